"""The node agent of ``--recovery in-process`` (the default): workers keep their processes.

:class:`InProcessAgent` re-rendezvouses while its workers train, hands them the next
generation's assignment through the control channel (:mod:`elastictrain._control`), and
replaces only a worker that died, alone. A hung worker is killed so that its peers'
collectives fail at once. Only this node's own worker failures spend the failure budget
(``--max-restarts`` within ``--restart-window``). Between two checks of its workers it waits
for a change (see :meth:`~elastictrain.launch.worker_group.Channel.wait`), not a whole tick.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

from torch.distributed.elastic.agent.server.api import DEFAULT_ROLE, RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, start_processes
from torch.distributed.elastic.rendezvous import RendezvousClosedError
from torch.distributed.elastic.utils import macros

from elastictrain import _torch_compat
from elastictrain._control import Assignment, Progress, Section, WorkerState as SlotState, stacks_path
from elastictrain.errors import EtcdError
from elastictrain.events import NODE_ENV
from elastictrain._fault import Fault, node_label
from elastictrain.launch.agent import (
    ElasticAgent,
    failure_cause,
    failure_fields,
    final_failure,
    not_own_failure,
    own_fault,
    peer_faults,
    round_fault,
    tell_fault,
)
from elastictrain.launch.hang_detector import HangDetector, Stacks, capture_stacks
from elastictrain.launch.worker_group import Channel, FailureBudget, WorkerProcesses
from elastictrain.rendezvous.protocol import AgentRendezvousHandler, agent_handler
from elastictrain.rendezvous.reachability import is_cut_off
from elastictrain.rendezvous.records import describe_node

_LINGER = timedelta(seconds=30)
"""How long a node's workers may run after the job finished on its other nodes before it says so."""

_HOLD = timedelta(seconds=60)
"""How long the nodes of a job train on after a node joined the rendezvous, waiting for its
workers to be ready, before they re-form the group anyway."""

_ENDING_TICK = 0.01
"""The agent's first tick once a worker that said it is done still runs, doubled at each tick
up to the monitor interval: the worker hands its return value over when its script ends (torch's
process context keeps it until the agent reads it), and nothing rings for that. A script may
go on for a while after its session closed (an evaluation, a final save): the ticks get longer."""

_PROBE_AFTER = timedelta(seconds=2)
"""How long a worker waits in a step's collective before its agent asks whether this node still
reaches its peers (a peer merely slower, or hung and about to be replaced, answers the probe)."""

_PROBE_EVERY = timedelta(seconds=2)
"""How often the agent asks again while the wait lasts."""

_FORMING = frozenset({SlotState.STARTING, SlotState.RECOVERING, SlotState.BUSY})
"""Worker states that wait for peers to form a group (not training)."""

logger = logging.getLogger(__name__)

__all__ = ["InProcessAgent"]


def _said(stacks: Stacks | None) -> str:
    """A worker's innermost frames for a log line (where it was stuck)."""
    if stacks is None:
        return ""
    frames = stacks.main_thread()
    return "; its stack, innermost first:\n    " + "\n    ".join(frames) if frames else ""


@dataclass(frozen=True, slots=True)
class _Held:
    """A generation formed at the rendezvous whose publication waits for a joining node."""

    cause: str
    started: float
    """``time.monotonic()`` when the recovery began."""
    formed: float
    """When its rendezvous completed (the workers train on from then until it is published)."""


class InProcessAgent(ElasticAgent):
    """An agent whose workers survive faults and membership changes in their own processes.

    Args:
        channel: The control channel its workers were told of (``ELASTICTRAIN_CONTROL_DIR``).
        budget: This node's own worker failures the job survives.
        hangs: Decides which workers are hung.
        **kwargs: As :class:`ElasticAgent`.
    """

    def __init__(self, *, channel: Channel, budget: FailureBudget, hangs: HangDetector | None = None,
                 worker_logs: Callable[[int], DefaultLogsSpecs] | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._worker_logs = worker_logs
        self._channel = channel
        self._budget = budget
        self._hangs = hangs or HangDetector()
        self._start_method = kwargs.get("start_method", "spawn")
        self._log_root = kwargs["logs_specs"].root_log_dir
        self._logs: dict[int, DefaultLogsSpecs] = {}
        self._workers = WorkerProcesses(self._start_one)
        self._finished: set[int] = set()
        self._dead: dict[int, int] = {}
        """The pid of each dead worker awaiting its replacement, by local rank."""
        self._generation = 0
        self._replacements = 0
        self._finished_elsewhere_at: float | None = None
        self._lingering_said = False
        self._killed_hung: set[int] = set()
        self._held: _Held | None = None
        self._ready_round: int | None = None
        self._ending_tick: float | None = None
        self.recoveries = 0
        self._node = os.environ.get(NODE_ENV) or socket.gethostname()
        self._probed_at = 0.0

    @property
    def restarts(self) -> int:
        """This node's own worker failures within the budget's window."""
        return self._budget.used(time.monotonic())

    # --- processes: one torch process context per worker ------------------------------------

    def _start_one(self, local_rank: int) -> Any:
        """Start the worker of ``local_rank`` in a process context of its own.

        Its environment is the one torch's ``LocalElasticAgent._start_workers`` gives a
        worker; ``TORCHELASTIC_RESTART_COUNT`` counts this node's worker replacements.
        Its logs and error file go to ``<log dir>/local_rank_<n>/``, each start in an
        ``attempt_<k>`` of its own (torch's layout would put every single-worker
        context under ``0/``).
        """
        group = _torch_compat.worker_group(self)
        spec = group.spec
        worker = next(w for w in group.workers if w.local_rank == local_rank)
        env: dict[str, str | None] = {
            "RANK": str(worker.global_rank),
            "GROUP_RANK": str(group.group_rank),
            "ROLE_RANK": str(worker.role_rank),
            "ROLE_NAME": spec.role,
            "LOCAL_WORLD_SIZE": str(spec.local_world_size),
            "WORLD_SIZE": str(worker.world_size),
            "GROUP_WORLD_SIZE": str(group.group_world_size),
            "ROLE_WORLD_SIZE": str(worker.role_world_size),
            "MASTER_ADDR": group.master_addr,
            "MASTER_PORT": str(group.master_port),
            "TORCHELASTIC_RESTART_COUNT": str(self._replacements),
            "TORCHELASTIC_MAX_RESTARTS": str(spec.max_restarts),
            "TORCHELASTIC_RUN_ID": spec.rdzv_handler.get_run_id(),
            "TORCHELASTIC_USE_AGENT_STORE": str(spec.rdzv_handler.use_agent_store),
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.getenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
        }
        _torch_compat.set_local_rank_env(self, env, local_rank, spec)
        if "OMP_NUM_THREADS" in os.environ:
            env["OMP_NUM_THREADS"] = os.environ["OMP_NUM_THREADS"]
        if local_rank not in self._logs:
            self._logs[local_rank] = (self._worker_logs(local_rank) if self._worker_logs else DefaultLogsSpecs(
                log_dir=os.path.join(self._log_root, f"local_rank_{local_rank}")))
        assert spec.entrypoint is not None  # noqa: S101 - set by the launcher
        context = start_processes(
            name=f"{spec.role}{local_rank}", entrypoint=spec.entrypoint,
            args={0: tuple(macros.substitute(list(spec.args), str(local_rank)))}, envs={0: env},
            logs_specs=self._logs[local_rank], start_method=self._start_method,
            # What --tee shows on the terminal: [node rank], as untee'd worker output (see _worker_boot).
            log_line_prefixes={0: f"[{os.environ.get(NODE_ENV) or socket.gethostname()} {worker.global_rank}] "})
        _torch_compat.release_semaphore_names(context)  # none left behind if this agent is killed
        return context

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        self._publish_generation(worker_group, cause="start")
        self._finished.clear()
        return self._workers.start([w.local_rank for w in worker_group.workers])

    def _stop_workers(self, worker_group: WorkerGroup) -> None:
        self._workers.close()

    def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM, timeout: int = 30) -> None:
        if self._channel.assignment is not None:
            self._channel.publish(replace(self._channel.assignment, closed=True, cause="the agent stopped"))
        self._workers.close(death_sig, timeout)
        super()._shutdown(death_sig, timeout)

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        ended = self._workers.poll()
        by_local = {w.local_rank: w for w in worker_group.workers}
        failures = {}
        for local_rank, result in ended.items():
            self._workers.forget(local_rank)
            if result.is_failed():
                failure = result.failures[0]  # each context holds one worker
                failures[by_local[local_rank].global_rank] = failure
                self._dead[local_rank] = failure.pid
            else:
                self._finished.add(local_rank)
        if failures:
            self._events.emit("worker_failure", node_rank=worker_group.group_rank,
                              failures=failure_fields(failures, node_label(self._events.node, worker_group.group_rank)))
            return RunResult(state=WorkerState.FAILED, failures=failures)
        if len(self._finished) == len(worker_group.workers):
            return RunResult(state=WorkerState.SUCCEEDED,
                             return_values={by_local[lr].global_rank: None for lr in self._finished})
        return self._check_stop(worker_group) or RunResult(state=WorkerState.HEALTHY)

    def _trained(self, worker_group: WorkerGroup, failures: dict[int, Any]) -> bool:
        """Whether every failed worker (by global rank) had finished a step in its process, as
        its progress slot says: a fault that struck a training worker, not a crash loop."""
        progress = self._channel.progress()
        local_of = {w.global_rank: w.local_rank for w in worker_group.workers}
        slots = {rank: progress[local_of[rank]] for rank in failures if rank in local_of}
        return bool(failures) and all(
            rank in slots and slots[rank].pid == failure.pid and slots[rank].step_at > 0
            for rank, failure in failures.items())

    # --- the loop -------------------------------------------------------------------------------

    def _invoke_run(self, role: str = DEFAULT_ROLE) -> RunResult:
        group = _torch_compat.worker_group(self)
        spec = group.spec
        self._initialize_workers(group)
        handler = agent_handler(spec.rdzv_handler)
        handler.wake_on_change(self._channel.doorbell.ring)
        while True:
            # A tick, or sooner: a worker's slot changed, a worker ended, or the rendezvous changed.
            self._channel.wait(self._tick(spec.monitor_interval), self._workers.ends())
            result = self._monitor_workers(group)
            group.state = result.state
            if result.state == WorkerState.SUCCEEDED:
                self._exit_barrier()
                return result
            now = time.monotonic()
            cause = None
            fault: Fault | None = None
            if result.state in {WorkerState.FAILED, WorkerState.UNHEALTHY}:
                if final_failure(result.failures):
                    self._stop_workers(group)
                    group.state = WorkerState.FAILED
                    return result
                peer_caused = not_own_failure(group, result.failures)  # not this node's failure: no spending
                backoff = 0.0 if peer_caused else self._budget.spend(now, trained=self._trained(group, result.failures))
                if peer_caused:
                    logger.info("%s, because a peer's failure broke its collectives: not this node's own failure, "
                                "its restart budget is not spent", failure_cause(result.failures))
                if backoff is None:
                    logger.error("this node's workers failed %d times within %gs, more than --max-restarts %d "
                                 "allows: the job fails", self._budget.limit + 1, self._budget.window_s,
                                 self._budget.limit)
                    self._stop_workers(group)
                    group.state = WorkerState.FAILED
                    return result
                cause = failure_cause(result.failures)
                if not peer_caused:  # said in this node's request for a round: the others state it
                    fault = own_fault(result.failures, self._node, group.group_rank,
                                      hung=frozenset(self._killed_hung))
                    tell_fault(spec.rdzv_handler, fault)
                else:
                    said, fault = self._peers_cause("")
                    cause += f", after {said}" if said else ""
                if backoff:
                    logger.warning("%s: waiting %.0fs before replacing (failure %d of %d in the window)", cause,
                                   backoff, self._budget.used(now), self._budget.limit)
                    time.sleep(backoff)
            progress = self._channel.progress()
            live = self._workers.pids()
            self._kill_hung(group, progress, now, live)
            if cause is None:
                cause = self._leave_if_cut_off(handler, progress, now)
            self._say_if_lingering(handler, now)
            if (handler.closed_seen and not self._stop_requested()
                    and any(p.pid and p.state in _FORMING for p in progress)):
                # Another node ended the job (it finished, or its budget ran out) while ours
                # start or re-form and wait for peers that will not come: end now rather than
                # after the group's timeout.
                logger.info("the run was closed by another node while this node's workers formed a group: "
                            "stopping them")
                self._stop_workers(group)
                raise RendezvousClosedError()
            self._say_ready(group)
            if cause is None and any(p.state == SlotState.RECOVERING and p.generation == self._generation
                                     and p.pid for p in progress):
                cause, fault = self._peers_cause("a worker's collective failed (a peer is gone)")
            joins = False
            if cause is None:
                waiting = handler.num_nodes_waiting()
                if waiting > 0:
                    # Said as plainly as a loss is: a join when the nodes waiting only join.
                    joins = handler.only_nodes_joining()
                    cause, fault = self._peers_cause(
                        f"membership change: {waiting} node(s) joining" if joins
                        else f"membership change ({waiting} node(s) waiting, gone or re-joining)")
            held = self._held
            if held is not None and (cause is not None or self._joiners_ready(group, held, now)):
                # Only nodes joined unless something else happened meanwhile (a peer may be gone).
                self._publish_recovery(group, held.cause, held.started, held_since=held.formed, joined=cause is None)
            if cause is not None:
                self._recover(group, cause, joins=joins, fault=fault)

    def _peers_cause(self, seen: str) -> tuple[str, Fault | None]:
        """The cause of a re-formation this node did not start: what the other members said or
        were seen to meet (``rank 1 on node2 (node rank 1) was killed by SIGKILL``), the first of
        them as the fault its workers are told; ``seen`` (what this node saw) when none said."""
        faults = peer_faults(_torch_compat.worker_group(self).spec.rdzv_handler)
        if not faults:
            return seen, None
        return "; ".join(f.describe() for f in faults), faults[0]

    def _kill_hung(self, group: WorkerGroup, progress: list[Progress], now: float, live: dict[int, int]) -> None:
        """Kill each hung worker, once, after capturing its stacks (its replacement follows as for
        any dead worker), and warn once of each that runs long between two steps."""
        self._killed_hung &= set(live.values())  # a reaped one is no longer anybody's worker
        ranks = {w.local_rank: w.global_rank for w in group.workers}
        for slot in self._hangs.overdue(progress, now, live):
            p = progress[slot]
            stacks = capture_stacks(live[slot], stacks_path(self._channel.directory, slot))
            logger.warning("rank %s on %s has run its own code between steps %d and %d for %.0fs (no collective "
                           "of its peers waits for it yet; they will wait in the next one)%s", ranks.get(slot),
                           node_label(self._node, group.group_rank), p.step, p.step + 1, now - p.section_at,
                           _said(stacks))
            self._events.emit("slow_between_steps", rank=ranks.get(slot), local_rank=slot, pid=live[slot], step=p.step,
                              seconds=round(now - p.section_at, 3),
                              stack=stacks.main_thread() if stacks is not None else None)
        for slot in self._hangs.hung(progress, now, live):
            pid = live[slot]
            if pid in self._killed_hung:
                continue  # killed already; its end shows up once its process is reaped
            self._killed_hung.add(pid)
            p = progress[slot]
            written = p.pid == pid
            stacks = capture_stacks(pid, stacks_path(self._channel.directory, slot)) if written else None
            kept = self._keep_stacks(stacks, ranks.get(slot), pid)
            logger.warning("rank %s on %s (local worker %d, pid %d) is hung: %s: killing it%s%s", ranks.get(slot),
                           node_label(self._node, group.group_rank), slot, pid, self._hangs.reason(slot), _said(stacks),
                           f"\n    (every thread's stack: {kept})" if kept else "")
            self._events.emit("hang", rank=ranks.get(slot), local_rank=slot, pid=pid, node_rank=group.group_rank,
                              frozen_s=round(now - p.alive_at, 3) if written else None,
                              step=p.step if written else None, reason=self._hangs.reason(slot),
                              waited_s=round(now - p.section_at, 3) if written and p.section else None,
                              stack=stacks.main_thread() if stacks is not None else None, stacks_file=kept)
            self._workers.kill(slot)

    def _keep_stacks(self, stacks: Stacks | None, rank: int | None, pid: int) -> str | None:
        """Write ``stacks`` beside the node's logs; returns the file's path (None if nothing was kept)."""
        if stacks is None:
            return None
        path = os.path.join(self._log_root, f"stacks-rank{rank}-pid{pid}.txt")
        try:
            os.makedirs(self._log_root, exist_ok=True)
            with open(path, "w") as out:
                out.write(stacks.text)
        except OSError as exc:
            logger.warning("could not keep the stacks of pid %d in %s: %s", pid, path, exc)
            return None
        return path

    def _leave_if_cut_off(self, handler: AgentRendezvousHandler, progress: list[Progress], now: float) -> str | None:
        """When a worker has waited in a step's collective or a checkpoint save for :data:`_PROBE_AFTER`, ask (every
        :data:`_PROBE_EVERY` while it lasts) whether this node still reaches the other members of
        its round. If it is the one cut off (:func:`~elastictrain.rendezvous.reachability.is_cut_off`)
        while etcd hears from it, it leaves the round so that the others re-form without it at
        once, and rejoins once it reaches them; returns the cause of that re-formation."""
        since = [p.collective_at or (p.section_at if p.section == Section.SAVE else 0.0)  # a save waits for peers too
                 for p in progress if p.pid and p.state == SlotState.TRAINING]
        waiting = [now - at for at in since if at and now - at > _PROBE_AFTER.total_seconds()]
        if not waiting or now - self._probed_at < _PROBE_EVERY.total_seconds():
            return None
        self._probed_at = now
        try:
            reached = handler.peers_reached()
        except EtcdError as exc:
            logger.warning("could not read the round's members to probe them: %s", exc)
            return None
        if not is_cut_off(handler.node_id, reached):
            return None
        unreached = sorted(node for node, ok in reached.items() if not ok)
        named = ", ".join(map(describe_node, unreached))
        logger.warning("%s reaches %d of the %d other node(s) of its round (not %s) while etcd still hears from "
                       "it, and its workers have waited %.1fs in a collective: its link to its peers is cut. It leaves "
                       "the round, so that the others train on without it, and rejoins once it reaches them again",
                       node_label(self._node, _torch_compat.worker_group(self).group_rank),
                       len(reached) - len(unreached), len(reached), named, max(waiting))
        self._events.emit("cut_off", unreached=unreached, reached=len(reached) - len(unreached),
                          waited_s=round(max(waiting), 3))
        handler.withdraw()
        return f"this node cannot reach {len(unreached)} of its {len(reached)} peer(s): {named}"

    def _tick(self, interval: float) -> float:
        """How long the next wait for a change may last: ``interval``, or shorter while a worker
        said it is done and its process lives (see :data:`_ENDING_TICK`)."""
        live = set(self._workers.pids().values())
        if not any(p.state == SlotState.DONE and p.pid in live for p in self._channel.progress()):
            self._ending_tick = None
            return interval
        self._ending_tick = min(interval, 2 * self._ending_tick if self._ending_tick else _ENDING_TICK)
        return self._ending_tick

    def _say_if_lingering(self, handler: AgentRendezvousHandler, now: float) -> None:
        """Say once if this node's workers still run long after the job finished on other nodes:
        a final save on rank 0 takes a while, but a worker may also hang on its way out."""
        if not handler.finished_seen or self._lingering_said:
            return
        if self._finished_elsewhere_at is None:
            self._finished_elsewhere_at = now
        elif now - self._finished_elsewhere_at > _LINGER.total_seconds():
            self._lingering_said = True
            logger.warning("the job finished on its other nodes %.0fs ago and this node's workers (pids %s) still "
                           "run; one that hangs in destroy_process_group, or as its process group is torn down, may be "
                           "in a deadlock inside torch (the group's destructor waits, holding the interpreter, for a "
                           "gloo thread that needs it; pytorch#75097)",
                           now - self._finished_elsewhere_at, sorted(self._workers.pids().values()))

    def _in_process_capable(self, group: WorkerGroup) -> bool:
        """Whether this node's workers recover in place: every live one opened its control slot
        (a ``Session`` or ``run_elastic`` loop does; a plain script does not), and so did at
        least one worker, live or dead. A dead worker's slot keeps its pid: a node whose only
        worker was just killed recovers in place, as one with two workers does."""
        progress = self._channel.progress()
        live = self._workers.pids()
        opened = {local_rank for local_rank, pid in {**self._dead, **live}.items()
                  if progress[local_rank].pid == pid}
        return bool(opened) and set(live) <= opened

    def _say_ready(self, group: WorkerGroup) -> None:
        """Say once per round, in etcd, that this node's workers can form the round's group:
        they train (and stop at their next step when told), or they were started and wait for
        their peers. Nodes that train on while a node joins wait for every node to say it."""
        handler = agent_handler(group.spec.rdzv_handler)
        round_ = handler.round
        if round_ is None or round_ == self._ready_round:
            return
        if not self._in_process_capable(group):
            return
        try:
            handler.say_ready()
        except EtcdError as exc:  # the joining side then waits for its deadline: say so, go on
            logger.warning("could not say in etcd that this node's workers are ready: %s", exc)
        self._ready_round = round_

    def _joiners_ready(self, group: WorkerGroup, held: _Held, now: float) -> bool:
        """Whether every node of the round formed for a join said its workers are ready (or the
        wait for them is over)."""
        if now - held.formed > _HOLD.total_seconds():
            logger.warning("the joining node(s)' workers were not ready %.0fs after their rendezvous: re-forming "
                           "the group without waiting longer", _HOLD.total_seconds())
            return True
        try:
            ready = agent_handler(group.spec.rdzv_handler).ready_nodes()
        except EtcdError as exc:
            logger.warning("could not read which nodes are ready: %s", exc)
            return False
        return ready >= (group.group_world_size or 1)

    def _recover(self, group: WorkerGroup, cause: str, *, joins: bool = False, fault: Fault | None = None) -> None:
        """Re-form the group: re-rendezvous, then publish the next generation to the workers
        and replace the dead ones.

        When the only cause is a node that joins (``joins``) and every local worker lives,
        they train on through the rendezvous and until the joining nodes' workers are
        ready (see :meth:`_say_ready`): the generation is held and published later, so the
        workers stop only for the group's re-formation itself, not for a new node's start.
        """
        if self._dead:
            self._replacements += 1  # the workers started from now on see it as their restart count
        if not self._in_process_capable(group):
            # Plain scripts cannot re-form in place: restart every local worker (torch's way).
            logger.info("restarting this node's workers: %s", cause)
            self._events.emit("restart", reason=cause, restarts=self.restarts)
            self._publish(state="restarting", restarts=self.restarts)
            self._workers.close()
            self._dead = {}
            self._initialize_workers(group)
            return
        started = time.monotonic()
        hold = joins and not self._dead  # only our handler says a change is nodes joining
        if hold:
            agent_handler(group.spec.rdzv_handler).reenter_for_joiners()  # the other members hold the round too
        else:
            self._channel.mark_pending(cause)
        alive = {w.local_rank: w.id for w in group.workers if w.local_rank not in self._dead}
        self._rendezvous(group)
        for worker in group.workers:
            worker.id = alive.get(worker.local_rank)
        if hold:
            self._held = _Held(cause, started, time.monotonic())
            logger.info("round %s formed for a joining node: training on until its workers are ready",
                        agent_handler(group.spec.rdzv_handler).round)
            return
        if fault is None:  # a member may have said its cause as it asked for this round
            fault = round_fault(group.spec.rdzv_handler)
            cause += f": {fault.describe()}" if fault is not None else ""
        self._publish_recovery(group, cause, started, fault=fault)

    def _publish_recovery(self, group: WorkerGroup, cause: str, started: float, *,
                          held_since: float | None = None, joined: bool = False, fault: Fault | None = None) -> None:
        """Publish the next generation, start the dead workers' replacements, and report it.
        A generation held for a join since ``held_since`` is published as it was formed: a
        worker that died since is replaced by the recovery that follows."""
        self._held = None
        self._publish_generation(group, cause=cause, joined=joined, fault=fault)
        dead = sorted(self._dead) if held_since is None else []
        for local_rank in dead:
            del self._dead[local_rank]
        if dead:
            pids = self._workers.start(dead)
            for worker in group.workers:
                if worker.local_rank in pids:
                    worker.id = pids[worker.local_rank]
        self.recoveries += 1
        now = time.monotonic()
        trained_on = now - held_since if held_since is not None else 0.0
        duration = now - started - trained_on
        extra: dict[str, Any] = {"trained_on_s": round(trained_on, 3)} if held_since is not None else {}
        if fault is not None:
            extra["fault"] = fault.to_json()
        self._events.emit("recovery", cause=cause, generation=self._generation, duration_s=round(duration, 3),
                          replaced_local_ranks=dead, world_size=group.workers[0].world_size if group.workers else None,
                          node_rank=group.group_rank, **self._last_change, **extra)
        self._publish(state="running", generation=self._generation, last_recovery=cause,
                      restarts=self.restarts)
        logger.info("generation %d ready in %.3fs (%s%s)%s%s", self._generation, duration, cause,
                    self._last_change_said,
                    f"; replaced local worker(s) {dead}" if dead else "; every worker kept its process",
                    f"; the workers trained on for {trained_on:.3f}s until the joining node(s) were ready"
                    if held_since is not None else "")

    def _publish_generation(self, group: WorkerGroup, *, cause: str, joined: bool = False,
                            fault: Fault | None = None) -> None:
        self._generation += 1
        handler = agent_handler(group.spec.rdzv_handler)
        self._channel.publish(Assignment(
            generation=self._generation, round=handler.round or 0,
            world_size=group.workers[0].world_size if group.workers else 0,
            master_addr=group.master_addr or "", master_port=int(group.master_port or 0),
            ranks={str(w.local_rank): w.global_rank for w in group.workers},
            group_rank=group.group_rank or 0, group_world_size=group.group_world_size or 1, cause=cause, joined=joined,
            fault=fault.to_json() if fault is not None else {}))
