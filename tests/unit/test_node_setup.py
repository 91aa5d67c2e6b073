"""What a node sets up for its workers (``elastictrain.launch.node_setup``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from elastictrain.launch import node_setup


_FORKSERVER_PROBE = r"""
import json, logging, multiprocessing, multiprocessing.util, os, signal, sys, tempfile, threading, time
import torch
from elastictrain.launch import _logging, node_setup

def report(queue):
    import torch._dynamo  # preloaded: already there
    sys.stdout.flush()  # what every worker does as it ends
    queue.put({"pid": os.getpid(), "ppid": os.getppid(), "tempdir": tempfile.gettempdir(),
               "handlers": len(logging.getLogger("elastictrain").handlers),
               "level": logging.getLogger("elastictrain").level,
               "marker": getattr(torch, "_probe_marker", None),
               "python_sigint": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
               "default_sigterm": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL})

if __name__ == "__main__":
    mode = sys.argv[1]
    _logging.setup()
    torch._probe_marker = "set in the agent"  # only a fork of this process has it
    multiprocessing.util.get_temp_dir()  # as prepare() does: the socket's path must stay short
    tempfile.tempdir = sys.argv[2]  # the node's own temporary directory
    sys.stdout.write("written by the agent, not flushed yet\n")  # stdout is a pipe: buffered
    if mode == "thread":
        threading.Thread(target=time.sleep, args=(30,), daemon=True).start()
    signal.signal(signal.SIGTERM, lambda *_: print("the agent's handler"))  # as the CLI sets one
    mark = os.path.join(sys.argv[2], "preloading")
    if mode == "ctrl-c":  # a preload slow enough to be interrupted
        os.environ["PRELOAD_MARK"] = mark
        node_setup._FORKSERVER_PRELOAD = ["slow_preload"]
    forked = node_setup.start_forkserver(tempdir=None)
    if mode == "ctrl-c":
        while not os.path.exists(mark):
            time.sleep(0.01)
        os.kill(multiprocessing.forkserver._forkserver._forkserver_pid, signal.SIGINT)
    context = multiprocessing.get_context("forkserver")
    queue = context.SimpleQueue()
    worker = context.Process(target=report, args=(queue,))
    worker.start()
    out = queue.get()
    worker.join()
    server = multiprocessing.forkserver._forkserver._forkserver_pid
    with open(f"/proc/{server}/cmdline", "rb") as f:
        cmdline = f.read().replace(b"\0", b" ").decode()
    print(json.dumps(dict(out, forked=forked, server=server, agent=os.getpid(), cmdline=cmdline,
                          exitcode=worker.exitcode)), flush=True)
"""


def _probe_forkserver(tmp_path: Path, mode: str) -> tuple[dict, str]:
    import json
    import os
    import subprocess
    import sys

    script = tmp_path / "probe.py"
    script.write_text(_FORKSERVER_PROBE)
    (tmp_path / "slow_preload.py").write_text(
        "import os, time\nopen(os.environ['PRELOAD_MARK'], 'w').close()\ntime.sleep(1.5)\n")
    node_temp = tmp_path / "node-temp"
    node_temp.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # stdout buffered, as by default
    done = subprocess.run([sys.executable, str(script), mode, str(node_temp)], capture_output=True, text=True,
                          timeout=120, check=False, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stdout


def test_the_workers_forkserver_is_a_fork_of_the_agent_that_forgets_its_logging_and_temp_dir(tmp_path: Path) -> None:
    """The forkserver is forked from the agent once torch is imported there (no second import of
    torch), and its workers start as they would from a fresh interpreter: no agent log handler
    (the session installs its own), and the machine's temporary directory, not the node's."""
    import tempfile

    out, stdout = _probe_forkserver(tmp_path, "single-thread")
    assert out["forked"] is True
    assert stdout.count("written by the agent") == 1  # not again by a worker's flush
    assert out["marker"] == "set in the agent"  # the worker's torch is the agent's, imported once
    assert out["ppid"] == out["server"] and out["server"] != out["agent"]
    assert node_setup.FORKSERVER_TITLE in out["cmdline"]
    assert out["handlers"] == 0 and out["level"] == 0  # _logging.setup() undone
    assert out["tempdir"] == tempfile.gettempdir()
    assert out["exitcode"] == 0
    assert out["python_sigint"] and out["default_sigterm"]  # not the agent's handlers


def test_a_ctrl_c_while_the_forkserver_imports_is_left_to_the_agent(tmp_path: Path) -> None:
    """Ctrl-C in a job's first seconds reached the forkserver (a fork of the agent, in its
    process group) while it imported torch._dynamo: a KeyboardInterrupt traceback, and no
    forkserver. It now ignores SIGINT until it serves; its workers get Python's handler."""
    out, _ = _probe_forkserver(tmp_path, "ctrl-c")
    assert out["forked"] is True and out["exitcode"] == 0
    assert out["python_sigint"] and out["default_sigterm"]


def test_an_agent_with_a_thread_running_gets_multiprocessing_s_own_forkserver(tmp_path: Path) -> None:
    """A fork copies one thread only, and the locks the others held: with a second thread
    running, the agent is not forked; multiprocessing spawns a fresh forkserver instead."""
    out, _ = _probe_forkserver(tmp_path, "thread")
    assert out["forked"] is False
    assert out["marker"] is None
    assert "from multiprocessing.forkserver import main" in out["cmdline"]
    assert out["ppid"] == out["server"] and out["exitcode"] == 0


def test_an_agent_holding_the_cuda_driver_open_is_not_forked(tmp_path: Path) -> None:
    """Once the CUDA driver is initialized (its unified-memory device open), a fork of the process
    cannot use CUDA: the agent is then not forked (torch.cuda.is_initialized() would not say)."""
    import os

    fds = tmp_path / "fd"
    fds.mkdir()
    os.symlink("/dev/null", fds / "3")
    os.symlink("/dev/nvidiactl", fds / "4")  # NVML opens this one too: no sign of cuInit
    assert not node_setup._cuda_driver_open(str(fds))
    os.symlink("/dev/nvidia-uvm", fds / "5")
    assert node_setup._cuda_driver_open(str(fds))
    assert not node_setup._cuda_driver_open()


def test_an_agent_whose_stdout_is_gone_still_starts_its_forkserver() -> None:
    """The flush before the fork must not fail the node when its stdout cannot be written
    (a closed descriptor, a reader gone): nothing of it can be written twice then."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    done = subprocess.run([sys.executable, "-c", (
        "import os, sys, torch\n"
        "from elastictrain.launch import node_setup\n"
        "sys.stdout.write('buffered')\n"
        "os.close(1)\n"
        "print('forked', node_setup.start_forkserver(), file=sys.stderr, flush=True)\n")],
        capture_output=True, text=True, timeout=60, env=env, check=False)
    assert "forked True" in done.stderr, done.stderr[-2000:]


def test_a_forked_forkserver_exits_with_its_agent(tmp_path: Path) -> None:
    """The forkserver serves until no client holds its liveness pipe: an agent SIGKILLed leaves
    no forkserver behind (and with it, no worker: they die with their parent)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    agent = subprocess.Popen([sys.executable, "-c", (
        "import os, sys, time, torch\n"
        "from elastictrain.launch import node_setup\n"
        "assert node_setup.start_forkserver()\n"
        "import multiprocessing.forkserver as f\n"
        "print(f._forkserver._forkserver_pid, flush=True)\n"
        "time.sleep(60)\n")], stdout=subprocess.PIPE, text=True)
    try:
        server = int(agent.stdout.readline())
        os.kill(server, 0)  # serving
        agent.send_signal(signal.SIGKILL)
        agent.wait(10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                os.kill(server, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        else:
            pytest.fail(f"forkserver {server} outlived its agent")
    finally:
        agent.kill()
        agent.wait()


def test_a_killed_nodes_temp_dir_is_removed_at_the_next_start(tmp_path: Path, monkeypatch) -> None:
    import subprocess
    import sys
    import tempfile


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


def test_a_forkserver_bound_while_the_sockets_are_read_keeps_its_pymp_dir(tmp_path: Path, monkeypatch) -> None:
    # Two nodes start at once on one host: the other node binds its forkserver's socket in its
    # (already made) pymp dir while this one reads which sockets are bound. Its dir is live.
    import socket
    import tempfile

    racing, stale = tmp_path / "pymp-racing", tmp_path / "pymp-stale"
    racing.mkdir()  # multiprocessing makes the directory first, the forkserver binds in it later
    stale.mkdir()
    dead_sock = socket.socket(socket.AF_UNIX)
    dead_sock.bind(str(stale / "listener-5"))
    dead_sock.close()  # a killed node's: the bound sockets are read
    listener = socket.socket(socket.AF_UNIX)
    read_bound = node_setup._bound_unix_sockets

    def bound_then_the_other_node_binds() -> set[str]:
        bound = read_bound()
        listener.bind(str(racing / "listener-4"))
        listener.listen()
        return bound

    monkeypatch.setattr(node_setup, "_bound_unix_sockets", bound_then_the_other_node_binds)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    try:
        node_setup._node_temp_dir()
        assert (racing / "listener-4").exists() and not stale.exists()
    finally:
        listener.close()


def test_a_worker_whose_start_data_is_gone_says_so_in_one_line() -> None:
    """An agent stopped (SIGTERM, Ctrl-C) while it started its workers unlinks the semaphores it
    sent them; each worker then failed to unpickle them, printing a multiprocessing traceback
    (seen with ``elastictrain run --local-nodes 2`` stopped 2.2 s after its launch)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", (
        "import multiprocessing, multiprocessing.synchronize as s, torch\n"
        "from elastictrain.launch import node_setup\n"
        "class Gone:\n"
        "    def __reduce__(self):  # unpickled in the worker: a lock whose semaphore its agent removed\n"
        "        return (s.Lock.__new__, (s.Lock,), (0, s.SEMAPHORE, 1, '/mp-elastictrain-gone'))\n"
        "if __name__ == '__main__':\n"
        "    assert node_setup.start_forkserver()\n"
        "    worker = multiprocessing.get_context('forkserver').Process(target=print, args=(Gone(),))\n"
        "    worker.start()\n"
        "    worker.join()\n"
        "    print('exitcode', worker.exitcode, flush=True)\n")], capture_output=True, text=True, timeout=60,
        check=False)
    assert "exitcode 1" in done.stdout, done.stdout + done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip().splitlines() == [
        "elastictrain: a worker start was abandoned: the semaphores its agent sent it are gone ([Errno 2] No such "
        "file or directory); the agent stopped meanwhile"], done.stderr
