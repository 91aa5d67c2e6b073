"""The values the rendezvous keeps in etcd: JSON documents with a schema version.

Nothing read from etcd is ever unpickled or evaluated: anyone who can write a
key must not be able to run code on a training host or the operator's
machine. A value that is not a document of the expected kind and schema is
reported as :class:`~elastictrain.errors.UnreadableRecordError` (the rendezvous hands it to
torch's agent as a :class:`~elastictrain.errors.CorruptRendezvousStateError`), whose message
names the key.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from dataclasses import MISSING, asdict, dataclass, field
from typing import Any, TypeVar

from elastictrain import errors

__all__ = ["FINISHED", "FORMED_ALL_IN", "FORMED_FULL", "FORMED_LAST_CALL", "FORMED_PEERS_DEAD", "FORMED_REASONS",
           "AllReadyRecord", "ClosedRecord", "CloserRecord", "MemberRecord", "ReadyRecord", "RoundRecord",
           "decode", "describe_node", "encode", "node_id_for", "node_where"]

SCHEMA = 1

_R = TypeVar("_R")


def node_id_for(name: str, addr: str) -> str:
    """A node's id in the rendezvous, unique per handler: ``name@addr_pid_random``. It starts with
    the node's name (``--local-nodes``' ``node2``, else the host name) and address, so that a lost
    node is named the way its own lines name it (see :func:`describe_node`)."""
    return f"{name}@{addr}_{os.getpid()}_{secrets.token_hex(3)}"


def describe_node(node_id: str, node_rank: int | None = None) -> str:
    """A node id for people: ``node2@127.0.0.1 (node rank 1, pid 5995)`` (its name and address,
    its node rank in the round at hand when given, its agent's pid); an id of another form as it is."""
    parts = node_id.rsplit("_", 2)
    rank = f"node rank {node_rank}, " if node_rank is not None else ""
    if len(parts) != 3 or not parts[1].isdigit() or "@" not in parts[0]:
        return f"{node_id} ({rank[:-2]})" if rank else node_id
    return f"{parts[0]} ({rank}pid {parts[1]})"


def node_where(node_id: str) -> str:
    """Where a node id's agent ran, for people: ``at 127.0.0.1 (pid 5995)``; empty for an id of another form."""
    parts = node_id.rsplit("_", 2)
    if len(parts) != 3 or not parts[1].isdigit() or "@" not in parts[0]:
        return ""
    return f"at {parts[0].partition('@')[2]} (pid {parts[1]})"


@dataclass(frozen=True, slots=True)
class MemberRecord:
    """A node agent taking part in the run (``rdzv/members/<node>``, on its liveness lease)."""

    kind = "member"

    node: str
    """The node id: ``name@addr_pid_random``, unique per handler (see :func:`node_id_for`)."""
    addr: str
    """Where other nodes reach this node (``--local-addr``)."""
    host: str
    """This host's name, for people."""
    pid: int
    """The agent's pid."""
    nproc: int
    """Workers this node starts."""
    port: int
    """A port free on this node when it asked to join: the workers' store port if it is rank 0."""
    after: int
    """The node wants a round newer than this one (-1: any)."""
    for_joiners: bool = False
    """A member re-enters only to take in nodes that wait to join: nothing failed on it, and
    its workers train on until the joining nodes' workers are ready. The other members then
    hold the new round too (see :meth:`~elastictrain.rendezvous.membership.RoundWatch.only_joins`)."""
    probe_port: int = 0
    """Where this node answers its peers' reachability probes (0: it does not;
    :mod:`~elastictrain.rendezvous.reachability`)."""
    fault_rank: int = -1
    """The global rank of this node's worker whose failure made it ask for a new round (-1: none
    it knows of); the other members state it as the cause (:class:`~elastictrain._fault.Fault`)."""
    fault_how: str = ""
    """How that worker ended (``was killed by SIGKILL``), at most :data:`~elastictrain._fault.MAX_HOW`
    characters."""


FORMED_FULL = "full"
"""A :attr:`RoundRecord.reason`: ``max_nodes`` waited, and every live member of the round before it."""
FORMED_ALL_IN = "all_in"
"""A :attr:`RoundRecord.reason`: a re-formation, and every live node asked for it."""
FORMED_PEERS_DEAD = "peers_dead"
"""A :attr:`RoundRecord.reason`: a re-formation, and every live node asked for it but those found
dead (:attr:`RoundRecord.found_dead`): it did not wait the last call for them."""
FORMED_LAST_CALL = "last_call"
"""A :attr:`RoundRecord.reason`: the last call ended."""
FORMED_REASONS = (FORMED_FULL, FORMED_ALL_IN, FORMED_PEERS_DEAD, FORMED_LAST_CALL)


@dataclass(frozen=True, slots=True)
class RoundRecord:
    """A formed round (``rdzv/ctl/round``): its members in rank order and how to reach rank 0."""

    kind = "round"

    round: int
    nodes: list[str]
    """Member node ids; a node's index is its rank."""
    nproc: list[int]
    """Workers of each member, in the same order."""
    master_addr: str
    master_port: int
    snapshot: int
    """The membership revision the round was formed from: a member lost after it is seen by watching
    the members from ``snapshot + 1``."""
    min_nodes: int
    max_nodes: int
    formed_at: float = field(default_factory=time.time)
    """Wall-clock time of forming, for people only (nothing compares it)."""
    reason: str = ""
    """Why the closer formed it then (one of :data:`FORMED_REASONS`; empty from an older version)."""
    found_dead: list[str] = field(default_factory=list)
    """Nodes whose key still lived (their lease not yet expired) but whose probe port the closer
    found refused (their process is gone): the round did not wait for them. Most often a
    member of the round before it that was killed."""

    def rank_of(self, node: str) -> int | None:
        try:
            return self.nodes.index(node)
        except ValueError:
            return None

    @property
    def world_size(self) -> int:
        return sum(self.nproc)

    def first_global_rank(self, rank: int) -> int:
        return sum(self.nproc[:rank])


@dataclass(frozen=True, slots=True)
class CloserRecord:
    """The node that forms the next round (``rdzv/ctl/closer``, on its liveness lease)."""

    kind = "closer"

    node: str


@dataclass(frozen=True, slots=True)
class ReadyRecord:
    """A node whose workers can form the group of a round now (``rdzv/ready/<round>/<node>``,
    on its liveness lease): they train and can stop at their next step, or they were started
    and wait for their peers."""

    kind = "ready"

    node: str


@dataclass(frozen=True, slots=True)
class AllReadyRecord:
    """Every node of a round said its workers are ready (``rdzv/ctl/ready``, on the run's
    lease): written by the node whose word made the count complete, so that the others learn
    it from the watch they already keep instead of each counting the ready keys."""

    kind = "all_ready"

    round: int


FINISHED = "finished"
"""A :class:`ClosedRecord` reason: a node's workers finished training (the job is done)."""


@dataclass(frozen=True, slots=True)
class ClosedRecord:
    """The rendezvous is closed (``rdzv/ctl/closed``): no further round forms."""

    kind = "closed"

    by: str
    """Who closed it (a node id, or ``elastictrain stop``)."""
    reason: str = ""
    at: float = field(default_factory=time.time)


def encode(record: Any) -> bytes:
    """The JSON bytes of ``record`` with its kind and schema version."""
    return json.dumps({"kind": record.kind, "schema": SCHEMA, **asdict(record)}, separators=(",", ":")).encode()


_FIELD_TYPES = {int: (int,), float: (int, float), str: (str,)}


def decode(cls: type[_R], key: str, value: bytes) -> _R:
    """Parse ``value`` read from etcd ``key`` as a ``cls`` record.

    Raises:
        errors.UnreadableRecordError: It is not JSON, not a ``cls`` document of our schema, or a
            field has the wrong type; the message names the key.
    """
    kind = cls.kind  # type: ignore[attr-defined]

    def corrupt(why: str) -> errors.UnreadableRecordError:
        return errors.UnreadableRecordError(
            f"etcd key {key} does not hold an elastictrain {kind} record ({why}); it was not written by "
            "this version of elastictrain: delete it, or use another run id"
        )

    try:
        doc = json.loads(value)
    except (ValueError, UnicodeDecodeError):
        raise corrupt(f"not JSON: {bytes(value[:16])!r}...") from None
    if not isinstance(doc, dict) or doc.get("kind") != kind:
        raise corrupt("wrong kind")
    if doc.get("schema") != SCHEMA:
        raise corrupt(f"schema {doc.get('schema')!r}, this version reads schema {SCHEMA}")
    kwargs: dict[str, Any] = {}
    for name, spec in cls.__dataclass_fields__.items():  # type: ignore[attr-defined]
        if name not in doc:
            if spec.default is not MISSING or spec.default_factory is not MISSING:
                continue  # optional: keep the default
            raise corrupt(f"field {name!r} missing")
        kwargs[name] = _checked(doc[name], spec.type, name, corrupt)
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise corrupt(str(exc)) from None


def _checked(value: Any, annotation: Any, name: str, corrupt: Any) -> Any:
    text = str(annotation)
    if text.startswith("list["):
        inner = {"list[str]": str, "list[int]": int}[text]
        if not isinstance(value, list) or not all(
                isinstance(v, inner) and not isinstance(v, bool) for v in value):
            raise corrupt(f"field {name!r} is not a {text}")
        return value
    if text == "bool":
        if not isinstance(value, bool):
            raise corrupt(f"field {name!r} is not a bool")
        return value
    expected = {"int": int, "float": float, "str": str}[text]
    if isinstance(value, bool) or not isinstance(value, _FIELD_TYPES[expected]):
        raise corrupt(f"field {name!r} is not a {text}")
    return value
