"""A small MLP on synthetic data, trained with DDP: the README's main job.

Run it with ``elastictrain run --local-nodes 2 --min-nodes 2 examples/mlp.py``.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if backend == "nccl" else torch.device("cpu")
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)).to(device))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    generator = torch.Generator().manual_seed(1000 + rank)
    for step in range(args.steps):
        x = torch.randn(args.batch, 32, generator=generator).to(device)
        y = x.sum(dim=1, keepdim=True)
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if rank == 0 and (step == 0 or (step + 1) % 5 == 0):
            print(
                f"[rank 0/{world} restart {os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}] "
                f"step {step + 1}/{args.steps} loss {loss.item():.4f} t={time.time():.3f}",
                flush=True,
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
