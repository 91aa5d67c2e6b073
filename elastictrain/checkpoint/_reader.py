"""The restore side of :class:`~elastictrain.checkpoint.manager.CheckpointManager`: the ranks
agree on the newest committed checkpoint that verifies (rank 0 chooses, every rank checks that
it sees no newer one), then each checks the checksums of the files it loads and loads them;
if one does not verify on any rank, every rank tries the one before.
"""

from __future__ import annotations

import contextlib
import io
import logging
import pickle
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, BinaryIO

import torch

from elastictrain.errors import CheckpointError, CheckpointMismatchError, CorruptCheckpointError

from . import _manifest as fmt
from . import _reshard as reshard
from . import _snapshot as snap
from ._index import parse_index
from .coordinator import Coordinator
from .storage import LocalStorage, ObjectStore, Storage

__all__ = ["CheckpointReader", "RestoreInfo", "load_file"]

logger = logging.getLogger(__name__)
_events = logging.getLogger("elastictrain.events")

_ZIP_MAGIC = b"PK\x03\x04"
"""How a file ``torch.save`` wrote begins (a zip archive): the only kind ``torch.load`` maps."""

_AGREE_ATTEMPTS = 5
_LOAD_ATTEMPTS = 20


@dataclass(frozen=True, kw_only=True, slots=True)
class RestoreInfo:
    """What ``CheckpointManager.restore`` loaded."""

    step: int
    """The step the checkpoint was saved at."""
    path: str
    """Where the checkpoint lives (a filesystem path for ``LocalStorage``)."""
    world_size: int
    """How many ranks saved it (may differ from the current world size)."""
    extras: dict[str, dict[str, Any]]
    """Every plain-dict entry that was saved, by name."""


class CheckpointReader:
    """Finds and loads committed checkpoints with the other ranks (every method is a collective).

    Args:
        storage: Where the checkpoints' bytes are.
        prefix: The checkpoints' directory in ``storage``.
        coordinator: How the ranks agree.
        host: This rank's host name, for messages.
    """

    def __init__(self, storage: Storage, prefix: str, coordinator: Coordinator, *, host: str) -> None:
        self._storage = storage
        self._prefix = prefix
        self._coord = coordinator
        self._host = host

    @property
    def location(self) -> str:
        """Where the checkpoints live, for humans."""
        return self._storage.location(self._prefix)

    def restore(self, state: Mapping[str, Any], step: int | None = None) -> RestoreInfo | None:
        """Load the newest checkpoint that verifies (or ``step``'s) into ``state``: see
        :meth:`CheckpointManager.restore <elastictrain.checkpoint.manager.CheckpointManager.restore>`."""
        skip: set[int] = set()
        templates: _Templates | None = None
        for _ in range(_LOAD_ATTEMPTS):
            found = self.agree(step, frozenset(skip))
            if found is None:
                logger.info("no checkpoint in %s; starting from scratch", self.location)
                return None
            chosen, manifest = found
            directory = fmt.join(self._prefix, fmt.step_dir(chosen))
            if templates is None:  # on every rank, in step: a state_dict() may be a collective
                templates = _templates(state)
            # Every rank checks the checksums of what it loads, before anything changes:
            # rank 0's view of the directory is not proof of another node's.
            loaded, problem = self._load_verified(directory, manifest, templates)
            problems = [(r, p) for r, p in enumerate(self._coord.all_gather(problem)) if p is not None]
            if not problems:
                break
            mismatch = [p for _, (kind, p) in problems if kind == "mismatch"]
            if mismatch:
                raise CheckpointMismatchError(mismatch[0])
            fatal = [p for _, (kind, p) in problems if kind == "fatal"]
            if fatal:
                raise CorruptCheckpointError(fatal[0])
            corrupt = [f"rank {r} ({p})" for r, (kind, p) in problems if kind == "corrupt"]
            if corrupt:
                message = f"checkpoint of step {chosen} does not verify on " + "; ".join(corrupt)
                if step is not None:
                    raise CorruptCheckpointError(message)
                logger.warning("%s: trying an older one", message)
                skip.add(chosen)
            # Otherwise it vanished under a rank (retired by its writer): agree again.
        else:
            raise CheckpointError(f"could not load a checkpoint from {self.location} in {_LOAD_ATTEMPTS} attempts: "
                                  "they kept vanishing or failing verification")
        step = chosen
        assert loaded is not None  # noqa: S101 - no problem reported on this rank
        content, rng = loaded
        snap.load_state_into(state, content["stateful"], content["extras"], step)
        self._restore_rng(rng, manifest, step)
        info = RestoreInfo(
            step=step,
            path=self._storage.location(directory),
            world_size=manifest["world_size"],
            extras=content["extras"],
        )
        logger.info(
            "restored step %d from %s (saved by %d ranks, restored by %d)",
            step, info.path, info.world_size, self._coord.world_size,
        )
        _events.info("checkpoint_restore", extra={"elastictrain_event": {"step": step, "path": info.path}})
        return info

    def agree(self, step: int | None, skip: frozenset[int] = frozenset()) -> tuple[int, dict[str, Any]] | None:
        """Rank 0's choice of checkpoint (manifest and sizes checked), on every rank; a collective.

        Every rank also lists the directory: a rank that sees a newer step than rank
        0 (its node's directory is not the one rank 0 reads) makes every rank fail,
        rather than restore an older step, or start from scratch, silently.
        """
        for _ in range(_AGREE_ATTEMPTS):
            found: tuple[int, dict[str, Any]] | CheckpointError | None = None
            if self._coord.rank == 0:
                try:
                    found = fmt.find_checkpoint(self._storage, self._prefix, step, checksums=False, skip=skip)
                except CheckpointError as exc:
                    found = exc
            listed: int | None | str
            try:
                listed = fmt.newest_listed(self._storage, self._prefix)
            except OSError as exc:
                listed = f"cannot list it: {exc}"
            reply = self._coord.broadcast(found)
            views = self._coord.all_gather((listed, self._host))
            # Every rank raises rank 0's error, so none is left waiting in a collective.
            if isinstance(reply, CheckpointError):
                raise reply
            mine = views[0][0]
            ahead = [(r, s, host) for r, (s, host) in enumerate(views)
                     if isinstance(s, str) or (s is not None and (not isinstance(mine, int) or s > mine))]
            if not ahead:
                return reply
            newer = [s for _, s, _ in ahead if isinstance(s, int)]
            # A writer may have committed between the listings (this is a reader): look again.
            raced = False
            if self._coord.rank == 0:
                raced = len(newer) == len(ahead) and all(
                    self._storage.exists(fmt.join(self._prefix, fmt.step_dir(s))) for s in newer)
            if self._coord.broadcast(raced):
                continue
            what = "; ".join(f"rank {r} on host {host} sees " + (s if isinstance(s, str) else f"step {s}")
                             for r, s, host in ahead)
            raise CheckpointError(
                f"ranks disagree on the checkpoints in {self.location}: {what}, but rank 0 on host {views[0][1]} "
                f"sees {'newest step ' + str(mine) if mine is not None else 'none'}; the directory must be one "
                "filesystem shared by every node (a node-local or missing mount would restore an older step or "
                "start from scratch)"
            )
        raise CheckpointError(f"checkpoints in {self.location} kept changing while the ranks agreed on one")

    def _load_verified(
        self, directory: str, manifest: dict[str, Any], templates: _Templates
    ) -> tuple[tuple[Any, Any] | None, tuple[str, str] | None]:
        """Check the checksums of this rank's files of a checkpoint, then load them; of a sharded
        checkpoint, read the chunks this rank's templates need (each checked against its checksum).

        Returns:
            ``((replicated content, RNG state or None), None)``, or ``(None, (kind, message))``
            where kind is ``"vanished"`` (retired meanwhile: agree again), ``"corrupt"``
            (try an older one), ``"fatal"`` (a file that is not plain data) or ``"mismatch"``
            (a stored tensor does not fit its template).
        """
        rank = self._coord.rank
        names = [fmt.REPLICATED] + ([fmt.rank_file(rank)] if rank < manifest["world_size"] else [])
        sharded = manifest["format_version"] == fmt.SHARDED_FORMAT_VERSION
        # A DDP checkpoint's full tensors cut into shards: mapped, so that only the slices are paged in.
        sliced = not sharded and reshard.needs_filling(templates.state_dicts)
        try:
            loaded: list[Any] = []
            files_at = fmt.files_dir(directory, manifest)
            for name in names:
                entry = manifest["files"][name]
                expected = fmt.FileEntry(name, int(entry["size"]), str(entry["sha256"]))
                if isinstance(self._storage, ObjectStore):  # one download, checked before it is loaded
                    loaded.append(load_file(self._storage, directory, name, files_at, expected))
                    continue
                fmt.verify_file(self._storage, directory, expected, files_at)
                loaded.append(load_file(self._storage, directory, name, files_at,
                                        mmap=sliced and name == fmt.REPLICATED))
            content = loaded[0]
            if not isinstance(content, dict) or not {"stateful", "extras"} <= content.keys():
                return None, ("fatal", f"{self._storage.location(directory)}: {fmt.REPLICATED} has no state")
            index = parse_index(manifest.get("tensors"), self._storage.location(directory)) if sharded else {}
            if index or reshard.needs_filling(templates.state_dicts):
                # DTensors may sit in either kind; entries the state does not ask for are not read.
                saved = {name: value for kind in ("extras", "stateful") for name, value in content[kind].items()
                         if name in templates.state_dicts}
                filled = reshard.fill(saved, templates.state_dicts, index,
                                      lambda name: self._open(directory, name, files_at), params=templates.params,
                                      where=self._storage.location(directory))
                content = {**content, **{kind: {name: filled.get(name, value) for name, value in content[kind].items()}
                                         for kind in ("stateful", "extras")}}
        except CheckpointMismatchError as exc:
            return None, ("mismatch", str(exc))
        except fmt.VanishedCheckpointError as exc:
            return None, ("vanished", str(exc))
        except _NotPlainData as exc:
            return None, ("fatal", str(exc))
        except CorruptCheckpointError as exc:
            return None, ("corrupt", str(exc))
        except OSError as exc:
            return None, ("corrupt", f"cannot read {self._storage.location(directory)}: {exc}")
        return (content, loaded[1] if len(loaded) > 1 else None), None

    @contextlib.contextmanager
    def _open(self, directory: str, name: str, files_at: str) -> Iterator[BinaryIO]:
        """Open a file of the checkpoint for the chunk reads; a missing file of a checkpoint that
        is gone as a whole is ``VanishedCheckpointError``."""
        path = fmt.join(files_at, name)
        try:
            with self._storage.open_read(path) as f:
                yield f
        except FileNotFoundError as exc:
            if not self._storage.exists(directory):
                raise fmt.VanishedCheckpointError(f"{self._storage.location(directory)} was deleted while it was "
                                                  "read") from exc
            raise CorruptCheckpointError(f"checkpoint {self._storage.location(directory)}: {name} is missing") \
                from exc

    def _restore_rng(self, rng: Any, manifest: dict[str, Any], step: int) -> None:
        rank = self._coord.rank
        if rng is not None:
            snap.restore_rng(rng, where=f"step {step} {fmt.rank_file(rank)}")
            return
        seed = snap.fallback_seed(manifest["files"][fmt.rank_file(0)]["sha256"], rank)
        snap.seed_rng(seed)
        logger.info("rank %d has no saved RNG state in step %d; seeded RNGs with %d", rank, step, seed)


def load_file(storage: Storage, directory: str, name: str, files_at: str, expected: fmt.FileEntry | None = None,
              *, mmap: bool = False) -> Any:
    """``torch.load(weights_only=True)`` one file of the checkpoint in ``directory`` (its files in ``files_at``).

    With ``expected`` (an object store): from the bytes of the one download that checked their size
    and sha256 as they arrived, before anything is loaded from them. With ``mmap`` (a
    ``LocalStorage``; ignored elsewhere): the tensors are mapped from the file, not read, so that
    only the pages of what is used (a rank's slices) are read in; the file must not change while
    they are in use (a committed checkpoint's files do not).

    Raises:
        CorruptCheckpointError: It cannot be read or loaded; a subclass of it when it holds more
            than tensors and plain data (code: never run, never skipped silently).
        VanishedCheckpointError: The checkpoint was deleted meanwhile.
    """
    path = fmt.join(files_at, name)
    try:
        if expected is not None:
            if not isinstance(storage, ObjectStore):
                raise ValueError(f"a checked one-pass read needs an object store, not {storage!r}")
            data, digest = storage.read_hashed(path)
            if len(data) != expected.size or digest != expected.sha256:
                problem = (f"has {len(data)} bytes, manifest says {expected.size}" if len(data) != expected.size
                           else "does not match its sha256 checksum")
                raise CorruptCheckpointError(f"checkpoint {storage.location(directory)}: {name} {problem}")
            # weights_only: a checkpoint file must never be a way to run code.
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        with storage.open_read(path) as f:
            # torch maps only its zip format: any other file is loaded as before (and refused as before).
            if mmap and isinstance(storage, LocalStorage) and f.read(len(_ZIP_MAGIC)) == _ZIP_MAGIC:
                return torch.load(storage.location(path), map_location="cpu", weights_only=True, mmap=True)
            f.seek(0)
            return torch.load(f, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        why = next(iter(str(exc).strip().splitlines()), "")  # torch's message goes on for lines
        raise _NotPlainData(
            f"refusing to load {storage.location(path)}: it holds more than tensors and plain data ({why})"
        ) from exc
    except FileNotFoundError as exc:
        if not storage.exists(directory):
            raise fmt.VanishedCheckpointError(f"{storage.location(directory)} was deleted while it was read") from exc
        raise CorruptCheckpointError(f"cannot load {storage.location(path)}: {exc}") from exc
    except (OSError, RuntimeError, EOFError) as exc:
        raise CorruptCheckpointError(f"cannot load {storage.location(path)}: {exc}") from exc


@dataclass(frozen=True, slots=True)
class _Templates:
    """The live state a restore fills: each object's ``state_dict()`` and each optimizer's parameters."""

    state_dicts: dict[str, Any]
    params: dict[str, list[torch.Tensor]]


def _templates(state: Mapping[str, Any]) -> _Templates:
    stateful = {name: obj for name, obj in state.items() if not isinstance(obj, dict)}
    return _Templates(
        state_dicts={name: obj if isinstance(obj, dict) else obj.state_dict() for name, obj in state.items()},
        params={name: [p for group in obj.param_groups for p in group["params"]]
                for name, obj in stateful.items() if isinstance(obj, torch.optim.Optimizer)})


class _NotPlainData(CorruptCheckpointError):
    """A checkpoint file that ``torch.load(weights_only=True)`` refuses: never skipped silently."""
