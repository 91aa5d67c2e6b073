"""A small MLP on synthetic data, trained elastically: the README's main job.

Run it with ``elastictrain run --local-nodes 2 --min-nodes 2 examples/mlp.py``
(or plain ``python examples/mlp.py`` for one process). Kill a node's worker
mid-run and the job resumes from the last checkpoint; add a node (with
``--max-nodes 3`` and a shared ``--etcd``) and the global batch stays 64.

Checkpoints go to ``--checkpoint-dir`` (default: a directory under the
system's temp dir named after the run id) and are removed when the job
finishes, unless ``--keep-checkpoints``; a job that failed resumes from them
when started again.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile

import torch
from torch.utils.data import TensorDataset

import elastictrain


def epochs_for(steps: int, batch: int, samples: int) -> int:
    """Epochs enough for ``steps`` steps of ``batch`` samples (the README's status demo runs
    ``--steps 100000``; a fixed 100 epochs stopped it at 6,400)."""
    return max(1, -(-steps * batch // samples))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps in total")
    parser.add_argument("--batch", type=int, default=64, help="global batch size")
    parser.add_argument("--micro-batch", type=int, default=16, help="most samples per forward pass per rank")
    parser.add_argument("--checkpoint-dir", default=None)
    parser.add_argument("--checkpoint-every", type=int, default=10)
    parser.add_argument("--keep-checkpoints", action="store_true")
    args = parser.parse_args()

    context = elastictrain.WorkerContext.from_env()
    elastictrain.setup_logging(context)
    log = elastictrain.get_logger("mlp", context)
    checkpoint_dir = args.checkpoint_dir or os.path.join(tempfile.gettempdir(), f"elastictrain-mlp-{context.run_id}")

    # The same data on every rank (the sampler decides who reads what) and the
    # same initial weights (DDP would broadcast rank 0's anyway).
    data = torch.Generator().manual_seed(1234)
    x = torch.randn(4096, 32, generator=data)
    y = x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(4096, 1, generator=data)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)

    with elastictrain.Session(
        model, optimizer, TensorDataset(x, y),
        global_batch_size=args.batch, micro_batch_size=args.micro_batch,
        epochs=epochs_for(args.steps, args.batch, len(x)), max_steps=args.steps,
        checkpoint_dir=checkpoint_dir, checkpoint_every=args.checkpoint_every, log_every=5,
    ) as session:
        for step in session.steps():
            for micro in step:
                inputs, targets = micro.batch
                loss = torch.nn.functional.mse_loss(session.model(inputs), targets)
                micro.backward(loss)

    log.info("done: %d steps at world size %d", session.step, session.world_size)
    if context.rank == 0 and not args.keep_checkpoints:
        shutil.rmtree(checkpoint_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
