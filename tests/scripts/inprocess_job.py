"""Test job for in-process recovery: an MLP trained with ``elastictrain.Session``.

Usage: inprocess_job.py OUT_DIR [--steps N] [--step-sleep S] [--fail-at RANK:STEP] [--api session|elastic]

Every rank appends one line per applied step to ``OUT_DIR/steps.jsonl`` (rank, pid,
step, world size, time, torch's environment variables as the step saw them) and, at the end, saves its parameters to ``final-<rank>.pt``.
``--step-sleep`` slows each step down so that a test can inject a fault mid-run;
``--fast-at-world W`` stops slowing the steps down once the world size is W or more.
``--fail-at RANK:STEP`` makes RANK raise before STEP in every process that reaches
it (a crash loop). ``--hold-before STEP:FILE`` makes every rank wait inside STEP until FILE
exists, writing ``FILE.held-RANK`` as it starts to wait (a test then changes the membership at
a known step; the wait is a ``Session.long_call``, not a hang). ``--wait-before-session FILE``
makes the worker wait for FILE after building its model (a slow model build or data load).
``--stall-save RANK:FILE`` makes RANK's first checkpoint write at world size 2 stall for good,
writing its pid to ``FILE`` (a test then kills its node while its peers wait for its files);
``--async-save`` saves asynchronously.
``--api elastic`` trains through ``run_elastic`` instead of a Session; ``--sharding fsdp|hsdp`` shards it,
``--redundancy-every N`` keeps fsdp's in-memory copies, ``--no-checkpoint`` configures no checkpoint.
Each step's line also has the epoch and this rank's sample indices (``indices``); a step the
session discarded (a peer died during it) is a line of ``OUT_DIR/discarded.jsonl`` instead, with how
many of its micro-batches began a backward (``backwards``).
``--hold-in-forward STEP:FILE`` makes every rank wait inside the forward of the first step from STEP
on at a world of 2 or more, between the model's first and last layers (each its own unit when
sharded: the last one's parameters are not gathered yet), until FILE exists, writing ``FILE.held-RANK``
(its pid) as it starts to wait (a test then kills a node while its peers are inside the forward).
``--hang-floor S`` sets the session's ``HangBounds(step_floor=S)``. Work that must not be taken
for a hang: ``--first-step-sleep S`` (every rank's first step takes S seconds more, as a
compilation would), ``--between-sleep RANK:STEP:S`` (RANK runs S seconds of its own code after
STEP's micro-batches, as an evaluation would), ``--long-call RANK:STEP:S`` (RANK sleeps S seconds
inside STEP, wrapped in ``session.long_call``). ``--slow-forward RANK:STEP:S`` makes RANK a straggler
inside its forward: each micro-batch's forward takes S seconds more, between the model's first and
last layers (each its own unit when sharded), in the 10 steps from STEP. Faults placed in the loop come from
``ELASTICTRAIN_INJECT`` (see ``elastictrain.train.injector``).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import TensorDataset

import elastictrain
from elastictrain.chaos._demo_job import init_weights as demo_init_weights


def _pair(text: str) -> tuple[int, int]:
    a, _, b = text.partition(":")
    return int(a), int(b)


def _triple(text: str) -> tuple[int, int, float]:
    rank, step, seconds = text.split(":")
    return int(rank), int(step), float(seconds)


def _step_and_path(text: str) -> tuple[int, str]:
    step, _, path = text.partition(":")
    return int(step), path


SLOW_FORWARD_STEPS = 10
"""Steps ``--slow-forward`` slows down: one window of the straggler watch (10), so that the next window is
all at the peer's pace and the recovery falls at its end, however fast the normal steps run."""

TORCH_ENV = ("RANK", "WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
             "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
"""torch's environment variables, recorded with each step (``env``): they follow a re-formation."""


def _append(path: Path, record: dict) -> None:
    with open(path, "a") as out:
        out.write(json.dumps(record) + "\n")


def _data(samples: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(samples, 16, generator=generator)
    return x, torch.sin(x @ torch.randn(16, 1, generator=generator))


def _model(meta: bool = False) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    with torch.device("meta" if meta else "cpu"):
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def with_session(args: argparse.Namespace, out: Path) -> None:
    x, y = _data(args.samples)
    model, optimizer = _model(args.meta)
    if args.wait_before_session:
        while not os.path.exists(args.wait_before_session):
            time.sleep(0.05)
    session = elastictrain.Session(model, optimizer, TensorDataset(x, y), global_batch_size=32, micro_batch_size=8,
                                   epochs=100, max_steps=args.steps, seed=7, log_every=None,
                                   checkpoint_dir=None if args.no_checkpoint else str(out / "ckpt"),
                                   checkpoint_every=None if args.no_checkpoint else args.ckpt_every,
                                   async_save=args.async_save, sharding=args.sharding,
                                   redundancy_every=args.redundancy_every,
                                   # The chaos demo job's model is this one: its init gives _model()'s values.
                                   init_weights=demo_init_weights if args.meta else None,
                                   hang_bounds=elastictrain.HangBounds(step_floor=timedelta(seconds=args.hang_floor)))
    first = True
    held = False
    with session as s:
        for step in s.steps():
            hold = slow = None
            if args.slow_forward and s.rank == args.slow_forward[0] and \
                    0 <= step.number - args.slow_forward[1] < SLOW_FORWARD_STEPS:
                slow = s.model[1].register_forward_pre_hook(lambda *_, t=args.slow_forward[2]: time.sleep(t))
            if args.hold_in_forward and not held and step.number >= args.hold_in_forward[0] and s.world_size >= 2:
                held = True
                hold = s.model[1].register_forward_pre_hook(_holder(args.hold_in_forward[1], s.rank))
            if first and args.first_step_sleep:
                time.sleep(args.first_step_sleep)
            first = False
            if args.long_call and (s.rank, step.number) == args.long_call[:2]:
                with s.long_call(timedelta(seconds=10 * args.long_call[2])):
                    time.sleep(args.long_call[2])
            if args.stall_save and s.rank == args.stall_save[0] and s.world_size == 2 and s.checkpoints is not None:
                s.checkpoints._fault_hook = lambda stage: _stall(stage, args.stall_save[1])
            if args.fail_at and (s.rank, step.number) == args.fail_at:
                raise RuntimeError(f"injected failure on rank {s.rank} before step {step.number}")
            if args.hold_before and step.number == args.hold_before[0]:
                # Said as a long call: held past the step's hang bound (5 s), the rank was taken
                # for hung and killed while the test waited on a slow start of another node.
                with s.long_call(timedelta(minutes=5)):
                    Path(f"{args.hold_before[1]}.held-{s.rank}").touch()
                    while not os.path.exists(args.hold_before[1]):
                        time.sleep(0.05)
            if args.fast_at_world is None or s.world_size < args.fast_at_world:
                time.sleep(args.step_sleep)
            indices: list[int] = []
            backwards: list[int] = []
            for micro in step:
                inputs, targets = micro.batch
                indices += micro.indices
                loss = torch.nn.functional.mse_loss(s.model(inputs), targets)
                loss.register_hook(_counter(backwards))  # its backward began
                micro.backward(loss)
            if slow is not None:
                slow.remove()
            if hold is not None:
                hold.remove()
            if step.discarded:  # a peer died during it: it runs again in the re-formed group
                _append(out / "discarded.jsonl", {"rank": s.rank, "pid": os.getpid(), "step": step.number,
                                                  "world": s.world_size, "backwards": len(backwards)})
                continue
            _append(out / "steps.jsonl", {"rank": s.rank, "pid": os.getpid(), "step": step.number,
                                          "world": s.world_size, "t": time.time(), "epoch": step.epoch,
                                          "indices": indices,
                                          "env": {name: os.environ.get(name) for name in TORCH_ENV}})
            if args.between_sleep and (s.rank, step.number) == args.between_sleep[:2]:
                time.sleep(args.between_sleep[2])
        # Sharded: the full tensors gathered on rank 0 (a collective). The session's model, not
        # `model`: a sharded session re-formed in place trains a module rebuilt from the first.
        weights = s.full_state_dict() if args.sharding != "ddp" else model.state_dict()
    if weights:
        torch.save(weights, out / f"final-{session.rank}.pt")


def _counter(calls: list[int]) -> Any:
    """A tensor hook that counts its calls into ``calls`` (a backward through the tensor began)."""
    def count(grad: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return grad
    return count


def _holder(path: str, rank: int) -> Any:
    """A forward pre-hook that waits, once, for ``path`` to exist (see ``--hold-in-forward``)."""
    def hold(*_: Any) -> None:
        held = Path(f"{path}.held-{rank}")
        if not held.exists():
            held.write_text(str(os.getpid()))
            while not os.path.exists(path):
                time.sleep(0.01)
    return hold


def _stall(stage: str, path: str) -> None:
    if stage == "during_write":
        Path(path).write_text(str(os.getpid()))
        time.sleep(3600)


def with_run_elastic(args: argparse.Namespace, out: Path) -> None:
    x, y = _data(args.samples)
    model, optimizer = _model()
    state = elastictrain.ElasticState(model=model, optimizer=optimizer)

    def train(state: elastictrain.ElasticState) -> None:
        ddp = torch.nn.parallel.DistributedDataParallel(state.model)
        while state.step < args.steps:
            step = state.step + 1
            time.sleep(args.step_sleep)
            # Each step trains on 32 samples, split evenly over the ranks (a world of 1, 2 or 4).
            per_rank = 32 // state.world_size
            start = ((step - 1) * 32) % args.samples + state.rank * per_rank
            loss = torch.nn.functional.mse_loss(ddp(x[start:start + per_rank]), y[start:start + per_rank])
            loss.backward()
            state.optimizer.step()
            state.optimizer.zero_grad()
            state.commit()
            _append(out / "steps.jsonl", {"rank": state.rank, "pid": os.getpid(), "step": state.step,
                                          "world": state.world_size, "t": time.time(),
                                          "env": {name: os.environ.get(name) for name in TORCH_ENV}})

    elastictrain.run_elastic(train, state)
    torch.save(model.state_dict(), out / f"final-{state.rank}.pt")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--samples", type=int, default=384)
    parser.add_argument("--step-sleep", type=float, default=0.0)
    parser.add_argument("--fast-at-world", type=int, default=None)
    parser.add_argument("--ckpt-every", type=int, default=10)
    parser.add_argument("--fail-at", type=_pair, default=None)
    parser.add_argument("--hold-before", type=_step_and_path, default=None)
    parser.add_argument("--hold-in-forward", type=_step_and_path, default=None)
    parser.add_argument("--wait-before-session", default=None)
    parser.add_argument("--stall-save", type=_step_and_path, default=None)
    parser.add_argument("--async-save", action="store_true")
    parser.add_argument("--api", choices=("session", "elastic"), default="session")
    parser.add_argument("--hang-floor", type=float, default=5.0)
    parser.add_argument("--first-step-sleep", type=float, default=0.0)
    parser.add_argument("--between-sleep", type=_triple, default=None)
    parser.add_argument("--long-call", type=_triple, default=None)
    parser.add_argument("--slow-forward", type=_triple, default=None)
    parser.add_argument("--sharding", choices=("ddp", "fsdp", "hsdp"), default="ddp")
    parser.add_argument("--redundancy-every", type=int, default=None)
    parser.add_argument("--no-checkpoint", action="store_true")
    parser.add_argument("--meta", action="store_true", help="build the model on the meta device (sharded only)")
    args = parser.parse_args()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (with_session if args.api == "session" else with_run_elastic)(args, out)


if __name__ == "__main__":
    main()
