"""The node agent of ``--recovery restart``: torch's ``LocalElasticAgent`` on the etcd3 rendezvous.

:class:`ElasticAgent` keeps torch's behaviour: any fault or membership change stops every
worker of the node and starts them again; they resume from the last checkpoint. It reports
what happens to its node (events, ``status``). The default agent,
:class:`~elastictrain.launch.inprocess_agent.InProcessAgent`, extends it.

Both override torch's agent extension points listed (and checked against the
installed torch) in :mod:`elastictrain._torch_compat`.
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable
from typing import Any

from torch.distributed.elastic.agent.server.api import RunResult, Worker, WorkerGroup, WorkerSpec, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

from elastictrain import _torch_compat
from elastictrain._fault import Fault, node_label
from elastictrain.errors import ElasticTrainError, EtcdError
from elastictrain.events import EventLog
from elastictrain.launch import failure_report
from elastictrain.launch.run_state import RunPublisher
from elastictrain.launch.worker_group import continue_stopped, exited_cleanly, finished_without_a_word
from elastictrain.rendezvous.handler import Etcd3RendezvousHandler
from elastictrain.rendezvous.protocol import agent_handler
from elastictrain.rendezvous.records import describe_node

logger = logging.getLogger(__name__)

__all__ = ["ElasticAgent", "describe_change", "failure_cause", "failure_fields", "final_failure", "not_own_failure",
           "own_fault", "peer_faults", "round_fault", "tell_fault"]


def own_fault(failures: dict[int, Any], node: str, node_rank: int | None, *, hung: frozenset[int] = frozenset()
              ) -> Fault | None:
    """The fault this node saw among its failed workers (torch's ``ProcessFailure`` records by
    global rank): the root cause (:func:`failure_report.root_cause`), how it ended (a worker whose
    pid is in ``hung`` was killed by its agent as hung), on node ``node`` of node rank
    ``node_rank``. What its next request for a round tells the other nodes."""
    found = [failure_report.from_process_failure(rank, f, node) for rank, f in failures.items()]
    root = failure_report.root_cause(found)
    if root is None:
        return None
    how = f"hung and was killed by its agent ({root.signal})" if root.pid in hung and root.signal else root.how()
    return Fault(rank=root.rank, node=node, node_rank=node_rank, how=how)


def tell_fault(handler: Any, fault: Fault | None) -> None:
    """Have this node's next request for a round state ``fault``."""
    if fault is not None and fault.rank is not None:
        agent_handler(handler).say_fault(fault.rank, fault.how)


def peer_faults(handler: Any) -> list[Fault]:
    """The faults the other members of this node's round said or were seen to meet (see
    :meth:`Etcd3RendezvousHandler.seen_faults`)."""
    return agent_handler(handler).seen_faults()


def round_fault(handler: Any) -> Fault | None:
    """The first worker failure a member said as it asked for the round just formed (an etcd
    error leaves the cause as this node saw it, with a warning)."""
    try:
        return next(iter(agent_handler(handler).round_faults()), None)
    except EtcdError as exc:
        logger.warning("could not read what the round's members said of its cause: %s", exc)
        return None


def failure_cause(failures: dict[int, Any]) -> str:
    """What a recovery says of its failed workers, by global rank: ``worker(s) 1 failed (1: pid 42,
    killed by SIGKILL)`` (the ``worker(s)`` start is the metrics label's key)."""
    how = "; ".join(f"{rank}: pid {f.pid}, " + (f"killed by {f.signal_name()}" if f.exitcode < 0
                                                else f"exit code {f.exitcode}")
                    for rank, f in sorted(failures.items()))
    return f"worker(s) {', '.join(str(rank) for rank in sorted(failures))} failed ({how})"


def failure_fields(failures: dict[int, Any], node: str) -> dict[int, dict[str, Any]]:
    """A ``worker_failure`` event's ``failures``: by global rank, how each worker ended (exit code,
    pid, signal) and, when it recorded one, its error, where in the user's code, its trimmed
    traceback, and whether it failed because a peer went away (the run summary reads them)."""
    out: dict[int, dict[str, Any]] = {}
    for rank, f in failures.items():
        found = failure_report.from_process_failure(rank, f, node)
        out[rank] = {"exitcode": f.exitcode, "pid": f.pid, "signal": f.signal_name() if f.exitcode < 0 else None,
                     "error": found.error, "location": found.location, "traceback": found.traceback,
                     "consequential": found.consequential}
    return out


def not_own_failure(worker_group: WorkerGroup, failures: dict[int, Any]) -> bool:
    """Whether a failure is no failure of this node's own: its worker failed because a peer went
    away (:func:`failure_report.peer_caused`), and that peer is on another node. Only a node with
    one worker knows the latter: with several, a sibling may have failed first, and torch's agent
    stops the others at the first failure it sees (often the sibling's peer, whose error came
    sooner): the node's own failure would go uncounted, a crash loop unbounded."""
    return worker_group.spec.local_world_size == 1 and failure_report.peer_caused(failures)


def _membership_change(before: Any, after: Any) -> dict[str, list[str]]:
    """The node ids that left and joined between two round records (the etcd3 handler's
    ``joined``): ``{"nodes_left": [...], "nodes_joined": [...], "nodes_found_dead": [...]}``, each
    only when not empty; ``nodes_found_dead``: those of the left that the round did not wait for,
    their probe port refused (:attr:`RoundRecord.found_dead`)."""
    if before is None or after is None:
        return {}
    left = [n for n in before.nodes if n not in after.nodes]
    change = {"nodes_left": left, "nodes_joined": [n for n in after.nodes if n not in before.nodes],
              "nodes_found_dead": [n for n in after.found_dead if n in left]}
    return {k: v for k, v in change.items() if v}


def describe_change(before: Any, after: Any) -> str:
    """``; node(s) left: node2@127.0.0.1 (node rank 1, pid 42); joined: ...`` for a log line: the
    nodes that left and joined between two round records, each by name, address, node rank (in the
    round it left, or joined) and pid (:func:`describe_node`), never by its id alone; empty if none."""
    if before is None or after is None:
        return ""
    left = [describe_node(n, rank) + (" (found dead: its probe port refused)" if n in after.found_dead else "")
            for rank, n in enumerate(before.nodes) if n not in after.nodes]
    joined = [describe_node(n, rank) for rank, n in enumerate(after.nodes) if n not in before.nodes]
    parts = [f"{what}: {', '.join(nodes)}" for what, nodes in (("node(s) left", left), ("node(s) joined", joined))
             if nodes]
    return "".join(f"; {part}" for part in parts)


def final_failure(failures: dict[int, Any]) -> bool:
    """Whether a worker raised an error that a restart would meet again (said here; the job
    then fails at once, without spending the restart budget on it): refused input
    (``ConfigError``), a checkpoint that does not fit, a diverged state (see failure_report)."""
    found = failure_report.final_error(failures)
    if found is not None:
        logger.info("rank %d raised %s: the job fails without a restart, which would meet it again", *found)
    return found is not None


class ElasticAgent(LocalElasticAgent):
    """``LocalElasticAgent`` that reports what happens to its node.

    Each rendezvous, membership change, worker failure and restart becomes an
    event (see :mod:`elastictrain.events`) and updates this node's record in etcd
    (read by ``elastictrain status``). A run closed by ``elastictrain stop`` makes
    it stop its workers and finish successfully.
    """

    def __init__(self, *, events: EventLog, publisher: RunPublisher, stop_requested: Callable[[], bool],
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._events = events
        self._publisher = publisher
        self._stop_requested = stop_requested
        self._world_size: int | None = None
        self._restarts_at_final_error: int | None = None
        self._last_change: dict[str, list[str]] = {}
        """The node ids that left and joined at this node's last rendezvous (see :func:`_membership_change`)."""
        self._last_change_said = ""
        """The same for a log line (:func:`describe_change`)."""
        self._peer_caused = False
        """Whether this node's last worker failure was a peer's doing (:func:`not_own_failure`)."""
        self.stopped_by_request = False

    @property
    def restarts(self) -> int:
        """Worker-group restarts after failures so far (membership changes excluded)."""
        if self._restarts_at_final_error is not None:
            return self._restarts_at_final_error
        spec = _torch_compat.worker_group(self).spec
        return spec.max_restarts - _torch_compat.remaining_restarts(self)

    def _publish(self, **changes: Any) -> None:
        try:
            self._publisher.update(**changes)
        except ElasticTrainError as exc:  # status is informative; etcd trouble shows up elsewhere
            logger.warning("could not publish this node's status: %s", exc)

    def waiting_as_spare(self, nodes: int) -> None:
        """The rendezvous found its round full (``nodes`` nodes): this node waits as a hot spare, to
        take the place of a node that leaves (the handler's ``on_spare``)."""
        self._events.emit("spare", nodes=nodes)
        self._publish(state="spare")

    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        self._publish(state="rendezvous")
        started = time.monotonic()
        handler = agent_handler(worker_group.spec.rdzv_handler)
        before = handler.joined
        super()._rendezvous(worker_group)
        duration = time.monotonic() - started
        after = handler.joined
        self._last_change = _membership_change(before, after)
        self._last_change_said = describe_change(before, after)
        world_size = worker_group.workers[0].world_size if worker_group.workers else None
        fields = {"round": handler.round, "group_rank": worker_group.group_rank,
                  "nodes": worker_group.group_world_size, "world_size": world_size}
        self._events.emit("rendezvous", duration_s=round(duration, 3), restarts=self.restarts, **fields,
                          **self._last_change)
        if self._world_size is not None and world_size != self._world_size:
            self._events.emit("membership_change", old_world_size=self._world_size, new_world_size=world_size,
                              **self._last_change)
        self._world_size = world_size
        self._publish(state="running", restarts=self.restarts, **fields)
        logger.info(
            "rendezvous round %s complete in %.3fs: node rank %s of %s nodes, world size %s, restart %s%s",
            fields["round"], duration, worker_group.group_rank, worker_group.group_world_size,
            world_size, self.restarts, self._last_change_said,
        )

    def _assign_worker_ranks(self, store: Any, group_rank: int, group_world_size: int,
                             spec: WorkerSpec) -> list[Worker]:
        # The round record lists every node's worker count in rank order: each node
        # computes its global ranks itself, with no store round trip (torch's way is a
        # store write per node and a read of every node's by node 0).
        handler = spec.rdzv_handler
        joined = handler.joined if isinstance(handler, Etcd3RendezvousHandler) else None
        if joined is None or 0 in joined.nproc or len(joined.nproc) != group_world_size:
            return super()._assign_worker_ranks(store, group_rank, group_world_size, spec)
        first, world = joined.first_global_rank(group_rank), joined.world_size
        return [Worker(local_rank=i, global_rank=first + i, role_rank=first + i, world_size=world,
                       role_world_size=world) for i in range(spec.local_world_size)]

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        started = super()._start_workers(worker_group)
        # Their semaphores' names go once the workers hold them: none left behind if this agent is killed.
        _torch_compat.release_semaphore_names(_torch_compat.process_context(self))
        return started

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        result = super()._monitor_workers(worker_group)
        context = _torch_compat.process_context(self)
        if result.state == WorkerState.HEALTHY and context is not None and exited_cleanly(context):
            result = super()._monitor_workers(worker_group)  # one that returned just before (see exited_cleanly)
            if result.state == WorkerState.HEALTHY:
                finished_without_a_word(context)
                result = RunResult(state=WorkerState.SUCCEEDED,
                                   return_values={w.global_rank: None for w in worker_group.workers})
        if result.state in {WorkerState.FAILED, WorkerState.UNHEALTHY}:
            peer_caused = self._peer_caused = not_own_failure(worker_group, result.failures)
            if peer_caused:
                # A peer's failure broke this node's collectives: the job restarts, but the budget
                # counts only this node's own failures (as under in-process recovery).
                logger.info("%s, because a peer's failure broke its collectives: not this node's own failure, "
                            "its restart budget is not spent", failure_cause(result.failures))
            else:
                logger.info("%s", failure_cause(result.failures))
            node = node_label(self._events.node, worker_group.group_rank)
            self._events.emit("worker_failure", peer_caused=peer_caused, node_rank=worker_group.group_rank,
                              failures=failure_fields(result.failures, node))
            if final_failure(result.failures):
                self._restarts_at_final_error = self.restarts
                _torch_compat.forgo_restarts(self)
            elif peer_caused:
                _torch_compat.spare_restart(self)
            else:  # the other nodes state this cause when they restart theirs
                tell_fault(worker_group.spec.rdzv_handler,
                           own_fault(result.failures, self._events.node, worker_group.group_rank))
        elif result.state == WorkerState.HEALTHY:
            return self._check_stop(worker_group) or result
        return result

    def _check_stop(self, worker_group: WorkerGroup) -> RunResult | None:
        """A run closed by ``elastictrain stop``: stop the workers and succeed."""
        if not (agent_handler(worker_group.spec.rdzv_handler).closed_seen and self._stop_requested()):
            return None
        logger.info("run closed by `elastictrain stop`: stopping workers")
        self._events.emit("stop_requested")
        self._stop_workers(worker_group)
        self.stopped_by_request = True
        # torch records an event per worker and wants each one's return value.
        return RunResult(state=WorkerState.SUCCEEDED, return_values={w.global_rank: None for w in worker_group.workers})

    def _exit_barrier(self) -> None:
        # torch's exit barrier keeps the agent that hosts the c10d store alive until every
        # agent of the round is done. Our store is etcd: nothing of this node's outlives it.
        # And a round's nodes do not all get there: a node that joined as the job ended is
        # in the round but its workers wait for ranks that have exited (the barrier would
        # hold everyone for its 300 s), and after a stop the others find the run closed.
        # Instead this node says the job finished, which stops such nodes at once; nodes
        # still training finish as usual.
        if self.stopped_by_request:
            return
        handler = _torch_compat.worker_group(self).spec.rdzv_handler
        if not isinstance(handler, Etcd3RendezvousHandler):
            super()._exit_barrier()
            return
        try:
            handler.set_finished()
        except EtcdError as exc:
            logger.warning("could not mark run '%s' finished: %s", handler.get_run_id(), exc)

    def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM, timeout: int = 30) -> None:
        # Every way torch's agent stops its workers (a restart, a stop, a signal, the end of
        # its run) comes here: a stopped worker would hold it up for ``timeout``.
        context = _torch_compat.process_context(self)
        if context is not None:
            continue_stopped(context)
        super()._shutdown(death_sig, timeout)

    def _restart_workers(self, worker_group: WorkerGroup) -> None:
        failed = worker_group.state in {WorkerState.FAILED, WorkerState.UNHEALTHY}
        reason = "worker_failure" if failed else "membership_change"
        faults = [] if failed and not self._peer_caused else peer_faults(worker_group.spec.rdzv_handler)
        if faults:  # the cause the other nodes said: what made this node restart its workers
            logger.info("restarting this node's workers: %s", "; ".join(f.describe() for f in faults))
        self._events.emit("restart", reason=reason, restarts=self.restarts,
                          **({"fault": faults[0].to_json()} if faults else {}))
        self._publish(state="restarting", restarts=self.restarts)
        super()._restart_workers(worker_group)
