"""Turning live training state into checkpoint payloads, and RNG states into plain data.

Everything here produces objects that ``torch.load(weights_only=True)`` can read
back: tensors, ``torch.Size``/dtype/device and plain containers of plain Python
scalars. Checking that at save time turns a confusing failure at restore time
(possibly days later) into a clear ``ConfigError`` naming the offending entry.
"""

from __future__ import annotations

import hashlib
import logging
import math
import random
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeAlias

import numpy as np
import torch
from torch.distributed.tensor import DTensor

from elastictrain.errors import CheckpointMismatchError, ConfigError, CorruptCheckpointError

__all__ = [
    "CopyPool",
    "StorageKey",
    "capture",
    "check_state",
    "check_step",
    "deferred",
    "first_non_finite",
    "load_state_into",
    "materialize",
    "snapshot",
    "storage_key",
    "tensors",
    "validate_state",
    "capture_rng",
    "restore_rng",
    "seed_rng",
    "fallback_seed",
]

logger = logging.getLogger(__name__)

# Exact types only: subclasses (defaultdict, namedtuple, numpy scalars that subclass
# float) are rejected by the weights_only unpickler. So is bytes, for b"" at least
# (pickled as a call to the bytes global); store raw bytes as a uint8 tensor.
_SCALARS: tuple[type, ...] = (type(None), bool, int, float, complex, str, torch.dtype, torch.device)
_MAPPINGS: tuple[type, ...] = (dict, OrderedDict)
_SEQUENCES: tuple[type, ...] = (list, tuple, set)


StorageKey = tuple[torch.device, int, int]
"""Identifies a storage: (device, data pointer, size in bytes)."""


def storage_key(tensor: torch.Tensor) -> StorageKey:
    """Return the key of ``tensor``'s storage; tensors that share a storage share a key. A
    DTensor's is its local shard's (an optimizer stepping a sharded parameter changes that)."""
    if isinstance(tensor, DTensor):
        tensor = tensor.to_local()
    storage = tensor.untyped_storage()
    return (tensor.device, storage.data_ptr(), storage.nbytes())


def _storage_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """Return ``storage`` as a flat uint8 tensor on its device (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class CopyPool:
    """The CPU storages snapshots copy into, kept from one save to the next.

    A fresh allocation of hundreds of MB page-faults on first touch, which costs
    more than the copy itself (5x here); refilling the previous snapshot's
    storages makes a copy a plain memcpy. The pool holds one snapshot's worth of
    memory (briefly more if a ``reserve`` races the first snapshot).

    Thread-safe: the training thread starts snapshots, a background thread may
    copy (overlapped saves) or ``reserve`` at the same time. One snapshot at a
    time: ``begin`` only once the previous snapshot is no longer read.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: dict[tuple[int, bool], list[torch.UntypedStorage]] = {}
        self._taken: list[tuple[int, bool, torch.UntypedStorage]] = []
        self._memo: dict[StorageKey, torch.UntypedStorage] = {}

    def begin(self) -> None:
        """Start a snapshot: the previous snapshot's storages (no longer read) become reusable."""
        with self._lock:
            self._free = {}
            for nbytes, pinned, storage in self._taken:
                self._free.setdefault((nbytes, pinned), []).append(storage)
            self._taken, self._memo = [], {}

    def clear(self) -> None:
        """Drop every storage."""
        with self._lock:
            self._free, self._taken, self._memo = {}, [], {}

    def empty(self) -> bool:
        """Return whether the pool holds no storage at all."""
        with self._lock:
            return not self._free and not self._taken

    def reserve(self, sizes: list[tuple[int, bool]]) -> None:
        """Allocate storages of these (bytes, pinned) sizes ahead of a snapshot, and fault their pages in.

        They serve the next snapshot as if a previous one had used them, so that
        the first save of a run copies into warm memory. Call it from a
        background thread: it costs about as much as the copy into fresh memory.
        """
        for nbytes, pinned in sizes:
            storage = _allocate(nbytes, pinned)
            with self._lock:
                self._taken.append((nbytes, pinned, storage))

    def copy_of(self, tensor: torch.Tensor, *, non_blocking: bool = False) -> torch.UntypedStorage:
        """Return a CPU copy of ``tensor``'s whole storage, made once per snapshot.

        Args:
            tensor: A CPU or device tensor.
            non_blocking: Enqueue a device-to-host copy on the current stream
                and return before it is done (the caller synchronizes).
        """
        key = storage_key(tensor)
        with self._lock:
            copy = self._memo.get(key)
            if copy is not None:
                return copy
            # Pinned memory makes device-to-host copies fast (and asynchronous);
            # allocating it is slow, which the reuse amortizes.
            nbytes, pinned = tensor.untyped_storage().nbytes(), tensor.is_cuda
            free = self._free.get((nbytes, pinned))
            copy = free.pop() if free else None
        if copy is None:
            copy = _allocate(nbytes, pinned, touch=False)  # the copy touches it
        # Through uint8 tensors, not UntypedStorage.copy_: a tensor copy releases the
        # GIL, so a copy on a background thread does not stall the training thread.
        _storage_bytes(copy).copy_(_storage_bytes(tensor.untyped_storage()), non_blocking=non_blocking)
        with self._lock:
            self._taken.append((nbytes, pinned, copy))
            self._memo[key] = copy
        return copy

    def copied(self, tensor: torch.Tensor) -> torch.UntypedStorage | None:
        """Return the copy of ``tensor``'s storage made in this snapshot, if any."""
        with self._lock:
            return self._memo.get(storage_key(tensor))


def _allocate(nbytes: int, pinned: bool, *, touch: bool = True) -> torch.UntypedStorage:
    buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    if touch and not pinned:  # pinned memory is resident from the start
        buffer.zero_()
    return buffer.untyped_storage()


def snapshot(obj: Any, *, copy: bool, pool: CopyPool, where: str = "state") -> Any:
    """Return ``obj`` with every tensor on the CPU, checking it is weights_only-loadable.

    Args:
        obj: A nested structure of dicts, lists, tuples, sets, scalars and tensors.
        copy: Copy CPU tensors too, so the caller may mutate the originals as soon
            as this returns (async save). Tensors sharing a storage keep sharing one
            copy, with the same offsets and strides, so the bytes ``torch.save``
            writes are the same with and without ``copy``.
        pool: Where copies go; call ``pool.begin()`` once per snapshot, before.
        where: How to name ``obj`` in error messages.

    Returns:
        A structure of the same shape whose tensors live in CPU memory.

    Raises:
        ConfigError: ``obj`` holds something ``torch.load(weights_only=True)`` refuses.
    """
    return _walk(obj, where, lambda tensor: _to_cpu(tensor, pool, copy))


def validate_state(obj: Any, *, where: str = "state") -> None:
    """Check ``obj`` like ``snapshot`` does, without copying anything.

    Raises:
        ConfigError: ``obj`` holds something ``torch.load(weights_only=True)`` refuses.
    """
    _walk(obj, where, None)


def capture(obj: Any, *, pool: CopyPool, where: str = "state") -> tuple[Any, list[torch.Tensor]]:
    """Check ``obj`` and capture its structure now, leaving the tensor copies for later (an overlapped save).

    Containers and scalars are copied now; strided CPU and CUDA tensors are kept
    as references, to be copied by ``pool.copy_of`` before ``materialize``. Other
    tensors (sparse, other devices) are copied now, as ``snapshot`` would.

    Args:
        obj: As for ``snapshot``.
        pool: Where copies go; call ``pool.begin()`` once per snapshot, before.
        where: How to name ``obj`` in error messages.

    Returns:
        The captured structure, and the tensors it still references.

    Raises:
        ConfigError: ``obj`` holds something ``torch.load(weights_only=True)`` refuses.
    """
    references: list[torch.Tensor] = []

    def keep(tensor: torch.Tensor) -> torch.Tensor:
        if deferred(tensor):
            references.append(tensor)
            return tensor
        return _to_cpu(tensor, pool, True)

    return _walk(obj, where, keep), references


def deferred(tensor: torch.Tensor) -> bool:
    """Return whether ``capture`` leaves ``tensor`` to be copied later.

    Strided CPU and CUDA tensors only: their copy can be ordered against later
    changes (CPU work is done when issued; CUDA work is ordered by streams and
    events). Other devices and layouts are copied at once.
    """
    return tensor.layout == torch.strided and tensor.device.type in ("cpu", "cuda")


def materialize(captured: Any, pool: CopyPool) -> Any:
    """Return what ``capture`` returned with every reference replaced by its copy in ``pool``.

    The copies must be complete (device-to-host copies synchronized) before the
    result is read.
    """

    def copied(tensor: torch.Tensor) -> torch.Tensor:
        copy = pool.copied(tensor) if deferred(tensor) else None  # else copied by capture already
        return tensor if copy is None else _view(copy, tensor)

    return _walk(captured, "state", copied)


def tensors(obj: Any) -> list[torch.Tensor]:
    """Return the tensors in ``obj`` (a structure ``snapshot`` accepts), in walk order.

    Raises:
        ConfigError: ``obj`` holds something ``torch.load(weights_only=True)`` refuses.
    """
    found: list[torch.Tensor] = []
    _walk(obj, "state", found.append)
    return found


def first_non_finite(named: Iterable[tuple[str, Any]]) -> str | None:
    """The name of the first floating-point tensor among ``named`` that holds NaN or infinity.

    A sum is non-finite when an element is (summing is about 20x faster than ``isfinite``
    on a CPU); a sum that overflowed is checked element by element, so it is no false alarm.
    """
    for name, tensor in named:
        if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point() or tensor.numel() == 0:
            continue
        total = tensor.sum(dtype=torch.float32) if tensor.element_size() < 4 else tensor.sum()
        if not math.isfinite(total.item()) and not bool(torch.isfinite(tensor).all()):
            return name
    return None


def map_tensors(obj: Any, leaf: Callable[[torch.Tensor], Any]) -> Any:
    """A copy of ``obj`` (a structure ``snapshot`` accepts) with each tensor replaced by
    ``leaf(tensor)``, in walk order.

    Raises:
        ConfigError: ``obj`` holds something ``torch.load(weights_only=True)`` refuses.
    """
    return _walk(obj, "state", leaf)


_Where: TypeAlias = "str | tuple[_Where, Any]"
"""Where ``_walk`` is, spelt only for an error: a name, or (where its container is, its key or index)."""


def _spell(where: _Where) -> str:
    keys: list[Any] = []
    while isinstance(where, tuple):
        where, key = where
        keys.append(key)
    return where + "".join(f"[{key!r}]" for key in reversed(keys))


def _walk(obj: Any, where: _Where, leaf: Callable[[torch.Tensor], Any] | None) -> Any:
    # leaf=None: validate only. Runs on the training thread at every save, over every entry.
    kind = type(obj)
    if kind in _SCALARS:
        return obj
    if isinstance(obj, torch.Tensor):
        _check_tensor(obj, where)
        return None if leaf is None else leaf(obj.detach())
    if kind is torch.Size:
        return obj
    if kind in _MAPPINGS:
        out = kind()
        for key, value in obj.items():
            if type(key) not in _SCALARS:
                raise ConfigError(f"{_spell(where)}: key {key!r} of type {type(key).__name__} cannot be saved")
            out[key] = _walk(value, (where, key), leaf)
        return out
    if kind in _SEQUENCES:
        items = [_walk(value, (where, i), leaf) for i, value in enumerate(obj)]
        if kind is set and all(new is old for new, old in zip(items, obj, strict=True)):
            # A copy of the table keeps the iteration (so pickling) order, walk after walk; a
            # set rebuilt element by element may not (colliding hashes land elsewhere).
            return set(obj)
        return kind(items)
    raise ConfigError(
        f"{_spell(where)}: a value of type {kind.__module__}.{kind.__qualname__} cannot be loaded back with "
        "torch.load(weights_only=True); store tensors, plain containers and int/float/str/bool/None "
        "(convert numpy values with .tolist() or torch.from_numpy)"
    )


def _check_tensor(tensor: torch.Tensor, where: _Where) -> None:
    # Parameter is fine (detach() makes it a plain tensor). DTensors never get here from a save
    # (the manager writes them in shards); other subclasses are not supported.
    if type(tensor) not in (torch.Tensor, torch.nn.Parameter):
        raise ConfigError(f"{_spell(where)}: tensor subclass {type(tensor).__name__} is not supported")


def _to_cpu(tensor: torch.Tensor, pool: CopyPool, copy: bool) -> torch.Tensor:
    if tensor.layout != torch.strided:
        return tensor.clone().cpu() if copy else tensor.cpu()
    if not copy and tensor.device.type == "cpu":
        return tensor
    # Copy whole storages, once each, and rebuild views onto the copies: two state
    # dict entries that alias (tied weights) stay aliased, exactly as torch.save
    # would have written the originals.
    return _view(pool.copy_of(tensor), tensor)


def _view(storage: torch.UntypedStorage, like: torch.Tensor) -> torch.Tensor:
    out = torch.empty((), dtype=like.dtype)
    out.set_(storage, like.storage_offset(), like.size(), like.stride())
    return out


def capture_rng() -> dict[str, Any]:
    """Return this process's RNG states (torch CPU, CUDA if initialized, numpy, ``random``) as plain data."""
    np_state = np.random.get_state(legacy=True)
    version, internal, gauss_next = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "bit_generator": str(np_state[0]),
            "key": torch.from_numpy(np.asarray(np_state[1], dtype=np.int64)),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached_gaussian": float(np_state[4]),
        },
        "python": {"version": version, "internal": list(internal), "gauss_next": gauss_next},
    }
    # Querying the CUDA RNG initializes CUDA; a CPU-only job must not pay for that.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(saved: Any, *, where: str) -> None:
    """Set this process's RNG states from what ``capture_rng`` returned, wrapped as ``{"rng": ...}``.

    Raises:
        CorruptCheckpointError: ``saved`` holds no valid RNG state.
    """
    try:
        state = saved["rng"]
        torch.set_rng_state(state["torch"])
        np_state = state["numpy"]
        np.random.set_state(
            (
                np_state["bit_generator"],
                np_state["key"].numpy().astype(np.uint32),
                np_state["pos"],
                np_state["has_gauss"],
                np_state["cached_gaussian"],
            )
        )
        py_state = state["python"]
        random.setstate((py_state["version"], tuple(py_state["internal"]), py_state["gauss_next"]))
    except (KeyError, TypeError, ValueError, RuntimeError, AttributeError) as exc:
        raise CorruptCheckpointError(f"{where} holds no valid RNG state: {exc!r}") from exc
    cuda_states = state.get("cuda")
    if cuda_states is not None and torch.cuda.is_available():
        if len(cuda_states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda_states)
        else:
            logger.warning(
                "checkpoint holds %d CUDA RNG states but %d devices are visible; CUDA RNG not restored",
                len(cuda_states),
                torch.cuda.device_count(),
            )


def fallback_seed(checkpoint_digest: str, rank: int) -> int:
    """Return the seed for a rank that has no saved RNG state of its own.

    The seed depends on the checkpoint (through the digest of its rank-0 RNG file)
    and the rank, so a restore is reproducible, different runs differ, and no two
    ranks share a stream.
    """
    digest = hashlib.sha256(f"elastictrain-rng:{checkpoint_digest}:{rank}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1  # < 2**63: every RNG accepts it


def seed_rng(seed: int) -> None:
    """Seed torch (CPU and all CUDA devices), numpy's global RNG and ``random`` with ``seed``."""
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)


def _check_module_shapes(name: str, module: torch.nn.Module, saved: Any) -> None:
    """Raise if a saved module state dict has a tensor whose shape differs from the module's.

    Missing and unexpected keys are left to ``load_state_dict``; this exists
    because a shape error is the common case and deserves both shapes by name.

    Raises:
        CheckpointMismatchError: ``saved`` is not a dict, or a shape differs.
    """
    if not isinstance(saved, dict):
        raise CheckpointMismatchError(f"checkpoint entry {name!r} is a {type(saved).__name__}, not a state dict")
    for key, current in module.state_dict().items():
        stored = saved.get(key)
        if isinstance(stored, torch.Tensor) and isinstance(current, torch.Tensor) and stored.shape != current.shape:
            raise CheckpointMismatchError(
                f"checkpoint does not fit {name}: parameter {key!r} has shape {tuple(stored.shape)} "
                f"in the checkpoint but {tuple(current.shape)} in the {name}"
            )


def _check_optimizer_kind(name: str, optimizer: torch.optim.Optimizer, saved: Any, step: int) -> None:
    """Refuse the state of another kind of optimizer: torch's ``load_state_dict`` takes it and
    replaces the options of every parameter group, and the first ``step()`` fails on an
    option that is gone (``KeyError: 'betas'`` for SGD's state in Adam)."""
    groups = saved.get("param_groups") if isinstance(saved, dict) else None
    if not isinstance(groups, list) or not all(isinstance(group, dict) for group in groups):
        return
    # An option an older torch did not save is filled in by the class's own __setstate__
    # (group.setdefault(...)): ask it, on a bare instance, which options stay missing.
    probe = object.__new__(type(optimizer))
    try:
        probe.__setstate__({"defaults": dict(optimizer.defaults), "state": {},
                            "param_groups": [dict(group) for group in groups]})
        missing = sorted({key for group in probe.param_groups for key in optimizer.defaults if key not in group})
    except Exception:  # noqa: BLE001 - an optimizer of its own kind: torch's load decides
        return
    if missing:
        raise CheckpointMismatchError(
            f"checkpoint of step {step} holds another kind of optimizer for {name!r}: its parameter groups lack "
            f"{', '.join(repr(k) for k in missing)}, which {type(optimizer).__name__} needs")


def check_step(step: object) -> None:
    """Check a ``step`` argument.

    Raises:
        ConfigError: ``step`` is not a non-negative int.
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ConfigError(f"step must be a non-negative int, got {step!r}")


def check_state(state: Mapping[str, Any]) -> None:
    """Check the ``state`` argument of ``save``/``restore``: names to stateful objects or dicts.

    Raises:
        ConfigError: ``state`` is not such a mapping.
    """
    if not isinstance(state, Mapping):
        raise ConfigError(f"state must be a mapping of name to object, got {type(state).__name__}")
    for name, obj in state.items():
        if not isinstance(name, str) or not name:
            raise ConfigError(f"state names must be non-empty strings, got {name!r}")
        stateful = callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))
        if not isinstance(obj, dict) and not stateful:
            raise ConfigError(
                f"state[{name!r}] is a {type(obj).__name__}: it needs state_dict()/load_state_dict(), or be a dict"
            )


def load_state_into(state: Mapping[str, Any], stateful: dict[str, Any], extras: dict[str, Any], step: int) -> None:
    """Load a checkpoint's entries into ``state``'s objects; dicts are updated in place.

    Raises:
        CheckpointMismatchError: An entry is missing or does not fit its object.
    """
    # Check everything before changing anything: a mismatch leaves the objects as they were.
    for name, obj in state.items():
        saved = extras if isinstance(obj, dict) else stateful
        if name not in saved:
            raise CheckpointMismatchError(
                f"checkpoint of step {step} has no entry {name!r}; "
                f"it has {sorted(stateful)} and extras {sorted(extras)}"
            )
        if isinstance(obj, torch.nn.Module):
            _check_module_shapes(name, obj, saved[name])
        if isinstance(obj, torch.optim.Optimizer):
            _check_optimizer_kind(name, obj, saved[name], step)
    for name, obj in state.items():
        if isinstance(obj, dict):
            obj.clear()
            obj.update(extras[name])
            continue
        try:
            obj.load_state_dict(stateful[name])
        except (RuntimeError, ValueError, KeyError, TypeError) as exc:
            raise CheckpointMismatchError(f"checkpoint of step {step} does not fit {name!r}: {exc}") from exc
