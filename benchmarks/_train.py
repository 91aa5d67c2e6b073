"""The benchmark training job: plain DDP on gloo, an ElasticSampler and a CheckpointManager.

It reads only torch's standard environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``TORCHELASTIC_RESTART_COUNT``...), so the very same script runs under
``elastictrain run`` and stock ``torchrun``; the recovery benchmarks compare the two
launchers on it. Each rank restores the newest committed checkpoint, trains an MLP
on synthetic data (about 55 ms a step on one CPU core per rank) and saves a
checkpoint every ``--ckpt-every`` steps.

Every rank appends one JSON line per event to ``--events`` (a single ``write`` on an
``O_APPEND`` file, so lines of concurrent ranks never interleave):

- ``boot``: the process's start time (from ``/proc``), when the script began and
  when its imports were done;
- ``pg``: the process group is up; ``restored``: the checkpoint step it resumed
  from (0 on a fresh start) and when;
- ``step``: one per completed optimizer step (``step`` counts completed steps, so
  the first step after restoring checkpoint N is N + 1).

Every line has ``t`` (wall-clock seconds), ``rank``, ``world_size``, ``restart``
(``TORCHELASTIC_RESTART_COUNT``), ``pid`` and ``node`` (``BENCH_NODE`` from the
launching driver, inherited through the agent).

Usage: ``_train.py --events FILE --ckpt-dir DIR [--steps N] [--ckpt-every 10]``
"""

from __future__ import annotations

import time

_SCRIPT_START = time.time()

import argparse  # noqa: E402 - the script's start time is taken before anything else
import json  # noqa: E402
import os  # noqa: E402


def _process_start() -> float | None:
    """Wall-clock time this process was created (fork/exec), from ``/proc``; None off Linux."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        ticks = os.sysconf("SC_CLK_TCK")
        return time.time() - (uptime - int(fields[19]) / ticks)  # field 22: starttime
    except (OSError, ValueError, IndexError):
        return None


_PROC_START = _process_start()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

from elastictrain.checkpoint import CheckpointManager  # noqa: E402
from elastictrain.train.sampler import ElasticSampler  # noqa: E402

_IMPORTS_DONE = time.time()


class _Log:
    def __init__(self, path: str) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self.common = {
            "rank": int(os.environ.get("RANK", "0")),
            "world_size": int(os.environ.get("WORLD_SIZE", "1")),
            "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
            "pid": os.getpid(),
            "node": os.environ.get("BENCH_NODE"),
        }

    def __call__(self, event: str, **fields: object) -> None:
        record = {"event": event, "t": time.time(), **self.common, **fields}
        os.write(self._fd, (json.dumps(record) + "\n").encode())


def main() -> None:
    parser = argparse.ArgumentParser(description="benchmark DDP job")
    parser.add_argument("--events", required=True, help="JSON-lines event file shared by all ranks")
    parser.add_argument("--ckpt-dir", required=True)
    parser.add_argument("--steps", type=int, default=100_000, help="stop after this many completed steps")
    parser.add_argument("--ckpt-every", type=int, default=10)
    parser.add_argument("--sync-ckpt", action="store_true", help="synchronous saves (default: async)")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--global-batch", type=int, default=384)
    parser.add_argument("--samples", type=int, default=1 << 15)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    args = parser.parse_args()

    log = _Log(args.events)
    log("boot", proc_start=_PROC_START, script_start=_SCRIPT_START, imports_done=_IMPORTS_DONE)
    torch.set_num_threads(args.threads)

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    log("pg")

    gen = torch.Generator().manual_seed(1234)
    data_x = torch.randn(args.samples, args.width, generator=gen)
    data_y = data_x[:, :1].clone()
    layers: list[torch.nn.Module] = []
    for _ in range(args.depth):
        layers += [torch.nn.Linear(args.width, args.width), torch.nn.ReLU()]
    torch.manual_seed(0)
    model = torch.nn.Sequential(*layers, torch.nn.Linear(args.width, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    sampler = ElasticSampler(args.samples, global_batch_size=args.global_batch, seed=7, rank=rank, world_size=world)
    progress = {"step": 0}
    state = {"model": model, "optimizer": optimizer, "sampler": sampler, "progress": progress}

    log("model")
    ckpt = CheckpointManager(args.ckpt_dir, keep_last=2, async_save=not args.sync_ckpt)
    log("ckpt_group")
    info = ckpt.restore(state)
    sampler.set_world(rank, world)
    step = info.step if info else 0
    log("restored", step=step)
    ddp = DDP(model)
    log("ddp")

    while step < args.steps:
        if sampler.epoch_done:
            sampler.set_epoch(sampler.epoch + 1)
        plan = sampler.plan_step()
        micro = plan.micro_batches[0]
        index = list(micro.indices) or [plan.pad_index]
        scale = micro.loss_scale if micro.indices else 0.0
        x, y = data_x[index], data_y[index]
        loss = torch.nn.functional.mse_loss(ddp(x), y) * scale
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        sampler.commit_step(plan)
        step += 1
        progress["step"] = step
        log("step", step=step)
        if step % args.ckpt_every == 0:
            started = time.time()
            ckpt.save(step, state)
            log("ckpt", step=step, stall=time.time() - started)
    ckpt.close()
    log("done", step=step)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
