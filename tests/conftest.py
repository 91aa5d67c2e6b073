"""Shared fixtures: a real etcd server per test session, unique run ids, free ports."""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest

from elastictrain.errors import EtcdServerError
from elastictrain.etcd import EtcdClient, EtcdServer, EtcdServerOptions, EtcdSettings, parse_endpoints

REPO_ROOT = Path(__file__).resolve().parent.parent
_counter = itertools.count()


def _start_server(tmp: Path) -> EtcdServer:
    try:
        # Test data is thrown away: skip fsync, as a private etcd does.
        server = EtcdServer(EtcdServerOptions(data_dir=str(tmp / "etcd-data"), durable=False))
    except EtcdServerError as exc:
        pytest.fail(f"{exc} (the test extra installs it: pip install -e '.[test]')", pytrace=False)
    return server.start()


_OPT_IN = {
    "soak": "soak run: select it with `pytest -m soak`",
    "slow": "slow end-to-end check kept out of the default suite: select it with `pytest -m slow`",
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``soak`` or ``slow`` run only when the marker expression names them."""
    chosen = config.getoption("markexpr") or ""
    for marker, reason in _OPT_IN.items():
        if marker in chosen:
            continue
        for item in items:
            if item.get_closest_marker(marker) is not None:
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def etcd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    """One etcd for the session; tests keep apart through unique run ids."""
    server = _start_server(tmp_path_factory.mktemp("etcd"))
    yield server
    server.stop()


@pytest.fixture
def private_etcd(tmp_path: Path) -> Iterator[EtcdServer]:
    """An etcd of this test's own, for tests that kill or restart it."""
    server = _start_server(tmp_path)
    yield server
    server.stop()


@pytest.fixture
def run_id() -> str:
    return f"test-{os.getpid()}-{next(_counter)}-{uuid.uuid4().hex[:6]}"


def make_client(endpoint: str, retry_deadline: float = 10.0) -> EtcdClient:
    return EtcdClient(
        EtcdSettings(
            endpoints=tuple(parse_endpoints(endpoint)),
            retry_deadline=timedelta(seconds=retry_deadline),
            request_timeout=timedelta(seconds=2),
        )
    )


@pytest.fixture
def etcd_client(etcd_server: EtcdServer) -> Iterator[EtcdClient]:
    client = make_client(etcd_server.endpoint)
    yield client
    client.close()


def subprocess_env(**extra: str) -> dict[str, str]:
    """Environment for child processes: this interpreter's scripts dir first on PATH."""
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def _signal(pid: int, sig: signal.Signals) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


# The longest a hang report takes (gdb on every process, then their Python stacks): a test's
# pytest timeout must exceed the time it gives a job by this much, or pytest-timeout cuts the
# report short and the hang is lost (seen: a job timeout of 140 s under a test timeout of 150 s).
HANG_REPORT_S = 25


def _native_stacks(pids: list[int], budget: float = HANG_REPORT_S - 5) -> str:
    """gdb's backtrace of every thread of ``pids`` (where gdb is installed), in ``budget``
    seconds at most: what a process blocked in C++ (a collective, a store, a join) waits on,
    which faulthandler cannot show."""
    import shutil

    if shutil.which("gdb") is None:
        return ""
    deadline = time.monotonic() + budget
    out = []
    for pid in pids:
        left = deadline - time.monotonic()
        if left < 1:
            out.append(f"--- no time left for gdb on {pid} ---")
            continue
        try:
            trace = subprocess.run(["gdb", "-p", str(pid), "-batch", "-ex", "thread apply all bt 25"],
                                   capture_output=True, text=True, timeout=left).stdout
        except subprocess.TimeoutExpired:
            out.append(f"--- gdb on {pid} did not finish in {left:.0f}s ---")
            continue
        frames = [line for line in trace.splitlines() if line.startswith(("#", "Thread "))]
        out.append(f"--- native stacks of {pid} ---\n" + "\n".join(frames[:300]))
    return "\n".join(out)


def _pythons_deepest_first(pids: list[int]) -> list[int]:
    """The Python processes of ``pids`` (a process tree, parents first), deepest first:
    workers before their agents."""

    def is_python(pid: int) -> bool:
        try:
            return "python" in os.path.basename(os.readlink(f"/proc/{pid}/exe"))
        except OSError:
            return False

    return [pid for pid in reversed(pids) if is_python(pid)]


def run_reporting_hangs(args: list[str], *, timeout: float, env: dict[str, str] | None = None,
                        cwd: Path | str | None = None) -> subprocess.CompletedProcess[str]:
    """``subprocess.run(args, capture_output=True, text=True)``; a command that outlives
    ``timeout`` fails the test as :func:`communicate_reporting_hangs` says."""
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=hang_reporting_env(env), cwd=cwd)
    [(out, err)] = communicate_reporting_hangs([proc], timeout=timeout)
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


def hang_reporting_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: :func:`subprocess_env`) with faulthandler on: SIGABRT prints every thread's stack."""
    return {**(env if env is not None else subprocess_env()), "PYTHONFAULTHANDLER": "1"}


_test_timeout: float | None = None  # pytest-timeout's limit for the test now running


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    global _test_timeout
    marker = item.get_closest_marker("timeout")
    limit = marker.args[0] if marker is not None and marker.args else (
        item.config.getoption("timeout", None) or item.config.getini("timeout"))
    _test_timeout = float(limit) if limit else None


def communicate_reporting_hangs(procs: list[subprocess.Popen[str]], *, timeout: float) -> list[tuple[str, str]]:
    """Each process's (stdout, stderr) once all have exited (started with :func:`hang_reporting_env`).
    If any outlives ``timeout``, every Python process under each one still running prints its
    threads' stacks (SIGABRT with faulthandler on), deepest first, and the test fails with all
    their output: where a job hung. ``timeout`` must leave the test :data:`HANG_REPORT_S` for that."""
    if _test_timeout and timeout + HANG_REPORT_S > _test_timeout:
        raise AssertionError(f"a {timeout:g}s wait under a {_test_timeout:g}s test timeout leaves no time to report "
                             f"a hang: wait at most {_test_timeout - HANG_REPORT_S:g}s, or raise the test's timeout")
    deadline = time.monotonic() + timeout
    outputs: list[tuple[str, str]] = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=max(0.1, deadline - time.monotonic())))
    except subprocess.TimeoutExpired:
        pass
    else:
        return outputs
    fail_with_stacks(procs, outputs, f"still running after {timeout:g}s")


def fail_with_stacks(procs: list[subprocess.Popen[str]], outputs: list[tuple[str, str]], why: str) -> None:
    """Fail the test: ``why``, the output of the first ``len(outputs)`` processes (which have
    exited), then each other one's output and its processes' stacks; those are killed."""
    from elastictrain.chaos.processes import descendants

    report = []
    for proc in procs[len(outputs):]:
        everyone = [*descendants(proc.pid), proc.pid]
        below = _pythons_deepest_first(everyone[:-1])
        report.append(_native_stacks(below))
        for pid in [*below, proc.pid]:
            _signal(pid, signal.SIGABRT)
            time.sleep(0.3)  # one dump at a time
        for pid in everyone:  # etcd, and anything the dumps left, holds the pipes open
            _signal(pid, signal.SIGKILL)
        out, err = proc.communicate()
        report.append(f"--- {' '.join(map(str, proc.args[2:]))[:300]} ---\n{(out or '')[-60000:]}\n"
                      f"{(err or '')[-60000:]}")
    finished = "".join(f"--- exited {code} ---\n{(out or '')[-3000:]}{(err or '')[-3000:]}\n"
                       for (out, err), code in zip(outputs, (p.returncode for p in procs)))
    pytest.fail(f"{why}; the output of those that exited, then of each one still running with its "
                f"processes' stacks:\n{finished}" + "\n".join(report), pytrace=False)


@pytest.fixture(autouse=True)
def _restore_elastictrain_logging() -> Iterator[None]:
    """Tests that run the CLI in-process let it configure logging the way it does for a
    real process; undo that, so later tests see the library's default logging."""
    import logging

    names = ("elastictrain", "elastictrain.events")
    saved = {n: (list(logging.getLogger(n).handlers), logging.getLogger(n).level, logging.getLogger(n).propagate)
             for n in names}
    yield
    for name, (handlers, level, propagate) in saved.items():
        logger = logging.getLogger(name)
        logger.handlers[:] = handlers
        logger.setLevel(level)
        logger.propagate = propagate


@pytest.fixture(autouse=True)
def _restore_environment() -> Iterator[None]:
    """Code under test sets this process's environment as it does a real worker's or node's:
    the CLI run in-process (ELASTICTRAIN_NODE, the event log, the control channel), a group
    keeper after a re-formation (RANK, WORLD_SIZE, MASTER_PORT, ...). Undo it, so that a later
    test's subprocesses do not inherit a job that is gone (seen: a rendezvous at 127.0.0.1:1)."""
    saved = dict(os.environ)
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)
