"""What a run publishes about itself in etcd, and how ``status`` reads it back.

Besides torch's rendezvous state (``rendezvous/state``), each run keeps:

- ``meta``: how the run was launched (min/max nodes, workers per node, first
  launch time), written once by the first node;
- ``nodes/<node id>``: one record per node agent (host, address, pid, round,
  ranks, world size, restarts, state, update time), rewritten by the agent at
  every rendezvous and state change.

All of it is attached to the writing agent's lease, so it expires with the run.
"""

from __future__ import annotations

import json
import pickle
import socket
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import Any

from elastictrain.errors import CorruptRendezvousStateError
from elastictrain.etcd.client import EtcdClient
from elastictrain.etcd.keys import KEY_ROOT, run_prefix
from elastictrain.etcd.lease import RunLease
from elastictrain.rendezvous.etcd3_backend import Etcd3RendezvousBackend

__all__ = [
    "NodeRecord",
    "RunPublisher",
    "RunStatus",
    "list_runs",
    "purge",
    "read_status",
    "request_stop",
    "stop_requested",
]


@dataclass(slots=True)
class NodeRecord:
    """One node agent as it last described itself."""

    node_id: str
    host: str
    addr: str
    pid: int
    state: str = "starting"
    round: int | None = None
    group_rank: int | None = None
    nodes: int | None = None
    world_size: int | None = None
    restarts: int = 0
    updated_at: float = field(default_factory=time.time)


class RunPublisher:
    """Writes this agent's ``meta`` (once) and ``nodes/<id>`` records."""

    def __init__(self, client: EtcdClient, run_id: str, lease: RunLease, record: NodeRecord) -> None:
        self._client = client
        self._lease = lease
        self._prefix = run_prefix(run_id)
        self.record = record

    def publish_meta(self, **meta: Any) -> None:
        key = self._prefix + "meta"
        value = json.dumps({"launched_at": time.time(), **meta}).encode()
        self._lease.write(lambda lease_id: self._client.call(
            lambda c: c.put_if_not_exists(key, value, lease=lease_id), what="publishing run metadata"))

    def update(self, **changes: Any) -> None:
        """Apply ``changes`` to this node's record and publish it."""
        for name, value in changes.items():
            setattr(self.record, name, value)
        self.record.updated_at = time.time()
        key = self._prefix + "nodes/" + self.record.node_id
        value = json.dumps(asdict(self.record)).encode()
        self._lease.write(lambda lease_id: self._client.call(
            lambda c: c.put(key, value, lease=lease_id), what="publishing the node record"))


@dataclass(slots=True)
class RunStatus:
    """A run as etcd sees it now."""

    run_id: str
    exists: bool
    round: int | None = None
    complete: bool = False
    closed: bool = False
    participants: list[dict[str, Any]] = field(default_factory=list)
    waiting: list[str] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)
    nodes: list[dict[str, Any]] = field(default_factory=list)
    problem: str | None = None
    """Why the rendezvous state could not be read, if it could not."""

    @property
    def live(self) -> bool:
        """A completed round with participants, not closed: a job is training."""
        return self.exists and self.complete and not self.closed and bool(self.participants)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "live": self.live}


def _node_id(desc: Any) -> str:
    return repr(desc)


def read_status(client: EtcdClient, run_id: str) -> RunStatus:
    """Read a run's rendezvous state, metadata and node records.

    A state that cannot be decoded is reported in ``RunStatus.problem``.

    Raises:
        EtcdError: etcd could not be read.
    """
    backend = Etcd3RendezvousBackend(client, run_id)
    try:
        current = backend.get_state()
        problem = None
    except CorruptRendezvousStateError as exc:
        current, problem = None, str(exc)
    prefix = run_prefix(run_id)
    entries = client.call(lambda c: list(c.get_prefix(prefix)), what="reading the run")
    meta: dict[str, Any] = {}
    nodes: list[dict[str, Any]] = []
    for value, kv in entries:
        key = kv.key.decode()
        if key == prefix + "meta":
            meta = json.loads(value)
        elif key.startswith(prefix + "nodes/"):
            nodes.append(json.loads(value))
    status = RunStatus(run_id=run_id, exists=current is not None or bool(entries), meta=meta, problem=problem,
                       nodes=sorted(nodes, key=lambda n: (n.get("group_rank") is None, n.get("group_rank"), n["node_id"])))
    if current is None:
        return status
    # The state is torch's pickled _RendezvousState. It carries our header, so it
    # was written by an elastictrain node of this run (torch unpickles it too).
    try:
        state = pickle.loads(current[0])  # noqa: S301
        participants, heartbeats = state.participants, state.last_heartbeats
    except Exception as exc:  # noqa: BLE001 - report it; status must still show the rest
        status.problem = f"rendezvous state unreadable ({type(exc).__name__}: {exc})"
        return status
    now = datetime.now(timezone.utc)
    status.round = state.round
    status.complete = state.complete
    status.closed = state.closed
    for desc, rank in sorted(participants.items(), key=lambda item: item[1]):
        beat = heartbeats.get(desc)
        status.participants.append({
            "node_id": _node_id(desc), "addr": desc.addr, "pid": desc.pid, "rank": rank,
            "heartbeat_age_s": None if beat is None else round((now - beat).total_seconds(), 3),
        })
    status.waiting = sorted(_node_id(d) for d in state.wait_list)
    return status


def request_stop(client: EtcdClient, run_id: str) -> None:
    """Mark the run as stopped on purpose (agents then exit 0) and close its rendezvous."""
    key = run_prefix(run_id) + "stop"
    client.call(lambda c: c.put(key, json.dumps({"requested_at": time.time()})), what="requesting a stop")
    close_rendezvous(client, run_id)


def close_rendezvous(client: EtcdClient, run_id: str) -> None:
    """Mark the run's rendezvous closed, as torch's close operation does (compare-and-swap)."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _RendezvousState

    backend = Etcd3RendezvousBackend(client, run_id)
    while True:
        current = backend.get_state()
        state, token = (_RendezvousState(), None) if current is None else (pickle.loads(current[0]), current[1])  # noqa: S301
        if state.closed:
            return
        state.closed = True
        written = backend.set_state(pickle.dumps(state), token)
        if written is not None and written[2]:
            return


def stop_requested(client: EtcdClient, run_id: str) -> bool:
    """Whether ``elastictrain stop`` was run for this run id."""
    key = run_prefix(run_id) + "stop"
    value, _ = client.call(lambda c: c.get(key), what="reading the stop request")
    return value is not None


def purge(client: EtcdClient, run_id: str) -> int:
    """Delete every key of the run; returns how many there were."""
    prefix = run_prefix(run_id)
    return client.call(lambda c: c.delete_prefix(prefix).deleted, what="deleting the run's keys")


def list_runs(client: EtcdClient) -> list[str]:
    """Run ids that have any key on this etcd."""
    root = KEY_ROOT + "/"
    keys = client.call(lambda c: [kv.key.decode() for _, kv in c.get_prefix(root, keys_only=True)],
                       what="listing runs")
    return sorted({key[len(root):].split("/", 1)[0] for key in keys})


def this_host() -> str:
    return socket.gethostname()
