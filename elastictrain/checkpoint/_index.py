"""The tensor index of a sharded checkpoint: the manifest's ``tensors`` field, as JSON and as data.

A sharded checkpoint (format version 2) stores each DTensor of the saved state as chunks, raw
bytes in the ranks' ``shards_<rank>.bin`` files. The manifest says where each chunk is::

    "tensors": {
      "model/layers.0.weight": {
        "path": ["model", "layers.0.weight"],     where it sits in the saved state
        "dtype": "float32",
        "shape": [1000, 512],                     the global shape
        "chunks": [
          {"file": "shards_00000.bin", "offsets": [0, 0], "sizes": [250, 512],
           "byte_offset": 0, "byte_length": 512000, "sha256": "..."},
          ...
        ]
      }, ...
    }

A chunk is a box of the global tensor (``offsets`` and ``sizes`` per dimension), stored C-order
and little-endian at ``byte_offset`` in its file, and its own SHA-256, so that a reader that
reads only some chunks verifies each one it reads. Everything here is parsed from JSON and
checked: a malformed index is a ``CorruptCheckpointError``, never a crash or a wrong tensor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from elastictrain.errors import CorruptCheckpointError

__all__ = ["ChunkMeta", "TensorMeta", "dtype_name", "key_of", "parse_index", "to_dtype", "SAFETENSORS_DTYPES"]

_DTYPE_NAMES = ("float64", "float32", "float16", "bfloat16", "complex64", "complex128", "int64", "int32", "int16",
                "int8", "uint8", "uint16", "uint32", "uint64", "bool", "float8_e4m3fn", "float8_e5m2")
_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in _DTYPE_NAMES if hasattr(torch, name)}
_NAMES = {dtype: name for name, dtype in _DTYPES.items()}

SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}
"""The dtypes a safetensors file holds, by their names there."""


def dtype_name(dtype: torch.dtype) -> str | None:
    """The index's name of ``dtype`` (``"float32"``), or None for a dtype the format does not store."""
    return _NAMES.get(dtype)


def to_dtype(name: str) -> torch.dtype:
    """The dtype an index names.

    Raises:
        KeyError: Not a dtype the format stores.
    """
    return _DTYPES[name]


def key_of(path: tuple[Any, ...]) -> str:
    """The index key of the tensor at ``path`` in the saved state (``("model", "w")`` -> ``"model/w"``)."""
    return "/".join(map(str, path))


@dataclass(frozen=True, slots=True)
class ChunkMeta:
    """One stored box of a tensor."""

    file: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    byte_offset: int
    byte_length: int
    sha256: str

    def to_json(self) -> dict[str, Any]:
        """The chunk as the manifest records it."""
        return {"file": self.file, "offsets": list(self.offsets), "sizes": list(self.sizes),
                "byte_offset": self.byte_offset, "byte_length": self.byte_length, "sha256": self.sha256}


@dataclass(frozen=True, slots=True)
class TensorMeta:
    """One tensor of the index: where it sits in the state, its dtype and global shape, its chunks."""

    key: str
    path: tuple[Any, ...]
    dtype: torch.dtype
    shape: tuple[int, ...]
    chunks: tuple[ChunkMeta, ...]


def parse_index(raw: Any, where: str) -> dict[str, TensorMeta]:
    """Parse and check a manifest's ``tensors``.

    Checks every field's type, that the dtype is one the format stores, that each chunk lies
    inside the tensor with a byte length that fits its box, and that the chunks' boxes add up
    to the whole tensor.

    Raises:
        CorruptCheckpointError: ``raw`` is not a well-formed index.
    """
    if not isinstance(raw, dict):
        raise CorruptCheckpointError(f"checkpoint {where}: its tensor index is not an object")
    index: dict[str, TensorMeta] = {}
    for key, entry in raw.items():
        try:
            index[key] = _parse_tensor(key, entry)
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptCheckpointError(f"checkpoint {where}: tensor {key!r} of the index is malformed: {exc}") \
                from exc
    return index


def _ints(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(type(v) is int and v >= 0 for v in value):
        raise ValueError(f"{what} is not a list of non-negative integers")
    return tuple(value)


def _parse_tensor(key: str, entry: Any) -> TensorMeta:
    if not isinstance(entry, dict):
        raise TypeError("not an object")
    path = entry["path"]
    if not isinstance(path, list) or not path or not all(type(p) in (str, int) for p in path) \
            or key_of(tuple(path)) != key:
        raise ValueError(f"path {path!r} does not name it")
    dtype = to_dtype(entry["dtype"])
    shape = _ints(entry["shape"], "shape")
    itemsize = torch.empty((), dtype=dtype).element_size()
    chunks = []
    volume = 0
    for raw in entry["chunks"]:
        if not isinstance(raw, dict) or not isinstance(raw["file"], str) or not isinstance(raw["sha256"], str):
            raise TypeError("a chunk is not an object with a file and a sha256")
        chunk = ChunkMeta(file=raw["file"], offsets=_ints(raw["offsets"], "offsets"),
                          sizes=_ints(raw["sizes"], "sizes"), byte_offset=_ints([raw["byte_offset"]], "byte_offset")[0],
                          byte_length=_ints([raw["byte_length"]], "byte_length")[0], sha256=raw["sha256"])
        if len(chunk.offsets) != len(shape) or len(chunk.sizes) != len(shape) or any(
                o + s > n for o, s, n in zip(chunk.offsets, chunk.sizes, shape, strict=True)):
            raise ValueError(f"chunk {chunk.offsets}+{chunk.sizes} does not lie inside shape {shape}")
        if chunk.byte_length != math.prod(chunk.sizes) * itemsize:
            raise ValueError(f"chunk {chunk.offsets}+{chunk.sizes} has {chunk.byte_length} bytes")
        volume += math.prod(chunk.sizes)
        chunks.append(chunk)
    if volume != math.prod(shape):
        raise ValueError(f"its chunks hold {volume} elements of {math.prod(shape)}")
    return TensorMeta(key=key, path=tuple(path), dtype=dtype, shape=shape, chunks=tuple(chunks))
