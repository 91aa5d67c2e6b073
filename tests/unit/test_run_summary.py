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
        {"kind": "worker_failure", "node": "node1", "node_rank": 0, "failures": {"1": _RAISED}},
        {"kind": "worker_failure", "node": "node0", "failures": {"0": _BROKEN}},  # a consequence: not listed
        {"kind": "worker_failure", "node": "node2", "node_rank": 2,
         "failures": {"2": {**_RAISED, "signal": "SIGKILL"}}},
        {"kind": "recovery", "step": 49, "seconds": 0.5, "old_world_size": 3, "world_size": 3,
         "cause": "a collective failed in step 50 ([/x/pair.cc:1] Read error)"},
        {"kind": "checkpoint_abandoned", "step": 40, "reason": "a peer died", "next_step": 60},
        {"kind": "session_end", "step": 300},
    ]
    lines, traceback = summarize(events, seconds=60, finished=True)
    assert lines[0] == ("summary: 300 steps in 60.0s; 1 recovery(ies) in place, 2 worker failure(s), "
                        "1 checkpoint(s) abandoned")
    assert lines[1:] == [
        "  rank 1 on node1 (node rank 0) failed: ValueError: bad (train.py:3)",
        "  rank 2 on node2 (node rank 2) was killed by SIGKILL",
        # No fault in the recovery event: the last one seen before it is its cause.
        "  recovered in place in 0.50s after step 49 (world size 3 -> 3), 0 step(s) redone: rank 2 on node2 "
        "(node rank 2) was killed by SIGKILL; a collective failed in step 50 (Read error)",
        "  checkpoint of step 40 abandoned (a peer died); the next was due at step 60",
        "  the first exception recovered from, rank 1 on node1 (node rank 0) (its traceback, once):",
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


def test_a_recovery_names_the_fault_its_event_carries_by_rank_name_and_node_rank() -> None:
    """The fault as the node that saw it said it (carried to rank 0 with the generation), not the
    membership change the survivors saw."""
    fault = {"rank": 3, "node": "node2", "node_rank": 1, "how": "was killed by SIGKILL"}
    events = [{"kind": "recovery", "step": 7, "seconds": 0.25, "old_world_size": 4, "world_size": 4,
               "steps_redone": 0, "cause": "a collective failed in step 8", "fault": fault},
              {"kind": "session_end", "step": 20}]
    lines, _ = summarize(events, seconds=5, finished=True)
    assert lines == ["summary: 20 steps in 5.0s; 1 recovery(ies) in place",
                     "  recovered in place in 0.25s after step 7 (world size 4 -> 4), 0 step(s) redone: rank 3 on "
                     "node2 (node rank 1) was killed by SIGKILL; a collective failed in step 8"]


def test_a_restart_from_a_checkpoint_says_the_steps_trained_past_it_again_and_its_cause() -> None:
    events = [
        {"kind": "restore", "step": 0, "world_size": 2, "saved_world_size": 2},  # the job's start: no recovery
        {"kind": "session_failed", "rank": 1, "step": 14},
        {"kind": "worker_failure", "node": "node0", "node_rank": 1, "failures": {"1": _RAISED}},
        {"kind": "session_failed", "rank": 0, "step": 13},  # a rank a step behind: the newest step counts
        {"kind": "restore", "step": 10, "world_size": 2, "saved_world_size": 2},
        {"kind": "session_end", "step": 30},
    ]
    lines, _ = summarize(events, seconds=9, finished=True)
    assert lines[0] == "summary: 30 steps in 9.0s; 1 restart(s) from a checkpoint, 1 worker failure(s)"
    assert ("  restarted from the checkpoint of step 10 (world size 2 -> 2), 4 step(s) redone (trained past it up to "
            "step 14): rank 1 on node0 (node rank 1) failed: ValueError: bad (train.py:3)") in lines


def test_each_straggler_is_listed_once_with_its_worst_factor_and_steps() -> None:
    def straggler(kind: str, rank: int, step: int, factor: float, node: str = "node1") -> dict[str, object]:
        return {"kind": kind, "rank": rank, "node": node, "node_rank": 0, "step": step, "first_step": step - 9,
                "factor": factor}

    events = [straggler("straggler", 1, 20, 3.0), straggler("straggler", 1, 30, 4.5),
              straggler("straggler_recovered", 1, 40, 1.1), straggler("straggler", 2, 50, 2.0, node="node2"),
              {"kind": "session_end", "step": 60}]
    lines, _ = summarize(events, seconds=1, finished=True)
    assert lines == ["summary: 60 steps in 1.0s; 2 straggler(s)",
                     "  rank 1 on node1 (node rank 0) straggled: up to 4.5x its peers' compute time, from step 11 to "
                     "step 40",
                     "  rank 2 on node2 (node rank 0) straggled: up to 2.0x its peers' compute time, from step 41 to "
                     "the end of the run"]


def test_a_recovery_after_a_node_was_lost_names_the_node() -> None:
    """A node agent killed: no failure event names it, and the survivors' line said only that a
    collective failed; the agents' membership change names the node that left."""
    events = [
        {"kind": "membership_change", "node": "node0", "old_world_size": 3, "new_world_size": 2,
         "nodes_left": ["node2@127.0.0.1_23763_5528e6"]},
        {"kind": "membership_change", "node": "node1", "old_world_size": 3, "new_world_size": 2,
         "nodes_left": ["node2@127.0.0.1_23763_5528e6"]},
        {"kind": "recovery", "step": 165, "seconds": 1.05, "old_world_size": 3, "world_size": 2,
         "cause": "a collective failed in step 166 (RuntimeError: Connection closed by peer)"},
        {"kind": "session_end", "step": 300},
    ]
    lines, _ = summarize(events, seconds=40, finished=True)
    assert lines[1] == ("  recovered in place in 1.05s after step 165 (world size 3 -> 2), 0 step(s) redone: "
                        "node2 left the job; a collective failed in step 166 (RuntimeError: Connection closed by peer)")
