"""The benchmark training job through ``elastictrain.Session`` (in-process recovery where the launcher offers it).

The counterpart of ``_train.py`` for the issue-14 recovery table: the same event
file and the same per-step records, but the loop is a :class:`elastictrain.Session`,
so under ``elastictrain run --recovery in-process`` a surviving worker keeps its
process through a peer's crash, a node loss or a join (the group re-forms in
place, a new worker gets the state from a live peer), while under
``elastictrain run --recovery restart`` or stock ``torchrun`` every worker restarts
from the last checkpoint.

The model is an MLP (``--depth`` Linear layers, AdamW) whose parameters and
optimizer state (parameter, ``exp_avg``, ``exp_avg_sq``: 12 bytes a parameter)
total about ``--state-mb`` MB (default 100, width ~1440 at depth 4), on synthetic
data (global batch ``--global-batch`` 16); gloo on CPU; a checkpoint every
``--ckpt-every`` steps into ``--ckpt-dir`` (asynchronous, as ``_train.py``'s; ``--sync-ckpt``).

Every rank appends one JSON line per event to ``--events`` (one ``write`` on an
``O_APPEND`` file):

- ``boot``: process start (from ``/proc``), script start, imports done;
- ``model``: model and AdamW built; ``ready``: the session is entered (process
  group, restore, DDP), with the step it starts from (``step``) and the restored
  checkpoint's step (``restored``, None on a fresh start or a state received from a peer);
- ``step``: one per applied optimizer step, from the ``on_step_end`` hook (a step
  discarded by a failed collective is never recorded).

Every line has ``t`` (wall-clock seconds), ``rank``, ``world_size`` (current: they
change in place under in-process recovery), ``restart``
(``TORCHELASTIC_RESTART_COUNT``), ``pid`` and ``node`` (``BENCH_NODE``).

Work that is slow on purpose (``benchmarks/hangs.py``): ``--step-sleep S`` paces every step
(inside it, before its micro-batches), ``--first-step-sleep S`` makes each process's first step
S longer (a compilation), ``--between-sleep STEP:S`` makes rank 0 run S seconds of its own code
after STEP's micro-batches (an evaluation), ``--long-call STEP:S`` makes rank 0 sleep S seconds
inside STEP, wrapped in ``session.long_call``. Faults come from ``ELASTICTRAIN_INJECT``.

Usage: ``_train_session.py --events FILE --ckpt-dir DIR [--state-mb 100] [--steps N] [--ckpt-every 10]``
"""

from __future__ import annotations

import time

_SCRIPT_START = time.time()

import argparse  # noqa: E402 - the script's start time is taken before anything else
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
from datetime import timedelta  # noqa: E402


def _process_start() -> float | None:
    """Wall-clock time this process was created, from ``/proc``; None off Linux."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - (uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


_PROC_START = _process_start()

import torch  # noqa: E402
from torch.utils.data import TensorDataset  # noqa: E402

import elastictrain  # noqa: E402

_IMPORTS_DONE = time.time()

STATE_BYTES_PER_PARAM = 12  # fp32 parameter + AdamW exp_avg + exp_avg_sq


def width_for(state_mb: float, depth: int) -> int:
    """Hidden width whose ``depth`` square Linear layers hold about ``state_mb`` MB of parameters + AdamW state."""
    params = state_mb * 1e6 / STATE_BYTES_PER_PARAM
    return max(8, int(math.sqrt(params / depth)))


class _Log:
    def __init__(self, path: str) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self.pid = os.getpid()
        self.rank = int(os.environ.get("RANK", "0"))
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))

    def __call__(self, event: str, **fields: object) -> None:
        record = {"event": event, "t": time.time(), "rank": self.rank, "world_size": self.world_size,
                  "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")), "pid": self.pid,
                  "node": os.environ.get("BENCH_NODE"), **fields}
        os.write(self._fd, (json.dumps(record) + "\n").encode())


class _StepRecorder:
    """Session hook: one ``step`` line per applied optimizer step, with the rank and world size of now."""

    def __init__(self, log: _Log) -> None:
        self.log = log
        self.session: elastictrain.Session | None = None

    def on_step_end(self, *, step: int, loss: float, throughput: float) -> None:
        session = self.session
        if session is not None:
            self.log.rank, self.log.world_size = session.rank, session.world_size
        self.log("step", step=step)


def main() -> None:
    parser = argparse.ArgumentParser(description="benchmark Session job")
    parser.add_argument("--events", required=True, help="JSON-lines event file shared by all ranks")
    parser.add_argument("--ckpt-dir", required=True)
    parser.add_argument("--steps", type=int, default=100_000, help="stop after this many applied steps")
    parser.add_argument("--ckpt-every", type=int, default=10)
    parser.add_argument("--state-mb", type=float, default=100.0, help="parameters + AdamW state, MB")
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--samples", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    parser.add_argument("--sync-ckpt", action="store_true", help="synchronous saves (default: async, like _train.py)")
    parser.add_argument("--sharding", choices=("ddp", "fsdp", "hsdp"), default="ddp",
                        help="Session(sharding=...): fsdp/hsdp recover in place too (docs/sharding.md)")
    parser.add_argument("--step-sleep", type=float, default=0.0, help="seconds each step sleeps (pacing)")
    parser.add_argument("--first-step-sleep", type=float, default=0.0)
    parser.add_argument("--between-sleep", type=_step_seconds, default=None, help="STEP:SECONDS on rank 0")
    parser.add_argument("--long-call", type=_step_seconds, default=None, help="STEP:SECONDS on rank 0")
    args = parser.parse_args()

    log = _Log(args.events)
    log("boot", proc_start=_PROC_START, script_start=_SCRIPT_START, imports_done=_IMPORTS_DONE)
    torch.set_num_threads(args.threads)

    width = width_for(args.state_mb, args.depth)
    gen = torch.Generator().manual_seed(1234)
    data_x = torch.randn(args.samples, width, generator=gen)
    data_y = data_x[:, :1].clone()
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(args.depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(width, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    params = sum(p.numel() for p in model.parameters())
    log("model", width=width, params=params, state_mb=round(params * STATE_BYTES_PER_PARAM / 1e6, 1))

    recorder = _StepRecorder(log)
    session = elastictrain.Session(
        model, optimizer, TensorDataset(data_x, data_y), global_batch_size=args.global_batch,
        epochs=1_000_000, max_steps=args.steps, seed=7, log_every=None, backend="gloo",
        checkpoint_dir=args.ckpt_dir, checkpoint_every=args.ckpt_every, keep_last=2, async_save=not args.sync_ckpt,
        hooks=[recorder], sharding=args.sharding,
    )
    with session as s:
        recorder.session = s
        log.rank, log.world_size = s.rank, s.world_size
        log("ready", step=s.step, restored=s.restored.step if s.restored is not None else None,
            in_process=s.recovers_in_process)
        first = True
        for step in s.steps():
            time.sleep(args.step_sleep + (args.first_step_sleep if first else 0.0))
            first = False
            if args.long_call and s.rank == 0 and step.number == args.long_call[0]:
                with s.long_call(timedelta(seconds=2 * args.long_call[1])):
                    time.sleep(args.long_call[1])
            for micro in step:
                inputs, targets = micro.batch
                micro.backward(torch.nn.functional.mse_loss(s.model(inputs), targets))
            if args.between_sleep and s.rank == 0 and step.number == args.between_sleep[0]:
                time.sleep(args.between_sleep[1])
        log("done", step=s.step)


def _step_seconds(text: str) -> tuple[int, float]:
    step, _, seconds = text.partition(":")
    return int(step), float(seconds)


if __name__ == "__main__":
    main()
