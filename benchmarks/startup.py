"""Time from launch to the first training step of a 2-node job, and its rendezvous.

Runs the same 2-node x 1-worker gloo job (tests/scripts/ddp_steps.py) several times
with ``elastictrain run --local-nodes 2`` (private etcd included in the time) and with
stock ``torchrun --rdzv-backend c10d`` (two agents, tuned last_call), and reports
medians, min and max. Prints a table and writes one JSON document.

    python benchmarks/startup.py --reps 5 --out benchmarks/results/startup.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "scripts" / "ddp_steps.py"
_TIMEOUT_S = 120
"""A job of a few steps takes seconds: one that runs this long hangs."""
RDZV_LINE = re.compile(r"rendezvous round \d+ complete in ([0-9.]+)s")


def _first_step(out: Path) -> float:
    return min(json.loads(p.read_text())["first_step_at"] for p in out.glob("rank-*.json"))


def _finish(cmds: list[list[str]], what: str) -> str:
    """Run ``cmds`` side by side; the first one's stderr. A job that hangs (a torch teardown
    deadlock, pytorch#75097, has been seen in both launchers) is killed after ``_TIMEOUT_S``,
    and its output's end is printed before the benchmark fails."""
    with tempfile.TemporaryDirectory() as logs:
        files = [open(Path(logs) / f"{i}.err", "w+") for i in range(len(cmds))]  # noqa: SIM115 - closed below
        procs = [subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
                 for cmd, err in zip(cmds, files)]
        deadline = time.monotonic() + _TIMEOUT_S
        try:
            for proc in procs:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for proc in procs:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        texts = []
        for err in files:
            err.seek(0)
            texts.append(err.read())
            err.close()
    if any(proc.returncode != 0 for proc in procs):
        hung = any(proc.returncode == -signal.SIGKILL for proc in procs)
        raise RuntimeError(f"{what} {'hung for %d s' % _TIMEOUT_S if hung else 'failed'}; its output ended:\n"
                           + "\n---\n".join(t[-4000:] for t in texts))
    return texts[0]


def run_elastictrain() -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out"
        started = time.time()
        stderr = _finish([[sys.executable, "-m", "elastictrain", "run", "--local-nodes", "2", "--min-nodes", "2",
                           str(SCRIPT), str(out)]], "the elastictrain job")
        rdzv = [float(x) for x in RDZV_LINE.findall(stderr)]
        return {"launch_to_first_step_s": _first_step(out) - started, "rendezvous_s": max(rdzv)}


def run_torchrun() -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out"
        port = 29000 + int(time.time() * 1000) % 2000
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "bench",
               "--rdzv-conf", "last_call_timeout=1", "--local-addr", "127.0.0.1", str(SCRIPT), str(out)]
        started = time.time()
        _finish([cmd, cmd], "the torchrun job")
        return {"launch_to_first_step_s": _first_step(out) - started}


def summarize(samples: list[float]) -> dict[str, float]:
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "startup.json"))
    args = parser.parse_args()

    runs: dict[str, list[dict[str, float]]] = {"elastictrain": [], "torchrun_c10d": []}
    for _ in range(args.reps):  # interleaved, so drift on a noisy machine hits both alike
        runs["elastictrain"].append(run_elastictrain())
        runs["torchrun_c10d"].append(run_torchrun())
    report = {
        "benchmark": "startup",
        "reps": args.reps,
        "elastictrain": {k: summarize([r[k] for r in runs["elastictrain"]]) for k in runs["elastictrain"][0]},
        "torchrun_c10d": {k: summarize([r[k] for r in runs["torchrun_c10d"]]) for k in runs["torchrun_c10d"][0]},
    }
    report["ratio_launch_to_first_step"] = (
        report["elastictrain"]["launch_to_first_step_s"]["median"]
        / report["torchrun_c10d"]["launch_to_first_step_s"]["median"]
    )
    print("| launcher | launch -> first step (median, min-max) | rendezvous (median) |")
    print("|---|---|---|")
    for name in ("elastictrain", "torchrun_c10d"):
        first = report[name]["launch_to_first_step_s"]
        rdzv = report[name].get("rendezvous_s", {}).get("median")
        rdzv_text = f"{rdzv:.2f} s" if rdzv is not None else "n/a"
        print(f"| {name} | {first['median']:.2f} s ({first['min']:.2f}-{first['max']:.2f}) | {rdzv_text} |")
    print(f"ratio elastictrain/torchrun: {report['ratio_launch_to_first_step']:.2f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(json.dumps(report))


if __name__ == "__main__":
    main()
