"""A one-line progress display for rank 0: step, epoch, loss, throughput, world size.

It is a session hook (see :mod:`elastictrain.hooks`). The session adds it on rank 0
when stderr is a terminal, unless ``ELASTICTRAIN_PROGRESS=0`` or ``ELASTICTRAIN_NO_PROGRESS=1``
(``elastictrain run --no-progress`` sets the first for its workers). Off a terminal, logs say the same
every ``log_every`` steps, so nothing is lost.
"""

from __future__ import annotations

import os
import sys
import time
from typing import TextIO

__all__ = ["PROGRESS_ENV", "ProgressHook", "progress_wanted"]

PROGRESS_ENV = "ELASTICTRAIN_PROGRESS"
NO_PROGRESS_ENV = "ELASTICTRAIN_NO_PROGRESS"
"""The variable of ``elastictrain run --no-progress`` (``=1``); honoured by workers too, so the
two spellings agree wherever the script runs."""


def progress_wanted(rank: int, stream: TextIO = sys.stderr) -> bool:
    """Whether this worker should show a progress line."""
    if os.environ.get(PROGRESS_ENV, "1").strip().lower() in {"0", "false", "no", "off"}:
        return False
    if os.environ.get(NO_PROGRESS_ENV, "").strip().lower() in {"1", "true", "yes", "on"}:
        return False
    return rank == 0 and stream.isatty()


class ProgressHook:
    """Rewrites one terminal line after each optimizer step (at most 10 times a second).

    Args:
        total: Steps the run will take, if known.
        stream: Where to draw (a terminal).
    """

    _MIN_INTERVAL = 0.1

    def __init__(self, total: int | None = None, stream: TextIO = sys.stderr) -> None:
        self._total = total
        self._stream = stream
        self._world_size = 1
        self._drawn_at = 0.0
        self._width = 0

    def on_rendezvous(self, *, rank: int, world_size: int, restart_count: int) -> None:
        self._world_size = world_size

    def on_step_end(self, *, step: int, loss: float, throughput: float) -> None:
        now = time.monotonic()
        if now - self._drawn_at < self._MIN_INTERVAL and step != self._total:
            return
        self._drawn_at = now
        self._draw(self.line(step, loss, throughput))

    def line(self, step: int, loss: float, throughput: float) -> str:
        """The text shown after ``step``."""
        if self._total:
            filled = int(20 * min(step, self._total) / self._total)
            bar = f"[{'#' * filled}{'.' * (20 - filled)}] {step}/{self._total}"
        else:
            bar = f"step {step}"
        return f"{bar}  loss {loss:.4f}  {throughput:,.0f} samples/s  world {self._world_size}"

    def _draw(self, text: str) -> None:
        pad = max(0, self._width - len(text))
        self._stream.write("\r" + text + " " * pad)
        self._stream.flush()
        self._width = len(text)

    def on_end(self, *, step: int) -> None:
        if self._width:
            self._stream.write("\n")
            self._stream.flush()

    def on_failure(self, *, error: BaseException) -> None:
        self.on_end(step=0)
