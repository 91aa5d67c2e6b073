"""hsdp's sub-groups time out as the default group does: a rank hung in an hsdp step is noticed within
the collective timeout, not torch's 30-minute default for gloo sub-groups.

Four gloo processes build the 2x2 hsdp mesh with a 3 s timeout; rank 3 stays alive but never joins
its shard group's all-reduce (a hang), and rank 2 must fail that all-reduce within seconds. Found by
the hsdp chaos soak: under restart recovery a spinning rank held the job past its 140 s bound.

The test forks :func:`_worker` as every rank from the ranks' forkserver (``fork_ranks``).
"""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta
from pathlib import Path

import pytest

from tests.support.ranks import fork_ranks

pytestmark = pytest.mark.timeout(120)

TIMEOUT_S = 3.0


def test_an_hsdp_shard_group_notices_a_hung_peer_within_the_collective_timeout(tmp_path: Path) -> None:
    fork_ranks(_worker, 4, lambda rank: (rank, tmp_path), timeout=100)
    seen = json.loads((tmp_path / "rank2.json").read_text())
    assert seen["layout"] == {"mesh": [[0, 1], [2, 3]], "shard": [2, 3], "replicate": [0, 2]}
    assert seen["outcome"] == "raised", seen
    assert seen["seconds"] < 4 * TIMEOUT_S, seen  # 30 minutes without the sub-groups' timeout


def _worker(rank: int, tmp: Path) -> None:
    import torch
    import torch.distributed as dist

    from elastictrain.train.fsdp import build_mesh

    timeout = timedelta(seconds=TIMEOUT_S)
    torch.set_num_threads(1)  # one thread a rank, as OMP_NUM_THREADS=1 gave the ranks run as scripts
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=4, timeout=timeout)
    mesh = build_mesh("hsdp", "cpu", nproc_per_node=2, timeout=timeout)
    shard, replicate = mesh.get_group("shard"), mesh.get_group("replicate")
    done = tmp / "done"
    if rank == 3:  # hung: alive, never in the collective (its exit would close the sockets)
        deadline = time.monotonic() + 60
        while not done.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
    elif rank == 2:
        layout = {"mesh": mesh.mesh.tolist(), "shard": dist.get_process_group_ranks(shard),
                  "replicate": dist.get_process_group_ranks(replicate)}
        started = time.monotonic()
        try:
            dist.all_reduce(torch.ones(1), group=shard)
            outcome = "completed"
        except Exception:  # noqa: BLE001 - a timeout of gloo's, whatever its class
            outcome = "raised"
        seconds = time.monotonic() - started
        (tmp / "rank2.json").write_text(json.dumps({"layout": layout, "outcome": outcome, "seconds": seconds}))
        done.touch()
    else:
        dist.all_reduce(torch.ones(1), group=shard)  # ranks 0 and 1: their shard group is whole
    os._exit(0)  # no teardown with a peer that never took part
