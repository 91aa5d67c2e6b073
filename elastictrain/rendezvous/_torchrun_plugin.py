"""The ``torchrun.handlers`` entry point: how stock torchrun finds ``etcd3``.

torch loads every entry point of that group while its rendezvous package is
still being imported, so this module imports nothing from torch at module level
(doing so from inside ``elastictrain.rendezvous`` would be a circular import).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def create_etcd3_handler(params: Any) -> Any:
    """Build the ``etcd3`` handler for torch's ``RendezvousParameters``."""
    from elastictrain.rendezvous.handler import create_handler

    return create_handler(params)


def torchrun_handler() -> Callable[[Any], Any]:
    """Return the handler factory (torch calls the loaded entry point with no arguments)."""
    return create_etcd3_handler


def create_etcd3_dynamic_handler(params: Any) -> Any:
    """Build the opt-in ``etcd3-dynamic`` handler (torch's dynamic rendezvous on etcd v3)."""
    from elastictrain.rendezvous.dynamic import create_dynamic_handler

    return create_dynamic_handler(params)


def torchrun_dynamic_handler() -> Callable[[Any], Any]:
    """Return the ``etcd3-dynamic`` factory (the ``torchrun.handlers`` entry point)."""
    return create_etcd3_dynamic_handler
