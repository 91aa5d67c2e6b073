"""Errors elastictrain diagnosed at start-up end the job on their first occurrence, in one line,
without a traceback and without spending restarts (issue 40, item 6).

Two local nodes whose checkpoint directories differ stand in for a node-local (unshared)
checkpoint directory; a read-only bind mount stands in for a read-only one.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import subprocess_env
from tests.support.read_only import read_only_dir

pytestmark = pytest.mark.timeout(120)

SCRIPT = """\
import os, sys, torch, elastictrain
from torch.utils.data import TensorDataset
model = torch.nn.Linear(4, 1)
data = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
directory = sys.argv[1].replace("NODE", os.environ["GROUP_RANK"])
with elastictrain.Session(model, torch.optim.SGD(model.parameters(), lr=0.1), data, global_batch_size=8,
                          checkpoint_dir=directory, checkpoint_every=2) as session:
    for step in session.steps():
        for micro in step:
            x, y = micro.batch
            micro.backward(torch.nn.functional.mse_loss(session.model(x), y))
"""


def _run(tmp_path: Path, directory: str, recovery: str, nodes: int) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    return subprocess.run(
        [sys.executable, "-m", "elastictrain", "run", "--local-nodes", str(nodes), "--min-nodes", str(nodes),
         "--recovery", recovery, "--max-restarts", "3", "--no-progress", str(script), directory],
        capture_output=True, text=True, timeout=100, env=subprocess_env(), cwd=tmp_path)


@pytest.mark.parametrize("recovery", ["in-process", "restart"])
def test_an_unshared_checkpoint_directory_fails_the_job_at_once_in_one_line_without_a_traceback(
        tmp_path: Path, recovery: str) -> None:
    result = _run(tmp_path, str(tmp_path / "ckpt-node-NODE"), recovery, nodes=2)
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    last = output.strip().splitlines()[-1]
    assert "not on a filesystem shared by all ranks" in last, output
    assert last.endswith("job failed after 0 restart(s)"), output
    assert "Traceback" not in output, output
    assert "CheckpointDirectoryError" in last


def test_a_read_only_checkpoint_directory_fails_the_job_at_once_in_one_line(tmp_path: Path) -> None:
    with read_only_dir(tmp_path / "ckpt") as directory:
        result = _run(tmp_path, str(directory), "in-process", nodes=1)
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    last = output.strip().splitlines()[-1]
    assert f"checkpoint directory {directory} is not writable" in last, output
    assert last.endswith("job failed after 0 restart(s)"), output
    assert "Traceback" not in output, output
