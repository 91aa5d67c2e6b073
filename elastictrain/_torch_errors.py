"""The errors that subclass torch's ``RendezvousError`` family, so that torch's agent handles them
unchanged.

Defining them imports torch, which ``elastictrain --help``, ``status`` and ``stop`` must not pay
for: :mod:`elastictrain.errors` re-exports them on first use (PEP 562). They are defined here, at
module level, where grep and an IDE find them; import them from :mod:`elastictrain.errors`, which
is the name they carry (``__module__``), in tracebacks and when pickled.
"""

from __future__ import annotations

from torch.distributed.elastic.rendezvous.api import (
    RendezvousConnectionError,
    RendezvousError,
    RendezvousStateError,
)

from elastictrain.errors import ElasticTrainError, EtcdError

__all__ = [
    "CorruptRendezvousStateError",
    "EtcdAuthError",
    "EtcdIndeterminateError",
    "EtcdLeaseNotFoundError",
    "EtcdUnavailableError",
    "RendezvousBackendError",
]


class EtcdUnavailableError(EtcdError, RendezvousConnectionError):
    """No etcd endpoint answered within the retry deadline (or etcd refused the request)."""


class EtcdIndeterminateError(EtcdUnavailableError):
    """A request's reply was lost: etcd may or may not have applied it (never retried blindly)."""


class EtcdLeaseNotFoundError(EtcdUnavailableError):
    """etcd does not know the lease a request named: it expired (etcd did not hear from its
    holders for its TTL) or was revoked.

    Raised by :meth:`elastictrain.etcd.client.EtcdClient.call` from the gRPC status code
    ``NOT_FOUND``, which etcd's KV, lease and transaction services answer only for a missing lease
    (``etcdserver: requested lease not found``; etcd's other ``NOT_FOUND``, a missing cluster
    member, belongs to the cluster API, which elastictrain does not call). A subclass of
    :class:`EtcdUnavailableError` because that is what it was raised as before it had a type of
    its own: whoever catches that still does.
    """


class EtcdAuthError(EtcdError, RendezvousConnectionError):
    """etcd refused our credentials or TLS setup; retrying would not help."""


class RendezvousBackendError(ElasticTrainError, RendezvousError):
    """Base for rendezvous failures that are ours rather than etcd's."""


class CorruptRendezvousStateError(RendezvousBackendError, RendezvousStateError):
    """The rendezvous key holds bytes that elastictrain did not write (see
    :class:`~elastictrain.errors.UnreadableRecordError`)."""


for _cls in (EtcdUnavailableError, EtcdIndeterminateError, EtcdLeaseNotFoundError, EtcdAuthError,
             RendezvousBackendError, CorruptRendezvousStateError):
    _cls.__module__ = "elastictrain.errors"  # importable (and picklable) as elastictrain.errors.<name>
del _cls
