"""Whether this machine can run the chaos harness's network namespaces (root, ``ip netns``)."""

from __future__ import annotations

import os
import shutil
import subprocess

__all__ = ["netns_works"]


def netns_works() -> bool:
    """Whether a network namespace can be made here (one made and deleted to find out)."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return False
    probe = "elastictrain-probe"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, check=False).returncode == 0
    if made:
        subprocess.run(["ip", "netns", "delete", probe], capture_output=True, check=False)
    return made
