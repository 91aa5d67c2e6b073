"""The summary that ends a run (issue 43): what the job recovered from, said at the end."""

from __future__ import annotations

import json
import re
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


INPROCESS_JOB = str(REPO_ROOT / "tests" / "scripts" / "inprocess_job.py")


@pytest.mark.timeout(120)
def test_every_node_states_a_peers_failure_by_rank_name_and_node_rank_and_the_summary_too(tmp_path: Path) -> None:
    """Issue 43: the survivors said 'membership change (1 node(s) waiting, gone or re-joining)'; now
    the node whose worker failed says what failed in its request for a round, the other node's agent
    and rank 0 state it, and the summary's recovery line names it with 0 steps redone."""
    env = subprocess_env(OMP_NUM_THREADS="1", ELASTICTRAIN_INJECT="fail@1:6", ELASTICTRAIN_INJECT_STATE=str(tmp_path))
    result = run_reporting_hangs(
        [sys.executable, "-m", "elastictrain", "run", "--local-nodes", "2", INPROCESS_JOB, str(tmp_path / "out"),
         "--steps", "12", "--step-sleep", "0.05"], timeout=90, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    failed = re.search(r"summary: .*\n.*  rank 1 on (node\d) \(node rank (\d)\) failed: InjectedFault", result.stderr)
    assert failed is not None, result.stderr[-3000:]
    name, node_rank = failed[1], int(failed[2])
    other = "node0" if name == "node1" else "node1"
    said = f"rank 1 on {name} (node rank {node_rank}) failed: InjectedFault: injected failure (fail@1:6)"
    assert re.search(rf"^\[elastictrain {other}\] .* generation \d+ ready in \S+ \((.*: )?{re.escape(said)}",
                     result.stderr, re.M), result.stderr[-4000:]
    log = tmp_path / "elastictrain-runs" / "local" / "events.jsonl"
    recoveries = [e for e in map(json.loads, log.read_text().splitlines()) if e["kind"] == "recovery" and "step" in e]
    assert [(e["fault"]["rank"], e["fault"]["node"], e["fault"]["node_rank"], e["steps_redone"])
            for e in recoveries] == [(1, name, node_rank, 0)], recoveries
    assert re.search(rf"  recovered in place in \S+ after step 5 \(world size 2 -> 2\), 0 step\(s\) redone: "
                     rf"{re.escape(said)}", result.stderr), result.stderr[-3000:]
