"""Per-step time and per-rank state of a ``Session`` with ``sharding="ddp"``, ``"fsdp"`` and ``"hsdp"``,
at world size 4.

Four worker processes (gloo, a file store) train the same model (an MLP of ``--layers`` square
layers holding ``--mb`` MB of float32 parameters, AdamW) with
``Session(process_group=WORLD, sharding=MODE)``; hsdp on a 2x2 mesh (two "nodes" of two ranks on
this machine). In each repetition the three sessions run one after another, in an order that
rotates from one repetition to the next so that a shared machine's load falls on all three
alike; each times ``--steps`` steps after ``--warmup`` (rank 0's clock: the collectives keep the
ranks in step). Reported per mode: the median steps/s over ``--reps`` (min-max), the slowdown
against DDP, and each rank's bytes of parameters and optimizer state (what sharding saves: DDP
holds all of it, fsdp about a quarter, hsdp about a half); the load average before and after.
Prints a table, one JSON line, and writes the JSON to ``--out``.

    python benchmarks/sharded_step.py --mb 100 --reps 5 --out benchmarks/results/sharded_step.json
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
    add_step_options, emit, finish_gloo_worker, layer_width, machine, run_gloo_workers, summarize, worker_or_main,
)

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "sharded_step.json"
MODES = ("ddp", "fsdp", "hsdp")
WORLD = 4
GLOBAL_BATCH = 16


def _local_bytes(tensors: Any) -> int:
    from torch.distributed.tensor import DTensor

    total = 0
    for tensor in tensors:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        total += local.numel() * local.element_size()
    return total


def _run(mode: str, width: int, layers: int, warmup: int, steps: int) -> tuple[float, int]:
    """Steps/s of one session and this rank's bytes of parameters and optimizer state."""
    import torch
    import torch.distributed as dist
    from torch.utils.data import TensorDataset

    import elastictrain
    from elastictrain.train.worker import WorkerContext

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh())
                                  for _ in range(layers)], torch.nn.Linear(width, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = torch.Generator().manual_seed(1)
    total = warmup + steps
    dataset = TensorDataset(torch.randn(GLOBAL_BATCH * total, width, generator=data),
                            torch.randn(GLOBAL_BATCH * total, 1, generator=data))
    context = dataclasses.replace(WorkerContext.from_env({}), local_world_size=2)  # hsdp: 2 "nodes" of 2
    started = time.perf_counter()
    with elastictrain.Session(model, optimizer, dataset, global_batch_size=GLOBAL_BATCH, max_steps=total,
                              seed=0, log_every=None, process_group=dist.group.WORLD, context=context,
                              sharding=mode) as session:
        for index, step in enumerate(session.steps()):
            if index == warmup:  # the warmup steps are applied once the loop asks for this one
                started = time.perf_counter()
            for micro in step:
                inputs, targets = micro.batch
                micro.backward(torch.nn.functional.mse_loss(session.model(inputs), targets))
        elapsed = time.perf_counter() - started  # the last step is applied when the loop ends
        state = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
        held = _local_bytes(list(model.parameters()) + state)
    return steps / elapsed, held


def _worker(rank: int, store: str, options: dict[str, Any]) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    width = layer_width(options["mb"], options["layers"])
    rates: dict[str, list[float]] = {mode: [] for mode in MODES}
    held: dict[str, list[int]] = {mode: [] for mode in MODES}
    for rep in range(options["reps"]):
        for mode in MODES[rep % len(MODES):] + MODES[:rep % len(MODES)]:
            rate, state = _run(mode, width, options["layers"], options["warmup"], options["steps"])
            rates[mode].append(rate)
            held[mode].append(state)
    everyone: list[Any] = [None] * WORLD
    dist.all_gather_object(everyone, held)
    finish_gloo_worker(rank, {"width": width, "rates": rates, "held": everyone}, options["result"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_step_options(parser, layers=4, out=DEFAULT_OUT)
    args = parser.parse_args()
    before = machine()
    raw = run_gloo_workers(__file__, WORLD, {**vars(args), "out": None})
    results: dict[str, Any] = {}
    ddp = statistics.median(raw["rates"]["ddp"])
    for mode in MODES:
        rate = summarize(raw["rates"][mode])
        held = [statistics.median(rank[mode]) for rank in raw["held"]]
        results[mode] = {"steps_per_s": rate, "slowdown_vs_ddp": ddp / rate["median"],
                         "state_mb_per_rank": [round(b / 1e6, 2) for b in held]}
    record = {"benchmark": "sharded_step", "world_size": WORLD, "mb": args.mb, "layers": args.layers,
              "width": raw["width"], "steps": args.steps, "warmup": args.warmup, "reps": args.reps,
              "results": results, "machine": before, "loadavg_after": machine()["loadavg_1_5_15"]}
    print("| mode | steps/s, median (min-max) | step time / DDP's | state MB per rank |\n|---|---|---|---|",
          file=sys.stderr)
    for mode, r in results.items():
        s = r["steps_per_s"]
        print(f"| {mode} | {s['median']:.2f} ({s['min']:.2f}-{s['max']:.2f}) | {r['slowdown_vs_ddp']:.2f}x "
              f"| {', '.join(f'{mb:g}' for mb in r['state_mb_per_rank'])} |", file=sys.stderr)
    emit(record, args.out)


if __name__ == "__main__":
    worker_or_main(_worker, main)
