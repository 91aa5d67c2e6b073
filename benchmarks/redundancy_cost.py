"""Step time of a ``Session(sharding="fsdp")`` without in-memory redundancy and with
``redundancy_every`` 1, 10 and 100, at world size 4 (issue 41's target: <= 5 % at every step).

Four worker processes (gloo, a file store; two "nodes" of two ranks, so each rank's copy goes to
the other node) train the same transformer-like model (``--layers`` encoder blocks of width
``--width``, one FSDP unit each, AdamW) for ``--steps`` steps after ``--warmup``. In each
repetition the configurations run one after another, in an order that rotates from one
repetition to the next so that a shared machine's load falls on all alike; each times its steps
on rank 0's clock (the collectives keep the ranks in step) and reports the mean step time (what
the refreshes cost, stalls included), its median over ``--reps`` (min-max), the overhead against
no redundancy, the training thread's stall per refresh (the vote and the snapshot), refreshes
done and skipped, and each rank's host memory for the copies against its shard of the state.
Prints a table, one JSON line, and writes the JSON to ``--out``.

    python benchmarks/redundancy_cost.py --reps 5 --out benchmarks/results/redundancy_cost.json
    python benchmarks/redundancy_cost.py --width 32 --layers 2 --seq 8 --steps 12 --reps 1   # a smoke run
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._common import (  # noqa: E402 - after the path is set
    emit, finish_gloo_worker, machine, run_gloo_workers, summarize, worker_or_main,
)

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "redundancy_cost.json"
WORLD = 4
NPROC_PER_NODE = 2
GLOBAL_BATCH = 16


def _model(width: int, layers: int) -> Any:
    import torch

    blocks = [torch.nn.TransformerEncoderLayer(width, nhead=4, dim_feedforward=4 * width, dropout=0.0,
                                               batch_first=True) for _ in range(layers)]
    return torch.nn.Sequential(*blocks, torch.nn.Linear(width, width))


def _run(every: int | None, options: dict[str, Any]) -> dict[str, Any]:
    """One session: its mean step time, and what its redundancy did and held."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from torch.utils.data import TensorDataset

    import elastictrain
    from elastictrain.train.worker import WorkerContext

    width, seq = options["width"], options["seq"]
    torch.manual_seed(0)
    model = _model(width, options["layers"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    total = options["warmup"] + options["steps"]
    data = torch.Generator().manual_seed(1)
    dataset = TensorDataset(torch.randn(GLOBAL_BATCH * total, seq, width, generator=data),
                            torch.randn(GLOBAL_BATCH * total, seq, width, generator=data))
    context = dataclasses.replace(WorkerContext.from_env({}), local_world_size=NPROC_PER_NODE)
    started = time.perf_counter()
    with elastictrain.Session(model, optimizer, dataset, global_batch_size=GLOBAL_BATCH, max_steps=total,
                              seed=0, log_every=None, process_group=dist.group.WORLD, context=context,
                              sharding="fsdp", redundancy_every=every) as session:
        for index, step in enumerate(session.steps()):
            if index == options["warmup"]:  # the warmup steps are applied once the loop asks for this one
                started = time.perf_counter()
            for micro in step:
                inputs, targets = micro.batch
                micro.backward(torch.nn.functional.mse_loss(session.model(inputs), targets))
        elapsed = time.perf_counter() - started  # the last step is applied when the loop ends
        redundancy = session._keeper.strategy.redundancy  # noqa: SLF001 - what the session's strategy keeps
        tensors = [*model.parameters(), *(t for s in optimizer.state.values() for t in s.values()
                                          if isinstance(t, torch.Tensor))]
        shard = sum((t.to_local() if isinstance(t, DTensor) else t).numel() * t.element_size() for t in tensors)
    out: dict[str, Any] = {"step_s": elapsed / options["steps"], "shard_bytes": shard}
    if redundancy is not None:
        out.update(refreshed=redundancy.refreshed, skipped=redundancy.skipped, host_bytes=redundancy.host_bytes,
                   stall_s=redundancy.stalled / max(redundancy.started + redundancy.skipped, 1))
    return out


def _worker(rank: int, store: str, options: dict[str, Any]) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    configs: list[int | None] = [None, *options["every"]]
    runs: dict[str, list[dict[str, Any]]] = {str(e): [] for e in configs}
    for rep in range(options["reps"]):
        shift = rep % len(configs)
        for every in configs[shift:] + configs[:shift]:
            runs[str(every)].append(_run(every, options))
    everyone: list[Any] = [None] * WORLD
    dist.all_gather_object(everyone, runs)
    finish_gloo_worker(rank, everyone, options["result"])


def _median(runs: list[dict[str, Any]], name: str) -> float:
    return statistics.median(r[name] for r in runs) if runs and name in runs[0] else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=256, help="the blocks' width (4 heads, 4x feed-forward)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64, help="tokens per sample")
    parser.add_argument("--steps", type=int, default=200, help="timed steps (>= 100 for every=100 to refresh)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--every", type=lambda s: [int(x) for x in s.split(",")], default=[1, 10, 100],
                        help="comma-separated redundancy_every values (default 1,10,100)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    if args.steps < 1 or args.reps < 1 or args.width % 4 or any(e < 1 for e in args.every):
        sys.exit("--steps, --reps and --every must be positive and --width a multiple of 4")
    before = machine()
    everyone = run_gloo_workers(__file__, WORLD, {**vars(args), "out": None})
    base = statistics.median(r["step_s"] for r in everyone[0]["None"])
    results: dict[str, Any] = {}
    for name in ["None", *(str(e) for e in args.every)]:
        runs = everyone[0][name]
        step = summarize([r["step_s"] * 1e3 for r in runs])
        entry: dict[str, Any] = {"step_ms": step, "overhead": step["median"] / (base * 1e3) - 1}
        if name != "None":
            entry.update(stall_ms_per_refresh=_median(runs, "stall_s") * 1e3,
                         refreshed=[r["refreshed"] for r in runs], skipped=[r["skipped"] for r in runs],
                         host_mb_per_rank=[round(_median(rank[name], "host_bytes") / 1e6, 2) for rank in everyone],
                         shard_mb_per_rank=[round(_median(rank[name], "shard_bytes") / 1e6, 2) for rank in everyone])
        results["off" if name == "None" else f"every_{name}"] = entry
    record = {"benchmark": "redundancy_cost", "world_size": WORLD, "nproc_per_node": NPROC_PER_NODE,
              "width": args.width, "layers": args.layers, "seq": args.seq, "global_batch": GLOBAL_BATCH,
              "steps": args.steps, "warmup": args.warmup, "reps": args.reps, "results": results,
              "machine": before, "loadavg_after": machine()["loadavg_1_5_15"]}
    print("| redundancy | step ms, median (min-max) | overhead | stall ms/refresh | refreshed, skipped "
          "| host MB/rank (shard MB) |\n|---|---|---|---|---|---|", file=sys.stderr)
    for name, r in results.items():
        s = r["step_ms"]
        extra = "- | - | -"
        if "refreshed" in r:
            extra = (f"{r['stall_ms_per_refresh']:.2f} | {r['refreshed']}, {r['skipped']} | "
                     f"{max(r['host_mb_per_rank']):g} ({max(r['shard_mb_per_rank']):g})")
        print(f"| {name} | {s['median']:.1f} ({s['min']:.1f}-{s['max']:.1f}) | {100 * r['overhead']:+.1f} % "
              f"| {extra} |", file=sys.stderr)
    emit(record, args.out)


if __name__ == "__main__":
    worker_or_main(_worker, main)
