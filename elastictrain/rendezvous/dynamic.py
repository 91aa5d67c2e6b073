"""``etcd3-dynamic``: torch's own dynamic rendezvous, on etcd v3 (opt-in).

For users who want torch's ``DynamicRendezvousHandler`` exactly (its semantics,
its limits) on an etcd v3 cluster: torch's ``etcd``/``etcd-v2`` backends speak
only etcd's v2 API, which etcd 3.6 removed (pytorch/pytorch#158326, #170707).
``torchrun --rdzv-backend etcd3-dynamic`` selects it. ``elastictrain run`` uses
the native ``etcd3`` rendezvous, which scales past torch's (this one keeps every
node in one key rewritten by every heartbeat) and judges liveness by etcd leases.

torch's handler unpickles the state it reads. Here the bytes are first parsed by
an unpickler that admits only torch's rendezvous state types, so a key written
by someone else cannot run code; they are reported as a corrupt state instead.
"""

from __future__ import annotations

import io
import pickle
from datetime import timedelta
from typing import Any

from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend, Token, create_handler

from elastictrain._torch_compat import DYNAMIC_STATE_GLOBALS
from elastictrain.etcd.conf import etcd_settings_from
from elastictrain.errors import ConfigError, CorruptRendezvousStateError
from elastictrain.etcd import kv
from elastictrain.etcd.client import EtcdClient
from elastictrain.etcd.lease import RunLease
from elastictrain.rendezvous import DYNAMIC_BACKEND_NAME
from elastictrain.rendezvous.keys import RunKeys
from elastictrain.rendezvous.store import Etcd3Store

__all__ = ["Etcd3RendezvousBackend", "create_dynamic_handler"]

_MAGIC = b"ETRDZV1\n"  # a version tag in front of every state value: anything else is not ours
_STATE_TTL = timedelta(hours=2)


class _ForbiddenGlobal(pickle.UnpicklingError):
    pass


class _StateUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in DYNAMIC_STATE_GLOBALS:
            raise _ForbiddenGlobal(f"{module}.{name} is not part of a rendezvous state")
        return super().find_class(module, name)


class Etcd3RendezvousBackend(RendezvousBackend):
    """torch's ``RendezvousBackend`` on one etcd v3 key, fenced by its ``mod_revision``.

    Args:
        client: The etcd front.
        run_id: The run id; the state lives at ``/elastictrain/<run_id>/dynamic/state``.
        lease: The lease the key is attached to (default: the run's shared lease).
    """

    def __init__(self, client: EtcdClient, run_id: str, lease: RunLease | None = None) -> None:
        keys = RunKeys.of(run_id)
        self._client = client
        self.key = keys.prefix + "dynamic/state"
        self._lease = lease or RunLease(client, _STATE_TTL, key=keys.lease)

    @property
    def name(self) -> str:
        """See base class."""
        return DYNAMIC_BACKEND_NAME

    def get_state(self) -> tuple[bytes, Token] | None:
        """See base class."""
        _, found = kv.range_(self._client, self.key, what="reading the rendezvous state")
        return (self._checked(found[0].value), found[0].mod_revision) if found else None

    def set_state(self, state: bytes, token: Token | None = None) -> tuple[bytes, Token, bool] | None:
        """See base class. A write compares the key's ``mod_revision`` with ``token``: of several
        writers holding one token exactly one wins, and a foreign token never writes."""
        if token is not None and (not isinstance(token, int) or isinstance(token, bool) or token <= 0):
            return None if (current := self.get_state()) is None else (*current, False)
        compare = [kv.compare_create(self.key, "==", 0) if token is None else kv.compare_mod(self.key, "==", token)]
        result = self._lease.write(lambda lease: kv.txn(
            self._client, compare, [kv.put(self.key, _MAGIC + state, lease), kv.get(self.key)], [kv.get(self.key)],
            what="writing the rendezvous state"))
        found = result.ranges[0]
        if not found:
            return None  # a token was given but the key is gone
        if result.succeeded:
            return state, found[0].mod_revision, True
        return self._checked(found[0].value), found[0].mod_revision, False

    def _checked(self, value: bytes) -> bytes:
        def corrupt(why: str) -> CorruptRendezvousStateError:
            return CorruptRendezvousStateError(
                f"etcd key {self.key} does not hold a torch rendezvous state ({why}); delete it or use another run id")

        if not value.startswith(_MAGIC):
            raise corrupt(f"first bytes {value[:16]!r}")
        state = value[len(_MAGIC):]
        try:
            _StateUnpickler(io.BytesIO(state)).load()
        except _ForbiddenGlobal as exc:
            raise corrupt(str(exc)) from None
        except Exception:  # noqa: BLE001, S110
            # Not a whole pickle: torch's own unpickling fails at the same opcode, and
            # up to it meets only the globals admitted above, so nothing can run.
            pass
        return state


def create_dynamic_handler(params: RendezvousParameters) -> RendezvousHandler:
    """torch's dynamic handler on :class:`Etcd3RendezvousBackend` and :class:`Etcd3Store`.

    Raises:
        ConfigError: No endpoint or a bad run id.
        EtcdUnavailableError: No etcd endpoint answered.
    """
    if not params.endpoint:
        raise ConfigError(f"the {DYNAMIC_BACKEND_NAME} rendezvous backend needs an endpoint (--rdzv-endpoint HOST:PORT)")
    keys = RunKeys.of(params.run_id)
    client = EtcdClient(etcd_settings_from(params.config, params.endpoint))
    lease = RunLease(client, _STATE_TTL, key=keys.lease)
    backend = Etcd3RendezvousBackend(client, params.run_id, lease)
    store = Etcd3Store(client, keys.prefix + "dynamic/store/", lease)
    return create_handler(store, backend, params)
