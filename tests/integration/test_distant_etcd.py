"""An etcd far away (another zone or region, a congested link): every command still works.

The link is a :class:`~tests.support.tcp_proxy.TcpProxy` that delays each direction.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from elastictrain.etcd import kv
from elastictrain.etcd.client import EtcdClient
from elastictrain.launch import run_state
from elastictrain.launch.run_state import STATUS_PAGE, read_status
from elastictrain.rendezvous.keys import KEY_ROOT, RunKeys
from tests.conftest import REPO_ROOT, subprocess_env
from tests.support.runs import formed_round
from tests.integration.test_operations import cli
from tests.support.tcp_proxy import TcpProxy

SCRIPT = str(REPO_ROOT / "tests" / "scripts" / "ddp_steps.py")


def run_through(proxy: TcpProxy, run_id: str, out: Path, *script_args: str) -> list[str]:
    """``elastictrain run`` of the test job, one node, with etcd behind ``proxy``."""
    return [sys.executable, "-m", "elastictrain", "run", "--etcd", proxy.endpoint, "--run-id", run_id,
            "--local-addr", "127.0.0.1", SCRIPT, str(out), *script_args]


@pytest.mark.parametrize("round_trip", [0.2, 0.5])
def test_status_reaches_a_distant_etcd(etcd_server: Any, round_trip: float) -> None:
    with TcpProxy("127.0.0.1", etcd_server.options.client_port, delay_s=round_trip / 2) as proxy:
        started = time.monotonic()
        result = cli("status", "--etcd", proxy.endpoint, "--all")
        assert result.returncode == 0, result.stderr
        # Within the 30 s retry deadline that ends in "unreachable": a handful of round trips
        # (2 s here), whatever the number of runs that the suite's tests left on this etcd.
        assert time.monotonic() - started < 29


def test_status_of_every_run_asks_etcd_as_often_whatever_the_number_of_runs(
        etcd_client: EtcdClient, etcd_server: Any, run_id: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``status --all`` read each run in a request of its own: a round trip per run, 25 s for
    50 runs 0.5 s away. It reads them all at once (a request per page of keys)."""
    runs = [f"{run_id}-{i}" for i in range(40)]
    kv.txn(etcd_client, [], [kv.put(RunKeys.of(run).meta, json.dumps({"script": "x.py"}).encode()) for run in runs],
           what="test")
    keys = kv.count(etcd_client, KEY_ROOT + "/", what="test")
    requests: list[str] = []
    call = EtcdClient.call

    def counted(self: EtcdClient, operation: Any, what: str = "etcd request", **kwargs: Any) -> Any:
        requests.append(what)
        return call(self, operation, what, **kwargs)

    monkeypatch.setattr(EtcdClient, "call", counted)
    result = cli("status", "--etcd", etcd_server.endpoint, "--all", "--json")
    assert result.returncode == 0, result.stderr
    assert set(runs) <= {run["run_id"] for run in json.loads(result.stdout)}
    assert len(requests) <= 1 + keys // STATUS_PAGE + 1, requests  # a connection check, a request per page


def test_status_asks_for_the_leases_of_a_runs_nodes_several_at_once(
        etcd_client: EtcdClient, run_id: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A request per node's lease, one after the other: 32 s for a run of 64 nodes 0.5 s away."""
    keys, nodes = RunKeys.of(run_id), [f"n{i}" for i in range(8)]
    kv.txn(etcd_client, [], formed_round(etcd_client, keys, nodes), what="test")
    together = threading.Barrier(4, timeout=10)  # broken (and the lookup fails) unless 4 ask at once
    lease_ttl = run_state._lease_ttl

    def ask_together(client: EtcdClient, lease_id: int) -> Any:
        together.wait()
        return lease_ttl(client, lease_id)

    monkeypatch.setattr(run_state, "_lease_ttl", ask_together)
    status = read_status(etcd_client, run_id)
    assert [p["node_id"] for p in status.participants] == nodes
    assert all(p["alive"] and 0 < p["lease_ttl_s"] <= 60 for p in status.participants), status.participants


@pytest.mark.timeout(240)
@pytest.mark.parametrize("round_trip", [0.5])  # the farther of the two status reaches
def test_run_status_and_stop_through_a_distant_etcd(etcd_server: Any, run_id: str, tmp_path: Path,
                                                    round_trip: float) -> None:
    out = tmp_path / "out"
    with TcpProxy("127.0.0.1", etcd_server.options.client_port, delay_s=round_trip / 2) as proxy:
        job = subprocess.Popen(run_through(proxy, run_id, out, "--sleep", "120"), env=subprocess_env(), cwd=tmp_path,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            deadline = time.monotonic() + 120
            while not (out / "pid-0-0").exists() and job.poll() is None and time.monotonic() < deadline:
                time.sleep(0.2)
            assert (out / "pid-0-0").exists(), "no worker started"  # the rendezvous completed
            status = cli("status", "--etcd", proxy.endpoint, "--run-id", run_id)
            assert status.returncode == 0, status.stderr
            assert f"run '{run_id}': training" in status.stdout
            stopped = cli("stop", "--etcd", proxy.endpoint, "--run-id", run_id)
            assert stopped.returncode == 0, stopped.stderr
            output, _ = job.communicate(timeout=120)
            assert job.returncode == 0, output[-3000:]
            assert f"run '{run_id}' was stopped by `elastictrain stop`" in output
        finally:
            if job.poll() is None:
                job.kill()
                job.wait()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("round_trip", [0.5])  # the farther of the two status reaches
def test_short_job_trains_through_a_distant_etcd(etcd_server: Any, run_id: str, tmp_path: Path,
                                                 round_trip: float) -> None:
    out = tmp_path / "out"
    with TcpProxy("127.0.0.1", etcd_server.options.client_port, delay_s=round_trip / 2) as proxy:
        result = subprocess.run(run_through(proxy, run_id, out, "--steps", "20"), env=subprocess_env(), cwd=tmp_path,
                                capture_output=True, text=True, timeout=200)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"run '{run_id}' finished" in result.stderr
    assert (out / "rank-0.json").exists()
