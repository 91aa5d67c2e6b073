"""Restart mode (``--recovery restart``): a session job resized 2 -> 3 -> 2 by real node agents
trains like an uninterrupted one.

In-process recovery (the default) has its own tests in test_inprocess_recovery.py.

The job (tests/scripts/session_job.py) holds at known steps, so the test
changes membership while it waits: a node joins after step 10 (the last
checkpoint is step 8, so steps 9-10 are redone at world size 3), and that node
is SIGKILLed after step 18 (checkpoint 16; steps 17-18 are redone at world size 2).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from elastictrain._addresses import free_port
from tests.conftest import REPO_ROOT, subprocess_env

JOB = str(REPO_ROOT / "tests" / "scripts" / "session_job.py")
TOTAL_STEPS = 24  # 2 epochs of 384 samples at a global batch of 32

# Same global batch, same micro-batch cap, different world sizes: the gradient
# is the same sum of per-sample terms, added in another order (micro-batch
# means over 8 or 5-6 samples, then DDP's all-reduce over 2 or 3 ranks).
# float32 addition is not associative, so each step differs by a few ulps, and
# 24 steps of SGD with momentum carry that along; the largest difference seen
# is 3e-8 on parameters of size ~0.3. ATOL 1e-5 leaves 300x headroom and is
# still ~100x below one step's update, so a lost, repeated or mis-weighted step
# (or a wrong learning-rate schedule after restore) fails it.
ATOL, RTOL = 1e-5, 1e-4


def _wait_for(predicate: Callable[[], bool], what: str, procs: list[subprocess.Popen[str]], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        for proc in procs:
            if proc.poll() is not None:
                raise AssertionError(f"a node exited with {proc.returncode} while waiting for {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def _progress(out: Path) -> dict[str, Any] | None:
    try:
        return json.loads((out / "progress.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def _holding_at(out: Path, step: int, world_size: int) -> Callable[[], bool]:
    def check() -> bool:
        p = _progress(out)
        return p is not None and p["holding"] and (p["step"], p["world_size"]) == (step, world_size)
    return check


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def run_reference(out: Path) -> dict[str, torch.Tensor]:
    """World size 2, uninterrupted, started the way torchrun would (plain env, no agent)."""
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, JOB, str(out)],
            env=subprocess_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank), WORLD_SIZE="2",
                               LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", OMP_NUM_THREADS="1"),
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=out.parent,
        )
        for rank in range(2)
    ]
    try:
        errors = [p.communicate(timeout=90)[1] for p in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert [p.returncode for p in procs] == [0, 0], errors[0][-2000:] + errors[1][-2000:]
    final = torch.load(out / "final-0.pt", weights_only=True)
    assert final["step"] == TOTAL_STEPS
    return final["model"]


class ElasticRun:
    """The resized job's outputs: where it wrote, and each node's stderr."""

    def __init__(self, out: Path, logs: list[str]) -> None:
        self.out, self.logs = out, logs


def resized_run(etcd_endpoint: str, out: Path, *job_args: str) -> Iterator[ElasticRun]:
    """Run session_job.py (with ``job_args``) on 2 node agents, join a third once it holds at step
    10, kill it once the job holds at step 18; yields once the job has ended."""
    run_id = f"session-{os.getpid()}-{time.monotonic_ns() % 10**6}"
    node = [sys.executable, "-m", "elastictrain", "run", "--etcd", etcd_endpoint, "--run-id", run_id,
            "--min-nodes", "2", "--max-nodes", "3", "--local-addr", "127.0.0.1", "--recovery", "restart",
            JOB, str(out), "--hold", "10:2", "--hold", "18:3", *job_args]
    env = subprocess_env(OMP_NUM_THREADS="1")
    logs_dir = out / "logs"
    logs_dir.mkdir()
    procs: list[subprocess.Popen[str]] = []

    def start(name: str, *extra: str) -> subprocess.Popen[str]:
        log = open(logs_dir / f"{name}.log", "w")  # noqa: SIM115 - closed with the process below
        cmd = [*node[:4], *extra, *node[4:]]
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True, cwd=out)
        procs.append(proc)
        return proc

    try:
        start("a"), start("b")
        _wait_for(_holding_at(out, 10, 2), "step 10 at world size 2", procs, 90)
        joiner = start("c", "--join")  # the run id is live: joining it must be explicit
        _wait_for(_holding_at(out, 18, 3), "step 18 at world size 3", procs, 90)
        joiner.send_signal(signal.SIGKILL)
        joiner.wait()
        procs.remove(joiner)
        codes = [p.wait(timeout=90) for p in procs]
        logs = [(logs_dir / f"{n}.log").read_text() for n in ("a", "b", "c")]
        assert codes == [0, 0], "\n".join(log[-3000:] for log in logs)
        yield ElasticRun(out, logs)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.fixture(scope="module")
def elastic_run(etcd_server: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ElasticRun]:
    yield from resized_run(etcd_server.endpoint, tmp_path_factory.mktemp("elastic"))


@pytest.mark.timeout(180)
def test_job_resized_2_3_2_reaches_the_parameters_of_an_uninterrupted_run(
    elastic_run: ElasticRun, tmp_path: Path
) -> None:
    out = elastic_run.out
    segments = _lines(out / "segments.jsonl")
    assert [(s["world_size"], s["restored_step"]) for s in segments] == [(2, None), (3, 8), (2, 16)]
    changes = [(e["old"], e["new"]) for e in _lines(out / "events.jsonl") if e["event"] == "on_world_change"]
    assert changes == [(2, 3), (3, 2)]

    final = torch.load(out / "final-0.pt", weights_only=True)
    assert final["step"] == TOTAL_STEPS
    # The replicas agree bit for bit: restored, then broadcast by DDP, then in lockstep.
    other = torch.load(out / "final-1.pt", weights_only=True)["model"]
    assert all(torch.equal(final["model"][k], other[k]) for k in other)
    expected = run_reference(tmp_path / "reference")
    assert final["model"].keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(final["model"][name], value, atol=ATOL, rtol=RTOL, msg=name)
    # And the run really moved: the check is not vacuous.
    assert not torch.allclose(expected["0.weight"], _initial_first_layer(), atol=1e-3)


def _initial_first_layer() -> torch.Tensor:
    torch.manual_seed(0)
    return torch.nn.Linear(16, 32).weight.detach()


_PREFIX = re.compile(r"\[run=(\S+) node=(\d+) rank=(\d+)/(\d+) restart=(\d+)\] worker started")


@pytest.mark.timeout(180)
def test_log_prefix_names_node_rank_and_world_size_of_every_round(elastic_run: ElasticRun) -> None:
    # "worker started" is logged on every rank (all_ranks=True) by session_job.py,
    # once per round: nodes a and b train at 2, 3 (c joined), 2 (c killed); c at 3.
    rounds = {name: [m.groups() for m in _PREFIX.finditer(log)] for name, log in zip("abc", elastic_run.logs)}
    assert {run_id for r in rounds.values() for run_id, *_ in r} == {rounds["a"][0][0]}
    worlds = {name: [int(world) for _, _, _, world, _ in r] for name, r in rounds.items()}
    assert worlds == {"a": [2, 3, 2], "b": [2, 3, 2], "c": [3]}, rounds
    # One worker per node: its rank is its node's rank. c joined last, so it is node 2.
    assert all(node == rank for r in rounds.values() for _, node, rank, _, _ in r), rounds
    assert {node for _, node, *_ in rounds["c"]} == {"2"}
    for i in range(3):
        assert sorted(rounds[n][i][1] for n in "ab") == ["0", "1"], rounds
    # The restart count is torch's agent's: 0 at first; a membership change restarts
    # without counting, unless the node's worker had already failed (its peer's
    # restart broke the collective) before its agent saw the change: +1.
    for name, r in rounds.items():
        restarts = [int(restart) for *_, restart in r]
        assert restarts[0] == 0 and all(b - a in (0, 1) for a, b in zip(restarts, restarts[1:])), rounds


@pytest.mark.timeout(120)
def test_a_failed_worker_destroys_its_group_and_restarts_with_the_count_in_its_log_prefix(tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, "-m", "elastictrain", "run", "--nproc-per-node", "2", "--max-restarts", "1",
         "--recovery", "restart", JOB, str(out), "--epochs", "1", "--fail", "1:3"],
        capture_output=True, text=True, timeout=110, env=subprocess_env(OMP_NUM_THREADS="1"), cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    # Rank 1 raised; rank 0 then failed in the all-reduce its peer left. Both
    # sessions destroyed their process group on the way out.
    for rank in (0, 1):
        failed = json.loads((out / f"failed-{rank}-0.json").read_text())
        assert failed["pg_initialized"] is False
    assert "injected failure on rank 1" in json.loads((out / "failed-1-0.json").read_text())["error"]
    started = [line for line in result.stderr.splitlines() if "worker started" in line]
    assert sum("rank=0/2 restart=0]" in line for line in started) == 1
    assert sum("rank=0/2 restart=1]" in line for line in started) == 1
    assert sum("rank=1/2 restart=1]" in line for line in started) == 1
    assert torch.load(out / "final-0.pt", weights_only=True)["step"] == 12
