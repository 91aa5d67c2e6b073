"""Operating a live run: status, a refused duplicate run id, --join, stop, purge, events."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import Any

import pytest

from elastictrain.errors import RunIdInUseError
from elastictrain.etcd import kv
from elastictrain.launch import launcher
from elastictrain.launch.cli import main
from elastictrain.launch.config import RunConfig
from elastictrain.rendezvous.keys import RunKeys
from tests.conftest import REPO_ROOT, run_reporting_hangs, subprocess_env
from tests.support.runs import formed_round

MLP = str(REPO_ROOT / "examples" / "mlp.py")


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    """``elastictrain ARGS`` in this process (a process per call would load the 2 cores
    that the job under test needs); outputs and exit code as from a subprocess."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return subprocess.CompletedProcess(list(args), code, out.getvalue(), err.getvalue())


def cli_process(*args: str, timeout: float = 95) -> subprocess.CompletedProcess[str]:
    return run_reporting_hangs([sys.executable, "-m", "elastictrain", *args], timeout=timeout, cwd=REPO_ROOT)


def wait_for_status(endpoint: str, run_id: str, predicate: Any, timeout: float = 90) -> dict[str, Any]:
    # Polled in-process: a CLI process per poll would load the 2 cores that the
    # job's agents and workers need.
    from elastictrain.launch.run_state import read_status
    from tests.conftest import make_client

    client = make_client(endpoint)
    deadline = time.monotonic() + timeout
    status: dict[str, Any] = {}
    while time.monotonic() < deadline:
        status = read_status(client, run_id).to_json()
        if predicate(status):
            return status
        time.sleep(0.25)
    raise AssertionError(f"status never matched; last: {status}")


@pytest.mark.timeout(300)  # a whole job's life with a dozen operations on 2 cores
def test_status_duplicate_run_id_stop_and_events(etcd_server: Any, run_id: str, tmp_path: Path) -> None:
    endpoint = etcd_server.endpoint
    events = tmp_path / "events.jsonl"
    job = subprocess.Popen(
        [sys.executable, "-m", "elastictrain", "run", "--etcd", endpoint, "--run-id", run_id, "--local-nodes", "2",
         "--min-nodes", "2", "--max-nodes", "3", "--local-addr", "127.0.0.1", "--event-log", str(events),
         MLP, "--steps", "1000000", "--checkpoint-dir", str(tmp_path / "ckpt")],
        env=subprocess_env(), cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        status = wait_for_status(endpoint, run_id, lambda s: s["live"] and len(s["participants"]) == 2
                                 and [n["state"] for n in s["nodes"]] == ["running", "running"])
        assert sorted(p["rank"] for p in status["participants"]) == [0, 1]
        assert status["meta"]["min_nodes"] == 2 and status["meta"]["max_nodes"] == 3
        table = cli("status", "--etcd", endpoint, "--run-id", run_id)
        assert table.returncode == 0
        assert f"run '{run_id}': training, round 0, 2 node(s) (min 2, max 3), world size 2" in table.stdout
        assert "127.0.0.1" in table.stdout and "LEASE" in table.stdout and "s left" in table.stdout
        listing = cli("status", "--etcd", endpoint, "--all")
        assert run_id in listing.stdout
        empty = tmp_path / "no-checkpoints"
        empty.mkdir()  # a directory asked about is answered, even when it holds none (it said nothing)
        table = cli("status", "--etcd", endpoint, "--run-id", run_id, "--checkpoint-dir", str(empty))
        assert table.returncode == 0 and f"newest checkpoint: none in {empty}" in table.stdout

        nodes_before = {n["node_id"] for n in status["nodes"]}
        duplicate = cli_process("run", "--etcd", endpoint, "--run-id", run_id, MLP)
        assert duplicate.returncode == 1
        assert duplicate.stderr.strip().splitlines() == [
            f"elastictrain: error: run id '{run_id}' is live: round 0 trains with 2 node(s) on 127.0.0.1; "
            "pass --join to add this node to it, or choose another --run-id (it runs mlp.py on 2-3 nodes x 1)"
        ]
        after = wait_for_status(endpoint, run_id, lambda s: True)
        # The refused node left no trace: same round, no new node record, not waiting.
        assert after["round"] == status["round"] and not after["closed"]
        assert {n["node_id"] for n in after["nodes"]} == nodes_before and after["waiting"] == []

        refused = cli("stop", "--etcd", endpoint, "--run-id", run_id, "--purge")
        assert refused.returncode == 2 and "is training; stop it first" in refused.stderr
        stopped = cli("stop", "--etcd", endpoint, "--run-id", run_id)
        assert stopped.returncode == 0, stopped.stderr
        output, _ = job.communicate(timeout=90)
        assert job.returncode == 0, output[-3000:]
    finally:
        if job.poll() is None:
            job.kill()
    ended = wait_for_status(endpoint, run_id, lambda s: True)
    assert [n["state"] for n in ended["nodes"]] == ["succeeded", "succeeded"]  # each node's last record
    kinds = [json.loads(line) for line in events.read_text().splitlines()]
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for event in kinds:
        by_kind.setdefault(event["kind"], []).append(event)
    assert {e["node"] for e in by_kind["rendezvous"]} == {"node0", "node1"}
    assert all(e["world_size"] == 2 and e["run_id"] == run_id for e in by_kind["rendezvous"])
    assert [e["exit_code"] for e in by_kind["job_end"]] == [0, 0]
    assert "torch_agent" in by_kind

    again = cli("run", "--etcd", endpoint, "--run-id", run_id, MLP)
    assert again.returncode == 1 and "was stopped with `elastictrain stop`" in again.stderr
    purged = cli("stop", "--etcd", endpoint, "--run-id", run_id, "--purge")
    assert purged.returncode == 0 and "the run id is free again" in purged.stdout
    gone = cli("status", "--etcd", endpoint, "--run-id", run_id, "--json")
    assert gone.returncode == 1 and json.loads(gone.stdout)["exists"] is False


def test_a_starting_node_checks_its_run_id_without_reading_the_nodes_records_or_the_rounds_stores(
        etcd_client: Any, run_id: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every node that starts checks that its run id is free, or its own job's. It read all of the
    run's keys: at 1,000 nodes, each node's record and the last rounds' stores too, for each
    node that starts. It reads the rendezvous keys and the metadata, in one request."""
    keys, nodes = RunKeys.of(run_id), ["n0", "n1"]
    kv.txn(etcd_client, [], [
        *formed_round(etcd_client, keys, nodes),
        *(kv.put(keys.record(node), json.dumps({"node_id": node}).encode()) for node in nodes),
        kv.put(keys.meta, json.dumps({"script": "other.py"}).encode()),
        *(kv.put(f"{keys.store(1, 1)}key{i}", b"x") for i in range(40)),
    ], what="test")
    read: list[str] = []
    from_pb = kv.KeyValue.from_pb
    monkeypatch.setattr(kv.KeyValue, "from_pb", classmethod(lambda cls, pb: (read.append(pb.key.decode()),
                                                                              from_pb(pb))[1]))
    with pytest.raises(RunIdInUseError, match="is live: round 1 trains with 2 node"):
        launcher._check_run_id(types.SimpleNamespace(client=etcd_client),  # type: ignore[arg-type]
                               RunConfig(script=__file__, run_id=run_id))
    assert keys.round in read and keys.meta in read
    assert not [key for key in read if key.startswith((keys.records, keys.prefix + "store/"))], read
