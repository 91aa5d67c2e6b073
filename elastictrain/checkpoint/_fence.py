"""Fencing tokens of the worlds that write one checkpoint directory.

A world cut off from etcd (its nodes' leases expired, a newer round formed without
them) may not notice for a while, and keeps training: its commits must not land in
the directory the newer round now writes, and its retention must not delete that
round's checkpoints. Each writing world claims a token when it starts: the next
integer after the highest ``.fence-<n>`` file in the directory, created exclusively
(``O_EXCL``: of two claimers of one number, one wins and the other takes the next).
A commit carries its token into the manifest and is refused once a higher token
exists: a newer world started writing here.

Why a token from the directory rather than from etcd: the fenced world is exactly the
one that cannot reach etcd, and a worker restarted by torch's agent is not told its
round. The directory is what the two worlds share, and a new world (a new round's
workers, or a re-formed group) claims its token before it restores, so the ordering
of tokens is the ordering of the worlds' starts.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import time
from typing import Any

from elastictrain.errors import CheckpointError

from .storage import Storage

__all__ = ["FencedError", "claim", "check", "newest"]

logger = logging.getLogger(__name__)

_FENCE_RE = re.compile(r"^\.fence-(\d+)$")
_KEEP = 4
_ATTEMPTS = 100


class FencedError(CheckpointError):
    """A newer world claimed the checkpoint directory: this world's commit is refused."""


def _name(token: int) -> str:
    return f".fence-{token:012d}"


def _tokens(storage: Storage, prefix: str) -> list[int]:
    try:
        names = storage.list_dir(prefix)
    except FileNotFoundError:
        return []
    return sorted(int(m.group(1)) for n in names if (m := _FENCE_RE.match(n)))


def _join(prefix: str, name: str) -> str:
    return f"{prefix.strip('/')}/{name}" if prefix.strip("/") else name


def newest(storage: Storage, prefix: str) -> int | None:
    """The highest token claimed in ``prefix``, or None.

    Raises:
        OSError: The directory cannot be listed.
    """
    tokens = _tokens(storage, prefix)
    return tokens[-1] if tokens else None


def claim(storage: Storage, prefix: str) -> int:
    """Claim the next token in ``prefix`` for this world; prune all but the newest few.

    Raises:
        OSError: The directory cannot be listed or written.
        CheckpointError: Others kept claiming the same numbers (many worlds starting at once).
    """
    holder = {"host": socket.gethostname(), "pid": os.getpid(), "time": time.time()}
    for _ in range(_ATTEMPTS):
        tokens = _tokens(storage, prefix)
        token = (tokens[-1] if tokens else 0) + 1
        try:
            with storage.open_write(_join(prefix, _name(token))) as f:
                f.write(json.dumps({"token": token, **holder}).encode())
        except FileExistsError:
            continue  # another world took this number first: take the next
        for old in tokens[: max(0, len(tokens) - (_KEEP - 1))]:  # _KEEP tokens remain, this one included
            try:
                storage.delete(_join(prefix, _name(old)))
            except OSError:
                pass  # an old token costs a few bytes, not correctness
        return token
    raise CheckpointError(f"could not claim a fencing token in {storage.location(prefix)} in {_ATTEMPTS} attempts")


def _holder(storage: Storage, prefix: str, token: int) -> dict[str, Any]:
    try:
        with storage.open_read(_join(prefix, _name(token))) as f:
            found = json.loads(f.read())
        return found if isinstance(found, dict) else {}
    except (OSError, ValueError):
        return {}


def check(storage: Storage, prefix: str, token: int, *, what: str) -> None:
    """Refuse ``what`` if a world newer than ``token`` claimed ``prefix``.

    Raises:
        FencedError: A higher token exists.
        OSError: The directory cannot be listed.
    """
    latest = newest(storage, prefix)
    if latest is None or latest <= token:
        return
    holder = _holder(storage, prefix, latest)
    since = time.strftime("%H:%M:%S", time.localtime(holder["time"])) if isinstance(
        holder.get("time"), (int, float)) else "?"
    raise FencedError(
        f"{what} refused: a newer world (fencing token {latest}, host {holder.get('host', '?')}, "
        f"pid {holder.get('pid', '?')}, since {since}) writes to {storage.location(prefix)}; this world "
        f"(token {token}) is stale, e.g. cut off from etcd while a newer round formed"
    )
