"""Whether a node is the one cut off from its peers: the decision, and the probe over real sockets."""

from __future__ import annotations

import socket
from datetime import timedelta

import pytest

from elastictrain.rendezvous.reachability import Answer, PeerProbe, is_cut_off, probe_all, reach_all, reaches


@pytest.mark.parametrize(("me", "reached", "cut_off"), [
    ("c", {"a": False, "b": False}, True),            # 1 of 3 cut off: it leaves
    ("a", {"b": True, "c": False}, False),            # ... and the two that reach each other stay
    ("a", {"b": True, "c": True}, False),             # everyone reached
    ("d", {"a": False, "b": False, "c": False}, True),
    ("a", {"b": True, "c": True, "d": False}, False),
    ("b", {"a": False}, True),                        # two nodes apart: the lower id's side stays
    ("a", {"b": False}, False),
    ("a", {"b": True, "c": False, "d": False}, False),  # halves: {a, b} holds the lowest id
    ("c", {"a": False, "b": False, "d": True}, True),   # ... {c, d} leaves
    ("a", {}, False),                                 # alone in its round
])
def test_the_node_on_the_minority_side_of_a_cut_is_the_one_cut_off(me: str, reached: dict[str, bool],
                                                                    cut_off: bool) -> None:
    assert is_cut_off(me, reached) is cut_off


def test_a_probe_reaches_a_listening_peer_and_not_a_closed_one() -> None:
    probe = PeerProbe()
    try:
        assert reaches("127.0.0.1", probe.port)
        assert reaches("127.0.0.1", probe.port)  # accepted and closed each time: it answers again
    finally:
        probe.close()
    assert not reaches("127.0.0.1", probe.port, timeout=timedelta(seconds=0.5))


@pytest.mark.timeout(30)
def test_peers_are_probed_at_once_and_one_that_never_answers_counts_as_unreached() -> None:
    probe = PeerProbe()
    # A socket that listens with a full backlog answers no new connection: a peer on a cut link.
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(0)
    fillers = []
    try:
        for _ in range(8):
            filler = socket.socket()
            filler.setblocking(False)
            try:
                filler.connect(("127.0.0.1", silent.getsockname()[1]))
            except BlockingIOError:
                pass
            fillers.append(filler)
        reached = reach_all({"up": ("127.0.0.1", probe.port), "cut": ("127.0.0.1", silent.getsockname()[1])},
                            timeout=timedelta(seconds=0.5))
        assert reached == {"up": True, "cut": False}
        # What each answered: a port whose process is gone is refused; one that never answers is
        # silent, not refused (nothing is known of its process).
        gone = PeerProbe()
        gone.close()
        answers = probe_all({"up": ("127.0.0.1", probe.port), "cut": ("127.0.0.1", silent.getsockname()[1]),
                             "gone": ("127.0.0.1", gone.port), "unknown": ("no-such-host.invalid", 1)},
                            timeout=timedelta(seconds=0.5))
        assert answers == {"up": Answer.ANSWERED, "cut": Answer.SILENT, "gone": Answer.REFUSED,
                           "unknown": Answer.SILENT}
    finally:
        for filler in fillers:
            filler.close()
        silent.close()
        probe.close()
