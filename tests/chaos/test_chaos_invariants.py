"""The invariant checks on hand-made evidence: they pass on a correct history and catch each kind of corruption.

No processes here: these pin down what the checks accept and reject, including
the lineage rule (steps that ran but whose checkpoint never committed are not
part of the history) that the real chaos runs rely on.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from elastictrain.chaos import ChaosConfig
from elastictrain.chaos import invariants as inv
from elastictrain.chaos.cluster import Node
from elastictrain.chaos.faults import fault_for
from elastictrain.chaos.schedule import FaultKind, FaultRecord, PlannedFault, RandomPlanner, parse_kinds, parse_schedule
from elastictrain.chaos.recorder import Recorder
from elastictrain.chaos.verdict import _exit_status, unnoticed_faults
from elastictrain.errors import ConfigError

N, G = 12, 4  # 12 samples, a global batch of 4: 3 steps per epoch


def _perm(epoch: int) -> list[int]:
    return torch.randperm(N, generator=torch.Generator().manual_seed(100 + epoch)).tolist()


class Job:
    """Builds evidence the way a Recorder would: segments that train steps on `world` ranks."""

    def __init__(self) -> None:
        self.evidence = inv.Evidence(Path("/nonexistent"))
        self.evidence.events.append({"kind": "config", "seg": "a", "t": 0.0, "num_samples": N, "global_batch": G,
                                     "drop_last": False, "epochs": 2, "max_steps": None})
        self.clock = 1.0

    def run(self, seg: str, world: int, steps: range, *, shift: int = 0) -> None:
        """Segment ``seg`` trains ``steps`` (numbers from 1); ``shift`` moves its reads (a sampler bug)."""
        self.evidence.events.append({"kind": "segment", "seg": seg, "t": self.clock, "world": world})
        for number in steps:
            epoch, position = divmod(number - 1, N // G)
            start = position * G + shift
            share = _perm(epoch)[start:start + G]
            by_rank = self.evidence.steps.setdefault(seg, {}).setdefault(number, {})
            for rank in range(world):
                part = share[rank * G // world:(rank + 1) * G // world]
                by_rank[rank] = {"seg": seg, "rank": rank, "world": world, "step": number, "epoch": epoch,
                                 "idx": part, "t": self.clock}
            self.clock += 1

    def event(self, kind: str, seg: str, **fields: Any) -> None:
        self.evidence.events.append({"kind": kind, "seg": seg, "t": self.clock, **fields})
        self.clock += 1


def _final(lineage: list[tuple[str, int]], step: int, *, epoch: int = 1, cursor: int = N) -> inv.Checkpoint:
    return inv.Checkpoint(step, Path(f"/ckpt/step_{step:08d}"), {"w": torch.zeros(1)},
                          {"epoch": epoch, "cursor": cursor, "num_samples": N},
                          [{"seg": s, "base": b} for s, b in lineage])


def test_steps_redone_after_a_restore_count_once_and_lost_ones_not_at_all() -> None:
    job = Job()
    job.run("a", 2, range(1, 6))  # steps 1-5; its last checkpoint was step 4
    job.run("x", 2, range(5, 7))  # restored 4, ran 5 and 6, died before any checkpoint: not in the lineage
    job.run("b", 3, range(5, 6))  # restored 4 too: step 5 again, at world size 3; checkpointed it
    job.run("c", 2, range(6, 7))  # restored 5: step 6, the last
    final = _final([("a", 0), ("b", 4), ("c", 5)], 6, epoch=1, cursor=N)
    history = inv.committed_history(job.evidence, final)
    assert [(n, s) for n, s, _ in history.steps] == [(1, "a"), (2, "a"), (3, "a"), (4, "a"), (5, "b"), (6, "c")]
    assert inv.check_committed_history(history, job.evidence).ok
    result = inv.check_exactly_once(history, job.evidence, final)
    assert result.ok, result.detail
    assert "2 complete epoch(s)" in result.detail


def test_a_restore_that_resumes_one_sample_early_is_caught() -> None:
    job = Job()
    job.run("a", 2, range(1, 3))
    job.run("b", 2, range(3, 4), shift=-1)  # resumed at cursor - 1: one sample twice, one never
    final = _final([("a", 0), ("b", 2)], 3, epoch=0, cursor=N)
    result = inv.check_exactly_once(inv.committed_history(job.evidence, final), job.evidence, final)
    assert result.ok is False
    assert "consumed more than once" in result.detail and "never consumed" in result.detail


def test_an_unfinished_epoch_must_match_the_checkpointed_cursor() -> None:
    job = Job()
    job.run("a", 2, range(1, 3))
    final = _final([("a", 0)], 2, epoch=0, cursor=2 * G)
    assert inv.check_exactly_once(inv.committed_history(job.evidence, final), job.evidence, final).ok
    lying = _final([("a", 0)], 2, epoch=0, cursor=2 * G + 2)  # a sampler state ahead of the model
    result = inv.check_exactly_once(inv.committed_history(job.evidence, lying), job.evidence, lying)
    assert result.ok is False and "the cursor says 10" in result.detail


def test_a_committed_step_missing_a_rank_or_any_record_breaks_the_history() -> None:
    job = Job()
    job.run("a", 3, range(1, 4))
    del job.evidence.steps["a"][2][1]
    final = _final([("a", 0), ("b", 3)], 4, epoch=1, cursor=G)
    result = inv.check_committed_history(inv.committed_history(job.evidence, final), job.evidence)
    assert result.ok is False
    assert "records of ranks [0, 2]" in result.detail
    assert "committed step 4 (segment b) has no step records" in result.detail


def test_a_checkpoint_without_a_lineage_cannot_be_checked() -> None:
    job = Job()
    final = inv.Checkpoint(1, Path("/ckpt/step_00000001"), {}, None, None)
    result = inv.check_committed_history(inv.committed_history(job.evidence, final), job.evidence)
    assert result.ok is False and "extra_state" in result.detail


def _write_checkpoint(root: Path, step: int, payload: bytes = b"weights") -> Path:
    directory = root / f"step_{step:08d}"
    directory.mkdir(parents=True)
    files = {}
    for name, data in (("replicated.pt", payload), ("rank_00000.pt", b"rng")):
        (directory / name).write_bytes(data)
        files[name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (directory / "MANIFEST.json").write_text(json.dumps({"step": step, "world_size": 1, "files": files}))
    return directory


def test_checkpoint_verification_catches_a_flipped_byte_and_staging_dirs_do_not_count(tmp_path: Path) -> None:
    good = _write_checkpoint(tmp_path, 4)
    bad = _write_checkpoint(tmp_path, 8)
    (tmp_path / "step_00000010.tmp-abc").mkdir()
    assert list(inv.checkpoint_dirs(tmp_path)) == [4, 8]
    assert inv.verify_checkpoint(good, 4) is None
    data = bytearray((bad / "replicated.pt").read_bytes())
    data[0] ^= 1
    (bad / "replicated.pt").write_bytes(bytes(data))
    assert "sha256" in str(inv.verify_checkpoint(bad, 8))
    result = inv.check_checkpoints_intact(inv.checkpoint_dirs(tmp_path))
    assert result.ok is False and "step_00000008" in result.detail


def test_a_restore_must_load_what_its_producer_committed(tmp_path: Path) -> None:
    _write_checkpoint(tmp_path, 2)
    _write_checkpoint(tmp_path, 4)
    checkpoints = inv.checkpoint_dirs(tmp_path)
    job = Job()
    job.event("save_begin", "a", step=2, fp="p2")
    job.event("saved", "a", step=2, dir=str(tmp_path))
    job.event("save_begin", "a", step=4, fp="p4")
    job.event("saved", "a", step=4, dir=str(tmp_path))
    job.event("restored", "b", step=4, path=str(tmp_path / "step_00000004"), producer="a", fp="p4")
    assert inv.check_restores(job.evidence, checkpoints).ok

    torn = Job()
    torn.evidence.events = [e for e in job.evidence.events if e["kind"] != "restored"]
    torn.clock = job.clock
    torn.event("restored", "b", step=4, path=str(tmp_path / "step_00000004"), producer="a", fp="other")
    result = inv.check_restores(torn.evidence, checkpoints)
    assert result.ok is False and "parameters differ" in result.detail

    stale = Job()
    stale.evidence.events = [e for e in job.evidence.events if e["kind"] != "restored"]
    stale.clock = job.clock
    stale.event("restored", "b", step=2, path=str(tmp_path / "step_00000002"), producer="a", fp="p2")
    result = inv.check_restores(stale.evidence, checkpoints)
    assert result.ok is False and "although step 4 was committed before" in result.detail

    staged = Job()
    staged.event("restored", "b", step=6, path=str(tmp_path / "step_00000006.tmp-1"), producer="a", fp="x")
    assert inv.check_restores(staged.evidence, checkpoints).ok is False


def test_the_session_logging_a_restore_of_an_uncommitted_step_is_caught(tmp_path: Path) -> None:
    _write_checkpoint(tmp_path, 2)
    logged = [{"kind": "checkpoint_commit", "ts": 1.0, "step": 2}, {"kind": "restore", "ts": 2.0, "step": 2},
              {"kind": "restore", "ts": 3.0, "step": 6}]
    result = inv.check_restores(Job().evidence, inv.checkpoint_dirs(tmp_path), logged)
    assert result.ok is False and "step 6, which was never committed" in result.detail


def test_final_parameters_compare_within_tolerance() -> None:
    reference = inv.Checkpoint(8, Path("r"), {"w": torch.tensor([1.0, -2.0]), "n": torch.tensor(3)}, None, None)
    close = inv.Checkpoint(8, Path("c"), {"w": torch.tensor([1.0 + 3e-8, -2.0]), "n": torch.tensor(3)}, None, None)
    far = inv.Checkpoint(8, Path("f"), {"w": torch.tensor([1.001, -2.0]), "n": torch.tensor(3)}, None, None)
    early = inv.Checkpoint(7, Path("e"), reference.model, None, None)
    assert inv.check_final_parameters(close, reference, atol=1e-5, rtol=1e-4).ok
    assert inv.check_final_parameters(far, reference, atol=1e-5, rtol=1e-4).ok is False
    assert inv.check_final_parameters(early, reference, atol=1e-5, rtol=1e-4).ok is False


def test_world_sizes_outside_min_and_max_are_reported() -> None:
    job = Job()
    job.run("a", 2, range(1, 2))
    job.run("b", 4, range(2, 3))
    result = inv.check_world_sizes(job.evidence, [{"kind": "rendezvous", "world_size": 1}], low=2, high=3)
    assert result.ok is False and "world size 4" in result.detail and "rendezvous at world size 1" in result.detail


def test_schedules_parse_and_bad_ones_say_why() -> None:
    assert parse_schedule("kill_worker@4, join@10") == [PlannedFault(FaultKind.KILL_WORKER, 4),
                                                       PlannedFault(FaultKind.JOIN, 10)]
    with pytest.raises(ConfigError, match="unknown fault kind 'kill_everything'"):
        parse_schedule("kill_everything@3")
    with pytest.raises(ConfigError, match="KIND@STEP"):
        parse_schedule("kill_worker")
    assert parse_kinds("join,kill_etcd") == (FaultKind.JOIN, FaultKind.KILL_ETCD)


def test_every_fault_kind_has_a_class_of_its_own_that_injects_it() -> None:
    classes = {kind: type(fault_for(FaultRecord(0, kind, 1), harness=None)) for kind in FaultKind}  # type: ignore[arg-type]
    assert all(cls.kind is kind for kind, cls in classes.items()), classes
    assert len(set(classes.values())) == len(FaultKind), classes


def test_random_faults_replay_from_a_seed_and_never_leave_min_max_nodes() -> None:
    def draw(seed: int) -> list[PlannedFault]:
        planner, nodes, out, step = RandomPlanner(seed, tuple(FaultKind)), 3, [], 0
        for _ in range(200):
            fault = planner.next(step, nodes=nodes, min_nodes=2, max_nodes=3, etcd_members=1)
            assert fault is not None
            out.append(fault)
            step = fault.at_step
            nodes += {FaultKind.KILL_NODE: -1, FaultKind.JOIN: 1}.get(fault.kind, 0)
            assert 2 <= nodes <= 3
        return out

    first = draw(5)
    assert first == draw(5) and first != draw(6)
    assert FaultKind.KILL_ETCD_LEADER not in {f.kind for f in first}  # needs a 3-member etcd
    assert {f.kind for f in first} == set(FaultKind) - {FaultKind.KILL_ETCD_LEADER}
    assert all(2 <= b.at_step - a.at_step <= 5 for a, b in zip(first, first[1:]))


def test_a_chaos_config_refuses_what_cannot_run(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("")
    ChaosConfig(script=str(script), run_dir=str(tmp_path / "run"), pg_timeout=5, join_timeout="30")
    with pytest.raises(ConfigError, match="is not a file"):
        ChaosConfig(script=str(tmp_path / "missing.py"), run_dir=str(tmp_path / "run"))
    with pytest.raises(ConfigError, match="min_nodes <= max_nodes"):
        ChaosConfig(script=str(script), run_dir=str(tmp_path / "run"), min_nodes=3, max_nodes=2, nodes=2)
    with pytest.raises(ConfigError, match="needs etcd_members=3"):
        ChaosConfig(script=str(script), run_dir=str(tmp_path / "run"),
                    schedule=tuple(parse_schedule("kill_etcd_leader@2")))
    with pytest.raises(ConfigError, match="pg_timeout"):
        ChaosConfig(script=str(script), run_dir=str(tmp_path / "run"), pg_timeout="soon")
    # Found by probing the harness; each used to start a run that failed, hung or misreported.
    with pytest.raises(ConfigError, match="could never form the job"):
        ChaosConfig(script=str(script), run_dir=str(tmp_path / "run"), nodes=1, min_nodes=2)
    with pytest.raises(ConfigError, match="seed must be >= 0"):
        ChaosConfig(script=str(script), run_dir=str(tmp_path / "run"), seed=-5)
    with pytest.raises(ConfigError, match="atol must be a finite number >= 0"):
        ChaosConfig(script=str(script), run_dir=str(tmp_path / "run"), atol=-1)
    # What each node is started with: before, every node failed, and the run said so as a failed run (rc 1).
    with pytest.raises(ConfigError, match="--nproc-per-node: expected a positive integer"):
        ChaosConfig(script=str(script), run_dir=str(tmp_path / "run"), nproc_per_node=0)
    with pytest.raises(ConfigError, match="unrecognized arguments: --bogus"):
        ChaosConfig(script=str(script), run_dir=str(tmp_path / "run"), run_args=("--bogus",))
    with pytest.raises(ConfigError, match="'stray.py' is no flag's value"):
        ChaosConfig(script=str(script), run_dir=str(tmp_path / "run"), run_args=("--recovery", "restart", "stray.py"))
    with pytest.raises(ConfigError, match="prints its help"):
        ChaosConfig(script=str(script), run_dir=str(tmp_path / "run"), run_args=("--help",))
    ChaosConfig(script=str(script), run_dir=str(tmp_path / "run"), run_args=("--recovery", "restart"))


def test_checkpoints_in_an_object_store_refuse_the_faults_that_fill_a_local_disk(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("")
    run_dir, url = str(tmp_path / "run"), "s3://bucket/chaos"
    ChaosConfig(script=str(script), run_dir=run_dir, checkpoint_dir=url, faults=3, kinds=(FaultKind.KILL_IN_SAVE,))
    with pytest.raises(ConfigError, match="disk_full fills a local filesystem; the checkpoints are in s3://bucket/chaos"):
        ChaosConfig(script=str(script), run_dir=run_dir, checkpoint_dir=url,
                    schedule=tuple(parse_schedule("disk_full@3")))
    with pytest.raises(ConfigError, match="checkpoint_disk_mb .--checkpoint-disk-mb. mounts a filesystem"):
        ChaosConfig(script=str(script), run_dir=run_dir, checkpoint_dir=url, checkpoint_disk_mb=64)
    with pytest.raises(ConfigError, match="must be an s3://bucket/prefix URL"):
        ChaosConfig(script=str(script), run_dir=run_dir, checkpoint_dir=str(tmp_path / "ckpt"))


def test_a_relative_script_is_found_by_the_nodes_in_the_run_directory(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The nodes run in the run directory: a relative path passed the check, then no node found it."""
    (tmp_path / "train.py").write_text("")
    monkeypatch.chdir(tmp_path)
    config = ChaosConfig(script="train.py", run_dir=str(tmp_path / "run"))
    assert config.script == str(tmp_path / "train.py")


def test_partition_node_needs_netns_and_netns_needs_root_and_ip(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    script = tmp_path / "train.py"
    script.write_text("")
    run_dir = str(tmp_path / "run")
    with pytest.raises(ConfigError, match=r"partition_node needs netns=True \(--netns\)"):
        ChaosConfig(script=str(script), run_dir=run_dir, schedule=tuple(parse_schedule("partition_node@3")))
    with pytest.raises(ConfigError, match="partition_node needs netns=True"):
        ChaosConfig(script=str(script), run_dir=run_dir, faults=5,
                    kinds=(FaultKind.KILL_WORKER, FaultKind.PARTITION_NODE))
    # Kinds only matter when faults are drawn from them.
    ChaosConfig(script=str(script), run_dir=run_dir, kinds=(FaultKind.PARTITION_NODE,))
    config = ChaosConfig(script=str(script), run_dir=run_dir, pg_timeout=10)
    assert config.partition_duration.total_seconds() == 20  # past the collective timeout: the survivors notice
    assert config.bound_for(FaultKind.PARTITION_NODE) == 120 + 10 + 20
    # In-process, a hung worker is killed: the job must train again before the hang would end (a
    # hang that went unnoticed, waited out until the worker was continued, used to pass).
    assert config.noticed_within(FaultKind.HANG_WORKER) == 10 + 5
    assert config.noticed_within(FaultKind.KILL_WORKER) is None
    assert ChaosConfig(script=str(script), run_dir=run_dir, hang=3).noticed_within(FaultKind.HANG_WORKER) is None
    assert ChaosConfig(script=str(script), run_dir=run_dir, pg_timeout=10,
                       recovery="restart").noticed_within(FaultKind.HANG_WORKER) is None
    found = FaultRecord(0, FaultKind.HANG_WORKER, 5, injected=100.0, ended=115.0, recovered=103.4)
    waited_out = FaultRecord(1, FaultKind.HANG_WORKER, 9, injected=200.0, ended=215.0, recovered=215.2)
    killed = FaultRecord(2, FaultKind.KILL_WORKER, 12, injected=300.0, ended=300.0, recovered=330.0)
    assert unnoticed_faults(config, [found, waited_out, killed]) == [waited_out]
    assert ChaosConfig(script=str(script), run_dir=run_dir, partition=7).partition_duration.total_seconds() == 7
    monkeypatch.setattr("os.geteuid", lambda: 1000)
    with pytest.raises(ConfigError, match="netns needs root"):
        ChaosConfig(script=str(script), run_dir=run_dir, netns=True)
    monkeypatch.setattr("os.geteuid", lambda: 0)
    monkeypatch.setenv("PATH", str(tmp_path))  # no `ip` there
    with pytest.raises(ConfigError, match="netns needs the `ip` command"):
        ChaosConfig(script=str(script), run_dir=run_dir, netns=True,
                    schedule=tuple(parse_schedule("partition_node@3")))


def test_partition_node_is_drawn_only_above_min_nodes() -> None:
    planner = RandomPlanner(0, (FaultKind.PARTITION_NODE,))
    assert planner.next(0, nodes=2, min_nodes=2, max_nodes=3, etcd_members=1) is None
    assert planner.next(0, nodes=3, min_nodes=2, max_nodes=3, etcd_members=1) is not None


def test_only_a_node_cut_off_until_the_job_ended_may_exit_non_zero(tmp_path: Path) -> None:
    log = tmp_path / "node0.log"
    log.write_text("[elastictrain node0] ERROR run 'r' is closed: the job it named has already ended (30.2s)\n")

    def node(name: str, code: int, *, partitioned: float | None) -> Node:
        exited = SimpleNamespace(pid=0, returncode=code, poll=lambda: code)  # an agent that has exited
        return Node(name, exited, log, 0.0, False, partitioned=partitioned, ended=1.0)  # type: ignore[arg-type]

    ok = _exit_status([node("node0", 1, partitioned=5.0), node("node1", 0, partitioned=None)], True, None)
    assert ok.ok and "cut off until the job had ended" in ok.detail
    # The same exit without a partition (or a cut node failing for another reason) is a failure.
    assert _exit_status([node("node0", 1, partitioned=None)], True, None).ok is False
    log.write_text("Traceback: something else\n")
    assert _exit_status([node("node0", 1, partitioned=5.0)], True, None).ok is False


def _fault(index: int, kind: FaultKind, injected: float, recovered: float, targets: list[int]) -> SimpleNamespace:
    return SimpleNamespace(index=index, kind=kind, injected=injected, recovered=recovered, below_min=False,
                           target_pids=targets, expects_restart=True, spare_waiting=False)


def test_survivors_kept_holds_when_only_the_targets_changed_process_and_fails_otherwise() -> None:
    evidence = inv.Evidence(Path("/nonexistent"))
    for seg, t, pids in (("a", 1.0, (10, 11, 12)), ("b", 5.0, (10, 11, 13)), ("c", 9.0, (10, 14, 13))):
        evidence.workers += [{"seg": seg, "rank": r, "pid": pid, "t": t} for r, pid in enumerate(pids)]
    kept = [_fault(0, FaultKind.KILL_WORKER, 4.0, 6.0, [12]),   # 12 killed, 13 replaces it
            _fault(1, FaultKind.JOIN, 8.0, 10.0, [])]          # nobody touched... but 11 is gone
    result = inv.check_survivors_kept(evidence, kept[:1], in_process=True)
    assert result.ok, result.detail
    result = inv.check_survivors_kept(evidence, kept, in_process=True)
    assert result.ok is False and "fault 1 (join): worker(s) [11]" in result.detail
    assert inv.check_survivors_kept(evidence, kept, in_process=False).ok is None


def test_spares_fill_in_fails_when_a_fault_with_a_spare_waiting_shrinks_the_world() -> None:
    evidence = inv.Evidence(Path("/nonexistent"))
    evidence.events += [{"kind": "segment", "seg": seg, "t": t, "world": world}
                        for seg, t, world in (("a", 1.0, 2), ("b", 5.0, 2), ("c", 9.0, 1))]
    kept, shrunk = _fault(0, FaultKind.KILL_NODE, 4.0, 6.0, []), _fault(1, FaultKind.KILL_WORKER, 8.0, 10.0, [])
    assert inv.check_spares_fill_in(evidence, [kept, shrunk]).ok is None  # no spare waited
    kept.spare_waiting = shrunk.spare_waiting = True
    assert inv.check_spares_fill_in(evidence, [kept]).ok is True
    result = inv.check_spares_fill_in(evidence, [kept, shrunk])
    assert result.ok is False and "fault 1 (kill_worker): world size 2 -> 1 with a spare waiting" in result.detail


def test_a_run_may_start_with_hot_spares_and_random_joins_stop_at_its_node_count(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("")
    config = ChaosConfig(script=str(script), run_dir=str(tmp_path / "run"), nodes=4, min_nodes=2, max_nodes=3)
    assert config.capacity == 4
    assert ChaosConfig(script=str(script), run_dir=str(tmp_path / "run"), nodes=2, max_nodes=3).capacity == 3
    planner = RandomPlanner(1, (FaultKind.JOIN,))
    assert planner.next(0, nodes=3, min_nodes=2, max_nodes=config.capacity, etcd_members=1) is not None
    assert planner.next(0, nodes=4, min_nodes=2, max_nodes=config.capacity, etcd_members=1) is None


def test_a_recorder_that_was_rank_0_writes_no_events_once_it_is_another_rank(tmp_path: Path) -> None:
    # The run's events are rank 0's. A worker that was rank 0 of one generation and another
    # rank of the next kept writing them (stop 28: each step event twice in 2 segments of a
    # chaos run, counted as 12 steps redone).
    recorder = Recorder(torch.nn.Linear(2, 1), directory=str(tmp_path))
    recorder.on_rendezvous(rank=0, world_size=1, restart_count=0)
    recorder.on_step_end(step=1, loss=0.5, throughput=1.0)
    recorder.on_rendezvous(rank=1, world_size=1, restart_count=0)
    recorder.on_step_end(step=2, loss=0.5, throughput=1.0)
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [(e["kind"], e.get("step")) for e in events] == [("segment", None), ("step", 1)]


def test_a_sharded_run_recovers_in_process_by_default_and_by_restart_refuses_what_needs_in_process(
        tmp_path: Path) -> None:
    from elastictrain.chaos.__main__ import build_parser, config_from

    script = tmp_path / "train.py"
    script.write_text("")
    run_dir = str(tmp_path / "run")
    assert ChaosConfig(script=str(script), run_dir=run_dir).recovery == "in-process"
    assert ChaosConfig(script=str(script), run_dir=run_dir, sharding="hsdp").recovery == "in-process"
    assert ChaosConfig(script=str(script), run_dir=run_dir, sharding="fsdp", recovery="restart").recovery \
        == "restart"
    with pytest.raises(ConfigError, match="sharding must be one of ddp, fsdp, hsdp"):
        ChaosConfig(script=str(script), run_dir=run_dir, sharding="zero3")
    for recovery, sharding in (("restart", "ddp"), ("restart", "fsdp")):
        with pytest.raises(ConfigError, match="kill_in_save needs in-process recovery"):
            ChaosConfig(script=str(script), run_dir=run_dir, sharding=sharding, recovery=recovery,
                        schedule=tuple(parse_schedule("kill_in_save@3")))
    # The CLI: the demo job gets the sharding (fsdp in process: and copies every step), the nodes
    # recover in process; under restart the random kinds leave kill_in_save out.
    config = config_from(build_parser().parse_args(["--sharding", "fsdp", "--faults", "3", "--run-dir", run_dir]))
    assert (config.recovery, config.sharding) == ("in-process", "fsdp")
    assert config.script_args[-4:] == ("--sharding", "fsdp", "--redundancy-every", "1")
    assert FaultKind.KILL_IN_SAVE in config.kinds
    config = config_from(build_parser().parse_args(["--sharding", "fsdp", "--recovery", "restart", "--faults", "3",
                                                    "--run-dir", run_dir]))
    assert config.script_args[-2:] == ("--sharding", "fsdp")
    assert FaultKind.KILL_IN_SAVE not in config.kinds and FaultKind.KILL_WORKER in config.kinds
    config = config_from(build_parser().parse_args(["--sharding", "hsdp", "--faults", "3", "--run-dir", run_dir]))
    assert config.recovery == "in-process" and config.script_args[-2:] == ("--sharding", "hsdp")
