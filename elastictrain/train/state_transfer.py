"""Live replicas hand their state to the ranks that lack it, instead of a checkpoint.

When a group forms (at start, or re-formed in place after a fault), every rank says
whether it holds the training state and at which step. The newest step any rank
holds is the group's; the ranks holding it send it to every rank that does not: new
and replacement workers, and a survivor that did not apply the last step (a
collective that failed on some ranks and not on others), each receiver from one
holder, the holders taking turns. Applying an optimizer step is deterministic given
the all-reduced gradients, so every rank that holds the newest step holds the same
state: none is redone and none is lost.

Only the receivers receive (point to point): a rank that holds the state gets no
bytes, so a join costs the group one copy of the state per newcomer, sent by the
holders in parallel, whatever the number of survivors.

Only when no rank holds state (the whole job starts, or restarts) does the caller
read the checkpoint.

The state travels over a gloo group as raw tensor bytes: tensors of ``_DIRECT_BYTES`` and
more in messages of their own, from and into their own memory; smaller ones in one buffer
with the rest (containers, plain values, each tensor's shape and dtype) as ``torch.save``
bytes read back with ``torch.load(weights_only=True)``: a peer's bytes cannot run code here
either. No tensor is serialized.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from elastictrain.checkpoint import load_state_into, map_tensors, storage_key
from elastictrain.errors import ConfigError

logger = logging.getLogger(__name__)

__all__ = ["Agreement", "agree", "transfer"]


@dataclass(frozen=True, slots=True)
class Agreement:
    """What the ranks of a group hold, and who sends what to whom."""

    step: int | None
    """The newest step any rank holds; ``None`` when no rank holds state (read the checkpoint)."""
    holders: tuple[int, ...]
    """The ranks that hold it, lowest first; they send it."""
    receivers: tuple[int, ...]
    """Ranks that do not hold it and receive it."""

    @property
    def source(self) -> int | None:
        """The lowest rank holding the newest step; ``None`` when no rank holds state."""
        return self.holders[0] if self.holders else None

    @property
    def needed(self) -> bool:
        return bool(self.holders) and bool(self.receivers)

    def source_of(self, receiver: int) -> int:
        """The holder that sends to ``receiver``: the holders take turns."""
        return self.holders[self.receivers.index(receiver) % len(self.holders)]

    def receivers_of(self, holder: int) -> tuple[int, ...]:
        """The receivers ``holder`` sends to (none for a rank that is not a holder): every
        ``len(holders)``-th, from its place among the holders (see :meth:`source_of`)."""
        if holder not in self.holders:
            return ()
        return self.receivers[self.holders.index(holder)::len(self.holders)]


def agree(group: Any, *, holds: bool, step: int) -> Agreement:
    """Every rank's (holds, step), gathered over ``group`` (a CPU/gloo group); a collective.

    Raises:
        RuntimeError: The collective failed (a peer died).
    """
    mine = torch.tensor([1 if holds else 0, step], dtype=torch.int64)
    world = dist.get_world_size(group)
    everyone = [torch.zeros(2, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(everyone, mine, group=group)
    held = [(rank, int(t[1])) for rank, t in enumerate(everyone) if int(t[0])]
    if not held:
        return Agreement(None, (), ())
    newest = max(s for _, s in held)
    holders = tuple(rank for rank, s in held if s == newest)
    holding = set(holders)
    receivers = tuple(rank for rank in range(world) if rank not in holding)
    return Agreement(newest, holders, receivers)


_ALIGN = 64
"""Byte alignment of each tensor in the flat buffer (a view of any dtype needs its element size)."""
_DIRECT_BYTES = 1 << 20
"""Tensors this large travel in a message of their own, from and into their own memory;
smaller ones are copied into one buffer (one collective for all of them)."""


def _content(state: Mapping[str, Any], step: int) -> dict[str, Any]:
    content: dict[str, Any] = {"step": step, "stateful": {}, "extras": {}}
    for name, obj in state.items():
        if isinstance(obj, dict):
            content["extras"][name] = obj
        else:
            content["stateful"][name] = obj.state_dict()
    return content


def _raw(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` travels as raw bytes (else it is pickled in the skeleton)."""
    return tensor.layout == torch.strided and tensor.device.type != "meta"


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _encode(state: Mapping[str, Any], step: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The state as one uint8 buffer and the tensors sent on their own.

    The buffer holds a 16-byte header (skeleton bytes, total bytes), the skeleton (the
    state with every tensor replaced by a meta tensor of its shape and dtype, as
    ``torch.save`` bytes) and the bytes of each tensor under ``_DIRECT_BYTES``, aligned,
    in walk order. The larger ones follow it in walk order, each in a message of its
    own from its own memory. No tensor is serialized. A tensor that is the same view of
    the same storage as an earlier one (a tied weight under its second name) travels
    once: the skeleton's ``aliases`` name the earlier one, and it arrives as that object.
    """
    small: list[torch.Tensor] = []
    direct: list[torch.Tensor] = []
    seen: dict[tuple[Any, ...], int] = {}
    aliases: dict[int, int] = {}  # walk index -> the walk index of the same view, earlier
    walked = 0

    def placeholder(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal walked
        index, walked = walked, walked + 1
        if not _raw(tensor):
            return tensor
        view = (storage_key(tensor), tensor.storage_offset(), tuple(tensor.shape), tensor.stride(), tensor.dtype)
        if view in seen:
            aliases[index] = seen[view]
        else:
            seen[view] = index
            if _nbytes(tensor) >= _DIRECT_BYTES:
                direct.append(tensor.contiguous() if tensor.device.type == "cpu" else tensor.cpu())
            else:
                small.append(tensor)
        return torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")

    content = map_tensors(_content(state, step), placeholder)
    content["aliases"] = aliases
    skeleton = io.BytesIO()
    torch.save(content, skeleton)
    head = skeleton.getbuffer()
    offset = _aligned(16 + head.nbytes)
    spans = []
    for tensor in small:
        spans.append((offset, _nbytes(tensor)))
        offset = _aligned(offset + _nbytes(tensor))
    payload = torch.empty(offset, dtype=torch.uint8)
    payload[:16].view(torch.int64).copy_(torch.tensor([head.nbytes, offset], dtype=torch.int64))
    payload[16:16 + head.nbytes].copy_(torch.frombuffer(head, dtype=torch.uint8))
    for tensor, (start, nbytes) in zip(small, spans, strict=True):
        if nbytes:
            payload[start:start + nbytes].view(tensor.dtype).view(tensor.shape).copy_(tensor)
    return payload, direct


def _decode(payload: torch.Tensor) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """The content :func:`_encode` put in ``payload``, and the tensors (empty, in walk order)
    that the messages after it fill. Every tensor has memory of its own (a later save must
    not carry the buffer); an alias is the very tensor it names."""
    head_bytes = int(payload[:16].view(torch.int64)[0])
    skeleton = torch.load(io.BytesIO(payload[16:16 + head_bytes].numpy().tobytes()), map_location="cpu",
                          weights_only=True)
    aliases: dict[int, int] = skeleton.pop("aliases")
    offset = _aligned(16 + head_bytes)
    direct: list[torch.Tensor] = []
    walked: list[torch.Tensor] = []

    def fill(placeholder: torch.Tensor) -> torch.Tensor:
        walked.append(_fill(placeholder) if len(walked) not in aliases else walked[aliases[len(walked)]])
        return walked[-1]

    def _fill(placeholder: torch.Tensor) -> torch.Tensor:
        nonlocal offset
        if placeholder.device.type != "meta":
            return placeholder
        nbytes = _nbytes(placeholder)
        if nbytes >= _DIRECT_BYTES:
            direct.append(torch.empty(placeholder.shape, dtype=placeholder.dtype))
            return direct[-1]
        start, offset = offset, _aligned(offset + nbytes)
        if not nbytes:
            return torch.empty(placeholder.shape, dtype=placeholder.dtype)
        return payload[start:start + nbytes].view(placeholder.dtype).view(placeholder.shape).clone()

    return map_tensors(skeleton, fill), direct


def _aligned(offset: int) -> int:
    return (offset + _ALIGN - 1) // _ALIGN * _ALIGN


def transfer(group: Any, agreement: Agreement, state: Mapping[str, Any], *, step: int) -> bool:
    """Send ``state`` from the agreement's holders to its receivers, point to point; a
    collective (every rank of ``group`` calls it; the ranks that neither send nor receive
    take part only in one small all-gather).

    Args:
        group: A CPU (gloo) group of every rank.
        agreement: From :func:`agree`.
        state: The objects that make up the training state (``state_dict()``/
            ``load_state_dict()`` objects, or dicts of plain data updated in place).
        step: This rank's step (what a holder sends).

    Returns:
        Whether this rank received (and loaded) the state.

    Raises:
        RuntimeError: A send or receive failed (a peer died).
        CheckpointMismatchError: The state does not fit this rank's objects.
        ConfigError: The state holds a value that cannot be sent (on every rank: the holder
            names it).
    """
    if not agreement.needed:
        return False
    rank = dist.get_rank(group)
    sends_to = agreement.receivers_of(rank)
    refused: ConfigError | None = None
    if sends_to:
        try:
            payload, direct = _encode(state, step)
        except ConfigError as exc:
            refused = exc
    # Every rank learns at once whether a holder could not encode, instead of a receiver
    # waiting for bytes that never come and the others for a receiver that never arrives.
    flags = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size(group))]
    dist.all_gather(flags, torch.tensor([1 if refused is not None else 0], dtype=torch.int64), group=group)
    if refused is not None:
        raise refused
    failed = [r for r, flag in enumerate(flags) if int(flag)]
    if failed:
        raise ConfigError(f"rank {failed[0]} could not send the training state (its error says why)")
    if sends_to:
        # Each message has a tag of its own: the receiver matches them whatever the order.
        size = torch.tensor([payload.numel()], dtype=torch.int64)
        works = []
        for receiver in sends_to:
            peer = _global_rank(group, receiver)
            works += [dist.isend(tensor, peer, group=group, tag=tag)
                      for tag, tensor in enumerate([size, payload, *direct])]
        for work in works:
            work.wait()
        return False
    if rank not in agreement.receivers:
        return False
    src = agreement.source_of(rank)
    peer = _global_rank(group, src)
    size = torch.zeros(1, dtype=torch.int64)
    dist.recv(size, peer, group=group, tag=0)
    payload = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.recv(payload, peer, group=group, tag=1)
    content, direct = _decode(payload)
    works = [dist.irecv(tensor, peer, group=group, tag=tag) for tag, tensor in enumerate(direct, start=2)]
    for work in works:
        work.wait()
    load_state_into(state, content["stateful"], content["extras"], int(content["step"]))
    logger.debug("received step %d from rank %d (%d bytes)", content["step"], src,
                 payload.numel() + sum(_nbytes(tensor) for tensor in direct))
    return True


def _global_rank(group: Any, rank: int) -> int:
    """``rank`` of ``group`` as a rank of the default group (what ``send``/``recv`` take)."""
    return dist.get_global_rank(group, rank) if group is not None else rank
