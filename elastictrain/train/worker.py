"""Who this worker is: :class:`WorkerContext`, read from the launcher's environment.

``elastictrain run`` and stock ``torchrun`` give each worker torch's usual
variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
``GROUP_RANK``, ``TORCHELASTIC_RESTART_COUNT``, ``TORCHELASTIC_RUN_ID``,
``MASTER_ADDR``, ``MASTER_PORT``). Each restart is a fresh process with fresh
values, so the context is read once and never changes. A script started with
plain ``python`` (no variables) is rank 0 of a world of 1.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from elastictrain.errors import ConfigError

__all__ = ["STANDALONE_RUN_ID", "WorkerContext"]

STANDALONE_RUN_ID = "standalone"
"""``run_id`` of a process started without a launcher."""


def _int(env: Mapping[str, str], name: str, default: int, minimum: int) -> int:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw.strip())
    except ValueError:
        raise ConfigError(f"environment variable {name}={raw!r} is not an integer") from None
    if value < minimum:
        raise ConfigError(f"environment variable {name}={raw!r} must be at least {minimum}")
    return value


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkerContext:
    """This worker's place in the job, as the launcher described it.

    Build it with :meth:`from_env`; the defaults describe a single process.
    """

    rank: int = 0
    """Global rank, in ``[0, world_size)``."""

    world_size: int = 1
    """Number of workers in this round."""

    local_rank: int = 0
    """Rank among the workers of this node; picks the GPU."""

    local_world_size: int = 1
    """Workers on this node."""

    node_rank: int = 0
    """This node's rank among the nodes of this round (``GROUP_RANK``)."""

    restart_count: int = 0
    """How many times the agent restarted the worker group after a failure.

    A membership change (a node joining) restarts workers without counting.
    """

    run_id: str = STANDALONE_RUN_ID
    """The job's name (``TORCHELASTIC_RUN_ID``), or ``"standalone"``."""

    master_addr: str | None = None
    """Host of this round's rendezvous store; ``None`` without a launcher."""

    master_port: int | None = None
    """Port of this round's rendezvous store; ``None`` without a launcher."""

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(f"rank {self.rank} is outside world size {self.world_size}")
        if not 0 <= self.local_rank < self.local_world_size:
            raise ConfigError(f"local rank {self.local_rank} is outside local world size {self.local_world_size}")

    @property
    def launched(self) -> bool:
        """True when a launcher set up a rendezvous store (``MASTER_ADDR``/``MASTER_PORT``).

        Only then can a process group be formed from the environment.
        """
        return self.master_addr is not None and self.master_port is not None

    @property
    def is_rank_zero(self) -> bool:
        """True on global rank 0, the rank that logs and acts for the job."""
        return self.rank == 0

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> WorkerContext:
        """Read the context from ``env`` (default ``os.environ``).

        Missing variables take the single-process defaults. ``MASTER_ADDR`` and
        ``MASTER_PORT`` come as a pair, and a world of more than one needs them.

        Raises:
            ConfigError: A variable is not an integer, out of range, or
                ``WORLD_SIZE > 1`` without ``MASTER_ADDR``/``MASTER_PORT``.
        """
        env = os.environ if env is None else env
        world_size = _int(env, "WORLD_SIZE", 1, 1)
        addr = env.get("MASTER_ADDR") or None
        port = _int(env, "MASTER_PORT", 0, 1) if env.get("MASTER_PORT") else None
        if (addr is None) != (port is None):
            raise ConfigError("MASTER_ADDR and MASTER_PORT must be set together")
        if world_size > 1 and addr is None:
            raise ConfigError(f"WORLD_SIZE={world_size} but MASTER_ADDR/MASTER_PORT are not set; "
                              "start the script with `elastictrain run` or torchrun")
        local_world_size = _int(env, "LOCAL_WORLD_SIZE", 1, 1)
        return cls(
            rank=_int(env, "RANK", 0, 0),
            world_size=world_size,
            local_rank=_int(env, "LOCAL_RANK", 0, 0),
            local_world_size=local_world_size,
            node_rank=_int(env, "GROUP_RANK", 0, 0),
            restart_count=_int(env, "TORCHELASTIC_RESTART_COUNT", 0, 0),
            run_id=env.get("TORCHELASTIC_RUN_ID") or STANDALONE_RUN_ID,
            master_addr=addr,
            master_port=port,
        )
