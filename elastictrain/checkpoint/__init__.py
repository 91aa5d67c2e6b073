"""Barrier-consistent checkpoints: save on every rank, commit atomically, restore the newest that verifies."""

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
]
