"""The rendezvous as users meet it: real agents and workers, a node that dies while the
job gathers, and values in etcd that someone else wrote."""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from elastictrain.launch.cli import main
from elastictrain.etcd import kv
from elastictrain.rendezvous.keys import RunKeys
from tests.conftest import REPO_ROOT, communicate_reporting_hangs, hang_reporting_env, subprocess_env

SCRIPT = str(REPO_ROOT / "tests" / "scripts" / "ddp_steps.py")


def _node(endpoint: str, run_id: str, out: Path, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "elastictrain", "run", "--etcd", endpoint, "--run-id", run_id, "--min-nodes", "2",
         "--max-nodes", "2", "--local-addr", "127.0.0.1", *extra, SCRIPT, str(out)],
        env=hang_reporting_env(), cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True)


@pytest.mark.timeout(180)
def test_a_node_killed_while_the_job_gathers_does_not_block_the_nodes_after_it(
        etcd_server: Any, run_id: str, tmp_path: Path, etcd_client: Any) -> None:
    # A Kubernetes pod restart, or a node failing at start-up: the first node joins,
    # waits for a second, and is SIGKILLed. Two nodes started afterwards must train and
    # exit 0 without waiting on it (torch's rendezvous made it rank 0 of their round and
    # they waited 600 s for its store address).
    first = _node(etcd_server.endpoint, run_id, tmp_path / "out0")
    keys = RunKeys.of(run_id)
    deadline = time.monotonic() + 60
    while not kv.range_(etcd_client, keys.members, prefix=True, keys_only=True, what="test")[1]:
        assert time.monotonic() < deadline and first.poll() is None, "the first node never joined"
        time.sleep(0.1)
    os.killpg(first.pid, signal.SIGKILL)  # the agent and anything it started
    first.wait()
    started = time.monotonic()
    later = [_node(etcd_server.endpoint, run_id, tmp_path / f"out{i}") for i in (1, 2)]
    outputs = [out for out, _ in communicate_reporting_hangs(later, timeout=120)]
    assert [p.returncode for p in later] == [0, 0], outputs[0][-2500:] + outputs[1][-2500:]
    # The dead node's lease (5 s by default) is the only wait; nothing waited 600 s.
    assert time.monotonic() - started < 60
    worlds = [line for out in outputs for line in out.splitlines() if "rendezvous round" in line]
    assert worlds and all("world size 2" in line for line in worlds), worlds


class _Canary:
    """Unpickling this creates a file: the sign that reading a value ran code."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.path, "w"))


def _cli(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return code, out.getvalue(), err.getvalue()


@pytest.mark.timeout(180)
def test_a_crafted_pickle_in_every_key_of_a_run_runs_no_code_anywhere(
        etcd_server: Any, run_id: str, tmp_path: Path, etcd_client: Any) -> None:
    canary = tmp_path / "canary"
    crafted = b"ETRDZV1\n" + pickle.dumps(_Canary(str(canary)))
    keys = RunKeys.of(run_id)
    for key in (keys.lease, keys.meta, keys.stop, keys.record("n1"), keys.member("n1"), keys.round, keys.closer,
                keys.closed, keys.store(1, 0) + "MASTER_ADDR", keys.prefix + "dynamic/state"):
        kv.txn(etcd_client, [], [kv.put(key, crafted)], what="test")
    kv.txn(etcd_client, [], [kv.put("/elastictrain/not a run id/x", crafted), kv.put("/elastictrain/junk", crafted)],
           what="test")
    endpoint = etcd_server.endpoint

    code, out, err = _cli("status", "--etcd", endpoint, "--run-id", run_id)
    assert code == 0 and "Traceback" not in out + err
    unreadable = [line for line in out.splitlines() if line.startswith("unreadable: ")]
    assert len(unreadable) >= 5 and all("does not hold an elastictrain" in line for line in unreadable)
    assert any(keys.round in line for line in unreadable)

    code, out, err = _cli("status", "--etcd", endpoint, "--all")
    assert code == 0 and "Traceback" not in out + err
    assert run_id in out and "unreadable key(s)" in out and "junk" not in out and "not a run id" not in out

    code, out, err = _cli("status", "--etcd", endpoint, "--run-id", run_id, "--json")
    assert code == 0 and "Traceback" not in err

    joining = subprocess.run(
        [sys.executable, "-m", "elastictrain", "run", "--etcd", endpoint, "--run-id", run_id, "--local-addr",
         "127.0.0.1", "--join", SCRIPT, str(tmp_path / "out")],
        env=subprocess_env(), cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert joining.returncode == 1, joining.stderr[-2000:]
    errors = [line for line in joining.stderr.splitlines() if line.startswith("elastictrain: error:")]
    assert len(errors) == 1 and "does not hold an elastictrain" in errors[0], joining.stderr[-2000:]
    assert "Traceback" not in joining.stderr

    code, out, err = _cli("stop", "--etcd", endpoint, "--run-id", run_id)
    assert "Traceback" not in out + err and code in (0, 1)
    assert not canary.exists(), "reading a value from etcd ran code"
