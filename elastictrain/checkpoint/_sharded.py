"""Saving DTensor state as shards: each rank writes only its own local shards, once per replica group.

A save splits every ``DTensor`` out of the state (``split``): the rest of the state (plain tensors,
step counts, hyperparameters) stays in ``replicated.pt`` as before, with a placeholder where each
DTensor was, and the DTensors become chunks of the tensor index (:mod:`._index`). Each rank
writes the local shard of each DTensor (``local_chunks``) into its ``shards_<rank>.bin``
(``write_shards``), raw bytes streamed from the snapshot buffers, unless another replica writes the
same shard: along ``Replicate`` mesh dimensions the replicas share the work, each tensor going to
the replica with the fewest bytes so far, so that every shard is written exactly once and the
replicas write about as much as each other. One DTensor object under two keys (a tied weight, as
the sharded model's state gives it) is written once and indexed under both.

Placements: ``Shard(d)`` (uneven shards as ``torch.chunk`` makes them) and ``Replicate`` on a
mesh of any number of dimensions (fsdp ``(Shard(0),)``, hsdp ``(Replicate(), Shard(0))``). A
``Partial`` or a strided shard (FSDP over tensor parallel) is refused when saving.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from elastictrain._chunks import chunk_span
from elastictrain.errors import ConfigError

from . import _index as index
from ._manifest import FileEntry, HashingWriter, join
from .storage import Storage

__all__ = ["PLACEHOLDER", "ChunkPlanner", "LocalChunk", "TensorInfo", "build_index", "local_chunks", "region",
           "shard_file", "split", "tensor_bytes", "write_shards"]

PLACEHOLDER = "<sharded tensor: see the tensor index of MANIFEST.json>"
"""What ``replicated.pt`` holds where the state had a DTensor."""

_CONTAINERS = (dict, OrderedDict, list, tuple)


def shard_file(rank: int) -> str:
    """The name of ``rank``'s file of shards."""
    return f"shards_{rank:05d}.bin"


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """A DTensor of the saved state, as every rank sees it."""

    key: str
    path: tuple[Any, ...]
    dtype: torch.dtype
    shape: tuple[int, ...]
    same_as: str | None = None
    """The key of an earlier DTensor of the state that is this very object (a tied weight under
    two names): its chunks are written once, and the index lists them under both keys."""


@dataclass(slots=True)
class LocalChunk:
    """A local shard this rank writes: its box in the global tensor, and its bytes (a CPU tensor
    once snapshotted)."""

    key: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    tensor: torch.Tensor


def split(value: Any, path: tuple[Any, ...]) -> tuple[Any, list[tuple[tuple[Any, ...], DTensor]]]:
    """Return ``value`` with every DTensor replaced by ``PLACEHOLDER``, and the DTensors with their paths.

    ``value`` is returned as it is (not copied) when it holds no DTensor.
    """
    found: list[tuple[tuple[Any, ...], DTensor]] = []
    out = _split(value, path, found)
    return (out if found else value), found


def _split(value: Any, path: tuple[Any, ...], found: list[tuple[tuple[Any, ...], DTensor]]) -> Any:
    if isinstance(value, DTensor):
        found.append((path, value))
        return PLACEHOLDER
    kind = type(value)
    if kind in (dict, OrderedDict):
        out = kind()
        for key, item in value.items():
            out[key] = _split(item, (*path, key), found)
        return out
    if kind in (list, tuple):
        return kind(_split(item, (*path, i), found) for i, item in enumerate(value))
    return value


def region(shape: Sequence[int], mesh_shape: Sequence[int], coordinate: Sequence[int],
           placements: Sequence[Any], what: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The box (offsets, sizes) of the global tensor that the rank at ``coordinate`` of a mesh holds.

    ``Shard(d)`` splits dimension ``d`` as ``torch.chunk`` does (chunks of ``ceil(n / k)``, the last
    ones shorter or empty), mesh dimension by mesh dimension, as DTensor does.

    Raises:
        ConfigError: A placement other than ``Shard`` or ``Replicate``.
    """
    offsets, sizes = [0] * len(shape), list(shape)
    for mesh_dim, placement in enumerate(placements):
        if type(placement) is Replicate:
            continue
        if type(placement) is not Shard:  # Partial, or a strided shard (a subclass of Shard)
            raise ConfigError(f"{what}: placement {placement} cannot be checkpointed; Shard(d) and Replicate() can")
        dim = placement.dim % len(shape)
        start, sizes[dim] = chunk_span(sizes[dim], coordinate[mesh_dim], mesh_shape[mesh_dim])
        offsets[dim] += start
    return tuple(offsets), tuple(sizes)


def local_chunks(leaves: list[tuple[tuple[Any, ...], DTensor]]) -> tuple[list[TensorInfo], list[LocalChunk]]:
    """Describe the DTensors of a save and pick the local shards this rank writes.

    Along ``Replicate`` mesh dimensions, the replica that writes a tensor's shard is the one with
    the fewest bytes assigned so far, tensors taken in key order: every rank computes the same
    assignment from the global shapes, each shard is written once, and the replicas share the bytes.

    Returns:
        Every DTensor's description (the same on every rank), and this rank's chunks (their
        tensors are the live local shards: snapshot them).

    Raises:
        ConfigError: Two DTensors with one key, a dtype or placement the format does not store.
    """
    infos, planned = _plan(leaves)
    return infos, _chunks(leaves, planned)


class ChunkPlanner:
    """``local_chunks`` for one manager's saves, planning again only when the DTensors change.

    A training loop saves the same DTensors save after save (the parameters, the optimizer's
    state), and a plan depends only on what :func:`_signature` lists of them: while that is the
    same, the last save's plan holds, and only the local tensors are asked for again (FSDP2 may
    swap a parameter's local tensor in place). This runs on the training thread at every save: a
    plan costs microseconds per tensor, the comparison a fraction of that.
    """

    def __init__(self) -> None:
        self._signature: list[tuple[Any, ...]] | None = None
        self._plan: tuple[list[TensorInfo], list[_Planned]] = ([], [])

    def local_chunks(self, leaves: list[tuple[tuple[Any, ...], DTensor]]) -> tuple[list[TensorInfo], list[LocalChunk]]:
        """See :func:`local_chunks`."""
        signature = _signature(leaves)
        if signature != self._signature:
            self._signature = None  # a plan that fails is no plan
            self._plan = _plan(leaves)
            self._signature = signature
        infos, planned = self._plan
        return list(infos), _chunks(leaves, planned)


_Meshes = dict[int, tuple[tuple[int, ...], tuple[int, ...] | None]]
"""A save's meshes by ``id``: each one's shape and this rank's coordinate in it (asked once a mesh)."""


def _place(meshes: _Meshes, mesh: Any) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
    """``mesh``'s shape and this rank's coordinate there (``None``: it holds no part), kept in ``meshes``."""
    seen = meshes.get(id(mesh))
    if seen is None:
        seen = meshes[id(mesh)] = (tuple(mesh.shape), mesh.get_coordinate())
    return seen


def _signature(leaves: list[tuple[tuple[Any, ...], DTensor]]) -> list[tuple[Any, ...]]:
    """What the plan of ``leaves`` depends on, leaf by leaf: its key and path, dtype, global shape,
    placements, its mesh's shape and this rank's coordinate there, and the first leaf that is the
    same DTensor (a tied weight).

    By value: nothing refers to a tensor or mesh after the save (a weak reference to a parameter
    makes ``torch.utils.swap_tensors``, which ``Module._apply`` uses on DTensors, refuse it; a
    strong one would keep a resharded state's old shards in memory)."""
    meshes: _Meshes = {}
    first: dict[int, int] = {}  # id(DTensor) -> the first leaf that is it
    signature = []
    for leaf, (path, tensor) in enumerate(leaves):
        signature.append((index.key_of(path), path, tensor.dtype, tensor.shape, tensor.placements,
                          _place(meshes, tensor.device_mesh),
                          first.setdefault(id(tensor), leaf)))
    return signature


@dataclass(frozen=True, slots=True)
class _Planned:
    """A local chunk of a plan: which leaf of the save it is the shard of, and its box."""

    leaf: int
    key: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


def _chunks(leaves: list[tuple[tuple[Any, ...], DTensor]], planned: list[_Planned]) -> list[LocalChunk]:
    with torch.no_grad():  # to_local() is then the local tensor itself, not an autograd op's view of it
        return [LocalChunk(key=p.key, offsets=p.offsets, sizes=p.sizes, tensor=leaves[p.leaf][1].to_local())
                for p in planned]


def _plan(leaves: list[tuple[tuple[Any, ...], DTensor]]) -> tuple[list[TensorInfo], list[_Planned]]:
    """``local_chunks``'s plan: the descriptions, and the local chunks by the leaf they are of."""
    infos: list[TensorInfo] = []
    planned: list[_Planned] = []
    loads: dict[int, list[int]] = {}  # bytes assigned to each replica, by the number of replicas
    first: dict[int, str] = {}  # id(DTensor) -> the key it was first found under
    meshes: _Meshes = {}
    ordered = sorted(((index.key_of(path), i) for i, (path, _) in enumerate(leaves)))
    previous = None
    for key, leaf in ordered:
        path, tensor = leaves[leaf]
        if not all(type(p) in (str, int) for p in path):
            raise ConfigError(f"{_name(path)}: a DTensor's keys must be strings or integers")
        if key == previous:  # sorted: one key twice is two neighbours
            raise ConfigError(f"{_name(path)}: two DTensors of the state have the index key {key!r}")
        previous = key
        if index.dtype_name(tensor.dtype) is None:
            raise ConfigError(f"{_name(path)}: dtype {tensor.dtype} cannot be checkpointed in shards")
        shape = tuple(tensor.shape)
        if id(tensor) in first:  # the same tensor under a second name (tied weights): its bytes once
            infos.append(TensorInfo(key=key, path=path, dtype=tensor.dtype, shape=shape, same_as=first[id(tensor)]))
            continue
        first[id(tensor)] = key
        infos.append(TensorInfo(key=key, path=path, dtype=tensor.dtype, shape=shape))
        placements = tensor.placements
        mesh_shape, coordinate = _place(meshes, tensor.device_mesh)
        # Every rank counts every tensor (from global shapes only), so that all agree on the writers.
        replicated = [d for d, p in enumerate(placements) if type(p) is Replicate]
        replicas = math.prod(mesh_shape[d] for d in replicated)
        load = loads.setdefault(replicas, [0] * replicas)
        writer = load.index(min(load))
        load[writer] += math.prod(shape) * tensor.element_size()
        if coordinate is None:  # this rank holds no part of the mesh
            continue
        offsets, sizes = region(shape, mesh_shape, coordinate, placements, _name(path))
        for d in reversed(replicated):  # the writer's coordinate along the replicated dimensions
            writer, at = divmod(writer, mesh_shape[d])
            if coordinate[d] != at:
                break
        else:
            if math.prod(sizes) > 0:
                planned.append(_Planned(leaf=leaf, key=key, offsets=offsets, sizes=sizes))
    return infos, planned


def _name(path: tuple[Any, ...]) -> str:
    """How an error names the state entry at ``path``."""
    return "state" + "".join(f"[{p!r}]" for p in path)


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a CPU ``tensor``, C-order (copied only if it is not contiguous)."""
    flat = tensor.detach().contiguous().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy().data)


def write_shards(storage: Storage, directory: str, name: str, chunks: list[LocalChunk], *,
                 on_write: Callable[[], None] | None = None) -> tuple[FileEntry, list[tuple[str, dict[str, Any]]]]:
    """Write ``chunks`` (snapshotted: CPU tensors) durably into ``directory/name``, one after the other.

    Returns:
        The file's manifest entry, and each chunk's index record by tensor key.

    Raises:
        OSError: Writing failed (the partial file is removed).
    """
    records: list[tuple[str, dict[str, Any]]] = []
    with storage.open_write(join(directory, name)) as raw:
        writer = HashingWriter(raw, on_write)
        position = 0
        for chunk in chunks:
            data = tensor_bytes(chunk.tensor)
            digest = hashlib.sha256(data)
            writer.write(data)
            meta = index.ChunkMeta(file=name, offsets=chunk.offsets, sizes=chunk.sizes, byte_offset=position,
                                   byte_length=len(data), sha256=digest.hexdigest())
            records.append((chunk.key, meta.to_json()))
            position += len(data)
    return writer.entry(name), records


def build_index(infos: list[TensorInfo], records: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """The manifest's ``tensors``: every DTensor of the save with the chunks the ranks wrote of it
    (a tied weight's under each of its keys)."""
    by_key: dict[str, list[dict[str, Any]]] = {info.key: [] for info in infos}
    for key, record in records:
        by_key[key].append(record)
    for info in infos:
        if info.same_as is not None:  # a tied weight's second name: the first's chunks, the same bytes
            by_key[info.key] = by_key[info.same_as]
    return {info.key: {"path": list(info.path), "dtype": index.dtype_name(info.dtype), "shape": list(info.shape),
                       "chunks": sorted(by_key[info.key], key=lambda r: (r["offsets"], r["file"]))}
            for info in infos}
