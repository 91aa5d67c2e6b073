"""Test job for what a run shows on the terminal (issue 43): noise from torch, the session's lines.

Usage: noise_job.py CHECKPOINT_DIR

Rank 0 makes torch's C++ code warn (a store client retrying a port nobody serves); then both
ranks train 2 steps with ``Session`` (whose own log lines show). Rank 1 then exits 3 while rank 0
sleeps, so that its agent closes rank 0 (torch: ``Terminating process ... via signal SIGTERM``).
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
from torch.utils.data import TensorDataset

import elastictrain

if os.environ["RANK"] == "0":
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    try:  # retries once (the C++ warning), then times out
        dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=1))
    except Exception:  # noqa: BLE001 - any failure will do, the warning was written before it
        pass

torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
data = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
with elastictrain.Session(model, torch.optim.SGD(model.parameters(), lr=0.1), data, global_batch_size=8,
                          max_steps=2, checkpoint_dir=sys.argv[1]) as session:
    for step in session.steps():
        for micro in step:
            x, y = micro.batch
            micro.backward(torch.nn.functional.mse_loss(session.model(x), y))
if os.environ["RANK"] == "1":
    sys.exit(3)
time.sleep(60)
