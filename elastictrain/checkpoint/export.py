"""Exporting a checkpoint's model to one safetensors file, for inference: ``export_safetensors``.

The output holds the full tensors of one entry of the saved state (``"model"`` by default), by
their names in its state dict. A sharded checkpoint's tensors are assembled one at a time from
their chunks (each checked against its SHA-256 as it is read) and written as they are done, so
that memory holds one tensor, not the model; a DDP checkpoint's come from ``replicated.pt``
(checked, then read with ``torch.load(weights_only=True)``). The file is written beside ``out``
and renamed into place: a failed export leaves no partial file.

The safetensors layout (an 8-byte little-endian header length, a JSON header of each tensor's
dtype, shape and byte range, then the bytes) is written here rather than by the ``safetensors``
package, whose writer takes every tensor in memory at once.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch

from elastictrain.errors import CheckpointError, ConfigError

from . import _manifest as fmt
from . import _reshard as reshard
from ._index import SAFETENSORS_DTYPES, TensorMeta, key_of, parse_index
from ._reader import load_file
from ._sharded import PLACEHOLDER, tensor_bytes
from .storage import Storage, storage_for

__all__ = ["ExportInfo", "export_safetensors"]

_ALIGN = 8


@dataclass(frozen=True, kw_only=True, slots=True)
class ExportInfo:
    """What ``export_safetensors`` wrote."""

    step: int
    """The step of the exported checkpoint."""
    tensors: int
    """How many tensors the file holds."""
    bytes: int
    """The size of the file."""


def export_safetensors(checkpoint: str | os.PathLike[str], out: str | os.PathLike[str], *, step: int | None = None,
                       entry: str = "model") -> ExportInfo:
    """Write the full tensors of ``entry`` of a committed checkpoint to the safetensors file ``out``.

    Args:
        checkpoint: A checkpoint directory (``.../step_00000100``), or the directory (or
            ``s3://bucket/prefix``) that holds the checkpoints: then the newest committed
            one that verifies, or ``step``'s.
        out: The file to write (replaced if it exists).
        step: Which step to export from a directory of checkpoints.
        entry: The name the model was saved under in ``CheckpointManager.save``'s state.

    Raises:
        ConfigError: ``step`` given with a checkpoint directory of another step, or ``entry``
            is not in the checkpoint or holds no tensor, or a dtype safetensors does not hold.
        CheckpointError: No checkpoint there, or it does not verify (``CorruptCheckpointError``).
        OSError: ``out`` cannot be written.
    """
    storage, prefix, chosen = _locate(checkpoint, step)
    found = fmt.find_checkpoint(storage, prefix, chosen, checksums=False)
    if found is None:
        raise CheckpointError(f"no committed checkpoint in {storage.location(prefix)}")
    chosen, manifest = found
    directory = fmt.join(prefix, fmt.step_dir(chosen))
    where = storage.location(directory)
    files_at = fmt.files_dir(directory, manifest)
    replicated = fmt.FileEntry(fmt.REPLICATED, int(manifest["files"][fmt.REPLICATED]["size"]),
                               str(manifest["files"][fmt.REPLICATED]["sha256"]))
    fmt.verify_file(storage, directory, replicated, files_at)
    content = load_file(storage, directory, fmt.REPLICATED, files_at)
    saved = content.get("stateful", {}).get(entry) if isinstance(content, dict) else None
    if not isinstance(saved, dict):
        names = sorted(content.get("stateful", {})) if isinstance(content, dict) else []
        raise ConfigError(f"checkpoint {where} has no entry {entry!r} to export (it has {names})")
    index = parse_index(manifest.get("tensors"), where) \
        if manifest["format_version"] == fmt.SHARDED_FORMAT_VERSION else {}
    sources: dict[str, torch.Tensor | TensorMeta] = {}
    for name, value in saved.items():
        meta = index.get(key_of((entry, name)))
        if meta is not None and isinstance(value, str) and value == PLACEHOLDER:
            sources[str(name)] = meta
        elif isinstance(value, torch.Tensor):
            sources[str(name)] = value
    if not sources:
        raise ConfigError(f"entry {entry!r} of checkpoint {where} holds no tensor")
    with contextlib.ExitStack() as stack:
        opened: dict[str, BinaryIO] = {}

        @contextlib.contextmanager
        def open_file(name: str) -> Iterator[BinaryIO]:
            if name not in opened:  # kept open: an object store's file is fetched once
                opened[name] = stack.enter_context(storage.open_read(fmt.join(files_at, name)))
            yield opened[name]

        size = _write(Path(out), sources, open_file, where, step=chosen)
    return ExportInfo(step=chosen, tensors=len(sources), bytes=size)


def _locate(checkpoint: str | os.PathLike[str], step: int | None) -> tuple[Storage, str, int | None]:
    """The storage and checkpoints' prefix of ``checkpoint``, and the step to export (None: newest)."""
    try:
        storage, prefix = storage_for(checkpoint)
    except (ValueError, ImportError) as exc:
        raise ConfigError(f"checkpoint {os.fspath(checkpoint)!r}: {exc}") from exc
    if not storage.exists(prefix):
        raise CheckpointError(f"{storage.location(prefix)} does not exist")
    if not storage.exists(fmt.MANIFEST):
        return storage, prefix, step
    # A checkpoint directory itself: its parent holds the checkpoints.
    location = os.fspath(checkpoint).rstrip("/")
    parent_location, _, name = location.rpartition("/")
    named = fmt.parse_step_dir(name)
    if named is None:
        raise ConfigError(f"{location} holds a {fmt.MANIFEST} but is not named step_N")
    if step is not None and step != named:
        raise ConfigError(f"{location} is the checkpoint of step {named}, not {step}")
    parent, parent_prefix = storage_for(parent_location or ".")
    return parent, parent_prefix, named


def _write(out: Path, sources: dict[str, torch.Tensor | TensorMeta], open_file: reshard.OpenFile, where: str, *,
           step: int) -> int:
    header: dict[str, Any] = {"__metadata__": {"format": "pt", "elastictrain_step": str(step)}}
    position = 0
    for name in sorted(sources):
        source = sources[name]
        dtype, shape = (source.dtype, source.shape) if isinstance(source, TensorMeta) else \
            (source.dtype, tuple(source.shape))
        if dtype not in SAFETENSORS_DTYPES:
            raise ConfigError(f"{name!r} of checkpoint {where} has dtype {dtype}, which safetensors does not hold")
        length = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape),
                        "data_offsets": [position, position + length]}
        position += length
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % _ALIGN)
    partial = out.with_name(f".{out.name}.partial")
    try:
        with open(partial, "wb") as f:
            f.write(struct.pack("<Q", len(encoded)))
            f.write(encoded)
            for name in sorted(sources):
                source = sources[name]
                tensor = reshard.read_full(source, open_file, where) if isinstance(source, TensorMeta) else source
                f.write(tensor_bytes(tensor))
                del tensor
            f.flush()
            os.fsync(f.fileno())
        partial.replace(out)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    return 8 + len(encoded) + position
