"""What ``elastictrain run`` shows on the terminal (issue 43): the job's lines, not torch's noise."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT, run_reporting_hangs, subprocess_env

NOISE_JOB = str(REPO_ROOT / "tests" / "scripts" / "noise_job.py")


def _run(cwd: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    # Not this process's: a test that ran `elastictrain run` in it (cli.main) set TORCH_CPP_LOG_LEVEL.
    env = {k: v for k, v in subprocess_env(OMP_NUM_THREADS="1").items()
           if k not in ("TORCH_CPP_LOG_LEVEL", "ELASTICTRAIN_VERBOSE")}
    return run_reporting_hangs([sys.executable, "-m", "elastictrain", "run", *flags, "--nproc-per-node", "2",
                                "--recovery", "restart", "--max-restarts", "0", NOISE_JOB, str(cwd / "ckpt")],
                               timeout=90, env=env, cwd=cwd)


@pytest.mark.timeout(120)
def test_torchs_warnings_stay_off_the_terminal_and_worker_lines_are_short(tmp_path: Path) -> None:
    result = _run(tmp_path)
    assert result.returncode == 3, result.stderr[-3000:]
    # torch's C++ warnings: not shown (TORCH_CPP_LOG_LEVEL=ERROR in every worker).
    assert not re.search(r"^\S*\[W\d{4} .*\[c10d\]", result.stderr, re.M), result.stderr
    # torch's own WARNING as its agent stops rank 0: in the node's log file, not on the terminal.
    assert "via signal SIGTERM" not in result.stderr
    node_log = tmp_path / "elastictrain-runs" / "local" / f"{socket.gethostname()}.log"
    assert "via signal SIGTERM" in node_log.read_text()
    assert f"this node's log (torch's own lines too; -v shows them here): {node_log}" in result.stderr
    # The session's lines: [node rank] time message; the run id once, in its first line.
    started = next(line for line in result.stderr.splitlines() if "session started" in line)
    assert re.match(r"\[\S+ 0\] \d\d:\d\d:\d\d session started: run 'local', world size 2, ", started), started
    assert "[run=" not in result.stderr


@pytest.mark.timeout(120)
def test_verbose_shows_torchs_warnings_and_the_long_prefix(tmp_path: Path) -> None:
    result = _run(tmp_path, "-v")
    assert result.returncode == 3, result.stderr[-3000:]
    assert re.search(r"^\S*\[W\d{4} .*\[c10d\]", result.stderr, re.M), result.stderr
    assert "via signal SIGTERM" in result.stderr
    assert "[run=local node=0 rank=0/2 restart=0] session started" in result.stderr
