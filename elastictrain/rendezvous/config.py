"""Timing of the etcd3 rendezvous, with validation and the defaults we chose.

Rendezvous defaults differ from torch's on purpose (see README, "Defaults"):
torch waits 30 s of ``last_call`` whenever fewer than ``max_nodes`` join and
notices a dead node after 5 s x 3 missed heartbeats; we use 1 s and 1 s x 5, so
a failed node costs seconds, not minutes. (1 s x 3 was measured too tight: on a
loaded 2-core machine an agent's heartbeats stalled for up to 3.8 s while its
workers started, and the other nodes dropped it from the rendezvous.)
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from elastictrain._durations import parse_duration
from elastictrain.errors import ConfigError
from elastictrain.etcd.conf import ETCD_CONF_KEYS

__all__ = ["RendezvousConfig", "check_conf_keys"]


def _positive_int(name: str, value: Any) -> int:
    try:
        number = value if isinstance(value, int) else int(str(value).strip())
    except ValueError:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}") from None
    if number < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    return number


@dataclass(frozen=True, kw_only=True, slots=True)
class RendezvousConfig:
    """Timing of the etcd3 rendezvous (``elastictrain.rendezvous.handler``)."""

    join_timeout: timedelta = timedelta(seconds=600)
    """How long a node waits for ``min_nodes`` to gather before giving up."""

    last_call_timeout: timedelta = timedelta(seconds=1)
    """Extra wait for latecomers once ``min_nodes`` are there (torch: 30 s)."""

    keep_alive_interval: timedelta = timedelta(seconds=1)
    """Period of each node's lease keep-alive (torch's heartbeat: 5 s)."""

    keep_alive_max_attempt: int = 5
    """The node's liveness lease lives this many intervals: etcd expires it (the node is
    gone) after this many keep-alives in a row were lost or late. 5 s by default."""

    state_ttl: timedelta = timedelta(hours=2)
    """Lifetime of the run's etcd keys once no node keeps them alive."""

    def __post_init__(self) -> None:
        for name in ("join_timeout", "last_call_timeout", "keep_alive_interval", "state_ttl"):
            value = getattr(self, name)
            if not isinstance(value, timedelta):
                raise ConfigError(f"{name} must be a timedelta, got {value!r}")
        if self.keep_alive_interval.total_seconds() <= 0:
            raise ConfigError("keep_alive_interval must be positive")
        if self.join_timeout.total_seconds() <= 0:
            # 0 timed the first round out before a node could form it, blaming a stale run
            raise ConfigError(f"join_timeout (--join-timeout) must be positive, got {self.join_timeout.total_seconds():g} s")
        if self.keep_alive_max_attempt < 2:
            # With one attempt a single late keep-alive expires a live node.
            raise ConfigError(
                f"keep_alive_max_attempt must be at least 2, got {self.keep_alive_max_attempt}"
            )
        window = self.liveness_ttl.total_seconds()
        if window < 2:
            # etcd rounds a shorter lease up to its own minimum (1.5 x its election
            # timeout; 1.5 s by default), and a busy machine stalls a keep-alive thread
            # for a second or more: a shorter lease drops live nodes.
            raise ConfigError(
                f"keep_alive_interval x keep_alive_max_attempt must be at least 2 s, got {window:g} s"
            )
        if self.state_ttl.total_seconds() < 10:
            raise ConfigError(f"state_ttl must be at least 10 s, got {self.state_ttl.total_seconds():g} s")

    @property
    def liveness_ttl(self) -> timedelta:
        """TTL of each node's liveness lease: ``keep_alive_interval x keep_alive_max_attempt``."""
        return self.keep_alive_interval * self.keep_alive_max_attempt

    _KEYS = ("join_timeout", "last_call_timeout", "keep_alive_interval", "keep_alive_max_attempt", "state_ttl")

    @classmethod
    def from_mapping(cls, conf: dict[str, Any]) -> RendezvousConfig:
        """Build from ``--rdzv-conf``-style keys (values in seconds, strings allowed)."""
        kwargs: dict[str, Any] = {}
        for key in cls._KEYS:
            if key in conf and conf[key] is not None:
                if key == "keep_alive_max_attempt":
                    kwargs[key] = _positive_int(key, conf[key])
                else:
                    kwargs[key] = parse_duration(key, conf[key])
        return cls(**kwargs)

    def as_mapping(self) -> dict[str, Any]:
        """The inverse of :meth:`from_mapping` (seconds as floats)."""
        out: dict[str, Any] = {}
        for key in self._KEYS:
            value = getattr(self, key)
            out[key] = value.total_seconds() if isinstance(value, timedelta) else value
        return out


def check_conf_keys(conf: dict[str, Any]) -> None:
    """Raises:
        ConfigError: ``conf`` (``--rdzv-conf``) has a key neither the rendezvous nor the etcd client reads.
    """
    valid = (*RendezvousConfig._KEYS, *ETCD_CONF_KEYS)  # noqa: SLF001
    unknown = sorted(set(conf) - set(valid))
    if unknown:
        raise ConfigError(f"unknown key{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}; "
                          f"valid keys: {', '.join(valid)}")
