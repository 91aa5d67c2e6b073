"""What a node sets up for its workers: its temporary directory, its workers' environment,
the control channel, and the forkserver its workers are forked from.

The forkserver is a fork of the agent's process, made once torch is imported there and
before the agent opens a thread or a connection (:func:`start_forkserver`). It then imports
only what the agent has not (what building a DDP model imports), while the agent joins the
rendezvous. multiprocessing's own forkserver is a fresh interpreter that imports torch a
second time: a node joining two training nodes on this 2-core machine started its workers
2.8 s after the rendezvous with it, 1.2 s with a fork (``benchmarks/recovery.py``, node_join).
"""

from __future__ import annotations

import importlib
import inspect
import multiprocessing
import multiprocessing.forkserver
import multiprocessing.util
import os
import shutil
import signal
import socket
import stat
import sys
import tempfile
import threading
import traceback
from dataclasses import dataclass, field
from multiprocessing import connection, resource_tracker
from types import TracebackType
from typing import Any

from elastictrain.launch import _logging
from elastictrain._control import CONTROL_DIR_ENV
from elastictrain._process import fd_targets, set_process_title
from elastictrain.launch._worker_boot import AGENT_PID_ENV, TERMINAL_ENV, terminal_identity
from elastictrain.launch.config import RunConfig, take_etcd_password
from elastictrain.events import EVENT_LOG_ENV, NODE_ENV
from elastictrain.launch.worker_group import Channel

__all__ = ["FORKSERVER_TITLE", "NodeSetup", "prepare", "start_forkserver"]

FORKSERVER_TITLE = "elastictrain worker forkserver"
"""The forkserver's command line in ``ps`` when it is a fork of the agent (see :func:`start_forkserver`);
multiprocessing's own reads ``... from multiprocessing.forkserver import main ...``."""

_FORKSERVER_PRELOAD = ["elastictrain.launch._worker_preload"]
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
    :func:`~elastictrain.launch.config.take_etcd_password`): no worker inherits it."""
    _previous_tempdir: str | None = field(default=None, repr=False)

    def start_forkserver(self) -> bool:
        """:func:`start_forkserver` for this node's workers."""
        return start_forkserver(self._previous_tempdir)

    def close(self) -> None:
        if self.channel is not None:
            self.channel.close()
        tempfile.tempdir = self._previous_tempdir
        shutil.rmtree(self.temp, ignore_errors=True)


def start_forkserver(tempdir: str | None = None) -> bool:
    """Start the forkserver every worker of this node is forked from, unless it runs already;
    return whether it is a fork of this process (see the module's docstring).

    Every worker of every round is forked from it: a restart costs a fork, not a Python start
    plus a torch import. The workers' environment must be set first (:func:`prepare`).
    ``tempdir`` is the workers' ``tempfile.tempdir`` (not this node's temporary directory, which
    goes when the node ends: torch's compile cache, for one, lives in it).

    This process is forked only while it has one Python thread and CUDA untouched (a thread's locks
    and an initialized CUDA driver do not survive a fork), on Linux, with a multiprocessing whose
    forkserver this function knows how to start (CPython 3.10-3.13); otherwise
    multiprocessing starts its own, as before.
    """
    multiprocessing.set_forkserver_preload(_FORKSERVER_PRELOAD)
    server = multiprocessing.forkserver._forkserver  # noqa: SLF001 - the module's one server
    if not _can_fork(server):
        multiprocessing.forkserver.ensure_running()
        return False
    resource_tracker.ensure_running()  # as ensure_running does: workers get its fd from the server
    with socket.socket(socket.AF_UNIX) as listener:
        address = connection.arbitrary_address("AF_UNIX")
        listener.bind(address)
        if not multiprocessing.util.is_abstract_socket_namespace(address):
            os.chmod(address, 0o600)
        listener.listen()
        # Every client holds the write end; the server exits once none is left.
        alive_r, alive_w = os.pipe()
        for stream in (sys.stdout, sys.stderr):  # or the child (its workers) would write it again
            try:
                stream.flush()
            except (OSError, ValueError):  # gone or closed: nothing of it can be written twice
                pass
        try:
            pid = os.fork()
        except BaseException:
            os.close(alive_r)
            os.close(alive_w)
            raise
        if pid == 0:
            _serve(listener.fileno(), alive_r, alive_w, list(server._preload_modules), tempdir)  # noqa: SLF001
        os.close(alive_r)
    server._forkserver_address = address  # noqa: SLF001 - what ensure_running would set
    server._forkserver_alive_fd = alive_w  # noqa: SLF001
    server._forkserver_pid = pid  # noqa: SLF001
    return True


_SERVER_MAIN_PARAMS = ("listener_fd", "alive_r", "preload", "main_path", "sys_path")
_SERVER_STATE = ("_forkserver_address", "_forkserver_alive_fd", "_forkserver_pid", "_preload_modules")


def _can_fork(server: Any) -> bool:
    torch = sys.modules.get("torch")
    return (sys.platform == "linux"
            and threading.active_count() == 1
            and not (torch is not None and torch.cuda.is_initialized())
            and not _cuda_driver_open()
            and all(hasattr(server, name) for name in _SERVER_STATE)
            and not hasattr(server, "_forkserver_authkey")  # 3.14 authenticates its clients
            and tuple(inspect.signature(multiprocessing.forkserver.main).parameters) == _SERVER_MAIN_PARAMS
            and server._forkserver_pid is None)  # noqa: SLF001 - not started yet


def _cuda_driver_open(fd_dir: str = "/proc/self/fd") -> bool:
    """Whether this process holds the CUDA driver's unified-memory device open, as it does once
    the driver is initialized (``cuInit``: ``torch.cuda.is_available()`` does it, and
    ``torch.cuda.is_initialized()`` does not tell): a fork of it could not use CUDA."""
    return any(target.startswith("/dev/nvidia-uvm") for target in fd_targets(fd_dir).values())


def _serve(listener_fd: int, alive_r: int, alive_w: int, preload: list[str], tempdir: str | None) -> None:
    """The forked child: serve as multiprocessing's forkserver until the agent is gone, then
    exit without running the agent's exit handlers or finalizers."""
    code = 0
    try:
        # The agent's signal handlers are not the workers' (they restore what main() finds),
        # and a Ctrl-C at the terminal is the agent's to handle, also while this imports.
        for signum in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(signum, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        os.close(alive_w)
        tempfile.tempdir = tempdir
        _logging.forget()  # workers configure their own, as in a fresh interpreter
        set_process_title(FORKSERVER_TITLE)
        for name in preload:  # as main() would, but uninterrupted; main() then has none left to import
            try:
                importlib.import_module(name)
            except ImportError:
                pass
        signal.signal(signal.SIGINT, signal.default_int_handler)
        sys.excepthook = _start_failed  # how main() reports a worker that could not start
        multiprocessing.forkserver.main(listener_fd, alive_r, [])
    except SystemExit:
        pass  # how main ends once every client is gone
    except BaseException:  # noqa: BLE001 - reported; the agent sees its workers fail to start
        traceback.print_exc()
        code = 1
    finally:
        os._exit(code)


def _start_failed(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
    """``sys.excepthook`` of the forkserver's children: a worker whose start data named files
    that are gone (the semaphores of an agent that stopped while starting it: a SIGTERM or
    Ctrl-C in a job's first seconds) says so in one line; anything else keeps its traceback."""
    rebuilding = any(frame.f_code.co_name == "__setstate__" and frame.f_code.co_filename.endswith(
        os.path.join("multiprocessing", "synchronize.py")) for frame, _ in traceback.walk_tb(tb))
    if issubclass(kind, FileNotFoundError) and rebuilding:
        sys.stderr.write(f"elastictrain: a worker start was abandoned: the semaphores its agent sent it are gone "
                         f"({value}); the agent stopped meanwhile\n")
        return
    sys.__excepthook__(kind, value, tb)


def prepare(config: RunConfig) -> NodeSetup:
    """Make this node's temporary directory and control channel and set the workers'
    environment (before the forkserver starts: :func:`start_forkserver`)."""
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
