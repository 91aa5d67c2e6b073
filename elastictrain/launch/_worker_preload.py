"""What each node's worker forkserver imports once (see :mod:`elastictrain.launch.node_setup`), so that
every worker it forks starts with it: torch, its distributed package, and what building a DDP
model imports (:data:`elastictrain._torch_compat.DDP_MODULES`). A worker restart then costs a
fork, not a Python start plus these imports.
"""

from __future__ import annotations

import torch.distributed  # noqa: F401 - imported for the workers

import elastictrain.launch._worker_boot  # noqa: F401 - every worker runs under it
from elastictrain import _torch_compat

_torch_compat.import_ddp_modules()
