"""The restore side of :class:`~elastictrain.checkpoint.manager.CheckpointManager`: the ranks
agree on the newest committed checkpoint that verifies (rank 0 chooses, every rank checks that
it sees no newer one), then each checks the checksums of the files it loads and loads them;
if one does not verify on any rank, every rank tries the one before.
"""

from __future__ import annotations

import io
import logging
import pickle
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from elastictrain.errors import CheckpointError, CorruptCheckpointError

from . import _manifest as fmt
from . import _snapshot as snap
from .coordinator import Coordinator
from .storage import ObjectStore, Storage

__all__ = ["CheckpointReader", "RestoreInfo"]

logger = logging.getLogger(__name__)
_events = logging.getLogger("elastictrain.events")

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
        for _ in range(_LOAD_ATTEMPTS):
            found = self.agree(step, frozenset(skip))
            if found is None:
                logger.info("no checkpoint in %s; starting from scratch", self.location)
                return None
            chosen, manifest = found
            directory = fmt.join(self._prefix, fmt.step_dir(chosen))
            # Every rank checks the checksums of what it loads, before anything changes:
            # rank 0's view of the directory is not proof of another node's.
            loaded, problem = self._load_verified(directory, manifest)
            problems = [(r, p) for r, p in enumerate(self._coord.all_gather(problem)) if p is not None]
            if not problems:
                break
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
        self, directory: str, manifest: dict[str, Any]
    ) -> tuple[tuple[Any, Any] | None, tuple[str, str] | None]:
        """Check the checksums of this rank's files of a checkpoint, then load them.

        Returns:
            ``((replicated content, RNG state or None), None)``, or ``(None, (kind, message))``
            where kind is ``"vanished"`` (retired meanwhile: agree again), ``"corrupt"``
            (try an older one) or ``"fatal"`` (a file that is not plain data).
        """
        rank = self._coord.rank
        names = [fmt.REPLICATED] + ([fmt.rank_file(rank)] if rank < manifest["world_size"] else [])
        try:
            loaded: list[Any] = []
            files_at = fmt.files_dir(directory, manifest)
            for name in names:
                entry = manifest["files"][name]
                expected = fmt.FileEntry(name, int(entry["size"]), str(entry["sha256"]))
                if isinstance(self._storage, ObjectStore):  # one download, checked before it is loaded
                    loaded.append(self._load(directory, name, files_at, expected))
                    continue
                fmt.verify_file(self._storage, directory, expected, files_at)
                loaded.append(self._load(directory, name, files_at))
        except fmt.VanishedCheckpointError as exc:
            return None, ("vanished", str(exc))
        except _NotPlainData as exc:
            return None, ("fatal", str(exc))
        except CorruptCheckpointError as exc:
            return None, ("corrupt", str(exc))
        except OSError as exc:
            return None, ("corrupt", f"cannot read {self._storage.location(directory)}: {exc}")
        content = loaded[0]
        if not isinstance(content, dict) or not {"stateful", "extras"} <= content.keys():
            return None, ("fatal", f"{self._storage.location(directory)}: {fmt.REPLICATED} has no state")
        return (content, loaded[1] if len(loaded) > 1 else None), None

    def _load(self, directory: str, name: str, files_at: str, expected: fmt.FileEntry | None = None) -> Any:
        """``torch.load`` one file; with ``expected`` (an object store), from the bytes of the one
        download that checked its size and sha256 as they arrived."""
        path = fmt.join(files_at, name)
        try:
            if expected is not None:
                assert isinstance(self._storage, ObjectStore)  # noqa: S101 - the caller checked
                data, digest = self._storage.read_hashed(path)
                if len(data) != expected.size or digest != expected.sha256:
                    problem = (f"has {len(data)} bytes, manifest says {expected.size}" if len(data) != expected.size
                               else "does not match its sha256 checksum")
                    raise CorruptCheckpointError(f"checkpoint {self._storage.location(directory)}: {name} {problem}")
                return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
            with self._storage.open_read(path) as f:
                # weights_only: a checkpoint file must never be a way to run code.
                return torch.load(f, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as exc:
            raise _NotPlainData(
                f"refusing to load {self._storage.location(path)}: it holds more than tensors and plain data ({exc})"
            ) from exc
        except FileNotFoundError as exc:
            if not self._storage.exists(directory):
                raise fmt.VanishedCheckpointError(f"{self._storage.location(directory)} was deleted while it was "
                                                  "read") from exc
            raise CorruptCheckpointError(f"cannot load {self._storage.location(path)}: {exc}") from exc
        except (OSError, RuntimeError, EOFError) as exc:
            raise CorruptCheckpointError(f"cannot load {self._storage.location(path)}: {exc}") from exc

    def _restore_rng(self, rng: Any, manifest: dict[str, Any], step: int) -> None:
        rank = self._coord.rank
        if rng is not None:
            snap.restore_rng(rng, where=f"step {step} {fmt.rank_file(rank)}")
            return
        seed = snap.fallback_seed(manifest["files"][fmt.rank_file(0)]["sha256"], rank)
        snap.seed_rng(seed)
        logger.info("rank %d has no saved RNG state in step %d; seeded RNGs with %d", rank, step, seed)


class _NotPlainData(CorruptCheckpointError):
    """A checkpoint file that ``torch.load(weights_only=True)`` refuses: never skipped silently."""
