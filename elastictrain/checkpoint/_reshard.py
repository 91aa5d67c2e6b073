"""Filling live state from a checkpoint at any world size and mesh: the restore side of sharding.

The live objects' ``state_dict()`` are the templates. Where the template holds a DTensor, the
rank reads only the chunks of the stored tensor that overlap its own local shard (at the
template's placements, on the template's mesh), verifies each chunk it reads against its
SHA-256, and builds a DTensor like the template's; where it holds a plain tensor, the whole
tensor is assembled from the chunks. A DDP checkpoint's full tensors are sliced for DTensor
templates. Nothing here unpickles: chunks are raw bytes, placed with ``torch.frombuffer``.

An optimizer that has not stepped has no state to serve as a template; its state entries take
the placements of the parameters they belong to (torch's own ``state_dict`` form, keyed by
parameter index).
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, BinaryIO

import torch
from torch.distributed.tensor import DTensor

from elastictrain.errors import CheckpointMismatchError, CorruptCheckpointError

from ._index import ChunkMeta, TensorMeta, key_of
from ._sharded import region

__all__ = ["OpenFile", "fill", "needs_filling", "read_full"]

OpenFile = Callable[[str], contextlib.AbstractContextManager[BinaryIO]]
"""Opens a file of the checkpoint by its name in the manifest."""


@dataclass(slots=True)
class _Need:
    """A box of one stored tensor that this rank fills, and what it becomes."""

    meta: TensorMeta
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    dest: torch.Tensor
    like: DTensor | None
    filled: int = 0

    def result(self) -> torch.Tensor:
        if self.like is None:
            return self.dest
        return _like(self.dest, self.like)


def _like(local: torch.Tensor, like: DTensor) -> DTensor:
    """A DTensor with ``like``'s mesh and placements whose local shard is ``local``."""
    local = local.to(like.to_local().device)
    return DTensor.from_local(local, like.device_mesh, like.placements, run_check=False, shape=like.shape,
                              stride=like.stride())


def needs_filling(templates: dict[str, Any]) -> bool:
    """Whether any template holds a DTensor (a DDP checkpoint must then be sliced)."""
    def walk(value: Any) -> bool:
        if isinstance(value, DTensor):
            return True
        if type(value) in (dict, OrderedDict):
            return any(walk(v) for v in value.values())
        if type(value) in (list, tuple):
            return any(walk(v) for v in value)
        return False
    return walk(templates)


def fill(saved: dict[str, Any], templates: dict[str, Any], index: dict[str, TensorMeta], open_file: OpenFile, *,
         params: dict[str, list[torch.Tensor]], where: str) -> dict[str, Any]:
    """Return ``saved`` (the stateful entries of ``replicated.pt``) with every stored tensor laid out
    as its template: a DTensor template gets a DTensor of its placements, a plain one a full tensor.

    Args:
        saved: Name -> the saved state dict (placeholders where the index has a tensor).
        templates: Name -> the live object's ``state_dict()``.
        index: The checkpoint's tensor index (empty for a DDP checkpoint).
        open_file: Opens a file of the checkpoint.
        params: Name -> an optimizer's parameters in ``state_dict`` order, for state it has not built yet.
        where: The checkpoint, for messages.

    Raises:
        CorruptCheckpointError: A chunk read does not match its checksum, or the file is short.
        CheckpointMismatchError: A stored tensor's shape differs from its template's.
        OSError: Reading failed.
    """
    needs: list[_Need] = []

    def merge(value: Any, template: Any, path: tuple[Any, ...]) -> Any:
        meta = index.get(key_of(path))
        if meta is not None:
            like = template if isinstance(template, torch.Tensor) else _param_template(path, params)
            return _plan(meta, like, needs)
        if isinstance(value, torch.Tensor) and isinstance(template, DTensor):
            return _slice(value, template, key_of(path))
        kind = type(value)
        if kind in (dict, OrderedDict):
            entries = template if isinstance(template, dict) else {}
            out = kind()
            for k, v in value.items():
                out[k] = merge(v, entries.get(k), (*path, k))
            return out
        if kind in (list, tuple):
            items = template if isinstance(template, (list, tuple)) else ()
            return kind(merge(v, items[i] if i < len(items) else None, (*path, i)) for i, v in enumerate(value))
        return value

    merged = {name: merge(value, templates.get(name), (name,)) for name, value in saved.items()}
    _read(needs, open_file, where)
    return {name: _resolve(value) for name, value in merged.items()}


def read_full(meta: TensorMeta, open_file: OpenFile, where: str) -> torch.Tensor:
    """Assemble the whole of one stored tensor from its chunks (each verified as it is read).

    Raises:
        CorruptCheckpointError: A chunk does not match its checksum, or the file is short.
        OSError: Reading failed.
    """
    needs: list[_Need] = []
    _plan(meta, None, needs)
    _read(needs, open_file, where)
    return needs[0].dest


def _param_template(path: tuple[Any, ...], params: dict[str, list[torch.Tensor]]) -> torch.Tensor | None:
    """The parameter an optimizer state entry at ``path`` (name, "state", index, entry) belongs to."""
    if len(path) == 4 and path[1] == "state" and type(path[2]) is int and path[0] in params:
        owned = params[path[0]]
        return owned[path[2]] if 0 <= path[2] < len(owned) else None
    return None


def _plan(meta: TensorMeta, like: torch.Tensor | None, needs: list[_Need]) -> _Need:
    template: DTensor | None = None
    offsets, sizes = (0,) * len(meta.shape), meta.shape
    if isinstance(like, DTensor) and tuple(like.shape) == meta.shape:
        coordinate = like.device_mesh.get_coordinate()
        if coordinate is not None:
            template = like
            offsets, sizes = region(meta.shape, like.device_mesh.shape, coordinate, like.placements, meta.key)
    elif isinstance(like, torch.Tensor) and tuple(like.shape) != meta.shape:
        raise CheckpointMismatchError(f"checkpoint does not fit {meta.key!r}: it has shape {meta.shape} in the "
                                      f"checkpoint but {tuple(like.shape)} in the live state")
    need = _Need(meta=meta, offsets=offsets, sizes=sizes, dest=torch.empty(sizes, dtype=meta.dtype), like=template)
    needs.append(need)
    return need


def _slice(full: torch.Tensor, template: DTensor, key: str) -> torch.Tensor:
    """A DTensor like ``template`` cut from a full tensor (a DDP checkpoint into a sharded job)."""
    if tuple(full.shape) != tuple(template.shape):
        raise CheckpointMismatchError(f"checkpoint does not fit {key!r}: it has shape {tuple(full.shape)} in the "
                                      f"checkpoint but {tuple(template.shape)} in the live state")
    coordinate = template.device_mesh.get_coordinate()
    if coordinate is None:
        return full
    offsets, sizes = region(full.shape, template.device_mesh.shape, coordinate, template.placements, key)
    local = full[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))].clone()
    return _like(local, template)


def _box(chunk: ChunkMeta, need: _Need) -> list[tuple[int, int]] | None:
    """The overlap of a chunk and a need, as (start, stop) per dimension in global coordinates."""
    box = []
    for co, cs, no, ns in zip(chunk.offsets, chunk.sizes, need.offsets, need.sizes, strict=True):
        start, stop = max(co, no), min(co + cs, no + ns)
        if start >= stop:
            return None
        box.append((start, stop))
    return box


def _read(needs: list[_Need], open_file: OpenFile, where: str) -> None:
    plan: dict[str, list[tuple[ChunkMeta, _Need, list[tuple[int, int]]]]] = {}
    for need in needs:
        for chunk in need.meta.chunks:
            box = _box(chunk, need)
            if box is not None:
                plan.setdefault(chunk.file, []).append((chunk, need, box))
    for name in sorted(plan):
        with open_file(name) as f:
            for chunk, need, box in sorted(plan[name], key=lambda item: item[0].byte_offset):
                data = _read_chunk(f, chunk, need.meta.key, where)
                source = torch.frombuffer(data, dtype=need.meta.dtype).view(chunk.sizes)
                src = tuple(slice(a - o, b - o) for (a, b), o in zip(box, chunk.offsets, strict=True))
                dst = tuple(slice(a - o, b - o) for (a, b), o in zip(box, need.offsets, strict=True))
                need.dest[dst].copy_(source[src])
                need.filled += math.prod(b - a for a, b in box)
    for need in needs:
        if need.filled != math.prod(need.sizes):
            raise CorruptCheckpointError(f"checkpoint {where}: the chunks of {need.meta.key!r} do not cover "
                                         f"the box {need.offsets}+{need.sizes}")


def _read_chunk(f: BinaryIO, chunk: ChunkMeta, key: str, where: str) -> bytearray:
    """Read one chunk's bytes and check them against its checksum."""
    data = bytearray(chunk.byte_length)
    view = memoryview(data)
    f.seek(chunk.byte_offset)
    got = 0
    while got < chunk.byte_length:
        n = f.readinto(view[got:])  # type: ignore[attr-defined]  # every storage's file (BufferedReader, BytesIO) has it
        if not n:
            raise CorruptCheckpointError(f"checkpoint {where}: {chunk.file} ends before the bytes of {key!r} "
                                         f"at {chunk.byte_offset}+{chunk.byte_length}")
        got += n
    if hashlib.sha256(data).hexdigest() != chunk.sha256:
        raise CorruptCheckpointError(f"checkpoint {where}: the bytes of {key!r} at {chunk.byte_offset} in "
                                     f"{chunk.file} do not match their sha256 checksum")
    return data


def _resolve(value: Any) -> Any:
    if isinstance(value, _Need):
        return value.result()
    kind = type(value)
    if kind in (dict, OrderedDict):
        out = kind()
        for k, v in value.items():
            out[k] = _resolve(v)
        return out
    if kind in (list, tuple):
        return kind(_resolve(v) for v in value)
    return value
