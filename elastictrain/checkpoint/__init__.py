"""Barrier-consistent checkpoints: save on every rank, commit atomically, restore the newest that verifies.

Besides the manager, the pieces other packages use (the in-process state transfer and training
state of :mod:`elastictrain.train`, ``elastictrain status``) are public here:

- :func:`check_state`, :func:`validate_state`: check a ``state`` mapping, and that an object
  holds only what ``torch.load(weights_only=True)`` reads back;
- :func:`map_tensors`: a copy of such an object with each tensor replaced;
- :func:`storage_key`: which storage a tensor views (tied weights share one: each is written or
  sent once);
- :func:`load_state_into`: load a checkpoint's entries into live objects (all checked first);
- :func:`capture_rng`, :func:`restore_rng`: this process's RNG states as a checkpoint keeps them,
  and back (fsdp's redundancy keeps them with each in-memory snapshot);
- :func:`find_checkpoint`, :func:`step_dir`: the newest committed checkpoint that verifies in a
  storage, and the directory of a step's checkpoint;
- :func:`region`: the box of a global tensor that a rank of a mesh holds under given placements
  (``Shard(d)`` as ``torch.chunk`` splits);
- :func:`export_safetensors`: a checkpoint's model as one safetensors file (``elastictrain
  checkpoint export``);
- :class:`SideStreams`: the CUDA stream per device that overlapped snapshots copy to pinned host
  memory on (fsdp's redundancy copies its shards on them too).
"""

from ._manifest import find_checkpoint, step_dir
from ._overlap import SideStreams
from ._sharded import region
from ._snapshot import (capture_rng, check_state, load_state_into, map_tensors, restore_rng, storage_key,
                        validate_state)
from .export import ExportInfo, export_safetensors
from .coordinator import Coordinator, SingleProcessCoordinator, TorchDistributedCoordinator
from .manager import CheckpointManager, RestoreInfo, Stateful
from .storage import LocalStorage, Storage

__all__ = [
    "CheckpointManager",
    "RestoreInfo",
    "Stateful",
    "Storage",
    "LocalStorage",
    "Coordinator",
    "SingleProcessCoordinator",
    "TorchDistributedCoordinator",
    "ExportInfo",
    "SideStreams",
    "capture_rng",
    "check_state",
    "export_safetensors",
    "find_checkpoint",
    "load_state_into",
    "map_tensors",
    "region",
    "restore_rng",
    "step_dir",
    "storage_key",
    "validate_state",
]
