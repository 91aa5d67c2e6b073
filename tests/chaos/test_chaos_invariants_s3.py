"""Chaos runs with the checkpoints in an object store: the invariants read them through the
``Storage`` protocol (a manager's commits in a real S3 API, moto's standalone server on a
loopback port, are found, verified, a flipped byte caught, and read, as in a local directory),
and the harness refuses a location it cannot use."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

pytest.importorskip("boto3", reason="the [test] extra installs boto3 and moto")

from elastictrain.chaos import ChaosConfig, run_chaos
from elastictrain.chaos import invariants as inv
from elastictrain.checkpoint import CheckpointManager
from elastictrain.errors import ConfigError
from tests.support.s3_server import CREDENTIALS, client, moto_server, new_bucket

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def moto(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with moto_server(tmp_path_factory.mktemp("moto")) as endpoint:
        yield endpoint


@pytest.fixture
def s3_url(moto: str, monkeypatch: pytest.MonkeyPatch) -> tuple[str, str]:
    for name, value in CREDENTIALS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto)
    return moto, f"s3://{new_bucket(moto)}/job"


def test_checkpoints_in_s3_are_found_verified_and_read_and_a_flipped_byte_is_caught(s3_url: tuple[str, str]) -> None:
    endpoint, url = s3_url
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    with CheckpointManager(url) as manager:
        manager.save(3, {"model": model})
        manager.save(6, {"model": model})
    checkpoints = inv.checkpoint_dirs(url)
    assert list(checkpoints) == [3, 6]  # the .data- prefixes and fencing tokens are no checkpoints
    assert str(checkpoints[6]) == f"{url}/step_00000006"
    assert inv.check_checkpoints_intact(checkpoints).ok
    final = inv.read_checkpoint(checkpoints[6], 6)
    assert torch.equal(final.model["weight"], model.weight)

    bucket = url.removeprefix("s3://").partition("/")[0]
    s3 = client(endpoint)
    [key] = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket)["Contents"]
             if o["Key"].startswith("job/step_00000006.data-") and o["Key"].endswith("/replicated.pt")]
    body = bytearray(s3.get_object(Bucket=bucket, Key=key)["Body"].read())
    body[-10] ^= 0xFF
    s3.put_object(Bucket=bucket, Key=key, Body=bytes(body))
    assert "step_00000006/replicated.pt: size or sha256 differs" in str(inv.verify_checkpoint(checkpoints[6], 6))
    result = inv.check_checkpoints_intact(checkpoints)
    assert result.ok is False and "step_00000006" in result.detail
    assert inv.checkpoint_dirs(f"{url}-none") == {}


def test_a_chaos_run_refuses_a_checkpoint_location_that_holds_anything_or_cannot_be_read(
        s3_url: tuple[str, str], tmp_path: Path) -> None:
    _, url = s3_url
    script = tmp_path / "train.py"
    script.write_text("")
    with CheckpointManager(url) as manager:
        manager.save(1, {"progress": {"epoch": 0}})
    with pytest.raises(ConfigError, match=f"checkpoint location {url} is not empty .*a prefix of its own"):
        run_chaos(ChaosConfig(script=str(script), run_dir=str(tmp_path / "run1"), checkpoint_dir=url))
    with pytest.raises(ConfigError, match="bucket 'no-such-bucket-44' does not exist"):
        run_chaos(ChaosConfig(script=str(script), run_dir=str(tmp_path / "run2"),
                              checkpoint_dir="s3://no-such-bucket-44/chaos"))
