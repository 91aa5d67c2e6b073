"""A directory this process cannot write to, also when the tests run as root."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

__all__ = ["read_only_dir"]


@contextlib.contextmanager
def read_only_dir(path: Path) -> Iterator[Path]:
    """Create ``path`` and make it unwritable while the ``with`` block runs.

    A normal user gets mode 0555. Root ignores modes, so for root ``path`` becomes a
    read-only bind mount of itself; where root cannot mount (no CAP_SYS_ADMIN), the
    test is skipped with the reason.
    """
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        path.chmod(0o555)
        try:
            yield path
        finally:
            path.chmod(0o755)
        return
    mounted = subprocess.run(["mount", "--bind", str(path), str(path)], capture_output=True).returncode == 0
    if not mounted or subprocess.run(["mount", "-o", "remount,ro,bind", str(path)],
                                     capture_output=True).returncode != 0:
        if mounted:
            subprocess.run(["umount", str(path)], capture_output=True)
        pytest.skip("running as root (which ignores file modes) and cannot mount a read-only directory")
    try:
        yield path
    finally:
        if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
            # Busy (a process still has its cwd there): detach it now, free it when unused.
            subprocess.run(["umount", "--lazy", str(path)], check=True, capture_output=True)
