"""The faults a chaos run injects: one class per kind, which injects it and says when the job recovered.

The harness makes a :class:`Fault` for each fault of the schedule (:func:`fault_for`),
calls :meth:`Fault.inject` once the job has applied the fault's step (until it finds
its target), then :meth:`Fault.recovered` until the job trains again, or until
:meth:`Fault.bound` has passed (the run is hung). Each writes what it did and saw in
its :class:`~elastictrain.chaos.schedule.FaultRecord`, the report's entry.

Workers are found from the process tree (:mod:`~elastictrain.chaos.processes`), not from
the job's evidence.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar

from elastictrain.chaos.processes import process_state, worker_pids
from elastictrain.chaos.schedule import FaultKind, FaultRecord

if TYPE_CHECKING:
    from elastictrain.chaos.cluster import Node
    from elastictrain.chaos.harness import Harness

__all__ = ["BounceNode", "Fault", "HangWorker", "Join", "KillEtcd", "KillEtcdLeader", "KillNode", "KillWorker",
           "PartitionNode", "fault_for"]

_ETCD_SETTLE_S = 10.0
"""How long after an etcd outage ends the job is watched for its effects: heartbeats lapsed during
it are judged within about this (5 missed heartbeats and a rendezvous)."""


class Fault(ABC):
    """One fault of a run, of the kind :attr:`kind`.

    Args:
        record: What happened to it (filled in as it does).
        harness: The run: its configuration, cluster, nodes and the job's progress.
    """

    kind: ClassVar[FaultKind]

    def __init__(self, record: FaultRecord, harness: Harness) -> None:
        self.record = record
        self.harness = harness

    @abstractmethod
    def inject(self, now: float) -> bool:
        """Strike now: record the target, and ``ended`` (now, or when a later action undoes the
        fault). False if its target is not there yet: the harness tries again shortly."""

    def settled(self) -> bool:
        """Whether what the fault set off beside the job's recovery has played out. By default:
        a node it added to a full round says it waits as a spare, or trains, or has exited."""
        name = self.record.awaits_spare
        return not name or self.harness.node_settled(name)

    def recovered(self, *, final: bool = False) -> bool:
        """Whether the job trains again after the fault; sets the record's ``recovered`` and ``restarted``.

        Args:
            final: The run is over: judge with what there is.
        """
        record = self.record
        if record.ended is None or record.below_min:
            return False
        if not self.settled() and not final:
            return False
        if record.expects_restart:
            return self._group_trained_since(self._restart_after())
        # A node that was not training died, or a spare joined: training just goes on.
        progress = self.harness.progress
        first = next((s for s in progress.steps if s["t"] > self._injected), None)
        if first is None and not final:
            return False
        record.restarted = any(g["t"] > self._injected for g in progress.segments)
        record.recovered = first["t"] if first else None
        return True

    def bound(self) -> float:
        """Seconds the job may go without training after the fault before the run counts as hung."""
        config = self.harness.config
        bound = config.bound_for(self.kind)
        if self.record.below_min:  # the survivors wait out --join-timeout before they give up
            bound += config.join_timeout.total_seconds()
        return bound

    @property
    def _injected(self) -> float:
        if self.record.injected is None:
            raise RuntimeError(f"fault {self.record.index} has not been injected")
        return self.record.injected

    def _restart_after(self) -> float:
        """The fault ends the training group: the first group formed after this time trains."""
        return self._injected

    def _group_trained_since(self, since: float) -> bool:
        progress = self.harness.progress
        for seg in (s for s in progress.segments if s["t"] > since):
            first = progress.first_step_of(seg["seg"])
            if first is not None:
                self.record.recovered, self.record.restarted = first["t"], True
                return True
        return False

    def _start_joiner(self) -> tuple[str, bool]:
        """Start one more node with ``--join``; its name, and whether the round is full without it
        (it waits as a hot spare: the fault settles once it says so)."""
        harness = self.harness
        spare = len(harness.alive_nodes()) >= harness.config.max_nodes
        name = harness.start_node(join=True).name
        self.record.awaits_spare = name if spare else ""
        return name, spare


class _WorkerFault(Fault):
    """A fault of one worker process of a training node, chosen with the run's seed."""

    def _target_worker(self) -> int | None:
        """Pick a running worker of a training node and record it as the target; its pid (None: none yet)."""
        harness = self.harness
        training = harness.training_nodes()
        candidates = [(n, pid) for n in harness.alive_nodes() if n.name in training for pid in worker_pids(n.pid)
                      if process_state(pid) not in (None, "T", "Z")]
        if not candidates:
            return None
        node, pid = candidates[harness.planner.choice(range(len(candidates)))]
        self.record.target, self.record.target_pids = f"{node.name} worker pid {pid}", [pid]
        return pid


class KillWorker(_WorkerFault):
    """SIGKILL one worker process: its agent replaces it (restart mode: restarts the group)."""

    kind = FaultKind.KILL_WORKER

    def inject(self, now: float) -> bool:
        pid = self._target_worker()
        if pid is None:
            return False
        os.kill(pid, signal.SIGKILL)
        self.record.ended = now
        return True


class HangWorker(_WorkerFault):
    """SIGSTOP one worker for ``hang_duration`` (longer than the collective timeout: a hang, not a
    crash), then SIGCONT it (SIGKILL with ``hang_then_kill``). The hang is over sooner if the
    worker is killed while stopped: by its agent, which found it hung, or by a restart of its group."""

    kind = FaultKind.HANG_WORKER

    def inject(self, now: float) -> bool:
        pid = self._target_worker()
        if pid is None:
            return False
        os.kill(pid, signal.SIGSTOP)
        self.harness.stopped[pid] = now
        self._resume_later = self.harness.later(self.harness.config.hang_duration, self._resume)
        return True

    def _resume(self) -> None:
        pid = self.record.target_pids[0]
        self.harness.stopped.pop(pid, None)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL if self.harness.config.hang_then_kill else signal.SIGCONT)
        self.record.ended = time.time()

    def recovered(self, *, final: bool = False) -> bool:
        pid = self.record.target_pids[0]
        if self.record.ended is None and process_state(pid) in (None, "Z"):
            # Nothing is left to resume: the next fault need not wait out the rest of the hang.
            self.harness.cancel(self._resume_later)
            self.harness.stopped.pop(pid, None)
            self.record.ended = time.time()
            self.record.note = "killed while stopped, before it was to be resumed"
        return super().recovered(final=final)


class _NodeFault(Fault):
    """A fault of one node, preferably one that trains now, chosen with the run's seed."""

    def _pick_node(self) -> tuple[Node, bool] | None:
        """A node, and whether it trains."""
        harness = self.harness
        alive = harness.alive_nodes()
        training = [n for n in alive if n.name in harness.training_nodes()]
        pool = training or alive
        if not pool:
            return None
        return pool[harness.planner.choice(range(len(pool)))], bool(training)

    def _target(self, node: Node, training: bool) -> None:
        self.record.target = node.name if training else f"{node.name} (waiting to join: not training)"
        self.record.target_pids = worker_pids(node.pid)


class KillNode(_NodeFault):
    """SIGKILL one node agent; its workers die with it, and the node leaves for good."""

    kind = FaultKind.KILL_NODE

    def inject(self, now: float) -> bool:
        picked = self._pick_node()
        if picked is None:
            return False
        node, training = picked
        alive = len(self.harness.alive_nodes())
        self._target(node, training)
        # A node outside the training group leaves it untouched.
        self.record.expects_restart = training
        node.kill()
        self.record.ended = now
        # With no node coming back, the survivors wait out --join-timeout and give up.
        self.record.below_min = alive - 1 < self.harness.config.min_nodes
        return True


class BounceNode(_NodeFault):
    """:class:`KillNode`, then a replacement node joins ``rejoin_after`` later (at ``--min-nodes``
    the survivors wait below min-nodes meanwhile)."""

    kind = FaultKind.BOUNCE_NODE

    def inject(self, now: float) -> bool:
        picked = self._pick_node()
        if picked is None:
            return False
        node, training = picked
        self._target(node, training)
        # Even a node outside the training group brings a node that joins, and so a new group.
        self.record.expects_restart = True
        node.kill()
        self.harness.later(self.harness.config.rejoin_after, self._replace)
        return True

    def _replace(self) -> None:
        name, spare = self._start_joiner()
        self.record.target += f", replaced by {name}" + (" (the round is full: a spare)" if spare else "")
        self.record.ended = time.time()

    def _restart_after(self) -> float:
        # The group with the replacement in it trains; with a spare waiting, the group the spare
        # completed (the replacement then waits as a spare).
        if self.record.spare_waiting:
            return self._injected
        assert self.record.ended is not None  # noqa: S101 - recovered() checks it first
        return self.record.ended


class PartitionNode(_NodeFault):
    """(``netns`` only) Cut one node off etcd and its peers for ``partition_duration``, then
    reconnect it (:mod:`~elastictrain.chaos.netns`)."""

    kind = FaultKind.PARTITION_NODE

    def __init__(self, record: FaultRecord, harness: Harness) -> None:
        super().__init__(record, harness)
        self.node: Node | None = None

    def inject(self, now: float) -> bool:
        harness, record = self.harness, self.record
        network = harness.network
        if network is None:
            raise RuntimeError("partition_node needs netns (ChaosConfig refuses it without)")
        picked = self._pick_node()
        if picked is None:
            return False
        if len(harness.alive_nodes()) - 1 < harness.config.min_nodes:
            # Below min-nodes the survivors would wait for the cut node: not a partition the job
            # can ride out, so wait for a node to join (or give up after 60 s).
            record.note = "cutting a node would leave fewer than min-nodes"
            return False
        node, training = picked
        record.note = ""
        self._target(node, training)
        record.expects_restart = training
        index = harness.nodes.index(node)
        network.cut(index)
        node.partitioned = now
        self.node = node

        def heal() -> None:
            network.heal(index)
            record.ended = time.time()

        harness.later(harness.config.partition_duration, heal)
        return True

    def settled(self) -> bool:
        """Whether the node cut off has settled since the heal: trains again, waits as a spare (a
        spare took its place meanwhile), or has exited. Waiting for it keeps its rejoin (a new
        group) from landing on the next fault."""
        node, record, harness = self.node, self.record, self.harness
        assert node is not None and record.ended is not None  # noqa: S101 - recovered() checks it first
        if not node.alive():
            record.note = f"{node.name} exited {node.exit_code} after the heal"
            return True
        if node.name in harness.said_spare(since=record.ended):
            record.note = f"{node.name} waits as a spare after the heal"
            return True
        nodes_by_segment = harness.nodes_by_segment()
        for seg in (s for s in harness.progress.segments if s["t"] > record.ended):
            trained = harness.progress.first_step_of(seg["seg"]) is not None
            if trained and node.name in nodes_by_segment.get(seg["seg"], ()):
                record.note = f"{node.name} rejoined after the heal"
                return True
        return False


class Join(Fault):
    """Start one more node agent, with ``--join`` (into a full round: a hot spare)."""

    kind = FaultKind.JOIN

    def inject(self, now: float) -> bool:
        name, spare = self._start_joiner()
        self.record.target = name + (" (the round is full: it waits as a hot spare)" if spare else "")
        # A spare changes no group: the fault has settled once the node says it waits.
        self.record.expects_restart = not spare
        self.record.ended = now
        return True


class _EtcdFault(Fault):
    """A fault of the etcd cluster, which training itself need not notice."""

    def recovered(self, *, final: bool = False) -> bool:
        # Training needs no etcd within a round, but heartbeats may have lapsed while it was down.
        # Settle until a lapse would have been judged, then: did a new group form, and when did
        # training go on (in the new group if there was one)?
        record, progress = self.record, self.harness.progress
        if record.ended is None:
            return False
        settle = record.ended + _ETCD_SETTLE_S
        if time.time() < settle and not final:
            return False
        new = [s for s in progress.segments if self._injected < s["t"] <= settle]
        if new and progress.first_step_of(new[-1]["seg"]) is None and not final:
            return False  # a group formed because of the outage and has not trained yet
        record.restarted = bool(new)
        first = progress.first_step_of(new[-1]["seg"]) if new else next(
            (s for s in progress.steps if s["t"] > self._injected), None)
        record.recovered = first["t"] if first else None
        return True


class KillEtcd(_EtcdFault):
    """SIGKILL every etcd member, restart them ``etcd_down`` later."""

    kind = FaultKind.KILL_ETCD

    def inject(self, now: float) -> bool:
        etcd = self.harness.etcd
        self.record.target = f"all {len(etcd.servers)} etcd member(s)"
        for index in range(len(etcd.servers)):
            etcd.kill_member(index)

        def restart_all() -> None:
            etcd.start()
            self.record.ended = time.time()

        self.harness.later(self.harness.config.etcd_down, restart_all)
        return True


class KillEtcdLeader(_EtcdFault):
    """(3-member etcd) SIGKILL the leader, restart it ``etcd_down`` later."""

    kind = FaultKind.KILL_ETCD_LEADER

    def inject(self, now: float) -> bool:
        etcd = self.harness.etcd
        leader = etcd.leader()
        if leader is None:
            return False
        self.record.target = f"etcd leader m{leader}"
        etcd.kill_member(leader)

        def restart_leader() -> None:
            etcd.start_member(leader)
            self.record.ended = time.time()

        self.harness.later(self.harness.config.etcd_down, restart_leader)
        return True


_BY_KIND: dict[FaultKind, type[Fault]] = {cls.kind: cls for cls in (
    KillWorker, HangWorker, KillNode, BounceNode, PartitionNode, Join, KillEtcd, KillEtcdLeader)}


def fault_for(record: FaultRecord, harness: Harness) -> Fault:
    """The fault of ``record``'s kind."""
    return _BY_KIND[record.kind](record, harness)
