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

The time inside ``save()`` is not the time training loses: an overlapped save
returns at once and the next steps may wait for its copy, and background work
slows the steps it runs beside. So ``loop`` measures around a training loop
(forward, backward and AdamW step of the same model on a batch of
``--loop-batch``), on ``--loop-threads`` intra-op threads (default 1: the other
cores are free for the background work, as on a GPU server). For each method, one
episode times ``--loop-pre`` steps, one step followed by the checkpoint call and
``--loop-post`` more steps; the training time lost per checkpoint is the time of
those ``1 + post`` steps minus ``1 + post`` times the median of the ``pre`` steps
(``step_s``: the step time between checkpoints). ``pending_s`` is how long the
save still ran after the window (not counted). Methods, each episode in turn,
rotating: ``none`` (no checkpoint: the noise floor), ``torch_save`` (no fsync),
``dcp_save``, ``dcp_async``, ``sync_save``, ``async_save`` (``async_save=True``:
the copy in ``save``) and ``overlapped_save`` (``async_save=True, overlap=True``).
Each manager is restored first, as a training loop does (an overlapped one then
reserves its copy memory), and ``--loop-warmup`` steps run before the first
episode. The first episode of each method is its first save, reported apart
(``first``); statistics are over the ``--reps`` episodes after it.

Everything runs on a one-rank gloo process group (DCP needs one; the manager then
uses its own gloo group, as under DDP). Statistics are over ``--reps`` repetitions
after ``--warmup`` uncounted ones.

``--device cuda`` keeps the model, its AdamW state and the loop's batch on the GPU (each
timed step ends with a ``torch.cuda.synchronize``): every save then copies device to
host, the overlapped one on a side stream into pinned buffers. ``--no-call`` runs the
loop measure alone.

    python benchmarks/checkpoint_compare.py --sizes 3,33,333 --reps 5
    python benchmarks/checkpoint_compare.py --sizes 33,333 --reps 5 --device cuda --no-call
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict

from benchmarks._common import emit, free_port, machine, summarize
from benchmarks.checkpoint_stall import WIDTH, build_state
from elastictrain.checkpoint import CheckpointManager

MEASURES = ("torch_save", "torch_save_fsync", "sync_save", "async_stall", "async_total",
            "dcp_save", "dcp_async_stall", "dcp_async_total")
LOOP_METHODS = ("none", "torch_save", "dcp_save", "dcp_async", "sync_save", "async_save", "overlapped_save")
LOOP_TITLES = {"none": "no checkpoint", "torch_save": "torch.save", "dcp_save": "DCP save",
               "dcp_async": "DCP async_save", "sync_save": "elastictrain sync",
               "async_save": "elastictrain async (copy in save)", "overlapped_save": "elastictrain overlapped"}


def _mutate(model: torch.nn.Module) -> None:
    with torch.no_grad():  # training goes on while the background write runs
        for p in model.parameters():
            p.mul_(0.999)


def state_on(size_mb: int, device: torch.device) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """:func:`build_state`'s model and AdamW, with their tensors on ``device``."""
    model, opt = build_state(size_mb)
    model.to(device)  # the same Parameter objects: the optimizer still holds them
    for param_state in opt.state.values():
        for key, value in param_state.items():
            if torch.is_tensor(value) and key != "step":  # AdamW keeps its step count on the CPU
                param_state[key] = value.to(device)
    return model, opt


def measure(size_mb: int, reps: int, warmup: int, root: Path, device: torch.device) -> dict[str, Any]:
    model, opt = state_on(size_mb, device)
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


class _LoopMethod:
    """One way of checkpointing inside the loop: ``save`` is what the loop calls, ``drain`` finishes it."""

    def __init__(self, name: str, model: torch.nn.Module, opt: torch.optim.Optimizer, root: Path) -> None:
        self.name, self._model, self._opt, self._root = name, model, opt, root
        self._state = {"model": model, "optimizer": opt}
        self._manager: CheckpointManager | None = None
        self._future: Any = None
        self._target: Path | None = None
        if name in ("sync_save", "async_save", "overlapped_save"):
            self._manager = CheckpointManager(root / name, keep_last=1, async_save=name != "sync_save",
                                              overlap=name == "overlapped_save")
            self._manager.restore(self._state)  # as a training loop starts

    def save(self, rep: int) -> None:
        if self._manager is not None:
            self._manager.save(rep, self._state)
        elif self.name == "torch_save":
            self._target = self._root / "plain.pt"
            torch.save({"model": self._model.state_dict(), "optimizer": self._opt.state_dict()}, self._target)
        elif self.name in ("dcp_save", "dcp_async"):
            model_sd, optim_sd = get_state_dict(self._model, self._opt)
            self._target = self._root / f"{self.name}-{rep}"
            if self.name == "dcp_save":
                dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=str(self._target))
            else:
                self._future = dcp.async_save({"model": model_sd, "optimizer": optim_sd},
                                              checkpoint_id=str(self._target))

    def drain(self) -> None:
        if self._manager is not None:
            self._manager.wait()
        if self._future is not None:
            self._future.result()
            self._future = None
        if self._target is not None:
            if self._target.is_dir():
                shutil.rmtree(self._target)
            else:
                self._target.unlink()
            self._target = None

    def close(self) -> None:
        self.drain()
        if self._manager is not None:
            self._manager.close()


def measure_loop(size_mb: int, reps: int, root: Path, *, batch: int, pre: int, post: int, warmup_steps: int,
                 threads: int, device: torch.device) -> dict[str, Any]:
    """Training time lost per checkpoint, measured around a training loop (see the module docstring)."""
    saved_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    model, opt = state_on(size_mb, device)
    batch_x = torch.randn(batch, WIDTH, device=device)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        model(batch_x).square().mean().backward()
        opt.step()
        if device.type == "cuda":  # the step's time, not its launch's
            torch.cuda.synchronize(device)

    def timed(fn: Callable[[], None]) -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    methods = [_LoopMethod(name, model, opt, root) for name in LOOP_METHODS]
    samples: dict[str, dict[str, list[float]]] = {
        m.name: {"lost_s": [], "step_s": [], "call_s": [], "pending_s": []} for m in methods}
    try:
        for _ in range(warmup_steps):  # also lets an overlapped manager reserve its copy memory
            step()
        for rep in range(1 + reps):
            for method in methods[rep % len(methods):] + methods[:rep % len(methods)]:
                baseline = statistics.median(timed(step) for _ in range(pre))
                call: list[float] = []
                window = timed(step) + timed(lambda: call.append(timed(lambda: method.save(rep))))
                window += sum(timed(step) for _ in range(post))
                got = samples[method.name]
                got["lost_s"].append(window - (1 + post) * baseline)
                got["step_s"].append(baseline)
                got["call_s"].append(call[0])
                got["pending_s"].append(timed(method.drain))
    finally:
        for method in methods:
            method.close()
        torch.set_num_threads(saved_threads)
    tensors = [*model.state_dict().values(),
               *(value for state in opt.state.values() for value in state.values() if torch.is_tensor(value))]
    out: dict[str, Any] = {"batch": batch, "threads": threads, "pre": pre, "post": post, "device": str(device),
                           "state_mb": round(sum(t.numel() * t.element_size() for t in tensors) / 2**20, 1)}
    for name, measures in samples.items():
        out[name] = {key: {**summarize(values[1:]), "first": values[0]} for key, values in measures.items()}
    torch_lost = out["torch_save"]["lost_s"]["median"]
    overlapped = out["overlapped_save"]["lost_s"]
    out["overlapped_lost_over_torch_save"] = overlapped["median"] / torch_lost if torch_lost > 0 else None
    out["overlapped_first_over_median"] = (overlapped["first"] / overlapped["median"]
                                           if overlapped["median"] > 0 else None)
    out["overlapped_step_over_none_step"] = (out["overlapped_save"]["step_s"]["median"]
                                             / out["none"]["step_s"]["median"])
    return out


def loop_table(results: list[dict[str, Any]]) -> str:
    """The loop-level results as a text table (milliseconds, median [min-max], first save apart)."""
    lines = []
    for r in results:
        loop = r["loop"]
        torch_lost = loop["torch_save"]["lost_s"]["median"]
        lines += [f"state {r['checkpoint_mb']} MB on {loop['device']}, batch {loop['batch']}, "
                  f"{loop['threads']} training thread(s): "
                  "training time lost per checkpoint, ms",
                  f"{'method':<36}{'lost median [min-max]':>26}{'first save':>12}{'/ torch.save':>14}"
                  f"{'in save()':>11}{'step':>9}"]
        for name in LOOP_METHODS:
            m = loop[name]
            lost = m["lost_s"]
            cells = f"{lost['median'] * 1e3:8.1f} [{lost['min'] * 1e3:.1f}-{lost['max'] * 1e3:.1f}]"
            ratio = f"{lost['median'] / torch_lost:.3f}x" if torch_lost > 0 and name != "none" else ""
            lines.append(f"{LOOP_TITLES[name]:<36}{cells:>26}{lost['first'] * 1e3:12.1f}{ratio:>14}"
                         f"{m['call_s']['median'] * 1e3:11.1f}{m['step_s']['median'] * 1e3:9.1f}")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="The stall table of an overlapped save (issue 16: sync, async, overlapped, torch.save and DCP;\n"
               "100 MB and 1 GB of state, median of 5 after the first save, which is reported apart):\n\n"
               "    python benchmarks/checkpoint_compare.py --sizes 33,333 --reps 5\n\n"
               "Run it alone on the machine: the loop measure needs a core free for the background work.\n"
               "The table goes to stderr, one JSON line to stdout (and to --out).")
    parser.add_argument("--sizes", default="3,33", help="model sizes in MiB (the state is about 3x: 33 gives 100 MB)")
    parser.add_argument("--reps", type=int, default=5, help="repetitions (loop: episodes after the first save)")
    parser.add_argument("--warmup", type=int, default=1, help="uncounted repetitions of the call-level measures")
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--no-loop", action="store_true", help="skip the loop-level measure")
    parser.add_argument("--no-call", action="store_true", help="skip the call-level measures")
    parser.add_argument("--device", default="cpu", help="where the model and its optimizer state live: cpu or cuda")
    parser.add_argument("--loop-batch", type=int, default=32, help="samples per training step of the loop")
    parser.add_argument("--loop-threads", type=int, default=1, help="intra-op threads of the training loop")
    parser.add_argument("--loop-pre", type=int, default=3, help="steps timed before each checkpoint (the baseline)")
    parser.add_argument("--loop-post", type=int, default=4, help="steps timed after each checkpoint")
    parser.add_argument("--loop-warmup", type=int, default=3, help="untimed steps before the first episode")
    args = parser.parse_args(argv)
    try:
        device = torch.device(args.device)
    except RuntimeError:
        parser.error(f"--device: not a device: {args.device!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device here")
    if device.type not in ("cpu", "cuda"):
        parser.error(f"--device: cpu or cuda, not {args.device!r}")
    if args.no_call and args.no_loop:
        parser.error("--no-call and --no-loop leave nothing to measure")
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    if not sizes or min(sizes) < 1 or args.reps < 1 or args.warmup < 0:
        parser.error(f"need sizes > 0, reps > 0, warmup >= 0; got {args.sizes!r}, {args.reps}, {args.warmup}")
    if min(args.loop_batch, args.loop_threads, args.loop_pre) < 1 or min(args.loop_post, args.loop_warmup) < 0:
        parser.error("need --loop-batch, --loop-threads, --loop-pre > 0 and --loop-post, --loop-warmup >= 0")
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
                result = {"size_mb": size} if args.no_call else measure(size, args.reps, args.warmup, root, device)
                if not args.no_loop:
                    result["loop"] = measure_loop(size, args.reps, root, batch=args.loop_batch, pre=args.loop_pre,
                                                  post=args.loop_post, warmup_steps=args.loop_warmup,
                                                  threads=args.loop_threads, device=device)
                    # Without the call-level measures' committed checkpoint: the bytes of its tensors.
                    result.setdefault("checkpoint_mb", result["loop"]["state_mb"])
                results.append(result)
            finally:
                shutil.rmtree(root, ignore_errors=True)
    finally:
        dist.destroy_process_group()
    if not args.no_loop:
        print(loop_table(results), file=sys.stderr)
    for r in results if not args.no_call else ():
        r["async_stall_over_torch_save"] = r["async_stall"]["median"] / r["torch_save"]["median"]
        r["async_stall_over_torch_save_fsync"] = r["async_stall"]["median"] / r["torch_save_fsync"]["median"]
        r["async_stall_over_dcp_async_stall"] = r["async_stall"]["median"] / r["dcp_async_stall"]["median"]
    emit({"benchmark": "checkpoint_compare", "unit": "seconds", "reps": args.reps, "warmup": args.warmup,
          "device": str(device), "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
          "dir": str(args.dir or tempfile.gettempdir()), "machine": machine(), "results": results}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
