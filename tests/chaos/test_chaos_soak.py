"""Long chaos runs, not part of the default suite: ``pytest -m soak tests/chaos``.

- A soak: ``ELASTICTRAIN_SOAK_FAULTS`` random faults (default 50) of the kinds
  in ``ELASTICTRAIN_SOAK_KINDS`` (default: every kind but ``partition_node`` and ``link_cut``,
  which need root and run the nodes in network namespaces when named), drawn from
  ``ELASTICTRAIN_SOAK_SEED`` (default 1), against 3 nodes (min 2, max 3) and a
  3-member etcd. A failing seed replays the same fault sequence:
  ``elastictrain chaos --faults N --seed S --etcd-members 3``.
- A soak with the checkpoints in S3: ``ELASTICTRAIN_SOAK_S3_FAULTS`` random faults (default
  30) as above (``disk_full`` left out: it fills a local filesystem), the job checkpointing
  into a local S3 server (moto's standalone server, as the S3 integration tests start it);
  ``ELASTICTRAIN_SOAK_S3_RECOVERY=restart`` makes every fault restore from S3.
- Sharded soaks (``test_soak_of_random_faults_keeps_every_invariant_sharded[fsdp|hsdp]``): the demo
  job with ``--sharding fsdp`` (3 nodes of 1 worker) and ``hsdp`` (3 nodes of 2 workers),
  ``ELASTICTRAIN_SOAK_SHARDED_FAULTS`` random faults each (default 20) of every loopback kind,
  in process (fsdp with ``--redundancy-every 1``: ``ELASTICTRAIN_SOAK_REDUNDANCY_EVERY``, 0 for
  none); ``ELASTICTRAIN_SOAK_SHARDED_RECOVERY=restart`` runs them by restarts (``kill_in_save`` left out).
  Replay: ``elastictrain chaos --sharding hsdp --nproc-per-node 2 --faults N --seed S --etcd-members 3``.
- A soak with hot spares: ``ELASTICTRAIN_SOAK_SPARE_FAULTS`` random faults (default 20)
  against 3 nodes of a job of 2 nodes (the third waits as a spare).
- The planted bugs of tests/scripts/chaos_job.py: each must make the
  invariants fail after a single worker kill (and the same run without the bug
  passes: that is the fast set), and a hang detector that never fires must make a
  run with a rank blocked in a call fail.
- A node joins after an etcd outage longer than the heartbeat window (a fixed
  bug, found by the soak).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from elastictrain.chaos import ChaosConfig, FaultKind, parse_schedule, run_chaos
from elastictrain.chaos.config import default_recovery, demo_sharding_args, kinds_for
from elastictrain.chaos.schedule import parse_kinds
from tests.conftest import REPO_ROOT
from tests.support.netns import netns_works
from tests.support.s3_server import CREDENTIALS, moto_server, new_bucket

JOB = str(REPO_ROOT / "tests" / "scripts" / "chaos_job.py")

pytestmark = pytest.mark.soak


def _soak(run_dir: Path, *, faults: int, seed: int, kinds: tuple[FaultKind, ...], nodes: int, min_nodes: int,
          max_nodes: int, etcd_members: int, checkpoint_dir: str = "", recovery: str = "", sharding: str = "ddp",
          nproc_per_node: int = 1) -> None:
    # A gap of up to 5 steps and steps redone, and a straggler trains through 25 slow steps.
    steps_needed = faults * 7 + 12 + (faults * 25 if FaultKind.STRAGGLER in kinds else 0)
    result = run_chaos(ChaosConfig(
        script=JOB, run_dir=str(run_dir), nodes=nodes, min_nodes=min_nodes, max_nodes=max_nodes,
        etcd_members=etcd_members,
        script_args=("--ckpt", "{checkpoint_dir}", "--samples", "384", "--epochs", str(-(-steps_needed // 24)),
                     "--ckpt-every", "3", *demo_sharding_args(sharding, recovery or default_recovery(sharding),
                                         int(os.environ.get("ELASTICTRAIN_SOAK_REDUNDANCY_EVERY", "1")))),
        checkpoint_dir=checkpoint_dir, recovery=recovery, sharding=sharding, nproc_per_node=nproc_per_node,
        faults=faults, seed=seed, kinds=kinds, netns=any(kind.fault_class.needs_netns for kind in kinds),
        checkpoint_disk_mb=256 if any(kind.fault_class.needs_checkpoint_disk for kind in kinds) else 0,
        deadline=3.5 * 3600,
    ))
    report = result.report
    print(f"\nsoak of {report['faults_injected']} faults (seed {seed}, {sharding}, {nodes} nodes x {nproc_per_node}) "
          f"in {report['duration_s']}s:")
    for kind, summary in report["recovery_by_kind"].items():
        print(f"  {kind:17} x{summary['count']}: median {summary['recovery_s_median']}s "
              f"(min {summary['recovery_s_min']}, max {summary['recovery_s_max']}), {summary['steps_redone']} redone")
    for name, outcome in report["invariants"].items():
        print(f"  {name}: {outcome['ok']} - {outcome['detail'][:160]}")
    assert report["faults_injected"] == faults, report["faults"][-3:]
    assert result.ok, result.failures() + f"\nrun dir: {result.run_dir}"
    assert report["completed"]


@pytest.mark.timeout(4 * 3600)
def test_soak_random_faults_keep_every_invariant(tmp_path: Path) -> None:
    # partition_node needs root (network namespaces): only when ELASTICTRAIN_SOAK_KINDS names it.
    # disk_full mounts a tmpfs for the checkpoints: as root only.
    every_loopback_kind = ",".join(k.value for k in FaultKind if not k.fault_class.needs_netns
                                   and (os.geteuid() == 0 or not k.fault_class.needs_checkpoint_disk))
    _soak(tmp_path / "soak", faults=int(os.environ.get("ELASTICTRAIN_SOAK_FAULTS", "50")),
          seed=int(os.environ.get("ELASTICTRAIN_SOAK_SEED", "1")),
          kinds=parse_kinds(os.environ.get("ELASTICTRAIN_SOAK_KINDS", every_loopback_kind)),
          nodes=3, min_nodes=2, max_nodes=3, etcd_members=3)


@pytest.mark.timeout(4 * 3600)
def test_soak_with_checkpoints_in_s3_keeps_every_invariant(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The job checkpoints into a local S3 server (moto's) instead of a directory; the harness's
    # invariants read the checkpoints there. disk_full fills a local filesystem: left out. Under
    # restart recovery (every fault restores from S3) kill_in_save is too: it finds the saving
    # worker through the in-process control channel.
    recovery = os.environ.get("ELASTICTRAIN_SOAK_S3_RECOVERY", "in-process")
    kinds = ",".join(k.value for k in FaultKind if not k.fault_class.needs_netns
                     and not k.fault_class.needs_checkpoint_disk
                     and not (recovery == "restart" and k is FaultKind.KILL_IN_SAVE))
    (tmp_path / "moto").mkdir()
    with moto_server(tmp_path / "moto") as endpoint:
        for name, value in CREDENTIALS.items():
            monkeypatch.setenv(name, value)
        monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)  # the harness's reads and every node's
        _soak(tmp_path / "soak", faults=int(os.environ.get("ELASTICTRAIN_SOAK_S3_FAULTS", "30")),
              seed=int(os.environ.get("ELASTICTRAIN_SOAK_SEED", "1")),
              kinds=parse_kinds(os.environ.get("ELASTICTRAIN_SOAK_KINDS", kinds)),
              nodes=3, min_nodes=2, max_nodes=3, etcd_members=3, checkpoint_dir=f"s3://{new_bucket(endpoint)}/soak",
              recovery=recovery)


@pytest.mark.timeout(4 * 3600)
@pytest.mark.parametrize(("sharding", "nproc_per_node"), [("fsdp", 1), ("hsdp", 2)], ids=["fsdp", "hsdp"])
def test_soak_of_random_faults_keeps_every_invariant_sharded(tmp_path: Path, sharding: str,
                                                             nproc_per_node: int) -> None:
    # The demo job sharded: fsdp over 2-3 nodes of one worker (uneven shards at 3, a copy of each
    # rank's shards on its buddy), hsdp over 2-3 nodes of 2 (a node is a replica). In process;
    # ELASTICTRAIN_SOAK_SHARDED_RECOVERY=restart runs them by restarts (kill_in_save, which needs the
    # in-process agent, is then left out).
    # With network namespaces (root), the cuts too: a partition and a link cut found hsdp's survivors
    # waiting out the collective timeout in their all-reduce across replicas.
    recovery = os.environ.get("ELASTICTRAIN_SOAK_SHARDED_RECOVERY", "in-process")
    netns = netns_works()
    every_kind_here = ",".join(k.value for k in kinds_for(recovery, tuple(FaultKind))
                               if (netns or not k.fault_class.needs_netns)
                               and (os.geteuid() == 0 or not k.fault_class.needs_checkpoint_disk))
    _soak(tmp_path / sharding, faults=int(os.environ.get("ELASTICTRAIN_SOAK_SHARDED_FAULTS", "20")),
          seed=int(os.environ.get("ELASTICTRAIN_SOAK_SEED", "1")),
          kinds=parse_kinds(os.environ.get("ELASTICTRAIN_SOAK_KINDS", every_kind_here)),
          nodes=3, min_nodes=2, max_nodes=3, etcd_members=3, sharding=sharding, nproc_per_node=nproc_per_node,
          recovery=recovery)


@pytest.mark.timeout(3600)
def test_soak_with_hot_spares_keeps_every_invariant(tmp_path: Path) -> None:
    # 3 nodes of a job of exactly 2: a node is killed only while a spare waits (above min-nodes),
    # a join adds a spare, a bounce at 2 nodes leaves the survivor waiting for the replacement.
    _soak(tmp_path / "spares", faults=int(os.environ.get("ELASTICTRAIN_SOAK_SPARE_FAULTS", "20")),
          seed=int(os.environ.get("ELASTICTRAIN_SOAK_SEED", "1")),
          kinds=parse_kinds("kill_worker,kill_node,bounce_node,hang_worker,join,kill_etcd"),
          nodes=3, min_nodes=2, max_nodes=2, etcd_members=1)


@pytest.mark.timeout(900)
@pytest.mark.parametrize(("bug", "recovery", "invariant", "symptom"), [
    ("resume_off_by_one", "restart", "exactly_once", "consumed more than once"),
    ("stale_sampler_state", "restart", "exactly_once", "consumed more than once"),
    ("half_applied_step", "in-process", "final_parameters", ""),
])
def test_a_planted_bug_makes_the_invariants_fail(tmp_path: Path, bug: str, recovery: str, invariant: str,
                                                 symptom: str) -> None:
    result = run_chaos(ChaosConfig(
        script=JOB, run_dir=str(tmp_path / "run"), nodes=2, min_nodes=2, max_nodes=2,
        script_args=("--ckpt", "{run_dir}/ckpt", "--samples", "192", "--ckpt-every", "2"),
        schedule=tuple(parse_schedule("kill_worker@5")), env={"CHAOS_JOB_BUG": bug}, recovery=recovery,
    ))
    invariants = result.report["invariants"]
    print(f"\nplanted {bug} ({recovery} recovery):")
    for name, outcome in invariants.items():
        if outcome["ok"] is False:
            print(f"  {name}: FAILED - {outcome['detail']}")
    # The job ran to its end: the bug shows in the invariants, not as a job that cannot start
    # (stop 29: the half-applied step was planted in a method the step loop's split had moved).
    assert invariants["exit_status"]["ok"] is True, invariants
    assert invariants[invariant]["ok"] is False and symptom in invariants[invariant]["detail"], invariants
    assert invariants["final_parameters"]["ok"] is False, invariants
    assert not result.ok


@pytest.mark.timeout(600)
def test_a_hang_detector_that_never_fires_makes_a_run_with_a_blocked_rank_fail(tmp_path: Path) -> None:
    result = run_chaos(ChaosConfig(
        script=JOB, run_dir=str(tmp_path / "run"), nodes=2, min_nodes=2, max_nodes=2,
        script_args=("--ckpt", "{run_dir}/ckpt", "--samples", "192", "--ckpt-every", "2"),
        schedule=tuple(parse_schedule("hang_sleep@5")), env={"CHAOS_JOB_BUG": "no_hang_deadline"},
        recovery_bound=90,
    ))
    invariants = result.report["invariants"]
    print("\nplanted no_hang_deadline:", {n: o["detail"][:160] for n, o in invariants.items() if o["ok"] is False})
    assert invariants["no_hang"]["ok"] is False, invariants
    assert not result.ok


@pytest.mark.timeout(600)
def test_a_node_joins_after_an_etcd_outage_longer_than_the_heartbeat_window(tmp_path: Path) -> None:
    # Once a bug: the first agent to sync after the outage dropped every participant
    # (all heartbeats had lapsed) and the joining node waited alone in a round no
    # training agent re-entered. tests/integration/test_etcd3_rendezvous.py holds the
    # fast versions of this; this is the whole job.
    result = run_chaos(ChaosConfig(
        script=JOB, run_dir=str(tmp_path / "run"), nodes=2, min_nodes=2, max_nodes=3, reference=False,
        script_args=("--ckpt", "{run_dir}/ckpt", "--samples", "192", "--ckpt-every", "2"),
        schedule=tuple(parse_schedule("kill_etcd@3,join@8")), etcd_down=6, join_timeout=60, recovery_bound=90,
    ))
    join = result.report["faults"][1]
    assert join["recovery_s"] is not None, result.failures()
    assert result.ok, result.failures()
