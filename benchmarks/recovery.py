"""Recovery time of a training job: a worker crash, a node loss, a hot spare, a node join.

Every trial runs one training script under one launcher, one worker per node, lets
it train to ``--action-step``, then:

- ``worker_crash``: SIGKILL the worker of the highest rank (2 nodes); recovered at
  the first step past the last step completed before the kill (the replacement
  worker at work; survivors keep their pids under in-process recovery);
- ``node_loss``: SIGKILL a whole node, its agent and its worker, as a machine dying
  (3 nodes, min 2); recovered at the first step at world size 2. The node killed
  is never node 0, which hosts torchrun's c10d store (losing it ends a torchrun job);
- ``hot_spare``: 3 nodes with max 2 (one waits as a spare); SIGKILL a training node
  (never node 0) as above; recovered at the first step at world size 2 that the
  spare's worker completes;
- ``node_join``: start one more node agent (2 nodes, max 3); recovered at the first
  step at world size 3. The clock starts when the new agent's process is started.
- ``node_join_own_core``: ``node_join`` with the joining node on a core of its own, as
  on a machine of its own: the training nodes (agents, workers) and the new node are
  pinned to disjoint CPUs (the new node: the last one; the others: the rest; etcd and
  this driver are not pinned). On this 2-core machine the plain ``node_join``'s new node
  shares both cores with two training workers, so its imports run at a third of a core's
  speed or so; a node joining a real job brings its own cores.
  ``survivor_pause_s``: the longest gap between consecutive steps of a surviving
  node's worker, from its last step before the launch to its first step at world size 3.
  ``cold_import_s``: just before the launch, with the same nodes training, the wall time
  of a bare ``python -c "import torch, torch.nn.parallel, torch._dynamo"`` (what any
  joining node's worker imports before it can build DDP, whatever the launcher): the
  part of a cold join that is torch's own start on this machine.

Every trial also counts ``steps_redone``: the step numbers some rank completed twice
(from the per-step records; a restart from a checkpoint redoes the steps since it),
and ``survivor_pids_kept``: whether every node that was not killed trains on with the
same worker pid(s) after the recovery.

Launchers, interleaved trial by trial:

- ``elastictrain``: ``elastictrain run --etcd ...`` with its defaults, one agent per node,
  on the plain DDP script ``_train.py``;
- ``elastictrain_inprocess``: ``elastictrain run --recovery in-process`` on the Session
  script ``_train_session.py`` (survivors keep their processes);
- ``elastictrain_restart``: ``elastictrain run --recovery restart`` on ``_train_session.py``
  (every worker restarts from the last checkpoint);
- ``elastictrain_prev``: the same command as ``elastictrain`` of an earlier elastictrain, installed in a
  virtualenv of its own, whose ``elastictrain`` executable ``$BENCH_PREV_ELASTICTRAIN``
  names (e.g. ``git worktree add /tmp/prev c56d2b4 && cd /tmp/prev && python3 -m venv
  .venv && .venv/bin/pip install "torch==2.13.*" -e ".[etcd]"``): our previous mode,
  measured in the same run;
- ``torchrun_default``: ``torchrun --rdzv-backend c10d`` with torch's defaults;
- ``torchrun_tuned``: the same with ``--monitor-interval 0.05 --rdzv-conf
  last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3``.

The torchrun launchers run ``_train.py`` (stock torchrun cannot run a Session's in-process
recovery: under it a Session restarts from its checkpoint like ``elastictrain_restart``);
``--torchrun-script session`` runs them on ``_train_session.py`` instead. The JSON's
``scripts`` says which script each launcher ran. ``--state-mb`` sizes the model of both
scripts (parameters + AdamW state; the issue-14 table uses 100 MB); without it each
script keeps its own default (``_train.py``: ~13 MB, ``_train_session.py``: 100 MB).

Both torchrun variants run with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (with the
shared store a restarted group often never recovers) and ``--max-restarts 3`` like
elastictrain (torchrun's default of 0 turns any failure into the end of the job);
node 0 hosts the c10d store (``is_host``), as on a real cluster where only the
endpoint host matches.

Each trial also records where the recovery time went, from the agents' log lines
(timestamped by this driver as they arrive) and the workers' JSON events: failure
detected, rendezvous done, worker process started, imports done, process group
up, model and optimizer built, checkpoint group up, checkpoint restored, DDP
built (or the Session entered), first step; and, under elastictrain, the run's own
``recovery``/``restart``/``worker_failure`` events. Under in-process recovery rank 0's
``recovery`` events say where each re-formation's seconds went; ``reformation_s`` summarizes
them per scenario (a row of the table).

    python benchmarks/recovery.py --scenarios worker_crash --reps 3
    python benchmarks/recovery.py --launchers elastictrain_inprocess,elastictrain_restart,torchrun_tuned \\
        --scenarios worker_crash,node_loss,hot_spare,node_join --reps 5 --out benchmarks/results/recovery14.json

The script prints its JSON line on stdout and a markdown table (median, min-max) on
stderr (and next to ``--out`` as ``.md``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import (
    BENCH_DIR, BIN_DIR, NODE_ENV, TRIAL_ENV, EventLog, Proc, emit_with_table, free_port, kill_pids, machine,
    metrics_delta, processes_of, ratio, scrape_metrics, summarize, wait_until,
)

SCRIPT = BENCH_DIR / "_train.py"
SESSION_SCRIPT = BENCH_DIR / "_train_session.py"
LAUNCHERS = ("elastictrain", "elastictrain_inprocess", "elastictrain_restart", "elastictrain_prev",
             "torchrun_default", "torchrun_tuned")
# What ``python -m benchmarks`` (run.py) measures; the issue-14 launchers and hot_spare run from here.
CLASSIC_LAUNCHERS = ("elastictrain", "elastictrain_prev", "torchrun_default", "torchrun_tuned")
RECOVERY_MODE = {"elastictrain_inprocess": "in-process", "elastictrain_restart": "restart"}
PREV_ENV = "BENCH_PREV_ELASTICTRAIN"
SCENARIOS = ("worker_crash", "node_loss", "hot_spare", "node_join", "node_join_own_core")
JOIN_SCENARIOS = ("node_join", "node_join_own_core")
CLASSIC_SCENARIOS = ("worker_crash", "node_loss", "node_join")
TUNED_CONF = "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3"
REFORMATION_PHASES = ("wait_s", "group_s", "state_s", "ddp_s")
"""The fields of rank 0's ``recovery`` event that say where a re-formation's seconds went
(``elastictrain.train.group_keeper.RECOVERY_PHASES``, not imported: this driver imports no torch)."""
MAX_RESTARTS = 3

# Stderr lines of the agents that mark the phases of a recovery (torch's agent logs
# these for both launchers with LOGLEVEL=INFO; elastictrain adds its own round line).
DETECTED = re.compile(r"Worker group (FAILED|UNHEALTHY)|Detected \d+ new nodes")
RDZV_START = re.compile(r"Rendezvous'ing worker group")
RDZV_DONE = re.compile(r"Rendezvous complete for workers|rendezvous round \d+ complete")
AGENT_READY = re.compile(r"starting workers for entrypoint|Rendezvous'ing worker group")


@dataclass(frozen=True)
class Scenario:
    name: str
    nodes: int
    min_nodes: int
    max_nodes: int
    world_after: int
    own_core: bool = False
    """The joining node runs on a CPU of its own (see ``node_join_own_core``)."""
    nproc_per_node: int = 1
    """Workers per node (``world_after`` counts workers)."""
    past_last_step: bool = False
    """Recovered only at a step past the last one before the action (as ``worker_crash`` always is)."""

    @property
    def world_before(self) -> int:
        return min(self.nodes, self.max_nodes) * self.nproc_per_node


SCENARIO = {
    "worker_crash": Scenario("worker_crash", nodes=2, min_nodes=2, max_nodes=2, world_after=2),
    "node_loss": Scenario("node_loss", nodes=3, min_nodes=2, max_nodes=3, world_after=2),
    "hot_spare": Scenario("hot_spare", nodes=3, min_nodes=2, max_nodes=2, world_after=2),
    "node_join": Scenario("node_join", nodes=2, min_nodes=2, max_nodes=3, world_after=3),
    "node_join_own_core": Scenario("node_join_own_core", nodes=2, min_nodes=2, max_nodes=3, world_after=3,
                                   own_core=True),
}


def prev_elastictrain() -> str:
    """The ``elastictrain`` executable of the earlier version (``$BENCH_PREV_ELASTICTRAIN``).

    Raises:
        RuntimeError: It is not set, or not an executable.
    """
    path = os.environ.get(PREV_ENV, "")
    if not path or not os.access(path, os.X_OK):
        raise RuntimeError(f"the elastictrain_prev launcher needs {PREV_ENV}=/path/to/old/venv/bin/elastictrain "
                           f"(got {path!r})")
    return path


SESSION_GLOBAL_BATCH = 16  # _train_session.py's default --global-batch


def session_width(state_mb: float, depth: int = 4) -> int:
    """``_train_session.width_for``, without importing torch here."""
    return max(8, int(math.sqrt(state_mb * 1e6 / 12 / depth)))


def script_of(launcher: str, torchrun_script: str = "ddp") -> str:
    """The file name of the training script ``launcher`` runs."""
    if launcher in RECOVERY_MODE or (launcher.startswith("torchrun") and torchrun_script == "session"):
        return SESSION_SCRIPT.name
    return SCRIPT.name


def _elastictrain_has_join() -> bool:
    out = subprocess.run([str(BIN_DIR / "elastictrain"), "run", "--help"], capture_output=True, text=True)
    return "--join" in out.stdout


@dataclass
class TrialSetup:
    launcher: str
    scenario: Scenario
    workdir: Path
    etcd: str | None
    action_step: int
    recovery_timeout: float
    start_timeout: float
    join_flag: bool
    state_mb: float | None = None
    kill_at: float = 0.0
    """Where in a step a kill lands, as a fraction of the step time before it: 0 (the default) at
    once when the action step's event is seen, just after that step (an in-memory copy of it may
    still be in flight: the worst instant for one); 0.5 half-way through the next step."""
    torchrun_script: str = "ddp"
    sharding: str = "ddp"
    trial: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    rdzv_port: int = field(default_factory=free_port)

    def script_name(self) -> str:
        """The file name of the training script this launcher runs."""
        return script_of(self.launcher, self.torchrun_script)

    def tuned(self) -> bool:
        """Whether torchrun runs with the tuned monitor interval and rendezvous settings."""
        return self.launcher == "torchrun_tuned"

    def script(self) -> list[str]:
        """The training script and its arguments for this launcher."""
        common = ["--events", str(self.workdir / "events.jsonl"), "--ckpt-dir", str(self.workdir / "ckpt")]
        if script_of(self.launcher, self.torchrun_script) == SESSION_SCRIPT.name:
            sized = [] if self.state_mb is None else ["--state-mb", f"{self.state_mb:g}"]
            return [str(SESSION_SCRIPT), *common, *sized, "--sharding", self.sharding]
        if self.state_mb is None:
            return [str(SCRIPT), *common]
        # The same model as _train_session.py's at this size (depth 4, AdamW) and its batch.
        return [str(SCRIPT), *common, "--width", str(session_width(self.state_mb)), "--depth", "4",
                "--global-batch", str(SESSION_GLOBAL_BATCH), "--samples", "2048"]

    def command(self, node: int) -> list[str]:
        s = self.scenario
        script = self.script()
        if self.launcher.startswith("elastictrain"):
            front = ([prev_elastictrain()] if self.launcher == "elastictrain_prev"
                     else [str(BIN_DIR / "elastictrain")])
            cmd = [*front, "run", "--etcd", str(self.etcd), "--run-id", f"bench-{self.trial}",
                   "--min-nodes", str(s.min_nodes), "--max-nodes", str(s.max_nodes),
                   "--local-addr", "127.0.0.1", "--max-restarts", str(MAX_RESTARTS),
                   "--nproc-per-node", str(s.nproc_per_node)]
            if self.launcher in RECOVERY_MODE:
                cmd += ["--recovery", RECOVERY_MODE[self.launcher]]
            if self.join_flag:
                # Every node, not only the late one: elastictrain refuses a node whose run
                # id already trains, and with a 1 s last call a node that starts 2 s after
                # its peers finds round 0 complete without it (see README, product issues).
                cmd.append("--join")
            return cmd + script
        conf = f"is_host={'true' if node == 0 else 'false'}"
        cmd = [str(BIN_DIR / "torchrun"), "--nnodes", f"{s.min_nodes}:{s.max_nodes}",
               "--nproc-per-node", str(s.nproc_per_node),
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{self.rdzv_port}",
               "--rdzv-id", f"bench-{self.trial}", "--local-addr", "127.0.0.1",
               "--max-restarts", str(MAX_RESTARTS)]
        if self.tuned():
            cmd += ["--monitor-interval", "0.05"]
            conf += "," + TUNED_CONF
        return cmd + ["--rdzv-conf", conf] + script

    def cpus(self, node: int) -> set[int] | None:
        """The CPUs ``node``'s processes are pinned to (None: not pinned): under
        ``node_join_own_core``, the joining node gets the last CPU and the others the rest."""
        if not self.scenario.own_core:
            return None
        available = sorted(os.sched_getaffinity(0))
        if len(available) < 2:
            raise RuntimeError(f"{self.scenario.name} needs 2 CPUs or more; this process may use {available}")
        return {available[-1]} if node >= self.scenario.nodes else set(available[:-1])

    def env(self, node: int) -> dict[str, str]:
        env = dict(os.environ)
        env.update({
            "PATH": os.pathsep.join([str(BIN_DIR), env.get("PATH", "")]),
            "PYTHONUNBUFFERED": "1",
            "LOGLEVEL": "INFO",  # torch's agent logs its phases at INFO
            "OMP_NUM_THREADS": "1",
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
            TRIAL_ENV: self.trial,
            NODE_ENV: str(node),
        })
        return env


class Job:
    """The agents of one trial, started and stopped together."""

    def __init__(self, setup: TrialSetup) -> None:
        self.setup = setup
        self.agents: dict[int, Proc] = {}
        self.events = EventLog(setup.workdir / "events.jsonl")

    def start_node(self, node: int) -> Proc:
        # The trial's directory as cwd: elastictrain writes its run's event log there.
        proc = Proc(self.setup.command(node), self.setup.env(node),
                    self.setup.workdir / f"agent-{node}.log", cwd=self.setup.workdir)
        cpus = self.setup.cpus(node)
        if cpus is not None:
            # At once: the interpreter is still starting; every thread and process it starts inherits it.
            os.sched_setaffinity(proc.pid, cpus)
        self.agents[node] = proc
        return proc

    def stop(self) -> None:
        for proc in self.agents.values():
            if proc.alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGTERM)
        for proc in self.agents.values():
            proc.stop(grace=15)
        # Whatever outlived its agent (a torchrun worker orphaned by a SIGKILLed agent).
        leftovers = wait_until(lambda: not processes_of(self.setup.trial), timeout=5)
        if leftovers is None:
            kill_pids(processes_of(self.setup.trial))
            wait_until(lambda: not processes_of(self.setup.trial), timeout=10)

    def failed_agents(self) -> dict[int, int]:
        return {n: p.popen.returncode for n, p in self.agents.items() if p.popen.poll() not in (None, 0)}


def _first(lines: list[tuple[float, re.Match[str] | None] | None]) -> float | None:
    times = [x[0] for x in lines if x is not None]
    return min(times) if times else None


def _last(lines: list[tuple[float, re.Match[str]] | None]) -> float | None:
    times = [x[0] for x in lines if x is not None]
    return max(times) if times else None


def _profile(job: Job, t_action: float, old_pids: set[int], first_step: float) -> dict[str, float | None]:
    """Milestones of a recovery, in seconds after the action (critical path: the last rank)."""
    new = [e for e in job.events.poll() if e["pid"] not in old_pids and e["t"] > t_action]

    def latest(event: str, key: str = "t") -> float | None:
        values = [e[key] for e in new if e["event"] == event and e.get(key) is not None]
        return max(values) if values else None

    agents = list(job.agents.values())
    joining = job.agents.get(job.setup.scenario.nodes) if job.setup.scenario.name in JOIN_SCENARIOS else None
    milestones: dict[str, float | None] = {
        "joining_agent_in_rendezvous": _first([joining.first_line(RDZV_START, t_action)]) if joining else None,
        # torch's agent log line, or elastictrain's first event of the recovery (the in-process
        # agent logs neither "Worker group FAILED" nor "Detected N new nodes").
        "detected": _first([a.first_line(DETECTED, t_action) for a in agents]
                           + [(t_action + e["dt"], None) for e in _run_events(job.setup, t_action)]),
        "rendezvous_started": _first([a.first_line(RDZV_START, t_action) for a in agents]),
        "all_agents_in_rendezvous": _last([a.first_line(RDZV_START, t_action) for a in agents if a.alive()]),
        "rendezvous_done": _last([a.first_line(RDZV_DONE, t_action) for a in agents]),
        "worker_process_started": latest("boot", "proc_start"),
        "imports_done": latest("boot", "imports_done"),
        "process_group_ready": latest("pg"),
        "model_built": latest("model"),
        "checkpoint_group_ready": latest("ckpt_group"),
        "checkpoint_restored": latest("restored"),
        "ddp_built": latest("ddp"),
        "session_ready": latest("ready"),  # _train_session.py: group formed, state restored or received, DDP built
        "first_step": first_step,
    }
    return {k: (None if v is None else round(v - t_action, 4)) for k, v in milestones.items()}


def phases(milestones: dict[str, float | None]) -> dict[str, float]:
    """Durations between consecutive milestones; a missing one merges into the next phase."""
    out: dict[str, float] = {}
    previous_name, previous = "action", 0.0
    for name, value in milestones.items():
        if value is None:
            continue
        out[f"{previous_name}->{name}"] = round(max(0.0, value - previous), 4)
        previous_name, previous = name, value
    return out


def _step_interval(steps: list[dict[str, Any]], lo: float, hi: float) -> float | None:
    """Median seconds between rank 0's consecutive steps completed in (lo, hi)."""
    times = sorted(e["t"] for e in steps if e["rank"] == 0 and lo < e["t"] <= hi)
    gaps = [b - a for a, b in zip(times, times[1:])]
    return statistics.median(gaps) if gaps else None


def _latest_by_rank(steps: list[dict[str, Any]], world: int, before: float = float("inf")) -> dict[int, dict[str, Any]]:
    """Each rank's latest step event at world size ``world`` completed before ``before``."""
    out: dict[int, dict[str, Any]] = {}
    for e in steps:
        if e["world_size"] == world and e["t"] <= before and (e["rank"] not in out or e["t"] > out[e["rank"]]["t"]):
            out[e["rank"]] = e
    return out


def steps_redone(steps: list[dict[str, Any]]) -> int:
    """Step numbers that some rank completed more than once (a restart from a checkpoint redoes them)."""
    seen: dict[tuple[int, int], int] = {}
    for e in steps:
        key = (e["rank"], e["step"])
        seen[key] = seen.get(key, 0) + 1
    return len({step for (_, step), count in seen.items() if count > 1})


def survivor_pause(steps: list[dict[str, Any]], nodes: list[str], t_action: float, world_after: int) -> float | None:
    """The longest gap between consecutive steps of one surviving node's workers, from its last
    step before ``t_action`` to its first step at ``world_after`` (None if one never gets there)."""
    pauses = []
    for node in nodes:
        times = sorted(e["t"] for e in steps if e["node"] == node)
        before = [t for t in times if t <= t_action]
        after = sorted(e["t"] for e in steps
                       if e["node"] == node and e["t"] > t_action and e["world_size"] == world_after)
        if not before or not after:
            return None
        window = [t for t in times if before[-1] <= t <= after[0]]
        pauses.append(max((b - a for a, b in zip(window, window[1:])), default=0.0))
    return max(pauses) if pauses else None


def _run_events(setup: TrialSetup, t_action: float) -> list[dict[str, Any]]:
    """elastictrain's own events of the run after the action (recoveries, restarts, failures)."""
    path = setup.workdir / "elastictrain-runs" / f"bench-{setup.trial}" / "events.jsonl"
    out = []
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return out
    keep = {"recovery", "restart", "worker_failure", "membership_change", "hang"}
    for line in lines:
        try:
            e = json.loads(line)
        except ValueError:
            continue
        if e.get("kind") in keep and e.get("ts", 0) > t_action:
            fields = {k: v for k, v in e.items() if k not in ("ts", "run_id", "failures")}
            out.append({"dt": round(e["ts"] - t_action, 4), **fields})
    return out


def run_trial(setup: TrialSetup, etcd_window: float = 0.0) -> dict[str, Any]:
    """One trial: start, train to the action step, act, time the recovery, stop.

    Args:
        setup: What to run.
        etcd_window: With an etcd launcher, also measure the load the job puts on etcd
            (from its ``/metrics``): at start-up, during ``etcd_window`` seconds of
            steady training before the action, and during the recovery.
    """
    s = setup.scenario
    job = Job(setup)
    result: dict[str, Any] = {"launcher": setup.launcher, "scenario": s.name, "trial": setup.trial,
                              "script": setup.script_name()}
    measure_etcd = etcd_window > 0 and setup.etcd is not None and setup.launcher.startswith("elastictrain")
    etcd_load: dict[str, Any] = {}
    try:
        metrics_at_launch = scrape_metrics(str(setup.etcd)) if measure_etcd else None
        launched = time.time()
        for node in range(s.nodes):
            job.start_node(node)
        world = s.world_before

        def training() -> bool:
            return any(e["world_size"] == world for e in job.events.steps())

        def warmed() -> bool:
            return any(e["world_size"] == world and e["step"] >= setup.action_step for e in job.events.steps())

        if metrics_at_launch is not None and wait_until(training, setup.start_timeout, poll=0.01):
            etcd_load["startup"] = metrics_delta(metrics_at_launch, scrape_metrics(str(setup.etcd)),
                                                 time.time() - launched)
        # A job whose agents all exited (it failed at start) is not waited for.
        wait_until(lambda: warmed() or not any(a.alive() for a in job.agents.values()), setup.start_timeout,
                   poll=0.01)
        if not warmed():
            result.update(error=f"did not reach step {setup.action_step} in {setup.start_timeout:g}s",
                          failed_agents=job.failed_agents())
            return result
        if measure_etcd:
            steady_from, t0 = scrape_metrics(str(setup.etcd)), time.time()
            time.sleep(etcd_window)
            steady = metrics_delta(steady_from, scrape_metrics(str(setup.etcd)), time.time() - t0)
            steady["requests_per_s_per_node"] = steady["requests_per_s"] / world
            steady["received_bytes_per_s_per_node"] = steady["received_bytes_per_s"] / world
            etcd_load["steady"] = steady
        steps = job.events.steps()
        first_step_at = min(e["t"] for e in steps)
        result["launch_to_first_step_s"] = first_step_at - launched
        old_pids = {e["pid"] for e in job.events.poll()}
        workers = _latest_by_rank(steps, world)
        training_nodes = sorted({w["node"] for w in workers.values()})
        pids_before = {node: {w["pid"] for w in workers.values() if w["node"] == node} for node in training_nodes}

        if setup.kill_at > 0 and s.name in ("worker_crash", "node_loss"):
            # A crash lands anywhere in a step: wait the fraction of a step past the latest one.
            interval = _step_interval(steps, first_step_at + 0.5, time.time()) or 0.0
            latest = max(e["t"] for e in steps if e["world_size"] == world)
            time.sleep(max(0.0, latest + setup.kill_at * interval - time.time()))
            steps = job.events.steps()
            workers = _latest_by_rank(steps, world)
        metrics_before = scrape_metrics(str(setup.etcd)) if measure_etcd else None
        killed_node: str | None = None
        spare: str | None = None
        if s.name == "worker_crash":
            victim = workers[max(workers)]
            t_action = time.time()
            kill_pids([victim["pid"]])
            result["killed"] = {"rank": victim["rank"], "node": victim["node"], "pid": victim["pid"]}
        elif s.name in ("node_loss", "hot_spare"):
            if s.name == "hot_spare":
                spares = [str(n) for n in range(s.nodes) if str(n) not in training_nodes]
                spare = spares[0] if len(spares) == 1 else None
                if spare is None:
                    result.update(error=f"expected one spare node, found training nodes {training_nodes}")
                    return result
                result["spare_node"] = spare
            victim = max((w for w in workers.values() if w["node"] != "0"), key=lambda w: w["rank"])
            killed_node = victim["node"]
            agent = job.agents[int(killed_node)].pid
            pids = [agent] + [p for p in processes_of(setup.trial, killed_node) if p != agent]
            t_action = time.time()
            kill_pids(pids)
            result["killed"] = {"node": killed_node, "rank": victim["rank"], "pids": pids}
        else:  # node_join, node_join_own_core
            result["cold_import_s"] = cold_import_seconds(setup.env(s.nodes), setup.cpus(s.nodes))
            proc = job.start_node(s.nodes)
            t_action = proc.started

        def last_before() -> int:
            return max(e["step"] for e in job.events.steps() if e["t"] <= t_action)

        def recovered() -> dict[str, Any] | None:
            done = [e for e in job.events.steps() if e["t"] > t_action and e["world_size"] == s.world_after]
            if s.name == "worker_crash" or s.past_last_step:
                past = last_before()
                done = [e for e in done if e["step"] > past]
            elif s.name == "hot_spare":
                done = [e for e in done if e["node"] == spare]
            return min(done, key=lambda e: e["t"]) if done else None

        first = wait_until(recovered, setup.recovery_timeout, poll=0.01)
        if first is None:
            result.update(error=f"no step at world size {s.world_after} within {setup.recovery_timeout:g}s",
                          failed_agents=job.failed_agents())
            return result
        if metrics_before is not None:
            etcd_load["recovery"] = metrics_delta(metrics_before, scrape_metrics(str(setup.etcd)),
                                                  time.time() - t_action)
        # A few more steps: training goes on, and the post-recovery step time.
        wait_until(lambda: sum(1 for e in job.events.steps() if e["t"] > first["t"] and e["rank"] == 0) >= 6,
                   15, poll=0.05)
        all_steps = job.events.steps()
        restored = [e["step"] for e in job.events.poll()
                    if e["event"] == "restored" and e["pid"] not in old_pids and e["t"] > t_action]
        restored += [e["restored"] for e in job.events.poll()
                     if e["event"] == "ready" and e.get("restored") is not None and e["pid"] not in old_pids
                     and e["t"] > t_action]
        survivors = [n for n in training_nodes if n != killed_node and not (s.name == "worker_crash"
                                                                             and n == result["killed"]["node"])]
        after = [e for e in all_steps if e["t"] >= first["t"]]
        pids_after = {n: sorted({e["pid"] for e in after if e["node"] == n}) for n in survivors}
        milestones = _profile(job, t_action, old_pids, first["t"])
        result.update(
            recovery_s=first["t"] - t_action,
            first_step_after={"step": first["step"], "rank": first["rank"], "node": first["node"],
                              "world_size": first["world_size"]},
            last_step_before=last_before(),
            restored_step=min(restored) if restored else None,
            steps_redone=steps_redone(all_steps),
            survivor_pids_kept=bool(survivors) and all(
                pids_after[n] and set(pids_after[n]) <= pids_before[n] for n in survivors),
            survivor_pids={n: {"before": sorted(pids_before[n]), "after": pids_after[n]} for n in survivors},
            step_time_before_s=_step_interval(all_steps, first_step_at + 0.5, t_action),
            step_time_after_s=_step_interval(all_steps, first["t"], float("inf")),
            milestones=milestones,
            phases=phases(milestones),
        )
        if s.name in JOIN_SCENARIOS:
            result["survivor_pause_s"] = survivor_pause(all_steps, training_nodes, t_action, s.world_after)
        if setup.launcher.startswith("elastictrain"):
            result["run_events"] = _run_events(setup, t_action)
        return result
    finally:
        if etcd_load:
            result["etcd_load"] = etcd_load
        job.stop()


COLD_IMPORTS = "import torch, torch.nn.parallel, torch._dynamo"
"""What a joining node's worker imports before it can build DDP (DDP's constructor imports
``torch._dynamo``), whatever the launcher."""


def cold_import_seconds(env: dict[str, str], cpus: set[int] | None = None) -> float:
    """Wall time of a fresh interpreter importing :data:`COLD_IMPORTS` (under the load there is now),
    on ``cpus`` (None: any)."""
    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", COLD_IMPORTS], env=env, stdout=subprocess.DEVNULL)
    if cpus is not None:
        os.sched_setaffinity(proc.pid, cpus)
    if proc.wait() != 0:
        raise subprocess.CalledProcessError(proc.returncode, proc.args)
    return time.perf_counter() - started


@contextlib.contextmanager
def private_etcd() -> Iterator[Any]:
    from elastictrain.etcd import EtcdServer

    server = EtcdServer().start()
    try:
        yield server
    finally:
        server.stop()


def _aggregate(trials: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {
        "recovery_s": summarize(t.get("recovery_s") for t in trials),
        "steps_redone": summarize(t.get("steps_redone") for t in trials if "recovery_s" in t),
        "survivor_pause_s": summarize(t.get("survivor_pause_s") for t in trials if "survivor_pause_s" in t),
        "cold_import_s": summarize(t.get("cold_import_s") for t in trials if "cold_import_s" in t),
        "survivor_pids_kept": sum(1 for t in trials if t.get("survivor_pids_kept")),
        "trials_timed": sum(1 for t in trials if "recovery_s" in t),
        "step_time_before_s": summarize(t.get("step_time_before_s") for t in trials if "recovery_s" in t),
        "launch_to_first_step_s": summarize(t.get("launch_to_first_step_s") for t in trials
                                            if "launch_to_first_step_s" in t),
        "errors": [t["error"] for t in trials if "error" in t],
    }
    phase_names: list[str] = []
    for t in trials:
        for name in t.get("milestones", {}):
            if name not in phase_names:
                phase_names.append(name)
    out["milestones_median_s"] = {
        name: summarize(t["milestones"].get(name) for t in trials if "milestones" in t)["median"]
        for name in phase_names
    }
    out["phases_median_s"] = phases(out["milestones_median_s"])
    # In-process: rank 0's account of each re-formation (where its seconds went).
    reformed = [e for t in trials for e in t.get("run_events", [])
                if e.get("kind") == "recovery" and REFORMATION_PHASES[0] in e]
    if reformed:
        out["reformation_s"] = {name: summarize(e[name] for e in reformed)
                                for name in ("seconds", *REFORMATION_PHASES)}
    return out


def run(scenarios: list[str], launchers: list[str], reps: int, action_step: int = 25,
        recovery_timeout: float = 180.0, start_timeout: float = 240.0, workroot: Path | None = None,
        keep: bool = False, etcd_window: float = 0.0, log=print, state_mb: float | None = None,
        torchrun_script: str = "ddp", sharding: str = "ddp") -> dict[str, Any]:
    """All trials, interleaved: for each scenario and repetition, every launcher once (order rotated).

    With ``etcd_window``, the first ``elastictrain`` worker-crash trial also measures
    the job's etcd load (see :func:`run_trial`); it is reported as ``etcd_load``.
    ``state_mb`` sizes both training scripts' model (None: each script's default);
    ``torchrun_script`` is ``"ddp"`` (``_train.py``) or ``"session"`` (``_train_session.py``);
    ``sharding`` is the Session script's (``"fsdp"``/``"hsdp"`` recover in place too).
    """
    join_flag = _elastictrain_has_join()
    root = Path(tempfile.mkdtemp(prefix="bench-recovery-", dir=workroot))
    results: dict[str, Any] = {"scenarios": {}, "elastictrain_join_flag": join_flag, "action_step": action_step,
                               "state_mb": state_mb, "sharding": sharding,
                               "scripts": {ln: script_of(ln, torchrun_script) for ln in launchers}}
    try:
        with private_etcd() as etcd:
            for name in scenarios:
                trials: dict[str, list[dict[str, Any]]] = {ln: [] for ln in launchers}
                for rep in range(reps):
                    order = launchers[rep % len(launchers):] + launchers[:rep % len(launchers)]
                    for launcher in order:
                        workdir = root / f"{name}-{launcher}-{rep}"
                        workdir.mkdir(parents=True)
                        setup = TrialSetup(launcher, SCENARIO[name], workdir, etcd.endpoint, action_step,
                                           recovery_timeout, start_timeout, join_flag, state_mb=state_mb,
                                           torchrun_script=torchrun_script, sharding=sharding)
                        window = etcd_window if (launcher == "elastictrain" and name == "worker_crash"
                                                 and "etcd_load" not in results) else 0.0
                        trial = run_trial(setup, etcd_window=window)
                        trial["rep"] = rep
                        if window and "etcd_load" in trial:
                            results["etcd_load"] = {"nodes": SCENARIO[name].nodes, "window_s": window,
                                                    **trial["etcd_load"]}
                        trials[launcher].append(trial)
                        shown = (f"{trial['recovery_s']:.2f}s, redone {trial.get('steps_redone')}, "
                                 f"survivors kept pids {trial.get('survivor_pids_kept')}"
                                 + (f", survivor pause {trial['survivor_pause_s']:.2f}s"
                                    if trial.get("survivor_pause_s") is not None else "")
                                 if "recovery_s" in trial else f"FAILED: {trial.get('error')}")
                        log(f"[recovery] {name} rep {rep} {launcher}: {shown}")
                        if "error" not in trial and not keep:
                            shutil.rmtree(workdir, ignore_errors=True)
                entry: dict[str, Any] = {ln: {**_aggregate(ts), "trials": ts} for ln, ts in trials.items()}
                for ours in ("elastictrain", "elastictrain_inprocess"):
                    if ours in entry:
                        for other in launchers:
                            if other != ours:
                                entry[f"ratio_{ours}_over_{other}"] = ratio(
                                    entry[ours]["recovery_s"], entry[other]["recovery_s"])
                results["scenarios"][name] = entry
    finally:
        if not any(root.iterdir()):  # failed trials keep their logs for a look
            root.rmdir()
    results["kept_failed_trial_dirs"] = str(root) if root.exists() else None
    return results


TABLE_ROWS = {
    "worker_crash": "Worker kill → first step past the last pre-kill step",
    "node_loss": "Node loss (3 → 2 nodes) → first step at world size 2",
    "hot_spare": "Hot spare (3 nodes, max 2): training node lost → spare's first step at world size 2",
    "node_join": "Join (2 → 3 nodes) → first step at world size 3, from the new agent's launch",
    "node_join_own_core": "Join, the new node on a core of its own (the training nodes on the other)",
}


def _cell(summary: dict[str, Any] | None, digits: int = 2, unit: str = " s") -> str:
    if not summary or summary.get("median") is None:
        failed = (summary or {}).get("failed", 0)
        return f"failed ({failed})" if failed else "—"
    text = f"{summary['median']:.{digits}f}{unit}"
    if summary.get("n", 1) > 1:
        text += f" ({summary['min']:.{digits}f}–{summary['max']:.{digits}f})"
    if summary.get("failed"):
        text += f" [{summary['failed']} failed]"
    return text


def _reformation(phases: dict[str, Any] | None) -> str:
    """Medians of rank 0's re-formations: ``0.30 s; 0.02 / 0.16 / 0.12 / 0.00``."""
    if not phases:
        return "—"
    parts = " / ".join(f"{phases[name]['median']:.2f}" for name in REFORMATION_PHASES)
    return f"{phases['seconds']['median']:.2f} s; {parts}"


def markdown_table(results: dict[str, Any]) -> str:
    """The recovery results as one compact markdown table: median (min–max) per cell."""
    scenarios = results.get("scenarios", {})
    launchers = [ln for ln in LAUNCHERS if any(isinstance(e.get(ln), dict) for e in scenarios.values())]
    scripts = results.get("scripts", {})
    head = "| scenario | " + " | ".join(f"{ln} (`{scripts.get(ln, '?')}`)" for ln in launchers) + " |"
    lines = [head, "|---" * (len(launchers) + 1) + "|"]

    def row(title: str, cells: list[str]) -> None:
        lines.append(f"| {title} | " + " | ".join(cells) + " |")

    for name, entry in scenarios.items():
        stats = [entry.get(ln) for ln in launchers]
        row(TABLE_ROWS.get(name, name), [_cell(e["recovery_s"]) if e else "—" for e in stats])
        if name in JOIN_SCENARIOS:
            row("↳ survivors' pause (longest gap between their steps)",
                [_cell(e.get("survivor_pause_s")) if e else "—" for e in stats])
            row("↳ for reference: a bare `" + COLD_IMPORTS + "`, same load, just before the launch",
                [_cell(e.get("cold_import_s")) if e else "—" for e in stats])
        row("↳ committed steps redone", [_cell(e["steps_redone"], digits=0, unit="") if e else "—" for e in stats])
        row("↳ trials where the survivors kept their pids",
            [f"{e['survivor_pids_kept']}/{e['trials_timed']}" if e else "—" for e in stats])
        if any(e and "reformation_s" in e for e in stats):
            row("↳ rank 0's re-formation: in all; waiting for the generation / joining the group / the state / DDP",
                [_reformation(e.get("reformation_s")) if e else "—" for e in stats])
    state = results.get("state_mb")
    lines.append("")
    lines.append(f"Median (min–max) over {results.get('reps', '?')} repetition(s); seconds from the SIGKILL (join: "
                 f"from starting the new agent); model state {state if state is not None else 'per script default'} "
                 "MB (parameters + AdamW).")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--launchers", default=",".join(LAUNCHERS))
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--action-step", type=int, default=25)
    parser.add_argument("--recovery-timeout", type=float, default=180.0)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--keep", action="store_true", help="keep every trial's logs and events")
    parser.add_argument("--state-mb", type=float, default=100.0,
                        help="model parameters + AdamW state of both training scripts, MB (0: each script's default)")
    parser.add_argument("--torchrun-script", choices=("ddp", "session"), default="ddp",
                        help="torchrun launchers run _train.py (ddp) or _train_session.py (session)")
    parser.add_argument("--sharding", choices=("ddp", "fsdp", "hsdp"), default="ddp",
                        help="the Session script's sharding (the _train.py launchers stay DDP)")
    args = parser.parse_args(argv)
    scenarios = [s for s in args.scenarios.split(",") if s]
    launchers = [ln for ln in args.launchers.split(",") if ln]
    for name in scenarios:
        if name not in SCENARIOS:
            parser.error(f"unknown scenario {name!r}; choose from {SCENARIOS}")
    for name in launchers:
        if name not in LAUNCHERS:
            parser.error(f"unknown launcher {name!r}; choose from {LAUNCHERS}")
    result = run(scenarios, launchers, args.reps, args.action_step, args.recovery_timeout,
                 keep=args.keep, log=lambda m: print(m, file=sys.stderr, flush=True),
                 state_mb=args.state_mb or None, torchrun_script=args.torchrun_script, sharding=args.sharding)
    record = {"benchmark": "recovery", "machine": machine(), "reps": args.reps, **result}
    emit_with_table(record, markdown_table(record), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
