"""Tie a child process's life to its parent's (Linux ``PR_SET_PDEATHSIG``)."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Sequence

__all__ = ["die_with_parent", "dying_with_us"]

_PR_SET_PDEATHSIG = 1


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
