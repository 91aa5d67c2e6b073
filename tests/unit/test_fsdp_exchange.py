"""The region exchange on real gloo processes: shards held in memory reshape to a new layout.

One spawn of 3 processes: (a) a tensor and a 0-d value held as a 4-rank layout (rank 0 also
keeps lost rank 3's shard, as a redundancy copy would) reshape to 3 ranks' boxes; without that
copy every rank learns the state is not covered; with that copy of an older step only (and
every rank's snapshot of it), every rank rebuilds that older step. (b) The fsdp strategy grows 2 -> 3 ranks in
place: ranks 0-1 shard a model (Adam, 2 steps), then all 3 re-form; the full model and optimizer
state after equal those before, and a step after equals the same step of an unsharded copy. (c)
It shrinks 3 -> 2: rank 2 leaves, its shards copied to rank 0 beforehand and offered through the
holdings-source hook (what in-memory redundancy does); the state rebuilt from memory is equal.

The test forks :func:`_worker` as every rank from the ranks' forkserver (``fork_ranks``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.ranks import fork_ranks

WORLD = 3
pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("keys, flat", [
    (["w"], [7, 1, 1, 0, 4]),            # key 1 of 1
    (["w"], [7, 0, 2, 0, 0, 4]),         # cut short: 2 dimensions need 4 integers
    (["w"], [7, 0]),                     # cut short before its rank
    (["w"], [7, 0, 1, 0, "4"]),          # not an integer
    ([3], [7, 0, 1, 0, 4]),              # a key that is not a string
])
def test_an_announced_region_list_that_does_not_spell_regions_is_refused(keys: list[Any], flat: list[Any]) -> None:
    from elastictrain.train.fsdp.exchange import _regions
    from elastictrain.train.fsdp.regions import Region

    assert _regions(2, ["v", "w"], [7, 1, 2, 0, 0, 4, 3, 5, 0, 0]) == [
        (7, Region(2, "w", (0, 0), (4, 3))), (5, Region(2, "v", (), ()))]
    with pytest.raises(ValueError):
        _regions(2, keys, flat)


def test_shards_held_in_memory_reshape_to_a_new_layout_and_a_strategy_grows_in_place(tmp_path: Path) -> None:
    fork_ranks(_worker, WORLD, lambda rank: (rank, tmp_path), timeout=100)
    checks = json.loads((tmp_path / "rank0.json").read_text())
    assert checks == {"reshaped_4_to_3": True, "uncovered_without_copy": [True, True, True],
                      "rolled_back_to_older_step": [True, True, True],
                      "grown_state_error": 0.0, "grown_step_error": 0.0, "shrunk_from_copies_error": 0.0,
                      "rank2_received": True}, checks


def test_a_move_the_plan_merged_over_two_adjacent_holdings_is_sent_joined() -> None:
    # Three ranks of one worker, rank 2 lost: rank 1 holds its own rows 4-8 and the copy of rank
    # 0's rows 0-4 (its source), adjacent. The new rank 0 needs rows 0-6 and may take them all
    # from rank 1, which the plan says as one move (0, 6) over both holdings.
    from elastictrain.errors import SessionError
    from elastictrain.train.fsdp.exchange import Exchange
    from elastictrain.train.fsdp.holdings import Holding
    from elastictrain.train.fsdp.regions import Region, TensorSpec, plan_exchange

    full = torch.arange(12 * 2, dtype=torch.float32).reshape(12, 2)
    held = [Holding("model/w", (4, 0), (4, 2), 3, full[4:8].clone()),
            Holding("model/w", (0, 0), (4, 2), 3, full[0:4].clone())]
    plan = plan_exchange([Region(1, "model/w", (4, 0), (4, 2)), Region(1, "model/w", (0, 0), (4, 2))],
                         [Region(0, "model/w", (0, 0), (6, 2))])
    assert [(m.src, m.dst, m.rows) for m in plan.moves] == [(1, 0, (0, 6))]
    specs = {"model/w": (TensorSpec("model/w", (12, 2), True), torch.float32)}
    exchange = Exchange(1, 3, plan, (1,), (), specs, tuple(held))
    assert torch.equal(exchange._source(plan.moves[0]), full[0:6])
    # Rows no holding has are still refused in one line.
    gap = Exchange(1, 3, plan, (1,), (), specs, (held[0],))
    with pytest.raises(SessionError, match=r"send rows \(0, 6\) of model/w, which it does not hold"):
        gap._source(plan.moves[0])


def _reshape(rank: int) -> tuple[bool, list[bool]]:
    import torch.distributed as dist

    from elastictrain.train.fsdp.exchange import announce
    from elastictrain.train.fsdp.holdings import Holding
    from elastictrain.train.fsdp.regions import TensorSpec, chunk_box

    full = torch.arange(11 * 3, dtype=torch.float32).reshape(11, 3)
    step = torch.tensor(5.0)

    def held(index: int) -> Holding:
        offsets, sizes = chunk_box((11, 3), index, 4)
        return Holding("model/w", offsets, sizes, 7, full[offsets[0]:offsets[0] + sizes[0]].clone())

    mine = [held(rank), Holding("optimizer/w/step", (), (), 7, step.clone())]
    copy = [held(3)] if rank == 0 else []
    specs = {"model/w": (TensorSpec("model/w", (11, 3), True), torch.float32),
             "optimizer/w/step": (TensorSpec("optimizer/w/step", (), False), torch.float32)}
    exchange = announce(dist.group.WORLD, held=mine + copy, specs=specs, replicated=(7,), newest=7, shard_width=3)
    boxes = exchange.run(dist.group.WORLD)
    reshaped = (torch.equal(boxes["model/w"][1], torch.chunk(full, 3)[rank])
                and torch.equal(boxes["optimizer/w/step"][1], step))
    lacking = announce(dist.group.WORLD, held=mine, specs=specs, replicated=(7,), newest=7, shard_width=3)
    # Step 7 lacks rank 3's shard; step 5 (an older refresh: every rank's snapshot, and rank 0's copy
    # of rank 3's) is held whole, and its replicated state by ranks 1 and 2: the rebuild rolls back to it.
    older = full + 100
    snapshot = [Holding(h.key, h.offsets, h.sizes, 5, older[h.offsets[0]:h.offsets[0] + h.sizes[0]].clone()
                        if h.sizes else step.clone()) for h in mine + copy]
    rolled = announce(dist.group.WORLD, held=mine + snapshot, specs=specs, replicated=(7, 5) if rank else (7,),
                      newest=7, shard_width=3)
    boxes = rolled.run(dist.group.WORLD)
    rolled_back = (rolled.step == 5 and rolled.holders == (1, 2)
                   and torch.equal(boxes["model/w"][1], torch.chunk(older, 3)[rank]))
    flags = [None] * WORLD
    dist.all_gather_object(flags, (not lacking.covered and lacking.step is None, rolled_back))  # the test's own
    return reshaped, [bool(f[0]) for f in flags] + [bool(f[1]) for f in flags]


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(4, 7)
        self.b = torch.nn.Linear(7, 2)
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


def _max_error(a: dict[str, Any], b: dict[str, Any]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) if a[k].numel() else 0.0 for k in a)


def _flat(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {f"{i}/{k}": v for i, s in state.get("state", {}).items() for k, v in s.items()}


def _grow(rank: int) -> tuple[float, float, float, bool]:
    import torch.distributed as dist

    from elastictrain.train import process_group as pg
    from elastictrain.train.fsdp.state import full_optimizer_state_dict, full_state_dict
    from elastictrain.train.fsdp.strategy import FsdpStrategy
    from elastictrain.train.state_transfer import agree
    from elastictrain.train.strategy import GroupView

    def view(world: int, group: Any) -> GroupView:
        placement = pg.Placement(torch.device("cpu"), "gloo", pg.resolve_timeout(30), rank, world, owned=False)
        return GroupView(placement=placement, group=group, in_process=True, local_world_size=1)

    data = torch.Generator().manual_seed(1)
    batches = [(torch.randn(6, 4, generator=data), torch.randn(6, 2, generator=data)) for _ in range(3)]
    torch.manual_seed(0)
    model = Net()
    reference = Net()
    reference.load_state_dict(model.state_dict())
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    ref_optimizer = torch.optim.Adam(reference.parameters(), lr=0.01)
    strategy = FsdpStrategy()
    pair = dist.new_group([0, 1])
    step = 0
    if rank < 2:
        module = strategy.wrap(model, optimizer, view(2, pair), identical=False)
        for x, y in batches[:2]:
            for half in (slice(rank * 3, rank * 3 + 3),):
                torch.nn.functional.mse_loss(module(x[half]), y[half]).backward()
            optimizer.step()
            optimizer.zero_grad()
            step += 1
        before = (full_state_dict(module), full_optimizer_state_dict(module, optimizer))
        strategy.leave()
    for x, y in batches[:2]:  # the unsharded reference: the mean over both halves is the whole batch's
        torch.nn.functional.mse_loss(reference(x), y).backward()
        ref_optimizer.step()
        ref_optimizer.zero_grad()
    # Re-form over all 3 ranks: rank 2 is a newcomer with a fresh model and no state.
    group = dist.group.WORLD
    agreement = agree(group, holds=rank < 2, step=step)
    assert strategy.covers(group, agreement, model, optimizer, step=step, local_world_size=1)
    fresh = strategy.unwrapped(model, optimizer)
    assert (fresh is not model) == (rank < 2)
    progress = {"step": step}
    received = strategy.transfer_state(group, agreement, {"model": fresh, "optimizer": optimizer,
                                                          "session": progress}, step=step)
    module = strategy.wrap(fresh, optimizer, view(3, None), identical=True)
    # Cloned: the optimizer's step below updates its tensors (Adam's step count) in place.
    gathered = full_optimizer_state_dict(module, optimizer).get("state", {})
    after = (full_state_dict(module), {"state": {i: {k: v.clone() for k, v in s.items()} for i, s in gathered.items()}})
    x, y = batches[2]
    rows = torch.chunk(torch.arange(6), 3)[rank]
    torch.nn.functional.mse_loss(module(x[rows]), y[rows], reduction="sum").div(6 * 2).mul(3).backward()
    optimizer.step()
    stepped = full_state_dict(module)
    torch.nn.functional.mse_loss(reference(x), y).backward()
    ref_optimizer.step()
    shrunk_error = _shrink(rank, strategy, module, optimizer, (agreement.step or 0) + 1, pair, view)
    if rank != 0:
        return 0.0, 0.0, 0.0, received
    state_error = max(_max_error(before[0], after[0]), _max_error(_flat(before[1]), _flat(after[1])))
    step_error = _max_error({k: v for k, v in stepped.items() if k != "seen"},
                            {k: v for k, v in reference.state_dict().items() if k != "seen"})
    return state_error, step_error, shrunk_error, received


class Copies:
    """A holdings source: the regions another rank sent this one (what a redundancy buddy keeps)."""

    def __init__(self) -> None:
        self.held: list[Any] = []

    def holdings(self) -> list[Any]:
        return self.held


def _shrink(rank: int, strategy: Any, module: Any, optimizer: Any, step: int, pair: Any, view: Any) -> float:
    """fsdp 3 -> 2: rank 2 leaves, having sent its shards to rank 0 (a redundancy copy); ranks 0-1
    rebuild from memory through the holdings-source hook. Returns rank 0's max error against the
    full state before."""
    import torch.distributed as dist

    from elastictrain.train.fsdp.holdings import Holding, own_holdings
    from elastictrain.train.fsdp.state import full_optimizer_state_dict, full_state_dict
    from elastictrain.train.state_transfer import agree

    full = (full_state_dict(module), _flat(full_optimizer_state_dict(module, optimizer)))
    mine = own_holdings(module, optimizer, step)
    shapes = [None] * WORLD
    dist.all_gather_object(shapes, [(h.key, h.offsets, h.sizes, h.tensor.dtype) for h in mine])  # the test's own
    copies = Copies()
    if rank == 2:
        for held in mine:
            dist.send(held.tensor, 0)
    elif rank == 0:
        for (key, offsets, sizes, dtype) in shapes[2]:
            tensor = torch.empty(sizes, dtype=dtype)
            dist.recv(tensor, 2)
            copies.held.append(Holding(key, offsets, sizes, step, tensor))
    strategy.leave()
    if rank == 2:
        return 0.0
    strategy.add_holdings_source(copies)
    agreement = agree(pair, holds=True, step=step)
    assert strategy.covers(pair, agreement, module, optimizer, step=step, local_world_size=1)
    fresh = strategy.unwrapped(module, optimizer)
    strategy.transfer_state(pair, agreement, {"model": fresh, "optimizer": optimizer}, step=step)
    module = strategy.wrap(fresh, optimizer, view(2, pair), identical=True)
    after = (full_state_dict(module), _flat(full_optimizer_state_dict(module, optimizer)))
    if rank != 0:
        return 0.0
    return max(_max_error(full[0], after[0]), _max_error(full[1], after[1]))


def _worker(rank: int, out: Path) -> None:
    import torch.distributed as dist

    from tests.support.leave import leave_together

    torch.set_num_threads(1)  # one thread a rank, as OMP_NUM_THREADS=1 gave the ranks run as scripts
    dist.init_process_group("gloo", init_method=f"file://{out / 'store'}", rank=rank, world_size=WORLD)
    reshaped, uncovered = _reshape(rank)
    state_error, step_error, shrunk_error, received = _grow(rank)
    flags = [None] * WORLD
    dist.all_gather_object(flags, received)
    if rank == 0:
        (out / "rank0.json").write_text(json.dumps({
            "reshaped_4_to_3": reshaped, "uncovered_without_copy": uncovered[:WORLD],
            "rolled_back_to_older_step": uncovered[WORLD:],
            "grown_state_error": round(state_error, 5), "grown_step_error": round(step_error, 5),
            "shrunk_from_copies_error": shrunk_error,
            "rank2_received": flags == [False, False, True]}))
    leave_together()
