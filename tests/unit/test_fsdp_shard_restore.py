"""A sharded ``Session`` restores shard-wise: it shards first, then each rank reads only the saved
chunks that overlap its own shards (parameters and optimizer state) straight into them; no rank
reads, or assembles, the whole state. On real gloo processes.

One spawn of four processes: an fsdp session (AdamW, float64) saves at 4 ranks; an hsdp session
(2 nodes of 2) restores it, then fsdp sessions at 3 and at 2 ranks, each rank counting the bytes
it reads from the checkpoint's shard files. The restored full tensors equal the saved ones, each
rank read at most about half the shard bytes (the chunks of the 4-rank layout overlapping its
1/3 or 1/2; a restore that assembles the full state first reads all of them on every rank), and
copies of the checkpoint train on sharded and with DDP to equal ends.

Run as a script, this module is the worker the test spawns.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.ranks import run_ranks

WORLD = 4
TOLERANCE = 1e-12
READ_BOUND = 0.55
"""The most of the shard files' bytes a restoring rank may read, at 3 or 2 ranks: the 4-rank
chunks overlapping its rows (two of the four; each chunk is read whole, to check its sha256)."""
pytestmark = pytest.mark.timeout(120)


def test_a_sharded_session_restores_at_3_and_2_ranks_reading_only_its_own_shards(tmp_path: Path) -> None:
    run_ranks(__file__, WORLD, str(tmp_path))
    checks = json.loads((tmp_path / "rank0.json").read_text())
    assert set(checks) == {f"{what}/{world}" for what in ("restored", "trained_on") for world in (3, 2)} | {
        "read/3", "read/2", "restored/hsdp", "read/hsdp"}
    assert checks["restored/hsdp"] <= TOLERANCE, checks
    assert all(0 < share <= READ_BOUND for share in checks["read/hsdp"]), checks["read/hsdp"]
    for world in (3, 2):
        assert checks[f"restored/{world}"] <= TOLERANCE, checks
        assert checks[f"trained_on/{world}"] <= TOLERANCE, checks
        shares = checks[f"read/{world}"]
        assert len(shares) == world and all(0 < share <= READ_BOUND for share in shares), (world, shares)
        assert sum(shares) >= 1.0, (world, shares)  # together the ranks read every chunk at least once


class Net(torch.nn.Module):
    """Two layers of 64 and 8 rows: shares of 16 rows at 4 ranks, 22/21/21 at 3, 32 at 2."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(16, 64)
        self.head = torch.nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.embed(x)))


def _dataset() -> Any:
    from torch.utils.data import TensorDataset

    data = torch.Generator().manual_seed(5)
    return TensorDataset(torch.randn(24, 16, generator=data, dtype=torch.float64),
                         torch.randn(24, 8, generator=data, dtype=torch.float64))


def _train(sharding: str, group: Any, checkpoint_dir: Path, max_steps: int) -> dict[str, Any]:
    """One session; rank 0's full tensors (``{}`` elsewhere) and its step."""
    import elastictrain
    from elastictrain.train.worker import WorkerContext

    context = dataclasses.replace(WorkerContext.from_env({}), local_world_size=2)  # hsdp: 2 ranks a node
    torch.manual_seed(0)
    model = Net().double()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    with elastictrain.Session(model, optimizer, _dataset(), global_batch_size=12, micro_batch_size=3, seed=3,
                              log_every=None, epochs=2, max_steps=max_steps, process_group=group,
                              sharding=sharding, checkpoint_dir=str(checkpoint_dir), context=context) as session:
        for step in session.steps():
            for micro in step:
                inputs, targets = micro.batch
                micro.backward(torch.nn.functional.mse_loss(session.model(inputs), targets))
        full = session.full_state_dict()
    return {"full": full, "step": session.step}


def _error(a: dict[str, Any], b: dict[str, Any]) -> float:
    assert a["step"] == b["step"] and list(a["full"]) == list(b["full"])
    return max((x - y).abs().max().item() for x, y in zip(a["full"].values(), b["full"].values(), strict=True))


class _Counted:
    """A file whose reads add to a count of bytes."""

    def __init__(self, f: Any, count: list[int]) -> None:
        self._f, self._count = f, count

    def read(self, size: int = -1) -> bytes:
        data = self._f.read(size)
        self._count[0] += len(data)
        return bytes(data)

    def readinto(self, buffer: Any) -> int:
        n = self._f.readinto(buffer)
        self._count[0] += n or 0
        return n  # type: ignore[no-any-return]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)


_SHARD_BYTES = [0]
"""Bytes this process read from checkpoint shard files (``shards_*.bin``)."""


def _count_shard_reads() -> None:
    """Count every read of a shard file through ``LocalStorage`` (the session's storage)."""
    from elastictrain.checkpoint import LocalStorage

    original = LocalStorage.open_read

    @contextlib.contextmanager
    def open_read(self: LocalStorage, path: str) -> Iterator[Any]:
        with original(self, path) as f:
            name = path.rsplit("/", 1)[-1]
            yield _Counted(f, _SHARD_BYTES) if name.startswith("shards_") else f

    LocalStorage.open_read = open_read  # type: ignore[method-assign]


def _shard_file_bytes(checkpoint_dir: Path) -> int:
    """The bytes of the newest checkpoint's shard files."""
    newest = max((p for p in checkpoint_dir.iterdir() if p.name.startswith("step_")), key=lambda p: p.name)
    return sum(p.stat().st_size for p in newest.rglob("shards_*.bin"))


def _worker(rank: int, out: Path) -> None:
    import torch.distributed as dist

    from tests.support.leave import leave_together

    dist.init_process_group("gloo", init_method=f"file://{out / 'store'}", rank=rank, world_size=WORLD)
    groups = {2: dist.new_group([0, 1]), 3: dist.new_group([0, 1, 2])}
    _count_shard_reads()
    checks: dict[str, Any] = {}
    saved_at = out / "saved"
    saved = _train("fsdp", dist.group.WORLD, saved_at, max_steps=2)
    if rank == 0:
        for world in (3, 2):
            for use in ("restored", "sharded", "ddp"):
                shutil.copytree(saved_at, out / f"{use}_{world}")
        shutil.copytree(saved_at, out / "hsdp")
    dist.barrier()
    total = _shard_file_bytes(saved_at)
    # hsdp 2x2: each node's 2 ranks shard, the nodes replicate; each rank reads its half (2 of 4 chunks).
    _SHARD_BYTES[0] = 0
    hsdp = _train("hsdp", dist.group.WORLD, out / "hsdp", max_steps=2)
    shares = [0.0] * WORLD
    dist.all_gather_object(shares, _SHARD_BYTES[0] / total)
    if rank == 0:
        checks["restored/hsdp"] = _error(saved, hsdp)
        checks["read/hsdp"] = shares
    for world in (3, 2):
        if rank < world:
            _SHARD_BYTES[0] = 0
            restored = _train("fsdp", groups[world], out / f"restored_{world}", max_steps=2)
            shares = [0.0] * world
            dist.all_gather_object(shares, _SHARD_BYTES[0] / total, group=groups[world])
            on_sharded = _train("fsdp", groups[world], out / f"sharded_{world}", max_steps=4)
            on_ddp = _train("ddp", groups[world], out / f"ddp_{world}", max_steps=4)
            if rank == 0:
                checks[f"restored/{world}"] = _error(saved, restored)
                checks[f"trained_on/{world}"] = _error(on_ddp, on_sharded)
                checks[f"read/{world}"] = shares
                assert on_sharded["step"] == 4
        dist.barrier()
    if rank == 0:
        (out / "rank0.json").write_text(json.dumps(checks))
    leave_together()


if __name__ == "__main__":
    _worker(int(sys.argv[1]), Path(sys.argv[2]))
