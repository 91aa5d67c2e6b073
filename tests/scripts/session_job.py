"""Test job: an MLP trained with ``elastictrain.Session``; rank 0 records what happened in OUT_DIR.

Usage: session_job.py OUT_DIR [--ckpt DIR] [--hold STEP:WORLD ...] [--fail RANK:STEP] [--sharding MODE]

- ``--hold STEP:WORLD``: once STEP steps are done at world size WORLD, stop
  training and keep all-reducing (so a dead peer is noticed) until the agent
  restarts the workers. It makes resize tests deterministic: the test changes
  membership while the job waits at a known step.
- ``--fail RANK:STEP``: on the first attempt (restart count 0), RANK raises
  before training step STEP.

Files (rank 0 unless noted): ``progress.json`` (atomic; step, world size,
restart, holding), ``segments.jsonl`` (one line per session start),
``events.jsonl`` (hook events), ``final-<rank>.pt`` (every rank, rank 0 alone when sharded:
the full parameters at the end),
``failed-<rank>-<restart>.json`` (any rank whose session raised: was the
process group still initialized afterwards?).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import TensorDataset

import elastictrain


def _pair(text: str) -> tuple[int, int]:
    a, _, b = text.partition(":")
    return int(a), int(b)


def _write_atomic(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


class Recorder(elastictrain.Hooks):
    """Appends rank 0's hook events to events.jsonl."""

    def __init__(self, out: Path, context: elastictrain.WorkerContext) -> None:
        self.out, self.context = out, context

    def _write(self, event: str, **data: Any) -> None:
        if self.context.rank == 0:
            with open(self.out / "events.jsonl", "a") as f:
                f.write(json.dumps({"event": event, "restart": self.context.restart_count, **data}) + "\n")

    def on_rendezvous(self, *, rank: int, world_size: int, restart_count: int) -> None:
        self._write("on_rendezvous", world_size=world_size)

    def on_restore(self, *, step: int, path: str) -> None:
        self._write("on_restore", step=step)

    def on_world_change(self, *, old_world_size: int, new_world_size: int) -> None:
        self._write("on_world_change", old=old_world_size, new=new_world_size)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("--ckpt", default=None)
    parser.add_argument("--samples", type=int, default=384)
    parser.add_argument("--global-batch", type=int, default=32)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--ckpt-every", type=int, default=4)
    parser.add_argument("--hold", type=_pair, action="append", default=[])
    parser.add_argument("--fail", type=_pair, default=None)
    parser.add_argument("--sharding", default="ddp")
    args = parser.parse_args()

    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    context = elastictrain.WorkerContext.from_env()
    elastictrain.setup_logging(context, brief=False)  # the tests read [run= node= rank=] off each line
    log = elastictrain.get_logger("session_job", context, all_ranks=True)
    log.info("worker started, pid %d", os.getpid())

    data = torch.Generator().manual_seed(0)
    x = torch.randn(args.samples, 16, generator=data)
    y = torch.sin(x @ torch.randn(16, 1, generator=data))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1.0 + 0.05 * step))

    session = elastictrain.Session(
        model, optimizer, TensorDataset(x, y), global_batch_size=args.global_batch,
        micro_batch_size=args.micro_batch, epochs=args.epochs, seed=7, scheduler=scheduler,
        checkpoint_dir=args.ckpt or str(out / "ckpt"), checkpoint_every=args.ckpt_every,
        hooks=[Recorder(out, context)], log_every=4, sharding=args.sharding,
    )
    try:
        with session as s:
            if s.rank == 0:
                with open(out / "segments.jsonl", "a") as f:
                    restored = s.restored.step if s.restored else None
                    f.write(json.dumps({"restart": context.restart_count, "world_size": s.world_size,
                                        "restored_step": restored}) + "\n")
            for step in s.steps():
                if (s.step, s.world_size) in args.hold:
                    hold(s, out, context)
                if args.fail and context.restart_count == 0 and (s.rank, step.number) == args.fail:
                    raise RuntimeError(f"injected failure on rank {s.rank} before step {step.number}")
                for micro in step:
                    inputs, targets = micro.batch
                    micro.backward(torch.nn.functional.mse_loss(s.model(inputs), targets))
                if s.rank == 0:
                    _write_atomic(out / "progress.json", {"step": step.number, "world_size": s.world_size,
                                                          "restart": context.restart_count, "holding": False})
            weights = s.full_state_dict()  # sharded: gathered on rank 0 ({} elsewhere), a collective
    except BaseException as error:
        _write_atomic(out / f"failed-{context.rank}-{context.restart_count}.json",
                      {"error": repr(error), "pg_initialized": dist.is_initialized()})
        raise
    if weights:
        torch.save({"step": session.step, "model": weights}, out / f"final-{context.rank}.pt")


def hold(session: elastictrain.Session, out: Path, context: elastictrain.WorkerContext) -> None:
    if session.rank == 0:
        _write_atomic(out / "progress.json", {"step": session.step, "world_size": session.world_size,
                                              "restart": context.restart_count, "holding": True})
    beat = torch.zeros(1)
    while True:  # until the agent stops us, or a peer's death fails the all-reduce
        dist.all_reduce(beat)
        time.sleep(0.05)


if __name__ == "__main__":
    main()
