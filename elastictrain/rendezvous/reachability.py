"""Whether a node still reaches the other members of its round: the gray failure of a node cut off
from its peers while etcd still hears from it.

Such a node's lease stays alive, so nothing in etcd says it is gone, and its collectives (and
its peers') wait for the group's timeout, again at every re-formation that takes it back. So
each member listens on a port of its own (:class:`PeerProbe`, published in its member record)
and, when its workers wait in a collective for long, its agent asks whether this node reaches
the others (:func:`reaches`, a TCP connect each). The node that reaches fewer than half of its
peers is the one cut off (:func:`is_cut_off`): it leaves the round (its lease revoked, so the
others re-form at once without it) and joins again once it reaches them.

The same probe tells a member that died from one that is slow or cut off (:func:`probe`): a port
whose process is gone is refused at once by its host (an RST), while a live member's port
accepts (its kernel completes the handshake even while the process is stopped or busy), and a
host that is down or cut off does not answer at all. The closer of a re-forming round uses this
not to wait the last call for a member of the previous round that is provably dead
(:class:`~elastictrain.rendezvous.membership.Closer`).
"""

from __future__ import annotations

import contextlib
import enum
import logging
import socket
import threading
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

logger = logging.getLogger(__name__)

__all__ = ["Answer", "PeerProbe", "is_cut_off", "probe", "probe_all", "reach_all", "reaches"]

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


class Answer(enum.Enum):
    """What a probe of a peer's port met."""

    ANSWERED = "answered"
    """The connection was accepted: the process that published the port lives (it may be slow or
    stopped: its kernel still completes the handshake)."""
    REFUSED = "refused"
    """Every address of the peer refused the connection at once: its host is up and nothing
    listens on the port any more, so the process that published it is gone."""
    SILENT = "silent"
    """No answer within the timeout, or another error (host unreachable, name not resolved): a host
    that is down or cut off, or a slow network. Nothing is known of the process."""


def probe(addr: str, port: int, timeout: timedelta = PROBE_TIMEOUT) -> Answer:
    """Connect to ``addr``:``port`` (each of its addresses in turn, all within ``timeout``) and say
    what answered (:class:`Answer`)."""
    deadline = time.monotonic() + timeout.total_seconds()
    try:
        found = socket.getaddrinfo(addr.strip("[]"), port, type=socket.SOCK_STREAM)
    except OSError:
        return Answer.SILENT
    refused = 0
    for family, kind, proto, _, sockaddr in found:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            with socket.socket(family, kind, proto) as sock:
                sock.settimeout(left)
                sock.connect(sockaddr)
            return Answer.ANSWERED
        except ConnectionRefusedError:
            refused += 1
        except OSError:
            pass  # a timeout, an unreachable host or network: no word on the process
    return Answer.REFUSED if found and refused == len(found) else Answer.SILENT


def reaches(addr: str, port: int, timeout: timedelta = PROBE_TIMEOUT) -> bool:
    """Whether a TCP connection to ``addr``:``port`` is accepted within ``timeout``."""
    return probe(addr, port, timeout) is Answer.ANSWERED


def probe_all(peers: Mapping[str, tuple[str, int]], timeout: timedelta = PROBE_TIMEOUT) -> dict[str, Answer]:
    """Probe every peer (``node: (addr, port)``) at once; what each answered."""
    if not peers:
        return {}
    with ThreadPoolExecutor(max_workers=min(16, len(peers)), thread_name_prefix="elastictrain-probe") as pool:
        answers = {node: pool.submit(probe, addr, port, timeout) for node, (addr, port) in peers.items()}
        return {node: answer.result() for node, answer in answers.items()}


def reach_all(peers: Mapping[str, tuple[str, int]], timeout: timedelta = PROBE_TIMEOUT) -> dict[str, bool]:
    """Probe every peer (``node: (addr, port)``) at once; whether each answered."""
    return {node: answer is Answer.ANSWERED for node, answer in probe_all(peers, timeout).items()}


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
