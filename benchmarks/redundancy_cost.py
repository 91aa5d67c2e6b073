"""Step time of a ``Session(sharding="fsdp")`` without in-memory redundancy and with
``redundancy_every`` 1, 10 and 100 (issue 41's target: <= 5 % at a 50 ms step refreshed every
step), and each rank's host memory for the copies against its shard of the state.

For each world size of ``--worlds`` (default 2 and 4), that many worker processes (gloo, a file
store; two "nodes" of ``world / 2`` ranks, so each rank's copy goes to the other node) train the
same transformer-like model (``--layers`` encoder blocks of width ``--width``, one FSDP unit each,
AdamW) for ``--steps`` steps after ``--warmup``. With ``--target-step-ms`` the width is picked
first for that world: short runs without copies, the width scaled by the square root of the time
ratio until the step is within 10 % (or 5 tries; the chosen width and its step are reported).
In each repetition the configurations run one after another, in an order that rotates from one
repetition to the next so that a shared machine's load falls on all alike; each times its steps
on rank 0's clock (the collectives keep the ranks in step) and reports the mean step time (what
the refreshes cost, stalls included), its median over ``--reps`` (min-max), the overhead against
no redundancy (the ratio of the medians, and the median (min-max) of each repetition's ratio to its
own run without copies: on 2 busy cores one 200-step run differs from the next by up to +-20 %,
so a few per cent of overhead is not resolved by a handful of repetitions; the stall and the CPU
per refresh below are), the process's CPU time per step (all its threads, gloo's included: what the copies
take from a core, less sensitive to a shared machine's load than the step time), the training
thread's stall per refresh (the vote, handing the shards over, any wait of the next optimizer step
for the copy), the CPU time per refresh of the training thread (``Redundancy.training_cpu``) and
of the sending thread (``Redundancy.thread_cpu``), refreshes done and skipped, and each rank's host
memory for the copies, at the end (between refreshes) and at the peak, against its shard.

Which world is fair on a 2-core machine: 2 ranks, one core each, as a GPU job has its cores per
rank; 4 ranks share 2 cores, so the copies' CPU work (the snapshot's memcpy, the socket's copies
on both ends) is taken straight from training's, which a real job's spare host cores would do.
Prints a table per world, one JSON line, and writes the JSON to ``--out``.

    python benchmarks/redundancy_cost.py --target-step-ms 50 --reps 5 --out benchmarks/results/redundancy_cost.json
    python benchmarks/redundancy_cost.py --width 32 --layers 2 --seq 8 --steps 12 --reps 1   # a smoke run
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._common import (  # noqa: E402 - after the path is set
    emit_with_table, finish_gloo_worker, machine, run_gloo_workers, summarize, worker_or_main,
)

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "redundancy_cost.json"
GLOBAL_BATCH = 16
CALIBRATION_TRIES = 5
CALIBRATION_STEPS = 10


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
    context = dataclasses.replace(WorkerContext.from_env({}), local_world_size=options["world"] // 2)
    started, cpu = time.perf_counter(), time.process_time()
    with elastictrain.Session(model, optimizer, dataset, global_batch_size=GLOBAL_BATCH, max_steps=total,
                              seed=0, log_every=None, process_group=dist.group.WORLD, context=context,
                              sharding="fsdp", redundancy_every=every) as session:
        for index, step in enumerate(session.steps()):
            if index == options["warmup"]:  # the warmup steps are applied once the loop asks for this one
                started, cpu = time.perf_counter(), time.process_time()
            for micro in step:
                inputs, targets = micro.batch
                micro.backward(torch.nn.functional.mse_loss(session.model(inputs), targets))
        elapsed = time.perf_counter() - started  # the last step is applied when the loop ends
        cpu = time.process_time() - cpu
        redundancy = session._keeper.strategy.redundancy  # noqa: SLF001 - what the session's strategy keeps
        tensors = [*model.parameters(), *(t for s in optimizer.state.values() for t in s.values()
                                          if isinstance(t, torch.Tensor))]
        shard = sum((t.to_local() if isinstance(t, DTensor) else t).numel() * t.element_size() for t in tensors)
    out: dict[str, Any] = {"step_s": elapsed / options["steps"], "cpu_s": cpu / options["steps"], "shard_bytes": shard}
    if redundancy is not None:
        started_refreshes = max(redundancy.started, 1)
        out.update(refreshed=redundancy.refreshed, skipped=redundancy.skipped, host_bytes=redundancy.host_bytes,
                   peak_host_bytes=redundancy.peak_host_bytes,
                   stall_s=redundancy.stalled / max(redundancy.started + redundancy.skipped, 1),
                   training_cpu_s=redundancy.training_cpu / max(redundancy.started + redundancy.skipped, 1),
                   thread_cpu_s=redundancy.thread_cpu / started_refreshes)
    return out


def _calibrate(options: dict[str, Any]) -> tuple[int, float]:
    """The width whose step without copies is about ``target_step_ms`` (see the module
    docstring), and that step in ms; every rank gets rank 0's measurements."""
    import torch.distributed as dist

    width, target = options["width"], options["target_step_ms"]
    tries = 0
    while True:
        tries += 1
        trial = {**options, "width": width, "steps": CALIBRATION_STEPS, "warmup": 2}
        measured = [_run(None, trial)["step_s"] * 1e3]
        dist.broadcast_object_list(measured, src=0)
        step_ms = measured[0]
        scaled = max(16, round(width * math.sqrt(target / step_ms) / 16) * 16)  # 4 heads: a multiple of 4
        if abs(step_ms / target - 1) <= 0.1 or scaled == width or tries == CALIBRATION_TRIES:
            return width, step_ms  # the width measured last, with its step
        width = scaled


def _worker(rank: int, store: str, options: dict[str, Any]) -> None:
    import torch.distributed as dist

    world = options["world"]
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    calibrated = None
    if options["target_step_ms"] is not None:
        width, step_ms = _calibrate(options)
        options = {**options, "width": width}
        calibrated = {"width": width, "step_ms": step_ms}
    configs: list[int | None] = [None, *options["every"]]
    runs: dict[str, Any] = {str(e): [] for e in configs}
    for rep in range(options["reps"]):
        shift = rep % len(configs)
        for every in configs[shift:] + configs[:shift]:
            runs[str(every)].append(_run(every, options))
    runs["width"], runs["calibrated"] = options["width"], calibrated
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, runs)
    finish_gloo_worker(rank, everyone, options["result"])


def _median(runs: list[dict[str, Any]], name: str) -> float:
    return statistics.median(r[name] for r in runs) if runs and name in runs[0] else 0.0


def _results(everyone: list[Any], every: list[int]) -> dict[str, Any]:
    """One world's entries: each configuration's step time and overhead, and what the copies cost."""
    base = statistics.median(r["step_s"] for r in everyone[0]["None"])
    results: dict[str, Any] = {}
    for name in ["None", *(str(e) for e in every)]:
        runs = everyone[0][name]
        step = summarize([r["step_s"] * 1e3 for r in runs])
        # Each repetition ran the configurations one after another: its ratio to that repetition's
        # run without copies cancels the machine's drift between repetitions.
        paired = [r["step_s"] / b["step_s"] - 1 for r, b in zip(runs, everyone[0]["None"], strict=True)]
        entry: dict[str, Any] = {"step_ms": step, "overhead": step["median"] / (base * 1e3) - 1,
                                 "overhead_paired": summarize(paired),
                                 "cpu_ms_per_step": [round(_median(rank[name], "cpu_s") * 1e3, 2) for rank in everyone]}
        if name != "None":
            shard = [_median(rank[name], "shard_bytes") for rank in everyone]
            entry.update(stall_ms_per_refresh=_median(runs, "stall_s") * 1e3,
                         training_cpu_ms_per_refresh=_median(runs, "training_cpu_s") * 1e3,
                         thread_cpu_ms_per_refresh=_median(runs, "thread_cpu_s") * 1e3,
                         refreshed=[r["refreshed"] for r in runs], skipped=[r["skipped"] for r in runs],
                         shard_mb_per_rank=[round(b / 1e6, 3) for b in shard],
                         host_mb_per_rank=[round(_median(rank[name], "host_bytes") / 1e6, 3) for rank in everyone],
                         peak_host_mb_per_rank=[round(_median(rank[name], "peak_host_bytes") / 1e6, 3)
                                                for rank in everyone],
                         host_shards=max(_median(rank[name], "host_bytes") / b for rank, b in zip(everyone, shard)),
                         peak_host_shards=max(_median(rank[name], "peak_host_bytes") / b
                                              for rank, b in zip(everyone, shard)))
        results["off" if name == "None" else f"every_{name}"] = entry
    return results


def _table(world: int, entry: dict[str, Any]) -> str:
    calibrated = entry["calibrated"]
    lines = [f"world {world} (2 nodes x {world // 2}), width {entry['width']}"
             + (f" (calibrated: {calibrated['step_ms']:.1f} ms without copies)" if calibrated else ""),
             "| redundancy | step ms, median (min-max) | overhead | overhead in each repetition, median (min-max) "
             "| process CPU ms/step | stall ms/refresh "
             "| CPU ms/refresh: training, sending thread | refreshed, skipped "
             "| host MB/rank at rest, peak (shard MB) | in shards, at rest / peak |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in entry["results"].items():
        s = r["step_ms"]
        extra = "- | - | - | - | -"
        if "refreshed" in r:
            extra = (f"{r['stall_ms_per_refresh']:.2f} | {r['training_cpu_ms_per_refresh']:.2f}, "
                     f"{r['thread_cpu_ms_per_refresh']:.2f} | {r['refreshed']}, {r['skipped']} | "
                     f"{max(r['host_mb_per_rank']):g}, {max(r['peak_host_mb_per_rank']):g} "
                     f"({max(r['shard_mb_per_rank']):g}) | {r['host_shards']:.2f} / {r['peak_host_shards']:.2f}")
        p = r["overhead_paired"]
        lines.append(f"| {name} | {s['median']:.1f} ({s['min']:.1f}-{s['max']:.1f}) | {100 * r['overhead']:+.1f} % "
                     f"| {100 * p['median']:+.1f} % ({100 * p['min']:+.1f} to {100 * p['max']:+.1f} %) "
                     f"| {max(r['cpu_ms_per_step']):.1f} | {extra} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", type=lambda s: [int(x) for x in s.split(",")], default=[2, 4],
                        help="comma-separated world sizes, each 2 nodes of half (default 2,4)")
    parser.add_argument("--width", type=int, default=256,
                        help="the blocks' width (4 heads, 4x feed-forward); the first try with --target-step-ms")
    parser.add_argument("--target-step-ms", type=float, default=None,
                        help="pick the width for this step time without copies, per world (e.g. 50)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64, help="tokens per sample")
    parser.add_argument("--steps", type=int, default=200, help="timed steps (>= 100 for every=100 to refresh)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--every", type=lambda s: [int(x) for x in s.split(",")], default=[1, 10, 100],
                        help="comma-separated redundancy_every values (default 1,10,100)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    if (args.steps < 1 or args.reps < 1 or args.width % 4 or args.width < 4 or any(e < 1 for e in args.every)
            or any(w < 2 or w % 2 for w in args.worlds)
            or (args.target_step_ms is not None and args.target_step_ms <= 0)):
        sys.exit("--steps, --reps, --every and --target-step-ms must be positive, --width a positive multiple "
                 "of 4 and each of --worlds an even number >= 2")
    before = machine()
    worlds: dict[str, Any] = {}
    for world in args.worlds:
        everyone = run_gloo_workers(__file__, world, {**vars(args), "world": world, "out": None})
        worlds[str(world)] = {"nproc_per_node": world // 2, "width": everyone[0]["width"],
                              "calibrated": everyone[0]["calibrated"], "results": _results(everyone, args.every)}
    record = {"benchmark": "redundancy_cost", "worlds": worlds, "layers": args.layers, "seq": args.seq,
              "global_batch": GLOBAL_BATCH, "steps": args.steps, "warmup": args.warmup, "reps": args.reps,
              "target_step_ms": args.target_step_ms, "machine": before,
              "loadavg_after": machine()["loadavg_1_5_15"],
              "fair": "world 2: one core per rank on this 2-core machine; world 4 oversubscribes it"}
    emit_with_table(record, "\n\n".join(_table(int(w), e) for w, e in worlds.items()), args.out)


if __name__ == "__main__":
    worker_or_main(_worker, main)
