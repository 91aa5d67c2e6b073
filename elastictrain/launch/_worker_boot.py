"""What each worker process runs: the user's script, tied to its agent's life.

The agent starts workers from a forkserver that has already imported torch
(see :mod:`elastictrain.launch.node_setup`), so a worker restart does not pay a Python start
and a torch import (about 2 s here) on every survivor. Each worker then:

1. asks Linux to SIGKILL it when its parent dies. torch starts workers in their
   own session, so a node agent killed with SIGKILL otherwise leaves them running:
   ghosts that keep training on a stale world and hold its ports. (The parent is
   the forkserver, which exits as soon as the agent is gone.)
2. runs the script as ``__main__``, like ``python script.py``, with the script's
   directory importable. torch wraps this function in ``@record``, so an
   uncaught exception lands in the agent's error file as the job's root cause.
"""

from __future__ import annotations

import atexit
import io
import multiprocessing.forkserver
import os
import runpy
import shutil
import signal
import subprocess
import socket
import sys
from collections.abc import Callable
from typing import Any

from elastictrain._process import die_with_parent, dying_with_us, set_process_title
from elastictrain.events import NODE_ENV
from elastictrain.train.rank_logging import PREFIXED_LINES_ENV

_HOST = socket.gethostname()

AGENT_PID_ENV = "ELASTICTRAIN_AGENT_PID"
TERMINAL_ENV = "ELASTICTRAIN_AGENT_STREAMS"
LINE_PREFIX_ENV = "ELASTICTRAIN_LINE_PREFIX"
"""``0`` turns off the ``[node rank]`` prefix of worker output lines."""


class _PrefixedStream(io.TextIOBase):
    """A text stream that starts every line it writes with a prefix, then hands it on.

    Whole lines go out in one write each (a partial line waits for its end, or a flush):
    ``print`` writes the text and its newline separately, and the ranks of a node share
    the terminal, so lines written piecemeal interleaved (``[vm 0] a[vm 1] b``).
    """

    def __init__(self, stream: Any, prefix: Callable[[], str]) -> None:
        super().__init__()
        self._stream = stream
        self._prefix = prefix
        self._at_line_start = True
        self._pending = ""

    def write(self, text: str) -> int:
        if not text:
            return 0
        out = [self._pending]
        for line in text.splitlines(keepends=True):
            if self._at_line_start:
                out.append(self._prefix())
            out.append(line)
            self._at_line_start = line.endswith("\n")
        lines, newline, self._pending = "".join(out).rpartition("\n")
        if newline:
            self._stream.write(lines + newline)
            self._stream.flush()  # line-buffered, as a terminal would be
        return len(text)

    def flush(self) -> None:
        pending, self._pending = self._pending, ""
        if pending:
            self._stream.write(pending)
        self._stream.flush()

    def fileno(self) -> int:
        return self._stream.fileno()

    def isatty(self) -> bool:
        return bool(self._stream.isatty())

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return str(getattr(self._stream, "encoding", "utf-8"))

    def writable(self) -> bool:
        return True


def _line_prefix() -> str:
    # Read per line: in-process recovery may give this worker another rank.
    return f"[{os.environ.get(NODE_ENV) or _HOST} {os.environ.get('RANK', '?')}] "


def _identity(fd: int) -> str:
    try:
        st = os.fstat(fd)
    except OSError:
        return "-"
    return f"{st.st_dev}:{st.st_ino}"


def terminal_identity() -> str:
    """The agent's stdout and stderr, as ``dev:ino`` pairs: a worker whose streams are the same
    files writes to the terminal (or the agent's log); torch's ``--redirects``/``--tee`` give it
    files of its own."""
    return f"{_identity(1)},{_identity(2)}"


def _shares_agent_stream(stream: Any, agent: str) -> bool:
    try:
        return _identity(stream.fileno()) == agent
    except (OSError, ValueError, AttributeError, io.UnsupportedOperation):
        return False


def _prefix_output() -> None:
    """``[node rank]`` before each line of this worker's output, so that a terminal shared by
    every worker says whose line is whose (as torchrun's ``--tee`` does). Not for output
    redirected into its log file (``--redirects``/``--tee``: torch prefixes what it tees).
    Python-level: what C code writes straight to the file descriptors carries no prefix."""
    if os.environ.get(LINE_PREFIX_ENV, "1").strip().lower() in {"0", "false", "no", "off"}:
        return
    agent_out, _, agent_err = os.environ.get(TERMINAL_ENV, "").partition(",")
    if _shares_agent_stream(sys.stdout, agent_out):
        sys.stdout = _PrefixedStream(sys.stdout, _line_prefix)
    if _shares_agent_stream(sys.stderr, agent_err):
        sys.stderr = _PrefixedStream(sys.stderr, _line_prefix)
        os.environ[PREFIXED_LINES_ENV] = "1"  # the session's log lines need no [run= node= rank=] then


def _set_title(script: str, args: tuple[str, ...]) -> None:
    """Show the script in ``ps`` (the worker otherwise reads as the forkserver's command line),
    so that a user can find a worker's pid: ``elastictrain worker rank 3: train.py --lr 3e-4``."""
    title = f"elastictrain worker rank {os.environ.get('RANK', '?')}: {' '.join((os.path.basename(script), *args))}"
    set_process_title(title[:200])


def _release_forkserver() -> None:
    """Drop the forkserver's liveness fd that every forked child inherits.

    The forkserver exits when the last holder of that fd is gone; it passes the
    fd to each child (so children could fork through it too). A worker holding
    it would keep the forkserver alive after the agent died, and with it this
    worker, whose death signal fires only when the forkserver exits. If the
    script wants a forkserver of its own, multiprocessing starts a fresh one.
    """
    server = multiprocessing.forkserver._forkserver  # noqa: SLF001 - no public handle
    fd = server._forkserver_alive_fd  # noqa: SLF001
    if fd is not None:
        os.close(fd)
        server._forkserver_alive_fd = None  # noqa: SLF001
        server._forkserver_address = None  # noqa: SLF001
        server._forkserver_pid = None  # noqa: SLF001


def _die_with_parent() -> None:
    if not die_with_parent(signal.SIGKILL):  # not Linux: the agent's shutdown path still applies
        return
    # The agent may have died before prctl took effect; then no signal will come.
    agent = os.environ.get(AGENT_PID_ENV)
    if agent:
        try:
            os.kill(int(agent), 0)
        except ProcessLookupError:
            os._exit(1)


def run_script(script: str, args: tuple[str, ...], entry: str = "script") -> None:
    """Worker entry point: run ``script`` with ``args`` as ``__main__``.

    Args:
        script: Path of the training script; a module name with ``entry="module"``
            (``python -m``); a program with ``entry="program"`` (torchrun's ``--no-python``).
        args: Its command-line arguments (``sys.argv[1:]``).
        entry: ``script``, ``module`` or ``program``.
    """
    _release_forkserver()
    _die_with_parent()
    _set_title(script, args)
    _prefix_output()
    if entry == "program":
        # A child, not exec: torch's process context waits for this function's return value.
        # The program dies with this worker (which dies with its agent).
        sys.stdout.flush()
        sys.stderr.flush()
        code = subprocess.call(dying_with_us([shutil.which(script) or script, *args], signal.SIGKILL))
        if code:
            raise SystemExit(128 - code if code < 0 else code)
        return
    sys.argv = [script, *args]
    try:
        if entry == "module":
            sys.path.insert(0, os.getcwd())  # as `python -m` does
            runpy.run_module(script, run_name="__main__", alter_sys=True)
        else:
            sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
            runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (None, 0):
            raise
    finally:
        # multiprocessing ends workers with os._exit(), which skips atexit; a
        # script's handlers (flushing a logger, closing files) still expect to run.
        atexit._run_exitfuncs()  # noqa: SLF001
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
