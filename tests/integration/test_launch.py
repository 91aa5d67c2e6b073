"""End-to-end launches: real agents, real workers on gloo, a real etcd."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO_ROOT, communicate_reporting_hangs, hang_reporting_env, run_reporting_hangs, subprocess_env

SCRIPT = str(REPO_ROOT / "tests" / "scripts" / "ddp_steps.py")


def elastictrain(*args: str, timeout: float = 95, **env: str) -> subprocess.CompletedProcess[str]:
    return run_reporting_hangs([sys.executable, "-m", "elastictrain", *args], timeout=timeout,
                               env=subprocess_env(**env), cwd=REPO_ROOT)


def read_ranks(out: Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(out.glob("rank-*.json"))]


@pytest.mark.parametrize("recovery", ["in-process", "restart"])
def test_workers_that_leave_through_os_exit_zero_end_their_node_with_success(tmp_path: Path, recovery: str) -> None:
    # They hand no return value back to torch's process context, which waited for it forever:
    # the node never ended (stock torchrun, which runs a script as a plain child, ends at once).
    script = tmp_path / "leave.py"
    script.write_text("import os\nprint('done', flush=True)\nos._exit(0)\n")
    result = elastictrain("run", "--recovery", recovery, "--nproc-per-node", "2", str(script), timeout=60)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("done") == 2
    assert "exited with code 0 without returning" in result.stderr


_WAIT_FOR_RELEASE = """
import os, pathlib, sys, time
out = pathlib.Path(sys.argv[1])
(out / f"start-{os.environ['TORCHELASTIC_RESTART_COUNT']}-{os.getpid()}").touch()
while not (out / "release").exists():
    time.sleep(0.05)
"""


def _start_waiting_worker(tmp_path: Path, *run_args: str) -> tuple[subprocess.Popen[str], Path, int, float]:
    """A one-node ``elastictrain run`` of a script that waits for ``out/release``; the node, ``out``,
    the pid of its first worker once started, and the deadline (60 s) the caller waits within."""
    script, out = tmp_path / "wait.py", tmp_path / "out"
    script.write_text(_WAIT_FOR_RELEASE)
    out.mkdir()
    node = subprocess.Popen([sys.executable, "-m", "elastictrain", "run", *run_args, str(script), str(out)],
                            env=subprocess_env(), cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.monotonic() + 60
    while not (started := list(out.glob("start-0-*"))) and time.monotonic() < deadline and node.poll() is None:
        time.sleep(0.05)
    if not started:
        node.kill()
        _, err = node.communicate()
        raise AssertionError(f"the worker did not start:\n{err[-3000:]}")
    return node, out, int(started[0].name.rsplit("-", 1)[1]), deadline


@pytest.mark.parametrize("recovery", ["in-process", "restart"])
def test_a_worker_killed_before_its_forkserver_reports_it_is_restarted_not_taken_as_finished(
        tmp_path: Path, recovery: str) -> None:
    # A SIGKILLed worker is a zombie until its forkserver reaps it and reports its exit; a node
    # that judged exits by the zombie took it for one that had finished, and ended the job with
    # success (on a GPU machine, at step 445 of 4000). The forkserver is stopped to hold that
    # window open for many of the agent's checks.
    from elastictrain._process import proc_stat

    node, out, worker, deadline = _start_waiting_worker(tmp_path, "--recovery", recovery, "--max-restarts", "1")
    forkserver = None
    try:
        forkserver = int(proc_stat(worker)[1])
        os.kill(forkserver, signal.SIGSTOP)
        os.kill(worker, signal.SIGKILL)
        while proc_stat(worker)[0] != "Z" and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(1.0)  # ten of the agent's checks, with the worker dead and not reported
        os.kill(forkserver, signal.SIGCONT)
        forkserver = None
        while not list(out.glob("start-1-*")) and node.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        (out / "release").touch()
        _, err = node.communicate(timeout=60)
    finally:
        if forkserver is not None:
            os.kill(forkserver, signal.SIGCONT)
        if node.poll() is None:
            node.kill()
            node.communicate()
    assert "taken as finished" not in err, err[-3000:]
    assert len(list(out.glob("start-1-*"))) == 1, err[-3000:]  # the killed worker was replaced
    assert node.returncode == 0, err[-3000:]
    assert "killed by SIGKILL" in err


@pytest.mark.parametrize("recovery", ["restart", "in-process"])
def test_an_agent_that_stops_a_stopped_worker_is_not_held_up_by_it(tmp_path: Path, recovery: str) -> None:
    # torch's agent stops its workers with SIGTERM and sends SIGKILL only after 30 s: a worker
    # stopped by SIGSTOP cannot act on SIGTERM until continued, and held its agent for those
    # 30 s (its peers formed a round without the node, which then forced another restart).
    from elastictrain._process import proc_stat

    node, _, worker, deadline = _start_waiting_worker(tmp_path, "--recovery", recovery)
    try:
        os.kill(worker, signal.SIGSTOP)
        while (proc_stat(worker) or ["?"])[0] != "T" and time.monotonic() < deadline:
            time.sleep(0.01)
        stopping = time.monotonic()
        node.send_signal(signal.SIGTERM)  # the agent stops its workers, then exits
        _, err = node.communicate(timeout=60)
        took = time.monotonic() - stopping
    finally:
        if node.poll() is None:
            node.kill()
            node.communicate()
        if _alive(worker):
            os.kill(worker, signal.SIGKILL)
    assert took < 10, f"the agent took {took:.1f}s to stop its stopped worker (torch waits 30 s):\n{err[-3000:]}"
    assert node.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert not _alive(worker), "the stopped worker outlived its agent"


def test_two_local_nodes_train_ddp_steps_and_exit_zero(tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = elastictrain("run", "--local-nodes", "2", SCRIPT, str(out))  # a 2-node job without node counts
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = read_ranks(out)
    assert [r["rank"] for r in ranks] == [0, 1]
    assert {r["world_size"] for r in ranks} == {2}
    assert sorted(r["group_rank"] for r in ranks) == [0, 1]
    assert ranks[0]["params"] == ranks[1]["params"]  # DDP kept replicas in sync
    assert "run 'local' finished" in result.stderr


@pytest.mark.parametrize("local_nodes", [None, "2"])
def test_sigterm_while_a_job_starts_stops_it_with_one_line_and_removes_the_private_etcd(
        tmp_path: Path, local_nodes: str | None) -> None:
    """Python's default for SIGTERM ended the process at once, before torch's agent installs its
    handler: no line, and the private etcd's data directory left behind."""
    nodes = ["--local-nodes", local_nodes] if local_nodes else []
    proc = subprocess.Popen([sys.executable, "-m", "elastictrain", "run", *nodes, SCRIPT, str(tmp_path / "out"),
                             "--steps", "100000"], env=subprocess_env(), cwd=tmp_path, stderr=subprocess.PIPE,
                            text=True)
    lines = []
    try:
        for line in proc.stderr:  # type: ignore[union-attr]
            lines.append(line)
            if "private etcd at" in line:
                break
        proc.send_signal(signal.SIGTERM)  # the node(s) are importing torch
        rest = proc.communicate(timeout=60)[1]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    err = "".join(lines) + rest
    data = next(line for line in lines if "started etcd" in line).rpartition("data ")[2].rstrip(")\n")
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert err.count("elastictrain: stopped by SIGTERM") == 1, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert not os.path.exists(data), err[-3000:]

def test_stock_torchrun_with_etcd3_backend_trains(etcd_server: Any, run_id: str, tmp_path: Path) -> None:
    out = tmp_path / "out"
    torchrun = [sys.executable, "-m", "torch.distributed.run"]
    common = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "etcd3",
              "--rdzv-endpoint", etcd_server.endpoint, "--rdzv-id", run_id, "--local-addr", "127.0.0.1",
              "--rdzv-conf", "last_call_timeout=1,keep_alive_interval=1",
              # torch keeps its logs, in /tmp/torchelastic_* by default
              "--log-dir", str(tmp_path / "torchrun-logs"), SCRIPT, str(out)]
    procs = [subprocess.Popen([*torchrun, *common], env=subprocess_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs[0][-2000:] + outputs[1][-2000:]
    ranks = read_ranks(out)
    assert [r["world_size"] for r in ranks] == [2, 2]
    assert ranks[0]["run_id"] == run_id


def test_failing_worker_exhausts_restarts_and_job_exits_with_its_code(tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = elastictrain("run", "--max-restarts", "1", SCRIPT, str(out), "--fail-rank", "0", "--fail-exit-code", "7")
    assert result.returncode == 7
    last = result.stderr.strip().splitlines()[-1]
    assert "rank 0 on " in last and "exited with code 7" in last and "1 restart" in last
    assert "restarting this node's workers: worker(s) 0 failed (0: pid " in result.stderr
    assert ", exit code 7)" in result.stderr
    assert sorted(p.name for p in out.glob("pid-0-*")) == ["pid-0-0", "pid-0-1"]


_REFUSED_INPUT = """
import os, pathlib, sys
from elastictrain import ElasticSampler
pathlib.Path(sys.argv[1], f"start-{os.getpid()}").touch()
ElasticSampler(1000, global_batch_size=0)  # refused: ConfigError
"""


@pytest.mark.parametrize("recovery", ["in-process", "restart"])
def test_a_worker_that_raises_config_error_fails_the_job_without_a_restart_or_traceback(
        tmp_path: Path, recovery: str) -> None:
    """A restart would refuse the same input again: the job fails at once, with the one line
    that says what was refused and where, and no restart budget (nor back-off) spent on it."""
    script = tmp_path / "refused.py"
    script.write_text(_REFUSED_INPUT)
    result = elastictrain("run", "--recovery", recovery, "--max-restarts", "3", str(script), str(tmp_path),
                          timeout=60)
    assert result.returncode == 1
    assert len(list(tmp_path.glob("start-*"))) == 1, result.stderr[-3000:]  # never restarted
    err = result.stderr
    last = err.strip().splitlines()[-1]
    assert "rank 0 on " in last and "failed: ConfigError: global_batch_size must be >= 1, got 0 (refused.py:5)" in last
    assert "job failed after 0 restart(s)" in last
    assert "rank 0 raised ConfigError: the job fails without a restart" in err
    assert "Traceback" not in err, err


_DIVERGES = """
import math, os, pathlib, sys
import torch
from torch.utils.data import TensorDataset
import elastictrain
pathlib.Path(sys.argv[1], f"start-{os.getpid()}").touch()
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
data = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
with elastictrain.Session(model, torch.optim.SGD(model.parameters(), lr=0.1), data, global_batch_size=8,
                          checkpoint_dir=sys.argv[2], checkpoint_every=2, epochs=3) as s:
    for step in s.steps():
        for micro in step:
            x, y = micro.batch
            scale = math.nan if step.number >= 5 else 1.0  # the loss diverges at step 5
            micro.backward(torch.nn.functional.mse_loss(s.model(x), y) * scale)
"""


@pytest.mark.parametrize("recovery", ["in-process", "restart"])
def test_a_diverged_job_fails_without_a_restart_and_keeps_its_good_checkpoints(
        tmp_path: Path, recovery: str) -> None:
    """Before, NaN steps were committed like any other and pushed the good checkpoints out,
    and the job exited 0 with NaN weights."""
    script, ckpt = tmp_path / "diverges.py", tmp_path / "ckpt"
    script.write_text(_DIVERGES)
    result = elastictrain("run", "--recovery", recovery, "--nproc-per-node", "2", "--max-restarts", "3",
                          str(script), str(tmp_path), str(ckpt), timeout=60)
    err = result.stderr
    assert result.returncode == 1, err[-3000:]
    assert len(list(tmp_path.glob("start-*"))) == 2, err[-3000:]  # never restarted
    last = err.strip().splitlines()[-1]
    assert "failed: NonFiniteStateError:" in last and "holds NaN or infinity (training diverged)" in last, last
    assert "job failed after 0 restart(s)" in last
    assert "Traceback" not in err, err[-3000:]
    assert sorted(p.name for p in ckpt.iterdir() if not p.name.startswith(".")) == ["step_00000002", "step_00000004"]

_RANKS_DISAGREE = """
import os, sys
import torch
from torch.utils.data import TensorDataset
import elastictrain
rank = int(os.environ["RANK"])
model = torch.nn.Linear(4, 1)
data = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
with elastictrain.Session(model, torch.optim.SGD(model.parameters(), lr=0.1), data, global_batch_size=8,
                          max_steps=3 if rank == 0 else 2) as s:  # rank 1 would leave rank 0 waiting
    for step in s.steps():
        for micro in step:
            x, y = micro.batch
            micro.backward(torch.nn.functional.mse_loss(s.model(x), y))
"""


@pytest.mark.parametrize("recovery", ["in-process", "restart"])
def test_ranks_given_different_settings_fail_the_job_at_once(tmp_path: Path, recovery: str) -> None:
    """Before, rank 1 finished after 2 steps and rank 0 waited for it in its third, for ever
    (in-process: re-forming without it, then waiting again)."""
    script = tmp_path / "disagree.py"
    script.write_text(_RANKS_DISAGREE)
    result = elastictrain("run", "--recovery", recovery, "--nproc-per-node", "2", str(script), timeout=60)
    err = result.stderr
    assert result.returncode == 1, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert "failed: ConfigError: ranks disagree on max_steps (rank 0: 3, rank 1: 2)" in last, last
    assert "job failed after 0 restart(s)" in last and "Traceback" not in err

def test_a_raising_rank_is_reported_once_root_cause_first(tmp_path: Path) -> None:
    # A short TMPDIR of its own: multiprocessing's forkserver socket lives there, and a unix
    # socket path may not exceed 107 bytes (pytest-xdist's tmp_path is already long).
    temp = Path(tempfile.mkdtemp(prefix="et-", dir="/tmp"))
    try:
        result = elastictrain("run", "--local-nodes", "2", "--min-nodes", "2", "--max-restarts", "0", SCRIPT,
                              str(tmp_path / "out"), "--steps", "50", "--raise-rank", "1", TMPDIR=str(temp))
        # No torchelastic_* log dirs, pytorch-errorfile-*, pymp-*, elastictrain-node-* left behind
        # (torch's compiler cache, torchinductor_<user>, is meant to stay).
        left = sorted(p.name for p in temp.iterdir() if not p.name.startswith("torchinductor_"))
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    assert result.returncode == 1
    assert left == [], result.stderr[-2000:]
    err = result.stderr
    last = err.strip().splitlines()[-1]
    assert "rank 1 on node" in last and "failed: ValueError: bad batch 1234 in shard 7 (ddp_steps.py:" in last
    assert "job failed after 0 restart(s)" in last
    assert err.count("Traceback (most recent call last)") == 1, err  # the root cause's, once
    assert err.count("ValueError: bad batch") == 2  # in the traceback and in the one line
    assert "'message'" not in err and "GLHF" not in err and "Connection closed" not in err, err
    assert "_worker_boot" not in err and "ProcessRaisedException" not in err


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purpose (it no longer runs).
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_worker_dies_when_its_agent_is_killed(etcd_server: Any, run_id: str, tmp_path: Path) -> None:
    out = tmp_path / "out"
    agent = subprocess.Popen(
        [sys.executable, "-m", "elastictrain", "run", "--etcd", etcd_server.endpoint, "--run-id", run_id,
         SCRIPT, str(out), "--sleep", "60"],
        env=subprocess_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    pid_file = out / "pid-0-0"
    deadline = time.monotonic() + 60
    while not pid_file.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    worker = int(pid_file.read_text())
    assert _alive(worker)
    agent.send_signal(signal.SIGKILL)
    agent.wait()
    deadline = time.monotonic() + 10
    while _alive(worker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(worker), "the worker outlived its SIGKILLed agent"


def test_etcd_subcommand_stopped_the_moment_it_says_it_serves_exits_cleanly(tmp_path: Path) -> None:
    # A supervisor may send SIGTERM as soon as it reads "serving at"; the handler was installed
    # only after a second line, and such a SIGTERM killed it (-15) with etcd's data unflushed.
    from elastictrain.etcd.server import free_port

    proc = subprocess.Popen(
        [sys.executable, "-m", "elastictrain", "etcd", "--port", str(free_port()), "--data-dir", str(tmp_path / "d")],
        env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    assert proc.stdout is not None
    assert "etcd serving at" in proc.stdout.readline()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0


def test_etcd_subcommand_serves_until_sigterm(tmp_path: Path) -> None:
    from elastictrain.etcd.server import free_port
    from tests.conftest import make_client

    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "elastictrain", "etcd", "--port", str(port), "--data-dir", str(tmp_path / "d")],
        env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    assert proc.stdout is not None
    lines = [proc.stdout.readline() for _ in range(2)]
    assert any(f"etcd serving at 127.0.0.1:{port}" in line for line in lines), lines
    client = make_client(f"127.0.0.1:{port}")
    client.call(lambda c: c.put("/probe", "1"))
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    with pytest.raises(Exception):
        make_client(f"127.0.0.1:{port}", retry_deadline=0.5).call(lambda c: c.get("/probe"))


def test_torchrun_spellings_run_a_module_with_prefixed_output_titles_and_a_rank_filter(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    result = elastictrain("run", "--nproc_per_node", "2", "--local-ranks-filter", "1", "--log_dir", str(logs),
                          "--role", "probe", "-m", "tests.scripts.print_probe", "--flag")
    assert result.returncode == 0, result.stderr[-3000:]
    shown = [line for line in result.stdout.splitlines() if "probe rank=" in line]
    # Rank 1 on the terminal with a [node rank] prefix, its title naming the module; rank 0 only in its file.
    assert len(shown) == 1 and shown[0].startswith(f"[{socket.gethostname()} 1] probe rank=1 role=probe"), shown
    assert "argv=['--flag']" in shown[0] and "title=elastictrain worker rank 1: tests.scripts.print_probe --flag" \
        in shown[0]
    rank0 = [p.read_text() for p in logs.glob("local_rank_0/**/stdout.log")]
    assert len(rank0) == 1 and "probe rank=0" in rank0[0] and not rank0[0].startswith("[")


def test_no_python_runs_a_program(tmp_path: Path) -> None:
    result = elastictrain("run", "--no-python", "sh", "-c", "echo from-$RANK; exit 5")
    assert result.returncode == 5 and "from-0" in result.stdout
    assert "rank 0 on " in result.stderr and "exited with code 5" in result.stderr


INPROCESS_JOB = str(REPO_ROOT / "tests" / "scripts" / "inprocess_job.py")


def _child_with(parent: int, word: str) -> int:
    """The pid of ``parent``'s child whose command line has ``word`` (a local node by its name)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (stat.parent / "cmdline").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == parent and word.encode() in cmdline:
            return int(stat.parent.name)
    raise AssertionError(f"no child of {parent} with {word!r} in its command line")


@pytest.mark.timeout(200)
def test_a_local_job_that_finished_after_a_node_agent_was_killed_exits_zero_and_says_why(tmp_path: Path) -> None:
    """Issue 43: 3 local nodes, one node's agent SIGKILLed mid-run, the other two train to the end:
    the job finished, so the command exits 0 (it exited 137, the killed node's code, without a word)."""
    out, release = tmp_path / "out", tmp_path / "release"
    out.mkdir()
    launcher = subprocess.Popen(
        [sys.executable, "-m", "elastictrain", "run", "--local-nodes", "3", "--min-nodes", "2", "--max-nodes", "3",
         INPROCESS_JOB, str(out), "--steps", "12", "--hold-before", f"5:{release}"],
        env=hang_reporting_env(subprocess_env(OMP_NUM_THREADS="1")), cwd=tmp_path, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while len(list(tmp_path.glob("release.held-*"))) < 3:  # every rank waits inside step 5
        assert launcher.poll() is None and time.monotonic() < deadline, "the job never reached step 5"
        time.sleep(0.1)
    os.kill(_child_with(launcher.pid, "node2"), signal.SIGKILL)
    release.touch()
    [(_, err)] = communicate_reporting_hangs([launcher], timeout=150)
    assert launcher.returncode == 0, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert "job finished (exit code 0)" in last and "node2" in last and "SIGKILL" in last, err[-3000:]
    # The killed agent's workers held their semaphores by then, and their names were gone: its resource
    # tracker found none to clean up ('There appear to be 7 leaked semaphore objects').
    assert "leaked semaphore" not in err, err[-3000:]
    # The survivors name the lost node as its own lines did, with its address (not 127.0.0.1_5995_154fbb).
    # And with its node rank in the round it left (names stay, node ranks change: a line says both).
    assert re.search(r"node\(s\) left: node2@127\.0\.0\.1 \(node rank \d, pid ", err), err[-3000:]
    steps = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    assert max(s["step"] for s in steps) == 12 and steps[-1]["world"] == 2


_LEAVES_ONCE = """
import os, pathlib, sys, time
import torch, torch.distributed as dist
marker = pathlib.Path(sys.argv[1])
dist.init_process_group("gloo")
for step in range(20):
    if step == 5 and dist.get_rank() == 1 and not marker.exists():
        marker.touch()
        dist.destroy_process_group()  # rank 0's all_reduce fails now, long before this worker ends
        time.sleep(3)
        raise RuntimeError("raised once, on rank 1")
    dist.all_reduce(torch.ones(1))
    time.sleep(0.05)
dist.destroy_process_group()
"""


@pytest.mark.timeout(150)
@pytest.mark.parametrize("recovery", ["restart", "in-process"])
def test_a_peers_failure_spends_no_budget_of_the_node_it_broke(tmp_path: Path, recovery: str) -> None:
    """Issue 43: a plain script; rank 0's worker failed only because rank 1 went away, and its
    node's restart budget was spent for it ('failure 2 of 3 in the window'). Rank 1 closes its
    connections seconds before it fails, so that rank 0's failure is seen first, every time."""
    script = tmp_path / "leaves_once.py"
    script.write_text(_LEAVES_ONCE)
    result = run_reporting_hangs(
        [sys.executable, "-m", "elastictrain", "run", "--local-nodes", "2", "--recovery", recovery,
         "--max-restarts", "1", str(script), str(tmp_path / "left")],
        timeout=120, env=subprocess_env(OMP_NUM_THREADS="1"), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    events = [json.loads(line) for line in (tmp_path / "elastictrain-runs" / "local" / "events.jsonl").open()]
    rendezvous = [e for e in events if e["kind"] == "rendezvous"]
    rank_0_node = next(e["pid"] for e in rendezvous if e["round"] == 0 and e["group_rank"] == 0)
    failed = [e for e in events if e["kind"] == "worker_failure" and e["pid"] == rank_0_node]
    assert failed, events  # rank 0's worker failed (a peer's failure), not stopped for a membership change
    assert [e["restarts"] for e in rendezvous if e["pid"] == rank_0_node][-1] == 0, events
    assert "because a peer's failure broke its collectives: not this node's own failure" in result.stderr
