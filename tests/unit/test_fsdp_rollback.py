"""Which step a re-formed fsdp group rebuilds from (:func:`choose_rebuild`): the decision table.

The world is 3 ranks before (4 rows of ``w``, chunks of 2, 1, 1... as ``torch.chunk`` cuts) and 2
after; each case says which steps each live rank announces.
"""

from __future__ import annotations

import pytest

from elastictrain.train.fsdp.regions import Region, TensorSpec, chunk_box, needed_regions
from elastictrain.train.fsdp.rollback import choose_rebuild

pytestmark = pytest.mark.timeout(30)

SHAPE = (5, 3)
NEEDS = needed_regions([TensorSpec("model/w", SHAPE, True), TensorSpec("optimizer/w/step", (), False)], 2, 2)


def _share(holder: int, of: int, world: int = 3) -> list[Region]:
    """Rank ``of``'s shard of the old 3-rank layout (and the 0-d step count), held by ``holder``."""
    offsets, sizes = chunk_box(SHAPE, of, world)
    return [Region(holder, "model/w", offsets, sizes), Region(holder, "optimizer/w/step", (), ())]


def test_the_newest_step_held_whole_is_rebuilt_when_a_copy_of_it_survives() -> None:
    # Rank 2 lost; rank 0 holds its copy of step 9 (a refresh that completed).
    held = {9: _share(0, 0) + _share(1, 1) + _share(0, 2)}
    rebuild = choose_rebuild(held, {9: [1, 0]}, NEEDS)
    assert rebuild is not None and rebuild.step == 9 and rebuild.holders == (0, 1) and rebuild.plan.covered


def test_an_older_step_held_whole_is_rebuilt_when_the_newest_lacks_a_lost_ranks_shard() -> None:
    # Step 11 is live on ranks 0 and 1 only; step 9 (the last refresh) is every rank's snapshot
    # plus rank 0's copy of lost rank 2's shard: roll back to 9, never to the older 6.
    held = {11: _share(0, 0) + _share(1, 1),
            9: _share(0, 0) + _share(1, 1) + _share(0, 2),
            6: _share(0, 0) + _share(1, 1) + _share(1, 2)}
    rebuild = choose_rebuild(held, {11: [0, 1], 9: [0, 1], 6: [0, 1]}, NEEDS)
    assert rebuild is not None and rebuild.step == 9
    assert {(m.src, m.dst, m.key) for m in rebuild.plan.moves} >= {(0, 1, "model/w")}


def test_a_step_whose_replicated_state_no_live_rank_holds_is_skipped() -> None:
    # The regions of step 9 are all there, but no live rank kept its sampler cursor and scheduler.
    held = {11: _share(0, 0) + _share(1, 1), 9: _share(0, 0) + _share(1, 1) + _share(0, 2),
            6: _share(0, 0) + _share(1, 1) + _share(0, 2)}
    rebuild = choose_rebuild(held, {11: [0, 1], 6: [1]}, NEEDS)
    assert rebuild is not None and rebuild.step == 6 and rebuild.holders == (1,)


def test_no_step_is_rebuilt_when_a_lost_rank_and_its_holder_are_both_gone() -> None:
    held = {11: _share(0, 0) + _share(1, 1), 9: _share(0, 0) + _share(1, 1)}
    assert choose_rebuild(held, {11: [0, 1], 9: [0, 1]}, NEEDS) is None
    assert choose_rebuild({}, {}, NEEDS) is None


def test_a_newcomer_that_holds_nothing_is_given_its_share_and_the_replicated_state_from_the_holders() -> None:
    # Rank 1 is a fresh worker replacing the lost one (world 2 -> 2): it announces nothing.
    needs = needed_regions([TensorSpec("model/w", SHAPE, True)], 2, 2)
    old = [Region(0, "model/w", *chunk_box(SHAPE, 0, 2)), Region(0, "model/w", *chunk_box(SHAPE, 1, 2))]
    rebuild = choose_rebuild({4: old}, {4: [0], 5: [0]}, needs)
    assert rebuild is not None and rebuild.step == 4 and rebuild.holders == (0,)
    assert [(m.src, m.dst, m.rows) for m in rebuild.plan.moves] == [(0, 0, (0, 3)), (0, 1, (3, 5))]
