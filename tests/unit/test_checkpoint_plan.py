"""A manager's sharded saves plan their local chunks once while the DTensors stay the same
(``ChunkPlanner``): the remembered plan must always be what ``local_chunks`` makes of the leaves as
they are at that save, and bad leaves must fail every save, not only the first.

Each test runs 2 real gloo ranks (forked, tests/support/ranks.py); the checks run in the ranks.
"""

from __future__ import annotations

import gc
import re
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.ranks import fork_ranks

pytestmark = pytest.mark.timeout(60)


def _mesh(tmp: Path, rank: int) -> Any:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=2)
    return init_device_mesh("cpu", (2,))


def _leaves(state: dict[str, Any]) -> list[tuple[tuple[Any, ...], Any]]:
    from elastictrain.checkpoint import _sharded as sharded

    return sharded.split(state, ("s",))[1]


def _same_plan(got: tuple[list[Any], list[Any]], want: tuple[list[Any], list[Any]]) -> None:
    assert got[0] == want[0]
    assert [(c.key, c.offsets, c.sizes) for c in got[1]] == [(c.key, c.offsets, c.sizes) for c in want[1]]
    assert all(a.tensor is b.tensor for a, b in zip(got[1], want[1], strict=True))  # the live local tensors


def _reuses_and_replans(rank: int, tmp: Path) -> None:
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    from elastictrain.checkpoint import _sharded as sharded

    mesh = _mesh(tmp, rank)
    planned = 0
    plan = sharded._plan  # counted: how often the planner plans

    def counted(leaves: Any) -> Any:
        nonlocal planned
        planned += 1
        return plan(leaves)

    sharded._plan = counted

    def dt(rows: int, placement: Any = None) -> Any:
        return distribute_tensor(torch.arange(rows * 3.0).reshape(rows, 3), mesh, [placement or Shard(0)],
                                 src_data_rank=None)

    w, b = dt(5), dt(4, Replicate())
    state: dict[str, Any] = {"w": w, "b": b, "opt": {"w": {"exp_avg": dt(5), "step": torch.tensor(1.0)}}}
    planner = sharded.ChunkPlanner()
    for _ in range(3):  # the same DTensors: planned once, the chunks are the local tensors of now
        _same_plan(planner.local_chunks(_leaves(state)), sharded.local_chunks(_leaves(state)))
    assert planned == 3 + 1, planned  # local_chunks plans each time, the planner once

    changes = [  # (a change of the state, whether the plan changes with it)
        (lambda s: s.update(w=dt(5)), False),  # a new DTensor like the last (a state restored into new tensors)
        (lambda s: s.update(w=dt(5, Replicate())), True),  # another placement
        (lambda s: s.update(w=dt(7)), True),  # another shape
        (lambda s: s.update(w=s["w"].to(torch.float64)), True),  # another dtype
        (lambda s: s.update(tied=s["b"]), True),  # a tied weight: one DTensor under two keys
        (lambda s: s.update(tied=dt(4, Replicate())), True),  # untied: its own bytes again
        (lambda s: s.pop("tied"), True),  # a tensor fewer
        (lambda s: s.update(renamed=s.pop("b")), True),  # the same DTensor at another path
    ]
    for change, replans in changes:
        change(state)
        before = planned
        _same_plan(planner.local_chunks(_leaves(state)), sharded.local_chunks(_leaves(state)))
        assert planned == before + 1 + replans, f"planned {planned - before - 1} times, expected {int(replans)}"

    # Module._apply swaps a DTensor parameter's contents in place (torch.utils.swap_tensors, which refuses
    # a tensor anything holds a weak reference to): the same object, a new local tensor, one plan.
    w = state["w"]
    with torch.no_grad():
        torch.utils.swap_tensors(w, DTensor.from_local(w.to_local() + 1, mesh, w.placements, shape=w.shape,
                                                       stride=w.stride()))
    before = planned
    _same_plan(planner.local_chunks(_leaves(state)), sharded.local_chunks(_leaves(state)))
    assert planned == before + 1, "the planner planned again for the same DTensors"
    ref = weakref.ref(w)
    del w
    state.clear()
    gc.collect()
    assert ref() is None, "the planner keeps the DTensors of its last plan alive"
    assert planner.local_chunks([]) == ([], [])


def _refuses_every_time(rank: int, tmp: Path) -> None:
    from torch.distributed.tensor import DTensor, Partial, Shard, distribute_tensor

    from elastictrain.checkpoint import _sharded as sharded
    from elastictrain.errors import ConfigError

    mesh = _mesh(tmp, rank)
    good = distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)], src_data_rank=None)
    fp8 = distribute_tensor(torch.zeros(4, 2, dtype=torch.float8_e4m3fnuz), mesh, [Shard(0)], src_data_rank=None)
    partial = DTensor.from_local(torch.ones(2), mesh, [Partial()])
    cases = {
        "state['s']['a']['1']: two DTensors of the state have the index key 's/a/1'": {"a": {1: good, "1": good}},
        "state['s']['a'][2.5]: a DTensor's keys must be strings or integers": {"a": {2.5: good}},
        "state['s']['a']: dtype torch.float8_e4m3fnuz cannot be checkpointed in shards": {"a": fp8},
        "state['s']['a']: placement P(sum) cannot be checkpointed": {"a": partial},
    }
    planner = sharded.ChunkPlanner()
    for says, state in cases.items():
        for _ in range(2):  # a refused state is refused again, not taken for the plan of the last one
            with pytest.raises(ConfigError, match=re.escape(says)):
                planner.local_chunks(_leaves(state))
        with torch.no_grad():  # to_local() is then the local tensor itself
            assert planner.local_chunks(_leaves({"a": good}))[1][0].tensor is good.to_local()


def test_a_remembered_plan_is_the_plan_of_the_leaves_at_each_save(tmp_path: Path) -> None:
    fork_ranks(_reuses_and_replans, 2, lambda rank: (rank, tmp_path))


def test_a_state_the_format_refuses_is_refused_at_every_save(tmp_path: Path) -> None:
    fork_ranks(_refuses_every_time, 2, lambda rank: (rank, tmp_path))
