"""The GPU check's scripts (``tests/gpu``), run where they can be here, so that they do not rot
between the runs of ``tests/gpu/check.sh`` on a GPU machine.

``nccl_reform.py --cpu`` runs its fsdp part on gloo: an fsdp generation trained, left in place,
and re-formed in the same process through the strategy's agreement, ``covers``, ``unwrapped``,
``transfer_state`` and ``wrap``, its next step equal to an unsharded model's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.support.ranks import REPO

pytestmark = pytest.mark.timeout(90)


def test_the_nccl_reform_scripts_fsdp_part_reforms_sharded_state_in_place_on_gloo() -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(REPO / "tests" / "gpu" / "nccl_reform.py"), "--cpu"], env=env,
                          capture_output=True, text=True, timeout=80, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    fsdp = json.loads(done.stdout.strip().splitlines()[-1])["fsdp"]
    assert fsdp == {"sharded": "DTensor", "covered": True, "on_device": True, "error": 0.0}
