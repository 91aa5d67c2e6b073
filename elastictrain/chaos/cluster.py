"""The processes of a chaos run: an etcd of 1 or 3 members, and node agents.

Every process gets a parent-death signal (elastictrain's ``dying_with_us``
trampoline, as ``elastictrain run --local-nodes`` does), so a harness that is
killed takes its run with it. Start them from the harness's main thread: the
kernel sends the signal when the *thread* that forked the child exits.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from elastictrain._process import dying_with_us
from elastictrain.errors import EtcdServerError
from elastictrain.etcd.server import EtcdServer, EtcdServerOptions, free_port

__all__ = ["EtcdCluster", "Node"]


class EtcdCluster:
    """``members`` etcd servers on one local address forming one cluster, with data kept across kills.

    Args:
        directory: Data directories and logs go here.
        members: 1 or 3.
        host: The address they listen on: loopback, or the bridge of the nodes' namespaces.
    """

    def __init__(self, directory: Path, members: int = 1, host: str = "127.0.0.1") -> None:
        if members not in (1, 3):
            raise ValueError(f"etcd members must be 1 or 3, got {members}")
        directory.mkdir(parents=True, exist_ok=True)
        ports = [(free_port(host), free_port(host)) for _ in range(members)]
        cluster = ",".join(f"m{i}=http://{host}:{peer}" for i, (_, peer) in enumerate(ports))
        self.servers = [
            EtcdServer(EtcdServerOptions(
                host=host, name=f"m{i}", client_port=client, peer_port=peer, data_dir=str(directory / f"m{i}"),
                log_file=str(directory / f"m{i}.log"), initial_cluster=cluster if members > 1 else None,
                # Throwaway data: fsync only slows a loaded machine. A SIGKILLed
                # member still finds its writes in the page cache on restart.
                durable=False,
                # etcd logs every slow request at info: a soak left a 123 MB log in the run's
                # directory. Warnings and errors still say why a member fell over.
                extra_args=["--log-level", "warn"],
            ))
            for i, (client, peer) in enumerate(ports)
        ]

    @property
    def endpoints(self) -> str:
        """``host:port,...`` of every member, for ``--etcd``."""
        return ",".join(s.endpoint for s in self.servers)

    def start(self, timeout: float = 60.0) -> None:
        """Start every member and wait until the cluster has a leader.

        Raises:
            EtcdServerError: A member exited, or no leader within ``timeout``.
        """
        for server in self.servers:
            server.start(wait=False)
        for server in self.servers:
            server.wait_healthy(timeout)
        self.wait_for_leader(timeout)

    def start_member(self, index: int, timeout: float = 60.0) -> None:
        self.servers[index].start(wait=True, timeout=timeout)

    def kill_member(self, index: int) -> None:
        """SIGKILL one member; its data stays for a restart."""
        self.servers[index].kill(signal.SIGKILL)

    def _status(self, index: int) -> dict[str, str] | None:
        server = self.servers[index]
        if not server.is_running():
            return None
        request = urllib.request.Request(f"{server.client_url}/v3/maintenance/status", data=b"{}",
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=2) as response:
                answer = json.loads(response.read())
        except (OSError, ValueError):
            return None
        return {"member": str(answer.get("header", {}).get("member_id", "")), "leader": str(answer.get("leader", ""))}

    def leader(self) -> int | None:
        """Index of the member that is leader now, or None if none answers as one."""
        for index in range(len(self.servers)):
            status = self._status(index)
            if status and status["leader"] and status["member"] == status["leader"]:
                return index
        return None

    def wait_for_leader(self, timeout: float = 60.0) -> int:
        """Block until some member leads.

        Raises:
            EtcdServerError: No leader within ``timeout``.
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = self.leader()
            if found is not None:
                return found
            time.sleep(0.1)
        raise EtcdServerError(f"etcd cluster {self.endpoints} elected no leader within {timeout:g}s")

    def stop(self) -> None:
        for server in self.servers:
            server.kill(signal.SIGKILL)


@dataclass
class Node:
    """One ``elastictrain run`` agent process of the job."""

    name: str
    proc: subprocess.Popen[bytes]
    log: Path
    started: float
    joined: bool
    killed: float | None = None
    """When a fault SIGKILLed it (None: it ran until it exited, or until the harness's teardown)."""
    partitioned: float | None = None
    """When a fault last cut it off the network (it was not signalled: it may go on, rejoin, or give up)."""
    torn_down: bool = False
    """The harness killed it at teardown (an aborted run)."""
    ended: float | None = None
    _log_file: object = field(default=None, repr=False)

    @classmethod
    def start(cls, name: str, command: Sequence[str], *, env: Mapping[str, str], log: Path, cwd: Path,
              joined: bool) -> Node:
        handle = open(log, "ab")  # noqa: SIM115 - closed when the node is reaped
        proc = subprocess.Popen(dying_with_us(list(command)), env=dict(env), stdout=handle,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=cwd)
        return cls(name, proc, log, time.time(), joined, _log_file=handle)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        """True while the agent runs (and reaps it once it ended)."""
        if self.proc.poll() is None:
            return True
        if self.ended is None:
            self.ended = time.time()
            self._close()
        return False

    @property
    def exit_code(self) -> int | None:
        return self.proc.returncode

    def kill(self, *, fault: bool = True) -> None:
        """SIGKILL the agent, as a machine dying; its workers die with it (parent-death signal).

        Args:
            fault: A fault (else the harness's teardown of an aborted run).
        """
        if self.proc.poll() is None:
            if fault:
                self.killed = time.time()
            else:
                self.torn_down = True
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.alive()

    def _close(self) -> None:
        if self._log_file is not None:
            self._log_file.close()  # type: ignore[attr-defined]
            self._log_file = None

    def tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

