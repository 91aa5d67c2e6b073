"""The rendezvous under a slow network, a wrong clock and lost replies (real etcd, a delaying proxy)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters

from elastictrain.etcd import kv
from elastictrain.etcd.lease import RunLease
from elastictrain.etcd.watch import Watch, WatchEvent
from elastictrain.rendezvous.handler import create_handler
from elastictrain.rendezvous.keys import RunKeys
from elastictrain.rendezvous.store import Etcd3Store
from elastictrain.launch.run_state import read_status
from tests.conftest import REPO_ROOT, make_client, subprocess_env
from tests.support.tcp_proxy import TcpProxy

# A node whose wall clock is 30 s behind everyone else's (libfaketime shifts the whole
# process's clock, gRPC's included): it joins the round, then says every half second
# whether it sees a reason to re-form it.
_SKEWED_NODE = textwrap.dedent("""
    import json, sys, time
    clock_offset = time.time() - float(sys.argv[4])  # before the slow imports and the round
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from elastictrain.rendezvous.handler import create_handler
    endpoint, run_id, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
    handler = create_handler(RendezvousParameters("etcd3", endpoint, run_id, 3, 3, local_addr="127.0.0.1",
                                                  last_call_timeout=1, request_timeout=5, join_timeout=60))
    info = handler.next_rendezvous()
    print(json.dumps({"node": handler.node_id, "rank": info.rank, "clock_offset": clock_offset}),
          flush=True)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        print(json.dumps({"waiting": handler.num_nodes_waiting()}), flush=True)
        time.sleep(0.5)
""")


def _clock_off_by(offset: str) -> dict[str, str]:
    """Environment that shifts a process's wall clock by ``offset`` (libfaketime, a test dependency)."""
    import libfaketime

    library = Path(libfaketime.__file__).parent / "vendor" / "libfaketime" / "src" / "libfaketime.so.1"
    return {"LD_PRELOAD": str(library), "FAKETIME": offset, "DONT_FAKE_MONOTONIC": "1"}


def test_200ms_to_etcd_and_a_clock_30s_off_drop_no_live_node(etcd_server: Any, run_id: str, tmp_path: Path) -> None:
    host, port = etcd_server.endpoint.rsplit(":", 1)
    observer = make_client(etcd_server.endpoint)
    keys = RunKeys.of(run_id)
    deleted: list[str] = []

    def on_events(events: list[WatchEvent], _revision: int) -> None:
        deleted.extend(e.key for e in events if e.deleted)

    revision, _ = kv.range_(observer, keys.prefix, prefix=True, what="test")
    watch = Watch(observer, keys.members, prefix=True, start_revision=revision + 1, on_events=on_events).start()
    with TcpProxy(host, int(port), delay_s=0.1) as proxy:  # 200 ms round trips for every node
        script = tmp_path / "skewed_node.py"
        script.write_text(_SKEWED_NODE)
        skewed = subprocess.Popen([sys.executable, str(script), proxy.endpoint, run_id, "12", str(time.time())],
                                  cwd=REPO_ROOT, env=subprocess_env(**_clock_off_by("-30s")), stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
        handlers = [create_handler(RendezvousParameters("etcd3", proxy.endpoint, run_id, 3, 3,
                                                        local_addr="127.0.0.1", last_call_timeout=1,
                                                        request_timeout=5, join_timeout=60))
                    for _ in range(2)]
        with ThreadPoolExecutor(2) as pool:
            infos = list(pool.map(lambda h: h.next_rendezvous(), handlers))
        assert {i.world_size for i in infos} == {3}
        seen: list[int] = []
        until = time.monotonic() + 10  # two lease TTLs and more
        while time.monotonic() < until:
            seen += [h.num_nodes_waiting() for h in handlers]
            time.sleep(0.5)
        out, err = skewed.communicate(timeout=60)
        assert skewed.returncode == 0, err[-2000:]
        status = read_status(observer, run_id)
        expired = list(deleted)  # before the nodes leave on purpose
        for handler in handlers:
            handler.shutdown()
    watch.close()
    lines = [json.loads(line) for line in out.splitlines()]
    assert lines[0]["rank"] in (0, 1, 2)
    assert -35 < lines[0]["clock_offset"] < -25  # its clock really was 30 s behind
    assert set(seen) == {0} and {line["waiting"] for line in lines[1:]} == {0}
    assert not expired, f"etcd expired live members: {expired}"
    assert len(status.participants) == 3 and all(p["alive"] for p in status.participants)


@pytest.mark.parametrize("after", [0, 1, 2, 3])
def test_store_add_counts_once_when_etcds_reply_is_lost(etcd_server: Any, run_id: str, after: int) -> None:
    # A leader change or a broken connection loses a reply after etcd applied the
    # request: retrying a read-modify-write would count the add twice (torch's exit
    # barrier counts agents with add). ``after`` aims the loss at each reply in turn.
    host, port = etcd_server.endpoint.rsplit(":", 1)
    with TcpProxy(host, int(port)) as proxy:
        client = make_client(proxy.endpoint, retry_deadline=20)
        lease = RunLease(client, timedelta(seconds=60))
        store = Etcd3Store(client, RunKeys.of(run_id).store(1, 0), lease, timeout=timedelta(seconds=10))
        assert store.add("agents", 1) == 1  # the connection and the lease exist before the drop
        time.sleep(0.5)
        proxy.drop_next_response(after=after)
        assert store.add("agents", 1) == 2
        assert store.add("agents", 0) == 2
        assert store.get("agents") == b"2"
        lease.close()
        client.close()


def test_store_compare_set_applies_once_when_etcds_reply_is_lost(etcd_server: Any, run_id: str) -> None:
    host, port = etcd_server.endpoint.rsplit(":", 1)
    with TcpProxy(host, int(port)) as proxy:
        client = make_client(proxy.endpoint, retry_deadline=20)
        lease = RunLease(client, timedelta(seconds=60))
        store = Etcd3Store(client, RunKeys.of(run_id).store(1, 0), lease, timeout=timedelta(seconds=10))
        store.set("owner", "none")
        time.sleep(0.5)
        proxy.drop_next_response()
        # Applied, reply lost: the answer is still "it is mine", not the current value of a
        # second, failed attempt (which a caller would read as losing the race).
        assert store.compare_set("owner", "none", "me") == b"me"
        assert store.get("owner") == b"me"
        lease.close()
        client.close()


def test_a_lease_keep_alive_stream_survives_a_dropped_connection(etcd_server: Any, run_id: str) -> None:
    from elastictrain.etcd.lease import KeptLease

    host, port = etcd_server.endpoint.rsplit(":", 1)
    with TcpProxy(host, int(port)) as proxy:
        client = make_client(proxy.endpoint)
        lease = KeptLease(client, timedelta(seconds=2), interval=timedelta(seconds=0.5))
        lease_id = lease.grant()
        for _ in range(3):
            proxy.drop_next_response()
            time.sleep(1.5)
        observer = make_client(etcd_server.endpoint)
        info = observer.call(lambda c: c.get_lease_info(lease_id))
        assert info.TTL > 0 and not lease.lost
        lease.revoke()
        client.close()
        observer.close()


def test_reconnecting_watches_and_leases_leave_the_programs_random_numbers_alone(private_etcd: Any,
                                                                                 run_id: str) -> None:
    # Their back-off jitter ran on the global `random`: a trainer's RNG stream (and the RNG
    # state its checkpoint saves) then depended on when etcd was unreachable.
    import random

    from elastictrain.etcd.lease import KeptLease

    client = make_client(private_etcd.endpoint, retry_deadline=0.5)
    lease = KeptLease(client, timedelta(seconds=2), interval=timedelta(seconds=0.2))
    lease.grant()
    watch = Watch(client, RunKeys.of(run_id).members, prefix=True, start_revision=1,
                  on_events=lambda *_: None).start()
    time.sleep(0.3)
    random.seed(7)
    private_etcd.stop()  # both now retry, with back-off
    time.sleep(2.5)
    assert random.random() == random.Random(7).random()
    watch.close()
    lease.close()
    client.close()
