"""Checkpoints on many hosts (issue 15, items 1-4): a directory every rank must share,
checksums on every rank that loads, fencing of stale worlds, readers racing retention,
and saves whose barrier follows the writer's progress.

Thread ranks stand in for hosts: a rank whose storage root is a symlink sees what a node
with its own mount would see once the symlink is re-pointed. The real-process (gloo) tests run
:func:`_slow_writer` and :func:`_stopped_peer` as ranks forked from the ranks' forkserver.
"""

from __future__ import annotations

import os
import shutil
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import BinaryIO

import pytest
import torch

from elastictrain.launch import status_report
from elastictrain.checkpoint import CheckpointManager, LocalStorage
from elastictrain.errors import CheckpointError
from tests.support.ranks import fork_ranks, rank_context
from tests.unit.test_checkpoint_distributed import ThreadCoordinator, ThreadHub, run_ranks

pytestmark = pytest.mark.timeout(60)

HOST = socket.gethostname()


def _state(seed: int) -> dict[str, torch.nn.Module]:
    torch.manual_seed(seed)
    return {"model": torch.nn.Linear(4, 3)}


def _save(directory: Path, steps: list[int], *, keep_last: int = 3) -> None:
    with CheckpointManager(directory, keep_last=keep_last) as mgr:
        for step in steps:
            mgr.save(step, _state(step))


def _weights_of(step: int) -> torch.Tensor:
    return _state(step)["model"].weight.detach().clone()


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


# --- 1. a directory every rank shares, checked at start and at every restore ------------------


def test_a_directory_that_a_rank_cannot_see_fails_at_start_on_every_rank_naming_its_host(tmp_path: Path) -> None:
    def body(rank: int, hub: ThreadHub) -> str:
        # Each rank its "own disk": the node-local directory, or a mount missing on one node.
        with CheckpointManager(tmp_path / f"node{rank}", coordinator=ThreadCoordinator(hub, rank)):
            return "started"

    results = run_ranks(3, body)
    for result in results:
        assert isinstance(result, CheckpointError), result
        message = str(result)
        assert "not on a filesystem shared by all ranks" in message and f"host(s) {HOST}" in message
        assert "rank(s) 1, 2" in message and "mount one shared filesystem" in message and "\n" not in message


def test_a_rank_that_sees_a_newer_checkpoint_than_rank_0_stops_every_rank_from_starting_over(tmp_path: Path) -> None:
    shared, other, view = tmp_path / "shared", tmp_path / "other", tmp_path / "view"
    shared.mkdir()
    _save(other, [5])  # what another node's own disk holds: a newer step
    view.symlink_to(shared)

    def body(rank: int, hub: ThreadHub) -> object:
        with CheckpointManager(view if rank else shared, coordinator=ThreadCoordinator(hub, rank)) as mgr:
            if rank == 1:  # the shared mount went away on rank 1's node after the start
                view.unlink()
                view.symlink_to(other)
            return mgr.restore(_state(0))

    for result in run_ranks(2, body):
        # Before: both ranks found "no checkpoint" on rank 0's side and started from scratch.
        assert isinstance(result, CheckpointError), result
        assert f"rank 1 on host {HOST} sees step 5" in str(result) and "sees none" in str(result)


def test_every_rank_checks_the_checksums_of_what_it_loads_and_all_fall_back_together(tmp_path: Path) -> None:
    shared, other, view = tmp_path / "shared", tmp_path / "other", tmp_path / "view"
    _save(shared, [1, 2])
    shutil.copytree(shared, other)
    _flip_a_byte(other / "step_00000002" / "replicated.pt")  # rank 1's node holds a damaged copy
    view.symlink_to(shared)

    def body(rank: int, hub: ThreadHub) -> tuple[int, torch.Tensor]:
        state = _state(0)
        with CheckpointManager(view if rank else shared, coordinator=ThreadCoordinator(hub, rank)) as mgr:
            if rank == 1:
                view.unlink()
                view.symlink_to(other)
            info = mgr.restore(state)
        assert info is not None
        return info.step, state["model"].weight.detach().clone()

    results = run_ranks(2, body)
    # Before: rank 0 restored step 2 and rank 1 loaded its damaged step 2 unchecked.
    assert [r[0] for r in results] == [1, 1]  # type: ignore[index]
    assert all(torch.equal(r[1], _weights_of(1)) for r in results)  # type: ignore[index]


# --- 3. fencing ------------------------------------------------------------------------------


def test_a_commit_is_refused_once_a_newer_world_claimed_the_directory(tmp_path: Path) -> None:
    stale = CheckpointManager(tmp_path, fence=True)
    stale.save(1, _state(1))
    newer = CheckpointManager(tmp_path, fence=True)  # a newer round's world starts here
    info = newer.restore(_state(0))
    assert info is not None and info.step == 1
    with pytest.raises(CheckpointError, match=r"commit of step 2 refused: a newer world \(fencing token 2"):
        stale.save(2, _state(2))  # the world cut off from etcd trains on
    assert not (tmp_path / "step_00000002").exists()
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]
    newer.save(2, _state(22))
    manifest = (tmp_path / "step_00000002" / "MANIFEST.json").read_text()
    assert '"fence": 2' in manifest and (newer.fence, stale.fence) == (2, 1)
    newer.close()
    stale.close()


def test_a_reader_that_only_restores_does_not_fence_off_the_writer(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, fence=True) as writer:
        writer.save(1, _state(1))
        with CheckpointManager(tmp_path) as reader:  # an eval job
            assert reader.restore(_state(0)) is not None and reader.fence is None
        writer.save(2, _state(2))
    assert (tmp_path / "step_00000002").is_dir()


def test_a_session_claims_its_checkpoint_directory_before_it_restores(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    import elastictrain
    from torch.utils.data import TensorDataset

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "ELASTICTRAIN_CONTROL_DIR"):
        monkeypatch.delenv(name, raising=False)
    stale = CheckpointManager(tmp_path, fence=True)  # the world this session's round replaces
    model = torch.nn.Linear(4, 1)
    data = TensorDataset(torch.randn(16, 4), torch.randn(16, 1))
    with elastictrain.Session(model, torch.optim.SGD(model.parameters(), lr=0.1), data, global_batch_size=8,
                              max_steps=1, checkpoint_dir=str(tmp_path), log_every=None) as session:
        assert session.checkpoints is not None and session.checkpoints.fence == 2
        with pytest.raises(CheckpointError, match="refused: a newer world"):
            stale.save(2, _state(2))
    stale.close()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step_")) == ["step_00000000"]  # the session's, at exit


def test_each_world_claims_the_next_token_and_only_the_newest_four_remain(tmp_path: Path) -> None:
    tokens = []
    for _ in range(6):
        with CheckpointManager(tmp_path, fence=True) as mgr:
            tokens.append(mgr.fence)
    assert tokens == [1, 2, 3, 4, 5, 6]
    assert sorted(p.name for p in tmp_path.iterdir()) == [f".fence-{t:012d}" for t in (3, 4, 5, 6)]


# --- 4. readers racing the writer's retention -------------------------------------------------


class RetiringStorage(LocalStorage):
    """A reader's real storage, during whose read ``trigger`` the writer commits (and retires) more."""

    def __init__(self, root: Path, trigger: str, writer: CheckpointManager, steps: list[int]) -> None:
        super().__init__(root)
        self._trigger, self._writer, self._steps = trigger, writer, steps

    @contextmanager
    def open_read(self, path: str) -> Iterator[BinaryIO]:
        if path.endswith(self._trigger) and self._steps:
            steps, self._steps = self._steps, []
            for step in steps:
                self._writer.save(step, _state(step))
        with super().open_read(path) as f:
            yield f


@pytest.mark.parametrize("trigger", ["step_00000002/MANIFEST.json", "step_00000002/replicated.pt"])
def test_a_reader_whose_checkpoint_is_retired_under_it_restores_the_newer_one(tmp_path: Path, trigger: str) -> None:
    with CheckpointManager(tmp_path / "ckpt", keep_last=2) as writer:
        for step in (1, 2):
            writer.save(step, _state(step))
        storage = RetiringStorage(tmp_path, trigger, writer, [3, 4])
        state = _state(0)
        with CheckpointManager("ckpt", storage=storage) as reader:
            info = reader.restore(state)  # before: "none of the 2 checkpoints ... verifies"
    assert info is not None and info.step == 4
    assert torch.equal(state["model"].weight, _weights_of(4))


def test_status_checks_manifests_and_sizes_and_checksums_only_when_asked(tmp_path: Path) -> None:
    _save(tmp_path, [1, 2])
    _flip_a_byte(tmp_path / "step_00000002" / "replicated.pt")  # same size: only a checksum sees it
    cheap = status_report.newest_checkpoint(str(tmp_path))
    assert cheap is not None and cheap["step"] == 2 and cheap["checksums_verified"] is False
    full = status_report.newest_checkpoint(str(tmp_path), checksums=True)
    assert full is not None and full["step"] == 1 and full["checksums_verified"] is True
    (tmp_path / "step_00000001" / "rank_00000.pt").write_bytes(b"short")  # a size is still checked cheaply
    truncated = tmp_path / "step_00000002" / "rank_00000.pt"
    truncated.write_bytes(truncated.read_bytes()[:-1])
    with pytest.raises(CheckpointError, match="none of the 2"):
        status_report.newest_checkpoint(str(tmp_path))


def test_status_verify_checksums_without_a_checkpoint_dir_is_one_line_and_a_usage_error(
        capsys: pytest.CaptureFixture[str]) -> None:
    from elastictrain.launch.cli import main

    code = main(["status", "--etcd", "127.0.0.1:1", "--run-id", "x", "--verify-checksums"])
    err = capsys.readouterr().err
    assert code == 2 and err.strip().splitlines() == [
        "elastictrain: error: --verify-checksums needs --checkpoint-dir (the directory whose checkpoint to verify)"]


# --- 2. a save is never cut short for being large ---------------------------------------------


def test_a_save_that_writes_for_longer_than_the_collective_timeout_commits(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    # Before: rank 1 waited for rank 0's write in a gloo all_gather and timed out after 2 s.
    fork_ranks(_slow_writer, 2, lambda rank: (rank, str(tmp_path / "store"), str(ckpt)), timeout=50)
    with CheckpointManager(ckpt) as mgr:
        info = mgr.restore(_big_state())
    assert info is not None and info.step == 1 and info.world_size == 2


def test_a_save_waiting_for_a_rank_stops_waiting_when_the_group_is_superseded(tmp_path: Path) -> None:
    # In-process recovery: rank 1 hangs (SIGSTOP) before writing its part of a save; the agent
    # kills it and announces a new generation. Rank 0 waited for rank 1's files for the whole
    # stall deadline (here 120 s; 60 s in the test that found it) before its barrier failed.
    ckpt, flag = tmp_path / "ckpt", tmp_path / "superseded"
    context = rank_context()
    procs = [context.Process(target=_stopped_peer, args=(rank, str(tmp_path / "store"), str(ckpt), str(flag)),
                             name=f"rank {rank}") for rank in range(2)]
    for p in procs:
        p.start()
    try:
        deadline = time.monotonic() + 60
        while Path(f"/proc/{procs[1].pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "T":
            assert time.monotonic() < deadline and procs[1].exitcode is None, "rank 1 never stopped"
            time.sleep(0.1)
        procs[1].kill()  # what the agent's hang detector does
        flag.touch()  # and the new generation it publishes
        procs[0].join(timeout=60)  # its save failed at the barrier, well before the stall deadline
        assert procs[0].exitcode == 0, procs[0].output()
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()


def _stopped_peer(rank: int, store: str, ckpt: str, flag: str) -> None:
    import signal

    import torch.distributed as dist

    from elastictrain.errors import CheckpointError

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=120))

    def stop(stage: str) -> None:
        if stage == "before_write" and rank == 1:
            os.kill(os.getpid(), signal.SIGSTOP)

    with CheckpointManager(ckpt, timeout=timedelta(seconds=120), superseded=lambda: os.path.exists(flag)) as mgr:
        mgr._fault_hook = stop
        try:
            mgr.save(1, _big_state())
        except CheckpointError:
            os._exit(0)  # the barrier failed: the group re-forms (a plain exit would wait for the dead peer)
    os._exit(1)


def _big_state() -> dict[str, dict[str, torch.Tensor]]:
    return {"big": {f"t{i}": torch.full((16384,), float(i)) for i in range(40)}}


def _slow_writer(rank: int, store: str, ckpt: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    slow_for = {"slept": 0.0, "size": 0}

    def slow(stage: str) -> None:
        # Rank 0 writes its tensors at a crawl, for 2.5x the collective timeout in all, but
        # it keeps writing: it pauses only after bytes reached the file since its last pause.
        if stage != "during_write" or rank != 0 or slow_for["slept"] >= 5.0:
            return
        size = sum(p.stat().st_size for p in Path(ckpt).glob("*.tmp-*/replicated.pt"))
        if size != slow_for["size"]:
            slow_for["size"] = size
            time.sleep(0.15)
            slow_for["slept"] += 0.15

    with CheckpointManager(ckpt, timeout=timedelta(seconds=2)) as mgr:
        mgr._fault_hook = slow
        mgr.save(1, _big_state())
    dist.destroy_process_group()

