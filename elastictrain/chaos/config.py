"""How a chaos run is set up: :class:`ChaosConfig` and its defaults.

Every duration is a ``timedelta`` (seconds are accepted and converted); bad
values raise :class:`~elastictrain.errors.ConfigError` naming them.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta

from elastictrain.chaos.schedule import FaultKind, PlannedFault
from elastictrain.chaos.netns import check_available
from elastictrain.launch.arguments import check_run_flags
from elastictrain.train.strategy import SHARDINGS
from elastictrain._durations import parse_duration
from elastictrain.errors import ConfigError

__all__ = ["DEFAULT_KINDS", "RECOVERS_IN_PROCESS", "ChaosConfig", "default_recovery", "demo_sharding_args", "kinds_for"]

DEFAULT_KINDS = (FaultKind.KILL_WORKER, FaultKind.KILL_NODE, FaultKind.BOUNCE_NODE, FaultKind.HANG_WORKER,
                 FaultKind.JOIN, FaultKind.KILL_ETCD, FaultKind.HANG_SLEEP, FaultKind.HANG_SPIN, FaultKind.STRAGGLER,
                 FaultKind.KILL_IN_SAVE)
"""Kinds a random run draws from (plus ``kill_etcd_leader`` with a 3-member etcd, ``partition_node`` and
``link_cut`` with netns, ``disk_full`` with a checkpoint disk)."""


RECOVERS_IN_PROCESS = frozenset({"ddp", "fsdp", "hsdp"})
"""The shardings whose runs default to in-process recovery: every one (the sharded soaks pass in
process, docs/sharding.md). ``recovery="restart"`` runs a job by restarts instead."""


def default_recovery(sharding: str) -> str:
    """The recovery of a run whose job trains with ``sharding``: in-process where it recovers in process."""
    return "in-process" if sharding in RECOVERS_IN_PROCESS else "restart"


DEMO_REDUNDANCY_EVERY = 1
"""The demo job's ``redundancy_every`` under fsdp in process (see :func:`demo_sharding_args`)."""


def demo_sharding_args(sharding: str, recovery: str, redundancy_every: int | None = DEMO_REDUNDANCY_EVERY,
                       ) -> tuple[str, ...]:
    """The demo job's arguments for ``sharding`` under ``recovery``: fsdp in process keeps a copy of
    each rank's shards on its buddy, refreshed every ``redundancy_every`` steps (None: no copies),
    so that a rank lost with its shards (before the first checkpoint too) is rebuilt from memory."""
    redundancy = (("--redundancy-every", str(redundancy_every))
                  if redundancy_every and sharding == "fsdp" and recovery == "in-process" else ())
    return ("--sharding", sharding, *redundancy)


def kinds_for(recovery: str, kinds: tuple[FaultKind, ...] = DEFAULT_KINDS) -> tuple[FaultKind, ...]:
    """``kinds`` less those that need in-process recovery, under ``recovery="restart"``."""
    return kinds if recovery == "in-process" else tuple(k for k in kinds if not k.fault_class.needs_in_process)



@dataclass(frozen=True, kw_only=True, slots=True)
class ChaosConfig:
    """One chaos run. Durations are ``timedelta`` (seconds are accepted)."""

    script: str
    """The training script every worker runs (it must use a :class:`~elastictrain.chaos.Recorder`)."""

    script_args: tuple[str, ...] = ()
    """Its arguments; ``{run_dir}`` is replaced by the run's directory (the reference run's for the reference)."""

    run_dir: str
    """Where everything of the run goes; created, must not hold an earlier run."""

    nodes: int = 3
    """Node agents started at the beginning; those above ``max_nodes`` wait as hot spares."""

    min_nodes: int = 2
    """``--min-nodes`` of the job."""

    max_nodes: int = 3
    """``--max-nodes`` of the job."""

    nproc_per_node: int = 1
    """Workers per node."""

    schedule: tuple[PlannedFault, ...] = ()
    """Faults to inject, in order. Used when ``faults`` is 0."""

    faults: int = 0
    """Draw this many faults at random from ``seed`` instead of a schedule."""

    seed: int = 0
    """Seeds the random faults and the choice of targets (which node, which worker)."""

    kinds: tuple[FaultKind, ...] = DEFAULT_KINDS
    """Kinds the random faults are drawn from."""

    gap: tuple[int, int] = (2, 5)
    """Steps of training between a recovery and the next random fault (inclusive range)."""

    etcd_members: int = 1
    """1, or 3 for a loopback cluster (needed by ``kill_etcd_leader``)."""

    etcd_down: timedelta = timedelta(seconds=3)
    """How long killed etcd members stay down."""

    hang: timedelta | None = None
    """How long ``hang_worker`` stops a worker; default: the collective timeout plus 5 s."""

    hang_then_kill: bool = False
    """End a hang with SIGKILL instead of SIGCONT."""

    netns: bool = False
    """Run each node in its own network namespace (root only; see :mod:`~elastictrain.chaos.netns`).
    Needed by ``partition_node``; without it every process talks over loopback."""

    partition: timedelta | None = None
    """How long ``partition_node`` keeps a node cut off; default: the collective timeout plus 10 s."""

    rejoin_after: timedelta = timedelta(seconds=3)
    """How long after ``bounce_node`` kills a node its replacement starts."""

    pg_timeout: timedelta = timedelta(seconds=20)
    """Collective timeout of the workers (``ELASTICTRAIN_PG_TIMEOUT``): how long a hang goes unnoticed."""

    join_timeout: timedelta = timedelta(seconds=60)
    """``--join-timeout``: how long survivors below min-nodes wait for nodes to return."""

    max_restarts: int = 1000
    """``--max-restarts`` of the nodes (their own worker failures; with ``recovery="restart"``,
    every fault that fails workers uses one on each surviving node)."""

    sharding: str = "ddp"
    """How the job trains its model: ``ddp``, ``fsdp`` or ``hsdp`` (``Session(sharding=...)``). The
    built-in demo job takes it as ``--sharding`` (the CLI passes it); a script of your own is
    told in its ``script_args``. It decides the recovery by default (see ``recovery``)."""

    recovery: str = ""
    """``--recovery`` of the nodes: ``in-process`` (survivors keep their processes) or ``restart``.
    ``""``: in-process for the shardings of :data:`RECOVERS_IN_PROCESS`, else restart."""

    recovery_bound: timedelta | None = None
    """Longest a fault may go without the job training again before the run counts as hung.
    Default: 120 s plus the collective timeout, the fault's own duration (hang, etcd
    outage, rejoin delay) and, for a bounce, the join timeout."""

    deadline: timedelta = timedelta(minutes=30)
    """The whole run is stopped (and counts as hung) after this long."""

    reference: bool = True
    """Run the uninterrupted reference (one process) for the final-parameters invariant."""

    atol: float = 1e-5
    """Absolute tolerance of the final-parameters comparison."""

    rtol: float = 1e-4
    """Relative tolerance of the final-parameters comparison."""

    checkpoint_disk_mb: int = 0
    """Mount a tmpfs of this many MB at ``{run_dir}/ckpt`` for the job's checkpoints (root), which
    ``disk_full`` fills; the job must keep its checkpoints there. 0: none."""

    checkpoint_dir: str = ""
    """Where the job keeps its checkpoints when not in the run directory: an ``s3://bucket/prefix``
    URL with no object under it yet (the harness, which reads the checkpoints, and the nodes take
    the endpoint and credentials from the ``AWS_*`` environment). The job's arguments name it
    ``{checkpoint_dir}``; the reference run gets ``<url>/reference``. Faults that fill a local
    filesystem (``disk_full``) cannot apply to it and are refused. ``""``: ``{run_dir}/ckpt``."""

    run_args: tuple[str, ...] = ()
    """Extra ``elastictrain run`` flags for every node."""

    env: Mapping[str, str] = field(default_factory=dict)
    """Extra environment of every node and of the reference run."""

    def __post_init__(self) -> None:
        if self.sharding not in SHARDINGS:
            raise ConfigError(f"sharding must be one of {', '.join(SHARDINGS)}, got {self.sharding!r}")
        if not self.recovery:
            object.__setattr__(self, "recovery", default_recovery(self.sharding))
        if self.recovery not in ("in-process", "restart"):
            raise ConfigError(f"recovery must be in-process or restart, got {self.recovery!r}")
        for name in ("etcd_down", "rejoin_after", "pg_timeout", "join_timeout", "deadline", "hang", "partition",
                     "recovery_bound"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, parse_duration(name, value, minimum=0.001))
        if not os.path.isfile(self.script):
            raise ConfigError(f"training script {self.script!r} is not a file")
        # The nodes run in the run directory: a path relative to here would not be found there.
        object.__setattr__(self, "script", os.path.abspath(self.script))
        if not 1 <= self.min_nodes <= self.max_nodes:
            raise ConfigError(f"need 1 <= min_nodes <= max_nodes, got {self.min_nodes}, {self.max_nodes}")
        if self.nodes < self.min_nodes:
            raise ConfigError(f"nodes must be at least min_nodes={self.min_nodes} (fewer could never form the job; "
                              f"those above max_nodes={self.max_nodes} wait as hot spares), got {self.nodes}")
        if self.seed < 0:
            raise ConfigError(f"seed must be >= 0 (a negative one replays its positive twin), got {self.seed}")
        for name in ("atol", "rtol"):
            if not math.isfinite(getattr(self, name)) or getattr(self, name) < 0:
                raise ConfigError(f"{name} must be a finite number >= 0, got {getattr(self, name)}")
        if self.etcd_members not in (1, 3):
            raise ConfigError(f"etcd_members must be 1 or 3, got {self.etcd_members}")
        kinds = {f.kind for f in self.schedule} | (set(self.kinds) if self.faults else set())
        for kind in sorted(kinds, key=lambda k: k.value):
            fault = kind.fault_class
            if self.etcd_members < fault.etcd_members:
                raise ConfigError(f"{kind.value} needs etcd_members={fault.etcd_members}")
            if fault.needs_netns and not self.netns:
                raise ConfigError(f"{kind.value} needs netns=True (--netns): nodes on loopback cannot be cut off")
            if fault.needs_checkpoint_disk and self.checkpoint_dir:
                raise ConfigError(f"{kind.value} fills a local filesystem; the checkpoints are in "
                                  f"{self.checkpoint_dir}, an object store with no disk of the run's own to fill: "
                                  "leave it out")
            if fault.needs_in_process and self.recovery != "in-process":
                raise ConfigError(f"{kind.value} needs in-process recovery (it finds its target through the "
                                  f"in-process agent's control channel); under {self.recovery} recovery"
                                  f"{f' (sharding={self.sharding})' if self.sharding != 'ddp' else ''} leave it out")
            if fault.needs_checkpoint_disk and not self.checkpoint_disk_mb:
                raise ConfigError(f"{kind.value} needs checkpoint_disk_mb (--checkpoint-disk-mb): a filesystem of the "
                                  "run's own to fill, never the host's")
        if self.checkpoint_dir:
            if not self.checkpoint_dir.startswith("s3://"):
                raise ConfigError("checkpoint_dir (--checkpoint-dir) must be an s3://bucket/prefix URL (a local one "
                                  f"is {{run_dir}}/ckpt), got {self.checkpoint_dir!r}")
            if self.checkpoint_disk_mb:
                raise ConfigError("checkpoint_disk_mb (--checkpoint-disk-mb) mounts a filesystem for the checkpoints; "
                                  f"they are in {self.checkpoint_dir}: give one or the other")
        if self.netns:
            check_available()
        if self.faults < 0:
            raise ConfigError(f"faults must be >= 0, got {self.faults}")
        # What every node gets from the user, in the harness's order: refused now, not as the nodes' failure.
        script = check_run_flags(["--nproc-per-node", str(self.nproc_per_node), *self.run_args, self.script])
        if script != self.script:
            raise ConfigError(f"run_args {list(self.run_args)}: {script!r} is no flag's value (each node would "
                              "take it for the training script)")

    @property
    def capacity(self) -> int:
        """Most node agents alive at once: ``max_nodes``, or ``nodes`` when the run starts with hot
        spares (random joins stop there; a join into a full round adds a spare)."""
        return max(self.nodes, self.max_nodes)

    @property
    def hang_duration(self) -> timedelta:
        return self.hang if self.hang is not None else self.pg_timeout + timedelta(seconds=5)

    def noticed_within(self, kind: FaultKind) -> float | None:
        """Seconds within which the job must train again after a fault of ``kind`` for the fault to
        count as noticed, not waited out (each kind says, see
        :meth:`~elastictrain.chaos.faults.Fault.noticed_within`); ``None``: no such limit."""
        return kind.fault_class.noticed_within(self)

    @property
    def partition_duration(self) -> timedelta:
        # Longer than the collective timeout, so that the survivors' collectives fail and they re-form
        # without the node before it comes back.
        return self.partition if self.partition is not None else self.pg_timeout + timedelta(seconds=10)

    def bound_for(self, kind: FaultKind) -> float:
        """Seconds a fault of ``kind`` may take before the run counts as hung."""
        if self.recovery_bound is not None:
            return self.recovery_bound.total_seconds()
        extra = kind.fault_class.duration(self)
        return 120.0 + self.pg_timeout.total_seconds() + extra.total_seconds()
