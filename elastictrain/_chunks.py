"""How a dimension of ``length`` splits into ``count`` chunks, as ``torch.chunk`` and DTensor's
``Shard(d)`` split it: chunks of ``ceil(length / count)``, the last ones shorter or empty.

Here rather than in either user: the checkpoint's regions (:func:`elastictrain.checkpoint.region`)
and the sharded state's exchange planner (:mod:`elastictrain.train.fsdp.regions`) must cut the same
way, and the planner is pure (no torch, no checkpoint package).
"""

from __future__ import annotations

__all__ = ["chunk_span"]


def chunk_span(length: int, index: int, count: int) -> tuple[int, int]:
    """The span (start, size) of chunk ``index`` of ``count`` of a dimension of ``length``.

    Chunk ``i`` starts at ``min(i * ceil(length / count), length)``; trailing chunks are shorter
    or empty (size 0, starting at ``length``) where ``count`` does not divide ``length``.

    Raises:
        ValueError: ``length`` is negative, ``count`` not positive, or ``index`` not in ``range(count)``.
    """
    if length < 0:
        raise ValueError(f"chunk length {length} is negative")
    if count < 1:
        raise ValueError(f"chunk count {count} is not positive")
    if not 0 <= index < count:
        raise ValueError(f"chunk index {index} is not in range({count})")
    step = -(-length // count)
    start = min(index * step, length)
    return start, min(step, length - start)
