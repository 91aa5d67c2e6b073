"""Several node agents on one machine: ``elastictrain run --local-nodes N``.

Each node is a separate ``elastictrain run`` process with its own agent, exactly
as on separate hosts, so a multi-node job (and its failures) can be seen and
tested on one machine. The launcher waits for every node, forwards Ctrl-C and
SIGTERM to them, and exits with the first non-zero node exit code.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

from elastictrain._process import dying_with_us

logger = logging.getLogger(__name__)

__all__ = ["run_local_nodes"]


def run_local_nodes(count: int, node_args: Sequence[str], *, grace_seconds: float = 30.0) -> int:
    """Start ``count`` node agents with ``elastictrain run <node_args>`` and wait for all.

    Args:
        count: Number of node processes.
        node_args: Arguments of ``elastictrain run`` for each node (no ``--local-nodes``).
        grace_seconds: After a signal, how long nodes get to stop before SIGKILL.

    Returns:
        0 if every node exited 0, else the first non-zero exit code seen.
    """
    procs: list[subprocess.Popen[bytes]] = []
    received: list[int] = []

    def forward(signum: int, _frame: object) -> None:
        received.append(signum)
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        for index in range(count):
            cmd = [sys.executable, "-m", "elastictrain", "run", "--node-name", f"node{index}", *node_args]
            # A node outlives neither this launcher nor, through its own agent, its workers.
            procs.append(subprocess.Popen(dying_with_us(cmd)))
        logger.info("started %d local nodes: pids %s", count, [p.pid for p in procs])
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
        if received and first_failure == 0:
            first_failure = 128 + received[0]
        return first_failure
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
