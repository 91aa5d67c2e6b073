"""The load one elastictrain job puts on etcd: requests and bytes, at rest and during rendezvous.

Runs the benchmark job (``benchmarks/_train.py``, one worker per node) under
``elastictrain run`` against a private etcd that serves nothing else, and reads
etcd's Prometheus ``/metrics`` between phases:

- ``startup``: from launching the agents to the first training step (the first
  rendezvous, the workers' store traffic, the status records);
- ``steady``: ``--window`` seconds of training with nothing happening (heartbeats,
  lease keep-alives, status polls), the load to size etcd for;
- ``recovery``: from SIGKILLing one worker to the first step after recovery (one
  rendezvous round and the new round's store).

A request is one gRPC message etcd received (a unary call, or one message on a
lease keep-alive or watch stream); bytes are etcd's client gRPC bytes received and
sent. Per-node rates are the job's rates divided by its node count.

    python benchmarks/etcd_load.py --nodes 2,3 --window 30
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import emit, machine
from benchmarks.recovery import Scenario, TrialSetup, _elastictrain_has_join, private_etcd, run_trial


def measure(nodes: int, window: float, workroot: Path, timeout: float = 240.0) -> dict[str, Any]:
    """Load of one ``nodes``-node elastictrain job on a fresh etcd: startup, steady state, one recovery."""
    workdir = Path(tempfile.mkdtemp(prefix=f"etcd-load-{nodes}-", dir=workroot))
    scenario = Scenario("worker_crash", nodes=nodes, min_nodes=nodes, max_nodes=nodes, world_after=nodes)
    try:
        with private_etcd() as etcd:
            setup = TrialSetup("elastictrain", scenario, workdir, etcd.endpoint, action_step=5,
                               recovery_timeout=timeout, start_timeout=timeout, join_flag=_elastictrain_has_join())
            trial = run_trial(setup, etcd_window=window)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    out: dict[str, Any] = {"nodes": nodes, "window_s": window, **trial.get("etcd_load", {})}
    if "error" in trial:
        out["error"] = trial["error"]
    else:
        out["recovery_s"] = trial["recovery_s"]
    return out


def run(node_counts: list[int], window: float, log=print) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="bench-etcd-load-"))
    try:
        jobs = []
        for n in node_counts:
            result = measure(n, window, root)
            jobs.append(result)
            if "error" in result or "steady" not in result:
                log(f"[etcd_load] {n} nodes: FAILED: {result.get('error')}")
            else:
                log(f"[etcd_load] {n} nodes: steady {result['steady']['requests_per_s']:.1f} req/s, "
                    f"{result['steady']['received_bytes_per_s'] / 1024:.1f} KiB/s in; recovery "
                    f"{result['recovery']['requests']:.0f} requests")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {"window_s": window, "jobs": jobs}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", default="2", help="node counts, comma separated (one job each)")
    parser.add_argument("--window", type=float, default=30.0, help="seconds of steady state to measure")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    counts = [int(n) for n in args.nodes.split(",") if n]
    if not counts or min(counts) < 1 or args.window <= 0:
        parser.error("need node counts >= 1 and a positive window")
    result = run(counts, args.window, log=lambda m: print(m, file=sys.stderr, flush=True))
    emit({"benchmark": "etcd_load", "machine": machine(), **result}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
