"""A Session whose checkpoint saves meet a full disk, an I/O error or a storage that blocks (issue 40,
item 5): training goes on, the failed save is said in one line and a ``checkpoint_abandoned`` event,
the checkpoint before stays restorable, and the next save commits. A real world-of-one gloo group,
so the skip vote runs as a collective."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import pytest
import torch

import elastictrain
from elastictrain.checkpoint import LocalStorage, storage
from tests.support.small_disk import small_disk
from tests.unit.test_session import dataset, make_model, no_launcher, train, world_of_one  # noqa: F401 - fixtures

pytestmark = pytest.mark.timeout(90)

MODES = {"sync": {}, "async": {"async_save": True}, "overlap": {"async_save": True, "overlap_save": True}}


class Blob(elastictrain.Hooks):
    """Makes the extra state too big for the disk for the save of step 4 only, and runs ``at``'s
    callbacks after their steps."""

    def __init__(self, blob: dict[str, Any], at: dict[int, Any] | None = None) -> None:
        self.blob, self.at = blob, at or {}

    def on_step_end(self, *, step: int, loss: float, throughput: float) -> None:
        if step == 4:
            self.blob["x"] = torch.zeros(3 << 18)  # 3 MB: more than the disk holds
        elif step == 5:
            self.blob["x"] = torch.zeros(4)
        if step in self.at:
            self.at[step]()


def _run(directory: Path, hooks: tuple[Any, ...] = (), blob: dict[str, Any] | None = None,
         **options: Any) -> elastictrain.Session:
    model = make_model()
    session = elastictrain.Session(model, torch.optim.SGD(model.parameters(), lr=0.01), dataset(40),
                                   global_batch_size=4, epochs=1, checkpoint_dir=str(directory),
                                   checkpoint_every=2, keep_last=10, log_every=None, hooks=hooks,
                                   extra_state={"blob": blob if blob is not None else {"x": torch.zeros(4)}},
                                   **options)
    with session:
        train(session)
    return session


def _said(caplog: pytest.LogCaptureFixture, step: int) -> tuple[list[str], list[str]]:
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING
             and any(f"{what} of step {step} " in r.getMessage() for what in ("checkpoint", "the save"))]
    events = [r.getMessage() for r in caplog.records
              if r.name == "elastictrain.events" and '"checkpoint_abandoned"' in r.getMessage()]
    return lines, events


def _steps(directory: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in directory.iterdir() if p.name.startswith("step_") and ".tmp" not in p.name)


def _check_the_full_disk_run(directory: Path, session: elastictrain.Session, caplog: pytest.LogCaptureFixture,
                             error: str) -> None:
    assert session.step == 10  # training went on to the end
    lines, events = _said(caplog, 4)
    assert len(lines) == 1, lines  # one line: step, error, the next save
    assert "checkpoint of step 4 was not committed" in lines[0] and error in lines[0]
    assert "training continues, the next save is at step 6" in lines[0]
    assert len(events) == 1 and '"step": 4' in events[0] and error in events[0], events
    assert _steps(directory) == [2, 6, 8, 10]  # the save after it committed, nothing torn left
    assert not [p for p in directory.iterdir() if ".tmp-" in p.name]
    with elastictrain.checkpoint.CheckpointManager(directory) as reader:
        state = {"model": make_model(), "blob": {"x": torch.zeros(4)}}
        info = reader.restore(state, step=2)
        assert info is not None and info.step == 2


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.usefixtures("world_of_one")
def test_a_save_that_fills_a_real_disk_is_said_once_and_training_goes_on(
        tmp_path: Path, mode: str, caplog: pytest.LogCaptureFixture) -> None:
    blob = {"x": torch.zeros(4)}
    with small_disk(tmp_path / "disk", "2m") as disk, caplog.at_level(logging.INFO):
        session = _run(disk / "ckpt", (Blob(blob),), blob, **MODES[mode])
        _check_the_full_disk_run(disk / "ckpt", session, caplog, "No space left on device")


class FaultyStorage(LocalStorage):
    """LocalStorage whose writes into the staging directory of step 4 fail with ``FaultyStorage.error``."""

    error = errno.ENOSPC

    @contextlib.contextmanager
    def open_write(self, path: str) -> Iterator[BinaryIO]:
        with super().open_write(path) as f:
            if "step_00000004.tmp-" in path and not os.path.basename(path).startswith("."):
                raise OSError(self.error, os.strerror(self.error), path)
            yield f


@pytest.mark.parametrize("error", [errno.ENOSPC, errno.EIO])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.usefixtures("world_of_one")
def test_a_storage_error_during_a_save_is_said_once_and_training_goes_on(
        tmp_path: Path, mode: str, error: int, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(FaultyStorage, "error", error)
    monkeypatch.setattr(storage, "LocalStorage", FaultyStorage)  # what the session's manager writes through
    with caplog.at_level(logging.INFO):
        session = _run(tmp_path / "ckpt", **MODES[mode])
    _check_the_full_disk_run(tmp_path / "ckpt", session, caplog, os.strerror(error))


class BlockingStorage(LocalStorage):
    """LocalStorage whose writes into the staging directory of step 4 block until released (a hung
    NFS server)."""

    release = threading.Event()
    writes: list[str] = []

    @contextlib.contextmanager
    def open_write(self, path: str) -> Iterator[BinaryIO]:
        BlockingStorage.writes.append(path)
        if "step_00000004.tmp-" in path:
            BlockingStorage.release.wait(60)
        with super().open_write(path) as f:
            yield f


@pytest.fixture
def blocking_storage(monkeypatch: pytest.MonkeyPatch) -> Iterator[type[BlockingStorage]]:
    monkeypatch.setattr(BlockingStorage, "release", threading.Event())
    monkeypatch.setattr(BlockingStorage, "writes", [])
    monkeypatch.setattr(storage, "LocalStorage", BlockingStorage)
    yield BlockingStorage
    BlockingStorage.release.set()


@pytest.mark.usefixtures("world_of_one")
def test_an_async_save_whose_write_blocks_is_abandoned_after_the_bound_and_the_next_one_skipped(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, blocking_storage: type[BlockingStorage]) -> None:
    """checkpoint_timeout 1 s: the save of step 4 is abandoned; step 6 finds the write still blocked
    and is skipped on every rank, with no second write; once the storage answers, saves commit."""
    def release() -> None:
        blocking_storage.release.set()
        time.sleep(0.5)  # the blocked call returns (its staging directory is gone: it fails)

    with caplog.at_level(logging.INFO):
        session = _run(tmp_path / "ckpt", (Blob({}, at={7: release}),), async_save=True, checkpoint_timeout=1)
    assert session.step == 10
    lines4, events = _said(caplog, 4)
    assert len(lines4) == 1 and "made no progress for 1s" in lines4[0], lines4
    lines6, _ = _said(caplog, 6)
    assert len(lines6) == 1 and "skipped, so that no second write blocks" in lines6[0], lines6
    assert "the next save is at step 8" in lines6[0]
    assert [e for e in events if '"step": 6' in e]
    assert not [w for w in blocking_storage.writes if "step_00000006" in w]  # no second write while blocked
    assert _steps(tmp_path / "ckpt") == [2, 8, 10]


@pytest.mark.usefixtures("world_of_one")
def test_a_save_due_while_the_one_in_flight_gets_no_answer_is_skipped_not_waited_for(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, blocking_storage: type[BlockingStorage]) -> None:
    """checkpoint_timeout 60 s, a step after the blocked save that takes 3 s: the save due at step 6
    does not wait up to a minute for the blocked one; it is skipped, and said so."""
    def release() -> None:
        blocking_storage.release.set()
        time.sleep(0.5)  # the write of step 4 goes on (and commits) before step 8's save falls due
    with caplog.at_level(logging.INFO):
        session = _run(tmp_path / "ckpt", (Blob({}, at={5: lambda: time.sleep(3), 7: release}),),
                       async_save=True, checkpoint_timeout=60)
    assert session.step == 10
    lines6 = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and "step 6" in r.getMessage()]
    assert len(lines6) == 1 and "checkpoint of step 6 skipped: the save in flight has had no answer from the " \
                                "storage for" in lines6[0], lines6
    assert "the next save is at step 8" in lines6[0]
    assert any('"checkpoint_skipped"' in r.getMessage() and '"step": 6' in r.getMessage() for r in caplog.records)
    assert not [w for w in blocking_storage.writes if "step_00000006" in w]
    assert _steps(tmp_path / "ckpt") == [2, 4, 8, 10]  # step 4's write went through once released
