"""The key layout of a run in etcd, and the run id that names it.

Everything elastictrain stores for run ``R`` lives under ``/elastictrain/R/``:

- ``rendezvous/state``: torch's rendezvous state (see ``Etcd3RendezvousBackend``);
- ``store/<round prefix>/...``: the c10d store keys of each rendezvous round.

Two runs on one etcd therefore never read or write each other's keys.
"""

from __future__ import annotations

from elastictrain.errors import ConfigError

__all__ = ["KEY_ROOT", "run_prefix", "validate_run_id"]

KEY_ROOT = "/elastictrain"

_RUN_ID_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")
_RUN_ID_MAX = 128


def validate_run_id(run_id: str) -> str:
    """Return ``run_id`` if it is safe as an etcd key segment.

    Raises:
        ConfigError: Empty, too long, or holding characters outside ``[A-Za-z0-9._-]``.
    """
    if not run_id:
        raise ConfigError("run id must not be empty")
    if len(run_id) > _RUN_ID_MAX:
        raise ConfigError(f"run id {run_id[:20]!r}... is {len(run_id)} characters; at most {_RUN_ID_MAX}")
    bad = sorted(set(run_id) - _RUN_ID_CHARS)
    if bad or run_id in {".", ".."}:
        raise ConfigError(
            f"run id {run_id!r} may hold only letters, digits, '.', '_' and '-'"
            + (f" (found {''.join(bad)!r})" if bad else "")
        )
    return run_id


def run_prefix(run_id: str) -> str:
    """The etcd key prefix that holds every key of one run (ends with ``/``)."""
    return f"{KEY_ROOT}/{validate_run_id(run_id)}/"
