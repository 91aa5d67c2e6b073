"""The chaos evidence of a sharded (FSDP2) job: fingerprints over full tensors, sharded checkpoints read and verified.

Two gloo processes shard a small model (uneven shards: dim 0 of 5 and 3 over 2 ranks), fingerprint
it through the recorder's hooks (a collective), and save a sharded checkpoint (format 2); the
test then reads it with the invariants' reader, which must assemble the full model, and
verifies it, which must require every shard file its tensor index names.

Run as a script, this module is the worker the test spawns.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from elastictrain.chaos import invariants as inv
from tests.support.ranks import run_ranks

pytestmark = pytest.mark.timeout(120)

STEP = 3


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("sharded-chaos")
    run_ranks(__file__, 2, str(tmp), timeout=100)
    return tmp


def test_a_sharded_model_prints_as_its_full_tensors_through_the_recorder(saved: Path) -> None:
    prints = json.loads((saved / "prints.json").read_text())
    assert prints["sharded"] == prints["full"]
    events = [json.loads(line) for line in (saved / "evidence" / "events.jsonl").read_text().splitlines()]
    assert [e["fp"] for e in events if e["kind"] == "save_begin"] == [prints["full"]]


def test_after_a_reformation_the_recorder_prints_the_sessions_module_not_the_first_one(saved: Path) -> None:
    # The in-process fsdp soak: a survivor's recorder printed the first generation's module, sharded
    # over a mesh that was gone (a collective its peers did not run, a timeout or a wrong print).
    prints = json.loads((saved / "prints.json").read_text())
    events = [json.loads(line) for line in (saved / "evidence" / "events.jsonl").read_text().splitlines()]
    restored = [e for e in events if e["kind"] == "restored"]
    assert [e["fp"] for e in restored] == [prints["fresh"]] and prints["fresh"] != prints["full"]
    # A recovery is heard by the ranks that kept or received the state, not by one that restored
    # the checkpoint beside them: no collective there, so a sharded module is not printed.
    assert [e["fp"] for e in events if e["kind"] == "recovered"] == [None]


def test_a_sharded_checkpoint_reads_as_its_full_model_and_verifies(saved: Path) -> None:
    checkpoint = saved / "ckpt" / f"step_{STEP:08d}"
    assert json.loads((checkpoint / "MANIFEST.json").read_text())["format_version"] == 2
    assert inv.verify_checkpoint(checkpoint, STEP) is None
    read = inv.read_checkpoint(checkpoint, STEP)
    full = torch.load(saved / "full.pt", weights_only=True)
    assert read.model.keys() == full.keys()
    assert all(torch.equal(read.model[k], v) for k, v in full.items())


def test_a_sharded_checkpoint_whose_manifest_leaves_out_a_shard_file_does_not_verify(saved: Path,
                                                                                    tmp_path: Path) -> None:
    import shutil

    checkpoint = tmp_path / f"step_{STEP:08d}"
    shutil.copytree(saved / "ckpt" / checkpoint.name, checkpoint)
    manifest = json.loads((checkpoint / "MANIFEST.json").read_text())
    del manifest["files"]["shards_00001.bin"]
    (checkpoint / "MANIFEST.json").write_text(json.dumps(manifest))
    assert inv.verify_checkpoint(checkpoint, STEP) == f"{checkpoint.name}: manifest lacks ['shards_00001.bin']"


class _Session:
    """What the recorder reads of a session: its current module, and its steps (none here)."""

    def __init__(self, module: torch.nn.Module) -> None:
        from types import SimpleNamespace

        self.module = module
        self.config = SimpleNamespace(global_batch_size=4, drop_last=False, epochs=1, max_steps=None,
                                      checkpoint_every=1)
        self.sampler = SimpleNamespace(num_samples=4)

    def steps(self) -> list[object]:
        return []


def _worker(rank: int, tmp: Path) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from elastictrain.chaos.recorder import Recorder, fingerprint, is_sharded
    from elastictrain.checkpoint import CheckpointManager

    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    full = {k: v.detach().clone() for k, v in model.state_dict().items()}
    full_print = fingerprint(model)
    mesh = init_device_mesh("cpu", (2,))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model[2], mesh=mesh)
    fully_shard(model, mesh=mesh)
    assert is_sharded(model)
    sharded_print = fingerprint(model)  # a collective: every rank calls it
    recorder = Recorder(model, directory=str(tmp / "evidence"))
    recorder.on_rendezvous(rank=rank, world_size=2, restart_count=0)
    recorder.before_save(step=STEP)  # a collective too, on every rank
    with CheckpointManager(tmp / "ckpt") as manager:
        manager.save(STEP, {"model": model})
    # The group re-forms in place: the session's module is now a fresh one (restored, not yet sharded).
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    session = _Session(fresh)
    assert list(recorder.steps(session)) == []
    recorder.on_restore(step=STEP, path=str(tmp / "ckpt" / f"step_{STEP:08d}"))
    session.module = model  # sharded again (the old module stands in for the new generation's)
    recorder.on_recovery(step=STEP, cause="test", generation=2, world_size=2, seconds=0.0)
    if rank == 0:
        torch.save(full, tmp / "full.pt")
        (tmp / "prints.json").write_text(json.dumps({"full": full_print, "sharded": sharded_print,
                                                     "fresh": fingerprint(fresh)}))
    dist.destroy_process_group()


if __name__ == "__main__":
    _worker(int(sys.argv[1]), Path(sys.argv[2]))
