"""Tests for ``elastictrain.train.sampler``: exactly-once data order across resizes and restarts."""

from __future__ import annotations

import io
import math

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, Dataset

from elastictrain.errors import CheckpointMismatchError, ConfigError
from elastictrain.train.sampler import (
    ElasticBatchSampler,
    ElasticSampler,
    StepPlan,
    WorkerInitFn,
    epoch_permutation,
    seed_for,
    share_bounds,
)

pytestmark = pytest.mark.timeout(60)

FAST = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])


def make(n: int, g: int, mbs: int | None = None, *, world: int = 1, rank: int = 0, **kwargs) -> ElasticSampler:
    return ElasticSampler(n, global_batch_size=g, micro_batch_size=mbs, world_size=world, rank=rank, **kwargs)


def checkpoint_roundtrip(state: dict) -> dict:
    """What a restarted process gets back from ``torch.load(weights_only=True)``."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def check_step(plans: list[StepPlan], perm: list[int], mbs: int | None) -> None:
    """Asserts the invariants every step must satisfy over all ranks."""
    world = len(plans)
    first = plans[0]
    assert all((p.cursor, p.step_size, p.world_size) == (first.cursor, first.step_size, world) for p in plans)
    # DDP runs one backward per micro-batch: every rank must run the same number.
    assert len({len(p.micro_batches) for p in plans}) == 1
    shares = [len(p.indices) for p in plans]
    assert max(shares) - min(shares) <= 1
    assert shares == [first.step_size // world + (1 if r < first.step_size % world else 0) for r in range(world)]
    # Rank shares are contiguous slices of the permutation, in rank order.
    assert [i for p in plans for i in p.indices] == perm[first.cursor:first.cursor + first.step_size]
    for p in plans:
        for micro in p.micro_batches:
            assert mbs is None or len(micro.indices) <= mbs
            assert micro.loss_scale == pytest.approx(world * len(micro.indices) / p.step_size)
    assert sum(m.weight for p in plans for m in p.micro_batches) == pytest.approx(1.0)


segments = st.lists(
    st.tuples(
        st.integers(1, 8),  # world size after this resize
        st.integers(0, 5),  # committed steps before the next crash/resize
        st.booleans(),  # full restart (fresh samplers from a checkpoint) or live resize
        st.booleans(),  # a step was planned and read but crashed before it committed
    ),
    min_size=1,
    max_size=5,
)


@settings(FAST, max_examples=500)
@given(
    n=st.integers(1, 120),
    g=st.integers(1, 24),
    mbs=st.one_of(st.none(), st.integers(1, 6)),
    drop_last=st.booleans(),
    shuffle=st.booleans(),
    seed=st.integers(0, 2**64 - 1),
    epoch=st.integers(0, 50),
    plan=segments,
)
def test_every_sample_is_read_exactly_once_across_resizes_and_restarts(
    n: int, g: int, mbs: int | None, drop_last: bool, shuffle: bool, seed: int, epoch: int,
    plan: list[tuple[int, int, bool, bool]],
) -> None:
    assume(not (drop_last and g > n))  # refused: no step would run
    perm = epoch_permutation(n, seed, epoch, shuffle).tolist()
    kwargs = dict(seed=seed, drop_last=drop_last, shuffle=shuffle)
    samplers = [make(n, g, mbs, **kwargs)]
    samplers[0].set_epoch(epoch)
    trained: list[int] = []
    for world, steps, restart, crashed_step in plan + [(plan[-1][0], 10**9, False, False)]:
        state = checkpoint_roundtrip(samplers[0].state_dict())
        survivors = [] if restart else samplers[:world]
        for rank, sampler in enumerate(survivors):
            sampler.set_world(rank, world)
        for rank in range(len(survivors), world):
            joined = make(n, g, mbs, world=world, rank=rank, **kwargs)
            joined.load_state_dict(state)
            joined.set_epoch(epoch)  # the usual loop calls this on resume; it must keep the cursor
            survivors.append(joined)
        samplers = survivors
        for _ in range(min(steps, samplers[0].remaining_steps)):
            plans = [s.plan_step() for s in samplers]
            check_step(plans, perm, mbs)
            trained += [i for p in plans for i in p.indices]
            for s, p in zip(samplers, plans):
                s.commit_step(p)
        assert len({(s.epoch, s.cursor) for s in samplers}) == 1
        if crashed_step and not samplers[0].epoch_done:
            # Read (e.g. prefetched) but never committed: it must be read again later.
            [list(s) for s in samplers]
            [s.plan_step() for s in samplers]
    assert all(s.epoch_done for s in samplers)
    end = n - n % g if drop_last else n
    assert sorted(trained) == sorted(perm[:end])
    assert len(trained) == len(set(trained)) == end
    assert trained == perm[:end]  # and in permutation order
    assert set(range(n)) - set(trained) == set(perm[end:])


@settings(FAST, max_examples=100)
@given(
    n=st.integers(1, 60),
    g=st.integers(1, 16),
    mbs=st.one_of(st.none(), st.integers(1, 5)),
    world=st.integers(1, 9),
    drop_last=st.booleans(),
)
def test_iterators_and_lengths_match_the_step_plans(
    n: int, g: int, mbs: int | None, world: int, drop_last: bool
) -> None:
    assume(not (drop_last and g > n))  # refused: no step would run
    for rank in range(world):
        sampler = make(n, g, mbs, world=world, rank=rank, drop_last=drop_last, seed=7)
        plans = list(sampler.iter_steps())
        assert len(plans) == sampler.remaining_steps == sampler.steps_per_epoch
        assert list(sampler) == [i for p in plans for i in p.indices]
        assert len(sampler) == len(list(sampler))
        batches = ElasticBatchSampler(sampler, pad_empty=False)
        assert list(batches) == [list(m.indices) for p in plans for m in p.micro_batches]
        assert len(batches) == len(list(batches))
        padded = list(ElasticBatchSampler(sampler))
        assert len(padded) == len(batches)
        assert all(b == list(m.indices) or (not m.indices and b == [p.pad_index])
                   for b, (p, m) in zip(padded, [(p, m) for p in plans for m in p.micro_batches]))


@settings(FAST, max_examples=250)
@given(
    n=st.integers(1, 50),
    g=st.integers(1, 16),
    mbs=st.one_of(st.none(), st.integers(1, 5)),
    world=st.integers(1, 7),
    step=st.integers(0, 10),
    data_seed=st.integers(0, 2**31),
)
def test_loss_scaled_micro_batch_gradients_averaged_over_ranks_equal_the_global_batch_gradient(
    n: int, g: int, mbs: int | None, world: int, step: int, data_seed: int
) -> None:
    gen = torch.Generator().manual_seed(data_seed)
    x = torch.randn(n, 3, generator=gen, dtype=torch.float64)
    y = torch.randn(n, generator=gen, dtype=torch.float64)
    weight = torch.randn(3, generator=gen, dtype=torch.float64, requires_grad=True)

    def mean_loss(indices: list[int]) -> torch.Tensor:
        return ((x[indices] @ weight - y[indices]) ** 2).mean()

    cursor = min(step, math.ceil(n / g) - 1) * g
    plans = [make(n, g, mbs, world=world, rank=r).plan_step(cursor) for r in range(world)]
    (full,) = torch.autograd.grad(mean_loss([i for p in plans for i in p.indices]), weight)
    rank_grads = []
    for p in plans:
        grad = torch.zeros(3, dtype=torch.float64)
        for micro in p.micro_batches:
            # An empty micro-batch trains on the pad index with scale 0, as a DDP rank must.
            indices = list(micro.indices) or [p.pad_index]
            grad += torch.autograd.grad(mean_loss(indices) * micro.loss_scale, weight)[0]
        rank_grads.append(grad)
    ddp_grad = torch.stack(rank_grads).sum(0) / world  # DDP averages over ranks
    torch.testing.assert_close(ddp_grad, full, rtol=1e-12, atol=1e-12)
    weighted = sum(m.weight * mean_loss(list(m.indices)) for p in plans for m in p.micro_batches if m.indices)
    torch.testing.assert_close(weighted, mean_loss([i for p in plans for i in p.indices]), rtol=1e-12, atol=0)


def test_same_inputs_give_the_same_plans_and_epochs_give_different_orders() -> None:
    a, b = make(1000, 64, 8, world=3, rank=1, seed=5), make(1000, 64, 8, world=3, rank=1, seed=5)
    for epoch in (0, 3):
        a.set_epoch(epoch)
        b.set_epoch(epoch)
        assert list(a.iter_steps()) == list(b.iter_steps())
    orders = {tuple(epoch_permutation(1000, 5, epoch).tolist()) for epoch in range(10)}
    assert len(orders) == 10
    # A plain seed + epoch would make these two equal.
    assert not torch.equal(epoch_permutation(1000, 1, 0), epoch_permutation(1000, 0, 1))


def test_permutation_is_pinned_so_checkpoints_resume_across_processes() -> None:
    assert epoch_permutation(10, 0, 0).tolist() == [1, 5, 0, 4, 9, 7, 8, 3, 6, 2]
    assert epoch_permutation(10, 1234, 7).tolist() == [0, 4, 5, 6, 2, 1, 3, 8, 7, 9]


def test_shuffle_false_reads_in_index_order() -> None:
    sampler = make(10, 4, shuffle=False, seed=99)
    sampler.set_epoch(3)
    assert list(sampler) == list(range(10))


def test_drop_last_skips_the_tail_and_keep_last_gives_a_smaller_final_step() -> None:
    keep, drop = make(10, 4, seed=1), make(10, 4, seed=1, drop_last=True)
    assert [p.step_size for p in keep.iter_steps()] == [4, 4, 2]
    assert [p.step_size for p in drop.iter_steps()] == [4, 4]
    last = list(keep.iter_steps())[-1]
    assert [m.weight for m in last.micro_batches] == [1.0]


def test_dataset_smaller_than_the_world_gives_empty_micro_batches_on_idle_ranks() -> None:
    plans = [make(3, 8, 2, world=5, rank=r).plan_step() for r in range(5)]
    assert [len(p.indices) for p in plans] == [1, 1, 1, 0, 0]
    assert [len(p.micro_batches) for p in plans] == [1] * 5
    assert plans[4].micro_batches[0].loss_scale == 0.0
    assert list(ElasticBatchSampler(make(3, 8, 2, world=5, rank=4))) == [[plans[4].pad_index]]


def test_iteration_never_advances_the_cursor_and_snapshots_it() -> None:
    sampler = make(20, 4, seed=3)
    steps = sampler.iter_steps()
    indices = iter(sampler)
    list(ElasticBatchSampler(sampler))
    assert sampler.cursor == 0
    first = next(steps)
    sampler.commit_step(first)
    # Iterators made before the commit keep reading from where they started.
    assert [next(indices) for _ in range(4)] == first.indices
    assert next(iter(sampler)) == sampler.plan_step().indices[0] == epoch_permutation(20, 3, 0)[4]


class IndexDataset(Dataset[int]):
    def __len__(self) -> int:
        return 37

    def __getitem__(self, index: int) -> int:
        return index


class NoisyDataset(IndexDataset):
    def __getitem__(self, index: int) -> int:  # type: ignore[override]
        return int(torch.randint(0, 2**62, ()).item())


def collate_list(batch: list[int]) -> list[int]:
    return batch


def test_dataloader_with_workers_yields_the_planned_micro_batches_from_the_committed_cursor() -> None:
    sampler = make(37, 9, 2, world=4, rank=3, seed=11)
    sampler.commit_step()
    batches = ElasticBatchSampler(sampler, pad_empty=False)
    loader = DataLoader(IndexDataset(), batch_sampler=batches, num_workers=2, prefetch_factor=2,
                        collate_fn=collate_list)
    expected = [list(m.indices) for p in sampler.iter_steps() for m in p.micro_batches]
    assert [] in expected  # the last step of 1 sample leaves rank 3 empty
    it = iter(loader)
    assert next(it) == expected[0]
    assert sampler.cursor == 9  # workers prefetched ahead; nothing committed
    assert [next(it)] + list(it) == expected[1:]
    flat = DataLoader(IndexDataset(), sampler=sampler, batch_size=None, num_workers=2)
    assert list(flat) == [i for p in sampler.iter_steps() for i in p.indices]
    padded = DataLoader(IndexDataset(), batch_sampler=ElasticBatchSampler(sampler), num_workers=2)
    assert all(isinstance(b, torch.Tensor) and b.numel() >= 1 for b in padded)  # default_collate copes


def test_worker_seeds_are_reproducible_and_differ_per_rank_epoch_and_worker() -> None:
    seeds = {seed_for(0, e, r, w) for e in range(4) for r in range(8) for w in range(8)}
    assert len(seeds) == 4 * 8 * 8
    assert seed_for(5, 1, 2, 3) == seed_for(5, 1, 2, 3)

    def draws(rank: int) -> list[int]:
        sampler = make(37, 8, world=2, rank=rank)
        return list(DataLoader(NoisyDataset(), sampler=sampler, batch_size=None, num_workers=2,
                               worker_init_fn=sampler.worker_init_fn()))

    assert draws(0) == draws(0)
    assert draws(0) != draws(1)
    assert make(5, 1, world=3, rank=2, seed=4).worker_init_fn() == WorkerInitFn(seed=4, epoch=0, rank=2)


def test_state_dict_round_trips_through_a_weights_only_checkpoint() -> None:
    sampler = make(50, 8, seed=2**64 - 1)
    sampler.set_epoch(4)
    sampler.commit_step()
    state = sampler.state_dict()
    assert all(type(v) is int for v in state.values())
    fresh = make(50, 8, seed=0, world=3, rank=2)
    fresh.load_state_dict(checkpoint_roundtrip(state))
    assert (fresh.seed, fresh.epoch, fresh.cursor, fresh.rank, fresh.world_size) == (2**64 - 1, 4, 8, 2, 3)
    assert fresh.state_dict() == state


def test_set_epoch_resets_the_cursor_only_for_a_different_epoch() -> None:
    sampler = make(50, 8)
    sampler.commit_step()
    sampler.set_epoch(0)
    assert sampler.cursor == 8
    sampler.set_epoch(1)
    assert (sampler.epoch, sampler.cursor) == (1, 0)


def test_commit_step_refuses_a_finished_epoch_and_a_stale_plan() -> None:
    sampler = make(10, 4)
    plan = sampler.plan_step()
    assert sampler.commit_step(plan) == 4
    with pytest.raises(ConfigError, match="cursor 0"):
        sampler.commit_step(plan)
    sampler.commit_step()
    assert sampler.commit_step() == 10 and sampler.epoch_done
    with pytest.raises(ConfigError, match="cursor=10"):
        sampler.commit_step()
    with pytest.raises(ConfigError, match="cursor=10"):
        sampler.plan_step()


@pytest.mark.parametrize(
    ("state", "error", "match"),
    [
        ({"cursor": 0}, ConfigError, "missing"),
        ({"version": 2}, ConfigError, "version"),
        ({"cursor": 51}, ConfigError, "cursor"),
        ({"epoch": -1}, ConfigError, "epoch"),
        ({"seed": "7"}, ConfigError, "'7'"),
        ({"num_samples": 49}, CheckpointMismatchError, "49"),
        ({"shuffle": 0}, CheckpointMismatchError, "shuffle"),
    ],
)
def test_load_state_dict_rejects_bad_or_mismatched_state(state: dict, error: type, match: str) -> None:
    sampler = make(50, 8)
    full = sampler.state_dict() | state
    if match == "missing":
        del full["epoch"]
    with pytest.raises(error, match=match):
        sampler.load_state_dict(full)
    assert sampler.state_dict() == make(50, 8).state_dict()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"dataset": 0}, "dataset length.*0"),
        ({"dataset": object()}, "object"),
        ({"global_batch_size": 0}, "global_batch_size.*0"),
        ({"global_batch_size": 2.0}, "global_batch_size.*2.0"),
        ({"global_batch_size": True}, "global_batch_size.*True"),
        ({"micro_batch_size": 0}, "micro_batch_size.*0"),
        ({"seed": -1}, "seed.*-1"),
        ({"seed": 2**64}, "seed"),
        ({"world_size": 0, "rank": 0}, "world_size.*0"),
        ({"world_size": 3, "rank": 3}, "rank.*3"),
        ({"world_size": 3, "rank": -1}, "rank.*-1"),
        # no step would run (before: 0 steps, and the job ended "finished")
        ({"global_batch_size": 11, "drop_last": True}, "global batch of 11 is more than the dataset's 10 samples"),
    ],
)
def test_bad_arguments_raise_config_error_naming_the_value(kwargs: dict, match: str) -> None:
    args = {"dataset": 10, "global_batch_size": 4, "rank": 0, "world_size": 1} | kwargs
    with pytest.raises(ConfigError, match=match):
        ElasticSampler(args.pop("dataset"), **args)
    assert issubclass(ConfigError, ValueError)


def test_bad_method_arguments_raise_config_error() -> None:
    sampler = make(10, 4)
    for call, match in [
        (lambda: sampler.set_epoch(-1), "epoch.*-1"),
        (lambda: sampler.plan_step(11), "cursor.*11"),
        (lambda: sampler.set_world(2, 2), "rank.*2"),
        (lambda: ElasticBatchSampler([1, 2]), "list"),  # type: ignore[arg-type]
    ]:
        with pytest.raises(ConfigError, match=match):
            call()


def test_world_defaults_come_from_env_then_fall_back_to_a_single_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "5")
    sampler = ElasticSampler(10, global_batch_size=4)
    assert (sampler.rank, sampler.world_size) == (2, 5)
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    sampler.set_world()
    assert (sampler.rank, sampler.world_size) == (0, 1)
    monkeypatch.setenv("WORLD_SIZE", "four")
    with pytest.raises(ConfigError, match="WORLD_SIZE='four'"):
        sampler.set_world()


def test_world_defaults_prefer_an_initialized_process_group(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "5")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        sampler = ElasticSampler(10, global_batch_size=4)
    finally:
        dist.destroy_process_group()
    assert (sampler.rank, sampler.world_size) == (0, 1)


def test_share_bounds_are_contiguous_and_balanced() -> None:
    assert [share_bounds(10, r, 4) for r in range(4)] == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert [share_bounds(2, r, 4) for r in range(4)] == [(0, 1), (1, 2), (2, 2), (2, 2)]
