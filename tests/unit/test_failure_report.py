"""The failure report: root cause first, one line, its traceback once, no raw dicts."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from elastictrain import failure_report
from elastictrain.launcher import _failure_outcome

USER_STACK = """Traceback (most recent call last):
  File "/venv/site-packages/torch/distributed/elastic/multiprocessing/errors/__init__.py", line 367, in wrapper
    return f(*args, **kwargs)
           ^^^^^^^^^^^^^^^^^^
  File "/src/elastictrain/_worker_boot.py", line 72, in run_script
    runpy.run_path(script, run_name="__main__")
  File "<frozen runpy>", line 291, in run_path
  File "/jobs/train.py", line 42, in <module>
    raise ValueError("bad batch 1234 in shard 7")
ValueError: bad batch 1234 in shard 7
"""

GLOO = ("RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed "
        "by peer [127.0.0.1]:2954. This is typically caused by a remote worker crashing. Check the logs of the "
        "remote worker before reporting an error. GLHF! \U0001f3d6\ufe0f")


def _failure(tmp_path: Path, name: str, message: str | None, *, exitcode: int = 1, ts: int = 100,
             stack: str = "") -> ProcessFailure:
    error_file = tmp_path / f"{name}.json"
    if message is not None:  # what torch's @record writes
        error_file.write_text(json.dumps({"message": {"message": message, "extraInfo": {
            "py_callstack": stack, "timestamp": str(ts)}}}))
    return ProcessFailure(local_rank=0, pid=1000 + ts, exitcode=exitcode, error_file=str(error_file))


def test_the_raising_rank_is_the_root_cause_even_when_a_peer_failed_first(tmp_path: Path) -> None:
    raised = _failure(tmp_path, "r1", "ValueError: bad batch 1234 in shard 7", ts=101, stack=USER_STACK)
    peer = _failure(tmp_path, "r0", GLOO, ts=100, stack="Traceback (most recent call last):\n" + GLOO)
    outcome = _failure_outcome({0: peer, 1: raised}, restarts=0, node="node1")
    assert outcome.exit_code == 1
    assert outcome.summary == ("rank 1 on node1 failed: ValueError: bad batch 1234 in shard 7 (train.py:42); "
                               "rank(s) 0 stopped after it (their collectives failed when it went away); "
                               "job failed after 0 restart(s)")
    assert "{" not in outcome.summary and "GLHF" not in outcome.summary


def test_the_report_prints_the_root_cause_traceback_once_trimmed_to_the_script(tmp_path: Path) -> None:
    raised = failure_report.from_process_failure(
        1, _failure(tmp_path, "r1", "ValueError: bad batch 1234 in shard 7", stack=USER_STACK), "node1")
    peer = failure_report.from_process_failure(0, _failure(tmp_path, "r0", GLOO, stack=GLOO), "node0")
    text = failure_report.report([peer, raised], restarts=2)
    assert text.count("Traceback (most recent call last)") == 1
    assert 'File "/jobs/train.py", line 42' in text
    assert "_worker_boot" not in text and "runpy" not in text and "errors/__init__" not in text
    assert "Connection closed" not in text  # the consequence is summarised, not printed
    assert text.splitlines()[-1].endswith("job failed after 2 restart(s)")


def test_a_peer_error_is_cleaned_of_gloo_noise(tmp_path: Path) -> None:
    peer = failure_report.from_process_failure(0, _failure(tmp_path, "r0", GLOO), "node0")
    assert peer.consequential
    assert peer.error == "RuntimeError: Connection closed by peer [127.0.0.1]:2954."


def test_a_signal_and_a_plain_exit_code_read_as_such(tmp_path: Path) -> None:
    killed = failure_report.from_process_failure(3, _failure(tmp_path, "k", None, exitcode=-9), "host-a")
    exited = failure_report.from_process_failure(0, _failure(tmp_path, "e", None, exitcode=7), "host-a")
    assert killed.describe() == "rank 3 on host-a was killed by SIGKILL"
    assert exited.describe() == "rank 0 on host-a exited with code 7"
    assert _failure_outcome({3: _failure(tmp_path, "k", None, exitcode=-9)}, 1, "h").exit_code == 128 + 9


def test_an_outcome_file_round_trips_for_the_local_launcher(tmp_path: Path) -> None:
    raised = failure_report.from_process_failure(
        1, _failure(tmp_path, "r1", "ValueError: x", ts=int(time.time()), stack=USER_STACK), "node1")
    path = str(tmp_path / "node1.json")
    failure_report.write_outcome(path, exit_code=1, summary="s", restarts=0, failures=[raised])
    data = failure_report.read_outcome(path)
    assert data is not None and data["failures"] == [raised]
    assert failure_report.read_outcome(str(tmp_path / "missing.json")) is None


def test_a_killed_nodes_temp_dir_is_removed_at_the_next_start(tmp_path: Path, monkeypatch) -> None:
    import subprocess
    import sys
    import tempfile

    from elastictrain import node_setup

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f"elastictrain-node-{dead.pid}-abc"
    (stale / "logs").mkdir(parents=True)
    live = tmp_path / "elastictrain-node-1-xyz"  # pid 1 is alive
    live.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    made = node_setup._node_temp_dir()
    assert not stale.exists() and live.exists()
    assert Path(made).name.startswith(f"elastictrain-node-{__import__('os').getpid()}-")


def test_a_killed_forkservers_pymp_dir_is_removed_and_a_live_one_kept(tmp_path: Path, monkeypatch) -> None:
    import socket
    import tempfile

    from elastictrain import node_setup

    stale, live = tmp_path / "pymp-stale", tmp_path / "pymp-live"
    stale.mkdir()
    live.mkdir()
    dead_sock = socket.socket(socket.AF_UNIX)
    dead_sock.bind(str(stale / "listener-1"))
    dead_sock.close()  # bound, never listening: what a killed forkserver leaves
    live_sock = socket.socket(socket.AF_UNIX)
    live_sock.bind(str(live / "listener-2"))
    live_sock.listen()
    try:
        monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
        node_setup._node_temp_dir()
        assert not stale.exists() and live.exists()
    finally:
        live_sock.close()


def test_a_forkserver_in_another_network_namespace_keeps_its_pymp_dir(tmp_path: Path, monkeypatch) -> None:
    # /proc/net/unix lists the reader's network namespace only: a node started in another one
    # (the chaos harness runs nodes in their own) must not take a live forkserver for dead.
    import subprocess
    import sys
    import tempfile

    from elastictrain import node_setup

    live = tmp_path / "pymp-elsewhere"
    live.mkdir()
    listener = live / "listener-3"
    bind_and_wait = (f"import socket, sys, time; s = socket.socket(socket.AF_UNIX); s.bind({str(listener)!r}); "
                     "s.listen(); print('bound', flush=True); time.sleep(60)")
    try:
        proc = subprocess.Popen(["unshare", "--net", sys.executable, "-c", bind_and_wait],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    except FileNotFoundError:
        pytest.skip("needs unshare (util-linux)")
    try:
        if proc.stdout.readline().strip() != "bound":
            pytest.skip(f"cannot make a network namespace here: {proc.stderr.read().strip()[:200]}")
        monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
        node_setup._node_temp_dir()
        assert live.exists() and listener.exists()
    finally:
        proc.kill()
        proc.wait()
