"""The ready word: how the nodes of a round learn that all their workers can form its group.

A node that joins a running job starts its workers only after the round that takes it in
has formed; the nodes that train meanwhile keep training until the newcomer's workers are
ready, then all of them re-form at one step boundary. So each node of the round says when
its workers can form the group: a key of its own under the round's ``ready`` prefix, on its
liveness lease (a node that dies takes its word with it). The node whose key completes the
count writes the all-ready key, and every other node learns it from its control watch (no
etcd request per agent tick, which at a thousand nodes would be thousands a second). The
all-ready key is written only while the round key is the one that node joined: a late word
never replaces a newer round's.
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta

from elastictrain.etcd import kv
from elastictrain.etcd.client import EtcdClient
from elastictrain.etcd.lease import KeptLease, RunLease
from elastictrain.rendezvous.keys import RunKeys
from elastictrain.rendezvous.membership import ControlView
from elastictrain.rendezvous.records import AllReadyRecord, ReadyRecord, RoundRecord, encode

logger = logging.getLogger(__name__)

__all__ = ["ReadyWord"]

RECOUNT = timedelta(seconds=5)
"""How often :meth:`ReadyWord.count` counts the ready keys itself while the all-ready key does
not name its round: only if the node that completed the count failed to write that key (each
node asks at every monitor tick while a node joins)."""


class ReadyWord:
    """One node's part in the ready word (see the module docstring).

    Args:
        client: The node's etcd front.
        keys: The run's keys.
        node_id: The node's id in the rendezvous.
        alive: Its liveness lease: its ready key lives as long as the node.
        run_lease: The lease of the run's shared keys (the all-ready key).
        control: Its view of the control keys (the all-ready key among them).
    """

    def __init__(self, client: EtcdClient, keys: RunKeys, node_id: str, *, alive: KeptLease, run_lease: RunLease,
                 control: ControlView) -> None:
        self._client = client
        self._keys = keys
        self._node_id = node_id
        self._alive = alive
        self._run_lease = run_lease
        self._control = control
        self._said: int | None = None
        """The round this node last said its workers are ready for (its one ready key)."""
        self._counted: tuple[int, int, float] | None = None
        """(round, count, when): the ready keys this node last counted itself."""

    def say(self, joined: RoundRecord, revision: int) -> None:
        """Say that this node's workers can form the group of ``joined``, the round it joined (its
        round key written at ``revision``); if that completes the count, say so for everyone.

        Raises:
            EtcdError: etcd is unreachable or refused us.
        """
        lease = self._alive.id
        if lease is None:
            return
        ready = self._keys.ready(joined.round)
        ops = [kv.put(ready + self._node_id, encode(ReadyRecord(self._node_id)), lease)]
        if self._said is not None and self._said != joined.round:
            ops.append(kv.delete(self._keys.ready(self._said) + self._node_id))  # one key per node
        ops.append(kv.get(ready, prefix=True, count_only=True))  # with this node's key
        result = kv.txn(self._client, [], ops, what="saying this node's workers are ready")
        self._said = joined.round
        if result.counts[0] >= len(joined.nodes):
            self._say_all(joined, revision)

    def count(self, joined: RoundRecord, revision: int) -> int:
        """How many nodes of ``joined`` said their workers can form its group: all of them once the
        all-ready key names the round (from the control watch: no etcd request), else the count
        this node last made (again every :data:`RECOUNT`).

        Raises:
            EtcdError: etcd is unreachable or refused us.
        """
        with self._control.cond:
            if self._control.all_ready == joined.round:
                return len(joined.nodes)
        now = time.monotonic()
        last = self._counted
        if last is None or last[0] != joined.round:
            self._counted = (joined.round, 0, now)  # the first count waits too: the key may come
            return 0
        if now - last[2] < RECOUNT.total_seconds():
            return last[1]
        count = kv.count(self._client, self._keys.ready(joined.round), what="reading how many nodes are ready")
        self._counted = (joined.round, count, now)
        if count >= len(joined.nodes):
            logger.info("every node of round %d said its workers are ready, but none said so for all: saying it",
                        joined.round)
            self._say_all(joined, revision)
        return count

    def _say_all(self, joined: RoundRecord, revision: int) -> None:
        """Write the all-ready key for ``joined`` unless a newer round replaced it (the round key
        is no longer the one written at ``revision``)."""
        value = encode(AllReadyRecord(joined.round))
        still = [kv.compare_mod(self._keys.round, "==", revision)]
        self._run_lease.write(lambda lease: kv.txn(self._client, still, [kv.put(self._keys.all_ready, value, lease)],
                                                   what="saying every node of the round is ready"))
