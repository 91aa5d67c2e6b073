"""Gradient accumulation with uneven shares equals a single-process full-batch step, at world sizes 1 to 3.

Three real processes on gloo form one default group (free-port TCPStore via
``MASTER_ADDR``/``MASTER_PORT``) and subgroups of sizes 1, 2 and 3; a Session
runs over each subgroup. Every optimizer step records the parameters and
gradients it saw; each rank then recomputes, in one process, the gradient of
the mean loss over the step's whole global batch and compares.

Run as a script, this module is the worker the test spawns.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from elastictrain._addresses import free_port
from tests.conftest import REPO_ROOT, subprocess_env
from tests.support.leave import leave_together

pytestmark = pytest.mark.timeout(180)

# (dataset size, global batch, micro-batch cap): shares and micro-batches are
# uneven (10 over 3 ranks is 4/3/3, cut 2+2, 2+1, 2+1), the last step of the
# epoch is short (22 = 10 + 10 + 2), and a global batch of 2 over 3 ranks
# leaves rank 2 an empty share that it pads with loss scale 0.
CASES = [(22, 10, 3), (24, 12, None), (22, 10, 2), (8, 2, None)]
WORLD_SIZES = (1, 2, 3)
# float64 throughout: the only difference from the reference is summation
# order, ~1e-16 relative; 1e-12 catches any mis-weighting (which is O(1e-2)).
TOLERANCE = 1e-12


def test_accumulated_uneven_micro_batches_match_the_full_batch_gradient_on_1_to_3_ranks(tmp_path: Path) -> None:
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, str(tmp_path)],
            env=subprocess_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank), WORLD_SIZE="3",
                               OMP_NUM_THREADS="1", PYTHONPATH=str(REPO_ROOT)),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for rank in range(3)
    ]
    try:
        outputs = [p.communicate(timeout=150)[0] for p in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert [p.returncode for p in procs] == [0, 0, 0], "\n".join(o[-3000:] for o in outputs)
    results = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(3)]
    checked = 0
    for result in results:
        for entry in result:
            assert entry["steps"] >= 1
            assert entry["max_error"] < TOLERANCE, entry
            checked += 1
    # Every (case, world size) pair was checked by each member rank.
    assert checked == len(CASES) * sum(WORLD_SIZES)
    # Padding happened where expected: rank 2 of 3 with a global batch of 2.
    padded = [e for e in results[2] if e["case"] == [8, 2, None] and e["world_size"] == 3]
    assert padded and padded[0]["padded"] > 0


class RecordingSGD(torch.optim.SGD):
    """SGD that keeps the parameters and gradients of every step."""

    def __init__(self, params: Any, lr: float) -> None:
        super().__init__(params, lr=lr)
        self.records: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        params = [p for group in self.param_groups for p in group["params"]]
        self.records.append(([p.detach().clone() for p in params], [p.grad.detach().clone() for p in params]))
        return super().step(closure)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 2)).double()


def _worker(out: Path) -> None:
    import torch.distributed as dist
    from torch.utils.data import TensorDataset

    import elastictrain
    from elastictrain.train.sampler import epoch_permutation

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    groups = {1: dist.new_group([0]), 2: dist.new_group([0, 1]), 3: dist.group.WORLD}
    results = []
    for n, global_batch, micro in CASES:
        data = torch.Generator().manual_seed(n)
        x = torch.randn(n, 5, generator=data, dtype=torch.float64)
        y = torch.randn(n, 2, generator=data, dtype=torch.float64)
        dataset = TensorDataset(x, y)
        for world_size in WORLD_SIZES:
            if rank >= world_size:
                continue
            model = _model()
            optimizer = RecordingSGD(model.parameters(), lr=0.1)
            padded = 0
            with elastictrain.Session(model, optimizer, dataset, global_batch_size=global_batch,
                                      micro_batch_size=micro, seed=3, log_every=None,
                                      process_group=groups[world_size]) as session:
                for step in session.steps():
                    for m in step:
                        inputs, targets = m.batch
                        padded += m.is_padding
                        m.backward(torch.nn.functional.mse_loss(session.model(inputs), targets))
            # The reference: one process, the step's whole global batch, one backward.
            perm = epoch_permutation(n, 3, 0)
            cursor, worst = 0, 0.0
            reference = _model()
            for params, grads in optimizer.records:
                batch = perm[cursor:cursor + global_batch]
                cursor += len(batch)
                with torch.no_grad():
                    for p, value in zip(reference.parameters(), params, strict=True):
                        p.copy_(value)
                reference.zero_grad()
                torch.nn.functional.mse_loss(reference(x[batch]), y[batch]).backward()
                for p, grad in zip(reference.parameters(), grads, strict=True):
                    worst = max(worst, (p.grad - grad).abs().max().item())
            assert cursor == n
            results.append({"case": [n, global_batch, micro], "world_size": world_size,
                            "steps": len(optimizer.records), "max_error": worst, "padded": padded})
    (out / f"rank{rank}.json").write_text(json.dumps(results))
    leave_together()


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))
