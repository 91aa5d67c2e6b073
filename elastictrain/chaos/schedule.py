"""Which faults a chaos run injects, and when: their kinds, schedules, the seeded planner, the record of each.

A schedule is a list of :class:`PlannedFault` (a kind and the training step
after which it fires), written ``kill_worker@4,kill_node@10,join@16``, or
drawn one at a time by a :class:`RandomPlanner` from a seed. Kinds (each is a
class of :mod:`~elastictrain.chaos.faults`, which injects it):

========================  ===================================================================
``kill_worker``           SIGKILL one worker process (its agent replaces it)
``kill_node``             SIGKILL one node agent; its workers die with it (the node leaves)
``bounce_node``           ``kill_node``, then a replacement node joins ``rejoin_after`` later
                          (at ``--min-nodes`` the survivors wait below min-nodes meanwhile)
``hang_worker``           SIGSTOP one worker for ``hang`` (longer than the collective
                          timeout: a hang, not a crash), then SIGCONT it (or SIGKILL)
``join``                  start one more node agent, with ``--join`` (into a full round: a hot spare)
``kill_etcd``             SIGKILL every etcd member, restart them ``etcd_down`` later
``kill_etcd_leader``      (3-member etcd) SIGKILL the leader, restart it ``etcd_down`` later
``partition_node``        (``netns`` only) cut one node off etcd and its peers for
                          ``partition_duration``, then reconnect it (:mod:`~elastictrain.chaos.netns`)
``link_cut``              (``netns`` only) cut one node off its peers but not off etcd for
                          ``partition_duration``, then reconnect it (a gray failure)
``hang_sleep``            one worker blocks in a call inside its next step, for good (from inside
                          its training loop: its process keeps running, as real hangs do)
``hang_spin``             one worker spins in Python inside its next step, for good
``straggler``             one worker computes each of its next 25 steps 0.5 s slower, then catches up
``kill_in_save``          SIGKILL one worker the moment it saves a checkpoint
``disk_full``             (``checkpoint_disk`` only) fill the checkpoint filesystem for 5 s, then free it
========================  ===================================================================

Everything else a kind knows (whether it ends the training group, when it is feasible, how
long it lasts, whether it needs netns) lives on its class.
"""

from __future__ import annotations

import enum
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from elastictrain.errors import ConfigError

if TYPE_CHECKING:
    from elastictrain.chaos.faults import Fault

__all__ = ["FaultKind", "FaultRecord", "PlannedFault", "RandomPlanner", "parse_kinds", "parse_schedule"]


class FaultKind(str, enum.Enum):
    """What a fault does; see the module docstring."""

    KILL_WORKER = "kill_worker"
    KILL_NODE = "kill_node"
    BOUNCE_NODE = "bounce_node"
    HANG_WORKER = "hang_worker"
    JOIN = "join"
    KILL_ETCD = "kill_etcd"
    KILL_ETCD_LEADER = "kill_etcd_leader"
    PARTITION_NODE = "partition_node"
    LINK_CUT = "link_cut"
    HANG_SLEEP = "hang_sleep"
    HANG_SPIN = "hang_spin"
    STRAGGLER = "straggler"
    KILL_IN_SAVE = "kill_in_save"
    DISK_FULL = "disk_full"

    @property
    def restarts_workers(self) -> bool:
        """True if the fault must end the current process group (recovery = a new one training)."""
        return self.fault_class.restarts_workers

    @property
    def fault_class(self) -> type[Fault]:
        """The class that knows everything about this kind (:mod:`~elastictrain.chaos.faults`)."""
        from elastictrain.chaos.faults import fault_class

        return fault_class(self)


@dataclass(frozen=True, slots=True)
class PlannedFault:
    """One fault of a schedule."""

    kind: FaultKind
    """What to inject."""

    at_step: int
    """Inject once the job has applied this step (and recovered from the previous fault)."""

    def __str__(self) -> str:
        return f"{self.kind.value}@{self.at_step}"


_ITEM = re.compile(r"^\s*([a-z_]+)\s*@\s*(\d+)\s*$")


def parse_schedule(text: str) -> list[PlannedFault]:
    """Parse ``kind@step[,kind@step...]``; faults fire in the order given.

    Raises:
        ConfigError: An unknown kind or a malformed item.
    """
    faults = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        match = _ITEM.match(item)
        if not match:
            raise ConfigError(f"schedule item {item!r} is not KIND@STEP (e.g. kill_worker@4)")
        try:
            kind = FaultKind(match.group(1))
        except ValueError:
            kinds = ", ".join(k.value for k in FaultKind)
            raise ConfigError(f"unknown fault kind {match.group(1)!r}; expected one of {kinds}") from None
        faults.append(PlannedFault(kind, int(match.group(2))))
    return faults


def parse_kinds(text: str) -> tuple[FaultKind, ...]:
    """Parse a comma-separated list of fault kinds.

    Raises:
        ConfigError: An unknown kind, or none.
    """
    try:
        kinds = tuple(FaultKind(k.strip()) for k in text.split(",") if k.strip())
    except ValueError as exc:
        raise ConfigError(f"{exc}; expected kinds among {', '.join(k.value for k in FaultKind)}") from None
    if not kinds:
        raise ConfigError("no fault kinds given")
    return kinds


class RandomPlanner:
    """Draws the next fault from a seed, among the kinds that fit the cluster's state now.

    The draw depends only on the seed and on the harness's own actions (how
    many nodes it has killed and started), so a seed replays the same fault
    sequence: a failure found by a soak can be reproduced.

    Args:
        seed: The seed.
        kinds: The kinds to draw from.
        gap: Inclusive range of steps of training between one recovery and the next fault.
    """

    def __init__(self, seed: int, kinds: Sequence[FaultKind], gap: tuple[int, int] = (2, 5)) -> None:
        if gap[0] < 1 or gap[1] < gap[0]:
            raise ConfigError(f"gap must be 1 <= low <= high, got {gap}")
        self._rng = random.Random(seed)
        self.kinds = tuple(kinds)
        self.gap = gap

    def feasible(self, kind: FaultKind, *, nodes: int, min_nodes: int, max_nodes: int,
                 etcd_members: int) -> bool:
        """Whether ``kind`` keeps the job able to finish (see :meth:`Fault.feasible
        <elastictrain.chaos.faults.Fault.feasible>`)."""
        return kind.fault_class.feasible(nodes=nodes, min_nodes=min_nodes, max_nodes=max_nodes,
                                         etcd_members=etcd_members)

    def next(self, after_step: int, *, nodes: int, min_nodes: int, max_nodes: int,
             etcd_members: int) -> PlannedFault | None:
        """The next fault, ``gap`` steps after ``after_step``; None if no kind fits."""
        options = [k for k in self.kinds if self.feasible(k, nodes=nodes, min_nodes=min_nodes,
                                                          max_nodes=max_nodes, etcd_members=etcd_members)]
        if not options:
            return None
        kind = self._rng.choice(options)
        return PlannedFault(kind, after_step + self._rng.randint(*self.gap))

    def choice(self, items: Sequence[int]) -> int:
        """A seeded pick (which node, which worker)."""
        return self._rng.choice(list(items))


@dataclass
class FaultRecord:
    """A fault as it happened; times are ``time.time()``."""

    index: int
    kind: FaultKind
    at_step: int
    injected: float | None = None
    target: str = ""
    ended: float | None = None
    """When its delayed part ran (SIGCONT, etcd restart, replacement start); = injected if none."""
    recovered: float | None = None
    """When the job had trained again (see ``recovery_s`` in the report)."""
    restarted: bool | None = None
    step_before: int | None = None
    note: str = ""
    hung: bool = False
    expects_restart: bool = True
    """The fault must end the training process group (False for etcd, or a node that was not training)."""
    below_min: bool = False
    """It left fewer than min-nodes for good: the job is expected to give up, not to recover."""
    target_pids: list[int] = field(default_factory=list)
    """The worker processes the fault touched (killed, stopped, cut off); every other worker of
    the group keeps its process under in-process recovery."""
    spare_waiting: bool = False
    """A hot spare waited when the fault struck: the group formed after it keeps its world size."""
    awaits_spare: str = ""
    """A node that this fault adds to a full round (a join, a bounce's replacement): the fault has
    settled once that node says it waits as a spare, or trains."""

    @property
    def recovery_s(self) -> float | None:
        """Seconds from the injection until the job trained again, once it has."""
        return None if self.recovered is None or self.injected is None else self.recovered - self.injected

    def to_json(self, start: float) -> dict[str, Any]:
        def rel(t: float | None) -> float | None:
            return None if t is None else round(t - start, 3)

        return {"index": self.index, "kind": self.kind.value, "at_step": self.at_step, "target": self.target,
                "step_before": self.step_before, "injected_s": rel(self.injected), "ended_s": rel(self.ended),
                "recovered_s": rel(self.recovered),
                "recovery_s": None if self.recovery_s is None else round(self.recovery_s, 3),
                "restarted": self.restarted, "hung": self.hung, "note": self.note,
                "spare_waiting": self.spare_waiting,
                "target_pids": list(self.target_pids)}
