"""A Prometheus endpoint on each node agent: ``elastictrain run --metrics-port PORT``.

The agent's own events (rendezvous, recoveries, restarts, worker failures; see
:mod:`elastictrain.events`) update counters and gauges as they happen; what the workers
know (their step, their step time) is read from the control channel when Prometheus
scrapes, and the newest checkpoint from the run's event log, which the workers append to.
Every series is listed, with its type and labels, in ``docs/metrics.md``.

``prometheus_client`` is an optional dependency (``pip install elastictrain[metrics]``);
asking for ``--metrics-port`` without it is one line saying so.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from elastictrain.errors import ConfigError, DependencyError
from elastictrain.events import LineTail

logger = logging.getLogger(__name__)

__all__ = ["AgentMetrics", "recovery_cause"]

_DURATION_BUCKETS = (0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600)


def recovery_cause(cause: str) -> str:
    """A recovery's free-text cause as a bounded label value."""
    if cause.startswith("worker(s)"):
        return "worker_failure"
    if cause.startswith("membership change"):
        return "membership_change"
    if "collective failed" in cause:
        return "peer_failure"
    if cause == "start":
        return "start"
    return "other"


class _CheckpointTail:
    """The newest checkpoint event of the run's JSON-lines event log, read incrementally."""

    def __init__(self, path: str | None) -> None:
        self._tail = LineTail(path) if path else None
        self.step: float = float("nan")
        self.at: float = float("nan")

    def refresh(self) -> None:
        if self._tail is None:
            return
        try:
            lines = self._tail.new_lines()
        except OSError:
            return
        for line in lines:
            if b"checkpoint_" not in line:
                continue
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if event.get("kind") in {"checkpoint_commit", "checkpoint_save"} and isinstance(event.get("step"), int):
                if not event["step"] < self.step:  # nan compares false: the first one counts
                    self.step, self.at = float(event["step"]), float(event.get("ts", time.time()))


class AgentMetrics:
    """This node agent's series, served over HTTP for Prometheus.

    Args:
        port: TCP port of the endpoint (all interfaces).
        run_id: Labels ``elastictrain_info``.
        node: Labels ``elastictrain_info``.
        event_log: The run's event log (for the newest checkpoint); ``None``: no checkpoint series values.
        progress: Returns the workers' control-channel slots (``step``, ``step_s``), or ``None`` under
            ``--recovery restart`` (no channel): then no step series values.

    Raises:
        DependencyError: ``prometheus_client`` is not installed.
        ConfigError: The port cannot be bound.
    """

    def __init__(self, port: int, *, run_id: str, node: str, event_log: str | None,
                 progress: Callable[[], Sequence[Any]] | None = None) -> None:
        try:
            import prometheus_client as prom
        except ImportError as exc:
            raise DependencyError("--metrics-port needs the prometheus_client package: "
                                  "pip install 'elastictrain[metrics]'") from exc
        self._lock = threading.Lock()
        self._progress = progress
        self._checkpoints = _CheckpointTail(event_log)
        self.registry = registry = prom.CollectorRegistry(auto_describe=True)
        prom.Gauge("elastictrain_info", "This agent's run and node (always 1)", ["run_id", "node"],
                   registry=registry).labels(run_id=run_id, node=node).set(1)
        self.world_size = prom.Gauge("elastictrain_world_size", "Ranks in the current round", registry=registry)
        self.nodes = prom.Gauge("elastictrain_nodes", "Nodes in the current round", registry=registry)
        self.node_rank = prom.Gauge("elastictrain_node_rank", "This node's rank in the current round",
                                    registry=registry)
        self.round = prom.Gauge("elastictrain_rendezvous_round", "Current rendezvous round", registry=registry)
        self.rendezvous = prom.Histogram("elastictrain_rendezvous_duration_seconds",
                                         "Time this node spent in each rendezvous", buckets=_DURATION_BUCKETS,
                                         registry=registry)
        self.recoveries = prom.Counter("elastictrain_recoveries_total",
                                       "In-place recoveries of this node's workers, by cause", ["cause"],
                                       registry=registry)
        self.recovery = prom.Histogram("elastictrain_recovery_duration_seconds",
                                       "Time from a fault or membership change to the re-formed group",
                                       ["cause"], buckets=_DURATION_BUCKETS, registry=registry)
        self.restarts = prom.Counter("elastictrain_restarts_total",
                                     "Restarts of this node's workers (all of them, from the last checkpoint), "
                                     "by reason", ["reason"], registry=registry)
        self.failures = prom.Counter("elastictrain_worker_failures_total", "This node's workers that failed",
                                     registry=registry)
        self.membership = prom.Counter("elastictrain_membership_changes_total",
                                       "Rounds whose world size differed from the previous one", registry=registry)
        prom.Gauge("elastictrain_step", "Highest optimizer step reached by this node's workers",
                   registry=registry).set_function(lambda: self._step()[0])
        prom.Gauge("elastictrain_steps_per_second", "This node's step rate (from its workers' typical step time)",
                   registry=registry).set_function(lambda: self._step()[1])
        prom.Gauge("elastictrain_straggler_factor", "How many times its peers' median the slowest of this node's "
                   "workers took to compute its recent steps (see docs/recovery.md, Hangs and stragglers)",
                   registry=registry).set_function(self._straggle)
        self.hangs = prom.Counter("elastictrain_hangs_total", "This node's workers found hung and replaced",
                                  registry=registry)
        prom.Gauge("elastictrain_last_checkpoint_step", "Step of the newest checkpoint saved by the job",
                   registry=registry).set_function(lambda: self._checkpoint()[0])
        prom.Gauge("elastictrain_last_checkpoint_timestamp_seconds", "When the newest checkpoint was saved "
                   "(Unix time)", registry=registry).set_function(lambda: self._checkpoint()[1])
        prom.Gauge("elastictrain_last_checkpoint_age_seconds", "Seconds since the newest checkpoint was saved",
                   registry=registry).set_function(lambda: time.time() - self._checkpoint()[1])
        try:
            self._server, self._thread = prom.start_http_server(port, registry=registry)
        except OSError as exc:
            raise ConfigError(f"--metrics-port {port}: cannot serve metrics there: {exc.strerror or exc}") from None
        logger.info("metrics for Prometheus at http://%s:%d/metrics", os.uname().nodename, port)

    def observe(self, event: dict[str, Any]) -> None:
        """Update the series from one of the agent's events (an :class:`~elastictrain.events.EventLog` listener)."""
        kind = event.get("kind")
        if kind == "rendezvous":
            for gauge, key in ((self.world_size, "world_size"), (self.nodes, "nodes"),
                               (self.node_rank, "group_rank"), (self.round, "round")):
                if isinstance(event.get(key), int):
                    gauge.set(event[key])
            if isinstance(event.get("duration_s"), (int, float)):
                self.rendezvous.observe(event["duration_s"])
        elif kind == "recovery":
            cause = recovery_cause(str(event.get("cause", "")))
            self.recoveries.labels(cause=cause).inc()
            if isinstance(event.get("duration_s"), (int, float)):
                self.recovery.labels(cause=cause).observe(event["duration_s"])
            if isinstance(event.get("world_size"), int):
                self.world_size.set(event["world_size"])
        elif kind == "restart":
            reason = str(event.get("reason", ""))
            self.restarts.labels(reason="worker_failure" if reason == "worker_failure" or
                                 reason.startswith("worker(s)") else "membership_change"
                                 if reason.startswith("membership") else "other").inc()
        elif kind == "worker_failure":
            self.failures.inc(len(event.get("failures") or {}) or 1)
        elif kind == "hang":
            self.hangs.inc()
        elif kind == "membership_change":
            self.membership.inc()

    def _step(self) -> tuple[float, float]:
        if self._progress is None:
            return float("nan"), float("nan")
        slots = [p for p in self._progress() if getattr(p, "pid", 0)]
        if not slots:
            return float("nan"), float("nan")
        times = [p.step_s for p in slots if p.step_s > 0]
        rate = 1.0 / statistics.median(times) if times else 0.0
        return float(max(p.step for p in slots)), rate

    def _straggle(self) -> float:
        if self._progress is None:
            return float("nan")
        factors = [p.straggle for p in self._progress() if getattr(p, "pid", 0) and p.straggle > 0]
        return max(factors) if factors else float("nan")

    def _checkpoint(self) -> tuple[float, float]:
        with self._lock:
            self._checkpoints.refresh()
            return self._checkpoints.step, self._checkpoints.at

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
