"""`elastictrain run --metrics-port`: Prometheus series scraped from a running job."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from elastictrain.etcd.server import free_port
from tests.conftest import REPO_ROOT, subprocess_env

SCRIPT = str(REPO_ROOT / "tests" / "scripts" / "inprocess_job.py")


def _scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    return {f"{s.name}{sorted(s.labels.items()) if s.labels else ''}": s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_a_running_job_is_scraped_for_world_size_round_step_and_checkpoint(tmp_path: Path) -> None:
    port = free_port()
    job = subprocess.Popen(
        [sys.executable, "-m", "elastictrain", "run", "--nproc-per-node", "2", "--metrics-port", str(port),
         "--event-log", str(tmp_path / "events.jsonl"), SCRIPT, str(tmp_path / "job"), "--steps", "400",
         "--step-sleep", "0.05", "--ckpt-every", "5"],
        env=subprocess_env(), cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        seen: dict[str, float] = {}
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and job.poll() is None:
            try:
                seen = _scrape(port)
            except OSError:
                seen = {}
            if seen.get("elastictrain_step", 0) >= 6 and seen.get("elastictrain_last_checkpoint_step", -1) >= 5:
                break
            time.sleep(0.5)
        assert seen.get("elastictrain_world_size") == 2, seen
        assert seen.get("elastictrain_rendezvous_round") == 0 and seen.get("elastictrain_nodes") == 1
        assert seen.get("elastictrain_rendezvous_duration_seconds_count") == 1
        assert seen.get("elastictrain_step", 0) >= 6 and seen.get("elastictrain_steps_per_second", 0) > 0
        assert seen.get("elastictrain_last_checkpoint_step", -1) >= 5
        assert seen.get("elastictrain_last_checkpoint_age_seconds", -1) >= 0
        assert any(k.startswith("elastictrain_info[") and "('run_id', 'local')" in k for k in seen), seen
    finally:
        job.terminate()
        job.wait(timeout=60)


def test_a_metrics_port_in_use_is_one_line_before_anything_starts(tmp_path: Path, capsys) -> None:
    import socket

    from elastictrain.launch.cli import main

    with socket.socket() as busy:
        busy.bind(("0.0.0.0", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code = main(["run", "--metrics-port", str(port), "--event-log", str(tmp_path / "e.jsonl"), SCRIPT,
                     str(tmp_path / "job")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert err[0].startswith(f"elastictrain: error: --metrics-port {port}: cannot serve metrics there")
