"""A re-forming round does not wait the last call for a member that is provably dead (real etcd,
real node processes): the closer probes the port each member publishes, and a port refused means
the member's process is gone, while a member that answers (alive, even stopped) or does not answer
at all (a host cut off) is waited for as before."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters

from elastictrain.etcd import kv
from elastictrain.rendezvous.handler import Etcd3RendezvousHandler, create_handler
from elastictrain.rendezvous.keys import RunKeys
from elastictrain.rendezvous.membership import read_members
from elastictrain.rendezvous.records import (
    FORMED_ALL_IN,
    FORMED_LAST_CALL,
    FORMED_PEERS_DEAD,
    RoundRecord,
    decode,
)
from tests.conftest import REPO_ROOT, subprocess_env

pytestmark = pytest.mark.timeout(90)

# Long enough that a round formed by its end says so (FORMED_LAST_CALL) rather than by a probe.
LAST_CALL = 5.0
# A killed node's key outlives every test here: only a probe can tell that it is dead.
LONG_LEASE = {"keep_alive_interval": 5, "keep_alive_max_attempt": 6}

# A node of its own process: it joins the first round, prints its id, then does what each line
# on its stdin says ("rejoin": ask for the next round and print it). With --silent-probe its
# member record publishes a port that never answers (a listening socket with a full backlog drops
# every new connection): a host cut off from the others.
_NODE = textwrap.dedent("""
    import json, socket, sys
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from elastictrain.rendezvous.handler import create_handler
    endpoint, run_id, last_call = sys.argv[1], sys.argv[2], float(sys.argv[3])
    handler = create_handler(RendezvousParameters(
        "etcd3", endpoint, run_id, 2, 3, local_addr="127.0.0.1", last_call_timeout=last_call,
        keep_alive_interval=5, keep_alive_max_attempt=6, request_timeout=5, join_timeout=60))
    if "--silent-probe" in sys.argv:
        class Silent:
            def __init__(self):
                self.sock = socket.socket()
                self.sock.bind(("127.0.0.1", 0))
                self.sock.listen(0)
                self.port = self.sock.getsockname()[1]
                self.fillers = []
                for _ in range(8):
                    filler = socket.socket()
                    filler.setblocking(False)
                    try:
                        filler.connect(("127.0.0.1", self.port))
                    except BlockingIOError:
                        pass
                    self.fillers.append(filler)
            def close(self):
                self.sock.close()
        handler._probe.close()
        handler._probe = Silent()
    print(json.dumps({"node": handler.node_id, "pid": __import__("os").getpid()}), flush=True)
    info = handler.next_rendezvous()
    print(json.dumps({"round": handler.round, "world": info.world_size}), flush=True)
    for line in sys.stdin:
        if line.strip() == "rejoin":
            info = handler.next_rendezvous()
            print(json.dumps({"round": handler.round, "world": info.world_size}), flush=True)
    handler.shutdown()
""")


def _handler(endpoint: str, run_id: str) -> Etcd3RendezvousHandler:
    return create_handler(RendezvousParameters("etcd3", endpoint, run_id, 2, 3, local_addr="127.0.0.1",
                                               last_call_timeout=LAST_CALL, request_timeout=5, join_timeout=60,
                                               retry_deadline=20, **LONG_LEASE))


def _start_node(tmp_path: Path, endpoint: str, run_id: str, *flags: str) -> tuple[subprocess.Popen[str], str]:
    script = tmp_path / "node.py"
    script.write_text(_NODE)
    node = subprocess.Popen([sys.executable, str(script), endpoint, run_id, str(LAST_CALL), *flags], cwd=REPO_ROOT,
                            env=subprocess_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert node.stdout is not None
    line = node.stdout.readline()
    assert line, "the node process printed nothing"
    return node, json.loads(line)["node"]


def _first_round(tmp_path: Path, endpoint: str, run_id: str, *flags: str
                 ) -> tuple[list[Etcd3RendezvousHandler], subprocess.Popen[str], str]:
    """Two nodes in this process and one of its own, all three in round 0 (it forms at once:
    max_nodes wait)."""
    node, node_id = _start_node(tmp_path, endpoint, run_id, *flags)
    handlers = [_handler(endpoint, run_id) for _ in range(2)]
    deadline = time.monotonic() + 30
    while node_id not in read_members(handlers[0].client, RunKeys.of(run_id)):
        assert time.monotonic() < deadline, "the node process never registered"
        time.sleep(0.05)
    with ThreadPoolExecutor(2) as pool:
        infos = list(pool.map(lambda h: h.next_rendezvous(), handlers))
    assert {i.world_size for i in infos} == {3}
    assert node.stdout is not None and json.loads(node.stdout.readline()) == {"round": 0, "world": 3}
    return handlers, node, node_id


def _round_record(handler: Etcd3RendezvousHandler) -> RoundRecord:
    keys = handler.keys
    return decode(RoundRecord, keys.round, kv.range_(handler.client, keys.round, what="test")[1][0].value)


def _end(node: subprocess.Popen[str], handlers: list[Etcd3RendezvousHandler]) -> None:
    for handler in handlers:
        handler.shutdown()
    if node.poll() is None:
        node.kill()
    node.wait(10)


def test_a_killed_member_is_found_dead_by_its_refused_probe_and_not_waited_for(etcd_server: Any, run_id: str,
                                                                              tmp_path: Path) -> None:
    handlers, node, node_id = _first_round(tmp_path, etcd_server.endpoint, run_id)
    try:
        node.send_signal(signal.SIGKILL)  # agent and all: its lease lives on for 30 s
        node.wait(10)
        assert node_id in read_members(handlers[0].client, RunKeys.of(run_id))
        with ThreadPoolExecutor(2) as pool:
            infos = list(pool.map(lambda h: h.next_rendezvous(), handlers))
        assert {i.world_size for i in infos} == {2}
        record = _round_record(handlers[0])
        assert record.round == 1 and node_id not in record.nodes
        assert (record.reason, record.found_dead) == (FORMED_PEERS_DEAD, [node_id])
        assert node_id in read_members(handlers[0].client, RunKeys.of(run_id))  # not its lease's doing
        # The survivors' recovery states it, by name and node rank in the round it left.
        [fault] = handlers[0].round_faults()
        assert fault.rank is None and fault.node_rank == 0 and "probe port refused" in fault.how
    finally:
        _end(node, handlers)


def test_a_member_alive_but_stopped_still_answers_and_is_waited_for(etcd_server: Any, run_id: str,
                                                                     tmp_path: Path) -> None:
    # Its agent is frozen (SIGSTOP): its process runs nothing, but its kernel still accepts the
    # probe's connection. The round must wait for it, and take it in once it asks.
    handlers, node, node_id = _first_round(tmp_path, etcd_server.endpoint, run_id)
    try:
        node.send_signal(signal.SIGSTOP)
        with ThreadPoolExecutor(2) as pool:
            survivors = [pool.submit(h.next_rendezvous) for h in handlers]
            time.sleep(1.5)  # several probes, each answered
            assert not any(f.done() for f in survivors), "the round formed without a live member"
            node.send_signal(signal.SIGCONT)
            assert node.stdin is not None
            node.stdin.write("rejoin\n")
            node.stdin.flush()
            infos = [f.result(timeout=30) for f in survivors]
        assert {i.world_size for i in infos} == {3}
        assert node.stdout is not None and json.loads(node.stdout.readline()) == {"round": 1, "world": 3}
        record = _round_record(handlers[0])
        assert node_id in record.nodes and (record.reason, record.found_dead) == (FORMED_ALL_IN, [])
    finally:
        node.send_signal(signal.SIGCONT)
        _end(node, handlers)


def test_a_member_whose_probe_goes_unanswered_is_waited_for_the_whole_last_call(etcd_server: Any, run_id: str,
                                                                               tmp_path: Path) -> None:
    # A host cut off or powered off answers nothing: no word on its process, so no guess either.
    handlers, node, node_id = _first_round(tmp_path, etcd_server.endpoint, run_id, "--silent-probe")
    try:
        with ThreadPoolExecutor(2) as pool:
            infos = list(pool.map(lambda h: h.next_rendezvous(), handlers))
        assert {i.world_size for i in infos} == {2}
        record = _round_record(handlers[0])
        assert node_id not in record.nodes and (record.reason, record.found_dead) == (FORMED_LAST_CALL, [])
    finally:
        _end(node, handlers)
