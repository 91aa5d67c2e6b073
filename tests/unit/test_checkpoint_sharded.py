"""Sharded checkpoints: DTensor state saved by real gloo processes, each writing its own shards, and
restored at other world sizes and meshes (fsdp 4 -> 3 -> 1, fsdp 4 -> hsdp 2x2, hsdp 2x2 -> fsdp 3,
DDP -> fsdp).

One 4-rank job saves every case, one 3-rank job restores them, and the test process (world size
1, no process group) restores into plain tensors, corrupts copies and exports. The jobs run
:func:`_worker` as each rank, forked from the ranks' forkserver (tests/support/ranks.py).
"""

from __future__ import annotations

import contextlib
import io
import json
import pickle
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from elastictrain.checkpoint import CheckpointManager, LocalStorage, export_safetensors
from elastictrain.errors import CheckpointMismatchError, CorruptCheckpointError, NonFiniteStateError
from elastictrain.launch.cli import main as cli_main
from tests.support.ranks import fork_ranks

pytestmark = pytest.mark.timeout(120)

SIZES = [(6, 10), (10, 7), (7, 5)]
"""The model's Linear layers: dim 0 of 10, 7 and 5 split over 4 ranks is 3,3,3,1 / 2,2,2,1 / 2,2,1,0."""
HSDP_SHAPES = {"a": (9, 4), "b": (5,), "c": (3, 3, 2)}


def _model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for n_in, n_out in SIZES:
        layers += [torch.nn.Linear(n_in, n_out), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


class Holder:
    """A Stateful over a plain dict: what the hsdp case saves."""

    def __init__(self, values: dict[str, Any]) -> None:
        self.values = values

    def state_dict(self) -> dict[str, Any]:
        return dict(self.values)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.values = dict(state)


def _full(value: Any) -> Any:
    """A state dict with every DTensor gathered (a collective) and every tensor cloned."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return value.full_tensor().clone()
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _full(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_full(v) for v in value]
    return value


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _spawn(role: str, world_size: int, tmp: Path) -> None:
    fork_ranks(_worker, world_size, lambda rank: (role, rank, world_size, tmp))


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every checkpoint of the module, saved once: A (fsdp, overlapped, steps 1 and 2), B (fsdp through
    torch's get/set_*_state_dict), C (hsdp 2x2), D (DDP format, from this process); and the 3-rank restores."""
    tmp = tmp_path_factory.mktemp("sharded")
    model = _model()
    with CheckpointManager(tmp / "D") as mgr:
        mgr.save(3, {"model": model})
    torch.save(_full(model.state_dict()), tmp / "D.pt")
    _spawn("save", 4, tmp)
    _spawn("restore", 3, tmp)
    return tmp


def _manifest(ckpt: Path) -> dict[str, Any]:
    return json.loads(ckpt.joinpath("MANIFEST.json").read_text())


def test_each_rank_writes_only_its_own_shards_and_replicas_write_each_shard_once(saved: Path) -> None:
    manifest = _manifest(saved / "A" / "step_00000002")
    assert manifest["format_version"] == 2
    files = manifest["files"]
    assert {f"shards_{r:05d}.bin" for r in range(4)} <= files.keys()
    weight = manifest["tensors"]["model/2.weight"]  # (7, 10): rows 2, 2, 2, 1
    assert weight["shape"] == [7, 10] and weight["dtype"] == "float32"
    assert [(c["file"], c["offsets"], c["sizes"]) for c in weight["chunks"]] == [
        (f"shards_{r:05d}.bin", [2 * r, 0], [2 if r < 3 else 1, 10]) for r in range(4)]
    # Rank 3's share of the 5-row layer is empty: no chunk.
    assert [c["sizes"][0] for c in manifest["tensors"]["model/4.weight"]["chunks"]] == [2, 2, 1]
    exp_avg = manifest["tensors"]["optimizer/state/0/exp_avg"]
    assert exp_avg["shape"] == [10, 6] and len(exp_avg["chunks"]) == 4
    # hsdp (Replicate, Shard(0)) on 2x2: each shard once, by the replica with the fewest bytes so far
    # (a: 36 elements to replica 0, b: 5 to replica 1, c: 18 to replica 1 again).
    hsdp = _manifest(saved / "C" / "step_00000001")
    writers = {key: sorted(c["file"] for c in t["chunks"]) for key, t in hsdp["tensors"].items()}
    assert writers == {"values/a": ["shards_00000.bin", "shards_00001.bin"],
                       "values/b": ["shards_00002.bin", "shards_00003.bin"],
                       "values/c": ["shards_00002.bin", "shards_00003.bin"]}
    assert "shards_00000.bin" in hsdp["files"] and "shards_00002.bin" in hsdp["files"]


def test_fsdp_checkpoint_of_4_ranks_restores_identical_full_tensors_at_3_ranks_and_at_hsdp_2x2(saved: Path) -> None:
    expected = torch.load(saved / "A2.pt", weights_only=True)
    got = torch.load(saved / "A_at3.pt", weights_only=True)
    assert _same(got["model"], expected["model"])
    assert _same(got["optimizer"], expected["optimizer"])  # exp_avg, exp_avg_sq and step of every parameter
    assert got["info"] == [2, 4]
    assert got["trained"]  # and the restored optimizer steps
    assert _same(torch.load(saved / "A_hsdp.pt", weights_only=True), expected)  # and at hsdp 2x2
    # Through torch's get/set_model_state_dict and get/set_optimizer_state_dict (FQN keys).
    got_b = torch.load(saved / "B_at3.pt", weights_only=True)
    assert _same(got_b["model"], expected["model"])
    assert _same(got_b["optimizer"]["state"], {
        f"{i // 2 * 2}.{'weight' if i % 2 == 0 else 'bias'}": v for i, v in expected["optimizer"].items()})


def test_each_rank_reads_only_the_chunks_its_shards_overlap(saved: Path) -> None:
    tensors = _manifest(saved / "A" / "step_00000002")["tensors"]
    expected = [0, 0, 0]
    for meta in tensors.values():  # rows split over 3 ranks as torch.chunk does; the saved chunks it overlaps
        rows = meta["shape"][0]
        step = -(-rows // 3)
        for rank in range(3):
            start, stop = min(rank * step, rows), min((rank + 1) * step, rows)
            expected[rank] += sum(c["byte_length"] for c in meta["chunks"]
                                  if c["offsets"][0] < stop and start < c["offsets"][0] + c["sizes"][0])
    total = sum(p.stat().st_size for p in (saved / "A" / "step_00000002").glob("shards_*.bin"))
    assert [int((saved / f"A_read{rank}").read_text()) for rank in range(3)] == expected
    assert max(expected) < 0.6 * total


def test_overlapped_saves_hold_the_state_of_their_step(saved: Path) -> None:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    for step in (1, 2):
        with CheckpointManager(saved / "A") as mgr:
            info = mgr.restore({"model": model, "optimizer": opt}, step=step)
        assert info is not None and info.world_size == 4
        expected = torch.load(saved / f"A{step}.pt", weights_only=True)
        assert _same(_full(model.state_dict()), expected["model"])
        assert _same(_full(opt.state_dict()["state"]), expected["optimizer"])


def test_an_optimizer_outside_an_overlapped_save_waits_for_the_copy_of_the_sharded_parameters(saved: Path) -> None:
    model = _model()
    with CheckpointManager(saved / "F") as mgr:
        mgr.restore({"model": model})
    assert _same(_full(model.state_dict()), torch.load(saved / "F.pt", weights_only=True))


def test_hsdp_2x2_checkpoint_restores_into_fsdp_3_and_into_plain_tensors(saved: Path) -> None:
    expected = torch.load(saved / "C.pt", weights_only=True)
    assert _same(torch.load(saved / "C_at3.pt", weights_only=True), expected)
    holder = Holder({k: torch.zeros(s) for k, s in HSDP_SHAPES.items()} | {"plain": torch.zeros(2), "n": 0})
    with CheckpointManager(saved / "C") as mgr:
        mgr.restore({"values": holder})
    assert _same(holder.values, expected)


def test_ddp_checkpoint_restores_into_fsdp_and_sharded_into_plain_tensors(saved: Path) -> None:
    assert _same(torch.load(saved / "D_at3.pt", weights_only=True), torch.load(saved / "D.pt", weights_only=True))
    assert _manifest(saved / "D" / "step_00000003")["format_version"] == 1  # the DDP format, unchanged


def test_a_nan_in_one_ranks_shard_of_a_parameter_fails_the_save_on_every_rank(saved: Path) -> None:
    outcomes = [torch.load(saved / f"E{rank}.pt", weights_only=True) for rank in range(4)]
    assert all("parameter '2.weight' of state['model'] (a local shard) holds NaN" in o for o in outcomes), outcomes
    assert not any(p.name.startswith("step_") for p in (saved / "E").iterdir())


def test_a_flipped_byte_in_one_shard_falls_back_to_the_previous_checkpoint(saved: Path, tmp_path: Path) -> None:
    ckpt = tmp_path / "A"
    shutil.copytree(saved / "A", ckpt)
    manifest = _manifest(ckpt / "step_00000002")
    chunk = manifest["tensors"]["model/2.weight"]["chunks"][1]
    path = ckpt / "step_00000002" / chunk["file"]
    data = bytearray(path.read_bytes())
    data[chunk["byte_offset"] + 5] ^= 0x10
    path.write_bytes(bytes(data))
    model = _model()
    with CheckpointManager(ckpt) as mgr:
        assert mgr.latest_step() == 2  # sizes agree: only the bytes read show it
        info = mgr.restore({"model": model})
        assert info is not None and info.step == 1
        with pytest.raises(CorruptCheckpointError, match=r"2\.weight.*sha256"):
            mgr.restore({"model": model}, step=2)
    assert _same(_full(model.state_dict()), torch.load(saved / "A1.pt", weights_only=True)["model"])


def test_a_restore_reads_only_the_entries_its_state_names(saved: Path, tmp_path: Path) -> None:
    ckpt = tmp_path / "A"
    shutil.copytree(saved / "A", ckpt)
    chunk = _manifest(ckpt / "step_00000002")["tensors"]["optimizer/state/0/exp_avg"]["chunks"][0]
    path = ckpt / "step_00000002" / chunk["file"]
    data = bytearray(path.read_bytes())
    data[chunk["byte_offset"]] ^= 0x01
    path.write_bytes(bytes(data))
    model = _model()
    with CheckpointManager(ckpt) as mgr:
        info = mgr.restore({"model": model})  # the optimizer's chunks are not read: step 2 restores
        assert info is not None and info.step == 2
        info = mgr.restore({"model": model, "optimizer": torch.optim.AdamW(model.parameters())})
        assert info is not None and info.step == 1


class _Payload:
    """A pickle that writes a marker file when unpickled."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.write_text, (self.marker, "code ran"))


def test_a_checkpoint_file_replaced_by_a_crafted_pickle_runs_no_code(
    saved: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    marker = tmp_path / "marker"
    crafted = pickle.dumps({"x": _Payload(marker)}, protocol=2)
    buffer = io.BytesIO()
    torch.save({"x": torch.zeros(1)}, buffer)
    ckpt = tmp_path / "A"
    shutil.copytree(saved / "A", ckpt)
    # A shard file replaced, its manifest entry rewritten to match: the chunks are raw bytes, checked by
    # their own sha256, never unpickled: restore falls back.
    step2 = ckpt / "step_00000002"
    (step2 / "shards_00001.bin").write_bytes(crafted)
    _rewrite_entry(step2, "shards_00001.bin")
    model = _model()
    with CheckpointManager(ckpt) as mgr:
        info = mgr.restore({"model": model})
    assert info is not None and info.step == 1 and not marker.exists()
    # replicated.pt replaced (as a torch.save zip whose data.pkl is the crafted pickle), manifest to match:
    # weights_only refuses it, every rank fails with one line.
    step1 = ckpt / "step_00000001"
    shutil.rmtree(step2)
    (step1 / "replicated.pt").write_bytes(_torch_zip_with(crafted))
    _rewrite_entry(step1, "replicated.pt")
    with CheckpointManager(ckpt) as mgr, pytest.raises(CorruptCheckpointError) as raised:
        mgr.restore({"model": model})
    assert "refusing to load" in str(raised.value) and "\n" not in str(raised.value)
    assert not marker.exists()
    assert cli_main(["checkpoint", "export", str(ckpt), str(tmp_path / "out.safetensors")]) == 1
    err = capsys.readouterr().err
    assert "refusing to load" in err and err.count("\n") == 1
    assert not marker.exists() and not (tmp_path / "out.safetensors").exists()


def test_a_mapped_load_reads_a_torch_file_and_refuses_a_crafted_one_as_a_plain_load_does(tmp_path: Path) -> None:
    # A DDP checkpoint's replicated.pt restored into a sharded job is mapped (mmap=True), not read.
    from elastictrain.checkpoint._reader import load_file

    storage = LocalStorage(tmp_path)
    torch.save({"w": torch.arange(6.0).reshape(3, 2)}, tmp_path / "good.pt")
    loaded = load_file(storage, "", "good.pt", "", mmap=True)
    assert torch.equal(loaded["w"], torch.arange(6.0).reshape(3, 2))
    marker = tmp_path / "marker"
    crafted = pickle.dumps({"x": _Payload(marker)}, protocol=2)
    # A plain pickle (torch maps only its zip format: loaded as without mmap) and one inside a torch zip.
    (tmp_path / "plain.pt").write_bytes(crafted)
    (tmp_path / "zipped.pt").write_bytes(_torch_zip_with(crafted))
    for name in ("plain.pt", "zipped.pt"):
        with pytest.raises(CorruptCheckpointError, match="refusing to load") as raised:
            load_file(storage, "", name, "", mmap=True)
        assert "\n" not in str(raised.value) and not marker.exists()


def _torch_zip_with(pickled: bytes) -> bytes:
    """A torch.save archive whose data.pkl is ``pickled``."""
    import zipfile

    buffer = io.BytesIO()
    torch.save({"x": 1}, buffer)
    source = zipfile.ZipFile(io.BytesIO(buffer.getvalue()))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_STORED) as target:
        for item in source.infolist():
            data = pickled if item.filename.endswith("/data.pkl") else source.read(item.filename)
            target.writestr(item, data)
    return out.getvalue()


def _rewrite_entry(directory: Path, name: str) -> None:
    import hashlib

    manifest = _manifest(directory)
    data = (directory / name).read_bytes()
    manifest["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (directory / "MANIFEST.json").write_text(json.dumps(manifest))


_GOOD = {"path": ["m", "w"], "dtype": "float32", "shape": [3, 2], "chunks": [
    {"file": "shards_00000.bin", "offsets": [0, 0], "sizes": [2, 2], "byte_offset": 0, "byte_length": 16,
     "sha256": "0" * 64},
    {"file": "shards_00001.bin", "offsets": [2, 0], "sizes": [1, 2], "byte_offset": 0, "byte_length": 8,
     "sha256": "0" * 64}]}


@pytest.mark.parametrize(("change", "says"), [
    ({"dtype": "object"}, "'object'"),
    ({"path": ["m", "v"]}, "does not name it"),
    ({"shape": [3, -2]}, "non-negative"),
    ({"chunks": [_GOOD["chunks"][0]]}, "hold 4 elements of 6"),
    ({"chunks": [_GOOD["chunks"][0], {**_GOOD["chunks"][1], "offsets": [3, 0]}]}, "does not lie inside"),
    ({"chunks": [_GOOD["chunks"][0], {**_GOOD["chunks"][1], "byte_length": 9}]}, "has 9 bytes"),
    ({"chunks": [_GOOD["chunks"][0], {**_GOOD["chunks"][1], "byte_offset": True}]}, "byte_offset"),
])
def test_a_malformed_tensor_index_is_a_corrupt_checkpoint(change: dict[str, Any], says: str) -> None:
    from elastictrain.checkpoint._index import parse_index

    assert parse_index({"m/w": _GOOD}, "here")["m/w"].shape == (3, 2)
    with pytest.raises(CorruptCheckpointError, match=says):
        parse_index({"m/w": {**_GOOD, **change}}, "here")


def test_a_mismatched_template_fails_on_every_rank_with_both_shapes(saved: Path) -> None:
    wrong = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.ReLU(), torch.nn.Linear(10, 8))
    with CheckpointManager(saved / "A") as mgr, pytest.raises(CheckpointMismatchError, match=r"\(7, 10\)"):
        mgr.restore({"model": wrong})


def test_export_writes_the_full_tensors_of_a_sharded_and_of_a_ddp_checkpoint(
    saved: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    safetensors_torch = pytest.importorskip("safetensors.torch")
    out = tmp_path / "model.safetensors"
    assert cli_main(["checkpoint", "export", str(saved / "A"), str(out), "--step", "1"]) == 0
    assert "step 1" in capsys.readouterr().out
    assert _same(safetensors_torch.load_file(str(out)), torch.load(saved / "A1.pt", weights_only=True)["model"])
    info = export_safetensors(saved / "A" / "step_00000002", out)
    assert info.step == 2 and info.tensors == 6 and info.bytes == out.stat().st_size
    assert _same(safetensors_torch.load_file(str(out)), torch.load(saved / "A2.pt", weights_only=True)["model"])
    export_safetensors(saved / "D", out)
    assert _same(safetensors_torch.load_file(str(out)), torch.load(saved / "D.pt", weights_only=True))


@pytest.mark.parametrize(("args", "says"), [
    (["nowhere", "out"], "does not exist"),
    (["{A}", "out", "--step", "7"], "no committed checkpoint of step 7"),
    (["{A}/step_00000002", "out", "--step", "1"], "is the checkpoint of step 2, not 1"),
    (["{A}", "out", "--entry", "nope"], "has no entry 'nope'"),
    (["{A}", "{tmp}/missing/out"], "No such file or directory"),
    ([], "checkpoint needs an action: export"),
])
def test_export_refuses_bad_input_in_one_line(
    saved: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
    args: list[str], says: str
) -> None:
    argv = ["checkpoint", *(["export"] if args else []), *[a.format(A=saved / "A", tmp=tmp_path) for a in args]]
    monkeypatch.chdir(tmp_path)
    assert cli_main(argv) != 0
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1 and "Traceback" not in err


# ----------------------------------------------------------------------------------------------------------
# The worker: ``python test_checkpoint_sharded.py ROLE RANK WORLD_SIZE TMP``.


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, rank: int) -> None:
    torch.manual_seed(100 + rank)
    opt.zero_grad()
    model(torch.randn(4, SIZES[0][0])).square().mean().backward()
    opt.step()


def _optimizer_full(opt: torch.optim.Optimizer) -> dict[int, Any]:
    return _full(opt.state_dict()["state"])


class _CountingStorage:
    """A LocalStorage that counts the bytes read from shard files."""

    def __init__(self, inner: LocalStorage) -> None:
        self.inner, self.shard_bytes = inner, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    @contextlib.contextmanager
    def open_read(self, path: str) -> Iterator[Any]:
        with self.inner.open_read(path) as f:
            if "shards_" not in path:
                yield f
                return
            counter = self

            class Counted:
                def seek(self, offset: int) -> int:
                    return f.seek(offset)

                def readinto(self, buffer: Any) -> int:
                    n = f.readinto(buffer)
                    counter.shard_bytes += n
                    return n

            yield Counted()


def _worker(role: str, rank: int, world_size: int, tmp: Path) -> None:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from tests.support.leave import leave_together

    dist.init_process_group("gloo", init_method=f"file://{tmp}/store-{role}", rank=rank, world_size=world_size)
    mesh = init_device_mesh("cpu", (world_size,))

    def sharded_model(on: Any = None) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        model = _model()
        for layer in model[::2]:
            fully_shard(layer, mesh=on or mesh)
        fully_shard(model, mesh=on or mesh)
        return model, torch.optim.AdamW(model.parameters(), lr=0.1)

    class ModelState:
        def __init__(self, model: torch.nn.Module) -> None:
            self.model = model

        def state_dict(self) -> dict[str, Any]:
            return get_model_state_dict(self.model)

        def load_state_dict(self, state: dict[str, Any]) -> None:
            set_model_state_dict(self.model, state)

    class OptimizerState:
        def __init__(self, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
            self.model, self.opt = model, opt

        def state_dict(self) -> dict[str, Any]:
            return get_optimizer_state_dict(self.model, self.opt)

        def load_state_dict(self, state: dict[str, Any]) -> None:
            set_optimizer_state_dict(self.model, self.opt, state)

    hsdp_full = {k: torch.arange(torch.Size(s).numel(), dtype=torch.float32).reshape(s) + 0.5
                 for k, s in HSDP_SHAPES.items()}
    if role == "save":
        model, opt = sharded_model()
        with CheckpointManager(tmp / "A", async_save=True, overlap=True) as mgr:
            for step in (1, 2):
                _train(model, opt, rank)
                mgr.save(step, {"model": model, "optimizer": opt})
                expected = {"model": _full(model.state_dict()), "optimizer": _optimizer_full(opt)}
                if rank == 0:
                    torch.save(expected, tmp / f"A{step}.pt")
        with CheckpointManager(tmp / "B", async_save=True) as mgr:
            mgr.save(2, {"model": ModelState(model), "optimizer": OptimizerState(model, opt)})
        mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        hsdp, hsdp_opt = sharded_model(mesh2)  # fsdp at 4 -> hsdp 2x2 (FSDP2 on a 2-D mesh)
        with CheckpointManager(tmp / "A") as mgr:
            mgr.restore({"model": hsdp, "optimizer": hsdp_opt})
        assert [p.placements for p in hsdp.parameters()] == [(Replicate(), Shard(0))] * 6
        restored = {"model": _full(hsdp.state_dict()), "optimizer": _optimizer_full(hsdp_opt)}
        if rank == 0:
            torch.save(restored, tmp / "A_hsdp.pt")
        values: dict[str, Any] = {k: distribute_tensor(v, mesh2, [Replicate(), Shard(0)]) for k, v in hsdp_full.items()}
        with CheckpointManager(tmp / "C") as mgr:
            mgr.save(1, {"values": Holder(values | {"plain": torch.ones(2), "n": 7})})
        if rank == 0:
            torch.save(hsdp_full | {"plain": torch.ones(2), "n": 7}, tmp / "C.pt")
        with CheckpointManager(tmp / "F", async_save=True, overlap=True) as mgr:
            mgr.save(1, {"model": model})  # the optimizer is not saved: its step waits for the parameters' copy
            expected = _full(model.state_dict())
            _train(model, opt, rank)
        if rank == 0:
            torch.save(expected, tmp / "F.pt")
        with torch.no_grad():  # one rank's shard of one parameter diverged
            if rank == 2:
                model[2].weight.to_local()[0, 0] = float("nan")
        with CheckpointManager(tmp / "E") as mgr:
            try:
                mgr.save(3, {"model": model})
                outcome = "saved"
            except NonFiniteStateError as exc:
                outcome = str(exc)
        torch.save(outcome, tmp / f"E{rank}.pt")
    else:
        model, opt = sharded_model()
        counting = _CountingStorage(LocalStorage(tmp / "A"))
        with CheckpointManager("", storage=counting) as mgr:
            info = mgr.restore({"model": model, "optimizer": opt})
        assert info is not None
        (tmp / f"A_read{rank}").write_text(str(counting.shard_bytes))
        result = {"model": _full(model.state_dict()), "optimizer": _optimizer_full(opt),
                  "info": [info.step, info.world_size]}
        _train(model, opt, rank)
        result["trained"] = True
        if rank == 0:
            torch.save(result, tmp / "A_at3.pt")
        model, opt = sharded_model()
        with CheckpointManager(tmp / "B") as mgr:
            mgr.restore({"model": ModelState(model), "optimizer": OptimizerState(model, opt)})
        result = {"model": _full(model.state_dict()), "optimizer": _full(get_optimizer_state_dict(model, opt))}
        if rank == 0:
            torch.save(result, tmp / "B_at3.pt")
        holder = Holder({k: distribute_tensor(torch.zeros(s), mesh, [Shard(0)]) for k, s in HSDP_SHAPES.items()}
                        | {"plain": torch.zeros(2), "n": 0})
        with CheckpointManager(tmp / "C") as mgr:
            mgr.restore({"values": holder})
        assert all(type(holder.values[k]).__name__ == "DTensor" for k in HSDP_SHAPES)
        result = _full(holder.values)
        if rank == 0:
            torch.save(result, tmp / "C_at3.pt")
        model, _ = sharded_model()
        with CheckpointManager(tmp / "D") as mgr:
            mgr.restore({"model": model})
        result = _full(model.state_dict())
        if rank == 0:
            torch.save(result, tmp / "D_at3.pt")
    leave_together()

