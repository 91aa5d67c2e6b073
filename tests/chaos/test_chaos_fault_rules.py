"""When the harness counts a fault as recovered from, on hand-made progress of the job.

No processes here: the fault classes judge from the job's evidence (the process groups it
formed and the steps each applied) and from the times the harness recorded; these pin down
which group and which step count for each kind, the rules that the chaos runs rely on.
"""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from elastictrain.chaos import ChaosConfig
from elastictrain.chaos.faults import Fault, fault_for
from elastictrain.chaos.harness import _Progress
from elastictrain.chaos.schedule import FaultKind, FaultRecord
from tests.conftest import REPO_ROOT


def _fault(kind: FaultKind, *, groups: list[tuple[str, float]], steps: list[tuple[str, float]],
           settled: bool = True, **record: Any) -> Fault:
    """A fault of ``kind`` whose job formed ``groups`` (name, when) and applied ``steps`` (group, when)."""
    progress = _Progress(Path("/nonexistent"))
    progress.segments = [{"seg": seg, "t": t} for seg, t in groups]
    progress.steps = [{"seg": seg, "t": t, "step": number} for number, (seg, t) in enumerate(steps, 1)]
    config = ChaosConfig(script=str(REPO_ROOT / "tests" / "scripts" / "chaos_job.py"), run_dir="/nonexistent",
                         join_timeout=40)
    run = SimpleNamespace(progress=progress, config=config, node_settled=lambda name: settled)
    record.setdefault("expects_restart", kind.restarts_workers)
    return fault_for(FaultRecord(0, kind, 4, **record), run)  # type: ignore[arg-type]


def test_a_killed_worker_counts_as_recovered_at_the_first_step_of_a_group_formed_after_it() -> None:
    before = [("a", 90.0)], [("a", 95.0)]
    fault = _fault(FaultKind.KILL_WORKER, groups=before[0], steps=before[1], injected=100.0, ended=100.0)
    assert not fault.recovered()  # group a's steps are older than the kill
    fault = _fault(FaultKind.KILL_WORKER, groups=[*before[0], ("b", 100.4)], steps=[*before[1], ("b", 100.6)],
                   injected=100.0, ended=100.0)
    assert fault.recovered() and fault.record.recovered == 100.6 and fault.record.restarted


def test_a_bounce_recovers_with_the_group_formed_after_its_replacement_started_unless_a_spare_took_over() -> None:
    # The survivors re-formed at 101 (before the replacement, started at 103) and trained; the
    # group with the replacement formed at 104.
    groups, steps = [("a", 90.0), ("b", 101.0), ("c", 104.0)], [("a", 95.0), ("b", 101.5), ("c", 104.5)]
    fault = _fault(FaultKind.BOUNCE_NODE, groups=groups, steps=steps, injected=100.0, ended=103.0)
    assert fault.recovered() and fault.record.recovered == 104.5
    # With a spare waiting, the spare completed group b: that is the recovery.
    fault = _fault(FaultKind.BOUNCE_NODE, groups=groups, steps=steps, injected=100.0, ended=103.0,
                   spare_waiting=True)
    assert fault.recovered() and fault.record.recovered == 101.5
    # Until the replacement has started, the bounce has not ended.
    assert not _fault(FaultKind.BOUNCE_NODE, groups=groups, steps=steps, injected=100.0).recovered()


def test_a_node_killed_below_min_nodes_never_recovers_and_its_bound_adds_the_join_timeout() -> None:
    groups, steps = [("a", 90.0), ("b", 101.0)], [("a", 95.0), ("b", 101.5)]
    lost = _fault(FaultKind.KILL_NODE, groups=groups, steps=steps, injected=100.0, ended=100.0, below_min=True)
    assert not lost.recovered() and not lost.recovered(final=True)
    kept = _fault(FaultKind.KILL_NODE, groups=groups, steps=steps, injected=100.0, ended=100.0)
    assert lost.bound() == kept.bound() + 40.0


def test_a_node_that_joins_as_a_spare_settles_first_then_counts_the_next_step_without_a_new_group() -> None:
    groups, steps = [("a", 90.0)], [("a", 95.0), ("a", 100.5)]
    waiting = _fault(FaultKind.JOIN, groups=groups, steps=steps, settled=False, injected=100.0, ended=100.0,
                     expects_restart=False, awaits_spare="node3")
    assert not waiting.recovered()  # the node has not said it waits as a spare yet
    assert waiting.recovered(final=True)  # the run is over: judged with what there is
    said = _fault(FaultKind.JOIN, groups=groups, steps=steps, injected=100.0, ended=100.0, expects_restart=False,
                  awaits_spare="node3")
    assert said.recovered() and said.record.recovered == 100.5 and not said.record.restarted


def test_an_etcd_outage_is_judged_once_a_lapse_would_have_been_and_a_group_it_caused_must_train() -> None:
    now = time.time()
    # etcd came back just now: too early to tell whether heartbeats lapsed.
    fresh = _fault(FaultKind.KILL_ETCD, groups=[("a", now - 60)], steps=[("a", now - 59.5)], injected=now - 3,
                   ended=now)
    assert not fresh.recovered()
    # Long ago, nothing re-formed: training went on in its group.
    calm = _fault(FaultKind.KILL_ETCD, groups=[("a", now - 60)], steps=[("a", now - 59.5), ("a", now - 28.0)],
                  injected=now - 30, ended=now - 27)
    assert calm.recovered() and calm.record.recovered == now - 28.0 and not calm.record.restarted
    # A group formed within the settling window, and has not trained yet: not recovered.
    groups = [("a", now - 60), ("b", now - 20)]
    lapsed = _fault(FaultKind.KILL_ETCD_LEADER, groups=groups, steps=[("a", now - 59.5), ("a", now - 28.0)],
                    injected=now - 30, ended=now - 27)
    assert not lapsed.recovered()
    trained = _fault(FaultKind.KILL_ETCD_LEADER, groups=groups,
                     steps=[("a", now - 59.5), ("a", now - 28.0), ("b", now - 19.0)], injected=now - 30,
                     ended=now - 27)
    assert trained.recovered() and trained.record.recovered == now - 19.0 and trained.record.restarted
