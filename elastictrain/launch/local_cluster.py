"""Several node agents on one machine: ``elastictrain run --local-nodes N``.

Each node is a separate ``elastictrain run`` process with its own agent, exactly
as on separate hosts, so a multi-node job (and its failures) can be seen and
tested on one machine. The launcher waits for every node, forwards Ctrl-C and
SIGTERM to them, and exits with the first non-zero node exit code.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence

from elastictrain.launch import failure_report
from elastictrain._process import dying_with_us

logger = logging.getLogger(__name__)

__all__ = ["run_local_nodes"]


def run_local_nodes(count: int, node_args: Sequence[str], *, grace_seconds: float = 30.0,
                    per_node: Callable[[int], list[str]] | None = None, log_dir: str | None = None) -> int:
    """Start ``count`` node agents with ``elastictrain run <node_args>`` and wait for all.

    Args:
        count: Number of node processes.
        node_args: Arguments of ``elastictrain run`` for each node (no ``--local-nodes``).
        grace_seconds: After a signal, how long nodes get to stop before SIGKILL.
        per_node: Flags of node ``i`` alone (put before ``node_args``), e.g. its metrics port.
        log_dir: Where the nodes write their log files (``node0.log``, ...), named once here.

    Returns:
        0 if every node exited 0, else the first non-zero exit code seen.
    """
    procs: list[subprocess.Popen[bytes]] = []
    received: list[int] = []
    outcomes = tempfile.mkdtemp(prefix="elastictrain-outcomes-")

    def forward(signum: int, _frame: object) -> None:
        received.append(signum)
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        for index in range(count):
            own = per_node(index) if per_node else []
            cmd = [sys.executable, "-m", "elastictrain", "run", "--node-name", f"node{index}", *own, *node_args]
            env = {**os.environ, failure_report.OUTCOME_FILE_ENV: os.path.join(outcomes, f"node{index}.json")}
            # A node outlives neither this launcher nor, through its own agent, its workers.
            procs.append(subprocess.Popen(dying_with_us(cmd), env=env))
        logs = f"; their logs (torch's own lines too; -v shows them here): {log_dir}/node*.log" if log_dir else ""
        logger.info("started %d local nodes: pids %s%s", count, [p.pid for p in procs], logs)
        first_failure = 0
        pending = list(procs)
        signalled_at: float | None = None
        while pending:
            for proc in list(pending):
                code = proc.poll()
                if code is not None:
                    pending.remove(proc)
                    if code != 0 and first_failure == 0:
                        first_failure = code if code > 0 else 128 - code
            if received and signalled_at is None:
                signalled_at = time.monotonic()
            if signalled_at is not None and time.monotonic() - signalled_at > grace_seconds:
                for proc in pending:
                    proc.kill()
            time.sleep(0.05)
        if received:  # said once here, not by each node
            print(f"elastictrain: stopped by {signal.Signals(received[0]).name}; the {count} local nodes were "
                  "stopped", file=sys.stderr, flush=True)
            return 128 + received[0]
        if first_failure:
            first_failure = _report(outcomes, count, first_failure)
        return first_failure
    finally:
        shutil.rmtree(outcomes, ignore_errors=True)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _report(outcomes: str, count: int, first_failure: int) -> int:
    """Report a failed job once, for all its nodes: the root cause's traceback and one line.

    Returns:
        The job's exit code: the root-cause worker's, else the first failed node's.
    """
    found = [failure_report.read_outcome(os.path.join(outcomes, f"node{i}.json")) for i in range(count)]
    nodes = [o for o in found if o is not None]
    failures = [f for o in nodes for f in o["failures"]]
    root = failure_report.root_cause(failures)
    if root is not None:
        restarts = next(o["restarts"] for o in nodes if root in o["failures"])
        text = failure_report.report(failures, restarts)
        head, _, last = text.rpartition("\n")
        if head:
            print(head, file=sys.stderr, flush=True)
        logger.error("%s", last)
        code = root.exit_code
        return 128 - code if code < 0 else (code or first_failure)
    for summary in dict.fromkeys(o["summary"] for o in nodes):  # once each, in node order
        logger.error("%s", summary)
    return first_failure
