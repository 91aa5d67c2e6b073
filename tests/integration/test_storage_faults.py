"""Storage faults in a real two-node job (issue 40, item 5): a full disk, and one rank whose
checkpoint writes block. Training goes to the end, every rank agrees the save failed (nobody
hangs at the barrier or dies), rank 0 says it in one line, and a later save commits."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import subprocess_env
from tests.support.small_disk import small_disk

pytestmark = pytest.mark.timeout(180)

SCRIPT = """\
import contextlib, os, sys, threading, time, torch, elastictrain
from torch.utils.data import TensorDataset
from elastictrain.checkpoint import LocalStorage, storage

directory, fault = sys.argv[1], sys.argv[2]


class BlockingStorage(LocalStorage):
    # rank 1's writes into step 4's staging directory block for 8 s: a hung NFS client
    @contextlib.contextmanager
    def open_write(self, path):
        if "step_00000004.tmp-" in path and "rank_00001" in path:
            time.sleep(8)
        with super().open_write(path) as f:
            yield f


if fault == "block" and os.environ["RANK"] == "1":
    storage.LocalStorage = BlockingStorage  # what the session's manager writes through (storage_for)
blob = {"x": torch.zeros(4)}


class Grow(elastictrain.Hooks):
    def on_step_end(self, *, step, loss, throughput):
        if fault == "full":
            blob["x"] = torch.zeros(3 << 18) if step == 4 else torch.zeros(4)  # 3 MB at step 4 only
        if fault == "block" and step == 5:
            time.sleep(3)  # the blocked save is still in flight (and stalled) when step 6's falls due


model = torch.nn.Linear(4, 1)
data = TensorDataset(torch.randn(160, 4), torch.randn(160, 1))
with elastictrain.Session(model, torch.optim.SGD(model.parameters(), lr=0.1), data, global_batch_size=8,
                          checkpoint_dir=directory, checkpoint_every=2, keep_last=20, async_save=True,
                          checkpoint_timeout=30, extra_state={"blob": blob}, hooks=[Grow()], log_every=None,
                          max_steps=14) as session:
    for step in session.steps():
        for micro in step:
            x, y = micro.batch
            micro.backward(torch.nn.functional.mse_loss(session.model(x), y))
print("trained to step", session.step)
"""


def _run(tmp_path: Path, directory: Path, fault: str) -> str:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    result = subprocess.run(
        [sys.executable, "-m", "elastictrain", "run", "--local-nodes", "2", "--min-nodes", "2", "--no-progress",
         str(script), str(directory), fault], capture_output=True, text=True, timeout=150, env=subprocess_env(),
        cwd=tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert output.count("trained to step 14") == 2, output
    return output


def _steps(directory: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in directory.iterdir() if p.name.startswith("step_") and ".tmp" not in p.name)


def test_a_full_disk_during_an_async_save_of_a_two_node_job_is_said_once_and_training_goes_on(tmp_path: Path) -> None:
    with small_disk(tmp_path / "disk", "2m") as disk:
        output = _run(tmp_path, disk / "ckpt", "full")
        # Said once (the run summary at the end quotes it again, at INFO).
        lines = [line for line in output.splitlines()
                 if "checkpoint of step 4 was not committed" in line and " WARNING " in line]
        assert len(lines) == 1 and "No space left on device" in lines[0], output
        assert "training continues, the next save is at step 6" in lines[0]
        assert _steps(disk / "ckpt") == [2, 6, 8, 10, 12, 14]


def test_a_rank_whose_checkpoint_write_blocks_holds_up_no_step_and_no_rank(tmp_path: Path) -> None:
    output = _run(tmp_path, tmp_path / "ckpt", "block")
    skipped = [line for line in output.splitlines() if "checkpoint of step 6 skipped" in line]
    assert len(skipped) == 1 and "no answer from the storage" in skipped[0], output
    assert "Traceback" not in output
    steps = _steps(tmp_path / "ckpt")
    assert 2 in steps and 6 not in steps and 14 in steps, (steps, output)
