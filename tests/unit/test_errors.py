"""The error hierarchy: torch's family is defined at module level and named as before."""

from __future__ import annotations

import pickle

import pytest
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError, RendezvousStateError

from elastictrain import _torch_errors, errors


@pytest.mark.parametrize("name", errors._TORCH_FAMILY)
def test_each_torch_family_error_is_a_module_level_class_named_and_pickled_as_elastictrain_errors(name: str) -> None:
    cls = getattr(errors, name)
    assert vars(_torch_errors)[name] is cls  # where grep and an IDE find it
    assert name in errors.__all__
    assert (cls.__module__, cls.__qualname__) == ("elastictrain.errors", name)
    again = pickle.loads(pickle.dumps(cls("why")))  # noqa: S301 - bytes this test just made
    assert type(again) is cls and str(again) == "why"


def test_the_torch_family_keeps_its_bases() -> None:
    assert issubclass(errors.EtcdUnavailableError, (errors.EtcdError,))
    assert issubclass(errors.EtcdUnavailableError, RendezvousConnectionError)
    assert issubclass(errors.EtcdIndeterminateError, errors.EtcdUnavailableError)
    assert issubclass(errors.EtcdLeaseNotFoundError, errors.EtcdUnavailableError)
    assert issubclass(errors.EtcdAuthError, RendezvousConnectionError)
    assert issubclass(errors.CorruptRendezvousStateError, RendezvousStateError)
    assert issubclass(errors.CorruptRendezvousStateError, errors.RendezvousBackendError)
