"""Test job: a few DDP steps on gloo; each rank writes what it saw to OUT_DIR.

Usage: ddp_steps.py OUT_DIR [--steps N] [--sleep S] [--fail-rank R --fail-exit-code C] [--raise-rank R]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--sleep", type=float, default=0.0, help="seconds to sleep before training")
    parser.add_argument("--fail-rank", type=int, default=-1)
    parser.add_argument("--fail-exit-code", type=int, default=3)
    parser.add_argument("--raise-rank", type=int, default=-1, help="this rank raises ValueError after step 1")
    args = parser.parse_args()

    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rank = int(os.environ["RANK"])
    (out / f"pid-{rank}-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}").write_text(str(os.getpid()))
    if args.sleep:
        time.sleep(args.sleep)
    if rank == args.fail_rank:
        raise SystemExit(args.fail_exit_code)

    started = time.time()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    first_step_at = None
    for _ in range(args.steps):
        x = torch.full((2, 4), float(rank + 1))
        loss = model(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if first_step_at is None:
            first_step_at = time.time()
        elif rank == args.raise_rank:
            raise ValueError("bad batch 1234 in shard 7")
    record = {
        "rank": rank,
        "world_size": dist.get_world_size(),
        "local_rank": int(os.environ["LOCAL_RANK"]),
        "group_rank": int(os.environ["GROUP_RANK"]),
        "restart_count": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
        "run_id": os.environ.get("TORCHELASTIC_RUN_ID"),
        "params": [p.detach().flatten().tolist() for p in model.parameters()],
        "process_group_init_s": first_step_at - started,
        "first_step_at": first_step_at,
    }
    (out / f"rank-{rank}.json").write_text(json.dumps(record))
    # Leave together: no rank goes while a peer still waits in one of its collectives. Then exit
    # without tearing the group down: torch's teardown can deadlock (pytorch#75097). Seen twice
    # at stop 27 (a test that timed out, a benchmark job): the main thread, freeing DDP's reducer
    # with the interpreter held, joined a gloo thread that waited for the interpreter to free
    # this barrier's work. What this script tests is the launcher, not torch's teardown.
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
