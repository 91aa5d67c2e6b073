"""The job a chaos run trains when no script is given: a small MLP under ``elastictrain.Session``.

Usage: python _demo_job.py --ckpt DIR [--samples N] [--global-batch G] [--micro-batch M]
                           [--epochs E] [--ckpt-every K] [--step-time SECONDS] [--ballast-mb MB]
                           [--sharding ddp|fsdp|hsdp] [--redundancy-every N]

Each sample carries its own index, and the recorder logs the indices the
batches actually held (not the sampler's plan), so a DataLoader that diverged
from the plan shows in the evidence too. ``--step-time`` paces the job (a sleep
per step) so that faults land mid-run instead of after a job that took a second.
``--ballast-mb`` adds that many MB of state the job checkpoints (and a new worker receives)
without training it: saves take long enough for a fault to land inside one.
``--sharding fsdp|hsdp`` trains the model sharded (FSDP2; hsdp shards within a node), built on
the meta device and given its values by ``init_weights`` (:func:`init_weights`: those the DDP job
builds): its checkpoints are sharded, and it recovers in place; ``--redundancy-every N`` (fsdp) keeps a copy of
each rank's shards on its buddy, refreshed every N steps (``elastictrain chaos --sharding fsdp``
passes 1 under in-process recovery). At the end every rank gathers
the full parameters (``session.full_state_dict()``) and rank 0 writes them for the
final-parameters invariant (:meth:`~elastictrain.chaos.Recorder.final_parameters`).
It doubles as an example of a script instrumented for chaos runs.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

import torch
from torch.utils.data import TensorDataset

import elastictrain
from elastictrain.chaos.recorder import Recorder
from elastictrain.train.strategy import SHARDINGS


def init_weights(module: torch.nn.Module) -> None:
    """``Session(init_weights=...)`` of the sharded job, built on the meta device: the values the DDP
    job's model is built with (torch seeded 0 before its first layer, whose constructor draws first,
    as ``Module.apply`` calls this on it first)."""
    if isinstance(module, torch.nn.Linear):
        if module.in_features == 16:
            torch.manual_seed(0)
        module.reset_parameters()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--samples", type=int, default=384)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--ckpt-every", type=int, default=3)
    parser.add_argument("--step-time", type=float, default=0.0)
    parser.add_argument("--ballast-mb", type=float, default=0.0)
    parser.add_argument("--sharding", choices=SHARDINGS, default="ddp")
    parser.add_argument("--redundancy-every", type=int, default=None)
    args = parser.parse_args(argv)

    context = elastictrain.WorkerContext.from_env()
    elastictrain.setup_logging(context)

    data = torch.Generator().manual_seed(0)
    x = torch.randn(args.samples, 16, generator=data)
    y = torch.sin(x @ torch.randn(16, 1, generator=data))
    dataset = TensorDataset(x, y, torch.arange(args.samples))
    torch.manual_seed(0)
    sharded = args.sharding != "ddp"
    with torch.device("meta" if sharded else "cpu"):  # sharded: no rank holds the whole model
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1.0 + 0.02 * step))

    recorder = Recorder(model)
    with elastictrain.Session(
        model, optimizer, dataset, global_batch_size=args.global_batch, micro_batch_size=args.micro_batch,
        epochs=args.epochs, seed=11, scheduler=scheduler, checkpoint_dir=args.ckpt, sharding=args.sharding,
        redundancy_every=args.redundancy_every, init_weights=init_weights if sharded else None,
        # Every checkpoint is kept, so the invariants can verify each one a restore loaded.
        checkpoint_every=args.ckpt_every, keep_last=10_000, sync_loss=True, log_every=None,
        hooks=[recorder],
        extra_state={"chaos": recorder, "ballast": {"zeros": torch.zeros(int(args.ballast_mb * 2**18))}},
    ) as session:
        for step in recorder.steps(session):
            consumed: list[int] = []
            for micro in step:
                inputs, targets, index = micro.batch
                micro.backward(torch.nn.functional.mse_loss(session.model(inputs), targets))
                if not micro.is_padding:
                    consumed.extend(index.tolist())
            recorder.record(step, consumed)
            if args.step_time:
                time.sleep(args.step_time)
        recorder.final_parameters(session.full_state_dict())  # a collective when sharded


if __name__ == "__main__":
    main()
