"""How a node is named for people, and the fault a node saw, as it travels to the other nodes.

Names: a node keeps its name for its whole life (``--local-nodes``' ``node0``, ``node1``, ... in
launch order, else its host name), while its node rank is decided at each rendezvous and changes
when the job resizes. A name drawn from a rank would lie after the first resize, so the names stay
and every line that names a node says its node rank as well, as of that line: ``node1 (node rank
0)`` (:func:`node_label`).

Faults: the node whose worker died knows which rank it was and how it ended; the others only see
their collectives fail or the round change. The failing node's agent writes what it saw into its
member record as it asks for a new round (:class:`~elastictrain.rendezvous.records.MemberRecord`'s
``fault_rank`` and ``fault_how``), the other agents read it there and hand it to their workers with
the next generation (:class:`~elastictrain._control.Assignment`'s ``fault``), so that every node
states the cause: ``rank 1 on node2 (node rank 1) was killed by SIGKILL``. Plain JSON, bounded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["MAX_HOW", "Fault", "node_label", "node_name_of"]

MAX_HOW = 160
"""The most characters of a fault's ``how`` that travel (an error message is cut there)."""


def node_label(name: str, node_rank: int | None) -> str:
    """``node1 (node rank 0)``: a node's name and its node rank now; the name alone when the rank
    is not known (before its first rendezvous)."""
    return name if node_rank is None else f"{name} (node rank {node_rank})"


def node_name_of(node_id: str) -> str:
    """The name a rendezvous node id starts with (``node2`` of ``node2@127.0.0.1_5995_154fbb``)."""
    return node_id.partition("@")[0] if "@" in node_id else node_id


def _bounded(text: str) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= MAX_HOW else text[:MAX_HOW - 3] + "..."


@dataclass(frozen=True, slots=True)
class Fault:
    """A fault as the node that saw it tells it."""

    rank: int | None
    """The global rank of the worker that failed; None: the node as a whole (lost, left)."""
    node: str
    """The node's name (:func:`node_name_of`)."""
    node_rank: int | None
    """Its node rank in the round the fault struck."""
    how: str
    """How it ended: ``was killed by SIGKILL``, ``exited with code 1``, ``hung and was killed``."""

    def describe(self) -> str:
        """``rank 1 on node2 (node rank 1) was killed by SIGKILL``."""
        who = node_label(self.node, self.node_rank)
        return f"rank {self.rank} on {who} {self.how}" if self.rank is not None else f"{who} {self.how}"

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "node": self.node, "node_rank": self.node_rank, "how": _bounded(self.how)}

    @classmethod
    def from_json(cls, data: Any) -> Fault | None:
        """The fault ``data`` holds (:meth:`to_json`), or None when it holds none or is malformed."""
        if not isinstance(data, dict) or not isinstance(data.get("node"), str) or not data.get("how"):
            return None
        rank, node_rank = data.get("rank"), data.get("node_rank")
        if not all(v is None or (isinstance(v, int) and not isinstance(v, bool)) for v in (rank, node_rank)):
            return None
        return cls(rank=rank, node=data["node"], node_rank=node_rank, how=_bounded(str(data["how"])))
