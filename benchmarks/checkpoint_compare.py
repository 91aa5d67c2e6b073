"""How long a checkpoint blocks the training loop: elastictrain, ``torch.save`` and DCP, interleaved.

``benchmarks/checkpoint_stall.py`` (owned by the checkpoint work) times its methods one
after the other (all ``torch.save`` repetitions, then all sync saves, then all async
ones); on a shared machine the load changes between those phases. This script takes
its state (``build_state``: a model of ``--sizes`` MiB plus its AdamW state, about 3x
the model) and, in every repetition, times each method once on the same state:

- ``torch_save``: one ``torch.save`` of the state dicts to one file (no fsync);
- ``torch_save_fsync``: the same followed by ``fsync``: a durable synchronous save;
- ``sync_save``: ``CheckpointManager.save`` with ``async_save=False`` (durable, committed);
- ``async_stall`` / ``async_total``: ``CheckpointManager.save`` with ``async_save=True``
  until it returns (the state is copied to CPU memory) / until it has committed;
- ``dcp_save``: ``torch.distributed.checkpoint.save`` (its writer fsyncs);
- ``dcp_async_stall`` / ``dcp_async_total``: ``torch.distributed.checkpoint.async_save``
  until it returns (the state is staged) / until its future completes.

After each async save the parameters are changed before waiting, as training would.
Everything runs on a one-rank gloo process group (DCP needs one; the manager then
uses its own gloo group, as under DDP). Statistics are over ``--reps`` repetitions
after ``--warmup`` uncounted ones.

    python benchmarks/checkpoint_compare.py --sizes 3,33,333 --reps 5
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.state_dict import get_state_dict  # noqa: E402

from benchmarks._common import emit, free_port, machine, summarize  # noqa: E402
from benchmarks.checkpoint_stall import build_state  # noqa: E402
from elastictrain.checkpoint import CheckpointManager  # noqa: E402

MEASURES = ("torch_save", "torch_save_fsync", "sync_save", "async_stall", "async_total",
            "dcp_save", "dcp_async_stall", "dcp_async_total")


def _mutate(model: torch.nn.Module) -> None:
    with torch.no_grad():  # training goes on while the background write runs
        for p in model.parameters():
            p.mul_(0.999)


def measure(size_mb: int, reps: int, warmup: int, root: Path) -> dict[str, Any]:
    model, opt = build_state(size_mb)
    state = {"model": model, "optimizer": opt}
    times: dict[str, list[float]] = {name: [] for name in MEASURES}
    plain = root / "plain.pt"
    with CheckpointManager(root / "sync", keep_last=1) as sync_mgr, \
            CheckpointManager(root / "async", keep_last=1, async_save=True) as async_mgr:
        for rep in range(warmup + reps):
            start = time.perf_counter()
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, plain)
            times["torch_save"].append(time.perf_counter() - start)
            plain.unlink()

            start = time.perf_counter()
            with open(plain, "wb") as f:
                torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, f)
                f.flush()
                os.fsync(f.fileno())
            times["torch_save_fsync"].append(time.perf_counter() - start)
            plain.unlink()

            start = time.perf_counter()
            sync_mgr.save(rep, state)
            times["sync_save"].append(time.perf_counter() - start)

            start = time.perf_counter()
            async_mgr.save(rep, state)
            times["async_stall"].append(time.perf_counter() - start)
            _mutate(model)
            async_mgr.wait()
            times["async_total"].append(time.perf_counter() - start)

            model_sd, optim_sd = get_state_dict(model, opt)
            target = root / f"dcp-{rep}"
            start = time.perf_counter()
            dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=str(target))
            times["dcp_save"].append(time.perf_counter() - start)
            shutil.rmtree(target)

            model_sd, optim_sd = get_state_dict(model, opt)
            target = root / f"dcp-async-{rep}"
            start = time.perf_counter()
            future = dcp.async_save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=str(target))
            times["dcp_async_stall"].append(time.perf_counter() - start)
            _mutate(model)
            future.result()
            times["dcp_async_total"].append(time.perf_counter() - start)
            shutil.rmtree(target)
        checkpoint_bytes = sum(f.stat().st_size for f in (root / "sync").rglob("*") if f.is_file())
    out: dict[str, Any] = {"size_mb": size_mb, "checkpoint_mb": round(checkpoint_bytes / 2**20, 1)}
    for name, samples in times.items():
        s = summarize(samples[warmup:])
        out[name] = {"median": s["median"], "min": s["min"], "max": s["max"], "first": samples[0]}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="3,33", help="model sizes in MiB (the state is about 3x)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    if not sizes or min(sizes) < 1 or args.reps < 1 or args.warmup < 0:
        parser.error(f"need sizes > 0, reps > 0, warmup >= 0; got {args.sizes!r}, {args.reps}, {args.warmup}")
    logging.basicConfig(level=logging.ERROR)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(max(1, os.cpu_count() or 1))  # as checkpoint_stall.py
    store = dist.TCPStore("127.0.0.1", free_port(), 1, is_master=True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    results = []
    try:
        for size in sizes:
            root = Path(tempfile.mkdtemp(prefix="ckpt-compare-", dir=args.dir))
            try:
                results.append(measure(size, args.reps, args.warmup, root))
            finally:
                shutil.rmtree(root, ignore_errors=True)
    finally:
        dist.destroy_process_group()
    for r in results:
        r["async_stall_over_torch_save"] = r["async_stall"]["median"] / r["torch_save"]["median"]
        r["async_stall_over_torch_save_fsync"] = r["async_stall"]["median"] / r["torch_save_fsync"]["median"]
        r["async_stall_over_dcp_async_stall"] = r["async_stall"]["median"] / r["dcp_async_stall"]["median"]
    emit({"benchmark": "checkpoint_compare", "unit": "seconds", "reps": args.reps, "warmup": args.warmup,
          "dir": str(args.dir or tempfile.gettempdir()), "machine": machine(), "results": results}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
