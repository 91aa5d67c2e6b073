"""Tie a child process's life to its parent's (Linux ``PR_SET_PDEATHSIG``)."""

from __future__ import annotations

import ctypes
import signal

__all__ = ["die_with_parent", "sigterm_with_parent"]

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


def sigterm_with_parent() -> None:
    """``preexec_fn`` for children that should stop in order when we are killed."""
    die_with_parent(signal.SIGTERM)
