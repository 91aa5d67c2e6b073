"""Checkpoints in S3 (issue 44) against a local S3 server: the training stall and the upload throughput.

Starts moto's standalone server (``python -m moto.server``) on a free loopback port, builds
``build_state(--mb)`` (a model of about ``--mb`` MiB plus its AdamW state, about 3x the model)
and, in each of ``--reps`` repetitions after ``--warmup`` uncounted ones, times:

- ``torch_save_local``: one ``torch.save`` of the state dicts to a file on local disk (no fsync);
- ``s3_async_stall`` / ``s3_async_total``: ``CheckpointManager("s3://...", async_save=True).save``
  until it returns (the state is copied to CPU memory: the training stall) / until committed;
- ``s3_restore``: ``CheckpointManager.restore`` of that checkpoint (download, sha256, load);
- ``s3storage_upload`` vs ``boto3_put_object``: the bytes of the checkpoint's ``replicated.pt``
  streamed through ``S3Storage.open_write`` (64 MiB writes, as ``torch.save`` hands them over:
  a create-only multipart upload on a few threads) vs one plain ``put_object`` of the same bytes
  by the same library (boto3); ``*_mb_per_s`` are their throughputs.

The targets of issue 44: ``s3_async_stall`` < 0.1x ``torch_save_local``; ``s3storage_upload``
throughput >= 0.8x ``boto3_put_object``'s. A loopback server measures the client's overhead, not
a network: on real S3 the put is bound by the link, and parallel parts help more.

    python benchmarks/checkpoint_s3.py                  # 1024 MiB, 3 reps: run it alone
    python benchmarks/checkpoint_s3.py --mb 16 --reps 1 --warmup 1 --out /tmp/s3.json
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks._common import emit, free_port, machine, ratio, summarize
from benchmarks.checkpoint_stall import build_state
from elastictrain.checkpoint import CheckpointManager
from elastictrain.checkpoint.s3 import S3Storage

_WRITE = 64 << 20


def _start_moto(workdir: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=workdir, start_new_session=True)
    deadline = time.monotonic() + 30
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return proc, f"http://127.0.0.1:{port}"
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("moto server did not start (pip install 'moto[s3]' flask flask-cors)") from None
            time.sleep(0.05)


def _mutate(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1e-3)


def measure(mb: int, reps: int, warmup: int, endpoint: str, root: Path) -> dict[str, Any]:
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint)
    bucket = f"bench-{uuid.uuid4().hex[:10]}"
    client.create_bucket(Bucket=bucket)
    model, opt = build_state(mb)
    state = {"model": model, "optimizer": opt}
    times: dict[str, list[float]] = {k: [] for k in (
        "torch_save_local", "s3_async_stall", "s3_async_total", "s3_restore", "s3storage_upload", "boto3_put_object")}
    size = 0
    storage = S3Storage(bucket, client=client)
    with CheckpointManager("run", storage=storage, async_save=True, keep_last=1) as manager:
        for rep in range(warmup + reps):
            counted = rep >= warmup
            t0 = time.perf_counter()
            torch.save({k: v.state_dict() for k, v in state.items()}, root / "local.pt")
            t1 = time.perf_counter()
            manager.save(rep, state)
            t2 = time.perf_counter()
            _mutate(model)  # training goes on while the upload runs
            manager.wait()
            t3 = time.perf_counter()
            info = manager.restore(state)
            t4 = time.perf_counter()
            assert info is not None and info.step == rep  # noqa: S101 - a benchmark of a working restore
            # The same bytes both ways: the committed replicated.pt.
            [data] = [n for n in storage.list_dir("run") if ".data-" in n]
            with storage.open_read(f"run/{data}/replicated.pt") as f:
                payload = f.read()
            size = len(payload)
            view = memoryview(payload)
            t5 = time.perf_counter()
            with storage.open_write(f"upload/{rep}.pt") as out:
                for start in range(0, size, _WRITE):
                    out.write(view[start:start + _WRITE])
            t6 = time.perf_counter()
            client.put_object(Bucket=bucket, Key=f"put/{rep}.pt", Body=payload)
            t7 = time.perf_counter()
            del view, payload
            storage.delete("upload")
            storage.delete("put")
            (root / "local.pt").unlink()
            if counted:
                for key, seconds in (("torch_save_local", t1 - t0), ("s3_async_stall", t2 - t1),
                                     ("s3_async_total", t3 - t1), ("s3_restore", t4 - t3),
                                     ("s3storage_upload", t6 - t5), ("boto3_put_object", t7 - t6)):
                    times[key].append(seconds)
    out: dict[str, Any] = {"checkpoint_mb": mb, "replicated_bytes": size}
    out.update({k: summarize(v) for k, v in times.items()})
    out["s3_async_stall_over_torch_save"] = ratio(out["s3_async_stall"], out["torch_save_local"])
    for key in ("s3storage_upload", "boto3_put_object"):
        out[f"{key}_mb_per_s"] = size / 2**20 / out[key]["median"] if out[key]["median"] else None
    put = out["boto3_put_object_mb_per_s"]
    out["upload_throughput_over_put"] = out["s3storage_upload_mb_per_s"] / put if put else None
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=1024, help="model size in MiB (state: about 3x)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1, help="uncounted repetitions first (the stall is a warm one)")
    parser.add_argument("--out", type=Path, default=None, help="write the JSON record here too")
    args = parser.parse_args(argv)
    if args.mb < 1 or args.reps < 1 or args.warmup < 0:
        parser.error("--mb and --reps must be positive, --warmup not negative")
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    with tempfile.TemporaryDirectory(prefix="checkpoint-s3-") as tmp:
        proc, endpoint = _start_moto(Path(tmp))
        try:
            result = measure(args.mb, args.reps, args.warmup, endpoint, Path(tmp))
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    record = {"benchmark": "checkpoint_s3", "machine": machine(), "reps": args.reps, "warmup": args.warmup,
              "result": result}
    print(f"state of {args.mb} MiB model (+AdamW): replicated.pt {result['replicated_bytes'] / 2**20:.0f} MiB",
          file=sys.stderr)
    for key in ("torch_save_local", "s3_async_stall", "s3_async_total", "s3_restore", "s3storage_upload",
                "boto3_put_object"):
        print(f"  {key:18s} median {result[key]['median']:.3f}s", file=sys.stderr)
    print(f"  stall / torch.save: {result['s3_async_stall_over_torch_save']:.3f} (target < 0.1); upload "
          f"{result['s3storage_upload_mb_per_s']:.0f} MB/s vs put_object {result['boto3_put_object_mb_per_s']:.0f} MB/s"
          f" = {result['upload_throughput_over_put']:.2f}x (target >= 0.8)", file=sys.stderr)
    emit(record, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
