"""Retention: what rank 0 deletes after a commit.

Checkpoints beyond ``keep_last`` (only directories holding a manifest: another ``step_N`` is not
ours), and every staging directory (stale: at most one save is in flight, and it just committed).
In an object store a retired checkpoint's manifest goes before its data, then every data prefix no
kept manifest names (a crashed or refused save's), then unfinished uploads. A newer world that
claimed the directory (its fencing token) owns what is in it: retention then deletes nothing.
"""

from __future__ import annotations

import json
import logging
import time

from . import _fence
from . import _manifest as fmt
from .storage import ObjectStore, Storage, delete_quietly

__all__ = ["retain"]

logger = logging.getLogger(__name__)


def retain(storage: Storage, prefix: str, *, committed: int, keep_last: int, fence: int | None) -> None:
    """Delete what the commit of step ``committed`` retired in ``prefix``; never raises for storage errors
    (each is logged: the next commit tries again).

    Args:
        storage: Where the checkpoints are.
        prefix: The checkpoints' directory in ``storage``.
        committed: The step just committed (kept).
        keep_last: How many committed checkpoints to keep, ``committed`` included.
        fence: The committing world's fencing token (``None``: none claimed, no check).
    """
    location = storage.location(prefix)
    try:
        if fence is not None:
            # A newer world that claimed the directory since our commit owns what is in it.
            _fence.check(storage, prefix, fence, what="retention")
        names = storage.list_dir(prefix)
    except _fence.FencedError as exc:
        logger.warning("%s", exc)
        return
    except OSError as exc:
        logger.warning("retention skipped: cannot list %s: %s", location, exc)
        return
    # Only directories holding a manifest are checkpoints this manager committed (a commit
    # renames a staging directory that holds one): another ``step_N`` is not ours to delete.
    others = sorted((s for n in names if (s := fmt.parse_step_dir(n)) is not None and s != committed
                     and storage.exists(fmt.join(prefix, n, fmt.MANIFEST))), reverse=True)
    if others and others[0] > committed:
        logger.warning("checkpoints of later steps exist (%s); restore prefers the highest step", others[0])
    # Every staging dir is stale here: at most one save is in flight, and it just committed.
    doomed = [fmt.step_dir(s) for s in others[keep_last - 1 :]] + [n for n in names if fmt.is_staging_dir(n)]
    if isinstance(storage, ObjectStore):
        _retain_objects(storage, prefix, names, [committed] + others[: keep_last - 1], doomed)
        return
    for name in doomed:
        delete_quietly(storage, fmt.join(prefix, name))


def _retain_objects(storage: ObjectStore, prefix: str, names: list[str], kept: list[int], doomed: list[str]) -> None:
    """Retention in an object store: a retired checkpoint's manifest goes first (a reader then
    finds it gone, not torn), then every data prefix that no kept manifest names (retired,
    replaced, or left by a crashed or refused save), then unfinished uploads (a crash mid-file)."""
    location = storage.location(prefix)
    for name in doomed:
        delete_quietly(storage, fmt.join(prefix, name))
    referenced: set[str] = set()
    for step in kept:
        try:
            with storage.open_read(fmt.join(prefix, fmt.step_dir(step), fmt.MANIFEST)) as f:
                data = json.loads(f.read()).get("data")
        except (OSError, ValueError, AttributeError) as exc:
            # Without every kept checkpoint's data prefix, none is safe to call garbage.
            logger.warning("retention kept unreferenced data: cannot read the manifest of step %d: %s", step, exc)
            return
        if isinstance(data, str):
            referenced.add(data)
    for name in names:
        if fmt.is_data_dir(name) and name not in referenced:
            delete_quietly(storage, fmt.join(prefix, name))
    try:
        # Every upload of this writer has finished: one still open was left by a crash.
        aborted = storage.abort_uploads(prefix, started_before=time.time())
    except OSError as exc:
        logger.warning("could not abort unfinished uploads in %s: %s", location, exc)
        return
    if aborted:
        logger.info("aborted %d unfinished upload(s) in %s (left by a crashed save)", aborted, location)
