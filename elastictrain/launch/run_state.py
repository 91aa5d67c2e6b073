"""What a run publishes about itself in etcd, and how ``status`` and ``stop`` read it back.

Besides the rendezvous keys (see :mod:`elastictrain.rendezvous.keys`), each run keeps:

- ``meta``: how the run was launched (min/max nodes, workers per node, script, first
  launch time), written once by the first node;
- ``nodes/<node id>``: one record per node agent (host, address, pid, round, ranks,
  world size, restarts, state, update time), rewritten by the agent at every
  rendezvous and state change;
- ``stop``: present once ``elastictrain stop`` asked the run to end.

All of it is JSON on the run's shared lease, so it expires with the run. Whether a
node is alive comes from its membership key, which etcd deletes when the node's
liveness lease expires: no wall clock of any host is compared.
"""

from __future__ import annotations

import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

from elastictrain import errors
from elastictrain.errors import EtcdError
from elastictrain.etcd import kv
from elastictrain.etcd.client import EtcdClient
from elastictrain.etcd.lease import RunLease
from elastictrain.rendezvous.keys import KEY_ROOT, RunKeys, validate_run_id
from elastictrain.rendezvous.membership import Member, close_rendezvous, member_of, waiting
from elastictrain.rendezvous.records import ClosedRecord, RoundRecord, decode

__all__ = [
    "NodeRecord",
    "RunPublisher",
    "STATUS_PAGE",
    "RunStatus",
    "purge",
    "read_every_status",
    "read_membership",
    "read_status",
    "request_stop",
    "stop_requested",
]

_LEASE_LOOKUPS = 64
"""Most participants whose remaining lease TTL ``status`` asks etcd for (one request each)."""

_LEASE_LOOKUPS_AT_ONCE = 16
"""Of those requests, how many ``status`` has in flight at once: 64 take 4 round trips to etcd."""

STATUS_PAGE = 1000
"""Keys ``status`` reads in one request. gRPC takes at most 4 MB in one response: about 4 KB a key,
several times what a node's record holds."""


@dataclass(slots=True)
class NodeRecord:
    """One node agent as it last described itself."""

    node_id: str
    host: str
    addr: str
    pid: int
    name: str = ""
    """The node's name as its own lines give it (``--local-nodes``' ``node2``; else the host name)."""
    state: str = "starting"
    round: int | None = None
    group_rank: int | None = None
    nodes: int | None = None
    world_size: int | None = None
    restarts: int = 0
    generation: int | None = None
    """In-process recovery: the generation its workers train in (one per re-formation)."""
    last_recovery: str | None = None
    """In-process recovery: why the group last re-formed."""
    updated_at: float = field(default_factory=time.time)


class RunPublisher:
    """Writes this agent's ``meta`` (once) and ``nodes/<id>`` records."""

    def __init__(self, client: EtcdClient, keys: RunKeys, lease: RunLease, record: NodeRecord) -> None:
        self._client = client
        self._keys = keys
        self._lease = lease
        self.record = record

    def publish_meta(self, **meta: Any) -> None:
        value = json.dumps({"launched_at": time.time(), **meta}).encode()
        self._lease.write(lambda lease: kv.txn(self._client, [kv.compare_create(self._keys.meta, "==", 0)],
                                               [kv.put(self._keys.meta, value, lease)],
                                               what="publishing run metadata"))

    def update(self, **changes: Any) -> None:
        """Apply ``changes`` to this node's record and publish it."""
        for name, value in changes.items():
            setattr(self.record, name, value)
        self.record.updated_at = time.time()
        key, value = self._keys.record(self.record.node_id), json.dumps(asdict(self.record)).encode()
        self._lease.write(lambda lease: kv.txn(self._client, [], [kv.put(key, value, lease)],
                                               what="publishing the node record"))


@dataclass(slots=True)
class RunStatus:
    """A run as etcd sees it now."""

    run_id: str
    exists: bool
    round: int | None = None
    closed: bool = False
    participants: list[dict[str, Any]] = field(default_factory=list)
    """Members of the last round, in rank order: node id, rank, address, pid, whether its
    liveness lease still exists (``alive``) and its remaining TTL (``lease_ttl_s``)."""
    waiting: list[str] = field(default_factory=list)
    """Live nodes that want a newer round (joining, or members re-entering)."""
    meta: dict[str, Any] = field(default_factory=dict)
    nodes: list[dict[str, Any]] = field(default_factory=list)
    """Each node agent's last published record, with ``alive``: whether its liveness lease still exists."""
    problems: list[str] = field(default_factory=list)
    """Keys that could not be read, one line each."""

    @property
    def complete(self) -> bool:
        """A round was formed."""
        return self.round is not None

    @property
    def live(self) -> bool:
        """A job is training: a formed round, not closed, with a member still alive."""
        return self.exists and self.complete and not self.closed and any(p["alive"] for p in self.participants)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "complete": self.complete, "live": self.live}


def read_status(client: EtcdClient, run_id: str, *, lease_ttls: bool = True) -> RunStatus:
    """Read a run's rounds, members, metadata and node records.

    A value that cannot be decoded is named in ``RunStatus.problems``; nothing read is
    executed.

    Raises:
        EtcdError: etcd could not be read.
        ConfigError: ``run_id`` is not a valid run id.
    """
    keys = RunKeys.of(run_id)
    _, entries = kv.range_pages(client, keys.prefix, page=STATUS_PAGE, what="reading the run")
    status, leases = _status_of(keys, entries)
    if lease_ttls:
        lookups = [(p, leases[p["node_id"]]) for p in status.participants[:_LEASE_LOOKUPS] if leases.get(p["node_id"])]
        if lookups:
            # A request each (etcd answers for one lease at a time), several in flight at once.
            with ThreadPoolExecutor(min(len(lookups), _LEASE_LOOKUPS_AT_ONCE)) as pool:
                ttls = list(pool.map(lambda lookup: _lease_ttl(client, lookup[1]), lookups))
            for (participant, _), ttl in zip(lookups, ttls):
                participant["lease_ttl_s"] = ttl
    return status


def read_membership(client: EtcdClient, run_id: str) -> RunStatus:
    """:func:`read_status` from the run's rendezvous keys and metadata alone, in one request: its
    round, whether it is closed, its members and what it runs, without the nodes' records, the
    rounds' stores or the lease lookups. What a node that starts checks, at any number of nodes.

    Raises:
        EtcdError: etcd could not be read.
        ConfigError: ``run_id`` is not a valid run id.
    """
    keys = RunKeys.of(run_id)
    result = kv.txn(client, [], [kv.get(keys.ctl, prefix=True), kv.get(keys.members, prefix=True), kv.get(keys.meta)],
                    what="reading the run's rendezvous")
    return _status_of(keys, [item for found in result.ranges for item in found])[0]


def read_every_status(client: EtcdClient) -> list[RunStatus]:
    """:func:`read_status` of every run that has keys on this etcd, by run id, without the lease
    lookups: every key is read at once (a request per :data:`STATUS_PAGE` keys), not a request
    per run. Keys under ``/elastictrain/`` that no run id could have written are left out.

    Raises:
        EtcdError: etcd could not be read.
    """
    root = KEY_ROOT + "/"
    _, entries = kv.range_pages(client, root, page=STATUS_PAGE, what="reading every run")
    runs: dict[str, list[kv.KeyValue]] = {}
    for item in entries:
        run_id, slash, _ = item.key[len(root):].partition("/")
        if slash and _is_run_id(run_id):
            runs.setdefault(run_id, []).append(item)
    return [_status_of(RunKeys.of(run_id), found)[0] for run_id, found in sorted(runs.items())]


def _is_run_id(text: str) -> bool:
    try:
        validate_run_id(text)
    except ValueError:
        return False
    return True


def _status_of(keys: RunKeys, entries: list[kv.KeyValue]) -> tuple[RunStatus, dict[str, int]]:
    """The status a run's keys say, and each member's lease."""
    status = RunStatus(run_id=keys.run_id, exists=bool(entries))
    current: RoundRecord | None = None
    members: dict[str, Member] = {}
    leases: dict[str, int] = {}
    records: list[dict[str, Any]] = []
    for item in entries:
        try:
            if item.key == keys.round:
                current = decode(RoundRecord, item.key, item.value)
            elif item.key == keys.closed:
                decode(ClosedRecord, item.key, item.value)
                status.closed = True
            elif item.key.startswith(keys.members):
                member = member_of(item)
                members[member.record.node] = member
                leases[member.record.node] = item.lease
            elif item.key == keys.meta:
                status.meta = _json_object(item)
            elif item.key.startswith(keys.records):
                records.append(_json_object(item, required=("node_id",)))
        except errors.UnreadableRecordError as exc:
            status.problems.append(str(exc))
    for record in records:
        record["alive"] = record["node_id"] in members  # its liveness lease, not its last word
    status.nodes = sorted(records, key=lambda n: (n.get("group_rank") is None, n.get("group_rank") or 0,
                                                  str(n["node_id"])))
    if current is not None:
        status.round = current.round
        for rank, node in enumerate(current.nodes):
            member = members.get(node)
            addr = member.record.addr if member else _record_field(records, node, "addr")
            pid = member.record.pid if member else _record_field(records, node, "pid")
            status.participants.append({"node_id": node, "rank": rank, "addr": addr, "pid": pid,
                                        "nproc": current.nproc[rank], "alive": member is not None,
                                        "lease_ttl_s": None})
    # The rendezvous's own rule: a node left out of the round whose key predates it (a dead
    # node whose lease runs on) is not waiting.
    status.waiting = sorted(m.record.node for m in waiting(members, current))
    return status, leases


def _json_object(item: kv.KeyValue, required: tuple[str, ...] = ()) -> dict[str, Any]:
    try:
        value = json.loads(item.value)
    except (ValueError, UnicodeDecodeError):
        value = None
    if not isinstance(value, dict) or any(name not in value for name in required):
        raise errors.UnreadableRecordError(
            f"etcd key {item.key} does not hold an elastictrain record (not a JSON object"
            f"{' with ' + ', '.join(required) if required else ''}: {item.value[:16]!r}...); delete it")
    return value


def _record_field(records: list[dict[str, Any]], node: str, name: str) -> Any:
    return next((r.get(name) for r in records if r.get("node_id") == node), None)


def _lease_ttl(client: EtcdClient, lease_id: int) -> int | None:
    """Seconds etcd gives the lease before it expires it (its own clock), ``None`` if gone."""
    try:
        info = client.call(lambda c: c.get_lease_info(lease_id), what="reading a node's lease")
    except EtcdError:
        return None
    return int(info.TTL) if info.TTL > 0 else None


def request_stop(client: EtcdClient, run_id: str) -> None:
    """Mark the run as stopped on purpose (agents then exit 0) and close its rendezvous."""
    keys = RunKeys.of(run_id)
    lease = RunLease(client, _run_ttl(), key=keys.lease)
    try:
        value = json.dumps({"requested_at": time.time()}).encode()
        lease.write(lambda lease_id: kv.txn(client, [], [kv.put(keys.stop, value, lease_id)],
                                            what="requesting a stop"))
        close_rendezvous(client, keys, lease, by="elastictrain stop", reason="stop requested")
    finally:
        lease.close()


def _run_ttl() -> Any:
    from elastictrain.rendezvous.config import RendezvousConfig

    return RendezvousConfig().state_ttl


def stop_requested(client: EtcdClient, run_id: str) -> bool:
    """Whether ``elastictrain stop`` was run for this run id."""
    keys = RunKeys.of(run_id)
    _, found = kv.range_(client, keys.stop, keys_only=True, what="reading the stop request")
    return bool(found)


def purge(client: EtcdClient, run_id: str) -> int:
    """Delete every key of the run; returns how many there were."""
    keys = RunKeys.of(run_id)
    result = kv.txn(client, [], [kv.delete(keys.prefix, prefix=True)], what="deleting the run's keys")
    return result.deleted[0]


def this_host() -> str:
    return socket.gethostname()
