"""A checkpoint directory that cannot be written is refused when the manager is made, not at the first save."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from elastictrain.checkpoint import CheckpointManager
from elastictrain.errors import CheckpointError
from tests.support.read_only import read_only_dir

pytestmark = pytest.mark.timeout(30)


def test_a_read_only_checkpoint_directory_is_refused_at_construction(tmp_path: Path) -> None:
    model = torch.nn.Linear(2, 1)
    with read_only_dir(tmp_path / "ckpt") as directory:
        with pytest.raises(CheckpointError, match=f"checkpoint directory {directory} is not writable: "):
            manager = CheckpointManager(directory)
            # Before the fix the first save is where it failed: after training up to it.
            manager.save(1, {"model": model})
        assert list(directory.iterdir()) == []


def test_a_writable_directory_keeps_no_probe_file(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path / "ckpt"):
        pass
    assert list((tmp_path / "ckpt").iterdir()) == []
