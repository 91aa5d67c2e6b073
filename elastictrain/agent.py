"""One node's elastic agent: torch's ``LocalElasticAgent`` on the etcd3 rendezvous.

:func:`launch` is torch's ``launch_agent`` with three differences: the rendezvous
is ours (``etcd3``), every worker runs under ``elastictrain._worker_boot`` (it
dies with its agent and records its root-cause error), and the outcome comes
back as a :class:`JobOutcome` with an exit code and a one-line summary instead
of an exception.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.forkserver
import os
import time
from dataclasses import dataclass

from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerSpec
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.elastic.multiprocessing.api import Std
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousParameters,
    RendezvousTimeoutError,
)

from elastictrain._worker_boot import AGENT_PID_ENV, run_script
from elastictrain.config import RunConfig
from elastictrain.errors import ElasticTrainError
from elastictrain.rendezvous import BACKEND_NAME
from elastictrain.rendezvous.handler import create_handler

logger = logging.getLogger(__name__)

__all__ = ["ElasticAgent", "JobOutcome", "launch"]


class ElasticAgent(LocalElasticAgent):
    """``LocalElasticAgent`` that reports each rendezvous round it completes."""

    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        started = time.monotonic()
        super()._rendezvous(worker_group)
        handler = worker_group.spec.rdzv_handler
        logger.info(
            "rendezvous round %s complete in %.3fs: node rank %s of %s nodes, world size %s, restart %s",
            getattr(handler, "round", "?"),
            time.monotonic() - started,
            worker_group.group_rank,
            worker_group.group_world_size,
            worker_group.workers[0].world_size if worker_group.workers else "?",
            worker_group.spec.max_restarts - self._remaining_restarts,
        )


@dataclass(frozen=True, slots=True)
class JobOutcome:
    """How one node's part of the job ended."""

    exit_code: int
    """0 on success; the failing worker's exit code (or 1) otherwise."""

    summary: str
    """One line for the user."""


def _failure_summary(failures: dict[int, ProcessFailure], restarts: int) -> tuple[int, str]:
    rank, failure = min(failures.items(), key=lambda item: item[1].timestamp)
    code = failure.exitcode
    if code < 0:
        how = f"was killed by signal {failure.signal_name()}"
        exit_code = 128 - code
    else:
        how = f"exited with code {code}"
        exit_code = code or 1
    message = failure.message if isinstance(failure.message, str) else str(failure.message)
    detail = ""
    if message and not message.startswith("To enable traceback"):
        detail = f": {message.strip().splitlines()[-1][:300]}"
    return exit_code, (
        f"worker rank {rank} (pid {failure.pid}) {how}{detail}; "
        f"job failed after {restarts} restart(s)"
    )


# Imported once by the forkserver, then inherited by every worker it forks.
_FORKSERVER_PRELOAD = ["torch", "torch.distributed", "torch.nn.parallel", "elastictrain._worker_boot"]


def _start_forkserver() -> None:
    """Start the forkserver now, so that its torch import overlaps the rendezvous.

    Every worker of every round is forked from it: a restart costs a fork, not a
    Python start plus a torch import. It does not touch CUDA, so forking is safe.
    """
    multiprocessing.set_forkserver_preload(_FORKSERVER_PRELOAD)
    multiprocessing.forkserver.ensure_running()


def launch(config: RunConfig, endpoint: str) -> JobOutcome:
    """Run this node's agent until the job ends.

    Args:
        config: The validated run configuration.
        endpoint: etcd endpoints (``host:port[,...]``) of the rendezvous.

    Returns:
        The node's outcome; never raises for a failed job or an ended rendezvous.

    Raises:
        ElasticTrainError: Rendezvous set-up failed (e.g. etcd unreachable).
    """
    params = RendezvousParameters(
        backend=BACKEND_NAME,
        endpoint=endpoint,
        run_id=config.run_id,
        min_nodes=config.min_nodes,
        max_nodes=config.max_nodes,
        local_addr=config.local_addr,
        **config.rendezvous.as_mapping(),
        **config.etcd_options,
    )
    # Workers check this pid to catch an agent that died before they could ask to be
    # killed along with it (see _worker_boot). Set before the forkserver starts.
    os.environ[AGENT_PID_ENV] = str(os.getpid())
    _start_forkserver()
    handler = create_handler(params)
    spec = WorkerSpec(
        role="trainer",
        local_world_size=config.nproc_per_node,
        entrypoint=run_script,
        args=(config.script, tuple(config.script_args)),
        rdzv_handler=handler,
        max_restarts=config.max_restarts,
        monitor_interval=config.monitor_interval.total_seconds(),
        local_addr=config.local_addr,
    )
    logs = DefaultLogsSpecs(log_dir=config.log_dir, redirects=Std.NONE, tee=Std.NONE)
    agent = ElasticAgent(spec=spec, logs_specs=logs, start_method="forkserver")
    shutdown_rendezvous = True
    try:
        result: RunResult = agent.run()
    except RendezvousClosedError:
        return JobOutcome(1, f"run {config.run_id!r} is closed: the job it named has already ended")
    except RendezvousTimeoutError:
        return JobOutcome(
            1,
            f"rendezvous of run {config.run_id!r} timed out after "
            f"{config.rendezvous.join_timeout.total_seconds():g}s waiting for "
            f"{config.min_nodes} node(s); the last committed checkpoint is untouched",
        )
    except ElasticTrainError:
        raise
    except BaseException:
        # A signal (Ctrl-C, SIGTERM): leave the rendezvous open so that the other
        # nodes can carry on without us; torch does the same.
        shutdown_rendezvous = False
        raise
    finally:
        if shutdown_rendezvous:
            handler.shutdown()
    if result.is_failed():
        restarts = config.max_restarts - agent._remaining_restarts  # noqa: SLF001
        return JobOutcome(*_failure_summary(result.failures, restarts))
    return JobOutcome(0, f"run {config.run_id!r} finished")
