"""The ``ElasticTrainError`` hierarchy: the only home of elastictrain's exception types (those that
subclass torch's are defined in :mod:`elastictrain._torch_errors` and re-exported here).

Every error a user can cause or meet (bad input, an unreachable etcd, a corrupt
checkpoint) is one of these, so the CLI can print a single line for it instead
of a traceback. Rendezvous errors also subclass torch's ``RendezvousError``
family, so torch's elastic agent handles them unchanged.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = [
    "ElasticTrainError",
    "ConfigError",
    "DependencyError",
    "TorchCompatError",
    "EtcdError",
    "EtcdUnavailableError",
    "EtcdIndeterminateError",
    "EtcdLeaseNotFoundError",
    "EtcdAuthError",
    "EtcdServerError",
    "RendezvousBackendError",
    "CorruptRendezvousStateError",
    "UnreadableRecordError",
    "RunIdInUseError",
    "CheckpointError",
    "CheckpointDirectoryError",
    "CheckpointWriteError",
    "CorruptCheckpointError",
    "NoCheckpointError",
    "CheckpointMismatchError",
    "NonFiniteStateError",
    "SessionError",
]


class ElasticTrainError(Exception):
    """Base of every error elastictrain raises on purpose.

    ``str(error)`` is a complete one-line explanation meant for the user.
    """


class ConfigError(ElasticTrainError, ValueError):
    """A flag, environment variable or API argument has a value we refuse."""


class DependencyError(ElasticTrainError, ImportError):
    """A dependency is missing or cannot be imported (e.g. etcd3 under protobuf 4)."""


class TorchCompatError(DependencyError):
    """The installed torch lacks a private name elastictrain relies on (``elastictrain._torch_compat``
    checks them at import)."""


class EtcdError(ElasticTrainError):
    """Talking to etcd failed."""


class EtcdServerError(ElasticTrainError):
    """The embedded etcd server could not be found, started or stopped."""


class UnreadableRecordError(ElasticTrainError, ValueError):
    """An etcd key holds bytes that elastictrain did not write (a foreign key, or another
    version's record). What reads run state without a rendezvous (``status``) meets it as it is,
    without importing torch; the rendezvous reports it to torch's agent as a
    :class:`CorruptRendezvousStateError`."""


class RunIdInUseError(ElasticTrainError):
    """A run id is already live on this etcd and the caller did not ask to join it."""


class CheckpointError(ElasticTrainError):
    """Saving or restoring a checkpoint failed."""


class CheckpointDirectoryError(CheckpointError):
    """The checkpoint directory cannot serve the job, found when a manager opens it: it cannot be
    created or written (read-only), or some rank does not see it (not on a filesystem shared by
    all ranks). A restart would meet it again: the job fails at once."""


class CheckpointWriteError(CheckpointError):
    """A save could not write its files: the storage failed (a full disk, an I/O error) or blocked
    past the save timeout. Nothing was committed; the checkpoints committed before are intact, and
    a later save may succeed (``Session`` reports it and trains on)."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint's manifest or checksums do not verify."""


class NoCheckpointError(CheckpointError):
    """No committed checkpoint exists where one was required."""


class CheckpointMismatchError(CheckpointError):
    """A checkpoint does not fit the model/optimizer it is loaded into."""


class NonFiniteStateError(CheckpointError):
    """A model parameter to be checkpointed holds NaN or infinity (training diverged): the step
    is not committed, so that it cannot push the good checkpoints out."""


class SessionError(ElasticTrainError, RuntimeError):
    """A training session was driven out of order (e.g. a step left with micro-batches untrained)."""


# The errors of the rendezvous subclass torch's RendezvousError family (torch's agent handles
# them unchanged), so defining them imports torch. They are defined in elastictrain._torch_errors and
# imported from there on first use (PEP 562): `elastictrain --help`, `status` and `stop` never need
# torch unless such an error is raised.
_TORCH_FAMILY = ("EtcdUnavailableError", "EtcdIndeterminateError", "EtcdLeaseNotFoundError", "EtcdAuthError",
                 "RendezvousBackendError", "CorruptRendezvousStateError")

if TYPE_CHECKING:
    from elastictrain._torch_errors import (
        CorruptRendezvousStateError,
        EtcdAuthError,
        EtcdIndeterminateError,
        EtcdLeaseNotFoundError,
        EtcdUnavailableError,
        RendezvousBackendError,
    )


def __getattr__(name: str) -> Any:
    if name in _TORCH_FAMILY:
        from elastictrain import _torch_errors

        value = getattr(_torch_errors, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'elastictrain.errors' has no attribute {name!r}")
