"""Whether a node still reaches the other members of its round: the gray failure of a node cut off
from its peers while etcd still hears from it.

Such a node's lease stays alive, so nothing in etcd says it is gone, and its collectives (and
its peers') wait for the group's timeout, again at every re-formation that takes it back. So
each member listens on a port of its own (:class:`PeerProbe`, published in its member record)
and, when its workers wait in a collective for long, its agent asks whether this node reaches
the others (:func:`reaches`, a TCP connect each). The node that reaches fewer than half of its
peers is the one cut off (:func:`is_cut_off`): it leaves the round (its lease revoked, so the
others re-form at once without it) and joins again once it reaches them.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

logger = logging.getLogger(__name__)

__all__ = ["PeerProbe", "is_cut_off", "reach_all", "reaches"]

PROBE_TIMEOUT = timedelta(seconds=1)
"""How long a probe waits for a peer's answer (a peer on a cut link never answers)."""


class PeerProbe:
    """A listening socket that accepts and closes every connection: a peer that connects knows
    this node's host answers. It listens on every interface (the member record says which
    address the peers use: ``--local-addr``)."""

    def __init__(self) -> None:
        if socket.has_dualstack_ipv6():
            self._socket = socket.create_server(("", 0), family=socket.AF_INET6, dualstack_ipv6=True, backlog=64)
        else:
            self._socket = socket.create_server(("", 0), backlog=64)
        self.port: int = self._socket.getsockname()[1]
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name="elastictrain-peer-probe", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._closed:
            try:
                connection, _ = self._socket.accept()
            except OSError:
                return  # closed
            connection.close()

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._socket.shutdown(socket.SHUT_RDWR)
        self._socket.close()


def reaches(addr: str, port: int, timeout: timedelta = PROBE_TIMEOUT) -> bool:
    """Whether a TCP connection to ``addr``:``port`` is accepted within ``timeout``."""
    try:
        with socket.create_connection((addr.strip("[]"), port), timeout=timeout.total_seconds()):
            return True
    except OSError:
        return False


def reach_all(peers: Mapping[str, tuple[str, int]], timeout: timedelta = PROBE_TIMEOUT) -> dict[str, bool]:
    """Probe every peer (``node: (addr, port)``) at once; whether each answered."""
    if not peers:
        return {}
    with ThreadPoolExecutor(max_workers=min(16, len(peers)), thread_name_prefix="elastictrain-probe") as pool:
        answers = {node: pool.submit(reaches, addr, port, timeout) for node, (addr, port) in peers.items()}
        return {node: answer.result() for node, answer in answers.items()}


def is_cut_off(me: str, reached: Mapping[str, bool]) -> bool:
    """Whether node ``me`` is the one cut off, from whether it reached each other member.

    Its side is itself and the members it reached. It is cut off when its side is a minority of
    the round; on a tie (two nodes that cannot reach each other, a round split in halves) the
    side without the lowest node id leaves, so that one side trains on: each side decides
    alone, from the same member list.
    """
    side = [me, *(node for node, ok in reached.items() if ok)]
    members = 1 + len(reached)
    if 2 * len(side) != members:
        return 2 * len(side) < members
    return min(side) != min([me, *reached])
