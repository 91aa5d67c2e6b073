"""A sharded checkpoint on a real S3 API (moto's standalone server): two gloo ranks each upload their own
shards through the same ``Storage`` as a directory's, the manifest commits, and it restores and exports
at world size 1 from the bucket.

Run as a script, this module is the saving rank.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

pytest.importorskip("boto3", reason="the [test] extra installs boto3 and moto")

from elastictrain.checkpoint import CheckpointManager, export_safetensors
from tests.support.s3_server import CREDENTIALS, client, moto_server, new_bucket

pytestmark = pytest.mark.timeout(90)

REPO = Path(__file__).resolve().parents[2]
SHAPES = {"w": (7, 3), "b": (5,)}  # 4,3 and 3,2 rows over two ranks


def _full() -> dict[str, torch.Tensor]:
    return {k: torch.arange(torch.Size(s).numel(), dtype=torch.float32).reshape(s) * 0.5 for k, s in SHAPES.items()}


class _Values:
    def __init__(self, values: dict[str, torch.Tensor]) -> None:
        self.values = values

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.values)

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.values = dict(state)


@pytest.fixture
def s3_env(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    with moto_server(tmp_path_factory.mktemp("moto")) as endpoint:
        for name, value in CREDENTIALS.items():
            monkeypatch.setenv(name, value)
        monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
        for name in ("AWS_PROFILE", "AWS_MAX_ATTEMPTS", "AWS_RETRY_MODE"):
            monkeypatch.delenv(name, raising=False)
        yield endpoint


def test_sharded_checkpoint_of_two_ranks_round_trips_through_s3(s3_env: str, tmp_path: Path) -> None:
    safetensors_torch = pytest.importorskip("safetensors.torch")
    bucket = new_bucket(s3_env)
    url = f"s3://{bucket}/run"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, __file__, str(rank), str(tmp_path / "store"), url], env=env)
             for rank in range(2)]
    try:
        codes = [p.wait(timeout=60) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert codes == [0, 0]

    keys = sorted(o["Key"] for o in client(s3_env).list_objects_v2(Bucket=bucket)["Contents"])
    manifest = json.loads(client(s3_env).get_object(Bucket=bucket, Key="run/step_00000004/MANIFEST.json")
                          ["Body"].read())
    data = manifest["data"]
    assert [k for k in keys if data in k] == [f"run/{data}/{name}" for name in (
        "rank_00000.pt", "rank_00001.pt", "replicated.pt", "shards_00000.bin", "shards_00001.bin")]
    assert manifest["format_version"] == 2
    assert [c["sizes"] for c in manifest["tensors"]["values/w"]["chunks"]] == [[4, 3], [3, 3]]

    holder = _Values({k: torch.zeros(s) for k, s in SHAPES.items()})
    with CheckpointManager(url) as mgr:
        info = mgr.restore({"values": holder})
    assert info is not None and info.step == 4 and info.world_size == 2
    assert all(torch.equal(holder.values[k], v) for k, v in _full().items())

    out = tmp_path / "values.safetensors"
    export_safetensors(f"{url}/step_00000004", out, entry="values")
    exported = safetensors_torch.load_file(str(out))
    assert exported.keys() == SHAPES.keys() and all(torch.equal(exported[k], v) for k, v in _full().items())


def _main(rank: int, store: str, url: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from tests.support.leave import leave_together

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    values = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in _full().items()}
    with CheckpointManager(url, async_save=True) as mgr:
        mgr.save(4, {"values": _Values(values)})
    leave_together()


if __name__ == "__main__":
    _main(int(sys.argv[1]), sys.argv[2], sys.argv[3])
