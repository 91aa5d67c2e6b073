"""Network namespaces for the chaos run's nodes, so that one node can be cut off the network.

On one machine every node agent would otherwise talk over loopback, which no
fault can cut for one node only. With :class:`NodeNetwork` each node runs in its
own network namespace (``ip netns exec``) with two veth interfaces and no default route:
``eth0`` at ``10.77.X.(10+i)``, whose other end is a port of a bridge in the root namespace
that holds ``10.77.X.1``, where etcd listens; and ``eth1`` at ``10.78.X.(10+i)`` (the node's
``--local-addr``), a port of a second bridge that carries what nodes send each other
(their workers' collectives and store, the agents' reachability probes). Cutting a node =
taking its bridge ports down (:meth:`NodeNetwork.cut`): its etcd client, its workers'
collectives and everything else lose the network at once, in both directions, and nothing
it runs is signalled. Cutting its peer port only (:meth:`NodeNetwork.cut_peers`) is the gray
failure: its lease stays alive in etcd while its collectives cannot complete.

Names start with ``etch<X>`` (X, the third octet, is drawn per run among the
free ones). The bridge's alias names the harness process that owns it, so a run
sweeps what a crashed earlier run left (its owner is dead) and leaves alone
what a live concurrent one uses. Needs root (``CAP_NET_ADMIN`` and
``CAP_SYS_ADMIN``) and iproute2's ``ip``.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import logging
import os
import random
import re
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

from elastictrain.errors import ConfigError

logger = logging.getLogger(__name__)

__all__ = ["NS_INTERFACE", "NS_PEER_INTERFACE", "NodeNetwork", "check_available", "mount_small_disk",
           "unmount_small_disk"]

NS_INTERFACE = "eth0"
"""The node's interface to etcd inside its namespace."""

NS_PEER_INTERFACE = "eth1"
"""The node's interface to its peers inside its namespace (also ``GLOO_SOCKET_IFNAME``: gloo binds to it)."""

_PREFIX = "etch"
_OWNER = "elastictrain-chaos pid="  # the bridge's alias: which process owns the subnet
_BRIDGE = re.compile(rf"^{_PREFIX}(\d+)br$")
# Namespaces, root-side and ns-side veths (to etcd: v, p; to peers: w, q), the peers' bridge.
_OURS = re.compile(rf"^{_PREFIX}(\d+)(?:-n\d+|v\d+|p\d+|w\d+|q\d+|pb)$")
# Held while sweeping and while making a bridge, until its alias names its owner: else a run
# starting meanwhile would take the new bridge, still without an owner, for a crashed run's.
_LOCK = "/run/elastictrain-chaos-netns.lock"


def check_available() -> None:
    """Raise if this process cannot build namespaces.

    Raises:
        ConfigError: Not root, or no ``ip`` command.
    """
    if os.geteuid() != 0:
        raise ConfigError("netns needs root (it creates network namespaces, a bridge and veth pairs)")
    if shutil.which("ip") is None:
        raise ConfigError("netns needs the `ip` command (iproute2), which is not on PATH")


def _ip(*args: str, check: bool = True) -> str:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if check and result.returncode != 0:
        message = (result.stderr or result.stdout).strip().replace("\n", "; ")
        raise ConfigError(f"`ip {' '.join(args)}` failed: {message}")
    return result.stdout


def _links() -> list[str]:
    return [line.split(":")[1].strip().split("@")[0] for line in _ip("-o", "link", "show").splitlines()]


def _namespaces() -> list[str]:
    return [line.split()[0] for line in _ip("netns", "list").splitlines() if line.strip()]


def _owner_alive(bridge: str) -> bool:
    try:
        alias = Path(f"/sys/class/net/{bridge}/ifalias").read_text().strip()
    except OSError:
        return False
    if not alias.startswith(_OWNER):
        return False
    try:
        os.kill(int(alias[len(_OWNER):]), 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    return True


def _sweep() -> set[int]:
    """Delete what crashed runs left; return the subnets (X) that live runs own."""
    links = _links()
    live = {int(m.group(1)) for name in links if (m := _BRIDGE.match(name)) and _owner_alive(name)}
    for name in _namespaces():
        if (m := _OURS.match(name)) and int(m.group(1)) not in live:
            logger.info("removing namespace %s left by an earlier run", name)
            _ip("netns", "delete", name, check=False)
    for name in links:
        m = _BRIDGE.match(name) or _OURS.match(name)
        if m and int(m.group(1)) not in live:
            _ip("link", "delete", name, check=False)  # gone already if its namespace took it
    return live


class NodeNetwork:
    """A bridge and one namespace per node; see the module docstring.

    Create it with :meth:`create`; :meth:`teardown` (also run at exit) removes
    everything. Nodes are added as they start (a replacement gets a new index).
    """

    def __init__(self, subnet: int) -> None:
        self.subnet = subnet
        self.bridge = f"{_PREFIX}{subnet}br"
        self.peer_bridge = f"{_PREFIX}{subnet}pb"
        self.gateway = f"10.77.{subnet}.1"
        """The root namespace's address on the bridge: etcd listens here."""
        self.namespaces: dict[int, str] = {}
        self._torn_down = False

    @classmethod
    def create(cls) -> NodeNetwork:
        """Sweep leftovers of crashed runs, then make a bridge on a subnet no live run uses.

        Raises:
            ConfigError: Not root, no ``ip``, or an ``ip`` command failed (the message says which).
        """
        check_available()
        with open(_LOCK, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            taken = _sweep() | {int(m.group(1)) for m in re.finditer(r"inet 10\.7[78]\.(\d+)\.", _ip("-o", "addr"))}
            free = [x for x in range(1, 255) if x not in taken]
            if not free:
                raise ConfigError("netns: every 10.77.X.0/24 subnet is in use")
            network = cls(random.SystemRandom().choice(free))
            atexit.register(network.teardown)
            try:
                _ip("link", "add", network.bridge, "type", "bridge")
                _ip("link", "set", network.bridge, "alias", f"{_OWNER}{os.getpid()}")
                _ip("addr", "add", f"{network.gateway}/24", "dev", network.bridge)
                _ip("link", "set", network.bridge, "up")
                _ip("link", "add", network.peer_bridge, "type", "bridge")
                _ip("link", "set", network.peer_bridge, "up")
            except BaseException:
                network.teardown()
                raise
        logger.info("netns: bridge %s at %s", network.bridge, network.gateway)
        return network

    def _root_veth(self, index: int) -> str:
        return f"{_PREFIX}{self.subnet}v{index}"

    def _root_peer_veth(self, index: int) -> str:
        return f"{_PREFIX}{self.subnet}w{index}"

    def address(self, index: int) -> str:
        """Node ``index``'s address towards etcd."""
        return f"10.77.{self.subnet}.{10 + index}"

    def peer_address(self, index: int) -> str:
        """Node ``index``'s address towards its peers (its ``--local-addr``)."""
        return f"10.78.{self.subnet}.{10 + index}"

    def add_node(self, index: int) -> str:
        """Make node ``index``'s namespace, wired to both bridges; returns its peer address.

        Raises:
            ConfigError: An ``ip`` command failed.
        """
        if not 0 <= index <= 240:
            raise ConfigError(f"netns: at most 241 nodes per run, got node index {index}")
        ns = f"{_PREFIX}{self.subnet}-n{index}"
        self.namespaces[index] = ns
        _ip("netns", "add", ns)
        for root_end, ns_end, bridge, name, address in (
                (self._root_veth(index), f"{_PREFIX}{self.subnet}p{index}", self.bridge, NS_INTERFACE,
                 self.address(index)),
                (self._root_peer_veth(index), f"{_PREFIX}{self.subnet}q{index}", self.peer_bridge, NS_PEER_INTERFACE,
                 self.peer_address(index))):
            _ip("link", "add", root_end, "type", "veth", "peer", "name", ns_end)
            _ip("link", "set", ns_end, "netns", ns)
            _ip("link", "set", root_end, "master", bridge, "up")
            _ip("-n", ns, "link", "set", ns_end, "name", name)  # renamed once inside the namespace
            _ip("-n", ns, "addr", "add", f"{address}/24", "dev", name)
            _ip("-n", ns, "link", "set", name, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        # No default route: with one, lookups of the host's name server go to the bridge and are
        # dropped there, so each reverse lookup (TCPStore makes one per connection) waits out the
        # resolver's timeout and the store's connect times out. Without, they fail at once.
        return self.peer_address(index)

    def wrap(self, index: int, command: Sequence[str]) -> list[str]:
        """``command`` run inside node ``index``'s namespace (``ip netns exec`` execs it: the pid stays)."""
        # A full path: the parent-death trampoline execs without a PATH lookup.
        return [shutil.which("ip") or "ip", "netns", "exec", self.namespaces[index], *command]

    def cut(self, index: int) -> None:
        """Cut node ``index`` off etcd and its peers (its bridge ports go down)."""
        for veth in (self._root_veth(index), self._root_peer_veth(index)):
            _ip("link", "set", veth, "down")

    def cut_peers(self, index: int) -> None:
        """Cut node ``index`` off its peers only: it still reaches etcd (a gray failure)."""
        _ip("link", "set", self._root_peer_veth(index), "down")

    def heal(self, index: int) -> None:
        """Reconnect node ``index``."""
        for veth in (self._root_veth(index), self._root_peer_veth(index)):
            _ip("link", "set", veth, "up")

    def teardown(self) -> None:
        """Remove the namespaces, their veths and the bridge (idempotent).

        A veth pair goes with its namespace, unless a process still holds the namespace after its
        name is deleted: the root ends are deleted too, and that is a no-op when they are gone.
        """
        if self._torn_down:
            return
        self._torn_down = True
        for ns in self.namespaces.values():
            _ip("netns", "delete", ns, check=False)
        for index in self.namespaces:
            _ip("link", "delete", self._root_veth(index), check=False)
            _ip("link", "delete", self._root_peer_veth(index), check=False)
        _ip("link", "delete", self.peer_bridge, check=False)
        _ip("link", "delete", self.bridge, check=False)
        with contextlib.suppress(Exception):
            atexit.unregister(self.teardown)


def mount_small_disk(path: Path, megabytes: int) -> None:
    """Mount a tmpfs of ``megabytes`` at ``path`` (a filesystem of the run's own, which a fault may
    fill: a real ENOSPC, and never the host's disk).

    Raises:
        ConfigError: Not root, or the mount failed.
    """
    if os.geteuid() != 0:
        raise ConfigError("checkpoint_disk_mb needs root (it mounts a tmpfs for the checkpoints)")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={megabytes}m", "tmpfs", str(path)],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise ConfigError(f"could not mount a {megabytes} MB tmpfs at {path}: {done.stderr.strip()}")


def unmount_small_disk(path: Path) -> None:
    """Unmount what :func:`mount_small_disk` mounted (lazily if something still holds it)."""
    if subprocess.run(["umount", str(path)], capture_output=True, check=False).returncode != 0:
        subprocess.run(["umount", "--lazy", str(path)], capture_output=True, check=False)
