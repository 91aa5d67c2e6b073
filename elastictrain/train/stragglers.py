"""Naming the rank that slows a job down: :class:`StragglerWatch`.

In a synchronous step every rank waits in the gradient collective for the slowest, so
every rank's step takes as long. What tells the straggler apart is its *compute*: the time
from the step being handed out to the rank reaching the step's gradient collective (its
data loading, forward and backward). Every ``window`` steps the ranks exchange their
compute times (one small all-gather on the CPU group, at the same step on every rank), and
each rank compares its own with its peers' median, step by step: a rank at ``factor`` times
or more in most of the window (the median of its steps' ratios: one slow step of its own, a
long call, makes no straggler, and a few slow steps of its peers, a host's CPU taken by
another process, do not hide one), and slower by more than ``min_excess_s`` a step (noise at
tiny steps is no straggler), says so once, with an event, and once more when most of a window is
back under ``recover_factor`` (the same median: one slow step keeps no rank a straggler). Its
factor (the window's mean) is a gauge of its agent's metrics.

Nothing here imports torch: the exchange is the caller's (:class:`~elastictrain.train.step_loop.StepLoop`).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["StragglerVerdict", "StragglerWatch"]


@dataclass(frozen=True, slots=True)
class StragglerVerdict:
    """This rank against its peers over one window."""

    factor: float
    """Its compute time over its peers' median (the mean over the window's steps)."""
    compute_s: float
    """Its mean compute time a step."""
    peers_s: float
    """Its peers' median compute time a step."""
    change: str | None
    """``"started"`` when it became a straggler in this window, ``"ended"`` when it stopped, else None."""


class StragglerWatch:
    """One rank's compute times, and whether it straggles.

    Args:
        window: Steps between two exchanges (a straggler is slow in most of them).
        factor: Times its peers' median that makes a rank a straggler.
        recover_factor: Under this in most of a window (the median of its ratios), a straggler is one no more.
        min_excess_s: The least a straggler's step is slower than its peers', in seconds.
    """

    def __init__(self, window: int = 10, factor: float = 2.0, recover_factor: float = 1.5,
                 min_excess_s: float = 0.02) -> None:
        self.window, self.factor, self.recover_factor, self.min_excess_s = window, factor, recover_factor, min_excess_s
        self._times: list[float] = []
        self.straggling = False

    def record(self, compute_s: float) -> None:
        """Add one step's compute time."""
        self._times.append(compute_s)
        del self._times[:-self.window]

    def restart(self) -> None:
        """Forget the window (the group re-formed: the peers are others)."""
        self._times.clear()

    def due(self, step: int) -> bool:
        """Whether the ranks exchange their times after ``step`` (the same on every rank)."""
        return step % self.window == 0

    def times(self) -> list[float]:
        """This rank's window, ``window`` long: NaN where it saw no step (it joined since)."""
        return [math.nan] * (self.window - len(self._times)) + self._times

    def judge(self, rank: int, gathered: Sequence[Sequence[float]]) -> StragglerVerdict | None:
        """Judge this rank (``rank``) from every rank's :meth:`times` (``gathered[r]``); None when
        there is nothing to compare (no peer, or steps that not every rank saw)."""
        mine = gathered[rank]
        peers = [times for r, times in enumerate(gathered) if r != rank]
        ratios, own, theirs = [], [], []
        for i, t in enumerate(mine):
            others = [p[i] for p in peers if not math.isnan(p[i])]
            if math.isnan(t) or not others:
                continue
            median = statistics.median(others)
            own.append(t)
            theirs.append(median)
            ratios.append(t / median if median > 0 else (math.inf if t >= self.min_excess_s else 1.0))
        if not ratios:
            return None
        compute_s, peers_s = statistics.fmean(own), statistics.fmean(theirs)
        factor = compute_s / peers_s if peers_s > 0 else math.inf
        typical = statistics.median(ratios)
        slow = typical >= self.factor and compute_s - peers_s >= self.min_excess_s
        change = None
        if not self.straggling and slow and len(ratios) == self.window:
            self.straggling, change = True, "started"
        elif self.straggling and typical < self.recover_factor:
            self.straggling, change = False, "ended"
        return StragglerVerdict(factor=factor, compute_s=compute_s, peers_s=peers_s, change=change)
