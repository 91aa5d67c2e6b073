"""Durations given in seconds, as both sides of a job read them (a run's flags, a session's options).

Here rather than in :mod:`elastictrain.launch.config`, which the launch side owns: a worker reads its
settings without importing the etcd client and the rendezvous.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from elastictrain.errors import ConfigError

__all__ = ["MAX_DURATION_S", "parse_duration"]

# The longest duration we accept: about 31 years. Much longer ones overflow where torch
# adds them to the current datetime or waits on a lock with them ("wait forever" is 1e9).
MAX_DURATION_S = 1e9


def parse_duration(name: str, value: Any, *, minimum: float = 0.0) -> timedelta:
    """Read a duration in seconds (``int``/``float``/``str``/``timedelta``).

    Raises:
        ConfigError: Not a number, below ``minimum`` seconds, or not finite / above
            :data:`MAX_DURATION_S`.
    """
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    else:
        try:
            seconds = float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{name} must be a number of seconds, got {value!r}") from None
    if not seconds >= minimum:  # also rejects NaN
        raise ConfigError(f"{name} must be at least {minimum:g} s, got {value!r}")
    if not seconds <= MAX_DURATION_S:  # also rejects infinity
        raise ConfigError(f"{name} must be at most {MAX_DURATION_S:g} s (about 31 years), got {value!r}")
    return timedelta(seconds=seconds)
