"""What a node sets up before its agent imports torch (``elastictrain.node_setup``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from elastictrain import node_setup


@pytest.mark.parametrize(("idle_ticks", "spare"), [(20, True), (16, True), (15, False), (10, False), (0, False)])
def test_the_forkserver_starts_before_torch_only_with_more_than_one_idle_core(
        monkeypatch: pytest.MonkeyPatch, idle_ticks: int, spare: bool) -> None:
    # 2 cores, 20 ticks of CPU time in the window: the agent's own import takes one core, the
    # forkserver's must find another mostly idle.
    readings = iter([(1000, 5000), (1000 + idle_ticks, 5020)])
    monkeypatch.setattr(node_setup, "_cpu_times", lambda: next(readings))
    monkeypatch.setattr(node_setup.os, "cpu_count", lambda: 2)
    assert node_setup.core_to_spare(window=0) is spare


def test_cpu_times_are_read_from_proc_stat() -> None:
    idle, total = node_setup._cpu_times()  # noqa: SLF001
    assert 0 < idle <= total


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
