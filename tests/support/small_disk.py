"""A real filesystem that fills up: a tmpfs of a given size mounted for the ``with`` block."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

__all__ = ["small_disk"]


@contextlib.contextmanager
def small_disk(path: Path, size: str = "2m") -> Iterator[Path]:
    """Mount a tmpfs of ``size`` at ``path`` (created) while the block runs: writes past its size
    fail with ENOSPC, as on a full disk. Where this process may not mount (not root, no
    CAP_SYS_ADMIN, a container), the test is skipped with the reason."""
    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a {size} tmpfs to fill up (needs root with CAP_SYS_ADMIN): "
                    f"{mounted.stderr.strip()}")
    try:
        yield path
    finally:
        if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "--lazy", str(path)], check=True, capture_output=True)
