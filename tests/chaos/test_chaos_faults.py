"""The fast chaos set: real node agents, real etcd, a few faults each, every invariant asserted.

Each test is one chaos run of tests/scripts/chaos_job.py (a tiny MLP, 2 epochs
of 192 samples at a global batch of 16, a checkpoint every 2 steps). Times vary
a lot on a loaded 2-core machine, so nothing here asserts a duration: the
recovery times are printed (run with ``-s`` to see them) and the harness's own
hang bound is generous (see docs/chaos.md).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from pathlib import Path

import pytest

from elastictrain.chaos import ChaosConfig, ChaosResult, parse_schedule, run_chaos
from elastictrain.chaos.config import demo_sharding_args
from tests.conftest import REPO_ROOT
from tests.support.netns import netns_works

JOB = str(REPO_ROOT / "tests" / "scripts" / "chaos_job.py")
JOB_ARGS = ("--ckpt", "{run_dir}/ckpt", "--samples", "192", "--epochs", "2", "--ckpt-every", "2")
TOTAL_STEPS = 24

EVERY_INVARIANT = ("exit_status", "committed_history", "exactly_once", "final_parameters", "restores_committed",
                   "checkpoints_intact", "world_size_bounds", "no_hang", "no_ghost_workers", "survivors_kept")


def _show(result: ChaosResult) -> None:
    report = result.report
    print(f"\nchaos run in {report['duration_s']}s, {report['steps_redone']} step(s) redone")
    for fault in report["faults"]:
        print(f"  {fault['kind']:17} at step {fault['step_before']}: {fault['target']}; "
              f"recovery {fault['recovery_s']}s, "
              f"restarted {fault['restarted']}, redone {fault.get('steps_redone')}")
    for name, outcome in report["invariants"].items():
        print(f"  {name}: {outcome['ok']} - {outcome['detail']}")


def _assert_holds(result: ChaosResult, *names: str) -> None:
    invariants = result.report["invariants"]
    failed = {n: invariants[n] for n in names if invariants[n]["ok"] is not True}
    assert not failed, json.dumps(failed, indent=1) + f"\nrun dir: {result.run_dir}"


@pytest.mark.timeout(600)
def test_training_survives_etcd_restart_worker_kill_node_bounce_below_min_and_join(tmp_path: Path) -> None:
    # 2 nodes, min 2: the bounce leaves one survivor below min-nodes, which waits
    # for the replacement and resumes; then a third node joins.
    schedule = "kill_etcd@2,kill_worker@4,bounce_node@8,join@12"
    result = run_chaos(ChaosConfig(
        script=JOB, script_args=JOB_ARGS, run_dir=str(tmp_path / "run"), nodes=2, min_nodes=2, max_nodes=3,
        schedule=tuple(parse_schedule(schedule)), seed=1, join_timeout=120,
    ))
    _show(result)
    report = result.report
    assert [f["kind"] for f in report["faults"] if f["injected_s"] is not None] == [
        "kill_etcd", "kill_worker", "bounce_node", "join"]
    _assert_holds(result, *EVERY_INVARIANT)
    assert report["completed"] and report["committed_steps"] == TOTAL_STEPS
    assert report["final_world_size"] == 3
    # Every fault that restarts workers was followed by training in a new group.
    for fault in report["faults"]:
        if fault["kind"] != "kill_etcd":
            assert fault["restarted"] and fault["recovery_s"] is not None, fault
    if importlib.util.find_spec("matplotlib") is None:
        assert report["plot"].startswith("skipped: matplotlib not importable")
    else:
        assert Path(report["plot"]).is_file()


# In the soak set: about 50 s (half of it the survivor's 25 s join timeout, which the first
# rendezvous needs on a loaded machine), over CI's 10 minutes; `pytest -m soak -k gives_up tests/chaos`.
@pytest.mark.soak
@pytest.mark.timeout(600)
def test_etcd_leader_loss_and_a_hang_are_survived_then_below_min_nodes_the_job_gives_up_intact(
    tmp_path: Path,
) -> None:
    # A 3-member etcd loses its leader (training goes on); a worker hangs past
    # the collective timeout (SIGSTOP for 15 s, then SIGCONT) and the group is
    # re-formed without it; then a node dies for good: its peer waits --join-timeout for
    # it, then exits non-zero saying why. (The join timeout also bounds the first
    # rendezvous: 15 s was seen to expire there on a machine at load 23.)
    schedule = "kill_etcd_leader@2,hang_worker@4,kill_node@8"
    result = run_chaos(ChaosConfig(
        script=JOB, script_args=JOB_ARGS, run_dir=str(tmp_path / "run"), nodes=2, min_nodes=2, max_nodes=2,
        etcd_members=3, schedule=tuple(parse_schedule(schedule)), seed=2, join_timeout=25, pg_timeout=10,
    ))
    _show(result)
    report = result.report
    assert [f["kind"] for f in report["faults"] if f["injected_s"] is not None] == [
        "kill_etcd_leader", "hang_worker", "kill_node"]
    hang = report["faults"][1]
    assert hang["restarted"] and hang["recovery_s"] is not None, hang
    # Its agent killed the stopped worker: the hang was over then, and the next fault came
    # without waiting out the rest of its 15 s.
    assert hang["note"] == "killed while stopped, before it was to be resumed", hang
    assert hang["ended_s"] - hang["injected_s"] < 15, hang
    assert not report["completed"]
    survivors = {n: c for n, c in report["node_exit_codes"].items() if n not in report["nodes_killed_by_faults"]}
    assert len(survivors) == 1 and all(code not in (0, None) for code in survivors.values()), survivors
    # exit_status holds because the harness expected this failure and found the reason in the log.
    _assert_holds(result, "exit_status", "committed_history", "exactly_once", "restores_committed",
                  "checkpoints_intact", "world_size_bounds", "no_ghost_workers", "survivors_kept")
    assert report["invariants"]["final_parameters"]["ok"] is None  # the job did not finish
    log = (result.run_dir / "nodes" / f"{next(iter(survivors))}.log").read_text()
    assert "timed out after 25s waiting for 2 node(s)" in log, log[-2000:]
    assert "last committed checkpoint is untouched, and the run is now closed" in log
    assert "--purge" in log
    assert report["committed_steps"] >= 8


# Soak, for CI's time (about 46 s): the default suite's tests/integration/test_hangs.py replaces a rank
# blocked in a call and one spinning inside a step (peers keep their processes) and names a straggler.
@pytest.mark.soak
@pytest.mark.timeout(600)
def test_ranks_blocked_in_a_call_or_spinning_inside_a_step_are_replaced_and_a_straggler_is_named(
        tmp_path: Path) -> None:
    # The hangs of real clusters, placed inside the workers' training loop (their processes keep
    # running): each is found by its progress and its worker replaced, the peers keep theirs; a
    # straggler (0.5 s slower for 25 steps) is named and nothing is replaced for it.
    schedule = "hang_sleep@3,hang_spin@8,straggler@12"
    result = run_chaos(ChaosConfig(
        script=JOB, script_args=("--ckpt", "{run_dir}/ckpt", "--samples", "192", "--epochs", "4", "--ckpt-every",
                                 "4"),
        run_dir=str(tmp_path / "run"), nodes=2, min_nodes=2, max_nodes=2, schedule=tuple(parse_schedule(schedule)),
        seed=3,
    ))
    _show(result)
    report = result.report
    assert [f["kind"] for f in report["faults"] if f["injected_s"] is not None] == [
        "hang_sleep", "hang_spin", "straggler"]
    _assert_holds(result, *EVERY_INVARIANT)
    assert report["completed"]
    hangs, straggler = report["faults"][:2], report["faults"][2]
    for hang in hangs:
        assert hang["restarted"] and hang["recovery_s"] is not None, hang
    assert straggler["note"].startswith("named: rank"), straggler
    events = [json.loads(line) for line in (result.run_dir / "events.jsonl").read_text().splitlines()]
    found = [e for e in events if e["kind"] == "hang"]
    assert [e["pid"] for e in found] == [pid for hang in hangs for pid in hang["target_pids"]], found
    assert all(any("in at_step" in frame for frame in e["stack"]) for e in found), found


# Soak, for CI's time (about 18 s): in the default suite, tests/integration/test_checkpoint_crash.py
# kills saves at every stage and tests/unit/test_session_storage_faults.py fills a real disk mid-save.
@pytest.mark.soak
@pytest.mark.timeout(600)
def test_a_kill_inside_a_checkpoint_save_and_a_full_disk_lose_nothing(tmp_path: Path) -> None:
    # A worker killed the moment its slot says it saves (4 MB of state: the save takes a while),
    # then the checkpoint filesystem (a 256 MB tmpfs of the run's own) filled for 5 s: training
    # goes on, the saves meanwhile are reported abandoned, one after the space is back commits,
    # and every committed checkpoint verifies.
    if os.geteuid() != 0:
        pytest.skip("disk_full mounts a tmpfs for the checkpoints: needs root")
    result = run_chaos(ChaosConfig(
        script=JOB, script_args=(*JOB_ARGS, "--ballast-mb", "4"), run_dir=str(tmp_path / "run"), nodes=2,
        min_nodes=2, max_nodes=2, schedule=tuple(parse_schedule("kill_in_save@4,disk_full@10")), seed=4,
        checkpoint_disk_mb=256,
    ))
    _show(result)
    report = result.report
    assert [f["kind"] for f in report["faults"] if f["injected_s"] is not None] == ["kill_in_save", "disk_full"]
    _assert_holds(result, *EVERY_INVARIANT)
    assert report["completed"] and report["committed_steps"] == TOTAL_STEPS
    kill, full = report["faults"]
    assert kill["note"] == "killed inside a checkpoint save" and kill["restarted"], kill
    assert full["note"].startswith("save of step") and "committed after the space came back" in full["note"], full
    assert full["restarted"] is False, full


@pytest.mark.timeout(600)
def test_hot_spares_take_the_place_of_lost_nodes_and_never_the_seat_of_a_healthy_one(tmp_path: Path) -> None:
    # 3 nodes of a job of at most 2: one waits as a hot spare. A worker kill must not hand the
    # spare a healthy node's seat (probe, stop 29: the job went back to its checkpoint); a lost
    # node is replaced at the same world size; a node that joins the full round, and a bounced
    # node's replacement, wait as the next spares; every spare exits 0 when the job ends.
    schedule = "kill_worker@4,kill_node@8,join@12,bounce_node@16"
    result = run_chaos(ChaosConfig(
        script=JOB, script_args=JOB_ARGS, run_dir=str(tmp_path / "run"), nodes=3, min_nodes=2, max_nodes=2,
        schedule=tuple(parse_schedule(schedule)), seed=3,
    ))
    _show(result)
    report = result.report
    faults = [f for f in report["faults"] if f["injected_s"] is not None]
    assert [f["kind"] for f in faults] == ["kill_worker", "kill_node", "join", "bounce_node"]
    assert [f["spare_waiting"] for f in faults] == [True, True, False, True]
    assert "waits as a hot spare" in faults[2]["target"] and not faults[2]["restarted"]
    _assert_holds(result, *EVERY_INVARIANT, "spares_fill_in")
    assert report["completed"] and report["committed_steps"] == TOTAL_STEPS
    assert report["final_world_size"] == 2 and report["steps_redone"] == 0


def _chaos_namespaces() -> set[str]:
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout
    return {line.split()[0] for line in listing.splitlines() if line.startswith("etch")}


# In the soak set: with its 20 s cut and the rejoin it takes about 45 s, which the
# default suite (CI) cannot spare; `pytest -m soak -k cut_off tests/chaos` runs it alone.
@pytest.mark.soak
@pytest.mark.timeout(300)
def test_a_node_cut_off_the_network_is_left_behind_then_rejoins_after_the_heal(tmp_path: Path) -> None:
    # 3 nodes (min 2), each in its own network namespace. node0..2 train; one is cut
    # off etcd and its peers for 20 s (the collective timeout is 10 s): the two
    # survivors' collectives time out and they re-form at world size 2; after the
    # heal the cut node finds the rendezvous moved on and rejoins (world size 3),
    # before a worker is killed for good measure.
    # Probed here, not in a skipif: that would make and delete a namespace at every collection.
    if not netns_works():
        pytest.skip("needs root and working `ip netns` (network namespaces)")
    namespaces_before = _chaos_namespaces()  # another run's, if one is going on
    result = run_chaos(ChaosConfig(
        script=JOB, script_args=JOB_ARGS, run_dir=str(tmp_path / "run"), nodes=3, min_nodes=2, max_nodes=3,
        schedule=tuple(parse_schedule("partition_node@4,kill_worker@12")), seed=1, netns=True, pg_timeout=10,
        partition=20, join_timeout=60,
    ))
    _show(result)
    report = result.report
    assert [f["kind"] for f in report["faults"] if f["injected_s"] is not None] == ["partition_node", "kill_worker"]
    _assert_holds(result, *EVERY_INVARIANT)
    assert report["completed"] and report["committed_steps"] == TOTAL_STEPS
    partition = report["faults"][0]
    assert partition["restarted"] and partition["recovery_s"] is not None, partition
    assert partition["note"].endswith("rejoined after the heal"), partition
    assert report["final_world_size"] == 3
    assert all(code == 0 for code in report["node_exit_codes"].values()), report["node_exit_codes"]
    # Nothing of the namespaces outlives the run.
    assert _chaos_namespaces() <= namespaces_before


@pytest.mark.soak
@pytest.mark.timeout(300)
def test_a_node_cut_off_its_peers_but_not_etcd_leaves_within_seconds_and_rejoins_after_the_heal(
        tmp_path: Path) -> None:
    # A gray failure: one of 3 nodes loses its link to its peers (its second interface), not to
    # etcd, for 20 s: its lease stays alive, its collectives and its peers' never complete. The
    # node that reaches fewer than half of its peers must leave the round within seconds (not
    # after the 30 s collective timeout, again at each re-formation that takes it back), the
    # others train on without it, and it rejoins after the heal.
    if not netns_works():
        pytest.skip("needs root and working `ip netns` (network namespaces)")
    namespaces_before = _chaos_namespaces()
    result = run_chaos(ChaosConfig(
        script=JOB, script_args=JOB_ARGS, run_dir=str(tmp_path / "run"), nodes=3, min_nodes=2, max_nodes=3,
        schedule=tuple(parse_schedule("link_cut@4,kill_worker@12")), seed=1, netns=True, pg_timeout=30,
        partition=20, join_timeout=60,
    ))
    _show(result)
    report = result.report
    assert [f["kind"] for f in report["faults"] if f["injected_s"] is not None] == ["link_cut", "kill_worker"]
    _assert_holds(result, *EVERY_INVARIANT)  # no_hang: trained again within the collective timeout
    cut = report["faults"][0]
    assert cut["restarted"] and cut["recovery_s"] is not None and cut["recovery_s"] < 30, cut
    assert cut["note"].endswith("rejoined after the heal"), cut
    assert report["completed"] and report["final_world_size"] == 3
    events = [json.loads(line) for line in (result.run_dir / "events.jsonl").read_text().splitlines()]
    assert [e["node"] for e in events if e["kind"] == "cut_off"] == [cut["target"]], events
    assert _chaos_namespaces() <= namespaces_before


# In the soak set (about 2.5 min each): the sharded soaks draw no fault that needs network namespaces.
@pytest.mark.soak
@pytest.mark.timeout(600)
@pytest.mark.parametrize(("sharding", "nproc_per_node"), [("fsdp", 1), ("hsdp", 2)], ids=["fsdp", "hsdp"])
def test_a_sharded_job_trains_on_in_place_through_a_link_cut_and_a_partition_well_within_the_timeout(
        tmp_path: Path, sharding: str, nproc_per_node: int) -> None:
    # A node loses its link to its peers (not etcd), then, once back, another is cut off the network
    # whole: no connection is closed, the survivors' collectives just never complete. They must train
    # on in their processes within seconds, not after the 30 s collective timeout. hsdp's survivors
    # waited out the timeout when a cut caught them in their gradient all-reduce across replicas (a
    # sub-group of its mesh whose connections were not shut down with the default group's): 2 of 4
    # cuts of a sharded soak, 21 s at a 20 s timeout; this run's two cuts passed without the fix
    # (where a cut lands in the step decides). The integration test of a node stopped whole,
    # test_survivors_of_a_node_gone_silent_..., meets it every time.
    if not netns_works():
        pytest.skip("needs root and working `ip netns` (network namespaces)")
    namespaces_before = _chaos_namespaces()
    result = run_chaos(ChaosConfig(
        script=JOB, script_args=(*JOB_ARGS, *demo_sharding_args(sharding, "in-process")),
        run_dir=str(tmp_path / "run"), nodes=3, min_nodes=2, max_nodes=3, sharding=sharding,
        nproc_per_node=nproc_per_node, schedule=tuple(parse_schedule("link_cut@4,partition_node@12")), seed=1,
        netns=True, pg_timeout=30, partition=20, join_timeout=60,
    ))
    _show(result)
    report = result.report
    assert [f["kind"] for f in report["faults"] if f["injected_s"] is not None] == ["link_cut", "partition_node"]
    _assert_holds(result, *EVERY_INVARIANT)
    for fault in report["faults"]:
        assert fault["restarted"] and fault["recovery_s"] is not None and fault["recovery_s"] < 30, fault
        assert fault["note"].endswith("rejoined after the heal"), fault
    assert report["completed"] and report["final_world_size"] == 3 * nproc_per_node
    assert _chaos_namespaces() <= namespaces_before


# In the soak set: it trains about 70 s (a 20 s cut, then past the spare's 15 s join timeout),
# which the default suite (CI, under 10 minutes) cannot spare; `pytest -m soak -k spare_waits tests/chaos`.
@pytest.mark.soak
@pytest.mark.timeout(300)
def test_a_node_cut_off_while_a_spare_waits_is_replaced_and_waits_as_the_spare_after_the_heal(
        tmp_path: Path) -> None:
    # 3 nodes of a job of 2, each in its own namespace: the spare takes the cut node's seat
    # once its lease expires; healed, the cut node finds the round full and waits as the next
    # spare, past the join timeout (15 s), until the job ends (it trains about 20 s more: 1 s a step).
    if not netns_works():
        pytest.skip("needs root and working `ip netns` (network namespaces)")
    result = run_chaos(ChaosConfig(
        script=JOB, script_args=(*JOB_ARGS, "--step-time", "1.0"), run_dir=str(tmp_path / "run"), nodes=3,
        min_nodes=2, max_nodes=2, schedule=tuple(parse_schedule("partition_node@4,kill_worker@12")), seed=1,
        netns=True, pg_timeout=10, partition=20, join_timeout=15,
    ))
    _show(result)
    report = result.report
    partition = report["faults"][0]
    assert partition["spare_waiting"] and partition["note"].endswith("waits as a spare after the heal"), partition
    _assert_holds(result, *EVERY_INVARIANT, "spares_fill_in")
    assert report["completed"] and report["final_world_size"] == 2
    assert all(code == 0 for code in report["node_exit_codes"].values()), report["node_exit_codes"]


@pytest.mark.timeout(120)
def test_a_job_that_fails_as_one_plain_process_ends_the_run_at_once(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Before, its nodes were replaced (a budget of 1000 failures) until the deadline."""
    from elastictrain.chaos import harness

    monkeypatch.setattr(harness, "_REFERENCE_GRACE_S", 3.0)  # 30 s in a real run
    script = tmp_path / "exits.py"
    script.write_text("import sys\nsys.exit(3)\n")
    config = ChaosConfig(script=str(script), run_dir=str(tmp_path / "run"), nodes=2, min_nodes=2, max_nodes=2,
                         deadline=90)
    result = run_chaos(config)
    assert not result.ok
    aborted = result.report["invariants"]["no_hang"]["detail"]
    assert "the reference run (the job as one plain process) exited 3, and the job trained no step in 3s" in aborted
    assert result.report["duration_s"] < 30, result.report["duration_s"]
