"""Per-step cost of ``elastictrain.Session`` against a hand-written DDP loop, at world size 2.

Two worker processes (gloo, a free-port TCPStore) train the same model on the
same data both ways, alternating which goes first in each repetition:

- hand: ``DistributedSampler`` + ``DataLoader(batch_size=G/2)``, ``zero_grad``,
  forward, loss, ``backward``, ``optimizer.step()``;
- session: ``Session(global_batch_size=G)`` over the already-formed group, no
  checkpoints or logging, the loop from docs/session.md;
- inprocess: the same session with an agent's control channel, as under
  ``elastictrain run --recovery in-process``: the stop-after-this-step flag rides on
  each step's gradient all-reduce (one more parameter's gradient), the agent's assignment is checked
  and the progress slot written at every step.

Each run times ``--steps`` steps after ``--warmup``; rank 0's time counts (DDP
keeps the ranks in lockstep). Reported: median steps/s over ``--reps`` runs,
for a tiny model (where fixed per-step costs show most) and a medium one, and
the session's overhead, ``(hand_steps_per_s / session_steps_per_s - 1) * 100``,
from the medians and as the median of each repetition's back-to-back pair,
and rank 0's CPU time per step (robust to other load on the machine).
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


def _hand(name: str, dataset: Any, global_batch: int, warmup: int, steps: int) -> tuple[float, float]:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, DistributedSampler

    model, optimizer = _build(name)
    ddp = DistributedDataParallel(model)
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)
    loader = iter(DataLoader(dataset, batch_size=global_batch // dist.get_world_size(), sampler=sampler,
                             drop_last=True))
    started = cpu = 0.0
    for index in range(warmup + steps):
        if index == warmup:
            dist.barrier()
            started, cpu = time.perf_counter(), time.process_time()
        x, y = next(loader)
        optimizer.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        optimizer.step()
    return steps / (time.perf_counter() - started), (time.process_time() - cpu) / steps * 1e6


def _session(name: str, dataset: Any, global_batch: int, warmup: int, steps: int) -> tuple[float, float]:
    import torch
    import torch.distributed as dist

    import elastictrain

    model, optimizer = _build(name)
    started = cpu = 0.0
    with elastictrain.Session(model, optimizer, dataset, global_batch_size=global_batch, seed=0,
                              max_steps=warmup + steps, log_every=None) as session:
        for step in session.steps():
            if step.number == warmup + 1:
                dist.barrier()
                started, cpu = time.perf_counter(), time.process_time()
            for micro in step:
                x, y = micro.batch
                micro.backward(torch.nn.functional.mse_loss(session.model(x), y))
            if step.number == warmup + steps:
                break  # stop the clock before the session's exit (no final work without checkpoints anyway)
        elapsed, used = time.perf_counter() - started, time.process_time() - cpu
    return steps / elapsed, used / steps * 1e6


def _session_inprocess(name: str, dataset: Any, global_batch: int, warmup: int, steps: int) -> tuple[float, float]:
    import torch.distributed as dist

    from elastictrain._control import CONTROL_DIR_ENV, Assignment, ProgressTable, write_assignment

    # What an in-process agent prepares for its worker: a control directory with the
    # current generation's assignment and a progress table.
    with tempfile.TemporaryDirectory() as directory:
        ProgressTable(directory, 1, create=True).close()
        write_assignment(directory, Assignment(generation=1, round=0, world_size=dist.get_world_size(),
                                               master_addr="127.0.0.1", master_port=1,
                                               ranks={"0": dist.get_rank()}))
        os.environ[CONTROL_DIR_ENV] = directory
        try:
            return _session(name, dataset, global_batch, warmup, steps)
        finally:
            del os.environ[CONTROL_DIR_ENV]


KINDS = {"hand": _hand, "session": _session, "inprocess": _session_inprocess}


def worker(rank: int, port: int, args: argparse.Namespace, result: Path) -> None:
    import torch
    import torch.distributed as dist
    from torch.utils.data import TensorDataset

    import elastictrain

    torch.set_num_threads(1)  # two workers on a 2-core machine: no oversubscription
    context = elastictrain.WorkerContext(rank=rank, world_size=WORLD_SIZE, master_addr="127.0.0.1", master_port=port)
    elastictrain.init_process_group(context, backend="gloo")
    out: dict[str, dict[str, list[float]]] = {}  # hand/session: steps/s; hand_cpu/session_cpu: CPU us/step
    for name in args.models:
        width = MODELS[name][0]
        data = torch.Generator().manual_seed(1)
        samples = args.global_batch * (args.warmup + args.steps + 1)
        dataset = TensorDataset(torch.randn(samples, width, generator=data), torch.randn(samples, 1, generator=data))
        runs: dict[str, list[float]] = {k: [] for kind in KINDS for k in (kind, f"{kind}_cpu")}
        for rep in range(args.reps):
            order = list(KINDS)[rep % len(KINDS):] + list(KINDS)[:rep % len(KINDS)]  # rotate who goes first
            for kind in order:
                rate, cpu_us = KINDS[kind](name, dataset, args.global_batch, args.warmup, args.steps)
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
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--models", nargs="+", default=["tiny", "medium"], choices=list(MODELS))
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        worker(args.worker, args.port, args, args.result)
        return 0

    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        port = _free_port()
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        forwarded = ["--reps", str(args.reps), "--steps", str(args.steps), "--warmup", str(args.warmup),
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
        # Each repetition ran both loops back to back: their ratio cancels most
        # of the drift of a shared machine's load between repetitions.
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
