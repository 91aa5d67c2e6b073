"""``Session(..., sharding="fsdp" | "hsdp")`` trains as ``sharding="ddp"`` does, and its sharded
checkpoints restore at another world size, on real gloo processes.

One spawn of four processes forms groups of 2, 3 and 4 ranks. On each, the same float64 job
(SGD with momentum, a learning-rate schedule, accumulation over uneven micro-batches, clipping, a
short last step, a hook) runs once with DDP and once sharded; the final full parameters must
agree to summation order (a bf16 one at 2 ranks stays close). A sharded session saves at 4 ranks
and restores at 3, with the saved full tensors; copies of that checkpoint train on at 3 ranks,
sharded and with DDP, to equal ends. The slow test resizes an fsdp job under the launcher.

The test forks :func:`_worker` as every rank from the ranks' forkserver (``fork_ranks``).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.ranks import fork_ranks

WORLD = 4
TOLERANCE = 1e-12
BF16_CLOSE = 5e-3
"""bf16 against fp32 DDP: a bound on the parameters' drift after 6 SGD steps."""
pytestmark = pytest.mark.timeout(180)


def test_sharded_sessions_train_as_ddp_sessions_and_restore_at_another_world_size(tmp_path: Path) -> None:
    fork_ranks(_worker, WORLD, lambda rank: (rank, tmp_path), timeout=160)
    checks = json.loads((tmp_path / "rank0.json").read_text())
    assert set(checks) == {"fsdp/2", "bf16_close", "fsdp/3", "hsdp/4", "restored_4_to_3", "trained_on_at_3"}
    for name, error in checks.items():
        assert error <= (BF16_CLOSE if name == "bf16_close" else TOLERANCE), f"{name}: max error {error}"


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_an_fsdp_job_resized_2_3_2_by_restarts_reaches_the_parameters_of_an_uninterrupted_ddp_run(
        etcd_server: Any, tmp_path: Path) -> None:
    # tests/integration/test_session_elastic.py's resize, with sharding="fsdp": each restart
    # restores the sharded checkpoint at the new world size (8 at 2 -> 3, 16 at 3 -> 2).
    from tests.integration.test_session_elastic import ATOL, RTOL, TOTAL_STEPS, resized_run, run_reference

    out = tmp_path / "elastic"
    out.mkdir()
    for run in resized_run(etcd_server.endpoint, out, "--sharding", "fsdp"):
        segments = [json.loads(line) for line in (run.out / "segments.jsonl").read_text().splitlines()]
        assert [(s["world_size"], s["restored_step"]) for s in segments] == [(2, None), (3, 8), (2, 16)]
        assert "shards_00002.bin" in {f.name for f in (out / "ckpt" / "step_00000016").iterdir()}
        final = torch.load(out / "final-0.pt", weights_only=True)
        assert final["step"] == TOTAL_STEPS and not (out / "final-1.pt").exists()
    expected = run_reference(tmp_path / "reference")
    assert final["model"].keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(final["model"][name], value, atol=ATOL, rtol=RTOL, msg=name)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_an_hsdp_job_of_2_nodes_of_2_workers_reaches_the_parameters_of_a_ddp_run(tmp_path: Path) -> None:
    from tests.conftest import run_reporting_hangs, subprocess_env
    from tests.integration.test_session_elastic import ATOL, JOB, RTOL, TOTAL_STEPS, run_reference

    out = tmp_path / "hsdp"
    result = run_reporting_hangs(
        [sys.executable, "-m", "elastictrain", "run", "--local-nodes", "2", "--nproc-per-node", "2", "--min-nodes",
         "2", "--recovery", "restart", JOB, str(out), "--sharding", "hsdp"],
        timeout=250, env=subprocess_env(OMP_NUM_THREADS="1"), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    final = torch.load(out / "final-0.pt", weights_only=True)
    assert final["step"] == TOTAL_STEPS
    expected = run_reference(tmp_path / "reference")
    for name, value in expected.items():
        torch.testing.assert_close(final["model"][name], value, atol=ATOL, rtol=RTOL, msg=name)


class Net(torch.nn.Module):
    """Rows of 7 and 3 (uneven shares at 2-4 ranks), and a buffer counting the samples seen."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(5, 7)
        self.head = torch.nn.Linear(7, 3)
        self.register_buffer("seen", torch.zeros((), dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen += x.shape[0]
        return self.head(torch.tanh(self.embed(x)))


class StepCounter:
    """A hook: the steps it was told of."""

    def __init__(self) -> None:
        self.steps = 0

    def on_step_end(self, **_: Any) -> None:
        self.steps += 1


def _dataset() -> Any:
    from torch.utils.data import TensorDataset

    data = torch.Generator().manual_seed(5)
    return TensorDataset(torch.randn(30, 5, generator=data, dtype=torch.float64),
                         torch.randn(30, 3, generator=data, dtype=torch.float64))


def _train(sharding: str, group: Any, **options: Any) -> dict[str, Any]:
    """One session; returns rank 0's full tensors (``{}`` elsewhere) and what it saw."""
    import elastictrain
    from elastictrain.train.worker import WorkerContext

    torch.manual_seed(0)
    model = Net().double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1.0 + 0.3 * step))
    counter = StepCounter()
    context = dataclasses.replace(WorkerContext.from_env({}), local_world_size=2)  # hsdp: 2 ranks a node
    with elastictrain.Session(model, optimizer, _dataset(), global_batch_size=12, micro_batch_size=2, seed=3,
                              grad_clip_norm=0.5, log_every=None, scheduler=scheduler, hooks=[counter], epochs=2,
                              process_group=group, context=context, sharding=sharding, **options) as session:
        for step in session.steps():
            for micro in step:
                inputs, targets = micro.batch
                micro.backward(torch.nn.functional.mse_loss(session.model(inputs), targets))
        if sharding != "ddp":
            from torch.distributed.fsdp import FSDPModule

            assert isinstance(session.model, FSDPModule) and session.optimizer is optimizer
        full = session.full_state_dict()
        seen = model.seen.clone()
    assert counter.steps == session.step - (session.restored.step if session.restored else 0)
    return {"full": full, "step": session.step, "lr": scheduler.get_last_lr(), "seen": seen}


def _error(a: dict[str, Any], b: dict[str, Any]) -> float:
    assert a["step"] == b["step"] and a["lr"] == b["lr"] and list(a["full"]) == list(b["full"])
    return max((x - y).abs().max().item() for x, y in zip(a["full"].values(), b["full"].values(), strict=True))


def _worker(rank: int, out: Path) -> None:
    import torch.distributed as dist

    from tests.support.leave import leave_together

    torch.set_num_threads(1)  # one thread a rank, as OMP_NUM_THREADS=1 gave the ranks run as scripts
    dist.init_process_group("gloo", init_method=f"file://{out / 'store'}", rank=rank, world_size=WORLD)
    groups = {2: dist.new_group([0, 1]), 3: dist.new_group([0, 1, 2]), 4: dist.group.WORLD}
    checks: dict[str, float] = {}
    for sharding, world in (("fsdp", 2), ("fsdp", 3), ("hsdp", 4)):
        if rank < world:
            ddp, sharded = _train("ddp", groups[world]), _train(sharding, groups[world])
            if rank == 0:
                checks[f"{sharding}/{world}"] = max(_error(ddp, sharded), abs(float(ddp["seen"] - sharded["seen"])))
            if world == 2:  # bf16: FSDP2's policy beside the session's autocast, close to fp32 DDP
                bf16 = _train(sharding, groups[world], precision="bf16")
                if rank == 0:
                    checks["bf16_close"] = _error(ddp, bf16)
            # The buffers were broadcast from rank 0 after each step.
            seen = sharded["seen"].reshape(1)
            everyone = [torch.zeros(1, dtype=torch.float64) for _ in range(world)]
            dist.all_gather(everyone, seen, group=groups[world])
            assert all(torch.equal(s, everyone[0]) for s in everyone)

    # Saved at 4 ranks (2 steps, then the session's final save), restored at 3.
    ckpt = out / "ckpt"
    saved = _train("fsdp", groups[4], checkpoint_dir=str(ckpt), max_steps=2)
    if rank == 0:
        for copy in ("sharded", "ddp"):
            shutil.copytree(ckpt, out / copy)
    dist.barrier()
    if rank < 3:
        restored = _train("fsdp", groups[3], checkpoint_dir=str(ckpt), max_steps=2)
        on_sharded = _train("fsdp", groups[3], checkpoint_dir=str(out / "sharded"), max_steps=4)
        on_ddp = _train("ddp", groups[3], checkpoint_dir=str(out / "ddp"), max_steps=4)
        if rank == 0:
            checks["restored_4_to_3"] = _error(saved, restored)
            checks["trained_on_at_3"] = _error(on_ddp, on_sharded)
            assert on_sharded["step"] == 4
    if rank == 0:
        (out / "rank0.json").write_text(json.dumps(checks))
    leave_together()
