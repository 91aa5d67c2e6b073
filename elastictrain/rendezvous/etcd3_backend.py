"""``Etcd3RendezvousBackend``: torch's rendezvous state held in one etcd v3 key.

The state lives at ``/elastictrain/<run_id>/rendezvous/state``. The fencing token
is that key's ``mod_revision``; a write is an etcd transaction that compares it,
so of several nodes writing with the same token exactly one wins. Every value
carries a magic header, so bytes that elastictrain did not write are reported as
corrupt instead of being unpickled by torch.

Keys are attached to a lease (default TTL two hours, refreshed while nodes
write): when every node of a run is gone, its keys expire on their own.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend, Token

from elastictrain.errors import CorruptRendezvousStateError
from elastictrain.etcd.client import EtcdClient
from elastictrain.etcd.keys import run_prefix, validate_run_id
from elastictrain.etcd.lease import RunLease

logger = logging.getLogger(__name__)

__all__ = ["Etcd3RendezvousBackend"]

DEFAULT_STATE_TTL = timedelta(hours=2)

# A version tag in front of every state value: anything else at our key is not ours.
_MAGIC = b"ETRDZV1\n"

class Etcd3RendezvousBackend(RendezvousBackend):
    """A :class:`RendezvousBackend` on the etcd v3 API.

    Args:
        client: The etcd front to use (shared with the rendezvous store).
        run_id: The run id; namespaces every key.
        lease: The lease to attach writes to; one is made with ``ttl`` if omitted.
        ttl: TTL of the state key while nobody writes it; default two hours.
    """

    def __init__(
        self,
        client: EtcdClient,
        run_id: str,
        *,
        lease: RunLease | None = None,
        ttl: timedelta = DEFAULT_STATE_TTL,
    ) -> None:
        self._client = client
        self._run_id = validate_run_id(run_id)
        self._key = run_prefix(run_id) + "rendezvous/state"
        self._lease = lease or RunLease(client, ttl)

    @property
    def name(self) -> str:
        """See base class."""
        return "etcd3"

    @property
    def key(self) -> str:
        """The etcd key that holds the state."""
        return self._key

    def get_state(self) -> tuple[bytes, Token] | None:
        """See base class."""
        value, meta = self._client.call(lambda c: c.get(self._key), what="reading the rendezvous state")
        if value is None:
            return None
        return self._decode(value), meta.mod_revision

    def set_state(
        self, state: bytes, token: Token | None = None
    ) -> tuple[bytes, Token, bool] | None:
        """See base class."""
        revision: int | None
        if token is None:
            revision = None
        elif isinstance(token, int) and not isinstance(token, bool) and token > 0:
            revision = token
        else:
            # Not a token we issued: never write with it, report the current state.
            current = self.get_state()
            return None if current is None else (*current, False)

        value = _MAGIC + state

        def write(lease_id: int) -> tuple[bool, list[Any]]:
            def attempt(c: Any) -> tuple[bool, list[Any]]:
                tx = c.transactions
                if revision is None:
                    compare = [tx.create(self._key) == 0]
                else:
                    compare = [tx.mod(self._key) == revision]
                return c.transaction(
                    compare=compare,
                    success=[tx.put(self._key, value, lease=lease_id)],
                    failure=[tx.get(self._key)],
                )

            return self._client.call(attempt, what="writing the rendezvous state")

        succeeded, responses = self._lease.write(write)
        if succeeded:
            return state, responses[0].response_put.header.revision, True
        kvs = responses[0] if responses else []
        if not kvs:
            # A token was given but the key is gone (expired or deleted): nothing to report.
            return None
        current_value, meta = kvs[0]
        return self._decode(current_value), meta.mod_revision, False

    def delete(self) -> None:
        """Delete the state key (used by ``elastictrain stop`` and tests)."""
        self._client.call(lambda c: c.delete(self._key), what="deleting the rendezvous state")

    def _decode(self, value: bytes) -> bytes:
        if not value.startswith(_MAGIC):
            raise CorruptRendezvousStateError(
                f"the rendezvous state at etcd key {self._key} was not written by elastictrain "
                f"(first bytes {value[:16]!r}); delete the key or choose another run id"
            )
        return value[len(_MAGIC):]
