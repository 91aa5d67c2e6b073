"""A run's rendezvous keys written by hand: a formed round and its members, without any node."""

from __future__ import annotations

from typing import Any

from elastictrain.etcd import kv
from elastictrain.etcd.client import EtcdClient
from elastictrain.rendezvous.keys import RunKeys
from elastictrain.rendezvous.records import MemberRecord, RoundRecord, encode


def formed_round(client: EtcdClient, keys: RunKeys, nodes: list[str], *, lease_ttl: int = 60) -> list[Any]:
    """The puts (for a transaction) of round 1 of ``nodes`` and of each node's member key, on a
    lease of its own (granted here, ``lease_ttl`` seconds), as a live job of one worker a node has."""
    puts = [kv.put(keys.round, encode(RoundRecord(round=1, nodes=nodes, nproc=[1] * len(nodes),
                                                  master_addr="127.0.0.1", master_port=1, snapshot=1,
                                                  min_nodes=len(nodes), max_nodes=len(nodes))))]
    for node in nodes:
        lease = client.call(lambda c: c.lease(lease_ttl), what="granting a member's lease")
        puts.append(kv.put(keys.member(node), encode(MemberRecord(node=node, addr="127.0.0.1", host="host", pid=1,
                                                                  nproc=1, port=1, after=0)), lease.id))
    return puts
