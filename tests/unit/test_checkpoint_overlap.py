"""Overlapped saves: ``save`` returns at once, the copy runs while training goes on, the bytes are the step's.

The copy is paused at chosen storages through the manager's fault hook (stage
``during_copy``), so that training reaches the guarded operation (a forward, an
optimizer step) while the tensors it would change are not copied yet. The pause
ends when training has done that operation or after ``PAUSE`` seconds: with the
guards in place training is blocked, and the pause ends by its timeout.
"""

from __future__ import annotations

import random
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from elastictrain.checkpoint import CheckpointManager
from elastictrain.checkpoint.manager import COPY_STAGE
from elastictrain.errors import CheckpointError, ConfigError

pytestmark = pytest.mark.timeout(60)

PAUSE = 1.0
FILES = ("replicated.pt", "rank_00000.pt")


class Net:
    """A model with buffers (BatchNorm) and every kind of optimizer-side state."""

    BUFFER_STORAGES = 3  # BatchNorm1d: running_mean, running_var, num_batches_tracked

    def __init__(self, device: str = "cpu") -> None:
        torch.manual_seed(0)
        self.device = device
        self.model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                                         torch.nn.Linear(16, 2)).to(device)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=0.05)
        self.sched = torch.optim.lr_scheduler.StepLR(self.opt, step_size=1, gamma=0.5)
        self.progress: dict[str, Any] = {"step": 0, "seen": torch.zeros(2)}

    def train(self, steps: int) -> None:
        for _ in range(steps):
            self.opt.zero_grad()
            self.model(torch.randn(5, 6, device=self.device)).square().mean().backward()
            self.opt.step()
            self.sched.step()
            self.progress["step"] += 1

    def state(self) -> dict[str, Any]:
        return {"model": self.model, "optimizer": self.opt, "scheduler": self.sched, "progress": self.progress}


class PauseCopy:
    """A fault hook pausing the background copy before chosen storages until an event (or ``timeout`` s)."""

    def __init__(self, pauses: dict[int, threading.Event], timeout: float = PAUSE) -> None:
        self.pauses, self.timeout = pauses, timeout
        self.copied = 0  # storages whose copy has started
        self.timed_out: list[int] = []

    def __call__(self, stage: str) -> None:
        if stage != COPY_STAGE:
            return
        event = self.pauses.get(self.copied)
        if event is not None and not event.wait(self.timeout):
            self.timed_out.append(self.copied)
        self.copied += 1


def held_until_stepped(opt: torch.optim.Optimizer, at: int) -> PauseCopy:
    """Pause the copy before storage ``at`` until ``opt`` has stepped."""
    stepped = threading.Event()
    opt.register_step_post_hook(lambda *_: stepped.set())
    return PauseCopy({at: stepped})


def seed_all(seed: int = 7) -> None:
    # The rank file holds the RNG states: make them equal for both saves.
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


def saved_bytes(directory: Path, step: int) -> dict[str, bytes]:
    return {name: (directory / f"step_{step:08d}" / name).read_bytes() for name in FILES}


def sync_reference(directory: Path, step: int, state: dict[str, Any]) -> dict[str, bytes]:
    seed_all()
    with CheckpointManager(directory) as mgr:
        mgr.save(step, state)
    return saved_bytes(directory, step)


def test_overlapped_save_is_byte_identical_to_a_sync_save_while_the_next_step_runs_during_the_copy(
    tmp_path: Path,
) -> None:
    net = Net()
    net.train(2)
    expected = sync_reference(tmp_path / "sync", 2, net.state())
    before = {k: v.clone() for k, v in net.model.state_dict().items()}

    forwarded, stepped = threading.Event(), threading.Event()
    net.model.register_forward_hook(lambda *_: forwarded.set())
    net.opt.register_step_post_hook(lambda *_: stepped.set())
    # Pause before the first buffer until the forward ran, and before the first
    # parameter until the optimizer stepped: only the guards keep those from
    # changing what is still to be copied.
    pause = PauseCopy({0: forwarded, Net.BUFFER_STORAGES: stepped})
    with CheckpointManager(tmp_path / "overlap", async_save=True, overlap=True) as mgr:
        mgr._fault_hook = pause
        seed_all()
        mgr.save(2, net.state())
        net.train(1)  # forward (BatchNorm statistics), optimizer, scheduler, extras
        net.progress["seen"] += 1  # after the optimizer step, which waited for the whole copy
        mgr.wait()

    assert saved_bytes(tmp_path / "overlap", 2) == expected
    # The step really ran during the copy, and changed what was saved.
    assert pause.timed_out == [0, Net.BUFFER_STORAGES]
    assert all(not torch.equal(before[k], v) for k, v in net.model.state_dict().items())


def test_overlapped_save_returns_before_any_tensor_is_copied(tmp_path: Path) -> None:
    net = Net()
    returned = threading.Event()
    seen: list[bool] = []

    def hook(stage: str) -> None:
        if stage == COPY_STAGE and not seen:
            seen.append(returned.wait(10))

    with CheckpointManager(tmp_path, async_save=True, overlap=True) as mgr:
        mgr._fault_hook = hook
        mgr.save(1, net.state())
        returned.set()
        mgr.wait()
        assert mgr.latest_step() == 1
    assert seen == [True]


def test_wait_snapshot_makes_an_in_place_change_outside_the_optimizer_safe(tmp_path: Path) -> None:
    net = Net()
    net.train(1)
    expected = sync_reference(tmp_path / "sync", 1, net.state())
    changed = threading.Event()
    pause = PauseCopy({0: changed})
    with CheckpointManager(tmp_path / "overlap", async_save=True, overlap=True) as mgr:
        mgr._fault_hook = pause
        seed_all()
        mgr.save(1, net.state())
        mgr.wait_snapshot()
        with torch.no_grad():
            for p in net.model.parameters():
                p.mul_(-3.0)
            net.model[1].running_mean.add_(5.0)
        changed.set()
        mgr.wait()
    assert saved_bytes(tmp_path / "overlap", 1) == expected
    assert pause.timed_out == [0]


def test_an_optimizer_left_out_of_the_save_still_waits_before_stepping_saved_parameters(tmp_path: Path) -> None:
    net = Net()
    net.train(1)
    expected = sync_reference(tmp_path / "sync", 1, {"model": net.model})
    pause = held_until_stepped(net.opt, Net.BUFFER_STORAGES)
    with CheckpointManager(tmp_path / "overlap", async_save=True, overlap=True) as mgr:
        mgr._fault_hook = pause
        seed_all()
        mgr.save(1, {"model": net.model})  # a plain loop saving the model alone
        net.train(1)
        mgr.wait()
    assert saved_bytes(tmp_path / "overlap", 1) == expected
    assert pause.timed_out == [Net.BUFFER_STORAGES]


def test_an_optimizer_of_other_parameters_steps_without_waiting_for_the_copy(tmp_path: Path) -> None:
    net = Net()
    other = torch.nn.Linear(3, 3)
    other_opt = torch.optim.SGD(other.parameters(), lr=0.1)
    release = threading.Event()
    pause = PauseCopy({0: release}, timeout=30)  # were the step to wait, it would wait this long
    with CheckpointManager(tmp_path, async_save=True, overlap=True) as mgr:
        mgr._fault_hook = pause
        mgr.save(1, net.state())
        other(torch.randn(2, 3)).sum().backward()
        other_opt.step()  # would block until the pause times out if it waited
        assert pause.copied == 0  # the copy is still paused before its first storage
        release.set()
        mgr.wait()
    assert pause.timed_out == []


def test_a_failed_copy_releases_training_and_is_raised_by_wait_without_a_commit(tmp_path: Path) -> None:
    net = Net()

    def fail(stage: str) -> None:
        if stage == COPY_STAGE:
            raise MemoryError("cannot allocate pinned memory")

    with CheckpointManager(tmp_path, async_save=True, overlap=True) as mgr:
        mgr.save(1, net.state())
        mgr.wait()
        mgr._fault_hook = fail
        mgr.save(2, net.state())
        net.train(1)  # must not hang on the abandoned copy
        with pytest.raises(CheckpointError, match="step 2.*copying the state"):
            mgr.wait()
        assert mgr.latest_step() == 1
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == ["step_00000001"]


def _copy_pointers(mgr: CheckpointManager) -> set[int]:
    return {storage.data_ptr() for storage in mgr._pool._memo.values()}


def test_the_first_save_copies_into_memory_reserved_after_the_first_step_and_later_saves_reuse_it(
    tmp_path: Path,
) -> None:
    net = Net()
    with CheckpointManager(tmp_path, async_save=True, overlap=True) as mgr:
        assert mgr.restore(net.state()) is None
        assert mgr._overlap._reserver is None  # AdamW has no state before its first step: nothing to size yet
        net.train(1)
        assert mgr._overlap._reserver is not None
        mgr._overlap._reserver.join()
        reserved = {storage.data_ptr() for _, _, storage in mgr._pool._taken}
        # The model's state, AdamW's step, exp_avg and exp_avg_sq per parameter, the extras' tensor.
        assert len(reserved) == len(net.model.state_dict()) + 3 * len(list(net.model.parameters())) + 1
        mgr.save(1, net.state())
        mgr.wait()
        assert _copy_pointers(mgr) == reserved
        net.train(1)
        mgr.save(2, net.state())
        mgr.wait()
        assert _copy_pointers(mgr) == reserved


def test_overlap_needs_async_save(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="overlap=True needs async_save=True"):
        CheckpointManager(tmp_path, overlap=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_overlapped_save_of_a_cuda_model_copies_through_pinned_memory_and_matches_a_sync_save(
    tmp_path: Path,
) -> None:
    net = Net("cuda")
    net.train(2)
    expected = sync_reference(tmp_path / "sync", 2, net.state())
    pause = held_until_stepped(net.opt, Net.BUFFER_STORAGES)
    with CheckpointManager(tmp_path / "overlap", async_save=True, overlap=True) as mgr:
        mgr._fault_hook = pause
        seed_all()
        mgr.save(2, net.state())
        net.train(3)  # its first optimizer step waits on the side stream's copies
        mgr.wait()
        # Device tensors went through pinned memory (AdamW's step counts live on the CPU).
        assert all(copy.is_pinned() == key[0].startswith("cuda") for key, copy in mgr._pool._memo.items())
        first = _copy_pointers(mgr)
        mgr.save(3, net.state())
        net.train(1)
        mgr.wait()
        assert _copy_pointers(mgr) == first
    assert saved_bytes(tmp_path / "overlap", 2) == expected
    assert pause.timed_out == [Net.BUFFER_STORAGES]
