"""The region exchange's planner (:mod:`elastictrain.train.fsdp.regions`): pure, one test per path."""

from __future__ import annotations

import pytest
import torch

from elastictrain.train.fsdp.regions import Move, Region, TensorSpec, chunk_box, needed_regions, plan_exchange

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize(("rows", "count"), [(7, 2), (7, 3), (3, 4), (0, 2), (8, 4)])
def test_chunk_box_cuts_as_torch_chunk_cuts(rows: int, count: int) -> None:
    full = torch.arange(rows * 2).reshape(rows, 2)
    chunks = list(torch.chunk(full, count)) if rows else []
    for index in range(count):
        offsets, sizes = chunk_box((rows, 2), index, count)
        expected = chunks[index] if index < len(chunks) else full[:0]
        assert sizes == tuple(expected.shape)
        assert torch.equal(full[offsets[0]:offsets[0] + sizes[0]], expected)


def test_chunk_box_of_a_0d_tensor_is_its_whole_and_a_bad_index_is_refused() -> None:
    assert chunk_box((), 0, 3) == ((), ())
    with pytest.raises(ValueError, match="chunk index 3"):
        chunk_box((4,), 3, 3)


def _held(world: int, key: str = "w", rows: int = 8) -> list[Region]:
    return [Region(r, key, *chunk_box((rows, 2), r, world)) for r in range(world)]


def test_a_rank_that_holds_its_box_copies_it_itself() -> None:
    needs = needed_regions([TensorSpec("w", (8, 2), True)], 2, 2)
    plan = plan_exchange(_held(2), needs)
    assert plan.covered and plan.moves == (Move(0, 0, "w", (0, 4)), Move(1, 1, "w", (4, 8)))


def test_a_joining_rank_receives_from_the_holders_and_the_survivors_reshape_among_themselves() -> None:
    # fsdp 2 -> 3: rank 2 held nothing; each row comes from the rank that held it.
    plan = plan_exchange(_held(2), needed_regions([TensorSpec("w", (8, 2), True)], 3, 3))
    assert plan.covered
    assert plan.moves == (Move(0, 0, "w", (0, 3)), Move(0, 1, "w", (3, 4)), Move(1, 1, "w", (4, 6)),
                          Move(1, 2, "w", (6, 8)))


def test_an_hsdp_replica_lost_is_covered_by_the_other_replica() -> None:
    # 2 nodes of 2 (ranks 0-1 and 2-3 hold the same chunks); node 1 lost: ranks 0-1 hold everything.
    held = [Region(r, "w", *chunk_box((8, 2), r % 2, 2)) for r in (0, 1)]
    plan = plan_exchange(held, needed_regions([TensorSpec("w", (8, 2), True)], 2, 2))
    assert plan.covered and all(m.src == m.dst for m in plan.moves)


def test_a_region_held_twice_is_sent_by_the_holder_that_sent_less() -> None:
    # Ranks 1 and 2 both hold all of "a" and "b": rank 0 receives "a" from 1, then "b" from 2.
    held = [Region(r, k, (0,), (4,)) for r in (1, 2) for k in ("a", "b")]
    needs = [Region(0, "a", (0,), (4,)), Region(0, "b", (0,), (4,))]
    plan = plan_exchange(held, needs)
    assert plan.moves == (Move(1, 0, "a", (0, 4)), Move(2, 0, "b", (0, 4)))


def test_a_region_no_rank_holds_is_reported_uncovered() -> None:
    # fsdp 4 -> 3 with rank 3 lost and no copy: rows 6-8 of rank 2's new box are nowhere.
    held = _held(4)[:3]
    plan = plan_exchange(held, needed_regions([TensorSpec("w", (8, 2), True)], 3, 3))
    assert not plan.covered and plan.uncovered == (Region(2, "w", (6, 0), (2, 2)),)


def test_a_copy_of_the_lost_ranks_shard_covers_it() -> None:
    held = [*_held(4)[:3], Region(0, "w", *chunk_box((8, 2), 3, 4))]  # rank 0 keeps rank 3's shard
    plan = plan_exchange(held, needed_regions([TensorSpec("w", (8, 2), True)], 3, 3))
    assert plan.covered and Move(0, 2, "w", (6, 8)) in plan.moves


def test_replicated_and_0d_tensors_are_needed_whole_by_every_rank() -> None:
    specs = [TensorSpec("buf", (3,), False), TensorSpec("step", (), False)]
    held = [Region(0, "buf", (0,), (3,)), Region(0, "step", (), ())]
    plan = plan_exchange(held, needed_regions(specs, 2, 2))
    assert plan.covered and plan.moves == (Move(0, 0, "buf", (0, 3)), Move(0, 0, "step", (0, 1)),
                                           Move(0, 1, "buf", (0, 3)), Move(0, 1, "step", (0, 1)))


def test_a_holding_that_cuts_another_dimension_does_not_cover_the_whole_rows() -> None:
    held = [Region(0, "w", (0, 0), (8, 1))]  # only column 0
    plan = plan_exchange(held, [Region(1, "w", (0, 0), (8, 2))])
    assert plan.uncovered == (Region(1, "w", (0, 0), (8, 2)),)


def test_more_ranks_than_rows_leave_empty_boxes_that_need_nothing() -> None:
    plan = plan_exchange(_held(2, rows=2), needed_regions([TensorSpec("w", (2, 2), True)], 4, 4))
    assert plan.covered and [m.dst for m in plan.moves] == [0, 1]


def test_needed_regions_refuses_a_shard_width_that_does_not_divide_the_world() -> None:
    with pytest.raises(ValueError, match="shard width 2 does not divide the world size 3"):
        needed_regions([TensorSpec("w", (8,), True)], 3, 2)
