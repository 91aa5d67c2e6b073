"""Per-step cost of ``elastictrain.Session`` against a hand-written DDP loop, at world size 2.

Two worker processes (gloo, a free-port TCPStore) train the same model on the
same data three ways:

- hand: ``DistributedSampler`` + ``DataLoader(batch_size=G/2)``, ``zero_grad``,
  forward, loss, ``backward``, ``optimizer.step()``;
- session: ``Session(global_batch_size=G)`` over the already-formed group, no
  checkpoints or logging, the loop from docs/session.md;
- inprocess: the same session with an agent's control channel, as under
  ``elastictrain run --recovery in-process``: the stop-after-this-step flag rides on
  each step's gradient all-reduce (one more parameter's gradient), the agent's assignment is checked
  and the progress slot written at every step.

The three run side by side in each worker process, taking turns in blocks of ``--block``
steps (10: about half a second for the large model), so that a shared machine's load,
which comes and goes over seconds, falls on all three alike. Each repetition builds
them afresh and times ``--steps`` steps of each (rounded up to whole blocks) after
``--warmup``; rank 0's time counts (DDP keeps the ranks in lockstep). Reported: median
steps/s over ``--reps`` repetitions, for a tiny model (where fixed per-step costs show most) and a larger one,
the overhead ``(hand_steps_per_s / session_steps_per_s - 1) * 100`` from the medians and
as the median of each repetition's own ratio (paired), and rank 0's CPU time per step.
Prints a table and one JSON line, and writes the JSON to ``--out``.

    python benchmarks/step_overhead.py --reps 5 --out benchmarks/results/step_overhead.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "step_overhead.json"
MODELS = {  # name: (input width, hidden width, hidden layers)
    "tiny": (32, 64, 1),
    "medium": (256, 1024, 2),
    "large": (1024, 2048, 2),  # about 50 ms a step on one core of the 2-core development machine
}
WORLD_SIZE = 2


def _build(name: str) -> Any:
    import torch

    width, hidden, layers = MODELS[name]
    torch.manual_seed(0)
    blocks: list[torch.nn.Module] = [torch.nn.Linear(width, hidden), torch.nn.ReLU()]
    for _ in range(layers - 1):
        blocks += [torch.nn.Linear(hidden, hidden), torch.nn.ReLU()]
    model = torch.nn.Sequential(*blocks, torch.nn.Linear(hidden, 1))
    return model, torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)


def _hand(name: str, dataset: Any, global_batch: int, steps: int) -> Iterator[None]:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, DistributedSampler

    model, optimizer = _build(name)
    ddp = DistributedDataParallel(model)
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)
    loader = iter(DataLoader(dataset, batch_size=global_batch // dist.get_world_size(), sampler=sampler,
                             drop_last=True))
    for _ in range(steps):
        x, y = next(loader)
        optimizer.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        optimizer.step()
        yield


def _session(name: str, dataset: Any, global_batch: int, steps: int) -> Iterator[None]:
    import torch

    import elastictrain

    model, optimizer = _build(name)
    with elastictrain.Session(model, optimizer, dataset, global_batch_size=global_batch, seed=0,
                              max_steps=steps, log_every=None) as session:
        for step in session.steps():
            for micro in step:
                x, y = micro.batch
                micro.backward(torch.nn.functional.mse_loss(session.model(x), y))
            yield  # the session applies this step (optimizer step, sampler commit) when resumed


def _session_inprocess(name: str, dataset: Any, global_batch: int, steps: int) -> Iterator[None]:
    import torch.distributed as dist

    from elastictrain.launch.worker_group import CONTROL_DIR_ENV, Assignment, Channel

    # What an in-process agent prepares for its worker: a control channel with the current
    # generation's assignment and a progress table (the agent's own Channel). The session
    # finds it when it starts (at the first step), and keeps it open until it ends.
    channel = Channel(1)
    try:
        channel.publish(Assignment(generation=1, round=0, world_size=dist.get_world_size(),
                                   master_addr="127.0.0.1", master_port=1, ranks={"0": dist.get_rank()}))
        os.environ[CONTROL_DIR_ENV] = channel.directory
        try:
            steps_of = _session(name, dataset, global_batch, steps)
            yield next(steps_of)
        finally:
            del os.environ[CONTROL_DIR_ENV]
        yield from steps_of
    finally:
        channel.close()


KINDS = {"hand": _hand, "session": _session, "inprocess": _session_inprocess}


def _interleaved(name: str, dataset: Any, args: argparse.Namespace) -> dict[str, tuple[float, float]]:
    """One repetition: the three loops side by side in this process, taking turns in blocks
    of ``--block`` steps (who goes first rotates every round), each block timed on its own.
    Load that comes and goes on a shared machine falls on all three alike. Blocks, not single
    steps: the ranks meet in each step's all-reduce, and a rank still finishing the previous
    loop's step makes its peer wait in the next loop's; that happens once per block. Returns
    per loop (steps/s, CPU microseconds per step) over the steps after the warm-up."""
    import torch.distributed as dist

    rounds = args.steps // args.block  # main() made it whole blocks
    total = args.warmup + args.steps
    loops = {kind: make(name, dataset, args.global_batch, total) for kind, make in KINDS.items()}
    for _ in range(args.warmup):
        for steps_of in loops.values():
            next(steps_of)
    dist.barrier()
    wall = dict.fromkeys(KINDS, 0.0)
    cpu = dict.fromkeys(KINDS, 0.0)
    kinds = list(KINDS)
    for index in range(rounds):
        for kind in kinds[index % len(kinds):] + kinds[:index % len(kinds)]:
            steps_of = loops[kind]
            started, used = time.perf_counter(), time.process_time()
            for _ in range(args.block):
                next(steps_of)
            wall[kind] += time.perf_counter() - started
            cpu[kind] += time.process_time() - used
    for steps_of in loops.values():
        for _ in steps_of:  # a session ends its run (and leaves its group) after its last step
            pass
    return {kind: (args.steps / wall[kind], cpu[kind] / args.steps * 1e6) for kind in KINDS}


def worker(rank: int, port: int, args: argparse.Namespace, result: Path) -> None:
    import torch
    from torch.utils.data import TensorDataset

    import elastictrain

    torch.set_num_threads(1)  # two workers on a 2-core machine: no oversubscription
    context = elastictrain.WorkerContext(rank=rank, world_size=WORLD_SIZE, master_addr="127.0.0.1", master_port=port)
    elastictrain.init_process_group(context, backend="gloo")
    out: dict[str, dict[str, list[float]]] = {}  # hand/session/inprocess: steps/s; *_cpu: CPU us/step
    for name in args.models:
        width = MODELS[name][0]
        data = torch.Generator().manual_seed(1)
        samples = args.global_batch * (args.warmup + args.steps + 1)
        dataset = TensorDataset(torch.randn(samples, width, generator=data), torch.randn(samples, 1, generator=data))
        runs: dict[str, list[float]] = {k: [] for kind in KINDS for k in (kind, f"{kind}_cpu")}
        for _ in range(args.reps):
            for kind, (rate, cpu_us) in _interleaved(name, dataset, args).items():
                runs[kind].append(rate)
                runs[f"{kind}_cpu"].append(cpu_us)
        out[name] = runs
    if rank == 0:
        result.write_text(json.dumps(out))
    elastictrain.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--block", type=int, default=10, help="steps a loop runs before the next takes its turn")
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--models", nargs="+", default=["tiny", "medium"], choices=list(MODELS))
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    for flag in ("reps", "steps", "block"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} must be at least 1, got {getattr(args, flag)}")
    if args.warmup < 0:
        parser.error(f"--warmup must be at least 0, got {args.warmup}")
    args.steps = -(-args.steps // args.block) * args.block  # whole blocks: each loop times as many steps
    if args.worker is not None:
        worker(args.worker, args.port, args, args.result)
        return 0

    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        port = _free_port()
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        forwarded = ["--reps", str(args.reps), "--steps", str(args.steps), "--warmup", str(args.warmup),
                     "--block", str(args.block),
                     "--global-batch", str(args.global_batch), "--models", *args.models]
        procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(rank), "--port", str(port),
                                   "--result", str(result), *forwarded], env=env)
                 for rank in range(WORLD_SIZE)]
        codes = [p.wait() for p in procs]
        if codes != [0] * WORLD_SIZE:
            print(f"step_overhead: workers exited with {codes}", file=sys.stderr)
            return 1
        raw = json.loads(result.read_text())

    results: dict[str, Any] = {}
    print(f"{'model':8} {'hand steps/s':>13} {'session steps/s':>16} {'overhead':>9} {'paired':>8}"
          f" {'hand CPU us':>12} {'session CPU us':>15} {'CPU overhead':>13}"
          f" {'in-process steps/s':>19} {'overhead':>9} {'paired':>8}")
    for name, runs in raw.items():
        inproc = statistics.median(runs["inprocess"])
        hand, session = statistics.median(runs["hand"]), statistics.median(runs["session"])
        overhead = (hand / session - 1.0) * 100.0
        # Within a repetition the loops took turns: their ratio cancels most of
        # the drift of a shared machine's load, within and between repetitions.
        paired = statistics.median((h / s - 1.0) * 100.0 for h, s in zip(runs["hand"], runs["session"], strict=True))
        # CPU time per step of rank 0 is what the loop itself costs; other
        # processes on a loaded machine stretch wall time but not this.
        hand_cpu, session_cpu = statistics.median(runs["hand_cpu"]), statistics.median(runs["session_cpu"])
        cpu_overhead = (session_cpu / hand_cpu - 1.0) * 100.0
        results[name] = {
            "hand_steps_per_s": {"median": hand, "samples": runs["hand"]},
            "session_steps_per_s": {"median": session, "samples": runs["session"]},
            "overhead_pct": overhead,
            "paired_overhead_pct": paired,
            "hand_cpu_us_per_step": {"median": hand_cpu, "samples": runs["hand_cpu"]},
            "session_cpu_us_per_step": {"median": session_cpu, "samples": runs["session_cpu"]},
            "cpu_overhead_pct": cpu_overhead,
            "inprocess_steps_per_s": {"median": inproc, "samples": runs["inprocess"]},
            "inprocess_overhead_pct": (hand / inproc - 1.0) * 100.0,
            "inprocess_paired_overhead_pct": statistics.median(
                (h / s - 1.0) * 100.0 for h, s in zip(runs["hand"], runs["inprocess"], strict=True)),
            "inprocess_cpu_us_per_step": {"median": statistics.median(runs["inprocess_cpu"]),
                                          "samples": runs["inprocess_cpu"]},
        }
        r = results[name]
        print(f"{name:8} {hand:13.1f} {session:16.1f} {overhead:8.1f}% {paired:7.1f}%"
              f" {hand_cpu:12.0f} {session_cpu:15.0f} {cpu_overhead:12.1f}%"
              f" {inproc:19.1f} {r['inprocess_overhead_pct']:8.1f}% {r['inprocess_paired_overhead_pct']:7.1f}%")
    record = {
        "benchmark": "step_overhead",
        "world_size": WORLD_SIZE,
        "backend": "gloo",
        "global_batch": args.global_batch,
        "steps": args.steps,
        "block": args.block,
        "warmup": args.warmup,
        "reps": args.reps,
        "models": {name: dict(zip(("width", "hidden", "layers"), MODELS[name], strict=True)) for name in raw},
        "results": results,
        "machine": {"nproc": os.cpu_count(), "python": platform.python_version(),
                    "torch": __import__("torch").__version__, "loadavg_1_5_15": list(os.getloadavg())},
    }
    line = json.dumps(record, sort_keys=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(line + "\n")
    print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
