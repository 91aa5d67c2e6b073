"""Hangs as they happen, and work that only looks like one: how long until training goes on, and
what is (never) replaced. The issue-40 table.

Every trial is a 2-node job (one worker a node, ``elastictrain run --recovery in-process``
with its defaults, a private etcd) of ``benchmarks/_train_session.py`` paced at ``--step-ms``
(50 ms) a step, with a ``--state-mb`` (1 MB) model, that meets one case at step ``--at`` (40):

- ``hang_sleep`` / ``hang_spin``: rank 1 blocks in a call (``time.sleep``) or spins in Python
  inside the step, for good (``ELASTICTRAIN_INJECT``; its process keeps running).
  ``regained_s``: from the last step applied before it to the first step past it at world size 2;
  ``survivor_kept``: rank 0 trains on in the same process.
- ``straggler``: rank 1 is 10x slower (``--straggle-s``, 0.5 s more) for 12 steps;
- ``eval_between``: rank 0 runs 20 s (``--slow-s``) of its own code between two steps;
- ``long_call``: rank 0 sleeps 20 s inside a step, wrapped in ``session.long_call``;
- ``first_step``: every rank's first step takes 20 s more.
  For these four: ``replaced`` (workers found hung and killed, from the run's ``hang`` events;
  expected 0) and ``named`` (the straggler's ``straggler`` event).
- ``link_cut`` (root, ``--link-cut``), ``kill_in_save`` and ``disk_full`` (root, ``--storage``):
  through the chaos harness, see :func:`chaos_trial`; ``regained_s`` is the harness's recovery time.

``--torchrun`` adds one trial of each hang under stock ``torchrun`` (c10d rendezvous, tuned as
in ``benchmarks/recovery.py``), where the hung rank is found only by its peer's collective
timeout (the Session's 60 s) and every worker restarts from the last checkpoint.

    python benchmarks/hangs.py --reps 3 --link-cut --storage --torchrun --out benchmarks/results/hangs.json

Prints the JSON line on stdout and a markdown table on stderr (and beside ``--out`` as ``.md``).
Run it alone: its numbers are wall-clock times.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import (
    BENCH_DIR,
    BIN_DIR,
    NODE_ENV,
    TRIAL_ENV,
    EventLog,
    Proc,
    emit,
    free_port,
    kill_pids,
    machine,
    processes_of,
    summarize,
    wait_until,
)

HANGS = ("hang_sleep", "hang_spin")
SLOW = ("straggler", "eval_between", "long_call", "first_step")
SCRIPT = BENCH_DIR / "_train_session.py"


def _case(case: str, args: argparse.Namespace, nodes: int = 2) -> tuple[dict[str, str], list[str], int]:
    """The injected faults, the script's extra arguments and the steps the trial trains for."""
    at = args.at
    if case in HANGS:
        return {"ELASTICTRAIN_INJECT": f"{case}@1:{at}"}, [], at + 20
    if case == "straggler":
        return {"ELASTICTRAIN_INJECT": f"slow@1:{at}x12+{args.straggle_s:g}"}, [], at + 40
    if case == "eval_between":
        return {}, ["--between-sleep", f"{at}:{args.slow_s:g}"], at + 10
    if case == "long_call":
        return {}, ["--long-call", f"{at}:{args.slow_s:g}"], at + 10
    if case == "first_step":
        return {}, ["--first-step-sleep", f"{args.slow_s:g}"], at + 10
    raise ValueError(case)


def run_trial(case: str, launcher: str, args: argparse.Namespace, endpoint: str, index: int) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix=f"bench-hang-{case}-"))
    (work / "inject").mkdir()
    trial = f"hang-{case}-{launcher}-{index}-{os.getpid()}"
    inject, extra, steps = _case(case, args)
    events_path, run_events = work / "steps.jsonl", work / "events.jsonl"
    script = [str(SCRIPT), "--events", str(events_path), "--ckpt-dir", str(work / "ckpt"), "--steps", str(steps),
              "--state-mb", str(args.state_mb), "--ckpt-every", "20", "--step-sleep", str(args.step_ms / 1000), *extra]
    procs = []
    rdzv_port = free_port()
    for node in range(2):
        env = {**os.environ, TRIAL_ENV: trial, NODE_ENV: f"node{node}", "OMP_NUM_THREADS": "1",
               "ELASTICTRAIN_INJECT_STATE": str(work / "inject"), **inject}
        if launcher == "elastictrain":
            cmd = [str(BIN_DIR / "elastictrain"), "run", "--etcd", endpoint, "--run-id", trial, "--min-nodes", "2",
                   "--max-nodes", "2", "--local-addr", "127.0.0.1", "--event-log", str(run_events), *script]
        else:
            env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
            cmd = [str(BIN_DIR / "torchrun"), "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                   "--rdzv-endpoint", f"127.0.0.1:{rdzv_port}", "--rdzv-id", trial, "--max-restarts", "3",
                   "--monitor-interval", "0.05", "--rdzv-conf",
                   f"is_host={'1' if node == 0 else '0'},last_call_timeout=1,keep_alive_interval=1,"
                   "keep_alive_max_attempt=3", *script]
        procs.append(Proc(cmd, env, work / f"node{node}.log"))
    log = EventLog(events_path)
    try:
        done = wait_until(lambda: all(not p.alive() for p in procs), args.trial_timeout, poll=0.2)
    finally:
        for proc in procs:
            proc.stop()
        kill_pids(processes_of(trial))
    steps_seen = log.steps()
    record: dict[str, Any] = {"case": case, "launcher": launcher, "finished": bool(done),
                              "exit_codes": [p.popen.returncode for p in procs], "work": str(work)}
    run = [json.loads(line) for line in run_events.read_text().splitlines()] if run_events.exists() else []
    record["replaced"] = sum(1 for e in run if e.get("kind") == "hang")
    record["named"] = [{"rank": e.get("rank"), "factor": e.get("factor")} for e in run if e.get("kind") == "straggler"]
    if case in HANGS:
        # The hang begins once every rank applied the step before it, the first time (a restart
        # from a checkpoint applies it again later).
        first_before: dict[int, float] = {}
        for s in steps_seen:
            if s["step"] == args.at - 1:
                first_before.setdefault(s["rank"], s["t"])
        after = [s for s in steps_seen if s["step"] >= args.at and s["world_size"] == 2]
        record["regained_s"] = (round(min(s["t"] for s in after) - max(first_before.values()), 3)
                                if first_before and after else None)
        rank0 = {s["pid"] for s in steps_seen if s["rank"] == 0}
        record["survivor_kept"] = len(rank0) == 1 if launcher == "elastictrain" else None
        stacks = [e.get("stack") for e in run if e.get("kind") == "hang"]
        record["stack"] = stacks[0][:2] if stacks and stacks[0] else None
    return record


def chaos_trial(case: str, args: argparse.Namespace, index: int) -> dict[str, Any]:
    """One fault through the chaos harness (``elastictrain.chaos``, the demo job at ``--step-ms``):
    ``link_cut`` (3 nodes in network namespaces, one cut off its peers for 20 s), ``kill_in_save``
    (2 nodes, ``--save-mb`` of state: a worker SIGKILLed the moment it saves) or ``disk_full``
    (2 nodes, the checkpoints on a 1 GB tmpfs filled for 5 s). ``regained_s`` is the harness's
    recovery time (to the first step of the group formed after it; for ``disk_full``, to the
    first step after a save it could not write, which it waits for); ``lost`` counts steps redone."""
    from elastictrain.chaos import ChaosConfig, parse_schedule, run_chaos

    run_dir = Path(tempfile.mkdtemp(prefix=f"bench-{case}-")) / "run"
    nodes = 3 if case == "link_cut" else 2
    ballast = ("--ballast-mb", f"{args.save_mb:g}") if case == "kill_in_save" else ()
    result = run_chaos(ChaosConfig(
        script=str(Path(__file__).resolve().parent.parent / "elastictrain" / "chaos" / "_demo_job.py"),
        script_args=("--ckpt", "{run_dir}/ckpt", "--samples", "192", "--epochs", "2", "--ckpt-every", "2",
                     "--step-time", str(args.step_ms / 1000), *ballast),
        run_dir=str(run_dir), nodes=nodes, min_nodes=2, max_nodes=nodes,
        schedule=tuple(parse_schedule(f"{case}@6")), seed=index, netns=case == "link_cut", partition=20,
        checkpoint_disk_mb=1024 if case == "disk_full" else 0, reference=False,
    ))
    fault = result.report["faults"][0]
    return {"case": case, "launcher": "elastictrain", "regained_s": fault["recovery_s"], "note": fault["note"],
            "lost": fault.get("steps_redone"), "ok": result.ok, "work": str(run_dir)}


def markdown(results: dict[str, Any]) -> str:
    rows = ["| case | launcher | regained (median, min-max) | replaced | survivor kept | named | n |",
            "|---|---|---|---|---|---|---|"]
    for key, summary in results["summary"].items():
        case, launcher = key.split("/")
        regained = summary["regained_s"]
        cell = (f"{regained['median']:.2f} s ({regained['min']:.2f}-{regained['max']:.2f})"
                if regained["median"] is not None else "-")
        rows.append(f"| {case} | {launcher} | {cell} | {summary['replaced']} | {summary['survivor_kept']} | "
                    f"{summary['named']} | {summary['n']} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default=",".join(HANGS + SLOW))
    parser.add_argument("--reps", type=int, default=3, help="trials of each hang case")
    parser.add_argument("--slow-reps", type=int, default=1, help="trials of each slow-work case")
    parser.add_argument("--at", type=int, default=40)
    parser.add_argument("--step-ms", type=float, default=50.0)
    parser.add_argument("--state-mb", type=float, default=1.0)
    parser.add_argument("--straggle-s", type=float, default=0.5)
    parser.add_argument("--slow-s", type=float, default=20.0)
    parser.add_argument("--trial-timeout", type=float, default=240.0)
    parser.add_argument("--torchrun", action="store_true", help="one trial of each hang under stock torchrun")
    parser.add_argument("--link-cut", action="store_true", help="(root) link_cut trials through the chaos harness")
    parser.add_argument("--storage", action="store_true", help="(root) kill_in_save and disk_full trials through "
                        "the chaos harness")
    parser.add_argument("--save-mb", type=float, default=60.0, help="state kill_in_save's job saves, MB")
    parser.add_argument("--skip-loop", action="store_true", help="only the chaos-harness trials")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)

    from elastictrain.etcd import EtcdServer

    started, load = time.time(), os.getloadavg()
    trials: list[dict[str, Any]] = []
    server = EtcdServer().start()
    try:
        for case in ([] if args.skip_loop else args.cases.split(",")):
            for index in range(args.reps if case in HANGS else args.slow_reps):
                trials.append(run_trial(case, "elastictrain", args, server.endpoint, index))
                print(f"{case}: {trials[-1]}", file=sys.stderr, flush=True)
            if args.torchrun and case in HANGS:
                trials.append(run_trial(case, "torchrun", args, server.endpoint, 0))
                print(f"{case} (torchrun): {trials[-1]}", file=sys.stderr, flush=True)
    finally:
        server.stop()
    chaos_cases = (["link_cut"] if args.link_cut else []) + (["kill_in_save", "disk_full"] if args.storage else [])
    for case in chaos_cases:
        for index in range(args.reps):
            trials.append(chaos_trial(case, args, index))
            print(f"{case}: {trials[-1]}", file=sys.stderr, flush=True)
    summary: dict[str, Any] = {}
    for key in dict.fromkeys(f"{t['case']}/{t['launcher']}" for t in trials):
        group = [t for t in trials if f"{t['case']}/{t['launcher']}" == key]
        summary[key] = {"n": len(group), "regained_s": summarize(t.get("regained_s") for t in group),
                        "replaced": [t.get("replaced") for t in group],
                        "survivor_kept": [t.get("survivor_kept") for t in group],
                        "named": [len(t.get("named") or []) for t in group]}
    results = {"benchmark": "hangs", "machine": machine(), "started": started, "duration_s": time.time() - started,
               "loadavg_start": load, "loadavg_end": os.getloadavg(), "settings": vars(args) | {"out": str(args.out)},
               "trials": trials, "summary": summary}
    table = markdown(results)
    print(table, file=sys.stderr)
    if args.out is not None:
        args.out.with_suffix(".md").parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".md").write_text(table + "\n")
    emit(results, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
