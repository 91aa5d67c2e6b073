"""Where a run lives in etcd: the run id rule and the one :class:`RunKeys` layout.

Everything elastictrain stores for run ``R`` lives under ``/elastictrain/R/``:

- ``lease``: the id of the run's shared lease (the keys below that outlive a
  node are attached to it, and expire a while after the last node is gone);
- ``rdzv/members/<node>``: one key per node agent, attached to that node's own
  liveness lease: it exists exactly as long as etcd hears from the node;
- ``rdzv/ctl/round``: the last round formed (its members in rank order);
- ``rdzv/ctl/closer``: the node that forms the next round (liveness lease);
- ``rdzv/ctl/closed``: present once the rendezvous is closed;
- ``rdzv/ctl/ready``: the last round whose nodes all said their workers are ready;
- ``rdzv/ready/<round>/<node>``: the node's workers can form that round's group now
  (on the node's liveness lease);
- ``store/<incarnation>/<round>/...``: the c10d store keys of one round;
- ``meta``, ``stop``, ``nodes/<node>``: what ``elastictrain status`` and ``stop`` read.

Two runs on one etcd never touch each other's keys. Every value is JSON with a
schema version (``elastictrain.rendezvous.records``): nothing read from etcd is
unpickled.
"""

from __future__ import annotations

from dataclasses import dataclass

from elastictrain.errors import ConfigError

__all__ = ["KEY_ROOT", "RunKeys", "validate_run_id"]

KEY_ROOT = "/elastictrain"

_RUN_ID_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")
_RUN_ID_MAX = 128


def validate_run_id(run_id: str) -> str:
    """Return ``run_id`` if it is safe as an etcd key segment.

    Raises:
        ConfigError: Empty, too long, or holding characters outside ``[A-Za-z0-9._-]``.
    """
    if not isinstance(run_id, str) or not run_id:
        raise ConfigError("run id must not be empty")
    if len(run_id) > _RUN_ID_MAX:
        raise ConfigError(f"run id {run_id[:20]!r}... is {len(run_id)} characters; at most {_RUN_ID_MAX}")
    bad = sorted(set(run_id) - _RUN_ID_CHARS)
    if bad or run_id in {".", ".."}:
        raise ConfigError(
            f"run id {run_id!r} may hold only letters, digits, '.', '_' and '-'"
            + (f" (found {''.join(bad)!r})" if bad else "")
        )
    return run_id


@dataclass(frozen=True, slots=True)
class RunKeys:
    """The etcd keys of one run. Build it with :meth:`of`, which validates the run id once."""

    run_id: str

    @classmethod
    def of(cls, run_id: str) -> RunKeys:
        """The keys of ``run_id``.

        Raises:
            ConfigError: The run id is not valid (see :func:`validate_run_id`).
        """
        return cls(validate_run_id(run_id))

    @property
    def prefix(self) -> str:
        """Every key of the run starts with this (it ends with ``/``)."""
        return f"{KEY_ROOT}/{self.run_id}/"

    @property
    def lease(self) -> str:
        return self.prefix + "lease"

    @property
    def meta(self) -> str:
        return self.prefix + "meta"

    @property
    def stop(self) -> str:
        return self.prefix + "stop"

    @property
    def records(self) -> str:
        """Prefix of the node status records (``nodes/<node id>``)."""
        return self.prefix + "nodes/"

    def record(self, node_id: str) -> str:
        return self.records + node_id

    @property
    def members(self) -> str:
        """Prefix of the membership keys (``rdzv/members/<node id>``)."""
        return self.prefix + "rdzv/members/"

    def member(self, node_id: str) -> str:
        return self.members + node_id

    @property
    def ctl(self) -> str:
        """Prefix of the round, closer, closed and all-ready keys: what every node watches."""
        return self.prefix + "rdzv/ctl/"

    @property
    def round(self) -> str:
        return self.ctl + "round"

    @property
    def closer(self) -> str:
        return self.ctl + "closer"

    @property
    def closed(self) -> str:
        return self.ctl + "closed"

    @property
    def all_ready(self) -> str:
        return self.ctl + "ready"

    def ready(self, round_: int) -> str:
        """Prefix of the nodes that said their workers can form ``round_``'s group now."""
        return f"{self.prefix}rdzv/ready/{round_}/"

    def store(self, incarnation: int, round_: int) -> str:
        """Prefix of the store keys of one round of one incarnation of the run."""
        return f"{self.prefix}store/{incarnation}/{round_}/"
