"""The faults a chaos run injects: one class per kind, which knows everything about its kind.

The harness makes a :class:`Fault` for each fault of the schedule (:func:`fault_for`),
calls :meth:`Fault.inject` once the job has applied the fault's step (until it finds
its target), then :meth:`Fault.recovered` until the job trains again, or until
:meth:`Fault.bound` has passed (the run is hung). Each writes what it did and saw in
its :class:`~elastictrain.chaos.schedule.FaultRecord`, the report's entry. What the
planner and the configuration ask of a kind is on its class too: whether it ends the
training group, when it is feasible, how long it lasts, what it needs. A new kind is a
class here and its name in :class:`~elastictrain.chaos.schedule.FaultKind`.

Workers are found from the process tree (:mod:`~elastictrain.chaos.processes`), not from
the job's evidence.
"""

from __future__ import annotations

import contextlib
import os
import signal
import tempfile
import time
from abc import ABC, abstractmethod
from datetime import timedelta
from typing import TYPE_CHECKING, ClassVar

from pathlib import Path

from elastictrain._control import CONTROL_PREFIX, SLOT_SIZE, ProgressTable, Section
from elastictrain.chaos.processes import process_state, worker_pids
from elastictrain.chaos.schedule import FaultKind, FaultRecord

if TYPE_CHECKING:
    from elastictrain.chaos.cluster import Node
    from elastictrain.chaos.config import ChaosConfig
    from elastictrain.chaos.harness import Harness
    from elastictrain.chaos.netns import NodeNetwork

__all__ = ["BounceNode", "DiskFull", "Fault", "HangSleep", "HangSpin", "HangWorker", "Join", "KillEtcd", "KillEtcdLeader",
           "KillInSave", "KillNode", "KillWorker", "LinkCut", "PartitionNode", "Straggler", "fault_class", "fault_for"]

_HANG_FOUND_S = 10.0
"""The shortest SIGSTOP hang :meth:`HangWorker.noticed_within` judges (finding one takes about 3 s: 2 s
of silence, 1 s to confirm, then the re-formation)."""

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

    restarts_workers: ClassVar[bool] = True
    """Whether the fault must end the current process group (recovery = a new one training)."""

    of_etcd: ClassVar[bool] = False
    """A fault of the etcd server, which training itself need not notice."""

    needs_netns: ClassVar[bool] = False
    """It needs each node in a network namespace of its own (``--netns``)."""

    etcd_members: ClassVar[int] = 1
    """The fewest etcd members it needs."""

    needs_checkpoint_disk: ClassVar[bool] = False
    """It needs the checkpoint directory on a filesystem of the run's own (``checkpoint_disk``)."""

    needs_in_process: ClassVar[bool] = False
    """It needs the nodes to recover in process (``recovery="in-process"``): it finds its target
    through the in-process agent's control channel, which a restarting agent does not open."""

    def __init__(self, record: FaultRecord, harness: Harness) -> None:
        self.record = record
        self.harness = harness

    @classmethod
    def feasible(cls, *, nodes: int, min_nodes: int, max_nodes: int, etcd_members: int) -> bool:
        """Whether a fault of this kind keeps the job able to finish now: never below min-nodes for
        good, never above ``max_nodes`` (the run's capacity: with hot spares, more than the job's
        ``--max-nodes``)."""
        return nodes >= 1 and etcd_members >= cls.etcd_members

    @classmethod
    def duration(cls, config: ChaosConfig) -> timedelta:
        """How long the fault itself lasts (a hang, an outage, a delay) before the job can recover."""
        return timedelta(0)

    @classmethod
    def noticed_within(cls, config: ChaosConfig) -> float | None:
        """Seconds within which the job must train again for the fault to count as noticed, not
        waited out (see :meth:`ChaosConfig.noticed_within
        <elastictrain.chaos.config.ChaosConfig.noticed_within>`); None: no such limit."""
        return None

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

    @classmethod
    def duration(cls, config: ChaosConfig) -> timedelta:
        """See base class."""
        return config.hang_duration

    @classmethod
    def noticed_within(cls, config: ChaosConfig) -> float | None:
        """See base class: under in-process recovery a hung worker's agent kills it, so the job
        trains again while the worker is still stopped, where a hang that went unnoticed trains
        again only once the worker is continued. Restart mode's peers wait out the collective
        timeout by design; a hang shorter than about 3 s may end before it is found."""
        if config.recovery != "in-process":
            return None
        hang = config.hang_duration.total_seconds()
        return hang if hang >= _HANG_FOUND_S else None

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


STRAGGLER_STEPS = 25
"""Steps a :class:`Straggler` slows down: a whole window of the straggler watch, whatever the phase."""


class _InLoopFault(_WorkerFault):
    """A fault placed inside a worker's training loop (:mod:`~elastictrain.train.injector`): the
    harness writes it to the run's injection file, and the worker it targets (by process id)
    meets it in the step after the one the job applied last. Nothing is signalled: the worker's
    process keeps running, as it does when a rank hangs or slows down on a real cluster."""

    spec: ClassVar[str]
    """The injector's kind and what follows the step (``x25+0.5``: for 25 steps, 0.5 s more)."""

    step = 0
    """The step the fault strikes in (once injected)."""

    def inject(self, now: float) -> bool:
        pid = self._target_worker()
        if pid is None:
            return False
        # The first step no worker may have started: past the job's newest step and past the gate (an
        # earlier fault may have opened it further); the gate then lets the job reach that step.
        harness = self.harness
        self.step = max(harness.progress.step, harness.gate) + 1
        kind, _, extra = self.spec.partition("@")
        harness.place_in_loop(f"{kind}@pid{pid}:{self.step}{extra}")
        harness.set_gate(self.step)
        self.record.ended = now
        return True


class HangSleep(_InLoopFault):
    """One worker blocks in a call inside its next step, for good (``time.sleep``: the interpreter
    lock released, process state ``S``): its agent must find it by its progress, kill it and
    replace it; its peers keep their processes."""

    kind = FaultKind.HANG_SLEEP
    spec = "hang_sleep@"

    @classmethod
    def noticed_within(cls, config: ChaosConfig) -> float | None:
        """See base class: without detection by progress the job trains again only after the
        collective timeout, if at all."""
        return config.pg_timeout.total_seconds() if config.recovery == "in-process" else None


class HangSpin(HangSleep):
    """One worker spins in Python inside its next step, for good (process state ``R``)."""

    kind = FaultKind.HANG_SPIN
    spec = "hang_spin@"


class Straggler(_InLoopFault):
    """One worker computes each of its next :data:`STRAGGLER_STEPS` steps 0.5 s slower, then
    catches up. Nothing may be replaced for it; the job names it (a ``straggler`` event from its
    rank) and trains on at its pace. The gate lets the job train through its slow steps."""

    kind = FaultKind.STRAGGLER
    spec = f"slow@x{STRAGGLER_STEPS}+0.5"
    restarts_workers = False

    def inject(self, now: float) -> bool:
        if not super().inject(now):
            return False
        self.harness.set_gate(self.step + STRAGGLER_STEPS)
        return True

    @classmethod
    def duration(cls, config: ChaosConfig) -> timedelta:
        """See base class."""
        return timedelta(seconds=0.5 * STRAGGLER_STEPS)

    def recovered(self, *, final: bool = False) -> bool:
        """See base class: the job trained on, and the straggler was named."""
        record = self.record
        named = [e for e in self.harness.agent_events("straggler") if e.get("ts", 0) > self._injected]
        if not named and not final:
            return False
        record.note = (f"named: rank {named[0].get('rank')} on {named[0].get('node')}, {named[0].get('factor')}x"
                       if named else "never named")
        if not named:
            return False
        return super().recovered(final=final)


class KillInSave(_WorkerFault):
    """SIGKILL one worker while it saves a checkpoint: the harness finds the worker's progress slot
    (its agent's control channel, from the worker's environment) and kills it the moment the slot
    says it is in a checkpoint save. Its peers, waiting for its files at the save's barrier, must
    notice at once, commit nothing, and re-form with its replacement; the committed checkpoints
    stay intact. The gate lets the job reach its next save."""

    kind = FaultKind.KILL_IN_SAVE
    needs_in_process = True

    def inject(self, now: float) -> bool:
        pid = self._target_worker()
        if pid is None:
            return False
        slot = _progress_slot(pid)
        if slot is None:
            self.record.note = "the worker has no control channel (not in-process recovery)"
            return False
        table, index = slot
        every = (self.harness.progress.config or {}).get("checkpoint_every") or 1
        self.harness.set_gate(self.harness.progress.step + every + 1)
        deadline = time.monotonic() + _SAVE_WAIT_S
        try:
            while time.monotonic() < deadline:
                if table.read(index).section == Section.SAVE:
                    os.kill(pid, signal.SIGKILL)
                    self.record.ended = time.time()
                    self.record.note = "killed inside a checkpoint save"
                    return True
                time.sleep(0.0005)
        except ProcessLookupError:
            pass
        finally:
            table.close()
        self.record.note = f"the worker was in no checkpoint save within {_SAVE_WAIT_S:g}s"
        return False


_SAVE_WAIT_S = 20.0
"""How long :class:`KillInSave` watches its target for a save before it tries again."""


def _progress_slot(pid: int) -> tuple[ProgressTable, int] | None:
    """The progress table of worker ``pid``'s agent and the worker's slot there: the slot that holds
    its pid, among the control channels of this machine's agents (a forked worker's ``/proc``
    environment is its forkserver's, so the channel is found by the pid its worker wrote)."""
    temp = Path(tempfile.gettempdir())
    # An agent's channel is in the temporary directory, or in its node's own directory there.
    for progress in [*temp.glob(f"{CONTROL_PREFIX}*/progress"), *temp.glob(f"*/{CONTROL_PREFIX}*/progress")]:
        try:
            slots = progress.stat().st_size // SLOT_SIZE
            table = ProgressTable(progress.parent, slots)
        except (OSError, ValueError):
            continue  # its agent removed it meanwhile
        found = next((slot for slot in range(slots) if table.read(slot).pid == pid), None)
        if found is not None:
            return table, found
        table.close()
    return None


class DiskFull(Fault):
    """Fill the checkpoint directory's filesystem (a tmpfs the harness mounted for the run,
    ``checkpoint_disk``) for :data:`DISK_FULL`, then free it: the saves meanwhile meet a real
    ENOSPC. Training must go on, each save that could not write is reported
    (``checkpoint_abandoned``), the committed checkpoints stay intact, and a save after the
    space is back commits. The gate lets the job train through it."""

    kind = FaultKind.DISK_FULL
    restarts_workers = False
    needs_checkpoint_disk = True

    @classmethod
    def duration(cls, config: ChaosConfig) -> timedelta:
        """See base class."""
        return DISK_FULL

    def inject(self, now: float) -> bool:
        harness = self.harness
        ballast = harness.checkpoint_dir / ".disk-full-ballast"
        with open(ballast, "wb") as out:
            chunk = b"\0" * (1 << 20)
            try:
                while True:
                    out.write(chunk)
                    out.flush()
            except OSError:
                pass  # full
        self.record.target = f"{harness.checkpoint_dir} full"
        every = (harness.progress.config or {}).get("checkpoint_every") or 1
        harness.set_gate(harness.progress.step + every + 2)

        def free() -> None:
            ballast.unlink(missing_ok=True)
            self.record.ended = time.time()

        harness.later(DISK_FULL, free)
        return True

    def recovered(self, *, final: bool = False) -> bool:
        """See base class: the job trained on past a save it could not write, then committed one."""
        record = self.record
        abandoned = [e for e in self.harness.agent_events("checkpoint_abandoned") if e.get("ts", 0) > self._injected]
        if record.ended is None or (not abandoned and not final):
            return False
        commits = [e for e in self.harness.agent_events("checkpoint_commit") if e.get("ts", 0) > record.ended]
        if not commits and not final:
            every = (self.harness.progress.config or {}).get("checkpoint_every") or 1
            self.harness.set_gate(self.harness.progress.step + every + 1)  # on to the next save
            return False
        record.note = (f"save of step {abandoned[0].get('step')} abandoned ({abandoned[0].get('reason', '')[:80]}); "
                       f"step {commits[0].get('step')} committed after the space came back"
                       if abandoned and commits else "no save was abandoned" if not abandoned else "no commit after")
        if not (abandoned and commits):
            return False
        return super().recovered(final=final)


DISK_FULL = timedelta(seconds=5)
"""How long :class:`DiskFull` keeps the checkpoint filesystem full."""


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

    @classmethod
    def feasible(cls, *, nodes: int, min_nodes: int, max_nodes: int, etcd_members: int) -> bool:
        """See base class."""
        return nodes > min_nodes

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

    @classmethod
    def duration(cls, config: ChaosConfig) -> timedelta:
        """See base class: the replacement's delay, and the survivors below min-nodes may wait for it."""
        return config.rejoin_after + config.join_timeout

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
    needs_netns = True

    @classmethod
    def feasible(cls, *, nodes: int, min_nodes: int, max_nodes: int, etcd_members: int) -> bool:
        """See base class."""
        return nodes > min_nodes

    @classmethod
    def duration(cls, config: ChaosConfig) -> timedelta:
        """See base class."""
        return config.partition_duration

    def __init__(self, record: FaultRecord, harness: Harness) -> None:
        super().__init__(record, harness)
        self.node: Node | None = None

    def inject(self, now: float) -> bool:
        harness, record = self.harness, self.record
        network = harness.network
        if network is None:
            raise RuntimeError(f"{self.kind.value} needs netns (ChaosConfig refuses it without)")
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
        self._cut(network, index)
        node.partitioned = now
        self.node = node

        def heal() -> None:
            network.heal(index)
            record.ended = time.time()

        harness.later(harness.config.partition_duration, heal)
        return True

    @staticmethod
    def _cut(network: NodeNetwork, index: int) -> None:
        network.cut(index)

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


class LinkCut(PartitionNode):
    """(``netns`` only) Cut one node off its peers, not off etcd, for ``partition_duration``, then
    reconnect it: a gray failure (its lease stays alive, its collectives never complete). The
    node that cannot reach its peers must leave the round within seconds, not after the
    collective timeout, and rejoin after the heal."""

    kind = FaultKind.LINK_CUT

    @staticmethod
    def _cut(network: NodeNetwork, index: int) -> None:
        network.cut_peers(index)

    @classmethod
    def noticed_within(cls, config: ChaosConfig) -> float | None:
        """See base class: waiting out the collective timeout is no answer to a cut link."""
        return config.pg_timeout.total_seconds() if config.recovery == "in-process" else None


class Join(Fault):
    """Start one more node agent, with ``--join`` (into a full round: a hot spare)."""

    kind = FaultKind.JOIN

    @classmethod
    def feasible(cls, *, nodes: int, min_nodes: int, max_nodes: int, etcd_members: int) -> bool:
        """See base class."""
        return nodes < max_nodes

    def inject(self, now: float) -> bool:
        name, spare = self._start_joiner()
        self.record.target = name + (" (the round is full: it waits as a hot spare)" if spare else "")
        # A spare changes no group: the fault has settled once the node says it waits.
        self.record.expects_restart = not spare
        self.record.ended = now
        return True


class _EtcdFault(Fault):
    """A fault of the etcd cluster, which training itself need not notice."""

    restarts_workers = False
    of_etcd = True

    @classmethod
    def duration(cls, config: ChaosConfig) -> timedelta:
        """See base class."""
        return config.etcd_down

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
    etcd_members = 3

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
    KillWorker, HangWorker, KillNode, BounceNode, PartitionNode, LinkCut, Join, KillEtcd, KillEtcdLeader, HangSleep,
    HangSpin, Straggler, KillInSave, DiskFull)}


def fault_class(kind: FaultKind) -> type[Fault]:
    """The class of faults of ``kind``."""
    return _BY_KIND[kind]


def fault_for(record: FaultRecord, harness: Harness) -> Fault:
    """The fault of ``record``'s kind."""
    return _BY_KIND[record.kind](record, harness)
