"""Checkpoints in S3 (issue 44), against a real S3 API: moto's standalone server on a loopback
port, and a proxy in front of it for throttling, denial and stalls. No client call is patched.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import random
import subprocess
import sys
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("boto3", reason="the [test] extra installs boto3 and moto")

from elastictrain.checkpoint import CheckpointManager
from elastictrain.checkpoint.s3 import S3Storage
from elastictrain.errors import CheckpointDirectoryError, CheckpointError, CheckpointWriteError
from elastictrain.launch import status_report
from tests.conftest import REPO_ROOT, subprocess_env
from tests.support.s3_server import CREDENTIALS, FaultProxy, client, moto_server, new_bucket
from tests.unit.test_checkpoint_distributed import ThreadCoordinator, run_ranks

pytestmark = pytest.mark.timeout(90)

PART = 5 << 20  # a 12 MiB model goes up in three segments


@pytest.fixture(scope="module")
def moto(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with moto_server(tmp_path_factory.mktemp("moto")) as endpoint:
        yield endpoint


@pytest.fixture
def s3_env(moto: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """The standard AWS variables point at moto; returns the endpoint."""
    for name, value in CREDENTIALS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto)
    for name in ("AWS_PROFILE", "AWS_MAX_ATTEMPTS", "AWS_RETRY_MODE"):
        monkeypatch.delenv(name, raising=False)
    return moto


@pytest.fixture
def bucket(s3_env: str) -> str:
    return new_bucket(s3_env)


@pytest.fixture
def proxy(s3_env: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[FaultProxy]:
    """A fault-injecting proxy that the standard endpoint variable now names."""
    fault = FaultProxy(s3_env)
    monkeypatch.setenv("AWS_ENDPOINT_URL", fault.endpoint)
    yield fault
    fault.close()


def _model(seed: int, width: int = 64) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(width, width)


def _keys(endpoint: str, bucket: str) -> list[str]:
    listing = client(endpoint).list_objects_v2(Bucket=bucket)
    return sorted(o["Key"] for o in listing.get("Contents", []))


def _uploads(endpoint: str, bucket: str) -> list[str]:
    return [u["Key"] for u in client(endpoint).list_multipart_uploads(Bucket=bucket).get("Uploads", [])]


def _index(endpoint: str, bucket: str, key: str) -> tuple[dict[str, str], dict[str, Any]]:
    """The metadata and the JSON body of the index of a file stored in segments."""
    reply = client(endpoint).get_object(Bucket=bucket, Key=key)
    return reply["Metadata"], json.loads(reply["Body"].read())


def _restored_weight(url: str, **kwargs: Any) -> tuple[int | None, torch.Tensor]:
    model = _model(999, kwargs.pop("width", 64))
    with CheckpointManager(url, **kwargs) as manager:
        info = manager.restore({"model": model})
    return (info.step if info else None), model.weight.detach().clone()


def test_a_save_uploads_a_large_file_in_segments_by_single_puts_and_commits_by_a_manifest_written_last(
        proxy: FaultProxy, s3_env: str, bucket: str) -> None:
    storage = S3Storage(bucket, part_size=PART)
    model = _model(1, width=1800)  # 12.4 MB of weights: three segments
    with CheckpointManager("run", storage=storage) as manager:
        manager.save(7, {"model": model, "progress": {"epoch": 2}})
    keys = _keys(s3_env, bucket)
    [data] = {k.split("/")[1] for k in keys if ".data-" in k}
    [segments] = {k.split("/")[2] for k in keys if ".seg-" in k}
    assert keys == ["run/.fence-000000000001", f"run/{data}/rank_00000.pt", f"run/{data}/replicated.pt",
                    *(f"run/{data}/{segments}/{n:06d}" for n in (1, 2, 3)), "run/step_00000007/MANIFEST.json"]
    manifest = json.loads(client(s3_env).get_object(Bucket=bucket, Key="run/step_00000007/MANIFEST.json")
                          ["Body"].read())
    assert manifest["data"] == data and manifest["step"] == 7
    size = manifest["files"]["replicated.pt"]["size"]
    metadata, index = _index(s3_env, bucket, f"run/{data}/replicated.pt")
    assert metadata == {"elastictrain-segmented": str(size)}
    assert index == {"format": "elastictrain-segments-1", "segments": segments,
                     "sizes": [PART, PART, size - 2 * PART]}
    assert storage.size(f"run/{data}/replicated.pt") == size
    assert storage.list_dir(f"run/{data}") == ["rank_00000.pt", "replicated.pt"]  # the segments are not files
    # No multipart write (POST ?uploads, PUT ?partNumber=&uploadId=, POST ?uploadId=): single PUTs only.
    assert not [r for r in proxy.requests if r[0] != "GET" and ("?uploads" in r[1] or "uploadId=" in r[1])]
    assert _uploads(s3_env, bucket) == []
    step, weight = _restored_weight(f"s3://{bucket}/run", width=1800)
    assert step == 7 and torch.equal(weight, model.weight)


def test_writes_of_any_size_store_the_same_bytes_in_segments_and_read_back_with_their_sha256(
        s3_env: str, bucket: str) -> None:
    data = random.Random(3).randbytes(4 * PART + 12345)
    storage = S3Storage(bucket, part_size=PART)
    view, start = memoryview(data), 0
    with storage.open_write("dir/blob") as f:  # segment boundaries fall inside writes, and writes span segments
        for size in itertools.cycle([1, PART - 1, 2, 2 * PART + 7, 3, PART // 3]):
            f.write(view[start:start + size])
            start += size
            if start >= len(data):
                break
    _, index = _index(s3_env, bucket, "dir/blob")
    assert index["sizes"] == [PART] * 4 + [12345]
    stored = b"".join(client(s3_env).get_object(Bucket=bucket, Key=f"dir/{index['segments']}/{n:06d}")["Body"].read()
                      for n in range(1, 6))
    assert stored == data
    assert storage.read_hashed("dir/blob") == (data, hashlib.sha256(data).hexdigest())
    with storage.open_read("dir/blob") as f:
        assert f.read() == data
    assert storage.size("dir/blob") == len(data) and storage.list_dir("dir") == ["blob"]
    with storage.open_write("dir/small") as f:  # at most one segment: one object, no index
        f.write(view[:PART])
    assert client(s3_env).get_object(Bucket=bucket, Key="dir/small")["Body"].read() == data[:PART]
    storage.delete("dir/blob")  # the file and its segments, not its neighbour
    assert _keys(s3_env, bucket) == ["dir/small"]


def test_of_two_writers_of_one_large_file_exactly_one_succeeds_and_the_loser_deletes_its_segments(
        s3_env: str, bucket: str) -> None:
    storage = S3Storage(bucket, part_size=PART)
    first, second = random.Random(1).randbytes(2 * PART + 1), random.Random(2).randbytes(2 * PART + 1)
    with pytest.raises(FileExistsError), storage.open_write("blob") as a:
        a.write(first[:PART])  # a's first segment goes out
        with storage.open_write("blob") as b:  # their segments interleave, each under a prefix of its own
            b.write(second)
        a.write(first[PART:])  # a's index comes second: refused, and a deletes its segments
    assert storage.read_hashed("blob") == (second, hashlib.sha256(second).hexdigest())
    _, index = _index(s3_env, bucket, "blob")
    assert _keys(s3_env, bucket) == ["blob", *(f"{index['segments']}/{n:06d}" for n in (1, 2, 3))]


def test_the_client_sends_no_crc32_of_each_body_unless_the_environment_asks(
        s3_env: str, monkeypatch: pytest.MonkeyPatch) -> None:
    config = S3Storage("any").client.meta.config  # the manifest's sha256 covers the bytes
    assert (config.request_checksum_calculation, config.response_checksum_validation) == ("when_required",) * 2
    monkeypatch.setenv("AWS_REQUEST_CHECKSUM_CALCULATION", "when_supported")
    assert S3Storage("any").client.meta.config.request_checksum_calculation == "when_supported"


CRASH_SCRIPT = """\
import os, sys, torch
from elastictrain.checkpoint import CheckpointManager
from elastictrain.checkpoint.s3 import S3Storage
from tests.support.s3_server import client
bucket, stage = sys.argv[1], sys.argv[2]
torch.manual_seed(2)
model = torch.nn.Linear(1800, 1800)
manager = CheckpointManager("run", storage=S3Storage(bucket, part_size=5 << 20))
def crash(at):
    # mid-file: once a segment of replicated.pt is stored, and not its index, as a process killed there leaves it
    if at == stage and (stage != "during_write" or any(".seg-" in o["Key"] for o in client(
            os.environ["AWS_ENDPOINT_URL"]).list_objects_v2(Bucket=bucket, Prefix="run/step_00000002.data-")
            .get("Contents", []))):
        os._exit(17)
manager._fault_hook = crash
manager.save(2, {"model": model})
"""


@pytest.mark.parametrize("stage", ["before_write", "during_write", "before_commit"])
def test_a_save_killed_at_any_stage_restores_the_previous_checkpoint_and_the_next_save_removes_its_garbage(
        s3_env: str, bucket: str, stage: str, tmp_path: Path) -> None:
    good = _model(1, width=1800)
    with CheckpointManager("run", storage=S3Storage(bucket, part_size=PART)) as manager:
        manager.save(1, {"model": good})
    script = tmp_path / "crash.py"
    script.write_text(CRASH_SCRIPT)
    done = subprocess.run([sys.executable, str(script), bucket, stage], env=subprocess_env(PYTHONPATH=str(REPO_ROOT)),
                          capture_output=True, text=True, timeout=60, cwd=REPO_ROOT)
    assert done.returncode == 17, done.stderr[-3000:]
    crashed = [k.split("/", 2)[2] for k in _keys(s3_env, bucket) if k.startswith("run/step_00000002.data-")]
    if stage == "during_write":  # segments, and no index: no file
        assert any(".seg-" in k for k in crashed) and "replicated.pt" not in crashed, crashed
    if stage == "before_commit":  # every object is there; only the manifest is not
        assert [k for k in crashed if ".seg-" not in k] == ["rank_00000.pt", "replicated.pt"], crashed
        assert len(crashed) == 5, crashed  # and replicated.pt's three segments
    step, weight = _restored_weight(f"s3://{bucket}/run", width=1800)
    assert step == 1 and torch.equal(weight, good.weight)

    newer = _model(3, width=1800)
    with CheckpointManager("run", storage=S3Storage(bucket, part_size=PART)) as manager:
        manager.save(3, {"model": newer})
    keys = _keys(s3_env, bucket)
    data = sorted({k.split("/")[1] for k in keys if ".data-" in k})
    assert [d.split(".")[0] for d in data] == ["step_00000001", "step_00000003"], keys  # the crashed save's: gone
    assert not [k for k in keys if k.startswith("run/step_00000002")], keys  # its segments too
    assert _uploads(s3_env, bucket) == []
    step, weight = _restored_weight(f"s3://{bucket}/run", width=1800)
    assert step == 3 and torch.equal(weight, newer.weight)


def test_a_save_aborts_the_multipart_uploads_an_earlier_version_left_open(s3_env: str, bucket: str) -> None:
    # elastictrain before segments uploaded large files in parts; a crash left the upload open.
    client(s3_env).create_multipart_upload(Bucket=bucket, Key="run/step_00000001.data-0badc0de/replicated.pt")
    with CheckpointManager("run", storage=S3Storage(bucket, part_size=PART)) as manager:
        manager.save(2, {"model": _model(2)})
    assert _uploads(s3_env, bucket) == []


def test_a_stale_writer_cannot_replace_a_newer_worlds_commit_of_the_same_step(s3_env: str, bucket: str) -> None:
    url = f"s3://{bucket}/run"
    old_model, new_model = _model(1), _model(2)
    old = CheckpointManager(url, fence=True)
    old.save(1, {"model": old_model})
    newer: list[CheckpointManager] = []

    def newer_world_commits_first(stage: str) -> None:
        # The race no check can close: the stale world passed its fencing check and found no
        # manifest of step 2, then a newer world claimed the location and committed step 2
        # before the stale one wrote its manifest.
        if stage == "before_commit" and not newer:
            newer.append(CheckpointManager(url, fence=True))
            newer[0].save(2, {"model": new_model})

    old._fault_hook = newer_world_commits_first
    with pytest.raises(CheckpointError, match="another writer committed .*step_00000002 first"):
        old.save(2, {"model": old_model})
    old._fault_hook = None
    with pytest.raises(CheckpointError, match="newer world"):  # and the fence refuses its next commit
        old.save(3, {"model": old_model})
    old.close()
    newer[0].close()
    step, weight = _restored_weight(url)
    assert step == 2 and torch.equal(weight, new_model.weight)


def test_a_stale_writer_re_saving_a_step_never_deletes_a_newer_worlds_commit_of_it(
        proxy: FaultProxy, s3_env: str, bucket: str) -> None:
    stale_model, new_model = _model(11), _model(12)
    stale = CheckpointManager("run", storage=S3Storage(bucket), fence=True)  # through the proxy
    stale.save(2, {"model": _model(13)})
    manifest = "run/step_00000002/MANIFEST.json"
    newer: list[CheckpointManager] = []

    def newer_world_commits_the_step() -> None:
        # A newer world (straight to the server) commits step 2 while the stale world's request
        # that would replace (or delete) its own manifest of step 2 is on the wire.
        newer.append(CheckpointManager("run", storage=S3Storage(bucket, client=client(s3_env)), fence=True))
        newer[0].save(2, {"model": new_model})

    # The first request that changes step 2's manifest: a PUT of it, or a DeleteObjects naming it.
    proxy.before(lambda method, path, body: method in ("PUT", "POST", "DELETE") and (
        manifest in path or manifest.encode() in body), newer_world_commits_the_step)
    with pytest.raises(CheckpointError, match="another writer committed .*step_00000002 first"):
        stale.save(2, {"model": stale_model})  # re-saving step 2 (as after restoring to it)
    assert newer, "the stale world's re-save never reached the server"
    stale.close()
    newer[0].close()
    step, weight = _restored_weight(f"s3://{bucket}/run")
    assert step == 2 and torch.equal(weight, new_model.weight)
    assert json.loads(client(s3_env).get_object(Bucket=bucket, Key=manifest)["Body"].read())["fence"] == 2


def test_a_restore_downloads_each_segment_once_and_checks_it_before_loading(
        proxy: FaultProxy, s3_env: str, bucket: str) -> None:
    model = _model(14, width=1800)  # 12.4 MB: three segments of 5 MiB
    with CheckpointManager("run", storage=S3Storage(bucket, part_size=PART)) as manager:
        manager.save(1, {"model": model})
    [key] = [k for k in _keys(s3_env, bucket) if k.endswith("/replicated.pt")]
    proxy.requests.clear()
    target = _model(15, width=1800)
    with CheckpointManager("run", storage=S3Storage(bucket, part_size=PART)) as manager:
        info = manager.restore({"model": target})
    assert info is not None and info.step == 1 and torch.equal(target.weight, model.weight)
    gets = sorted(path.split("?")[0].partition("/replicated.pt")[2] for method, path in proxy.requests
                  if method == "GET" and "/replicated.pt" in path)
    assert gets[0] == "" and [g.rpartition("/")[2] for g in gets[1:]] == ["000001", "000002", "000003"], gets

    # An object of more than one part_size that is not in segments (another writer's) reads in ranges.
    data = random.Random(5).randbytes(2 * PART + 1)
    client(s3_env).put_object(Bucket=bucket, Key="plain", Body=data)
    proxy.requests.clear()
    assert S3Storage(bucket, part_size=PART).read_hashed("plain") == (data, hashlib.sha256(data).hexdigest())
    assert [m for m, path in proxy.requests if path.split("?")[0].endswith("/plain")] == ["HEAD"] + ["GET"] * 3


def test_throttling_is_retried_with_backoff_and_the_save_commits(proxy: FaultProxy, bucket: str) -> None:
    model = _model(4)
    proxy.throttle(6)  # the first request meets them all
    with CheckpointManager(f"s3://{bucket}/run") as manager:
        manager.save(1, {"model": model})
        proxy.throttle(6)
        manager.save(2, {"model": model})
    assert proxy.counts["throttled"] == 12
    step, weight = _restored_weight(f"s3://{bucket}/run")
    assert step == 2 and torch.equal(weight, model.weight)


def test_a_missing_bucket_fails_at_start_with_one_line_naming_it(s3_env: str) -> None:
    with pytest.raises(CheckpointDirectoryError) as caught:
        CheckpointManager("s3://no-such-bucket-44/run")
    assert str(caught.value) == "cannot create checkpoint directory s3://no-such-bucket-44/run: bucket " \
                                "'no-such-bucket-44' does not exist"


def test_denied_access_fails_at_start_with_one_line_and_no_secret(proxy: FaultProxy, bucket: str) -> None:
    proxy.deny()
    with pytest.raises(CheckpointDirectoryError) as caught:
        CheckpointManager(f"s3://{bucket}/run")
    message = str(caught.value)
    assert "access to s3://" in message and "denied (403)" in message and "\n" not in message, message
    assert CREDENTIALS["AWS_SECRET_ACCESS_KEY"] not in message and CREDENTIALS["AWS_ACCESS_KEY_ID"] not in message


@pytest.mark.parametrize("width", [64, 1800])  # one object; three segments
def test_a_stalled_upload_is_abandoned_after_the_save_timeout(proxy: FaultProxy, bucket: str, width: int) -> None:
    model = _model(5, width)
    manager = CheckpointManager("run", storage=S3Storage(bucket, part_size=PART), save_timeout=timedelta(seconds=1))
    manager.save(1, {"model": model})
    proxy.stall("PUT")
    try:
        with pytest.raises(CheckpointWriteError, match="made no progress for 1s"):
            manager.save(2, {"model": _model(6, width)})
    finally:
        proxy.release()
    manager.close()
    step, weight = _restored_weight(f"s3://{bucket}/run", width=width)
    assert step == 1 and torch.equal(weight, model.weight)


def test_two_ranks_save_and_three_or_one_restore(s3_env: str, bucket: str) -> None:
    url = f"s3://{bucket}/run"
    model = _model(8)

    def save(rank: int, hub: Any) -> None:
        with CheckpointManager(url, coordinator=ThreadCoordinator(hub, rank)) as manager:
            manager.save(4, {"model": model if rank == 0 else _model(100 + rank)})

    assert run_ranks(2, save) == [None, None]
    assert sorted(k.rsplit("/", 1)[1] for k in _keys(s3_env, bucket) if ".data-" in k) == [
        "rank_00000.pt", "rank_00001.pt", "replicated.pt"]

    def restore(rank: int, hub: Any) -> tuple[int, torch.Tensor]:
        target = _model(200 + rank)
        with CheckpointManager(url, coordinator=ThreadCoordinator(hub, rank)) as manager:
            info = manager.restore({"model": target})
        assert info is not None and info.world_size == 2
        return info.step, target.weight.detach()

    for world in (3, 1):
        for result in run_ranks(world, restore):
            assert not isinstance(result, BaseException), result
            step, weight = result
            assert step == 4 and torch.equal(weight, model.weight)


def test_restore_and_status_skip_a_checkpoint_whose_object_does_not_match_its_manifest(
        s3_env: str, bucket: str, etcd_server: Any) -> None:
    url = f"s3://{bucket}/run"
    first, second = _model(9), _model(10)
    with CheckpointManager(url) as manager:
        manager.save(1, {"model": first})
        manager.save(2, {"model": second})
    assert status_report.newest_checkpoint(url, checksums=True)["step"] == 2
    [key] = [k for k in _keys(s3_env, bucket) if k.startswith("run/step_00000002.data-") and "replicated" in k]
    body = bytearray(client(s3_env).get_object(Bucket=bucket, Key=key)["Body"].read())
    body[-100] ^= 0xFF  # same size, one byte flipped: only the sha256 tells
    client(s3_env).put_object(Bucket=bucket, Key=key, Body=bytes(body))
    assert status_report.newest_checkpoint(url)["step"] == 2  # sizes only
    found = status_report.newest_checkpoint(url, checksums=True)
    assert found["step"] == 1 and found["path"] == f"{url}/step_00000001"
    step, weight = _restored_weight(url)
    assert step == 1 and torch.equal(weight, first.weight)

    shown = subprocess.run(
        [sys.executable, "-m", "elastictrain", "status", "--etcd", etcd_server.endpoint, "--run-id", "no-such-run",
         "--checkpoint-dir", url, "--verify-checksums", "--json"],
        capture_output=True, text=True, timeout=60, env=subprocess_env(), cwd=REPO_ROOT)
    assert json.loads(shown.stdout)["checkpoint"]["step"] == 1, shown.stderr
    assert CREDENTIALS["AWS_SECRET_ACCESS_KEY"] not in shown.stdout + shown.stderr


@pytest.mark.parametrize("damage", ["segment", "index"])
def test_restore_and_status_skip_a_checkpoint_with_a_flipped_byte_in_a_segment_or_a_damaged_index(
        s3_env: str, bucket: str, damage: str) -> None:
    first, second = _model(11, width=1800), _model(12, width=1800)
    with CheckpointManager("run", storage=S3Storage(bucket, part_size=PART)) as manager:
        manager.save(1, {"model": first})
        manager.save(2, {"model": second})
    [index] = [k for k in _keys(s3_env, bucket)
               if k.startswith("run/step_00000002.data-") and k.endswith("/replicated.pt")]
    metadata, body = _index(s3_env, bucket, index)
    if damage == "segment":  # same size, one byte flipped: only the whole file's sha256 tells
        key = f"{index.rpartition('/')[0]}/{body['segments']}/000002"
        raw = bytearray(client(s3_env).get_object(Bucket=bucket, Key=key)["Body"].read())
        raw[100] ^= 0xFF
        client(s3_env).put_object(Bucket=bucket, Key=key, Body=bytes(raw))
    else:  # an index whose sizes no longer add up to the file's
        body["sizes"][0] -= 1
        client(s3_env).put_object(Bucket=bucket, Key=index, Body=json.dumps(body).encode(), Metadata=metadata)
    assert status_report.newest_checkpoint(f"s3://{bucket}/run", checksums=True)["step"] == 1
    step, weight = _restored_weight(f"s3://{bucket}/run", width=1800)
    assert step == 1 and torch.equal(weight, first.weight)


SESSION_SCRIPT = """\
import os, sys, torch, elastictrain
from torch.utils.data import TensorDataset
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
data = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
first_try = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
with elastictrain.Session(model, torch.optim.SGD(model.parameters(), lr=0.1), data, global_batch_size=8,
                          checkpoint_dir=sys.argv[1], checkpoint_every=2, epochs=2) as session:
    if session.restored is not None:
        print(f"RESTORED rank={session.rank} step={session.restored.step}", flush=True)
    for step in session.steps():
        for micro in step:
            x, y = micro.batch
            micro.backward(torch.nn.functional.mse_loss(session.model(x), y))
        if first_try and session.step == 5 and session.rank == 1:
            os._exit(3)  # a worker dies after the save of step 4
"""


def _elastictrain_run(tmp_path: Path, directory: str, *extra: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "train.py"
    script.write_text(SESSION_SCRIPT)
    return subprocess.run(
        [sys.executable, "-m", "elastictrain", "run", "--local-nodes", "2", "--min-nodes", "2", "--no-progress",
         *extra, str(script), directory],
        capture_output=True, text=True, timeout=120, env=subprocess_env(), cwd=tmp_path)


@pytest.mark.timeout(150)
def test_a_session_of_two_gloo_processes_saves_to_s3_and_restores_after_a_worker_dies(
        s3_env: str, bucket: str, tmp_path: Path) -> None:
    result = _elastictrain_run(tmp_path, f"s3://{bucket}/job", "--recovery", "restart", "--max-restarts", "2")
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-5000:]
    assert "RESTORED rank=0 step=4" in output and "RESTORED rank=1 step=4" in output, output[-5000:]
    # 64 samples / 8 per step = 8 steps an epoch; the final save is step 16.
    assert status_report.newest_checkpoint(f"s3://{bucket}/job", checksums=True)["step"] == 16
    events = "".join(p.read_text() for p in tmp_path.rglob("*") if p.is_file() and p.suffix in (".jsonl", ".log"))
    for text in (output, events):
        assert CREDENTIALS["AWS_SECRET_ACCESS_KEY"] not in text


def test_a_job_whose_bucket_does_not_exist_fails_at_start_in_one_line(s3_env: str, tmp_path: Path) -> None:
    result = _elastictrain_run(tmp_path, "s3://no-such-bucket-44/job")
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    last = output.strip().splitlines()[-1]
    assert "bucket 'no-such-bucket-44' does not exist" in last, output
    assert last.endswith("job failed after 0 restart(s)"), output
    assert "Traceback" not in output, output
