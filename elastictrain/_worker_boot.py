"""What each worker process runs: the user's script, tied to its agent's life.

The agent starts workers from a forkserver that has already imported torch
(see :mod:`elastictrain.agent`), so a worker restart does not pay a Python start
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
import multiprocessing.forkserver
import os
import runpy
import signal
import sys

from elastictrain._process import die_with_parent

AGENT_PID_ENV = "ELASTICTRAIN_AGENT_PID"


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


def run_script(script: str, args: tuple[str, ...]) -> None:
    """Worker entry point: run ``script`` with ``args`` as ``__main__``.

    Args:
        script: Path of the training script.
        args: Its command-line arguments (``sys.argv[1:]``).
    """
    _release_forkserver()
    _die_with_parent()
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (None, 0):
            raise
    finally:
        # multiprocessing ends workers with os._exit(), which skips atexit; a
        # script's handlers (flushing a logger, closing files) still expect to run.
        atexit._run_exitfuncs()  # noqa: SLF001
