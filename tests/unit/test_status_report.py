"""``elastictrain status``'s table (``elastictrain.launch.status_report``) from a run's records."""

from __future__ import annotations

import os
import time

from elastictrain.launch.run_state import RunStatus
from elastictrain.launch.status_report import run_table
from elastictrain.rendezvous.records import describe_node, node_id_for


def _node(node_id: str, state: str, alive: bool, ago: float = 60.0) -> dict[str, object]:
    return {"node_id": node_id, "host": node_id, "addr": "10.0.0.1", "pid": 7, "state": state, "restarts": 0,
            "updated_at": time.time() - ago, "alive": alive}


def _rows(table: str) -> dict[str, str]:
    return {line.split()[1]: line for line in table.splitlines()[2:] if line.startswith("  ") and "RANK" not in line}


def test_a_node_whose_lease_is_gone_is_lost_whatever_it_last_said_and_one_that_finished_says_so() -> None:
    # Probe, stop 29: a SIGKILLed agent showed as "running, updated 64.1s ago" after it left the
    # round, and nodes that finished with exit 0 as "expired lost".
    status = RunStatus(
        run_id="r", exists=True, round=2, closed=True, meta={"min_nodes": 2, "max_nodes": 2},
        participants=[{"node_id": n, "rank": r, "addr": "10.0.0.1", "pid": 7, "nproc": 1, "alive": False,
                       "lease_ttl_s": None} for r, n in enumerate(["done", "killed-member"])],
        nodes=[_node("done", "succeeded", False), _node("killed-member", "running", False),
               _node("killed-earlier", "running", False), _node("training", "running", True, ago=2)])
    rows = _rows(run_table(status, None))
    assert "released" in rows["done"] and "succeeded" in rows["done"] and "lost" not in rows["done"]
    assert "expired" in rows["killed-member"] and "lost (last said running 60.0s ago)" in rows["killed-member"]
    assert "lost (last said running 60.0s ago)" in rows["killed-earlier"]
    assert "running, updated 2.0s ago" in rows["training"]


def test_a_hot_spare_shows_as_a_spare_and_the_header_counts_it() -> None:
    status = RunStatus(
        run_id="r", exists=True, round=1, meta={"min_nodes": 2, "max_nodes": 2},
        participants=[{"node_id": n, "rank": r, "addr": "10.0.0.1", "pid": 7, "nproc": 1, "alive": True,
                       "lease_ttl_s": 5} for r, n in enumerate(["a", "b"])],
        waiting=["spare", "joiner"],
        nodes=[_node("a", "running", True, ago=1), _node("b", "running", True, ago=1),
               _node("spare", "spare", True, ago=9), _node("joiner", "rendezvous", True, ago=1)])
    table = run_table(status, None)
    assert "waiting to join: 2 (1 hot spare(s))" in table.splitlines()[0]
    rows = _rows(table)
    assert rows["spare"].split()[-2:] == ["spare", "0"] and "held" in rows["spare"]
    assert rows["joiner"].split()[-2:] == ["waiting", "0"]


def test_the_table_names_each_node_as_its_lines_do_and_its_host() -> None:
    # Issue 43: three local nodes all showed as `NODE vm` (the host name).
    status = RunStatus(
        run_id="r", exists=True, round=0, meta={"min_nodes": 2, "max_nodes": 2},
        participants=[{"node_id": n, "rank": r, "addr": "127.0.0.1", "pid": 7, "nproc": 1, "alive": True,
                       "lease_ttl_s": 5} for r, n in enumerate(["id-a", "id-b"])],
        nodes=[{**_node("id-a", "running", True, ago=1), "name": "node1", "host": "vm"},
               {**_node("id-b", "running", True, ago=1), "host": "old"}])  # a record without a name
    lines = run_table(status, None).splitlines()
    assert lines[1].split()[:4] == ["RANK", "NODE", "HOST", "ADDRESS"]
    assert lines[2].split()[:3] == ["0", "node1", "vm"] and lines[3].split()[:3] == ["1", "old", "old"]


def test_a_node_id_names_the_node_and_its_address_and_says_so_to_people() -> None:
    node_id = node_id_for("node2", "127.0.0.1")
    assert node_id.startswith("node2@127.0.0.1_")
    assert describe_node(node_id) == f"node2@127.0.0.1 (pid {os.getpid()})"
    assert describe_node("127.0.0.1_5995_154fbb") == "127.0.0.1_5995_154fbb"  # an older id: as it is
