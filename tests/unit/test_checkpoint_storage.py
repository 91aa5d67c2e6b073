"""The Storage contract, run against LocalStorage and an in-memory fake; the manager needs nothing more."""

from __future__ import annotations

import contextlib
import io
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import pytest
import torch

from elastictrain.checkpoint import CheckpointManager, LocalStorage, Storage

pytestmark = pytest.mark.timeout(30)


class InMemoryStorage:
    """A Storage that keeps files in a dict, the way an object-store adapter would."""

    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}
        self.dirs: set[str] = {""}

    def location(self, path: str) -> str:
        return f"mem://{path}"

    def list_dir(self, path: str) -> list[str]:
        if path not in self.dirs:
            raise FileNotFoundError(path)
        prefix = f"{path}/" if path else ""
        paths = [p for p in [*self.files, *self.dirs] if p.startswith(prefix) and p != path]
        return sorted({p[len(prefix) :].split("/")[0] for p in paths})

    def make_dir(self, path: str) -> None:
        parts = path.split("/")
        self.dirs.update("/".join(parts[: i + 1]) for i in range(len(parts)))

    @contextlib.contextmanager
    def open_write(self, path: str) -> Iterator[BinaryIO]:
        if path in self.files:
            raise FileExistsError(path)
        buffer = io.BytesIO()
        yield buffer
        self.files[path] = buffer.getvalue()  # published only on a clean exit

    @contextlib.contextmanager
    def open_read(self, path: str) -> Iterator[BinaryIO]:
        if path not in self.files:
            raise FileNotFoundError(path)
        yield io.BytesIO(self.files[path])

    def size(self, path: str) -> int:
        if path not in self.files:
            raise FileNotFoundError(path)
        return len(self.files[path])

    def exists(self, path: str) -> bool:
        return path in self.files or path in self.dirs

    def sync_dir(self, path: str) -> None:
        pass

    def rename(self, src: str, dst: str) -> None:
        if self.exists(dst):
            raise FileExistsError(dst)
        move = lambda p: dst + p[len(src) :] if p == src or p.startswith(f"{src}/") else p  # noqa: E731
        self.files = {move(p): data for p, data in self.files.items()}
        self.dirs = {move(p) for p in self.dirs}

    def delete(self, path: str) -> None:
        inside = lambda p: p == path or p.startswith(f"{path}/")  # noqa: E731
        self.files = {p: d for p, d in self.files.items() if not inside(p)}
        self.dirs = {p for p in self.dirs if not inside(p)} | {""}


@pytest.fixture(params=["local", "memory"])
def storage(request: pytest.FixtureRequest, tmp_path: Path) -> Storage:
    return LocalStorage(tmp_path / "root") if request.param == "local" else InMemoryStorage()


def write(storage: Storage, path: str, data: bytes) -> None:
    with storage.open_write(path) as f:
        f.write(data)


def read(storage: Storage, path: str) -> bytes:
    with storage.open_read(path) as f:
        return f.read()


def test_storage_satisfies_the_protocol(storage: Storage) -> None:
    assert isinstance(storage, Storage)


def test_written_file_is_listed_with_its_size_and_reads_back(storage: Storage) -> None:
    storage.make_dir("a/b")
    storage.make_dir("a/b")  # idempotent
    write(storage, "a/b/f.bin", b"hello")
    assert storage.list_dir("a") == ["b"]
    assert storage.list_dir("a/b") == ["f.bin"]
    assert storage.size("a/b/f.bin") == 5 and read(storage, "a/b/f.bin") == b"hello"
    storage.sync_dir("a/b")


def test_missing_paths_raise_file_not_found(storage: Storage) -> None:
    assert not storage.exists("nope")
    for call in (lambda: storage.list_dir("nope"), lambda: storage.size("nope"), lambda: read(storage, "nope")):
        with pytest.raises(FileNotFoundError):
            call()
    storage.delete("nope")  # missing is fine


def test_failed_write_leaves_no_file(storage: Storage) -> None:
    storage.make_dir("d")
    with pytest.raises(RuntimeError), storage.open_write("d/f") as f:
        f.write(b"partial")
        raise RuntimeError("writer died")
    assert storage.list_dir("d") == []


def test_rename_moves_a_directory_and_refuses_to_overwrite(storage: Storage) -> None:
    storage.make_dir("stage")
    write(storage, "stage/f", b"x")
    storage.make_dir("taken")
    with pytest.raises(FileExistsError):
        storage.rename("stage", "taken")
    storage.delete("taken")
    storage.rename("stage", "final")
    assert storage.list_dir("") == ["final"] and read(storage, "final/f") == b"x"
    storage.delete("final")
    assert storage.list_dir("") == []


def test_local_storage_refuses_paths_outside_its_root(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path / "root")
    for bad in ("../x", "/etc/passwd", "a/../../x"):
        with pytest.raises(ValueError, match="relative"):
            storage.exists(bad)


def test_manager_round_trips_through_any_storage(storage: Storage) -> None:
    model = torch.nn.Linear(3, 2)
    with CheckpointManager("runs/ckpt", storage=storage, keep_last=1) as mgr:
        mgr.save(1, {"model": model})
        mgr.save(2, {"model": model, "progress": {"epoch": 4}})
        assert [n for n in storage.list_dir("runs/ckpt") if not n.startswith(".")] == ["step_00000002"]
    fresh = torch.nn.Linear(3, 2)
    with CheckpointManager("runs/ckpt", storage=storage) as mgr:
        info = mgr.restore({"model": fresh})
    assert info is not None and info.step == 2 and info.extras == {"progress": {"epoch": 4}}
    assert info.path == storage.location("runs/ckpt/step_00000002")
    assert torch.equal(fresh.weight, model.weight) and torch.equal(fresh.bias, model.bias)
