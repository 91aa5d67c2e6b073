"""Multi-rank checkpoints: the commit protocol with thread ranks, and real gloo processes across world sizes.

The process tests run :func:`_worker` as each rank, forked from the ranks' forkserver.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch

from elastictrain.checkpoint import CheckpointManager, Coordinator, LocalStorage
from elastictrain.checkpoint.manager import COPY_STAGE
from elastictrain.errors import CheckpointError
from tests.support.leave import leave_together
from tests.support.ranks import fork_ranks

pytestmark = pytest.mark.timeout(60)

T = TypeVar("T")


class ThreadHub:
    """Shared slots and a barrier: what ThreadCoordinators of one world meet at."""

    def __init__(self, world_size: int) -> None:
        self.barrier = threading.Barrier(world_size, timeout=10)
        self.slots: list[Any] = [None] * world_size


class ThreadCoordinator(Coordinator):
    """An in-memory Coordinator for ranks that are threads of one process."""

    def __init__(self, hub: ThreadHub, rank: int) -> None:
        self._hub, self._rank = hub, rank

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return len(self._hub.slots)

    def all_gather(self, obj: T) -> list[T]:
        try:
            self._hub.slots[self._rank] = obj
            self._hub.barrier.wait()
            out = list(self._hub.slots)
            self._hub.barrier.wait()  # nobody overwrites a slot before everyone has read it
        except threading.BrokenBarrierError as exc:
            raise CheckpointError("a thread rank left") from exc
        return out

    def broadcast(self, obj: T) -> T:
        return self.all_gather(obj)[0]


def run_ranks(world_size: int, body: Callable[[int, ThreadHub], T]) -> list[T | BaseException]:
    """Run ``body(rank, hub)`` on one thread per rank; return each rank's result or exception."""
    hub = ThreadHub(world_size)
    results: list[Any] = [None] * world_size

    def run(rank: int) -> None:
        try:
            results[rank] = body(rank, hub)
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            results[rank] = exc

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return results


def test_every_rank_writes_its_rng_file_and_rank_0_the_replicated_state(tmp_path: Path) -> None:
    model = torch.nn.Linear(3, 2)

    def body(rank: int, hub: ThreadHub) -> int | None:
        with CheckpointManager(tmp_path, coordinator=ThreadCoordinator(hub, rank)) as mgr:
            mgr.save(4, {"model": model})
            return mgr.latest_step()

    assert run_ranks(3, body) == [4, 4, 4]
    names = sorted(p.name for p in (tmp_path / "step_00000004").iterdir())
    assert names == ["MANIFEST.json", "rank_00000.pt", "rank_00001.pt", "rank_00002.pt", "replicated.pt"]


def test_a_write_failure_on_one_rank_aborts_the_commit_on_every_rank(tmp_path: Path) -> None:
    def body(rank: int, hub: ThreadHub) -> None:
        with CheckpointManager(tmp_path, coordinator=ThreadCoordinator(hub, rank), async_save=True) as mgr:
            if rank == 1:
                mgr._fault_hook = lambda stage: _raise(OSError(5, "I/O error")) if stage == "during_write" else None
            mgr.save(1, {"model": torch.nn.Linear(3, 2)})

    results = run_ranks(2, body)
    for result in results:
        assert isinstance(result, CheckpointError) and "rank 1" in str(result) and "I/O error" in str(result)
    assert list(tmp_path.iterdir()) == []  # no checkpoint, and the staging dir is gone


def test_a_copy_failure_on_rank_0_of_an_overlapped_save_aborts_the_commit_on_every_rank(tmp_path: Path) -> None:
    def body(rank: int, hub: ThreadHub) -> None:
        coordinator = ThreadCoordinator(hub, rank)
        with CheckpointManager(tmp_path, coordinator=coordinator, async_save=True, overlap=True) as mgr:
            if rank == 0:  # only rank 0 copies: it holds the replicated state
                mgr._fault_hook = lambda stage: _raise(MemoryError("out of pinned memory")) if stage == COPY_STAGE else None
            mgr.save(1, {"model": torch.nn.Linear(3, 2)})

    results = run_ranks(2, body)
    for result in results:
        assert isinstance(result, CheckpointError) and "rank 0" in str(result) and "out of pinned memory" in str(result)
    assert list(tmp_path.iterdir()) == []


def test_ranks_that_disagree_on_the_step_fail_together(tmp_path: Path) -> None:
    def body(rank: int, hub: ThreadHub) -> None:
        with CheckpointManager(tmp_path, coordinator=ThreadCoordinator(hub, rank)) as mgr:
            mgr.save(10 + rank, {})

    assert all(isinstance(r, CheckpointError) and "disagree" in str(r) for r in run_ranks(2, body))
    assert list(tmp_path.iterdir()) == []


def test_a_rank_writing_where_rank_0_cannot_see_fails_the_save_on_every_rank(tmp_path: Path) -> None:
    def body(rank: int, hub: ThreadHub) -> None:
        # Rank 1 has its "own disk": the mistake of checkpointing to node-local storage.
        storage = LocalStorage(tmp_path / f"node{rank}")
        with CheckpointManager("ckpt", storage=storage, coordinator=ThreadCoordinator(hub, rank)) as mgr:
            mgr.save(1, {})

    results = run_ranks(2, body)
    assert all(isinstance(r, CheckpointError) and "shared by all ranks" in str(r) for r in results)
    assert list((tmp_path / "node0" / "ckpt").iterdir()) == []


# --- real processes on gloo -------------------------------------------------------------------


def _raise(exc: BaseException) -> None:
    raise exc


def test_checkpoint_of_two_ddp_ranks_restores_the_same_model_on_three_ranks_and_on_one(tmp_path: Path) -> None:
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    out.mkdir()
    fork_ranks(_worker, 2, lambda rank: ("save", rank, 2, str(tmp_path / "store-save"), str(ckpt), str(out), "async"),
               timeout=45)
    fork_ranks(_worker, 3, lambda rank: ("restore", rank, 3, str(tmp_path / "store-restore"), str(ckpt), str(out)),
               timeout=45)

    expected = torch.load(out / "expected.pt", weights_only=True)
    saved_draws = [torch.load(out / f"draw{r}.pt", weights_only=True) for r in range(2)]
    restored = [torch.load(out / f"restored{r}.pt", weights_only=True) for r in range(3)]
    for rank, got in enumerate(restored):
        assert got["info"] == [4, 2]
        assert got["model"].keys() == expected["model"].keys()
        assert all(torch.equal(got["model"][k], v) for k, v in expected["model"].items())
        assert str(got["optimizer"]) == str(expected["optimizer"])
        assert torch.equal(got["after_step"], restored[0]["after_step"])  # DDP still trains in lockstep
    # Ranks 0 and 1 continue their own RNG streams; rank 2, new, gets a distinct seeded one.
    assert torch.equal(restored[0]["draw"], saved_draws[0]) and torch.equal(restored[1]["draw"], saved_draws[1])
    assert not any(torch.equal(restored[2]["draw"], d) for d in saved_draws)

    model = torch.nn.Linear(8, 4)
    with CheckpointManager(ckpt) as mgr:  # world size 1, no torch.distributed
        info = mgr.restore({"model": model})
    assert info is not None and info.step == 4 and info.world_size == 2
    assert torch.equal(model.weight, expected["model"]["weight"])
    assert torch.equal(torch.rand(4), saved_draws[0])


def test_overlapped_saves_of_two_ddp_ranks_hold_the_state_of_their_step(tmp_path: Path) -> None:
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    out.mkdir()
    # DDP all-reduces on the training thread while rank 0's copy and the commit run in the background.
    fork_ranks(_worker, 2, lambda rank: ("save", rank, 2, str(tmp_path / "store"), str(ckpt), str(out), "overlap"),
               timeout=45)
    for step in (2, 4):  # keep_last=2: both are there
        expected = torch.load(out / f"at{step}.pt", weights_only=True)
        model = torch.nn.Linear(8, 4)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        with CheckpointManager(ckpt) as mgr:
            info = mgr.restore({"model": model, "optimizer": opt}, step=step)
        assert info is not None and info.world_size == 2
        assert all(torch.equal(model.state_dict()[k], v) for k, v in expected["model"].items())
        assert str(opt.state_dict()) == str(expected["optimizer"])


def _worker(role: str, rank: int, world_size: int, store: str, ckpt: str, out: str, mode: str = "async") -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    torch.manual_seed(0 if role == "save" else 99)
    model = torch.nn.Linear(8, 4)
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    torch.manual_seed(1000 + rank)  # each rank its own data stream

    def train_step() -> None:
        opt.zero_grad()
        ddp(torch.randn(5, 8)).square().mean().backward()
        opt.step()

    if role == "save":
        # Async: the background commit's collectives run while DDP all-reduces on the main thread.
        with CheckpointManager(ckpt, async_save=True, overlap=mode == "overlap", keep_last=2) as mgr:
            for step in range(1, 5):
                train_step()
                if step % 2 == 0:
                    mgr.save(step, {"model": model, "optimizer": opt, "progress": {"step": step}})
                    if rank == 0:  # the state of this step, as training goes on
                        saved = {"model": model.state_dict(), "optimizer": opt.state_dict()}
                        torch.save(copy.deepcopy(saved), Path(out) / f"at{step}.pt")
            torch.save(torch.rand(4), Path(out) / f"draw{rank}.pt")
        if rank == 0:
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, Path(out) / "expected.pt")
    else:
        with CheckpointManager(ckpt) as mgr:
            info = mgr.restore({"model": model, "optimizer": opt})
        assert info is not None
        result = {
            "info": [info.step, info.world_size],
            "model": copy.deepcopy(model.state_dict()),
            "optimizer": copy.deepcopy(opt.state_dict()),
            "draw": torch.rand(4),
        }
        train_step()
        result["after_step"] = model.weight.detach().clone()
        torch.save(result, Path(out) / f"restored{rank}.pt")
    leave_together()

