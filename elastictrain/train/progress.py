"""A one-line progress display for rank 0: step, epoch, loss, throughput, world size.

It is a session hook (see :mod:`elastictrain.train.hooks`). The session adds it on rank 0
when stderr is a terminal, unless ``ELASTICTRAIN_PROGRESS=0`` or ``ELASTICTRAIN_NO_PROGRESS=1``
(``elastictrain run --no-progress`` sets the first for its workers). Off a terminal, logs say the same
every ``log_every`` steps, so nothing is lost.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any, TextIO

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


class _LinePrinter:
    """The terminal stream while a progress line is drawn on it: other text (log lines, prints)
    is printed above the progress line, which is then drawn again below it. Without it a log
    line is glued to the end of the progress line."""

    def __init__(self, stream: TextIO, hook: ProgressHook) -> None:
        self._stream = stream
        self._hook = hook

    def write(self, text: str) -> int:
        if not text:
            return 0
        drawn = self._hook.drawn
        if drawn:
            self._stream.write("\r" + " " * len(drawn) + "\r")
        self._stream.write(text)
        if drawn:
            if text.endswith("\n"):
                self._stream.write("\r" + drawn)
            else:
                self._hook.drawn = ""  # a partial line owns it now; the next step draws anew
        self._stream.flush()
        return len(text)

    def flush(self) -> None:
        self._stream.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


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
        self.drawn = ""
        """The progress line as it is on the terminal now (empty: none)."""
        self._printer: _LinePrinter | None = None

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
        self._own_the_line()
        pad = max(0, self._width - len(text))
        self._stream.write("\r" + text + " " * pad)
        self._stream.flush()
        self._width = len(text)
        self.drawn = text + " " * pad

    def _own_the_line(self) -> None:
        """Route this process's other writers to the terminal (``sys.stderr``, logging handlers
        on it) through a :class:`_LinePrinter`, once."""
        if self._printer is not None:
            return
        self._printer = printer = _LinePrinter(self._stream, self)
        if sys.stderr is self._stream:
            sys.stderr = printer
        loggers = [logging.getLogger(), *(logger for logger in logging.root.manager.loggerDict.values()
                                          if isinstance(logger, logging.Logger))]
        for logger in loggers:
            for handler in logger.handlers:
                if isinstance(handler, logging.StreamHandler) and handler.stream is self._stream:
                    handler.setStream(printer)

    def _release_the_line(self) -> None:
        printer, self._printer = self._printer, None
        if printer is None:
            return
        if sys.stderr is printer:
            sys.stderr = self._stream
        loggers = [logging.getLogger(), *(logger for logger in logging.root.manager.loggerDict.values()
                                          if isinstance(logger, logging.Logger))]
        for logger in loggers:
            for handler in logger.handlers:
                if isinstance(handler, logging.StreamHandler) and handler.stream is printer:
                    handler.setStream(self._stream)

    def on_end(self, *, step: int) -> None:
        if self._width:
            self._stream.write("\n")
            self._stream.flush()
        self.drawn = ""
        self._release_the_line()

    def on_failure(self, *, error: BaseException) -> None:
        self.on_end(step=0)
