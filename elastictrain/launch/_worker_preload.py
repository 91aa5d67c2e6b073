"""What each node's worker forkserver imports once (see :mod:`elastictrain.launch.node_setup`), so that
every worker it forks starts with it: torch, its distributed package, what building a DDP
model imports (:data:`elastictrain._torch_compat.DDP_MODULES`), and the ``Session`` with its
sharded strategies. A worker restart then costs a fork, not a Python start plus these imports;
and a replacement worker of an in-place recovery, which its peers wait for, builds its ``Session``
without importing it (0.1-0.25 s of a worker's start here, on 2 loaded cores).
"""

from __future__ import annotations

import torch.distributed  # noqa: F401 - imported for the workers

import elastictrain.launch._worker_boot  # every worker runs under it
import elastictrain.train.fsdp  # registers sharding="fsdp" and "hsdp" (a sharded Session's first step)
import elastictrain.train.session  # noqa: F401 - what `elastictrain.Session` imports at a worker's first use
from elastictrain import _torch_compat

_torch_compat.import_ddp_modules()
