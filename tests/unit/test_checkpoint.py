"""CheckpointManager in one process: round trip, retention, corruption, mismatch, async, weights_only."""

from __future__ import annotations

import hashlib
import json
import logging
import random
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from elastictrain.checkpoint import CheckpointManager, LocalStorage
from elastictrain.errors import (
    CheckpointError,
    CheckpointMismatchError,
    ConfigError,
    CorruptCheckpointError,
    NoCheckpointError,
    NonFiniteStateError,
)

pytestmark = pytest.mark.timeout(30)


class Cursor:
    """A sampler-like object: only state_dict/load_state_dict."""

    def __init__(self) -> None:
        self.epoch, self.consumed = 0, 0

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "consumed": self.consumed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.consumed = state["epoch"], state["consumed"]


class Trainer:
    """A tiny model with every kind of state the manager handles."""

    def __init__(self, seed: int = 0, hidden: int = 8) -> None:
        torch.manual_seed(seed)
        self.model = torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 2))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=0.01)
        self.sched = torch.optim.lr_scheduler.StepLR(self.opt, step_size=2, gamma=0.5)
        self.scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1)
        self.cursor = Cursor()

    def train(self, steps: int) -> None:
        for _ in range(steps):
            loss = self.model(torch.randn(3, 4)).square().mean()
            self.opt.zero_grad()
            self.scaler.scale(loss).backward()
            self.scaler.step(self.opt)
            self.scaler.update()
            self.sched.step()
            self.cursor.consumed += 3

    def state(self, **extras: dict[str, Any]) -> dict[str, Any]:
        return {
            "model": self.model,
            "optimizer": self.opt,
            "scheduler": self.sched,
            "scaler": self.scaler,
            "sampler": self.cursor,
            **extras,
        }


def draws() -> tuple[list[float], float, float]:
    return torch.rand(3).tolist(), float(np.random.rand()), random.random()


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def save_steps(directory: Path, steps: list[int], **kwargs: Any) -> dict[int, dict[str, torch.Tensor]]:
    trainer, saved = Trainer(), {}
    with CheckpointManager(directory, **kwargs) as mgr:
        for step in steps:
            trainer.train(1)
            mgr.save(step, trainer.state())
            saved[step] = weights(trainer.model)
    return saved


def test_restore_round_trips_model_optimizer_scheduler_scaler_sampler_rng_and_extras(tmp_path: Path) -> None:
    trainer = Trainer(seed=0)
    trainer.train(3)
    trainer.cursor.epoch = 2
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(3, trainer.state(progress={"epoch": 2, "best_loss": 0.25, "tags": ["a", "b"]}))
    expected_draws = draws()

    fresh = Trainer(seed=1)
    progress: dict[str, Any] = {"epoch": 0}
    torch.manual_seed(123)
    with CheckpointManager(tmp_path) as mgr:
        info = mgr.restore(fresh.state(progress=progress))

    assert info is not None and info.step == 3 and info.world_size == 1
    assert info.path == str(tmp_path / "step_00000003")
    assert info.extras == {"progress": {"epoch": 2, "best_loss": 0.25, "tags": ["a", "b"]}}
    assert progress == {"epoch": 2, "best_loss": 0.25, "tags": ["a", "b"]}
    assert draws() == expected_draws
    assert_same_weights(weights(fresh.model), weights(trainer.model))
    assert str(fresh.opt.state_dict()) == str(trainer.opt.state_dict())
    assert fresh.sched.state_dict() == trainer.sched.state_dict()
    assert fresh.scaler.state_dict() == trainer.scaler.state_dict() and fresh.scaler.get_scale() != 1024.0
    assert fresh.cursor.state_dict() == {"epoch": 2, "consumed": 9}
    # Training on from the restored state matches training on from the original (same batches).
    rng = torch.get_rng_state()
    trainer.train(2)
    torch.set_rng_state(rng)
    fresh.train(2)
    assert_same_weights(weights(fresh.model), weights(trainer.model))


def test_restore_returns_none_and_latest_step_is_none_without_checkpoints(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path / "new") as mgr:
        assert mgr.latest_step() is None
        assert mgr.restore(Trainer().state()) is None


def test_keep_last_deletes_older_checkpoints_only_after_a_newer_commit(tmp_path: Path) -> None:
    trainer = Trainer()
    with CheckpointManager(tmp_path, keep_last=2) as mgr:
        for step in (10, 20, 30, 40):
            mgr.save(step, trainer.state())
            names = sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("."))
            assert names[-1] == f"step_{step:08d}"
            assert len(names) <= 2
        assert mgr.latest_step() == 40
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == ["step_00000030", "step_00000040"]


def test_retention_counts_and_deletes_only_checkpoints_it_committed(tmp_path: Path, caplog: Any) -> None:
    """A ``step_N`` directory without a manifest was never committed by elastictrain (a commit
    renames a staging directory that holds one): retention neither deletes it nor counts it
    among the ``keep_last``. Before, it deleted the user's directory and kept one valid
    checkpoint fewer, while warning that restore would prefer it (restore skips it)."""
    foreign = tmp_path / "step_00000099"
    foreign.mkdir(parents=True)
    (foreign / "data.txt").write_text("the user's")
    trainer = Trainer()
    with caplog.at_level(logging.WARNING), CheckpointManager(tmp_path, keep_last=2) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, trainer.state())
        assert mgr.latest_step() == 3
    names = sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("."))
    assert names == ["step_00000002", "step_00000003", "step_00000099"]
    assert (foreign / "data.txt").read_text() == "the user's"
    assert "later steps exist" not in caplog.text
    with CheckpointManager(tmp_path, keep_last=1) as mgr:
        mgr.save(4, trainer.state())
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == ["step_00000004",
                                                                                        "step_00000099"]


def _corrupt(checkpoint: Path, how: str) -> None:
    target = checkpoint / "replicated.pt"
    if how == "truncated":
        target.write_bytes(target.read_bytes()[:-100])
    elif how == "flipped_byte":
        data = bytearray(target.read_bytes())
        data[len(data) // 2] ^= 0x01
        target.write_bytes(bytes(data))
    elif how == "missing_manifest":
        (checkpoint / "MANIFEST.json").unlink()
    elif how == "missing_file":
        (checkpoint / "rank_00000.pt").unlink()
    elif how == "garbled_manifest":
        (checkpoint / "MANIFEST.json").write_text("{not json")


@pytest.mark.parametrize("how", ["truncated", "flipped_byte", "missing_manifest", "missing_file", "garbled_manifest"])
def test_restore_skips_a_corrupt_checkpoint_with_a_warning_and_uses_the_previous_one(
    tmp_path: Path, how: str, caplog: pytest.LogCaptureFixture
) -> None:
    saved = save_steps(tmp_path, [1, 2])
    _corrupt(tmp_path / "step_00000002", how)
    fresh = Trainer(seed=5)
    with caplog.at_level(logging.WARNING), CheckpointManager(tmp_path) as mgr:
        # latest_step checks manifests and sizes only: a flipped byte is caught by the ranks that load it.
        assert mgr.latest_step() == (2 if how == "flipped_byte" else 1)
        info = mgr.restore(fresh.state())
    assert info is not None and info.step == 1
    assert_same_weights(weights(fresh.model), saved[1])
    assert any("step_00000002" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)


def test_restore_of_a_named_corrupt_step_raises_instead_of_falling_back(tmp_path: Path) -> None:
    save_steps(tmp_path, [1, 2])
    _corrupt(tmp_path / "step_00000002", "flipped_byte")
    with CheckpointManager(tmp_path) as mgr:
        with pytest.raises(CorruptCheckpointError, match="sha256"):
            mgr.restore(Trainer().state(), step=2)
        with pytest.raises(NoCheckpointError, match="step 7"):
            mgr.restore(Trainer().state(), step=7)


def test_restore_raises_when_checkpoints_exist_but_none_verifies(tmp_path: Path) -> None:
    save_steps(tmp_path, [1])
    _corrupt(tmp_path / "step_00000001", "truncated")
    with CheckpointManager(tmp_path) as mgr, pytest.raises(CorruptCheckpointError, match="none of the 1"):
        mgr.restore(Trainer().state())


def test_restore_into_a_model_of_another_shape_names_the_parameter_and_both_shapes(tmp_path: Path) -> None:
    save_steps(tmp_path, [1])
    bigger = Trainer(hidden=16)
    before = weights(bigger.model)
    with CheckpointManager(tmp_path) as mgr, pytest.raises(CheckpointMismatchError) as err:
        mgr.restore(bigger.state())
    assert "'0.weight'" in str(err.value) and "(8, 4)" in str(err.value) and "(16, 4)" in str(err.value)
    assert_same_weights(weights(bigger.model), before)  # nothing was half-loaded


def test_restore_of_an_entry_the_checkpoint_lacks_raises_mismatch(tmp_path: Path) -> None:
    save_steps(tmp_path, [1])
    with CheckpointManager(tmp_path) as mgr, pytest.raises(CheckpointMismatchError, match="'ema'"):
        mgr.restore({**Trainer().state(), "ema": Cursor()})


def test_restore_into_another_kind_of_optimizer_raises_mismatch_and_changes_nothing(tmp_path: Path) -> None:
    """torch's load_state_dict took SGD's state into Adam, and the first step() failed with
    KeyError: 'betas'. Adam into AdamW (the same options) still restores."""
    model = torch.nn.Linear(4, 2)
    with CheckpointManager(tmp_path / "sgd") as mgr:
        mgr.save(1, {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)})
    adam = torch.optim.Adam(model.parameters(), lr=0.01)
    before = str(adam.state_dict())
    with CheckpointManager(tmp_path / "sgd") as mgr, pytest.raises(
            CheckpointMismatchError, match=r"another kind of optimizer for 'optimizer'.*'betas', 'eps'.*Adam needs"):
        mgr.restore({"model": model, "optimizer": adam})
    assert str(adam.state_dict()) == before
    with CheckpointManager(tmp_path / "adam") as mgr:
        mgr.save(1, {"model": model, "optimizer": adam})
        assert mgr.restore({"model": model, "optimizer": torch.optim.AdamW(model.parameters())}).step == 1
    # An option a checkpoint of an older torch lacks is one the class fills in itself: no mismatch.
    with CheckpointManager(tmp_path / "adam") as mgr:
        adam_state = adam.state_dict()
        for group in adam_state["param_groups"]:
            del group["amsgrad"]
        mgr.save(2, {"model": model, "optimizer": _Raw(adam_state)})
        assert mgr.restore({"model": model, "optimizer": torch.optim.Adam(model.parameters())}).step == 2


class _Raw:
    """A saved state dict as it is (what an older torch's optimizer saved)."""

    def __init__(self, state: dict[str, Any]) -> None:
        self.state = state

    def state_dict(self) -> dict[str, Any]:
        return self.state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = state

def test_unreadable_checkpoint_directory_raises_checkpoint_error(tmp_path: Path) -> None:
    class Unreadable(LocalStorage):
        def list_dir(self, path: str) -> list[str]:
            raise PermissionError(13, "Permission denied", path)

    with CheckpointManager("ckpt", storage=Unreadable(tmp_path)) as mgr:
        with pytest.raises(CheckpointError, match="cannot read checkpoint directory"):
            mgr.restore(Trainer().state())


def test_save_rejects_state_that_weights_only_loading_could_not_read(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path) as mgr:
        with pytest.raises(ConfigError, match=r"state\['progress'\]\['lr'\].*numpy"):
            mgr.save(1, {"progress": {"lr": np.float64(0.1)}})
        with pytest.raises(ConfigError, match="'clock'"):
            mgr.save(1, {"clock": object()})  # type: ignore[dict-item]
        with pytest.raises(ConfigError, match="step"):
            mgr.save(-1, {})
        assert mgr.latest_step() is None


def test_restore_refuses_a_checkpoint_file_that_would_run_code(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self) -> tuple[Any, ...]:
            return (Path.touch, (marker,))

    save_steps(tmp_path / "ckpt", [1])
    checkpoint = tmp_path / "ckpt" / "step_00000001"
    torch.save({"stateful": {}, "extras": {"x": Payload()}}, checkpoint / "replicated.pt")
    # Make the manifest agree, so only weights_only stands between the file and the restore.
    manifest = json.loads((checkpoint / "MANIFEST.json").read_text())
    data = (checkpoint / "replicated.pt").read_bytes()
    manifest["files"]["replicated.pt"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (checkpoint / "MANIFEST.json").write_text(json.dumps(manifest))

    with CheckpointManager(tmp_path / "ckpt") as mgr, pytest.raises(CorruptCheckpointError, match="refusing"):
        mgr.restore({})
    assert not marker.exists()


def test_stale_staging_dirs_are_ignored_by_restore_and_deleted_by_the_next_commit(tmp_path: Path) -> None:
    saved = save_steps(tmp_path, [1])
    stale = tmp_path / "step_00000002.tmp-deadbeef"
    stale.mkdir()
    (stale / "replicated.pt").write_bytes(b"half a file")
    fresh = Trainer(seed=3)
    with CheckpointManager(tmp_path) as mgr:
        assert mgr.restore(fresh.state()).step == 1  # type: ignore[union-attr]
        assert_same_weights(weights(fresh.model), saved[1])
        mgr.save(2, fresh.state())
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == ["step_00000001", "step_00000002"]


def test_saving_a_step_again_replaces_its_checkpoint(tmp_path: Path) -> None:
    trainer = Trainer()
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(5, trainer.state(progress={"try": 1}))
        mgr.save(5, trainer.state(progress={"try": 2}))
        info = mgr.restore({})
    assert info is not None and info.extras == {"progress": {"try": 2}}
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == ["step_00000005"]


def test_async_save_writes_the_same_bytes_as_a_sync_save(tmp_path: Path) -> None:
    trainer = Trainer()
    trainer.train(2)
    for mode in ("sync", "async"):
        torch.manual_seed(7)  # the rank file holds RNG states; make them equal too
        np.random.seed(7)
        random.seed(7)
        with CheckpointManager(tmp_path / mode, async_save=mode == "async") as mgr:
            mgr.save(2, trainer.state(progress={"epoch": 1}))
    for name in ("replicated.pt", "rank_00000.pt"):
        sync = (tmp_path / "sync" / "step_00000002" / name).read_bytes()
        assert sync == (tmp_path / "async" / "step_00000002" / name).read_bytes(), name


class TiedLM(torch.nn.Module):
    """An LM whose output projection is its embedding's weight (tied), 256 KiB of it."""

    def __init__(self, tied: bool = True) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(1024, 64)
        self.out = torch.nn.Linear(64, 1024, bias=False)
        if tied:
            self.out.weight = self.emb.weight


@pytest.mark.parametrize("mode", ["sync", "async", "overlap"])
def test_a_tied_weight_is_written_once_and_restored_tied(tmp_path: Path, mode: str) -> None:
    written, saved = {}, {}
    for tied in (True, False):
        torch.manual_seed(0)
        model = TiedLM(tied)
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        model.out(model.emb(torch.arange(8))).square().mean().backward()
        opt.step()
        saved[tied] = {k: v.clone() for k, v in model.state_dict().items()}
        with CheckpointManager(tmp_path / str(tied), async_save=mode != "sync", overlap=mode == "overlap") as mgr:
            mgr.save(1, {"model": model, "opt": opt})
            with torch.no_grad():
                mgr.wait_snapshot()
                model.emb.weight.add_(1.0)  # training on at once: the save holds the values of step 1
            mgr.wait()
        written[tied] = (tmp_path / str(tied) / "step_00000001" / "replicated.pt").stat().st_size
    # Tied: the weight and its two Adam moments once; untied, the projection's three again.
    weight_bytes = 1024 * 64 * 4
    assert written[True] < written[False] - 2.5 * weight_bytes, written
    fresh = TiedLM()
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.01)
    with CheckpointManager(tmp_path / "True") as mgr:
        mgr.restore({"model": fresh, "opt": fresh_opt})
    assert fresh.out.weight is fresh.emb.weight
    for key, value in fresh.state_dict().items():
        assert torch.equal(value, saved[True][key]), key
    assert len(fresh_opt.state) == 1 and torch.equal(fresh_opt.state[fresh.emb.weight]["step"], torch.tensor(1.0))


def test_async_save_is_unaffected_by_training_right_after_save_returns(tmp_path: Path) -> None:
    trainer = Trainer()
    trainer.train(2)
    expected = weights(trainer.model)
    expected_opt = str(trainer.opt.state_dict())
    trained = threading.Event()
    with CheckpointManager(tmp_path, async_save=True) as mgr:
        # Hold the background writer until the training thread has changed everything.
        mgr._fault_hook = lambda stage: trained.wait(10) if stage == "before_write" else None
        mgr.save(2, trainer.state())
        trainer.train(3)
        with torch.no_grad():
            for p in trainer.model.parameters():
                p.add_(100.0)
        trained.set()
        mgr.wait()
    fresh = Trainer(seed=9)
    with CheckpointManager(tmp_path) as mgr:
        mgr.restore(fresh.state())
    assert_same_weights(weights(fresh.model), expected)
    assert str(fresh.opt.state_dict()) == expected_opt


def _fail_writes(stage: str) -> None:
    if stage == "during_write":
        raise OSError(28, "No space left on device")


class FailFirstWrite:
    """A fault hook failing the first file write only."""

    def __init__(self) -> None:
        self.failed = False

    def __call__(self, stage: str) -> None:
        if stage == "during_write" and not self.failed:
            self.failed = True
            _fail_writes(stage)


def test_failed_background_write_is_raised_by_wait_and_not_committed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    trainer = Trainer()
    with CheckpointManager(tmp_path, async_save=True) as mgr:
        mgr.save(1, trainer.state())
        mgr.wait()
        mgr._fault_hook = _fail_writes
        with caplog.at_level(logging.ERROR):
            mgr.save(2, trainer.state())
            with pytest.raises(CheckpointError, match="step 2.*No space left"):
                mgr.wait()
        assert any(r.levelno == logging.ERROR and "step 2" in r.getMessage() for r in caplog.records)
        mgr.wait()  # raised once, not forever
        assert mgr.latest_step() == 1
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == ["step_00000001"]


def test_failed_background_write_is_raised_by_the_next_save_which_then_does_not_run(tmp_path: Path) -> None:
    trainer = Trainer()
    with CheckpointManager(tmp_path, async_save=True) as mgr:
        mgr._fault_hook = FailFirstWrite()
        mgr.save(1, trainer.state())
        with pytest.raises(CheckpointError, match="step 1"):
            mgr.save(2, trainer.state())
        assert mgr.latest_step() is None
        mgr.save(3, trainer.state())
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == ["step_00000003"]


def test_failed_sync_write_raises_from_save_and_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    trainer = Trainer()
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, trainer.state())
        mgr._fault_hook = _fail_writes
        with pytest.raises(CheckpointError, match="not committed"):
            mgr.save(2, trainer.state())
        mgr._fault_hook = None
        assert mgr.latest_step() == 1
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == ["step_00000001"]


def test_async_saves_run_on_one_thread_which_close_ends(tmp_path: Path) -> None:
    # save() hands each save to the same thread rather than start one per save, which waits until
    # the new thread is scheduled: milliseconds of the training stall on busy cores.
    trainer = Trainer()
    ran_on: list[threading.Thread] = []
    go = threading.Event()

    def hold(stage: str) -> None:
        if stage == "before_write":
            ran_on.append(threading.current_thread())
            go.wait(10)

    with CheckpointManager(tmp_path, async_save=True) as mgr:
        mgr._fault_hook = hold
        for step in range(3):
            go.clear()
            mgr.save(step, trainer.state())
            assert mgr.saving
            go.set()
            mgr.wait()
            assert not mgr.saving
    assert len(set(ran_on)) == 1 and ran_on[0] is not threading.current_thread(), ran_on
    assert ran_on[0].name == "elastictrain-checkpoint-2"
    assert not ran_on[0].is_alive()
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == ["step_00000000",
                                                                                         "step_00000001",
                                                                                         "step_00000002"]


def test_closed_manager_refuses_to_save(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path, keep_last=1)
    mgr.close()
    mgr.close()
    with pytest.raises(CheckpointError, match="closed"):
        mgr.save(1, {})
    with pytest.raises(ConfigError, match="keep_last"):
        CheckpointManager(tmp_path, keep_last=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_async_save_of_a_cuda_model_round_trips_weights_and_cuda_rng(tmp_path: Path) -> None:
    model = torch.nn.Linear(4, 3).cuda()
    expected = {k: v.cpu().clone() for k, v in model.state_dict().items()}
    with CheckpointManager(tmp_path, async_save=True) as mgr:
        mgr.save(1, {"model": model})
        with torch.no_grad():
            model.weight.add_(1.0)  # the device copy was snapshotted; this must not leak in
    expected_draw = torch.rand(3, device="cuda")
    fresh = torch.nn.Linear(4, 3).cuda()
    with CheckpointManager(tmp_path) as mgr:
        mgr.restore({"model": fresh})
    assert torch.equal(torch.rand(3, device="cuda"), expected_draw)
    assert all(torch.equal(fresh.state_dict()[k].cpu(), v) for k, v in expected.items())


@pytest.mark.parametrize("mode", ["sync", "async", "overlap"])
def test_a_diverged_step_is_not_committed_and_keeps_the_good_checkpoints(tmp_path: Path, mode: str) -> None:
    """Before, a NaN step was committed like any other, and keep_last pushed the good
    checkpoints out: after 2 such saves only NaN weights were left."""
    trainer = Trainer()
    # An infinite buffer is no divergence (a causal attention mask holds -inf on purpose).
    trainer.model.register_buffer("mask", torch.full((2, 2), float("-inf")))
    options = {"async_save": mode != "sync", "overlap": mode == "overlap"}
    with CheckpointManager(tmp_path, keep_last=2, **options) as mgr:
        for step in (1, 2):
            trainer.train(1)
            mgr.save(step, trainer.state())
        mgr.wait()
        good = weights(trainer.model)
        with torch.no_grad():
            trainer.model[0].weight[0, 0] = float("nan")
        with pytest.raises(NonFiniteStateError, match=r"step 3: parameter '0.weight' of state\['model'\] holds NaN"):
            mgr.save(3, trainer.state())
            mgr.wait()
        with torch.no_grad():
            trainer.model[0].weight[0, 0] = float("inf")
        with pytest.raises(NonFiniteStateError):
            mgr.save(4, trainer.state())
            mgr.wait()
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == ["step_00000001",
                                                                                        "step_00000002"]
    restored = Trainer(seed=1)
    restored.model.register_buffer("mask", torch.zeros(2, 2))
    with CheckpointManager(tmp_path) as mgr:
        assert mgr.restore(restored.state()).step == 2
    assert_same_weights(weights(restored.model), good)


def test_large_finite_parameters_are_no_divergence(tmp_path: Path) -> None:
    trainer = Trainer()
    with torch.no_grad():
        trainer.model[0].weight.fill_(3e38)  # their float32 sum overflows; every value is finite
        trainer.model[2].half().weight.fill_(60000)  # a float16 sum of them would overflow
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, trainer.state())
        assert mgr.latest_step() == 1
