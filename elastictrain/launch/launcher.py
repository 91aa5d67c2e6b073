"""``elastictrain run`` on one node: set up and run its agent until the job ends.

:func:`launch` is torch's ``launch_agent`` with these differences: the rendezvous is
ours (``etcd3``), every worker runs under ``elastictrain.launch._worker_boot`` (it dies with
its agent and records its root-cause error), the agent recovers in place by default
(:class:`~elastictrain.launch.inprocess_agent.InProcessAgent`), and the outcome comes back as a
:class:`JobOutcome` with an exit code and a one-line summary instead of an exception.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch.distributed.elastic.agent.server.api import RunResult, WorkerSpec
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.elastic.multiprocessing.api import Std
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousParameters,
    RendezvousTimeoutError,
)

from elastictrain import _torch_compat
from elastictrain._fault import node_label
from elastictrain.launch import node_setup
from elastictrain.launch._worker_boot import run_script
from elastictrain.launch.agent import ElasticAgent
from elastictrain.launch.inprocess_agent import InProcessAgent
from elastictrain.launch.config import RunConfig
from elastictrain.errors import ElasticTrainError, RunIdInUseError
from elastictrain.events import EventLog, route_torch_events
from elastictrain.launch.failure_report import WorkerFailure, from_process_failure, job_line, root_cause
from elastictrain.launch.node_setup import NodeSetup
from elastictrain.rendezvous import BACKEND_NAME, register
from elastictrain.rendezvous.handler import LOCAL_WORLD_SIZE_KEY, Etcd3RendezvousHandler, create_handler
from elastictrain.launch.run_state import NodeRecord, RunPublisher, read_membership, stop_requested, this_host
from elastictrain.launch.worker_group import Channel, FailureBudget

logger = logging.getLogger(__name__)

__all__ = ["JobOutcome", "launch"]


@dataclass(frozen=True, slots=True)
class JobOutcome:
    """How one node's part of the job ended."""

    exit_code: int
    """0 on success; the failing worker's exit code (or 1) otherwise."""

    summary: str
    """One line for the user."""

    failures: tuple[WorkerFailure, ...] = ()
    """This node's failed workers, when the job failed because of them."""

    restarts: int = 0
    """This node's restarts (or replacements) after its own workers' failures."""


def _failure_outcome(failures: dict[int, ProcessFailure], restarts: int, node: str) -> JobOutcome:
    """The outcome of this node's failed workers: the root cause in one line, its traceback kept
    for the report (see :mod:`elastictrain.launch.failure_report`)."""
    reports = [from_process_failure(rank, failure, node) for rank, failure in failures.items()]
    root = root_cause(reports)
    code = root.exit_code if root is not None else 1
    exit_code = 128 - code if code < 0 else (code or 1)
    return JobOutcome(exit_code, job_line(reports, restarts), failures=tuple(reports), restarts=restarts)


def _worker_logs(config: RunConfig, root: str) -> Callable[[int], DefaultLogsSpecs]:
    """Each worker's logs under in-process recovery (one process context per worker):
    ``--redirects``/``--tee`` for its local rank; a rank outside ``--local-ranks-filter``
    writes to its files only."""
    redirects, tee = Std.from_str(config.redirects), Std.from_str(config.tee)

    def for_rank(local_rank: int) -> DefaultLogsSpecs:
        out, both = (s if isinstance(s, Std) else s.get(local_rank, Std.NONE) for s in (redirects, tee))
        if config.local_ranks_filter and local_rank not in config.local_ranks_filter:
            out, both = Std.ALL, Std.NONE
        return DefaultLogsSpecs(log_dir=os.path.join(root, f"local_rank_{local_rank}"), redirects=out, tee=both)

    return for_rank


def launch(config: RunConfig, endpoint: str, node: NodeSetup | None = None) -> JobOutcome:
    """Run this node's agent until the job ends.

    Args:
        config: The validated run configuration.
        endpoint: etcd endpoints (``host:port[,...]``) of the rendezvous.
        node: What :func:`elastictrain.launch.node_setup.prepare` set up for this node (the CLI does
            it before importing torch); by default it is set up here and removed at the end.

    Returns:
        The node's outcome; never raises for a failed job or an ended rendezvous.

    Raises:
        ElasticTrainError: Rendezvous set-up failed (e.g. etcd unreachable).
    """
    if node is None:
        node = node_setup.prepare(config)
        try:
            return launch(config, endpoint, node)
        finally:
            node.close()
    # First: the forkserver is forked from this process while it has no thread or connection.
    forked = node.start_forkserver()
    logger.debug("workers' forkserver: %s", "a fork of this process" if forked else "a fresh interpreter")
    params = RendezvousParameters(
        backend=BACKEND_NAME,
        endpoint=endpoint,
        run_id=config.run_id,
        min_nodes=config.min_nodes,
        max_nodes=config.max_nodes,
        local_addr=config.local_addr,
        **config.rendezvous.as_mapping(),
        **node.etcd_options,
        **{LOCAL_WORLD_SIZE_KEY: config.nproc_per_node},
    )
    events = EventLog(config.event_log, config.run_id, config.node_name)
    channel = node.channel
    metrics = None
    if config.metrics_port:
        from elastictrain.launch.metrics import AgentMetrics

        metrics = AgentMetrics(config.metrics_port, run_id=config.run_id, node=events.node,
                               event_log=config.event_log, progress=channel.progress if channel else None)
        events.add_listener(metrics.observe)
    try:
        return _run_node(config, params, events, channel, node.temp)
    finally:
        if metrics is not None:
            metrics.close()


def _run_node(config: RunConfig, params: RendezvousParameters, events: EventLog, channel: Channel | None,
              temp: str) -> JobOutcome:
    log_root = config.log_dir or os.path.join(temp, "logs")
    register()
    handler = create_handler(params)
    try:
        # A node that joins a training job asks at once, its forkserver still importing:
        # the others train on until its workers are ready (see InProcessAgent._recover).
        _check_run_id(handler, config)
    except RunIdInUseError:
        handler.leave()
        raise
    publisher = RunPublisher(handler.client, handler.keys, handler.run_lease, NodeRecord(
        node_id=handler.node_id, host=this_host(), addr=config.local_addr or socket.getfqdn(), pid=os.getpid(),
        name=config.node_name or this_host()))
    publisher.publish_meta(**_job_signature(config))
    publisher.update(state="starting")
    spec = WorkerSpec(
        role=config.role,
        local_world_size=config.nproc_per_node,
        entrypoint=run_script,
        args=(config.script, tuple(config.script_args), config.entry),
        rdzv_handler=handler,
        max_restarts=config.max_restarts,
        monitor_interval=config.monitor_interval.total_seconds(),
        local_addr=config.local_addr,
        event_log_handler=route_torch_events(events),
    )
    logs = DefaultLogsSpecs(log_dir=log_root, redirects=Std.from_str(config.redirects),
                            tee=Std.from_str(config.tee), local_ranks_filter=set(config.local_ranks_filter) or None)
    common: dict[str, Any] = dict(spec=spec, logs_specs=logs, start_method="forkserver", events=events,
                                  publisher=publisher,
                                  stop_requested=lambda: stop_requested(handler.client, config.run_id))
    agent: ElasticAgent
    if channel is not None:
        agent = InProcessAgent(channel=channel, worker_logs=_worker_logs(config, log_root), budget=FailureBudget(
            limit=config.max_restarts, window_s=config.restart_window.total_seconds()), **common)
    else:
        agent = ElasticAgent(**common)
    handler.on_spare = agent.waiting_as_spare
    outcome = _run_agent(agent, handler, config)  # the channel is the NodeSetup's, closed with it
    events.emit("job_end", exit_code=outcome.exit_code, summary=outcome.summary)
    events.close()
    return outcome


def _job_signature(config: RunConfig) -> dict[str, Any]:
    """What nodes of one job share; published in the run's meta by its first node."""
    return {"min_nodes": config.min_nodes, "max_nodes": config.max_nodes,
            "nproc_per_node": config.nproc_per_node, "script": os.path.basename(config.script)}


def _check_run_id(handler: Etcd3RendezvousHandler, config: RunConfig) -> None:
    """Refuse to start a second job under a run id that is in use, unless told to join it."""
    status = read_membership(handler.client, config.run_id)
    run = f"run id {config.run_id!r}"
    if status.closed:
        if stop_requested(handler.client, config.run_id):
            raise RunIdInUseError(f"{run} was stopped with `elastictrain stop`; choose another --run-id, "
                                  f"or clear it with `elastictrain stop --run-id {config.run_id} --purge`")
        raise RunIdInUseError(f"{run} belongs to a job that has ended; choose another --run-id, or clear it "
                              f"with `elastictrain stop --run-id {config.run_id} --purge`")
    alive = [p for p in status.participants if p["alive"]]
    signature = _job_signature(config)
    if status.complete and alive and not config.join:
        if all(status.meta.get(key) == value for key, value in signature.items()):
            # Same script and node counts: a node of this job that started after the
            # others formed round 0 (schedulers start nodes seconds apart). Let it in.
            logger.info("run %r is training; joining it as a late node of the same job", config.run_id)
            return
        hosts = ", ".join(sorted({p["addr"] for p in alive}))
        raise RunIdInUseError(
            f"{run} is live: round {status.round} trains with {len(alive)} node(s) on {hosts}; "
            "pass --join to add this node to it, or choose another --run-id (it runs "
            f"{status.meta.get('script', '?')} on {status.meta.get('min_nodes', '?')}-"
            f"{status.meta.get('max_nodes', '?')} nodes x {status.meta.get('nproc_per_node', '?')})"
        )


def _run_agent(agent: ElasticAgent, handler: Etcd3RendezvousHandler, config: RunConfig) -> JobOutcome:
    """Run the agent; publish this node's last record, then close the rendezvous and leave it
    (its etcd client closes with it), or only leave it on a signal."""
    try:
        outcome = _agent_outcome(agent, handler, config)
    except ElasticTrainError:
        handler.shutdown()
        raise
    except BaseException:
        # A signal (Ctrl-C, SIGTERM): leave the rendezvous open so that the other
        # nodes can carry on without us (torch does the same), but say at once that
        # this node is gone rather than let its lease run out.
        handler.leave()
        raise
    handler.begin_goodbyes()  # the last record is the first of them
    agent._publish(state="succeeded" if outcome.exit_code == 0 else "failed")  # noqa: SLF001
    handler.shutdown()
    return outcome


def _agent_outcome(agent: ElasticAgent, handler: Etcd3RendezvousHandler, config: RunConfig) -> JobOutcome:
    try:
        result: RunResult | None = agent.run()
    except RendezvousClosedError:
        if stop_requested(handler.client, config.run_id):
            return JobOutcome(0, f"run {config.run_id!r} was stopped by `elastictrain stop`")
        if handler.finished_seen:
            return JobOutcome(0, f"run {config.run_id!r} finished on its other nodes while this node's "
                                 "workers formed a group with them")
        return JobOutcome(1, f"run {config.run_id!r} is closed: the job it named has already ended")
    except RendezvousTimeoutError:
        return JobOutcome(
            1,
            f"rendezvous of run {config.run_id!r} timed out after "
            f"{config.rendezvous.join_timeout.total_seconds():g}s waiting for "
            f"{config.min_nodes} node(s); the last committed checkpoint is untouched, and the run is "
            f"now closed: to resume from that checkpoint, start the job under a new --run-id, or after "
            f"`elastictrain stop --run-id {config.run_id} --purge`",
        )
    if result is None:  # torch's agent returns nothing after RendezvousGracefulExitError
        return JobOutcome(0, f"run {config.run_id!r} ended while this node waited as a spare "
                             f"(it had --max-nodes {config.max_nodes} already)")
    if result.is_failed():
        group_rank = _torch_compat.worker_group(agent).group_rank
        node = node_label(config.node_name or this_host(), group_rank)
        return _failure_outcome(result.failures, agent.restarts, node)
    if agent.stopped_by_request:
        return JobOutcome(0, f"run {config.run_id!r} was stopped by `elastictrain stop`")
    return JobOutcome(0, f"run {config.run_id!r} finished")
