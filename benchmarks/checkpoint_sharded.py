"""Sharded checkpoints (issue 41): elastictrain's sharded format against ``torch.save`` and DCP, over N gloo ranks.

The state is transformer-like: ``--layers`` blocks of width ``--width`` (attention in/out
projections, a 4x MLP, two norms) and an embedding, each parameter a DTensor sharded on dim 0
over N ranks (uneven where the width does not divide), with its AdamW state (``exp_avg``,
``exp_avg_sq``, ``step``): about 3x the parameters. Phase 1 runs N ranks and times, each
repetition after a barrier and as the slowest rank saw it:

- ``torch_save``: each rank ``torch.save``s its local shards (the plain floor, no fsync);
- ``async_stall``: ``CheckpointManager.save`` with ``async_save=True`` (the loop's stall, warm
  copy buffers: the first save is reported apart), then the state changes and the save is awaited;
- ``overlap_stall``, ``overlap_copy``: with ``overlap=True`` too, the time in ``save`` (the stall
  when the next step's compute covers the copy) and until ``wait_snapshot`` returns right after
  it (the stall when nothing covers it);
- ``torch_save_cpu``, ``overlap_stall_cpu``: the CPU time of the training thread in ``torch.save``
  and in the overlapped ``save`` (``time.thread_time``): what the stall costs that thread, which
  other processes' load on the cores does not change as it changes the wall times;
- ``sync_save``: ``CheckpointManager.save`` until committed (written, fsynced, manifest, rename);
- ``dcp_save``: ``torch.distributed.checkpoint.save`` with its ``FileSystemWriter``.

Phase 2 runs N-1 ranks and times the resharded load of the last sync checkpoint
(``CheckpointManager.restore``) and of DCP's (``FileSystemReader``), into DTensors sharded
over N-1 ranks, and checks both loaded the same values.

Usage (run it alone: every rank competes for the same cores)::

    python benchmarks/checkpoint_sharded.py --ranks 4 --width 512 --layers 8 --reps 5    # 315 MB of state
    python benchmarks/checkpoint_sharded.py --ranks 2 --width 64 --layers 1 --reps 1   # a smoke run

The table goes to stderr; one JSON line to stdout and to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks._common import emit, machine, ratio, summarize

MEASURES = ("torch_save", "async_stall", "async_total", "overlap_stall", "overlap_copy", "sync_save", "dcp_save",
            "torch_save_cpu", "overlap_stall_cpu")
LOADS = ("restore", "dcp_load")


def shapes(width: int, layers: int) -> dict[str, tuple[int, ...]]:
    """The parameters of a transformer-like model: name -> global shape."""
    out: dict[str, tuple[int, ...]] = {"embed.weight": (4 * width + 3, width)}  # odd rows: uneven shards
    for i in range(layers):
        out |= {f"blocks.{i}.attn.in_proj.weight": (3 * width, width), f"blocks.{i}.attn.in_proj.bias": (3 * width,),
                f"blocks.{i}.attn.out_proj.weight": (width, width), f"blocks.{i}.mlp.fc1.weight": (4 * width, width),
                f"blocks.{i}.mlp.fc2.weight": (width, 4 * width), f"blocks.{i}.norm1.weight": (width,),
                f"blocks.{i}.norm2.weight": (width,)}
    return out


class _Holder:
    """A Stateful over a dict of (DTensor) state."""

    def __init__(self, values: dict[str, Any]) -> None:
        self.values = values

    def state_dict(self) -> dict[str, Any]:
        return self.values

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.values = state


def _state(width: int, layers: int, mesh: Any, *, fill: bool) -> dict[str, Any]:
    """Model and AdamW state of DTensors sharded on dim 0 over ``mesh``: random, or zeros (a template)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    def make(shape: tuple[int, ...], seed: int) -> Any:
        full = torch.zeros(shape)
        if fill:
            full = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
        # Every rank builds the same full tensor: each keeps its shard, nothing is scattered.
        return distribute_tensor(full, mesh, [Shard(0)], src_data_rank=None)

    params = {name: make(shape, i) for i, (name, shape) in enumerate(shapes(width, layers).items())}
    optim = {name: {"exp_avg": make(shape, 10_000 + i), "exp_avg_sq": make(shape, 20_000 + i).abs(),
                    "step": torch.tensor(7.0)} for i, (name, shape) in enumerate(shapes(width, layers).items())}
    return {"model": params, "optimizer": {"state": optim, "param_groups": [{"lr": 1e-3, "params": list(params)}]}}


def _locals(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    out: dict[str, torch.Tensor] = {}

    def walk(value: Any, path: str) -> None:
        if isinstance(value, DTensor):
            out[path] = value.to_local()
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(v, f"{path}/{k}")
    walk(state, "")
    return out


def _slowest(seconds: float) -> float:
    import torch.distributed as dist

    value = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value.item())


def _timed(fn: Any) -> float:
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    fn()
    return _slowest(time.perf_counter() - start)


def _save_phase(rank: int, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    from elastictrain.checkpoint import CheckpointManager

    mesh = init_device_mesh("cpu", (args.ranks,))
    state = _state(args.width, args.layers, mesh, fill=True)
    holders = {"model": _Holder(state["model"]), "optimizer": _Holder(state["optimizer"])}
    local = _locals(state)
    total = args.warmup + args.reps
    times: dict[str, list[float]] = {name: [] for name in MEASURES}

    for rep in range(total):
        path = root / f"plain-{rank}-{rep}.pt"
        torch.distributed.barrier()
        start, cpu = time.perf_counter(), time.thread_time()
        torch.save(local, path)
        wall, cpu = time.perf_counter() - start, time.thread_time() - cpu
        times["torch_save"].append(_slowest(wall))
        times["torch_save_cpu"].append(_slowest(cpu))
        path.unlink()
    with CheckpointManager(root / "async", keep_last=1, async_save=True) as mgr:
        for rep in range(total):
            torch.distributed.barrier()
            start = time.perf_counter()
            mgr.save(rep, holders)
            stalled = time.perf_counter() - start
            with torch.no_grad():  # training goes on while the background writes
                for tensor in local.values():
                    tensor.mul_(0.999)
            mgr.wait()
            times["async_total"].append(_slowest(time.perf_counter() - start))
            times["async_stall"].append(_slowest(stalled))
    with CheckpointManager(root / "overlap", keep_last=1, async_save=True, overlap=True) as mgr:
        for rep in range(total):
            torch.distributed.barrier()
            start, cpu = time.perf_counter(), time.thread_time()
            mgr.save(rep, holders)
            stalled, stalled_cpu = time.perf_counter() - start, time.thread_time() - cpu
            mgr.wait_snapshot()  # the copy, had no step's compute covered it
            copied = time.perf_counter() - start
            with torch.no_grad():
                for tensor in local.values():
                    tensor.mul_(0.999)
            mgr.wait()
            times["overlap_stall"].append(_slowest(stalled))
            times["overlap_stall_cpu"].append(_slowest(stalled_cpu))
            times["overlap_copy"].append(_slowest(copied))
    with CheckpointManager(root / "ours", keep_last=1) as mgr:
        for rep in range(total):
            times["sync_save"].append(_timed(lambda: mgr.save(rep, holders)))  # noqa: B023 - called at once
    for rep in range(total):
        where = root / f"dcp-{rep}"
        times["dcp_save"].append(_timed(lambda: dcp.save(state, storage_writer=dcp.FileSystemWriter(where))))  # noqa: B023
        torch.distributed.barrier()
        if rep < total - 1 and rank == 0:
            shutil.rmtree(where)
    size = sum(f.stat().st_size for f in (root / "ours").rglob("*") if f.is_file())
    return {"checkpoint_mb": round(size / 2**20, 1), "times": times}


def _load_phase(rank: int, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    from elastictrain.checkpoint import CheckpointManager

    world = args.ranks - 1
    mesh = init_device_mesh("cpu", (world,))
    total = args.warmup + args.reps
    times: dict[str, list[float]] = {name: [] for name in LOADS}
    ours: dict[str, Any] = {}
    theirs = _state(args.width, args.layers, mesh, fill=False)
    dcp_dir = root / f"dcp-{total - 1}"
    for _ in range(total):
        holders = {"model": _Holder(_state(args.width, args.layers, mesh, fill=False)["model"]),
                   "optimizer": _Holder(_state(args.width, args.layers, mesh, fill=False)["optimizer"])}
        with CheckpointManager(root / "ours") as mgr:
            times["restore"].append(_timed(lambda: mgr.restore(holders)))  # noqa: B023 - called at once
        ours = {"model": holders["model"].values, "optimizer": holders["optimizer"].values}
        theirs = _state(args.width, args.layers, mesh, fill=False)
        times["dcp_load"].append(_timed(lambda: dcp.load(theirs, storage_reader=dcp.FileSystemReader(dcp_dir))))  # noqa: B023
    mine, other = _locals(ours), _locals(theirs)
    same = mine.keys() == other.keys() and all(torch.equal(mine[k], other[k]) for k in mine)
    return {"times": times, "same_values_as_dcp": same}


def _worker(phase: str, rank: int, args: argparse.Namespace, root: Path) -> None:
    import torch.distributed as dist

    world = args.ranks if phase == "save" else args.ranks - 1
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{root}/store-{phase}", rank=rank, world_size=world)
    result = (_save_phase if phase == "save" else _load_phase)(rank, args, root)
    if rank == 0:
        (root / f"{phase}.json").write_text(json.dumps(result))
    dist.barrier()
    os._exit(0)  # without torch's teardown of the gloo group (see tests/support/leave.py)


def _run(phase: str, world: int, argv: list[str], root: Path, timeout: float) -> dict[str, Any]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, __file__, *argv, "--worker", f"{phase}:{rank}", "--root", str(root)],
                              env=env) for rank in range(world)]
    try:
        codes = [p.wait(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    if codes != [0] * world:
        raise RuntimeError(f"{phase} ranks exited with {codes}")
    return dict(json.loads((root / f"{phase}.json").read_text()))


def _stats(samples: list[float], warmup: int) -> dict[str, Any]:
    return {**summarize(samples[warmup:]), "first": samples[0]}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=4, help="gloo ranks that save (N); N-1 load")
    parser.add_argument("--width", type=int, default=512, help="model width (512 and 8 layers: 315 MB of state)")
    parser.add_argument("--layers", type=int, default=8, help="transformer blocks")
    parser.add_argument("--reps", type=int, default=5, help="repetitions per measurement")
    parser.add_argument("--warmup", type=int, default=1, help="uncounted repetitions first (reported as 'first')")
    parser.add_argument("--dir", type=Path, default=None, help="where to write checkpoints (default: a temp dir)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "checkpoint_sharded.json")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds each phase may take")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--root", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.ranks < 2 or args.width < 1 or args.layers < 1 or args.reps < 1 or args.warmup < 0:
        parser.error("need --ranks >= 2, --width, --layers, --reps >= 1 and --warmup >= 0")
    if args.worker is not None:
        phase, rank = args.worker.split(":")
        _worker(phase, int(rank), args, args.root)
        return 0

    params = sum(math.prod(s) for s in shapes(args.width, args.layers).values())
    started = machine()
    root = Path(tempfile.mkdtemp(prefix="ckpt-sharded-", dir=args.dir))
    try:
        saved = _run("save", args.ranks, argv, root, args.timeout)
        loaded = _run("load", args.ranks - 1, argv, root, args.timeout)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    results: dict[str, Any] = {name: _stats(saved["times"][name], args.warmup) for name in MEASURES}
    results |= {name: _stats(loaded["times"][name], args.warmup) for name in LOADS}
    results |= {
        "async_stall_over_torch_save": ratio(results["async_stall"], results["torch_save"]),
        "overlap_stall_over_torch_save": ratio(results["overlap_stall"], results["torch_save"]),
        "overlap_stall_cpu_over_torch_save_cpu": ratio(results["overlap_stall_cpu"], results["torch_save_cpu"]),
        "sync_save_over_dcp_save": ratio(results["sync_save"], results["dcp_save"]),
        "restore_over_dcp_load": ratio(results["restore"], results["dcp_load"]),
        "same_values_as_dcp": loaded["same_values_as_dcp"],
    }
    state_mb = params * 4 * 3 / 2**20
    lines = [f"{args.ranks} ranks save, {args.ranks - 1} load; {state_mb:.0f} MB of state "
             f"({saved['checkpoint_mb']} MB on disk); seconds, median [min-max] of {args.reps}, first apart"]
    for name in (*MEASURES, *LOADS):
        r = results[name]
        lines.append(f"  {name:<17} {r['median']:>8.3f} [{r['min']:.3f}-{r['max']:.3f}]  first {r['first']:.3f}")
    lines.append(f"  overlapped stall / torch.save {results['overlap_stall_over_torch_save']:.3f} "
                 f"(the training thread's CPU: {results['overlap_stall_cpu_over_torch_save_cpu']:.3f})")
    lines.append(f"  async stall / torch.save {results['async_stall_over_torch_save']:.3f}; sync save / DCP save "
                 f"{results['sync_save_over_dcp_save']:.2f}; resharded restore / DCP load "
                 f"{results['restore_over_dcp_load']:.2f}; same values as DCP: {results['same_values_as_dcp']}")
    print("\n".join(lines), file=sys.stderr)
    emit({"benchmark": "checkpoint_sharded", "unit": "seconds", "ranks": args.ranks, "width": args.width,
          "layers": args.layers, "reps": args.reps, "warmup": args.warmup, "state_mb": round(state_mb, 1),
          "checkpoint_mb": saved["checkpoint_mb"], "machine_at_start": started, "machine_at_end": machine(),
          "results": results}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
