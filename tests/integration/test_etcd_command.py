"""``elastictrain etcd``: a port already served, a host other machines reach, IPv6, its data dir."""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from elastictrain.etcd.server import EtcdServer, free_port
from tests.conftest import make_client, subprocess_env
from tests.integration.test_operations import cli
from tests.support.read_only import read_only_dir


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as sock:
            sock.bind(("::1", 0))
    except OSError:
        return False
    return True


needs_ipv6 = pytest.mark.skipif(not _has_ipv6_loopback(), reason="this machine has no IPv6 loopback (::1)")


def etcd_command(*args: str, cwd: Path, **env: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "elastictrain", "etcd", *args], env=subprocess_env(**env), cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def stop(proc: subprocess.Popen[str]) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


Serve = Callable[..., tuple[subprocess.Popen[str], str]]


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Serve]:
    """``serve(*args)`` starts ``elastictrain etcd ARGS`` in ``tmp_path`` and returns it with its first
    line of output; whatever still runs at the end is stopped with SIGTERM."""
    procs: list[subprocess.Popen[str]] = []

    def start(*args: str) -> tuple[subprocess.Popen[str], str]:
        proc = etcd_command(*args, cwd=tmp_path)
        procs.append(proc)
        assert proc.stdout is not None and proc.stderr is not None
        line = proc.stdout.readline()
        if "etcd serving at" not in line:
            stop(proc)
            raise AssertionError(f"not serving: {line!r} {proc.stderr.read()[-2000:]}")
        return proc, line

    yield start
    for proc in procs:
        stop(proc)


def error_lines(proc: subprocess.Popen[str], timeout: float = 60) -> tuple[int, list[str]]:
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop(proc)
        raise AssertionError("`elastictrain etcd` kept running instead of refusing") from None
    return proc.returncode, err.strip().splitlines()


def test_a_port_another_etcd_serves_is_refused_in_one_line(etcd_server: EtcdServer, tmp_path: Path) -> None:
    temp = tmp_path / "tmp"
    temp.mkdir()
    code, err = error_lines(etcd_command("--port", str(etcd_server.options.client_port), cwd=tmp_path,
                                         TMPDIR=str(temp)))
    assert code == 1
    assert err == [f"elastictrain: error: cannot serve etcd's client port on {etcd_server.endpoint}: Address already "
                   "in use (another etcd, or another program, may listen there)"]
    assert list(temp.iterdir()) == []  # no temporary data dir left behind for a server that never ran


def test_serving_other_hosts_without_tls_is_refused_unless_insecure(tmp_path: Path) -> None:
    port = free_port()
    code, err = error_lines(etcd_command("--host", "0.0.0.0", "--port", str(port), cwd=tmp_path))
    assert code == 2
    assert err == [f"elastictrain: error: refusing to serve etcd on 0.0.0.0 without TLS and client certificates: "
                   f"whoever reaches port {port} could read, rewrite or stop every run; pass --cert-file, --key-file, "
                   "--trusted-ca-file and --client-cert-auth, or --insecure on a trusted network"]


def test_serving_other_hosts_keeps_its_data_on_disk_and_fsyncs(serve: Serve, tmp_path: Path) -> None:
    port = free_port()
    proc, line = serve("--host", "0.0.0.0", "--port", str(port), "--insecure")
    assert f"data in elastictrain-runs/etcd-{port} (kept, fsynced)" in line
    etcd_pid = re.search(r"\(pid (\d+)\)", line).group(1)  # type: ignore[union-attr]
    assert "--unsafe-no-fsync" not in Path(f"/proc/{etcd_pid}/cmdline").read_bytes().decode().split("\0")
    client = make_client(f"127.0.0.1:{port}")
    client.call(lambda c: c.put("/elastictrain/durable-probe", "kept"))
    client.close()
    assert stop(proc) == 0
    serve("--host", "0.0.0.0", "--port", str(port), "--insecure")  # the same (default) data dir
    client = make_client(f"127.0.0.1:{port}")
    assert client.call(lambda c: c.get("/elastictrain/durable-probe"))[0] == b"kept"
    client.close()


def test_an_unwritable_data_dir_is_refused_in_one_line(tmp_path: Path) -> None:
    with read_only_dir(tmp_path / "ro") as ro:
        code, err = error_lines(etcd_command("--port", str(free_port()), "--data-dir", str(ro / "data"),
                                             cwd=tmp_path))
    assert code == 2
    assert len(err) == 1, err
    # "Read-only file system" for root (a read-only mount), "Permission denied" for others.
    assert err[0].startswith(f"elastictrain: error: --data-dir '{ro / 'data'}' is not a writable directory: ")


@pytest.mark.parametrize(("flags", "message"), [
    (["--cert-file", "server.crt"], "--cert-file and --key-file go together"),
    (["--client-cert-auth"], "--client-cert-auth needs --trusted-ca-file"),
    (["--cert-file", "nope.crt", "--key-file", "nope.key"], "cannot read --cert-file 'nope.crt': No such file"),
], ids=["cert-without-key", "client-cert-auth-without-ca", "missing-cert-file"])
def test_bad_tls_flags_are_refused_in_one_line(flags: list[str], message: str, tmp_path: Path) -> None:
    code, err = error_lines(etcd_command("--port", str(free_port()), *flags, cwd=tmp_path))
    assert code == 2
    assert len(err) == 1 and message in err[0], err


@needs_ipv6
def test_serves_on_ipv6_loopback_and_a_bracketed_endpoint_reaches_it(serve: Serve) -> None:
    port = free_port("::1")
    _, line = serve("--host", "::1", "--port", str(port))
    assert f"etcd serving at [::1]:{port}" in line
    listing = cli("status", "--etcd", f"[::1]:{port}", "--all", "--rdzv-conf", "retry_deadline=10")
    assert listing.returncode == 0, listing.stderr
