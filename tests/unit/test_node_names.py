"""How nodes are named for people (issue 43): a name that stays, with its node rank of the moment."""

from __future__ import annotations

import dataclasses

import pytest

from elastictrain._fault import MAX_HOW, Fault, node_label
from elastictrain.launch.agent import _membership_change, describe_change
from elastictrain.rendezvous.records import RoundRecord, describe_node

pytestmark = pytest.mark.timeout(10)


def _round(number: int, nodes: list[str]) -> RoundRecord:
    return RoundRecord(round=number, nodes=nodes, nproc=[1] * len(nodes), master_addr="127.0.0.1", master_port=1,
                       snapshot=0, min_nodes=1, max_nodes=3)


def test_a_node_is_named_with_its_node_rank_of_the_moment() -> None:
    assert node_label("node1", 0) == "node1 (node rank 0)"
    assert node_label("node1", None) == "node1"  # before its first rendezvous
    assert describe_node("node1@127.0.0.1_5995_154fbb", 2) == "node1@127.0.0.1 (node rank 2, pid 5995)"


def test_a_lost_node_is_named_by_name_address_and_its_node_rank_never_by_its_id_alone() -> None:
    a, b, c = (f"node{i}@127.0.0.1_{100 + i}_abcdef" for i in range(3))
    said = describe_change(_round(1, [c, a, b]), _round(2, [c, b]))
    assert said == "; node(s) left: node0@127.0.0.1 (node rank 1, pid 100)"
    assert "_abcdef" not in said
    joined = describe_change(_round(2, [c, b]), _round(3, [c, b, a]))
    assert joined == "; node(s) joined: node0@127.0.0.1 (node rank 2, pid 100)"
    # A node the round did not wait for, its probe port refused, says so (and its event lists it).
    dead = dataclasses.replace(_round(2, [c, b]), found_dead=[a])
    assert describe_change(_round(1, [c, a, b]), dead) == \
        "; node(s) left: node0@127.0.0.1 (node rank 1, pid 100) (found dead: its probe port refused)"
    assert _membership_change(_round(1, [c, a, b]), dead) == {"nodes_left": [a], "nodes_found_dead": [a]}


def test_a_fault_travels_as_bounded_json_and_a_malformed_one_is_none() -> None:
    fault = Fault(rank=1, node="node2", node_rank=0, how="failed: " + "x" * 1000)
    back = Fault.from_json(fault.to_json())
    assert back is not None and len(back.how) == MAX_HOW
    assert back.describe().startswith("rank 1 on node2 (node rank 0) failed: xxx")
    assert Fault(rank=None, node="node2", node_rank=1, how="is gone").describe() == "node2 (node rank 1) is gone"
    for bad in (None, {}, {"node": "n", "how": "x", "rank": "1"}, {"node": 3, "how": "x"}, []):
        assert Fault.from_json(bad) is None
