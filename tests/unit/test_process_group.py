"""Process-group set-up from the environment: backend, device, timeout, teardown on every path."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from elastictrain.train import process_group as pg
from elastictrain.errors import ConfigError
from elastictrain.train.worker import WorkerContext

pytestmark = pytest.mark.timeout(30)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in (pg.BACKEND_ENV, pg.TIMEOUT_ENV):
        monkeypatch.delenv(name, raising=False)
    yield
    assert not dist.is_initialized()


def launched(world_size: int = 1) -> WorkerContext:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return WorkerContext(rank=0, world_size=world_size, master_addr="127.0.0.1", master_port=port)


def test_timeout_comes_from_the_argument_then_the_environment_then_60_seconds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert pg.resolve_timeout() == timedelta(seconds=60)
    monkeypatch.setenv(pg.TIMEOUT_ENV, "15")
    assert pg.resolve_timeout() == timedelta(seconds=15)
    assert pg.resolve_timeout(5) == timedelta(seconds=5)
    assert pg.resolve_timeout(timedelta(minutes=2)) == timedelta(seconds=120)


@pytest.mark.parametrize("value", [0, -1, "soon", float("nan")])
def test_a_bad_timeout_is_refused(value: object) -> None:
    with pytest.raises(ConfigError, match="timeout"):
        pg.resolve_timeout(value)  # type: ignore[arg-type]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only defaults")
def test_without_cuda_the_backend_is_gloo_the_device_cpu_and_nccl_refused() -> None:
    assert pg.default_backend() == "gloo"
    assert pg.device_for(WorkerContext()) == torch.device("cpu")
    with pytest.raises(ConfigError, match="needs CUDA"):
        pg.init_process_group(launched(), backend="nccl")


def test_local_workers_sharing_the_one_gpu_are_refused_before_nccl_forms_a_group(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # As on a 1-GPU machine with --nproc-per-node 2: the job's last line was NCCL's "invalid usage"
    # (its "Duplicate GPU detected" only in the log above).
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    second = WorkerContext(rank=1, world_size=2, local_rank=1, local_world_size=2, master_addr="127.0.0.1",
                           master_port=1)
    with pytest.raises(ConfigError, match="2 local workers share this machine's one GPU"):
        pg.init_process_group(second)
    assert not dist.is_initialized()
    pg._check_a_gpu_per_rank(WorkerContext(local_world_size=1))  # one worker: the GPU is its own
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")  # a GPU of its own each (torch's virtual local rank)
    pg._check_a_gpu_per_rank(second)


def test_without_a_launcher_no_group_is_formed() -> None:
    placement = pg.init_process_group(WorkerContext())
    assert not placement.distributed and not dist.is_initialized()
    assert (placement.rank, placement.world_size, placement.device.type) == (0, 1, "cpu")


def test_a_rank_whose_peers_never_come_says_what_it_waits_for(monkeypatch: pytest.MonkeyPatch,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    """Launcher variables left over in a shell made a plain `python train.py` wait the whole
    timeout in silence, then fail with torch's store traceback."""
    monkeypatch.setattr(pg, "_SAY_WAITING", timedelta(seconds=0.3))
    with caplog.at_level("WARNING", logger=pg.__name__), pytest.raises(dist.DistError):
        pg.init_process_group(launched(world_size=2), backend="gloo", timeout=2)
    assert "rank 0 of 2 still waits for the other ranks at 127.0.0.1:" in caplog.text
    assert "are RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT left over" in caplog.text
    caplog.clear()
    pg.init_process_group(launched(), backend="gloo", timeout=2)  # formed at once: nothing said
    pg.destroy_process_group()
    assert "still waits" not in caplog.text


def test_the_scope_forms_a_group_and_destroys_it_when_the_body_raises() -> None:
    with pytest.raises(RuntimeError, match="boom"):
        with pg.process_group_scope(launched(), backend="gloo", timeout=7) as placement:
            assert dist.is_initialized() and dist.get_backend() == "gloo"
            assert placement.owned and placement.timeout == timedelta(seconds=7)
            raise RuntimeError("boom")
    assert not dist.is_initialized()
    pg.destroy_process_group()  # idempotent


def test_the_environment_overrides_the_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(pg.BACKEND_ENV, "gloo")
    with pg.process_group_scope(launched()) as placement:
        assert placement.backend == "gloo"


def test_a_group_formed_elsewhere_is_used_and_left_alone() -> None:
    context = launched()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{context.master_port}", rank=0, world_size=1)
    try:
        with pg.process_group_scope(context) as placement:
            assert not placement.owned
        assert dist.is_initialized()
    finally:
        dist.destroy_process_group()


def test_an_exit_handler_destroys_a_group_left_open() -> None:
    placement = pg.init_process_group(launched())
    assert placement.owned and pg._atexit_registered
    pg.destroy_process_group()  # what atexit runs
    assert not dist.is_initialized()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_gpu_nccl_is_chosen_with_async_error_handling_and_the_local_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    with pg.process_group_scope(launched()) as placement:
        assert placement.backend == "nccl" and placement.device == torch.device("cuda", 0)
        assert torch.cuda.current_device() == 0
        import os

        assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
