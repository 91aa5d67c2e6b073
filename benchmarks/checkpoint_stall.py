"""How long a checkpoint blocks the training loop: sync vs async ``CheckpointManager.save`` vs ``torch.save``.

For each model size the state is the model plus its AdamW state (after one step,
so the checkpoint is about 3x the model). Each repetition times:

- ``torch.save``: a plain ``torch.save`` of the same state dicts to one file
  (no fsync, no manifest, no commit): the floor a hand-rolled loop pays.
- ``sync save``: ``CheckpointManager.save`` with ``async_save=False``; the loop is
  blocked until the checkpoint is durable and committed.
- ``async stall``: ``CheckpointManager.save`` with ``async_save=True``; the loop is
  blocked only while the state is copied to CPU memory.
- ``async total``: the same save until it has committed in the background
  (``save`` + ``wait``), i.e. how soon the next save may start without waiting.

Statistics are over ``--reps`` repetitions after ``--warmup`` uncounted ones; the
JSON also records each measurement's first (cold) sample.

Usage::

    python benchmarks/checkpoint_stall.py --sizes 10,100 --reps 7
    python benchmarks/checkpoint_stall.py --sizes 1000 --dir /mnt/shared/tmp

The table goes to stderr; one JSON line goes to stdout and to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from elastictrain.checkpoint import CheckpointManager

WIDTH = 512  # every layer is WIDTH x WIDTH fp32 = 1 MiB, so sizes come out close


def build_state(size_mb: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """Return a model of about ``size_mb`` MiB of fp32 parameters and an AdamW with state."""
    torch.manual_seed(0)
    layers = max(1, round(size_mb * 2**20 / (WIDTH * WIDTH * 4)))
    model = torch.nn.Sequential(*(torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(layers)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, WIDTH)).sum().backward()
    opt.step()
    return model, opt


def summary(samples: list[float]) -> dict[str, float]:
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples)}


def measure(size_mb: int, reps: int, warmup: int, root: Path) -> dict[str, Any]:
    model, opt = build_state(size_mb)
    state = {"model": model, "optimizer": opt}
    times: dict[str, list[float]] = {"torch_save": [], "sync_save": [], "async_stall": [], "async_total": []}

    for rep in range(warmup + reps):
        path = root / f"plain-{size_mb}-{rep}.pt"
        start = time.perf_counter()
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
        times["torch_save"].append(time.perf_counter() - start)
        path.unlink()

    with CheckpointManager(root / f"sync-{size_mb}", keep_last=1) as mgr:
        for rep in range(warmup + reps):
            start = time.perf_counter()
            mgr.save(rep, state)
            times["sync_save"].append(time.perf_counter() - start)
        checkpoint_bytes = sum(f.stat().st_size for f in (root / f"sync-{size_mb}").rglob("*") if f.is_file())

    with CheckpointManager(root / f"async-{size_mb}", keep_last=1, async_save=True) as mgr:
        for rep in range(warmup + reps):
            start = time.perf_counter()
            mgr.save(rep, state)
            stalled = time.perf_counter() - start
            # Training goes on while the background writes: mutate what was snapshotted.
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(0.999)
            mgr.wait()
            times["async_stall"].append(stalled)
            times["async_total"].append(time.perf_counter() - start)

    # The first saves are cold (fresh allocations fault in every page); report them
    # apart from the steady state a long training run sees.
    return {
        "size_mb": size_mb,
        "checkpoint_mb": round(checkpoint_bytes / 2**20, 1),
        **{name: {**summary(samples[warmup:]), "first": samples[0]} for name, samples in times.items()},
    }


def table(results: list[dict[str, Any]]) -> str:
    columns = [("torch_save", "torch.save"), ("sync_save", "sync save"), ("async_stall", "async stall"),
               ("async_total", "async total")]
    head = f"{'model MB':>8} {'ckpt MB':>8} " + " ".join(f"{title + ' s (med [min-max])':>27}" for _, title in columns)
    lines = [head, "-" * len(head)]
    for r in results:
        cells = " ".join(
            f"{r[key]['median']:>9.3f} [{r[key]['min']:.3f}-{r[key]['max']:.3f}]".rjust(27) for key, _ in columns
        )
        lines.append(f"{r['size_mb']:>8} {r['checkpoint_mb']:>8} {cells}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="10,100", help="model sizes in MiB, comma separated (e.g. 10,100,1000)")
    parser.add_argument("--reps", type=int, default=7, help="repetitions per measurement")
    parser.add_argument("--warmup", type=int, default=1, help="uncounted repetitions first (reported as 'first')")
    parser.add_argument("--dir", type=Path, default=None, help="where to write checkpoints (default: a temp dir)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "checkpoint_stall.json")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    if not sizes or min(sizes) < 1 or args.reps < 1 or args.warmup < 0:
        parser.error(f"need sizes > 0, reps > 0, warmup >= 0; got {args.sizes!r}, {args.reps}, {args.warmup}")

    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(max(1, (os.cpu_count() or 1)))
    root = Path(tempfile.mkdtemp(prefix="ckpt-stall-", dir=args.dir))
    try:
        results = [measure(size, args.reps, args.warmup, root) for size in sizes]
    finally:
        shutil.rmtree(root, ignore_errors=True)

    print(table(results), file=sys.stderr)
    record = {
        "benchmark": "checkpoint_stall",
        "unit": "seconds",
        "reps": args.reps,
        "warmup": args.warmup,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "dir": str(args.dir or tempfile.gettempdir()),
        "time": time.time(),
        "results": results,
    }
    line = json.dumps(record, sort_keys=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(line + "\n")
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
