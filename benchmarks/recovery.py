"""Recovery time of a training job: a worker crash, a node loss, a node join.

Every trial runs ``benchmarks/_train.py`` (plain DDP on gloo, one worker per node,
a checkpoint every 10 steps) under one launcher, lets it train to ``--action-step``,
then:

- ``worker_crash``: SIGKILL the worker of the highest rank (2 nodes);
  recovered at the first step completed by a new worker process.
- ``node_loss``: SIGKILL a whole node, its agent and its worker, as a machine dying
  (3 nodes, min 2); recovered at the first step at world size 2. The node killed
  is never node 0, which hosts torchrun's c10d store (losing it ends a torchrun job).
- ``node_join``: start one more node agent (2 nodes, max 3); recovered at the first
  step at world size 3. The clock starts when the new agent's process is started.

Launchers, each run on the same script and interleaved trial by trial:

- ``elastictrain``: ``elastictrain run --etcd ...`` with its defaults, one agent per node;
- ``elastictrain_prev``: the same command of an earlier elastictrain, installed in a
  virtualenv of its own, whose ``elastictrain`` executable ``$BENCH_PREV_ELASTICTRAIN``
  names (e.g. ``git worktree add /tmp/prev c56d2b4 && cd /tmp/prev && python3 -m venv
  .venv && .venv/bin/pip install "torch==2.13.*" -e ".[etcd]"``): our previous mode,
  measured in the same run;
- ``torchrun_default``: ``torchrun --rdzv-backend c10d`` with torch's defaults;
- ``torchrun_tuned``: the same with ``--monitor-interval 0.05 --rdzv-conf
  last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3``.

Both torchrun variants run with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (with the
shared store a restarted group often never recovers) and ``--max-restarts 3`` like
elastictrain (torchrun's default of 0 turns any failure into the end of the job);
node 0 hosts the c10d store (``is_host``), as on a real cluster where only the
endpoint host matches.

Each trial also records where the recovery time went, from the agents' log lines
(timestamped by this driver as they arrive) and the workers' JSON events: failure
detected, rendezvous done, worker process started, imports done, process group
up, model and optimizer built, checkpoint group up, checkpoint restored, DDP
built, first step.

    python benchmarks/recovery.py --scenarios worker_crash --reps 3
"""

from __future__ import annotations

import argparse
import contextlib
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

from benchmarks._common import (  # noqa: E402
    BENCH_DIR, BIN_DIR, NODE_ENV, TRIAL_ENV, EventLog, Proc, emit, free_port, kill_pids, machine,
    metrics_delta, processes_of, ratio, scrape_metrics, summarize, wait_until,
)

SCRIPT = BENCH_DIR / "_train.py"
LAUNCHERS = ("elastictrain", "elastictrain_prev", "torchrun_default", "torchrun_tuned")
PREV_ENV = "BENCH_PREV_ELASTICTRAIN"
SCENARIOS = ("worker_crash", "node_loss", "node_join")
TUNED_CONF = "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3"
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


SCENARIO = {
    "worker_crash": Scenario("worker_crash", nodes=2, min_nodes=2, max_nodes=2, world_after=2),
    "node_loss": Scenario("node_loss", nodes=3, min_nodes=2, max_nodes=3, world_after=2),
    "node_join": Scenario("node_join", nodes=2, min_nodes=2, max_nodes=3, world_after=3),
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
    trial: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    rdzv_port: int = field(default_factory=free_port)

    def command(self, node: int) -> list[str]:
        s = self.scenario
        script = [str(SCRIPT), "--events", str(self.workdir / "events.jsonl"),
                  "--ckpt-dir", str(self.workdir / "ckpt")]
        if self.launcher.startswith("elastictrain"):
            front = ([str(BIN_DIR / "elastictrain")] if self.launcher == "elastictrain"
                     else [prev_elastictrain()])
            cmd = [*front, "run", "--etcd", str(self.etcd), "--run-id", f"bench-{self.trial}",
                   "--min-nodes", str(s.min_nodes), "--max-nodes", str(s.max_nodes),
                   "--local-addr", "127.0.0.1", "--max-restarts", str(MAX_RESTARTS)]
            if self.join_flag:
                # Every node, not only the late one: elastictrain refuses a node whose run
                # id already trains, and with a 1 s last call a node that starts 2 s after
                # its peers finds round 0 complete without it (see README, product issues).
                cmd.append("--join")
            return cmd + script
        conf = f"is_host={'true' if node == 0 else 'false'}"
        cmd = [str(BIN_DIR / "torchrun"), "--nnodes", f"{s.min_nodes}:{s.max_nodes}", "--nproc-per-node", "1",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{self.rdzv_port}",
               "--rdzv-id", f"bench-{self.trial}", "--local-addr", "127.0.0.1",
               "--max-restarts", str(MAX_RESTARTS)]
        if self.launcher == "torchrun_tuned":
            cmd += ["--monitor-interval", "0.05"]
            conf += "," + TUNED_CONF
        return cmd + ["--rdzv-conf", conf] + script

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


def _first(lines: list[tuple[float, re.Match[str]] | None]) -> float | None:
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
    joining = job.agents.get(job.setup.scenario.nodes) if job.setup.scenario.name == "node_join" else None
    milestones: dict[str, float | None] = {
        "joining_agent_in_rendezvous": _first([joining.first_line(RDZV_START, t_action)]) if joining else None,
        "detected": _first([a.first_line(DETECTED, t_action) for a in agents]),
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
    result: dict[str, Any] = {"launcher": setup.launcher, "scenario": s.name, "trial": setup.trial}
    measure_etcd = etcd_window > 0 and setup.etcd is not None and setup.launcher.startswith("elastictrain")
    etcd_load: dict[str, Any] = {}
    try:
        metrics_at_launch = scrape_metrics(str(setup.etcd)) if measure_etcd else None
        launched = time.time()
        for node in range(s.nodes):
            job.start_node(node)
        world = s.nodes

        def training() -> bool:
            return any(e["world_size"] == world for e in job.events.steps())

        def warmed() -> bool:
            return any(e["world_size"] == world and e["step"] >= setup.action_step for e in job.events.steps())

        if metrics_at_launch is not None and wait_until(training, setup.start_timeout, poll=0.01):
            etcd_load["startup"] = metrics_delta(metrics_at_launch, scrape_metrics(str(setup.etcd)),
                                                 time.time() - launched)
        if not wait_until(warmed, setup.start_timeout, poll=0.01):
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
        current = [e for e in steps if e["world_size"] == world]
        old_pids = {e["pid"] for e in job.events.poll()}
        latest_restart = max(e["restart"] for e in current)
        workers = {e["rank"]: e for e in current if e["restart"] == latest_restart}

        metrics_before = scrape_metrics(str(setup.etcd)) if measure_etcd else None
        if s.name == "worker_crash":
            victim = workers[max(workers)]
            t_action = time.time()
            kill_pids([victim["pid"]])
            result["killed"] = {"rank": victim["rank"], "node": victim["node"], "pid": victim["pid"]}
        elif s.name == "node_loss":
            victim = max((w for w in workers.values() if w["node"] != "0"), key=lambda w: w["rank"])
            node = victim["node"]
            agent = job.agents[int(node)].pid
            pids = [agent] + [p for p in processes_of(setup.trial, node) if p != agent]
            t_action = time.time()
            kill_pids(pids)
            result["killed"] = {"node": node, "rank": victim["rank"], "pids": pids}
        else:  # node_join
            proc = job.start_node(s.nodes)
            t_action = proc.started

        def recovered() -> dict[str, Any] | None:
            done = [e for e in job.events.steps()
                    if e["t"] > t_action and e["pid"] not in old_pids and e["world_size"] == s.world_after]
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
        restored = [e["step"] for e in job.events.poll()
                    if e["event"] == "restored" and e["pid"] not in old_pids and e["t"] > t_action]
        # The old workers train on until they are stopped (a join stops them only once the
        # new node is noticed): everything they did after the restored checkpoint is redone.
        last_before = max(e["step"] for e in job.events.steps() if e["pid"] in old_pids)
        milestones = _profile(job, t_action, old_pids, first["t"])
        result.update(
            recovery_s=first["t"] - t_action,
            last_step_before=last_before,
            restored_step=min(restored) if restored else None,
            steps_redone=(last_before - min(restored)) if restored else None,
            step_time_before_s=_step_interval(job.events.steps(), first_step_at + 0.5, t_action),
            step_time_after_s=_step_interval(job.events.steps(), first["t"], float("inf")),
            milestones=milestones,
            phases=phases(milestones),
        )
        return result
    finally:
        if etcd_load:
            result["etcd_load"] = etcd_load
        job.stop()


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
    return out


def run(scenarios: list[str], launchers: list[str], reps: int, action_step: int = 25,
        recovery_timeout: float = 180.0, start_timeout: float = 240.0, workroot: Path | None = None,
        keep: bool = False, etcd_window: float = 0.0, log=print) -> dict[str, Any]:
    """All trials, interleaved: for each scenario and repetition, every launcher once (order rotated).

    With ``etcd_window``, the first ``elastictrain`` worker-crash trial also measures
    the job's etcd load (see :func:`run_trial`); it is reported as ``etcd_load``.
    """
    join_flag = _elastictrain_has_join()
    root = Path(tempfile.mkdtemp(prefix="bench-recovery-", dir=workroot))
    results: dict[str, Any] = {"scenarios": {}, "elastictrain_join_flag": join_flag, "action_step": action_step}
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
                                           recovery_timeout, start_timeout, join_flag)
                        window = etcd_window if (launcher == "elastictrain" and name == "worker_crash"
                                                 and "etcd_load" not in results) else 0.0
                        trial = run_trial(setup, etcd_window=window)
                        trial["rep"] = rep
                        if window and "etcd_load" in trial:
                            results["etcd_load"] = {"nodes": SCENARIO[name].nodes, "window_s": window,
                                                    **trial["etcd_load"]}
                        trials[launcher].append(trial)
                        shown = (f"{trial['recovery_s']:.2f}s, redone {trial.get('steps_redone')}"
                                 if "recovery_s" in trial else f"FAILED: {trial.get('error')}")
                        log(f"[recovery] {name} rep {rep} {launcher}: {shown}")
                        if "error" not in trial and not keep:
                            shutil.rmtree(workdir, ignore_errors=True)
                entry: dict[str, Any] = {ln: {**_aggregate(ts), "trials": ts} for ln, ts in trials.items()}
                if "elastictrain" in entry:
                    for other in launchers:
                        if other != "elastictrain":
                            entry[f"ratio_elastictrain_over_{other}"] = ratio(
                                entry["elastictrain"]["recovery_s"], entry[other]["recovery_s"])
                results["scenarios"][name] = entry
    finally:
        if not any(root.iterdir()):  # failed trials keep their logs for a look
            root.rmdir()
    results["kept_failed_trial_dirs"] = str(root) if root.exists() else None
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--launchers", default=",".join(LAUNCHERS))
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--action-step", type=int, default=25)
    parser.add_argument("--recovery-timeout", type=float, default=180.0)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--keep", action="store_true", help="keep every trial's logs and events")
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
                 keep=args.keep, log=lambda m: print(m, file=sys.stderr, flush=True))
    emit({"benchmark": "recovery", "machine": machine(), "reps": args.reps, **result}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
