"""The examples run under ``elastictrain run`` as their docstrings say."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT, run_reporting_hangs, subprocess_env

pytestmark = pytest.mark.timeout(150)


EXAMPLES = REPO_ROOT / "examples"


def elastictrain_run(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    # cwd: the launcher writes its event log under the working directory.
    return run_reporting_hangs([sys.executable, "-m", "elastictrain", "run", *args], timeout=120,
                               env=subprocess_env(OMP_NUM_THREADS="1"), cwd=cwd)


def test_the_readme_mlp_job_trains_on_two_local_nodes_and_cleans_up(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    result = elastictrain_run(tmp_path, "--local-nodes", "2", "--min-nodes", "2", str(EXAMPLES / "mlp.py"),
                              "--checkpoint-dir", str(ckpt))
    assert result.returncode == 0, result.stderr[-3000:]
    # The launcher starts each worker line with [node0 0]: the job's own lines are brief.
    done = r"\[node\d 0\] \d\d:\d\d:\d\d done: 40 steps at world size 2"
    assert re.search(done, result.stderr), result.stderr[-3000:]
    assert "[run=" not in result.stderr
    assert not ckpt.exists()


def test_the_transformer_example_trains_with_accumulation_on_two_workers(tmp_path: Path) -> None:
    result = elastictrain_run(tmp_path, "--nproc-per-node", "2", str(EXAMPLES / "transformer_lm.py"), "--steps", "4",
                              "--checkpoint-every", "2", "--checkpoint-dir", str(tmp_path / "ckpt"),
                              "--keep-checkpoints")
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.search(r"\[\S+ 0\] \d\d:\d\d:\d\d trained to step 4", result.stderr), result.stderr[-3000:]
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir() if not p.name.startswith(".")) == ["step_00000002",
                                                                                           "step_00000004"]


def test_the_transformer_example_trains_fsdp_sharded_on_two_workers(tmp_path: Path) -> None:
    result = elastictrain_run(tmp_path, "--nproc-per-node", "2", "--recovery", "restart",
                              str(EXAMPLES / "transformer_lm.py"), "--sharding", "fsdp", "--steps", "2",
                              "--checkpoint-every", "2", "--checkpoint-dir", str(tmp_path / "ckpt"),
                              "--keep-checkpoints")
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.search(r"\[\S+ 0\] \d\d:\d\d:\d\d trained to step 2", result.stderr), result.stderr[-3000:]
    # Sampled from the full weights rank 0 gathered (a forward of the sharded model alone would hang).
    assert re.search(r"\[\S+ 0\] \d\d:\d\d:\d\d sample: '17\+25=", result.stderr), result.stderr[-3000:]
    # Each rank wrote its own shards.
    saved = {p.name for p in (tmp_path / "ckpt" / "step_00000002").iterdir()}
    assert {"shards_00000.bin", "shards_00001.bin"} <= saved, saved
