"""Helpers shared by the benchmarks: statistics, machine facts, launched jobs, etcd metrics.

Nothing here measures anything by itself. :class:`Proc` starts one launcher process
(an ``elastictrain run`` or ``torchrun`` agent) in its own session, timestamps every
line it writes to stderr as it arrives, and stops it; :class:`EventLog` follows the
JSON-lines file that ``benchmarks/_train.py`` appends to.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, NoReturn

from elastictrain.etcd.server import free_port  # noqa: F401 - the benchmarks' servers take their ports here

ROOT = Path(__file__).resolve().parent.parent
BENCH_DIR = ROOT / "benchmarks"
BIN_DIR = Path(sys.executable).parent
TRIAL_ENV = "BENCH_TRIAL"
NODE_ENV = "BENCH_NODE"


def summarize(samples: Iterable[float | None]) -> dict[str, Any]:
    """Median, min and max of the samples that are not None; ``failed`` counts the Nones."""
    values = list(samples)
    ok = [v for v in values if v is not None]
    out: dict[str, Any] = {"n": len(ok), "failed": len(values) - len(ok), "samples": ok}
    if ok:
        out.update(median=statistics.median(ok), min=min(ok), max=max(ok))
    else:
        out.update(median=None, min=None, max=None)
    return out


def ratio(numerator: dict[str, Any] | None, denominator: dict[str, Any] | None) -> float | None:
    """Ratio of two summaries' medians, None when either is missing or zero."""
    if not numerator or not denominator:
        return None
    a, b = numerator.get("median"), denominator.get("median")
    if a is None or not b:
        return None
    return a / b


def machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    model = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        import torch

        torch_version = torch.__version__
    except ImportError:  # pragma: no cover - the benchmarks need torch anyway
        torch_version = "missing"
    try:
        load = os.getloadavg()
    except OSError:
        load = (float("nan"),) * 3
    return {
        "nproc": os.cpu_count(),
        "cpu_model": model,
        "torch": torch_version,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "loadavg_1_5_15": [round(x, 2) for x in load],
    }


def run_gloo_workers(script: str, world: int, options: dict[str, Any]) -> Any:
    """Run ``script --worker RANK STORE OPTIONS`` as the ``world`` ranks of one gloo job (a file
    store in a temporary directory; ``OPTIONS`` is ``options`` as JSON, with ``"result"``: the
    path a worker writes its JSON result to) and return that result. Exits with a message if a
    worker fails."""
    with tempfile.TemporaryDirectory() as tmp:
        options = {**options, "result": str(Path(tmp) / "result.json")}
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        procs = [subprocess.Popen([sys.executable, script, "--worker", str(rank), str(Path(tmp) / "store"),
                                   json.dumps(options)], env=env) for rank in range(world)]
        codes = [p.wait() for p in procs]
        if codes != [0] * world:
            sys.exit(f"a worker failed: exit codes {codes}")
        return json.loads(Path(options["result"]).read_text())


def finish_gloo_worker(rank: int, result: Any, path: str) -> NoReturn:
    """End a rank of a :func:`run_gloo_workers` job: rank 0 writes ``result`` (JSON) to ``path``;
    every rank waits for the others and exits 0 without torch's teardown of the gloo groups (see
    ``tests/support/leave.py``)."""
    import torch.distributed as dist

    if rank == 0:
        Path(path).write_text(json.dumps(result))
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)


def layer_width(mb: float, layers: int) -> int:
    """The width of ``layers`` square float32 layers holding ``mb`` MB of weights."""
    return max(8, int((mb * 1e6 / 4 / layers) ** 0.5))


def add_step_options(parser: argparse.ArgumentParser, *, layers: int, out: Path) -> None:
    """The options of a script that times steps of a model of ``--layers`` square layers holding
    ``--mb`` MB of float32 parameters: ``--steps`` after ``--warmup``, ``--reps`` times."""
    parser.add_argument("--mb", type=float, default=100.0, help="MB of float32 parameters (AdamW adds twice that)")
    parser.add_argument("--layers", type=int, default=layers)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=out)


def worker_or_main(worker: Callable[[int, str, dict[str, Any]], None], main: Callable[[], Any]) -> None:
    """The entry point of a script that :func:`run_gloo_workers` runs: ``--worker RANK STORE OPTIONS``
    runs ``worker`` (a rank of the job), anything else the script's ``main``."""
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(int(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4]))
    else:
        main()


def wait_until(predicate: Callable[[], Any], timeout: float, poll: float = 0.02) -> Any:
    """Poll ``predicate`` until it returns something truthy (returned) or ``timeout`` passes (None)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            return None
        time.sleep(poll)


class Proc:
    """One launcher process in its own session; its stderr lines are kept with arrival times.

    Args:
        cmd: The command.
        env: Its environment (the driver adds ``BENCH_TRIAL``/``BENCH_NODE`` so that
            every process it starts, workers included, can be found again by id).
        log_path: Where the timestamped stderr goes as well.
        cwd: Its working directory (launchers write run files there).
    """

    def __init__(self, cmd: list[str], env: dict[str, str], log_path: Path, cwd: Path = ROOT) -> None:
        self.cmd = cmd
        self.started = time.time()
        self.lines: list[tuple[float, str]] = []
        self._log = open(log_path, "w")  # noqa: SIM115 - closed by the reader thread
        self.popen = subprocess.Popen(
            cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            text=True, errors="replace", start_new_session=True, cwd=cwd,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.popen.stderr is not None
        try:
            for line in self.popen.stderr:
                now = time.time()
                self.lines.append((now, line.rstrip("\n")))
                self._log.write(f"{now:.3f} {line}")
        finally:
            self._log.close()

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def first_line(self, pattern: str | re.Pattern[str], after: float = 0.0) -> tuple[float, re.Match[str]] | None:
        """The first stderr line after ``after`` matching ``pattern``: (arrival time, match)."""
        regex = re.compile(pattern) if isinstance(pattern, str) else pattern
        for t, line in list(self.lines):
            if t >= after:
                m = regex.search(line)
                if m:
                    return t, m
        return None

    def stop(self, grace: float = 15.0) -> None:
        """SIGTERM the launcher (it stops its workers), SIGKILL it after ``grace`` seconds."""
        if self.alive():
            try:
                os.kill(self.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.popen.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                os.kill(self.pid, signal.SIGKILL)
                self.popen.wait()
        self._reader.join(timeout=5)


def processes_of(trial: str, node: str | None = None) -> list[int]:
    """Pids of live processes this driver started for ``trial`` (and ``node``), by their environment.

    Every process of a trial (agents, forkservers, workers) inherits ``BENCH_TRIAL``;
    reading ``/proc/PID/environ`` only succeeds for our own processes.
    """
    wanted = [f"{TRIAL_ENV}={trial}".encode()]
    if node is not None:
        wanted.append(f"{NODE_ENV}={node}".encode())
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if all(w in environ for w in wanted):
            found.append(int(entry))
    return found


def kill_pids(pids: Iterable[int], sig: int = signal.SIGKILL) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


class EventLog:
    """Follows the JSON-lines file of ``_train.py`` (every rank appends to it)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.events: list[dict[str, Any]] = []
        self._offset = 0
        self._partial = b""

    def poll(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return self.events
        self._offset += len(data)
        data = self._partial + data
        *lines, self._partial = data.split(b"\n")
        for line in lines:
            if line.strip():
                self.events.append(json.loads(line))
        return self.events

    def steps(self) -> list[dict[str, Any]]:
        return [e for e in self.poll() if e["event"] == "step"]


def scrape_metrics(endpoint: str) -> dict[str, float]:
    """etcd's Prometheus metrics as ``{"name{labels}": value}`` (comments dropped)."""
    with urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=5) as response:
        text = response.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        try:
            out[key] = float(value)
        except ValueError:
            continue
    return out


_METHOD = re.compile(r'grpc_method="([^"]+)"')


def metrics_delta(before: dict[str, float], after: dict[str, float], seconds: float) -> dict[str, Any]:
    """What a workload put on etcd between two scrapes: requests and bytes, totals and per second.

    A request is one gRPC message received by etcd (``grpc_server_msg_received_total``):
    a unary call (Range, Txn, Put...) is one, and so is every message on a stream
    (each lease keep-alive, each watch create/cancel).
    """

    def total(name: str, snapshot: dict[str, float]) -> float:
        return sum(v for k, v in snapshot.items() if k == name or k.startswith(name + "{"))

    def delta(name: str) -> float:
        return total(name, after) - total(name, before)

    by_method: dict[str, float] = {}
    for key, value in after.items():
        if key.startswith("grpc_server_msg_received_total{"):
            m = _METHOD.search(key)
            if m:
                by_method[m.group(1)] = by_method.get(m.group(1), 0.0) + value - before.get(key, 0.0)
    seconds = max(seconds, 1e-9)
    requests = delta("grpc_server_msg_received_total")
    received = delta("etcd_network_client_grpc_received_bytes_total")
    sent = delta("etcd_network_client_grpc_sent_bytes_total")
    return {
        "seconds": seconds,
        "requests": requests,
        "requests_per_s": requests / seconds,
        "received_bytes": received,
        "received_bytes_per_s": received / seconds,
        "sent_bytes": sent,
        "sent_bytes_per_s": sent / seconds,
        "writes": delta("etcd_mvcc_put_total") + delta("etcd_mvcc_delete_total"),
        "txns": delta("etcd_mvcc_txn_total"),
        "ranges": delta("etcd_mvcc_range_total"),
        "proposals": delta("etcd_server_proposals_committed_total"),
        "requests_by_method": {k: v for k, v in sorted(by_method.items()) if v},
        "db_size_bytes": after.get("etcd_mvcc_db_total_size_in_bytes"),
        "keys": after.get("etcd_debugging_mvcc_keys_total"),
    }


def emit(record: dict[str, Any], out: Path | None) -> None:
    """Print the benchmark's one JSON line, and write it to ``out``."""
    line = json.dumps(record, sort_keys=True, default=str)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(line + "\n")
    print(line, flush=True)


def emit_with_table(record: dict[str, Any], table: str, out: Path | None) -> None:
    """:func:`emit` ``record`` with its markdown ``table`` in it (``table_md``), print the table on
    stderr, and write it beside ``out`` (``.md``)."""
    record["table_md"] = table
    emit(record, out)
    print("\n" + table, file=sys.stderr, flush=True)
    if out is not None:
        out.with_suffix(".md").write_text(table + "\n")
