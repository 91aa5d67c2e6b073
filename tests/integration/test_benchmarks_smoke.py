"""The benchmark driver runs end to end in its smoke mode and writes the report it documents.

Only the shape of the results is checked, never a timing: CI machines are too noisy
for that, and ``python -m benchmarks --mode quick|full`` is where numbers come from.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO_ROOT, subprocess_env

SUMMARY_KEYS = {"median", "min", "max", "n", "failed", "samples"}


def _run_benchmark(script: str, *args: str, out: Path, timeout: int, env: dict[str, str] | None = None) -> Any:
    """Runs one benchmark from the repository root and returns the JSON it wrote to ``out``.

    ``script`` is a file (``benchmarks/x.py``), given ``--out`` ``out``, or, without ``.py``, a
    module run with ``-m`` (whose ``args`` say where it writes ``out``).
    A failed run fails the test with the tail of its stderr.
    """
    command = [script, *args, "--out", str(out)] if script.endswith(".py") else ["-m", script, *args]
    done = subprocess.run([sys.executable, *command], cwd=REPO_ROOT, env=env or subprocess_env(),
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


# About a minute of the default suite's 10: `python -m pytest -m slow tests/integration/test_benchmarks_smoke.py`.
@pytest.mark.slow
@pytest.mark.timeout(420)
def test_driver_smoke_mode_writes_every_section_with_expected_keys(tmp_path: Path) -> None:
    results = _run_benchmark("benchmarks", "--mode", "smoke", "--out-dir", str(tmp_path), "--no-plots",
                             out=tmp_path / "smoke.json", timeout=400)

    assert results["mode"] == "smoke"
    assert {"nproc", "cpu_model", "torch"} <= results["machine_at_start"].keys()
    for section in ("recovery", "rendezvous_scale", "checkpoint", "step_overhead", "etcd_load"):
        assert results[section].get("status") != "error", results[section]

    crash = results["recovery"]["scenarios"]["worker_crash"]["elastictrain"]
    assert crash["errors"] == []
    assert SUMMARY_KEYS <= crash["recovery_s"].keys()
    assert SUMMARY_KEYS <= crash["steps_redone"].keys()
    assert {"detected", "rendezvous_done", "first_step"} <= crash["milestones_median_s"].keys()
    assert {"recovery_s", "steps_redone", "phases", "milestones"} <= crash["trials"][0].keys()

    scale = results["rendezvous_scale"]["by_size"]["2"]
    for backend in ("etcd3", "etcd3-dynamic", "c10d"):
        assert SUMMARY_KEYS <= scale[backend]["round_s"].keys()
    assert "ratio_etcd3_over_c10d" in scale

    size = results["checkpoint"]["sizes"][0]
    assert {"torch_save", "torch_save_fsync", "sync_save", "async_stall", "async_total", "dcp_save",
            "dcp_async_stall", "dcp_async_total", "async_stall_over_torch_save", "checkpoint_mb"} <= size.keys()
    assert {"median", "min", "max"} <= size["async_stall"].keys()

    assert results["step_overhead"]["status"] in {"ok", "todo", "skipped"}
    job = results["etcd_load"]["jobs"][0]
    for phase in ("startup", "steady", "recovery"):
        assert {"requests", "requests_per_s", "received_bytes_per_s", "sent_bytes_per_s",
                "requests_by_method"} <= job[phase].keys()

    assert "elastictrain" in results["launcher_step_time_s"]
    assert all({"goal", "target", "measured", "met"} <= g.keys() for g in results["goals"])
    report = (tmp_path / "smoke.md").read_text()
    for heading in ("## 1-3. Recovery", "## 4. Rendezvous scale", "## 5. Checkpoint stall",
                    "## 6. Step overhead", "## 7. etcd load"):
        assert heading in report


# In the default suite (about 10 s): nothing else runs this benchmark's code.
@pytest.mark.timeout(180)
def test_step_overhead_runs_the_three_loops_in_turns_and_reports_each(tmp_path: Path) -> None:
    out = tmp_path / "step_overhead.json"
    record = _run_benchmark(
        "benchmarks/step_overhead.py", "--reps", "2", "--steps", "4", "--warmup", "2", "--block", "3",
        "--models", "tiny",
        out=out, timeout=160,
    )
    # 4 steps are rounded up to whole blocks of 3: each loop times 6 (the data covers them).
    assert (record["steps"], record["block"], record["reps"]) == (6, 3, 2)
    tiny = record["results"]["tiny"]
    for kind in ("hand", "session", "inprocess"):
        rates = tiny[f"{kind}_steps_per_s"]["samples"]
        assert len(rates) == 2 and all(rate > 0 for rate in rates), (kind, rates)
        assert len(tiny[f"{kind}_cpu_us_per_step"]["samples"]) == 2
    assert {"overhead_pct", "paired_overhead_pct", "inprocess_overhead_pct", "inprocess_paired_overhead_pct",
            "cpu_overhead_pct"} <= tiny.keys()
    # The driver's report shows both overheads, as the script's own output does.
    from benchmarks import _report

    table = _report.markdown({"step_overhead": {"status": "ok", "record": record}})
    [row] = [line for line in table.splitlines() if line.startswith("| tiny |")]
    assert row.count("%") == 2 and f"{tiny['inprocess_paired_overhead_pct']:+.1f}%" in row, row


# In the default suite (both configurations, shared cores and pinned, one repetition each, no
# warm-up; 18 s on the 2-core VM at load 6): nothing else runs this benchmark's code (issue 44).
@pytest.mark.timeout(180)
def test_checkpoint_s3_saves_restores_and_uploads_to_a_local_s3_server_and_reports_each(tmp_path: Path) -> None:
    out = tmp_path / "checkpoint_s3.json"
    record = _run_benchmark(
        "benchmarks/checkpoint_s3.py", "--mb", "4", "--reps", "1", "--warmup", "0", "--part-mb", "5",
        "--batch", "4",
        out=out, timeout=160,
    )
    assert record["configs"] == ["shared", "pinned"]
    for name in ("result", "result_pinned"):
        result = record[name]
        for key in ("torch_save_local", "memcpy_floor", "s3_async_stall", "s3_async_total", "s3_overlap_stall",
                    "s3_overlap_lost", "s3_restore", "s3storage_upload", "boto3_put_object",
                    "boto3_put_object_same_client", "boto3_multipart",
                    "boto3_multipart_complete", "s3storage_upload_cpu_client", "s3storage_upload_cpu_server",
                    "overlap_window_cpu_client", "overlap_window_cpu_server", "compute_alone_cpu_client"):
            assert SUMMARY_KEYS <= result[key].keys() and result[key]["n"] == 1, (name, key, result[key])
        assert {"s3_overlap_stall_over_torch_save", "s3_async_stall_over_memcpy_floor", "upload_throughput_over_put",
                "upload_throughput_over_put_same_client",
                "upload_throughput_over_plain_multipart", "s3storage_upload_mb_per_s", "boto3_put_object_mb_per_s",
                "overlap_extra_cpu_client", "overlap_extra_cpu_server"} <= result.keys()
        assert result["replicated_bytes"] > 4 << 20
    assert record["result"]["cpus"] == sorted(os.sched_getaffinity(0)) and record["result_pinned"]["cpus"] == [0]
    assert record["result_pinned"]["torch_threads"] == 1


# Slow (about 10 s): sessions of three shardings at world size 4 (issue 41).
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_sharded_step_times_three_shardings_and_reports_each_ranks_state(tmp_path: Path) -> None:
    out = tmp_path / "sharded_step.json"
    results = _run_benchmark(
        "benchmarks/sharded_step.py", "--mb", "1", "--reps", "2", "--steps", "2", "--warmup", "1",
        out=out, timeout=160,
    )["results"]
    held = {mode: results[mode]["state_mb_per_rank"] for mode in ("ddp", "fsdp", "hsdp")}
    for mode, row in results.items():
        assert row["steps_per_s"]["n"] == 2 and all(rate > 0 for rate in row["steps_per_s"]["samples"]), mode
    # Each rank holds all of the state under DDP, about a quarter under fsdp, a half under hsdp 2x2.
    assert len(set(held["ddp"])) == 1 and all(0.2 < mb / held["ddp"][0] < 0.3 for mb in held["fsdp"])
    assert all(0.45 < mb / held["ddp"][0] < 0.55 for mb in held["hsdp"])


# Slow (about 10 s): a sharded forward's unsharded parameters, three modes at world size 2 (issue 41).
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_sharded_forward_reports_what_each_mode_holds_unsharded_at_once(tmp_path: Path) -> None:
    out = tmp_path / "sharded_forward.json"
    results = _run_benchmark(
        "benchmarks/sharded_forward.py", "--mb", "1", "--layers", "4", "--reps", "1", "--steps", "2",
        "--warmup", "1",
        out=out, timeout=160,
    )["results"]
    share = {mode: results[mode]["unsharded_share_of_model"] for mode in ("plain", "gather", "failsafe")}
    # The full gather holds the whole model; plain FSDP2 and the failsafe groups a block (and the head).
    assert share["gather"] == 1.0 and share["failsafe"] == share["plain"] < 0.5, share


# Slow (about 30 s): sessions with and without redundancy at world sizes 2 and 4 (issue 41).
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_redundancy_cost_times_each_refresh_interval_and_reports_the_host_memory(tmp_path: Path) -> None:
    out = tmp_path / "redundancy_cost.json"
    worlds = _run_benchmark(
        "benchmarks/redundancy_cost.py", "--width", "64", "--layers", "1", "--seq", "4",
        "--steps", "11", "--warmup", "1", "--reps", "1", "--every", "1,10", "--worlds", "2,4",
        out=out, timeout=280,
    )["worlds"]
    assert set(worlds) == {"2", "4"}
    for world, entry in worlds.items():
        results = entry["results"]
        assert set(results) == {"off", "every_1", "every_10"} and entry["width"] == 64, world
        assert results["every_1"]["refreshed"][0] + results["every_1"]["skipped"][0] >= 11
        assert len(results["every_1"]["host_mb_per_rank"]) == int(world)
        # Every step: two snapshots of a rank's shard and two copies of its buddy's, about four
        # shards. Every 10 (one refresh here): the pair of the last refresh, about two.
        for name, low, high in (("every_1", 3, 5), ("every_10", 1.5, 2.5)):
            for host, shard in zip(results[name]["host_mb_per_rank"], results[name]["shard_mb_per_rank"],
                                   strict=True):
                assert shard > 0.01 and low * shard <= host <= high * shard + 0.02, (world, name, host, shard)


# Slow (2-4 min): seven recovery trials of 4 workers and checkpoint_sharded.py at a tiny size (issue 41).
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sharded_recovery_times_every_launcher_or_reports_it_unsupported(tmp_path: Path) -> None:
    out = tmp_path / "sharded_recovery.json"
    record = _run_benchmark(
        "benchmarks/sharded_recovery.py", "--width", "32", "--layers", "1", "--reps", "1",
        "--action-step", "4", "--ckpt-every", "2",
        out=out, timeout=870, env=subprocess_env(OMP_NUM_THREADS="1"),
    )
    assert set(record["scenarios"]) == {"fsdp_worker_kill", "hsdp_node_loss"}
    for name, entry in record["scenarios"].items():
        # The restart-based launchers recover; a launcher the job refuses is named unsupported, with
        # the job's reason (in-process recovery, until a sharded session recovers in process).
        for launcher in ("elastictrain_restart", "torchrun_dcp"):
            assert entry[launcher]["trials_timed"] == 1, (name, launcher, entry[launcher]["errors"])
            assert SUMMARY_KEYS <= entry[launcher]["recovery_s"].keys()
            trial = entry[launcher]["trials"][0]
            assert trial["first_step_after"]["step"] > trial["last_step_before"], (name, launcher)
            assert isinstance(trial["steps_redone"], int), (name, launcher)
        inprocess = entry["elastictrain_inprocess"]
        assert ("unsupported" in inprocess) != ("recovery_s" in inprocess), inprocess
    # In process with a buddy's copies refreshed every step: the fsdp state from memory, <= 1 step redone.
    copies = record["scenarios"]["fsdp_worker_kill"]["elastictrain_redundancy"]
    assert copies["trials_timed"] == 1 and copies["trials"][0]["state_from"] == ["peers"], copies
    assert copies["trials"][0]["steps_redone"] <= 1, copies
    assert "unsupported" in record["scenarios"]["hsdp_node_loss"]["elastictrain_redundancy"]
    assert record["scenarios"]["hsdp_node_loss"]["torchrun_dcp"]["trials"][0]["first_step_after"]["world_size"] == 2
    assert record["checkpoint"]["results"]["same_values_as_dcp"] is True
    assert "| fsdp, worker kill" in out.with_suffix(".md").read_text()
