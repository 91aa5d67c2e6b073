"""No silent waits: a node waiting for peers says so every few seconds; an unreachable etcd is
named at once, with the retrying, not only when the retry deadline gives up."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

from elastictrain.etcd.server import free_port
from tests.conftest import REPO_ROOT, subprocess_env

SCRIPT = str(REPO_ROOT / "tests" / "scripts" / "ddp_steps.py")


def _elastictrain(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "elastictrain", *args], capture_output=True, text=True,
                          timeout=90, env=subprocess_env(), cwd=REPO_ROOT)


def test_a_node_waiting_for_peers_says_how_many_more_and_for_how_long(etcd_server: Any, run_id: str,
                                                                      tmp_path: Any) -> None:
    result = _elastictrain("run", "--etcd", etcd_server.endpoint, "--run-id", run_id, "--min-nodes", "2",
                           "--local-addr", "127.0.0.1", "--join-timeout", "6.5",
                           "--event-log", str(tmp_path / "events.jsonl"), SCRIPT, str(tmp_path / "out"))
    assert result.returncode == 1
    waiting = [line for line in result.stderr.splitlines() if "waiting for 1 more node (1 of 2) for " in line]
    assert waiting and "join timeout 6.5 s" in waiting[0], result.stderr[-2000:]


def test_an_unreachable_etcd_is_named_while_retrying(capsys) -> None:
    from elastictrain.launch.cli import main

    port = free_port()  # nothing listens there
    assert main(["status", "--etcd", f"127.0.0.1:{port}", "--run-id", "x", "--rdzv-conf", "retry_deadline=1.5"]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert any(f"etcd at 127.0.0.1:{port} does not answer connecting" in line and
               "retrying for up to 1.5s" in line for line in lines[:-1]), lines
    assert lines[-1].startswith("elastictrain: error: etcd unreachable for connecting")
