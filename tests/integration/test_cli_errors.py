"""Bad input: one line on stderr, a non-zero exit, no traceback, nothing started."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from elastictrain._addresses import is_loopback
from elastictrain.launch.cli import main
from tests.conftest import REPO_ROOT, subprocess_env
from tests.support.read_only import read_only_dir

SCRIPT = str(REPO_ROOT / "examples" / "mlp.py")

CASES = [
    (["run", "--min-nodes", "3", "--max-nodes", "2", SCRIPT], 2, "--min-nodes (3) must not exceed --max-nodes (2)"),
    (["run", "--min-nodes", "0", SCRIPT], 2, "--min-nodes: expected a positive integer, got '0'"),
    (["run", "--nproc-per-node", "-1", SCRIPT], 2, "--nproc-per-node: expected a positive integer"),
    (["run", "--max-restarts", "x", SCRIPT], 2, "--max-restarts: expected a non-negative integer"),
    (["run", "missing_script.py"], 2, "training script 'missing_script.py' does not exist"),
    (["run", str(REPO_ROOT / "pyproject.toml")], 2, "is not a Python file"),
    (["run", "--etcd", "host:notaport", "--run-id", "x", SCRIPT], 2, "malformed etcd endpoint 'host:notaport'"),
    (["run", "--etcd", "a:1,,b:2", "--run-id", "x", SCRIPT], 2, "empty endpoint"),
    # A host that cannot be one was tried for the whole retry deadline (10 s for status), and
    # only then named, as unreachable.
    (["status", "--etcd", "127.0.0.1:2379:2379", "--run-id", "x"], 2,
     "malformed etcd endpoint '127.0.0.1:2379:2379': '127.0.0.1:2379:2379' is not an IPv6 address"),
    (["status", "--etcd", "[fe80::1:2379", "--run-id", "x"], 2, "malformed etcd endpoint '[fe80::1:2379': no ']'"),
    (["status", "--etcd", "etcd host:2379", "--run-id", "x"], 2,
     "malformed etcd endpoint 'etcd host:2379': host 'etcd host' may hold only letters, digits"),
    (["run", "--etcd", "127.0.0.1:2379", SCRIPT], 2, "--run-id is required with --etcd"),
    (["run", "--run-id", "a/b", SCRIPT], 2, "run id 'a/b' may hold only"),
    (["run", "--min-nodes", "2", SCRIPT], 2, "pass --local-nodes 2"),
    (["run", "--rdzv-conf", "last_call_timeout=abc", SCRIPT], 2, "last_call_timeout must be a number of seconds"),
    (["run", "--rdzv-conf", "keep_alive_max_attempt=1", SCRIPT], 2, "keep_alive_max_attempt must be at least 2"),
    (["run", "--rdzv-conf", "keep_alive_interval=0.3,keep_alive_max_attempt=3", SCRIPT], 2,
     "keep_alive_interval x keep_alive_max_attempt must be at least 2 s, got 0.9 s"),
    (["frobnicate"], 2, "invalid choice: 'frobnicate'"),
    (["run", "--last-call-timeout", "inf", SCRIPT], 2, "last_call_timeout must be at most 1e+09 s (about 31 years), got inf"),
    (["run", "--rdzv-conf", "join_timeout=1e20", SCRIPT], 2, "join_timeout must be at most 1e+09 s (about 31 years), got '1e20'"),
    (["run", str(REPO_ROOT / "examples")], 2, "training script '" + str(REPO_ROOT / "examples") + "' is a directory"),
    (["run", "--rdzv-conf", "bogus_key=1", SCRIPT], 2,
     "argument --rdzv-conf: unknown key 'bogus_key'; valid keys: join_timeout, last_call_timeout, "
     "keep_alive_interval, keep_alive_max_attempt, state_ttl, request_timeout, retry_deadline, "
     "ca_cert, client_cert, cert, client_key, key, user, password"),
    (["status", "--etcd", "127.0.0.1:1", "--all", "--rdzv-conf", "retry_deadline=1,timeout=3"], 2,
     "argument --rdzv-conf: unknown key 'timeout'; valid keys: join_timeout"),
    # Each of these used to end in a traceback, a hang or a contradiction (found by probing the CLI).
    (["run", "--metrics-port", "70000", SCRIPT], 2, "--metrics-port: expected a port (1-65535) integer, got '70000'"),
    (["run", "--local-nodes", "3", "--metrics-port", "65534", SCRIPT], 2, "needs ports up to 65536, beyond 65535"),
    (["etcd", "--port", "70000"], 2, "--port: expected a port (1-65535) integer, got '70000'"),
    (["run", "--join-timeout", "0", SCRIPT], 2, "join_timeout (--join-timeout) must be positive, got 0 s"),
    (["run", "-m", "no_such_module_xyz"], 2, "no module named 'no_such_module_xyz' in the working directory"),
    (["run", "--log-dir", str(REPO_ROOT / "pyproject.toml"), SCRIPT], 2, "is a file, not a directory"),
    (["run", "--local-addr", "not_an_addr.invalid", SCRIPT], 2,
     "--local-addr 'not_an_addr.invalid' does not resolve to an address"),
    (["run"], 2, "the following arguments are required: script"),
    (["run", "--event-log", str(REPO_ROOT / "pyproject.toml" / "events.jsonl"), SCRIPT], 2,
     "a file stands where its directory would be"),
    (["status", "--etcd", "127.0.0.1:1", "--run-id", "x", "--checkpoint-dir", "/nonexistent"], 2,
     "--checkpoint-dir '/nonexistent' is not a directory"),
    # --all lists every run: a run id or a checkpoint with it was silently ignored.
    (["status", "--etcd", "127.0.0.1:1", "--all", "--run-id", "x"], 2,
     "--all lists every run: pass --run-id x without --all to show that run"),
    (["status", "--etcd", "127.0.0.1:1", "--all", "--checkpoint-dir", "/tmp"], 2,
     "--checkpoint-dir goes with --run-id, not --all"),
]


@pytest.mark.parametrize(("argv", "code", "message"), CASES, ids=[" ".join(c[0][:3]) for c in CASES])
def test_bad_input_prints_one_line_and_exits_non_zero(
    argv: list[str], code: int, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == code
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("elastictrain: error: ")
    assert message in err[0]


def test_unreachable_etcd_names_the_endpoint_and_exits_one(capsys: pytest.CaptureFixture[str]) -> None:
    from elastictrain.etcd.server import free_port

    port = free_port()
    argv = ["run", "--etcd", f"127.0.0.1:{port}", "--run-id", "x", "--rdzv-conf", "retry_deadline=1", SCRIPT]
    assert main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    # While it retries, the endpoint is named at once (issue 17); then one line for the error.
    assert all(f"etcd at 127.0.0.1:{port} does not answer connecting" in line for line in err[:-1]), err
    assert f"etcd unreachable for connecting after 1s: 127.0.0.1:{port}" in err[-1]
    assert "Connection refused" in err[-1]


def test_bad_input_in_a_real_process_shows_no_traceback(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "elastictrain", "run", "--min-nodes", "3", "--max-nodes", "2", SCRIPT],
        capture_output=True, text=True, timeout=60, env=subprocess_env(),
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [
        "elastictrain: error: --min-nodes (3) must not exceed --max-nodes (2)"
    ]


def test_flags_fall_back_to_environment_variables(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("ELASTICTRAIN_MIN_NODES", "3")
    monkeypatch.setenv("ELASTICTRAIN_MAX_NODES", "2")
    assert main(["run", SCRIPT]) == 2
    assert "--min-nodes (3) must not exceed --max-nodes (2)" in capsys.readouterr().err
    # A flag beats the variable.
    assert main(["run", "--max-nodes", "4", "--min-nodes", "5", SCRIPT]) == 2
    assert "--min-nodes (5) must not exceed --max-nodes (4)" in capsys.readouterr().err


@pytest.mark.skipif(not is_loopback(socket.getfqdn()), reason="this host's FQDN is not a loopback name")
def test_a_loopback_node_address_is_refused_when_etcd_is_elsewhere(capsys: pytest.CaptureFixture[str]) -> None:
    # An etcd name that does not resolve here leaves the FQDN as the node's address: a loopback one on this host.
    argv = ["run", "--etcd", "etcd.example.invalid:2379", "--run-id", "x", SCRIPT]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    # The message says first that etcd's name does not resolve (it blamed only the node's address before).
    assert err == ["elastictrain: error: etcd (etcd.example.invalid:2379) does not resolve to an address here, and "
                   f"this host's own name is {socket.getfqdn()!r}, a loopback address: check --etcd, or pass "
                   "--local-addr with an address the other nodes can reach"]


def test_an_unwritable_event_log_is_refused_before_anything_starts(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    with read_only_dir(tmp_path / "ro") as ro:
        assert main(["run", "--event-log", str(ro / "events.jsonl"), SCRIPT]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith(f"elastictrain: error: cannot write the event log '{ro / 'events.jsonl'}': ")
    assert err[0].endswith("; pass --event-log with a path in a writable directory")


def test_the_default_event_log_in_a_read_only_directory_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("ELASTICTRAIN_EVENT_LOG", raising=False)
    with read_only_dir(tmp_path / "ro") as ro, monkeypatch.context() as cwd:
        cwd.chdir(ro)  # (left before the directory is unmounted)
        assert main(["run", SCRIPT]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("elastictrain: error: cannot write the event log 'elastictrain-runs/local/events.jsonl': ")


def test_an_unwritable_chaos_run_dir_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from elastictrain.chaos.__main__ import main as chaos_main

    with read_only_dir(tmp_path / "ro") as ro:
        assert chaos_main(["--run-dir", str(ro / "chaos"), "--schedule", "kill_worker@2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith(f"elastictrain chaos: error: --run-dir '{ro / 'chaos'}' is not a writable directory: ")


def test_a_reader_that_goes_away_ends_status_quietly(etcd_server: Any) -> None:
    # `elastictrain status ... | head -1`: the reader closes the pipe before we write.
    proc = subprocess.Popen([sys.executable, "-m", "elastictrain", "status", "--etcd", etcd_server.endpoint, "--all"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=subprocess_env(), text=True)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=60) == 128 + signal.SIGPIPE
    assert err == ""


def test_status_and_stop_give_up_on_an_etcd_that_does_not_answer_after_ten_seconds(
        capsys: pytest.CaptureFixture[str]) -> None:
    # A wrong --etcd port is reported while the user still waits for the answer; a node keeps
    # retrying for 30 s (an etcd restart under a running job), a one-off query need not.
    from elastictrain.etcd.server import free_port

    port = free_port()
    assert main(["status", "--etcd", f"127.0.0.1:{port}", "--run-id", "x"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert f"etcd unreachable for connecting after 10s: 127.0.0.1:{port}" in err[-1], err
    # Its own --rdzv-conf retry_deadline still wins.
    assert main(["stop", "--etcd", f"127.0.0.1:{port}", "--run-id", "x", "--rdzv-conf", "retry_deadline=1"]) == 1
    assert f"after 1s: 127.0.0.1:{port}" in capsys.readouterr().err.strip().splitlines()[-1]
