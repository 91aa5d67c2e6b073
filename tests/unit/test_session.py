"""Session in one process: accumulation, resume, hooks, precision, and process-group teardown.

Most tests run without a launcher (no process group, no DDP). The
process-group tests form a real world-of-one gloo group from
``MASTER_ADDR``/``MASTER_PORT``, as a launcher would.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import TensorDataset

import elastictrain
from elastictrain.errors import ConfigError, SessionError
from elastictrain.train.sampler import epoch_permutation

pytestmark = pytest.mark.timeout(60)

_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID", "ELASTICTRAIN_BACKEND",
                "ELASTICTRAIN_PG_TIMEOUT")


@pytest.fixture(autouse=True)
def no_launcher(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in _LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)
    yield
    assert not dist.is_initialized(), "a test left a process group behind"


@pytest.fixture
def world_of_one(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    for name, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(port)), ("RANK", "0"),
                        ("WORLD_SIZE", "1"), ("TORCHELASTIC_RUN_ID", "unit")):
        monkeypatch.setenv(name, value)


def dataset(n: int = 40, dtype: torch.dtype = torch.float32) -> TensorDataset:
    data = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(n, 6, generator=data, dtype=dtype),
                         torch.randn(n, 1, generator=data, dtype=dtype))


def make_model(dropout: float = 0.0) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Dropout(dropout), torch.nn.Tanh(),
                               torch.nn.Linear(8, 1))


def train(session: elastictrain.Session, *, stop_after: int | None = None) -> None:
    for step in session.steps():
        for micro in step:
            x, y = micro.batch
            micro.backward(torch.nn.functional.mse_loss(session.model(x), y))
        if stop_after is not None and step.number == stop_after:
            raise KeyboardInterrupt("simulated crash")  # before the step is applied


class Recorder(elastictrain.Hooks):
    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    def _add(self, name: str, **kwargs: Any) -> None:
        self.events.append((name, kwargs))

    def on_start(self, **kw: Any) -> None:
        self._add("on_start")

    def on_rendezvous(self, **kw: Any) -> None:
        self._add("on_rendezvous", **kw)

    def on_restore(self, **kw: Any) -> None:
        self._add("on_restore", step=kw["step"])

    def on_world_change(self, **kw: Any) -> None:
        self._add("on_world_change", **kw)

    def before_save(self, **kw: Any) -> None:
        self._add("before_save", **kw)

    def after_save(self, **kw: Any) -> None:
        self._add("after_save", step=kw["step"])

    def on_step_end(self, **kw: Any) -> None:
        self._add("on_step_end", step=kw["step"])

    def on_end(self, **kw: Any) -> None:
        self._add("on_end", **kw)

    def on_failure(self, **kw: Any) -> None:
        self._add("on_failure", error=type(kw["error"]).__name__)

    def names(self) -> list[str]:
        return [name for name, _ in self.events]


# --- accumulation ---------------------------------------------------------------------------------


@pytest.mark.parametrize("num_workers", [0, 2])
def test_micro_batches_accumulate_to_the_full_batch_gradient_in_one_process(num_workers: int) -> None:
    data = dataset(22, torch.float64)
    model = make_model().double()
    seen: list[list[torch.Tensor]] = []
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # parameters stay put
    with elastictrain.Session(model, optimizer, data, global_batch_size=10, micro_batch_size=3, seed=5,
                              num_workers=num_workers, log_every=None) as session:
        for step in session.steps():
            assert len(step) == (4 if step.step_size == 10 else 1)
            for micro in step:
                x, y = micro.batch
                micro.backward(torch.nn.functional.mse_loss(session.model(x), y))
            seen.append([p.grad.clone() for p in model.parameters()])
    perm = epoch_permutation(22, 5, 0)
    for index, grads in enumerate(seen):
        batch = perm[index * 10:index * 10 + 10]
        model.zero_grad()
        torch.nn.functional.mse_loss(model(data.tensors[0][batch]), data.tensors[1][batch]).backward()
        for p, grad in zip(model.parameters(), grads, strict=True):
            torch.testing.assert_close(grad, p.grad, atol=1e-12, rtol=0)
    assert len(seen) == 3  # 10 + 10 + a short step of 2


def test_a_step_whose_micro_batches_were_not_all_trained_raises() -> None:
    model = make_model()
    with pytest.raises(SessionError, match="micro-batches ran backward"):
        with elastictrain.Session(model, torch.optim.SGD(model.parameters(), lr=0.1), dataset(),
                                  global_batch_size=8, micro_batch_size=4, log_every=None) as session:
            for step in session.steps():
                for micro in step:
                    x, y = micro.batch
                    micro.backward(torch.nn.functional.mse_loss(session.model(x), y))
                    break


def test_micro_step_backward_wants_a_scalar_loss() -> None:
    model = make_model()
    with pytest.raises(ConfigError, match="scalar"):
        with elastictrain.Session(model, torch.optim.SGD(model.parameters(), lr=0.1), dataset(),
                                  global_batch_size=8, log_every=None) as session:
            for step in session.steps():
                for micro in step:
                    micro.backward(session.model(micro.batch[0]))


# --- checkpoint and resume ------------------------------------------------------------------------


def run_to_end(tmp: Path | None, *, crash_at: int | None = None, hooks: tuple[object, ...] = (),
               precision: str = "fp32", on_session: Callable[[elastictrain.Session], None] | None = None,
               **options: Any) -> tuple[torch.nn.Module, elastictrain.Session]:
    model = make_model(dropout=0.2)  # dropout: the RNG states must be restored too
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    extras = {"meta": {"note": "kept"}}
    session = elastictrain.Session(
        model, optimizer, dataset(), global_batch_size=8, micro_batch_size=3, epochs=2, scheduler=scheduler,
        checkpoint_dir=None if tmp is None else str(tmp), checkpoint_every=None if tmp is None else 3,
        hooks=hooks, extra_state=extras, log_every=None, precision=precision, **options,
    )
    if on_session is not None:
        on_session(session)
    try:
        with session:
            train(session, stop_after=crash_at)
    except KeyboardInterrupt:
        pass
    return model, session


def test_a_resumed_run_ends_where_an_uninterrupted_one_does(tmp_path: Path) -> None:
    reference, _ = run_to_end(None)
    _, crashed = run_to_end(tmp_path, crash_at=8)  # checkpoints at 3 and 6; steps 7-8 lost
    assert crashed.step == 7
    resumed, session = run_to_end(tmp_path)
    assert session.restored is not None and session.restored.step == 6
    assert session.step == 10
    for a, b in zip(resumed.state_dict().values(), reference.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)  # same process, same order: bit-identical


class PauseCopyUntilNextStep(elastictrain.Hooks):
    """Holds each overlapped save's copy until the next optimizer step has run (or 1 s has passed)."""

    def __init__(self) -> None:
        self.session: elastictrain.Session | None = None
        self.timed_out: list[int] = []
        self.stepped: threading.Event | None = None

    def before_save(self, *, step: int) -> None:
        assert self.session is not None and self.session.checkpoints is not None
        if self.stepped is None:
            self.session.optimizer.register_step_post_hook(lambda *_: self.stepped.set())  # type: ignore[union-attr]
        stepped, paused = threading.Event(), []
        self.stepped = stepped

        def pause(stage: str) -> None:
            if stage == "during_copy" and not paused:
                paused.append(True)
                if not stepped.wait(1.0):
                    self.timed_out.append(step)

        self.session.checkpoints._fault_hook = pause


def test_overlapped_saves_hold_their_step_while_the_next_one_runs_and_resume_like_an_uninterrupted_run(
    tmp_path: Path,
) -> None:
    reference, _ = run_to_end(None)
    pause = PauseCopyUntilNextStep()
    _, crashed = run_to_end(tmp_path, crash_at=8, hooks=(pause,), async_save=True, overlap_save=True,
                            on_session=lambda session: setattr(pause, "session", session))
    assert crashed.step == 7
    # Both saves' copies were still held when the next optimizer step came: it waited for them.
    assert pause.timed_out == [3, 6]
    resumed, session = run_to_end(tmp_path, async_save=True, overlap_save=True)
    assert session.restored is not None and session.restored.step == 6
    for a, b in zip(resumed.state_dict().values(), reference.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_hooks_see_a_fresh_run_and_a_resumed_run_in_order(tmp_path: Path) -> None:
    first = Recorder()
    run_to_end(tmp_path, crash_at=5, hooks=(first,))
    assert first.names() == [
        "on_start", "on_rendezvous",
        "on_step_end", "on_step_end", "on_step_end", "before_save", "after_save",
        "on_step_end", "on_failure",
    ]
    assert first.events[1] == ("on_rendezvous", {"rank": 0, "world_size": 1, "restart_count": 0})
    assert first.events[-1] == ("on_failure", {"error": "KeyboardInterrupt"})

    second = Recorder()
    run_to_end(tmp_path, hooks=(second,))
    names = second.names()
    assert names[:3] == ["on_start", "on_rendezvous", "on_restore"]
    assert second.events[2] == ("on_restore", {"step": 3})
    assert [kw["step"] for name, kw in second.events if name == "on_step_end"] == list(range(4, 11))
    assert [kw["step"] for name, kw in second.events if name == "after_save"] == [6, 9, 10]  # 10: the final save
    assert names[-3:] == ["before_save", "after_save", "on_end"]
    assert second.events[-1] == ("on_end", {"step": 10})


def test_a_hook_that_raises_is_logged_by_name_and_training_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    class Broken(elastictrain.Hooks):
        def on_step_end(self, *, step: int, loss: float, throughput: float) -> None:
            raise ValueError("exporter down")

    after = Recorder()
    with caplog.at_level(logging.WARNING, logger="elastictrain.train.hooks"):
        model, session = run_to_end(None, hooks=(Broken(), after))
    assert session.step == 10
    assert [kw["step"] for name, kw in after.events if name == "on_step_end"] == list(range(1, 11))
    warnings = [r for r in caplog.records if r.name == "elastictrain.train.hooks"]
    assert len(warnings) == 10
    assert "Broken" in warnings[0].getMessage() and "on_step_end" in warnings[0].getMessage()
    assert warnings[0].exc_info is not None


def test_fp16_grad_scaler_state_is_checkpointed_and_restored(tmp_path: Path) -> None:
    _, first = run_to_end(tmp_path, crash_at=5, precision="fp16")
    assert first.precision.scaler is not None
    saved = torch.load(tmp_path / "step_00000003" / "replicated.pt", weights_only=True)
    assert "scaler" in saved["stateful"] and saved["stateful"]["scaler"]["scale"] > 0
    _, second = run_to_end(tmp_path, precision="fp16")
    assert second.restored is not None and second.step == 10


def test_bf16_autocasts_the_forward_on_cpu() -> None:
    model = make_model()
    dtypes = []
    model[0].register_forward_hook(lambda _m, _i, out: dtypes.append(out.dtype))
    with elastictrain.Session(model, torch.optim.SGD(model.parameters(), lr=0.1), dataset(),
                              global_batch_size=8, micro_batch_size=4, precision="bf16", max_steps=2,
                              grad_clip_norm=1.0, log_every=None) as session:
        train(session)
    assert dtypes and set(dtypes) == {torch.bfloat16}
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_max_steps_stops_mid_epoch_and_counts_restored_steps(tmp_path: Path) -> None:
    model = make_model()
    with elastictrain.Session(model, torch.optim.SGD(model.parameters(), lr=0.1), dataset(),
                              global_batch_size=8, max_steps=3, checkpoint_dir=str(tmp_path),
                              log_every=None) as session:
        train(session)
    assert session.step == 3
    with elastictrain.Session(model, torch.optim.SGD(model.parameters(), lr=0.1), dataset(),
                              global_batch_size=8, max_steps=4, checkpoint_dir=str(tmp_path),
                              log_every=None) as session:
        train(session)
    assert session.step == 4 and session.epoch == 0


# --- configuration --------------------------------------------------------------------------------


@pytest.mark.parametrize("options, match", [
    ({"global_batch_size": 0}, "global_batch_size"),
    ({"global_batch_size": 8, "micro_batch_size": -1}, "micro_batch_size"),
    ({"global_batch_size": 8, "precision": "fp8"}, "precision"),
    ({"global_batch_size": 8, "checkpoint_every": 5}, "checkpoint_dir"),
    ({"global_batch_size": 8, "timeout": -1}, "timeout"),
    ({"global_batch_size": 8, "no_such_option": 1}, "no_such_option"),
    ({"global_batch_size": 8, "grad_clip_norm": True}, "grad_clip_norm"),  # was taken as 1
])
def test_bad_options_raise_config_error_naming_them(options: dict[str, Any], match: str) -> None:
    model = make_model()
    with pytest.raises(ConfigError, match=match):
        elastictrain.Session(model, torch.optim.SGD(model.parameters(), lr=0.1), dataset(), **options)


def test_an_optimizer_that_would_not_train_the_model_is_refused() -> None:
    """Before, an optimizer over another model's parameters trained nothing and the job exited 0;
    a model without parameters failed later with a message about its output."""
    model = make_model()
    with pytest.raises(ConfigError, match="updates none of the model's trainable parameters"):
        elastictrain.Session(model, torch.optim.SGD(make_model().parameters(), lr=0.1), dataset(),
                             global_batch_size=8)
    with pytest.raises(ConfigError, match="must be a torch.optim.Optimizer, got str"):
        elastictrain.Session(model, "sgd", dataset(), global_batch_size=8)  # type: ignore[arg-type]
    frozen = make_model().requires_grad_(False)
    with pytest.raises(ConfigError, match="no parameter that requires grad"):
        elastictrain.Session(frozen, torch.optim.SGD(frozen.parameters(), lr=0.1), dataset(), global_batch_size=8)
    # Partly the model's (a head frozen, a learnable scale outside it) is fine.
    scale = torch.nn.Parameter(torch.ones(()))
    elastictrain.Session(model, torch.optim.SGD([*model.parameters(), scale], lr=0.1), dataset(), global_batch_size=8)


def test_extra_state_that_a_checkpoint_could_not_hold_is_refused_at_once() -> None:
    """Before, it was refused at the first save, checkpoint_every steps into training."""
    model = make_model()
    with pytest.raises(ConfigError, match=r"extra_state\['progress'\]"):
        elastictrain.Session(model, torch.optim.SGD(model.parameters(), lr=0.1), dataset(), global_batch_size=8,
                             extra_state={"progress": {"best": object()}})
    with pytest.raises(ConfigError, match=r"state\['ema'\] is a float"):
        elastictrain.Session(model, torch.optim.SGD(model.parameters(), lr=0.1), dataset(), global_batch_size=8,
                             extra_state={"ema": 0.5})


def test_extra_state_may_not_reuse_a_reserved_name() -> None:
    model = make_model()
    with pytest.raises(ConfigError, match="reserved"):
        elastictrain.Session(model, torch.optim.SGD(model.parameters(), lr=0.1), dataset(), global_batch_size=8,
                             extra_state={"model": {}})


# --- process group --------------------------------------------------------------------------------


@pytest.mark.usefixtures("world_of_one")
def test_the_session_destroys_the_group_it_formed_when_the_loop_raises() -> None:
    model = make_model()
    recorder = Recorder()
    with pytest.raises(RuntimeError, match="boom"):
        with elastictrain.Session(model, torch.optim.SGD(model.parameters(), lr=0.1), dataset(),
                                  global_batch_size=8, hooks=[recorder], log_every=None) as session:
            assert dist.is_initialized() and isinstance(session.model, torch.nn.parallel.DistributedDataParallel)
            raise RuntimeError("boom")
    assert not dist.is_initialized()
    assert recorder.names()[-1] == "on_failure"


@pytest.mark.usefixtures("world_of_one")
def test_a_worker_told_that_the_job_ended_says_it_left_and_logs_no_error(caplog: pytest.LogCaptureFixture) -> None:
    # Probe, stop 29: a worker whose agent closed the group (stopped, or the job ended
    # elsewhere) logged "ERROR training failed at step 41: JobEnded: the agent stopped".
    from elastictrain.train.control import JobEnded

    model = make_model()
    with caplog.at_level(logging.INFO, logger="elastictrain"), pytest.raises(JobEnded):
        with elastictrain.Session(model, torch.optim.SGD(model.parameters(), lr=0.1), dataset(),
                                  global_batch_size=8, log_every=None):
            raise JobEnded("the agent stopped")
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    assert "left the job at step 0: the agent stopped" in caplog.text


@pytest.mark.usefixtures("world_of_one")
def test_the_session_destroys_the_group_when_restoring_fails(tmp_path: Path) -> None:
    other = torch.nn.Linear(3, 3)
    with elastictrain.CheckpointManager(tmp_path) as manager:  # a checkpoint that does not fit
        manager.save(1, {"model": other, "optimizer": torch.optim.SGD(other.parameters(), lr=0.1)})
    model = make_model()
    with pytest.raises(elastictrain.ElasticTrainError, match="does not fit|has no entry"):
        with elastictrain.Session(model, torch.optim.SGD(model.parameters(), lr=0.1), dataset(),
                                  global_batch_size=8, checkpoint_dir=str(tmp_path), log_every=None):
            pass
    assert not dist.is_initialized()


@pytest.mark.usefixtures("world_of_one")
def test_a_forward_through_the_unwrapped_module_is_caught() -> None:
    model = make_model()
    with pytest.raises(SessionError, match="session.model"):
        with elastictrain.Session(model, torch.optim.SGD(model.parameters(), lr=0.1), dataset(),
                                  global_batch_size=8, log_every=None) as session:
            for step in session.steps():
                for micro in step:
                    micro.backward(torch.nn.functional.mse_loss(model(micro.batch[0]), micro.batch[1]))
    assert not dist.is_initialized()


@pytest.mark.usefixtures("world_of_one")
def test_the_session_leaves_a_group_it_did_not_form() -> None:
    dist.init_process_group("gloo")
    try:
        model = make_model()
        with elastictrain.Session(model, torch.optim.SGD(model.parameters(), lr=0.1), dataset(),
                                  global_batch_size=8, max_steps=1, log_every=None) as session:
            train(session)
        assert dist.is_initialized()
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.usefixtures("world_of_one")
def test_on_gpu_the_session_trains_on_the_local_gpu_with_nccl_and_bf16_autocast(tmp_path: Path) -> None:
    model = make_model()
    with elastictrain.Session(model, torch.optim.SGD(model.parameters(), lr=0.1), dataset(), global_batch_size=8,
                              micro_batch_size=4, max_steps=2, checkpoint_dir=str(tmp_path), sync_loss=True,
                              log_every=1) as session:
        assert session.placement is not None and session.placement.backend == "nccl"
        assert session.device == torch.device("cuda", 0)
        assert session.precision.precision in ("bf16", "fp16")
        for step in session.steps():
            for micro in step:
                x, y = micro.batch
                assert x.is_cuda
                micro.backward(torch.nn.functional.mse_loss(session.model(x).float(), y))
    assert next(model.parameters()).is_cuda and session.step == 2
    assert not dist.is_initialized()


def test_skipped_fp16_updates_are_said_and_a_run_of_them_warned_of(caplog: pytest.LogCaptureFixture) -> None:
    """Before, a GradScaler that skipped every update left the model as it was, without a line."""
    data = TensorDataset(torch.randn(40, 6), torch.full((40, 1), 1e4))  # loss gradients beyond fp16's range
    model = make_model()
    before = [p.detach().clone() for p in model.parameters()]
    with caplog.at_level(logging.INFO, logger="elastictrain"), elastictrain.Session(
            model, torch.optim.SGD(model.parameters(), lr=0.1), data, global_batch_size=4, precision="fp16",
            epochs=2, max_steps=12, log_every=None) as session:
        train(session)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    said = [r for r in caplog.records if "update skipped" in r.getMessage()]
    warned = [r for r in caplog.records if r.levelno == logging.WARNING and "were all skipped" in r.getMessage()]
    assert len(said) == 9 and "] step 1: update skipped" in said[0].getMessage()
    assert len(warned) == 1 and "last 10 steps (to step 10)" in warned[0].getMessage()


@pytest.mark.usefixtures("world_of_one")
def test_a_raise_inside_a_step_is_said_to_fail_in_that_step(caplog: pytest.LogCaptureFixture) -> None:
    # Issue 43: a raise inside step 50 was logged "training failed at step 49".
    model = make_model()
    with caplog.at_level(logging.INFO, logger="elastictrain"), pytest.raises(RuntimeError):
        with elastictrain.Session(model, torch.optim.SGD(model.parameters(), lr=0.1), dataset(),
                                  global_batch_size=8, log_every=None) as session:
            for step in session.steps():
                if step.number == 3:
                    raise RuntimeError("boom")
                for micro in step:
                    x, y = micro.batch
                    micro.backward(torch.nn.functional.mse_loss(session.model(x), y))
    assert "training failed in step 3 (2 committed): RuntimeError: boom" in caplog.text, caplog.text
