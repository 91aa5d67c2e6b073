"""Run a worker script as the ranks of one gloo job: one process per rank, all waited for."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run_ranks(script: str, world: int, *args: str, timeout: float = 160) -> None:
    """Start ``script RANK *args`` for every rank of ``world``, wait for all of them (killing what is
    left after ``timeout`` s), and fail with the tail of each one's output unless all exit 0."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, script, str(rank), *args], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
             for rank in range(world)]
    try:
        outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0] * world, "\n".join(o[-4000:] for o in outputs)
