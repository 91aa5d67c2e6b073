"""The ``etcd3`` rendezvous: membership of node agents on etcd v3, behind torch's interface.

:func:`register` adds ``etcd3`` to torch's rendezvous handler registry (the
agent of ``elastictrain run`` calls it). Stock ``torchrun`` finds the same
factory through the ``torchrun.handlers`` entry point
(``elastictrain.rendezvous._torchrun_plugin``), so ``torchrun --rdzv-backend etcd3`` works
once elastictrain is installed. ``etcd3-dynamic`` (opt-in) is torch's
own dynamic rendezvous on etcd v3. Importing this package imports neither
torch nor the etcd client.
"""

from __future__ import annotations

__all__ = ["BACKEND_NAME", "DYNAMIC_BACKEND_NAME", "register"]

BACKEND_NAME = "etcd3"
DYNAMIC_BACKEND_NAME = "etcd3-dynamic"
"""Opt-in: torch's own dynamic rendezvous on etcd v3 (``elastictrain.rendezvous.dynamic``)."""


def register() -> None:
    """Register ``etcd3`` and ``etcd3-dynamic`` with torch's rendezvous handler registry (idempotent)."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    from elastictrain.rendezvous._torchrun_plugin import create_etcd3_dynamic_handler, create_etcd3_handler

    # Registering the same factory again is a no-op (torchrun's entry points register them too).
    rendezvous_handler_registry.register(BACKEND_NAME, create_etcd3_handler)
    rendezvous_handler_registry.register(DYNAMIC_BACKEND_NAME, create_etcd3_dynamic_handler)
