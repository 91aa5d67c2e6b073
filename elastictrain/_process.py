"""Tie a child process's life to its parent's (Linux ``PR_SET_PDEATHSIG``); read a process's ``/proc`` status."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Sequence

__all__ = ["die_with_parent", "dying_with_us", "fd_targets", "proc_stat", "set_process_title"]

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15


def proc_stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (``[0]`` is the state, ``[1]``
    the parent's pid, ``[11]``/``[12]`` user/system CPU ticks), or ``None`` if ``pid`` is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            data = f.read()
    except OSError:
        return None
    # The command name may hold spaces and parentheses: the fields after the last ')' are fixed.
    return data[data.rindex(")") + 2:].split()


def fd_targets(fd_dir: str = "/proc/self/fd") -> dict[int, str]:
    """What each open fd of this process refers to (``/dev/null``, ``socket:[inode]``...), from
    ``fd_dir``; empty where it cannot be read (not Linux). An fd closed meanwhile is left out."""
    try:
        names = os.listdir(fd_dir)
    except OSError:
        return {}
    found = {}
    for name in names:
        try:
            found[int(name)] = os.readlink(os.path.join(fd_dir, name))
        except OSError:
            continue  # closed meanwhile (or the listing's own fd)
    return found


def die_with_parent(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent dies.

    Returns:
        ``False`` where the platform has no such call (then nothing changed).
    """
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


# Runs in a fresh interpreter (no torch, no gRPC), sets the death signal, then
# becomes the target program: PR_SET_PDEATHSIG survives execve.
_TRAMPOLINE = (
    "import ctypes, os, sys\n"
    "ctypes.CDLL(None).prctl(1, int(sys.argv[1]), 0, 0, 0)\n"
    "if os.getppid() != int(sys.argv[2]): sys.exit(1)  # the parent is already gone\n"
    "os.execv(sys.argv[3], sys.argv[3:])\n"
)


def dying_with_us(cmd: Sequence[str], sig: int = signal.SIGTERM) -> list[str]:
    """``cmd`` wrapped so that the program gets ``sig`` when this process dies.

    Not ``preexec_fn``: that runs Python between fork and exec, where a process with
    gRPC's threads (our etcd client) can deadlock or abort in gRPC's fork handlers.
    """
    return [sys.executable, "-S", "-c", _TRAMPOLINE, str(int(sig)), str(os.getpid()), *cmd]


def set_process_title(title: str) -> None:
    """Show ``title`` as this process's command line in ``ps`` (with the ``setproctitle``
    package), and its first word's basename as the kernel's 15-character process name
    (``ps -e``, ``top``) in any case."""
    try:
        import setproctitle  # a dependency, but a title is not worth failing a worker for

        setproctitle.setproctitle(title)
    except ImportError:
        pass
    words = title.split(":", 1)[-1].split()
    name = os.path.basename(words[0]) if words else title
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)
    except (OSError, AttributeError):
        pass
