"""The run summary from a run's events (issue 43)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from elastictrain.launch.run_summary import read_events, summarize

pytestmark = pytest.mark.timeout(10)

_RAISED = {"exitcode": 1, "pid": 9, "signal": None, "error": "ValueError: bad", "location": "train.py:3",
           "traceback": "Traceback (most recent call last):\n  ...\nValueError: bad", "consequential": False}
_BROKEN = {**_RAISED, "error": "RuntimeError: Connection closed by peer", "consequential": True}


def test_a_run_without_faults_is_one_line() -> None:
    lines, traceback = summarize([{"kind": "session_end", "step": 300}], seconds=12.34, finished=True)
    assert lines == ["summary: 300 steps in 12.3s; no fault"] and traceback == ""


def test_faults_are_listed_own_failures_only_and_the_first_traceback_once() -> None:
    events = [
        {"kind": "worker_failure", "node": "node1", "failures": {"1": _RAISED}},
        {"kind": "worker_failure", "node": "node0", "failures": {"0": _BROKEN}},  # a consequence: not listed
        {"kind": "worker_failure", "node": "node2", "failures": {"2": {**_RAISED, "signal": "SIGKILL"}}},
        {"kind": "recovery", "step": 49, "seconds": 0.5, "old_world_size": 3, "world_size": 3,
         "cause": "a collective failed in step 50 ([/x/pair.cc:1] Read error)"},
        {"kind": "checkpoint_abandoned", "step": 40, "reason": "a peer died", "next_step": 60},
        {"kind": "session_end", "step": 300},
    ]
    lines, traceback = summarize(events, seconds=60, finished=True)
    assert lines[0] == ("summary: 300 steps in 60.0s; 1 recovery(ies) in place, 2 worker failure(s), "
                        "1 checkpoint(s) abandoned")
    assert lines[1:] == [
        "  rank 1 on node1 failed: ValueError: bad (train.py:3)",
        "  rank 2 on node2 was killed by SIGKILL",
        "  recovered in 0.50s after step 49 (world size 3 -> 3): a collective failed in step 50 (Read error)",
        "  checkpoint of step 40 abandoned (a peer died); the next was due at step 60",
        "  the first exception recovered from, rank 1 on node1 (its traceback, once):",
    ]
    assert traceback == _RAISED["traceback"]
    # A job that failed: its report names the failures and gives the root cause's traceback.
    failed_lines, failed_traceback = summarize(events, seconds=60, finished=False)
    assert failed_traceback == "" and not [line for line in failed_lines if " failed: " in line]


def test_only_events_since_the_job_started_are_read(tmp_path: Path) -> None:
    log = tmp_path / "events.jsonl"
    log.write_text("\n".join([json.dumps({"ts": 5, "kind": "old"}), "{cut short", json.dumps({"ts": 10, "kind": "new"})]))
    assert [e["kind"] for e in read_events(str(log), since=10)] == ["new"]
    assert read_events(str(tmp_path / "missing.jsonl"), since=0) == []
