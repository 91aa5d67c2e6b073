"""Storage faults during a save (issue 40, item 5): a full disk, an I/O error, a write that blocks.

Every rank fails the save together (``CheckpointWriteError``), the torn staging directory goes,
the checkpoint committed before stays restorable, and the next save commits. A write that blocks
is abandoned after ``save_timeout`` and no second write starts while it blocks. Thread ranks
(``ThreadCoordinator``) stand in for processes; the full disk is a real 2 MB tmpfs where this
machine lets the test mount one, and a ``Storage`` raising the errno where it does not.
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any, BinaryIO

import pytest
import torch

from elastictrain.checkpoint import CheckpointManager, LocalStorage
from elastictrain.errors import CheckpointWriteError
from tests.support.small_disk import small_disk
from tests.unit.test_checkpoint_distributed import ThreadCoordinator, ThreadHub, run_ranks

pytestmark = pytest.mark.timeout(60)

MODES = {"sync": {}, "async": {"async_save": True}, "overlap": {"async_save": True, "overlap": True}}


def _state(seed: int, blob_mb: float = 0) -> dict[str, Any]:
    model = torch.nn.Linear(4, 3)
    with torch.no_grad():  # not the global RNG: the thread ranks would race for it
        model.weight.copy_(torch.randn(3, 4, generator=torch.Generator().manual_seed(seed)))
    state: dict[str, Any] = {"model": model}
    if blob_mb:
        state["blob"] = {"x": torch.zeros(int(blob_mb * (1 << 20)) // 4)}
    return state


def _save(mgr: CheckpointManager, step: int, state: dict[str, Any]) -> None:
    mgr.save(step, state)
    mgr.wait()  # an async save's failure comes here


def _committed(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if not p.name.startswith("."))


def _fails_then_recovers(directory: Path, mode: str, *, storage: Any = None, big_step: float = 0) -> list[Any]:
    """Save step 1, then step 2 (which meets the fault), then step 3; return each rank's outcome."""
    said: list[tuple[int, str]] = []

    def body(rank: int, hub: ThreadHub) -> Any:
        where = directory if storage is None else directory.name  # a storage's paths are relative to its root
        with CheckpointManager(where, coordinator=ThreadCoordinator(hub, rank), storage=storage,
                               on_write_failure=lambda step, exc: said.append((step, str(exc))),
                               **MODES[mode]) as mgr:
            _save(mgr, 1, _state(1))
            with pytest.raises(CheckpointWriteError) as failed:
                _save(mgr, 2, _state(2, big_step))
            assert _committed(directory) == ["step_00000001"]  # nothing torn left, the previous one kept
            _save(mgr, 3, _state(3))  # the next interval tries again
            restored = _state(0)
            info = mgr.restore(restored, step=1)
            assert info is not None and torch.equal(restored["model"].weight, _state(1)["model"].weight)
            return str(failed.value)

    results = run_ranks(2, body)
    assert not any(isinstance(r, BaseException) for r in results), results
    assert sorted(step for step, _ in said) == [2, 2], said  # said once per rank, by the caller's report
    assert _committed(directory) == ["step_00000001", "step_00000003"]
    return results


@pytest.mark.parametrize("mode", list(MODES))
def test_a_save_that_fills_a_real_disk_fails_on_every_rank_and_the_next_one_commits(tmp_path: Path,
                                                                                    mode: str) -> None:
    with small_disk(tmp_path / "disk", "2m") as disk:
        results = _fails_then_recovers(disk / "ckpt", mode, big_step=3)
    for result in results:
        assert isinstance(result, str) and "step 2" in result and "No space left on device" in result, result


class FaultyStorage(LocalStorage):
    """Local storage whose writes of paths holding every one of ``when`` fail with ``error``."""

    def __init__(self, root: Path, error: int, when: tuple[str, ...]) -> None:
        super().__init__(root)
        self.error, self.when = error, when

    @contextlib.contextmanager
    def open_write(self, path: str) -> Iterator[BinaryIO]:
        with super().open_write(path) as f:
            if all(part in path for part in self.when):
                f.write(b"partial")
                raise OSError(self.error, f"{errno.errorcode[self.error]}: {os.strerror(self.error)}", path)
            yield f


@pytest.mark.parametrize("error", [errno.ENOSPC, errno.EIO])
@pytest.mark.parametrize("mode", list(MODES))
def test_a_storage_error_on_one_rank_fails_the_save_on_every_rank_and_the_next_one_commits(
        tmp_path: Path, mode: str, error: int) -> None:
    storage = FaultyStorage(tmp_path, error, when=("step_00000002.tmp-", "rank_00001"))
    results = _fails_then_recovers(tmp_path / "ckpt", mode, storage=storage)
    for result in results:
        assert isinstance(result, str) and "step 2" in result and errno.errorcode[error] in result, result
        assert "rank 1: " in result and "rank 0: " not in result


class BlockingStorage(LocalStorage):
    """Local storage whose write of one file blocks until released: a hung NFS server."""

    def __init__(self, root: Path, when: str) -> None:
        super().__init__(root)
        self.when = when
        self.blocked, self.release, self.returned = threading.Event(), threading.Event(), threading.Event()
        self.writes: list[str] = []

    @contextlib.contextmanager
    def open_write(self, path: str) -> Iterator[BinaryIO]:
        self.writes.append(path)
        if self.when in path:
            self.blocked.set()
            self.release.wait(30)
            self.returned.set()
        with super().open_write(path) as f:
            yield f


def _save_once_unblocked(mgr: CheckpointManager, step: int, state: dict[str, Any]) -> None:
    """Save ``step`` once the abandoned call's thread has ended: it still unwinds for a moment after
    the storage answered (every rank gets the same outcome, so the ranks retry in step)."""
    for _ in range(50):
        try:
            return _save(mgr, step, state)
        except CheckpointWriteError as exc:
            if "skipped, so that no second write blocks" not in str(exc):
                raise
            time.sleep(0.1)
    raise AssertionError("the abandoned call never ended")


def test_a_write_that_blocks_is_abandoned_after_the_bound_and_no_second_write_starts_while_it_blocks(
        tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    stores = [LocalStorage(tmp_path), BlockingStorage(tmp_path, "step_00000002.tmp-")]
    blocked = stores[1]
    assert isinstance(blocked, BlockingStorage)
    errors: dict[int, list[str]] = {0: [], 1: []}

    def body(rank: int, hub: ThreadHub) -> None:
        with CheckpointManager("ckpt", coordinator=ThreadCoordinator(hub, rank), storage=stores[rank],
                               async_save=True, save_timeout=timedelta(seconds=1),
                               on_write_failure=lambda step, exc: errors[rank].append(f"{step}: {exc}")) as mgr:
            _save(mgr, 1, _state(1))
            mgr.save(2, _state(2))
            if rank == 1:  # the save returned: training goes on while its write blocks
                assert blocked.blocked.wait(10) and not blocked.release.is_set()
            with pytest.raises(CheckpointWriteError, match="made no progress for 1s"):
                mgr.wait()
            with pytest.raises(CheckpointWriteError, match="skipped, so that no second write blocks"):
                _save(mgr, 3, _state(3))  # still blocked: skipped on every rank
            if rank == 1:
                writes = len(blocked.writes)
                blocked.release.set()
                assert blocked.returned.wait(10)
            _save_once_unblocked(mgr, 4, _state(4))  # the storage answers again
            if rank == 1:
                assert not any("step_00000003" in path for path in blocked.writes[:writes])

    for result in run_ranks(2, body):
        assert result is None, result
    assert _committed(directory) == ["step_00000001", "step_00000004"]
    for rank in (0, 1):
        assert [e.split(":")[0] for e in errors[rank]][:2] == ["2", "3"], errors
    assert "rank 1: the write of step 2 made no progress" in errors[0][0]


class BlockingRename(LocalStorage):
    """Local storage whose commit (the rename) of step 2 blocks until released."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.release, self.returned = threading.Event(), threading.Event()

    def rename(self, src: str, dst: str) -> None:
        if dst.endswith("step_00000002"):
            self.release.wait(30)
            self.returned.set()
        super().rename(src, dst)


def test_a_commit_that_blocks_is_abandoned_before_the_ranks_waiting_for_its_outcome_time_out(
        tmp_path: Path) -> None:
    """Rank 1 waits for rank 0's commit in a collective (the broadcast of the outcome), whose timeout
    is ``timeout``: rank 0 abandons the commit at half of it, so every rank fails the save as a
    write error rather than rank 1 with a collective timeout."""
    storage = BlockingRename(tmp_path)

    def body(rank: int, hub: ThreadHub) -> None:
        with CheckpointManager("ckpt", coordinator=ThreadCoordinator(hub, rank), storage=storage,
                               timeout=timedelta(seconds=2), save_timeout=timedelta(seconds=20)) as mgr:
            _save(mgr, 1, _state(1))
            with pytest.raises(CheckpointWriteError, match="the commit of step 2 made no progress for 1s"):
                _save(mgr, 2, _state(2))
            with pytest.raises(CheckpointWriteError, match="skipped, so that no second write blocks"):
                _save(mgr, 3, _state(3))
            if rank == 0:
                storage.release.set()
                assert storage.returned.wait(10)
            _save_once_unblocked(mgr, 4, _state(4))

    for result in run_ranks(2, body):
        assert result is None, result
    # The abandoned rename completed once the storage answered: step 2 is whole after all.
    assert _committed(tmp_path / "ckpt") == ["step_00000001", "step_00000002", "step_00000004"]
