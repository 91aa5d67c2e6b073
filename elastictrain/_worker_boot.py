"""What each worker process runs before the user's script.

``python -m elastictrain._worker_boot script.py [args]``:

1. asks Linux to SIGKILL this worker when its agent dies. torch starts workers
   in their own session, so an agent killed with SIGKILL otherwise leaves them
   running: ghosts that keep training on a stale world and hold its ports;
2. runs the script as ``__main__`` (like ``python script.py``) under torch's
   ``@record``, so an uncaught exception lands in the agent's error file and is
   reported as the job's root cause;
3. exits without native teardown once the script has returned (see
   :func:`_exit_without_finalization`).
"""

from __future__ import annotations

import ctypes
import os
import runpy
import signal
import sys

PARENT_PID_ENV = "ELASTICTRAIN_AGENT_PID"
_PR_SET_PDEATHSIG = 1


def _die_with_agent() -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the agent's shutdown path still applies
        return
    # The agent may have died between fork and prctl; then no signal will come.
    expected = os.environ.get(PARENT_PID_ENV)
    if expected and os.getppid() != int(expected):
        os._exit(1)


def main() -> None:
    if len(sys.argv) < 2:
        sys.stderr.write("usage: python -m elastictrain._worker_boot SCRIPT [ARGS...]\n")
        raise SystemExit(2)
    _die_with_agent()
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    # As `python script.py` does: the script's directory is importable.
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))

    from torch.distributed.elastic.multiprocessing.errors import record

    record(lambda: runpy.run_path(script, run_name="__main__"))()
    _exit_without_finalization()


def _exit_without_finalization() -> None:
    """Leave with code 0 once the script has finished, skipping C++ teardown.

    Seen here with gloo (torch 2.13): a worker that finished and destroyed its
    process group can still abort in interpreter finalization ("terminate called
    without an active exception") while c10d's background threads are torn
    down, turning a finished job into a failure and a restart. The script's
    atexit handlers still run; only the destructors of native objects are skipped.
    """
    import atexit

    atexit._run_exitfuncs()  # noqa: SLF001 - the documented way to run them early
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
