"""On one GPU: form an NCCL group, train a DDP step with the boundary flag (wrapped as a session
wraps its model), abort the communicator (as a worker does when a collective is stuck on a dead
peer), then form the next generation in the same process and train again. Prints one JSON line;
exits non-zero on any failure.

Run by tests/gpu/check.sh on a machine with CUDA (not part of the CPU suite).
"""

from __future__ import annotations

import json
import socket
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from elastictrain.train.process_group import Placement
from elastictrain.train.ddp import wrap_in_ddp
from elastictrain.train.recovery import abort_default_group, is_collective_failure


def _port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def generation(model: torch.nn.Module, wanted: bool) -> dict:
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{_port()}", rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    placement = Placement(torch.device("cuda", 0), "nccl", timedelta(seconds=60), 0, 1, owned=True)
    ddp, flag, _ = wrap_in_ddp(model, {}, placement, None, in_process=True, identical=False)
    flag.arm(wanted)
    ddp(torch.randn(8, 16, device="cuda")).sum().backward()
    torch.cuda.synchronize()
    return {"raised": flag.raised, "grad_norm": float(sum(p.grad.norm() for p in model.parameters()))}


def main() -> int:
    if not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA"}))
        return 0
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)).cuda()
    first = generation(model, wanted=True)
    started = time.perf_counter()
    abort_default_group()  # what the liveness thread does for a stuck collective
    aborted = time.perf_counter() - started
    try:
        dist.all_reduce(torch.ones(1, device="cuda"))
        torch.cuda.synchronize()
        after_abort = "collective succeeded after abort"
    except Exception as exc:  # noqa: BLE001
        after_abort = f"failed as expected ({'collective failure' if is_collective_failure(exc) else 'other'}): " \
                      f"{type(exc).__name__}"
    dist.destroy_process_group()
    second = generation(model, wanted=False)
    dist.destroy_process_group()
    result = {"first": first, "abort_s": round(aborted, 4), "after_abort": after_abort, "second": second}
    print(json.dumps(result))
    ok = first["raised"] == 1 and second["raised"] == 0 and second["grad_norm"] > 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
