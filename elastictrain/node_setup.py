"""What a node sets up before its agent imports torch: its temporary directory, its workers'
environment, the control channel, and the forkserver its workers are forked from.

None of it needs torch, so ``elastictrain run`` can start the forkserver first, its import
of torch (and of what building a DDP model imports) beside the agent's own import of
torch instead of after it: a one-node job ends about 1 s sooner on a quiet machine here.
It does so only when cores are idle (:func:`core_to_spare`): on busy cores two torch
imports side by side slow each other down more than they gain (a node joining two
training nodes on this 2-core machine had its workers started 2 s later).
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import multiprocessing.util
import os
import shutil
import stat
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

from elastictrain._control import CONTROL_DIR_ENV
from elastictrain._worker_boot import AGENT_PID_ENV, TERMINAL_ENV, terminal_identity
from elastictrain.config import RunConfig, take_etcd_password
from elastictrain.events import EVENT_LOG_ENV, NODE_ENV
from elastictrain.worker_group import Channel

__all__ = ["NodeSetup", "core_to_spare", "prepare", "start_forkserver"]

_FORKSERVER_PRELOAD = ["elastictrain._worker_preload"]
"""What the forkserver imports once, for every worker it forks (torch among it)."""

_TEMP_PREFIX = "elastictrain-node-"


@dataclass(slots=True)
class NodeSetup:
    """A node's temporary directory and control channel.

    :meth:`close` removes the directory and the channel; the forkserver ends with the process.
    """

    temp: str
    """This node's temporary directory; ``tempfile`` creates this process's files in it until :meth:`close`."""
    channel: Channel | None
    """The control channel of in-process recovery (``None`` under ``--recovery restart``)."""
    etcd_options: dict[str, Any]
    """The run's etcd options, with the password taken out of the environment (see
    :func:`~elastictrain.config.take_etcd_password`): no worker inherits it."""
    _previous_tempdir: str | None = field(default=None, repr=False)

    def close(self) -> None:
        if self.channel is not None:
            self.channel.close()
        tempfile.tempdir = self._previous_tempdir
        shutil.rmtree(self.temp, ignore_errors=True)


def core_to_spare(window: float = 0.1) -> bool:
    """Whether this machine has a core to spare now for the forkserver's import, besides the one
    the agent's own import takes: more than 1.5 cores' worth of idle time over ``window``
    seconds, from ``/proc/stat`` (``False`` where it cannot be read). The load average would
    not do: it lags by a minute, and a node often starts right after the others did."""
    try:
        first = _cpu_times()
        time.sleep(window)
        second = _cpu_times()
    except (OSError, ValueError, IndexError):
        return False
    idle, total = (b - a for a, b in zip(first, second))
    return total > 0 and idle / total * (os.cpu_count() or 1) > 1.5


def _cpu_times() -> tuple[int, int]:
    """All cores' idle (idle + iowait) and total time so far, in clock ticks."""
    with open("/proc/stat", encoding="ascii") as stat_file:
        fields = [int(v) for v in stat_file.readline().split()[1:]]
    return fields[3] + fields[4], sum(fields[:8])  # user nice system idle iowait irq softirq steal


def start_forkserver() -> None:
    """Start the forkserver (once per process; it begins importing torch at once, and the
    first worker it forks waits for that). Every worker of every round is forked from it:
    a restart costs a fork, not a Python start plus a torch import. It does not touch CUDA,
    so forking is safe. The workers' environment must be set first (:func:`prepare`)."""
    multiprocessing.set_forkserver_preload(_FORKSERVER_PRELOAD)
    multiprocessing.forkserver.ensure_running()


def prepare(config: RunConfig, *, start: bool = False) -> NodeSetup:
    """Make this node's temporary directory and control channel and set the workers'
    environment; with ``start``, start the forkserver too (:func:`start_forkserver`)."""
    # Before any process starts: the forkserver, and every worker through it, would inherit it.
    etcd_options = take_etcd_password(config.etcd_options)
    temp = _node_temp_dir()
    # multiprocessing's own directory (the forkserver's socket) stays where it was: a unix
    # socket path must be short. It removes it at exit; a killed node's goes at the next start.
    multiprocessing.util.get_temp_dir()
    setup = NodeSetup(temp, None, etcd_options, tempfile.tempdir)
    tempfile.tempdir = temp  # this process's own temporary files (torch's, multiprocessing's)
    try:
        setup.channel = Channel(config.nproc_per_node) if config.recovery == "in-process" else None
        # Workers inherit these through the forkserver: they must be set before it starts.
        # The agent pid lets a worker catch an agent that died before the worker could
        # ask to die along with it (see _worker_boot).
        os.environ[AGENT_PID_ENV] = str(os.getpid())
        os.environ[TERMINAL_ENV] = terminal_identity()
        if config.event_log:
            os.environ[EVENT_LOG_ENV] = os.path.abspath(config.event_log)
        if config.node_name:
            os.environ[NODE_ENV] = config.node_name
        if setup.channel is not None:
            os.environ[CONTROL_DIR_ENV] = setup.channel.directory
        else:  # a channel of an earlier launch in this process must not reach these workers
            os.environ.pop(CONTROL_DIR_ENV, None)
        if start:
            start_forkserver()
    except BaseException:
        setup.close()
        raise
    return setup


def _node_temp_dir() -> str:
    """A temporary directory for this node's process (worker logs and error files when there
    is no ``--log-dir``, torch's ``pytorch-errorfile-*``, multiprocessing's ``pymp-*``),
    removed when the node ends. Those of nodes that were killed are removed here, at the next
    start: their names carry the pid of the node that made them."""
    base = tempfile.gettempdir()
    names = os.listdir(base)
    # The sockets first, then which are bound: a node starting beside this one may bind its
    # forkserver's socket in between, and read the other way round its live directory would
    # look stale (a socket, and none bound when they were read).
    forkservers: dict[str, set[str]] = {}
    for name in names:
        path = os.path.join(base, name)
        if name.startswith("pymp-") and (sockets := _sockets_in(path)):
            forkservers[path] = sockets
    bound = _bound_unix_sockets() if forkservers else set()
    for path, sockets in forkservers.items():
        if not sockets & bound:  # a killed forkserver's: no process has its socket bound any more
            shutil.rmtree(path, ignore_errors=True)
    for name in names:
        if not name.startswith(_TEMP_PREFIX):
            continue
        try:
            pid = int(name[len(_TEMP_PREFIX):].split("-", 1)[0])
            os.kill(pid, 0)
        except ValueError:
            continue
        except ProcessLookupError:
            shutil.rmtree(os.path.join(base, name), ignore_errors=True)
        except PermissionError:
            pass  # someone else's live process
    return tempfile.mkdtemp(prefix=f"{_TEMP_PREFIX}{os.getpid()}-", dir=base)


def _bound_unix_sockets() -> set[str]:
    """The paths of the unix sockets bound on this host. ``/proc/net/unix`` lists those of the
    reader's network namespace only: a node in another one (the chaos harness runs nodes in
    namespaces of their own) would take every forkserver outside it for dead. So each network
    namespace that a readable process is in is read once, through that process."""
    namespaces: set[str] = set()
    bound: set[str] = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            namespace = os.readlink(f"/proc/{entry}/ns/net")
            if namespace in namespaces:
                continue
            with open(f"/proc/{entry}/net/unix", encoding="utf-8", errors="replace") as fh:
                lines = fh.readlines()[1:]
        except OSError:  # gone, or another user's (whose directories are not ours to remove)
            continue
        namespaces.add(namespace)
        bound.update(line.split()[-1] for line in lines if len(line.split()) >= 8)
    return bound


def _sockets_in(path: str) -> set[str]:
    """The unix sockets in a multiprocessing ``pymp-*`` directory: a forkserver's, once it is
    bound. Whether a process still has one bound is told by :func:`_bound_unix_sockets`, not by
    connecting to it, which would crash a live forkserver."""
    try:
        return {os.path.join(path, n) for n in os.listdir(path)
                if stat.S_ISSOCK(os.lstat(os.path.join(path, n)).st_mode)}
    except OSError:
        return set()
