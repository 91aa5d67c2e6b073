"""The ``etcd3`` rendezvous backend, registered with torch's handler registry.

Importing this package registers ``etcd3`` in
``torch.distributed.elastic.rendezvous.rendezvous_handler_registry``. Stock
``torchrun`` finds the same factory through the ``torchrun.handlers`` entry
point (``elastictrain._torchrun_plugin``), so ``torchrun --rdzv-backend etcd3``
works once elastictrain is installed.
"""

from __future__ import annotations

from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

from elastictrain._torchrun_plugin import create_etcd3_handler

__all__ = ["BACKEND_NAME", "register"]

BACKEND_NAME = "etcd3"


def register() -> None:
    """Register ``etcd3`` with torch's rendezvous handler registry (idempotent)."""
    if BACKEND_NAME not in rendezvous_handler_registry._registry:  # noqa: SLF001 - no public lookup
        rendezvous_handler_registry.register(BACKEND_NAME, create_etcd3_handler)


register()
