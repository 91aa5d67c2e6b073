"""The summary that ends a run (issue 43): what the job recovered from, said at the end."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT, run_reporting_hangs, subprocess_env

SESSION_JOB = str(REPO_ROOT / "tests" / "scripts" / "session_job.py")


@pytest.mark.timeout(120)
def test_a_recovered_user_exception_is_named_in_the_summary_with_its_traceback_once(tmp_path: Path) -> None:
    """Rank 1 raised once and was recovered in place: the run ended 'finished', exit 0, and the
    only trace was one line in the middle of the log, without a traceback."""
    result = run_reporting_hangs(
        [sys.executable, "-m", "elastictrain", "run", "--nproc-per-node", "2", SESSION_JOB, str(tmp_path / "out"),
         "--epochs", "1", "--fail", "1:5"],
        timeout=90, env=subprocess_env(OMP_NUM_THREADS="1"), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stderr.splitlines()
    start = next(i for i, line in enumerate(lines) if "INFO summary: " in line)
    summary = "\n".join(lines[start:])
    assert "summary: 12 steps in " in lines[start] and "1 recovery(ies) in place, 1 worker failure(s)" in lines[start]
    assert "rank 1 on " in summary and "failed: RuntimeError: injected failure on rank 1 before step 5 " \
        "(session_job.py:" in summary, summary
    assert "recovered in " in summary and "a collective failed in step 5" in summary, summary
    assert "the first exception recovered from, rank 1 on " in summary
    assert summary.count("Traceback (most recent call last)") == 1 == result.stderr.count("Traceback (most recent")
    assert 'raise RuntimeError(f"injected failure' in summary
    assert "run 'local' finished" in lines[-1]  # the job's outcome stays the last line
