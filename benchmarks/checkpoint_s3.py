"""Checkpoints in S3 (issue 44) against a local S3 server: the training stall, the upload throughput, the restore.

Starts moto's standalone server (``python -m moto.server``) on a free loopback port, builds
``build_state(--mb)`` (a model of about ``--mb`` MiB plus its AdamW state, about 3x the model)
and, in each of ``--reps`` repetitions after ``--warmup`` uncounted ones (the first save of a
manager allocates its copy memory: the stall is a warm one), times:

- ``torch_save_local``: one ``torch.save`` of the state dicts to a file on local disk (no fsync);
- ``memcpy_floor``: one ``copy_`` of every tensor of the state into warm buffers of the same
  sizes, nothing else: the least any save that returns with the state copied can stall;
- ``s3_async_stall`` / ``s3_async_total``: ``CheckpointManager("s3://...", async_save=True).save``
  until it returns (the state is copied to CPU memory in ``save``) / until committed;
- ``s3_overlap_stall``: the same with ``overlap=True``, as a training loop sees it: ``save``
  returns once the state's structure is captured, the copy runs in the background while the next
  step's forward and backward run (``compute_with_save``; a batch of ``--batch``), and the
  optimizer step waits for what is left of the copy (``wait_snapshot``, as its pre-hook does).
  The stall is ``save`` plus that wait; ``s3_overlap_lost`` adds how much slower that forward and
  backward ran than the median of ``compute_alone`` (the same, without a save, just before): the
  competition of the copy, the serialization, the hashing, the upload and the server for cores;
- ``s3_restore``: ``CheckpointManager.restore`` of the async manager's checkpoint (each object
  downloaded once, its sha256 checked as it arrives, then loaded);
- the upload of the same bytes (the checkpoint's ``replicated.pt``) four ways. Over the
  loopback's plain HTTP botocore signs every body (a SHA-256 of it, SigV4); a plain boto3
  client adds its default CRC32 of each body (since botocore 1.36), ``S3Storage``'s client
  does not (the manifest's sha256 covers the bytes; see ``elastictrain/checkpoint/s3.py``):

  - ``s3storage_upload``: streamed through ``S3Storage.open_write`` (its own client, as
    shipped) in 64 MiB writes, as ``torch.save`` hands them over (through the manager's sha256,
    not timed here): segments of 32 MiB, each a create-only ``PutObject``, up to 8 in flight,
    each one copy of the bytes, then the file's index;
  - ``boto3_put_object``: one ``put_object`` on a plain ``boto3.client("s3")`` (the issue's
    baseline: the same library's plain put); ``boto3_put_object_same_client`` the same on
    ``S3Storage``'s client (no CRC32): what the segments cost against one request;
  - ``boto3_multipart``: boto3's plain multipart calls, the same part size and concurrency, the
    parts sliced from memory (one copy each); ``boto3_multipart_complete`` is its
    ``CompleteMultipartUpload`` alone: moto assembling the object from its parts (it reads every
    part back, concatenates them and stores the object again), the step segments do without.

Where the cores go: each upload, the overlapped save's window (``save`` and the step beside it)
and ``compute_alone`` also record the CPU seconds (user + system, every thread) of this process
(``..._cpu_client``) and of the moto server (``..._cpu_server``, from ``/proc/PID/stat``) over
the same interval. A loopback server on the same cores measures the client's and moto's CPU,
not a network: ``overlap_window_cpu_client`` less ``compute_alone_cpu_client`` is what our save
burns beside the step, ``overlap_window_cpu_server`` what the server does.

Each configuration runs in a process of its own (``--configs``, default both):

- ``shared``: the trainer and the server share every core, as before;
- ``pinned``: the trainer on CPU 0 (``taskset -c 0``, so torch computes on one thread) and the
  server on CPU 1 (``taskset -c 1``): the server's CPU no longer competes with the step, so the
  slowdown left is ours (the copy, ``torch.save``'s serialization, the sha256 and the upload
  threads' signing and sending, all on CPU 0); its baselines are measured pinned too.

The targets of issue 44: ``s3_overlap_stall`` (the stall of the shipped overlapped mode) < 0.1x
``torch_save_local``; ``s3storage_upload`` throughput >= 0.8x ``boto3_put_object``'s.

    python benchmarks/checkpoint_s3.py --mb 341 --reps 3 --warmup 1 --out checkpoint_s3.json   # 1 GB: run it alone
    python benchmarks/checkpoint_s3.py --mb 8 --reps 1 --part-mb 5 --out /tmp/s3.json   # a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks._common import emit, free_port, machine, ratio, summarize
from benchmarks.checkpoint_stall import WIDTH, build_state
from elastictrain.checkpoint import CheckpointManager, map_tensors
from elastictrain.checkpoint.s3 import S3Storage

_WRITE = 64 << 20
CONCURRENCY = 8
CONFIGS = ("shared", "pinned")
KEYS = ("torch_save_local", "memcpy_floor", "s3_async_stall", "s3_async_total", "s3_overlap_call", "s3_overlap_wait",
        "s3_overlap_stall", "s3_overlap_lost", "compute_alone", "compute_with_save", "s3_restore", "s3storage_upload",
        "boto3_put_object", "boto3_put_object_same_client", "boto3_multipart", "boto3_multipart_complete")
CPU_KEYS = tuple(f"{what}_cpu_{side}" for what in ("s3storage_upload", "boto3_put_object", "boto3_multipart",
                                                    "overlap_window", "compute_alone") for side in ("client", "server"))


def _start_moto(workdir: Path, cpu: int | None) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    pin = ["taskset", "-c", str(cpu)] if cpu is not None else []  # taskset execs python: the same pid
    proc = subprocess.Popen([*pin, sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
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


def _cpu_seconds(pid: int | None) -> float:
    """User + system CPU seconds of every thread of process ``pid`` (``None``: this one)."""
    if pid is None:
        times = os.times()
        return times.user + times.system
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()  # the name may hold spaces; fields 14, 15 follow it
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class _Clock:
    """Wall seconds and the CPU seconds of this process and of the server over one interval."""

    def __init__(self, server: int) -> None:
        self._server = server
        self._start = (time.perf_counter(), _cpu_seconds(None), _cpu_seconds(server))

    def stop(self) -> tuple[float, float, float]:
        wall, client, server = self._start
        return time.perf_counter() - wall, _cpu_seconds(None) - client, _cpu_seconds(self._server) - server


def _plain_multipart(client: Any, bucket: str, key: str, payload: bytes, part_size: int) -> float:
    """boto3's plain multipart calls (parts on ``CONCURRENCY`` threads); returns the complete's seconds."""
    view = memoryview(payload)
    upload = client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]

    def part(number: int, start: int) -> dict[str, Any]:
        reply = client.upload_part(Bucket=bucket, Key=key, UploadId=upload, PartNumber=number,
                                   Body=bytes(view[start:start + part_size]))
        return {"PartNumber": number, "ETag": reply["ETag"]}

    with ThreadPoolExecutor(CONCURRENCY) as pool:
        parts = list(pool.map(part, range(1, -(-len(payload) // part_size) + 1), range(0, len(payload), part_size)))
    started = time.perf_counter()
    client.complete_multipart_upload(Bucket=bucket, Key=key, UploadId=upload, MultipartUpload={"Parts": parts})
    return time.perf_counter() - started


def _warm_copies(state: dict[str, Any]) -> Callable[[], None]:
    """A function that copies every tensor storage of ``state`` into warm buffers of its size."""
    found: list[torch.Tensor] = []
    map_tensors({k: v.state_dict() for k, v in state.items()}, found.append)
    sources = {t.untyped_storage().data_ptr(): t.untyped_storage() for t in found}
    pairs = [(torch.empty(0, dtype=torch.uint8).set_(s), torch.zeros(s.nbytes(), dtype=torch.uint8))
             for s in sources.values()]

    def copy() -> None:
        for source, target in pairs:
            target.copy_(source)

    copy()  # the buffers' pages are touched: warm, as the managers' copy pools are
    return copy


def measure(mb: int, reps: int, warmup: int, batch: int, part_size: int, endpoint: str, server: int,
            root: Path) -> dict[str, Any]:
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint)
    bucket = f"bench-{uuid.uuid4().hex[:10]}"
    client.create_bucket(Bucket=bucket)
    model, opt = build_state(mb)
    state = {"model": model, "optimizer": opt}
    batch_x = torch.randn(batch, WIDTH)
    memcpy = _warm_copies(state)

    def forward_backward() -> None:
        opt.zero_grad(set_to_none=True)
        model(batch_x).square().mean().backward()

    times: dict[str, list[float]] = {k: [] for k in KEYS + CPU_KEYS}
    size = 0
    os.environ["AWS_ENDPOINT_URL"] = endpoint  # S3Storage makes its client as shipped
    storage = S3Storage(bucket, part_size=part_size, concurrency=CONCURRENCY)
    asynchronous = CheckpointManager("async", storage=storage, async_save=True, keep_last=1)
    overlapped = CheckpointManager("overlap", storage=storage, async_save=True, overlap=True, keep_last=1)
    try:
        overlapped.restore(state)  # as a training loop starts: the copy memory is reserved once AdamW steps
        for rep in range(warmup + reps):
            got: dict[str, float] = {}
            t0 = time.perf_counter()
            torch.save({k: v.state_dict() for k, v in state.items()}, root / "local.pt")
            got["torch_save_local"] = time.perf_counter() - t0
            (root / "local.pt").unlink()
            t0 = time.perf_counter()
            memcpy()
            got["memcpy_floor"] = time.perf_counter() - t0

            t0 = time.perf_counter()
            asynchronous.save(rep, state)
            t1 = time.perf_counter()
            forward_backward()  # training goes on while the upload runs
            opt.step()
            asynchronous.wait()
            got["s3_async_stall"], got["s3_async_total"] = t1 - t0, time.perf_counter() - t0

            alone = []
            for _ in range(3):
                clock = _Clock(server)
                forward_backward()
                alone.append(clock.stop())
                opt.step()
            got["compute_alone"], got["compute_alone_cpu_client"], got["compute_alone_cpu_server"] = (
                statistics.median(a[i] for a in alone) for i in range(3))
            clock = _Clock(server)
            t0 = time.perf_counter()
            overlapped.save(rep, state)
            t1 = time.perf_counter()
            forward_backward()
            t2 = time.perf_counter()
            _, got["overlap_window_cpu_client"], got["overlap_window_cpu_server"] = clock.stop()
            overlapped.wait_snapshot()  # what the optimizer step's pre-hook waits for
            t3 = time.perf_counter()
            opt.step()
            overlapped.wait()
            got["s3_overlap_call"], got["compute_with_save"], got["s3_overlap_wait"] = t1 - t0, t2 - t1, t3 - t2
            got["s3_overlap_stall"] = got["s3_overlap_call"] + got["s3_overlap_wait"]
            got["s3_overlap_lost"] = got["s3_overlap_stall"] + got["compute_with_save"] - got["compute_alone"]

            t0 = time.perf_counter()
            info = asynchronous.restore(state)
            got["s3_restore"] = time.perf_counter() - t0
            if info is None or info.step != rep:
                raise SystemExit(f"restore loaded {info}, not step {rep}")

            # The same bytes every way: the committed replicated.pt.
            [data] = [n for n in storage.list_dir("async") if ".data-" in n]
            payload, _ = storage.read_hashed(f"async/{data}/replicated.pt")
            size = len(payload)
            view = memoryview(payload)
            clock = _Clock(server)
            with storage.open_write(f"upload/{rep}.pt") as f:
                for start in range(0, size, _WRITE):
                    f.write(view[start:start + _WRITE])
            got["s3storage_upload"], got["s3storage_upload_cpu_client"], got["s3storage_upload_cpu_server"] = (
                clock.stop())
            clock = _Clock(server)
            client.put_object(Bucket=bucket, Key=f"put/{rep}.pt", Body=payload)
            got["boto3_put_object"], got["boto3_put_object_cpu_client"], got["boto3_put_object_cpu_server"] = (
                clock.stop())
            t0 = time.perf_counter()
            storage.client.put_object(Bucket=bucket, Key=f"put/{rep}-same.pt", Body=payload)
            got["boto3_put_object_same_client"] = time.perf_counter() - t0
            clock = _Clock(server)
            got["boto3_multipart_complete"] = _plain_multipart(client, bucket, f"multipart/{rep}.pt", payload,
                                                               part_size)
            got["boto3_multipart"], got["boto3_multipart_cpu_client"], got["boto3_multipart_cpu_server"] = (
                clock.stop())
            del view, payload
            for prefix in ("upload", "put", "multipart"):
                storage.delete(prefix)
            if rep >= warmup:
                for key, seconds in got.items():
                    times[key].append(seconds)
    finally:
        asynchronous.close()
        overlapped.close()
    out: dict[str, Any] = {"checkpoint_mb": mb, "replicated_bytes": size, "batch": batch, "part_bytes": part_size,
                           "concurrency": CONCURRENCY, "torch_threads": torch.get_num_threads(),
                           "cpus": sorted(os.sched_getaffinity(0))}
    out.update({k: summarize(v) for k, v in times.items()})
    for key in ("memcpy_floor", "s3_async_stall", "s3_overlap_stall", "s3_overlap_lost"):
        out[f"{key}_over_torch_save"] = ratio(out[key], out["torch_save_local"])
    out["s3_async_stall_over_memcpy_floor"] = ratio(out["s3_async_stall"], out["memcpy_floor"])
    for key in ("s3storage_upload", "boto3_put_object", "boto3_put_object_same_client", "boto3_multipart"):
        out[f"{key}_mb_per_s"] = size / 2**20 / out[key]["median"] if out[key]["median"] else None
    put, multipart = out["boto3_put_object_mb_per_s"], out["boto3_multipart_mb_per_s"]
    same = out["boto3_put_object_same_client_mb_per_s"]
    out["upload_throughput_over_put"] = out["s3storage_upload_mb_per_s"] / put if put else None
    out["upload_throughput_over_put_same_client"] = out["s3storage_upload_mb_per_s"] / same if same else None
    out["upload_throughput_over_plain_multipart"] = out["s3storage_upload_mb_per_s"] / multipart if multipart else None
    # What the step beside the save lost, and whose CPU competed with it.
    ours = out["overlap_window_cpu_client"]["median"] - out["compute_alone_cpu_client"]["median"]
    out["overlap_extra_cpu_client"] = ours
    out["overlap_extra_cpu_server"] = out["overlap_window_cpu_server"]["median"]
    return out


def _report(name: str, result: dict[str, Any]) -> None:
    print(f"[{name}] replicated.pt {result['replicated_bytes'] / 2**20:.0f} MiB, torch threads "
          f"{result['torch_threads']}, CPUs {result['cpus']}; medians [min-max]:", file=sys.stderr)
    for key in KEYS + CPU_KEYS:
        r = result[key]
        print(f"  {key:30s} {r['median']:.3f}s [{r['min']:.3f}-{r['max']:.3f}]", file=sys.stderr)
    print(f"  stall / torch.save: overlapped {result['s3_overlap_stall_over_torch_save']:.3f} (target < 0.1; with "
          f"the slower compute {result['s3_overlap_lost_over_torch_save']:.3f}); async "
          f"{result['s3_async_stall_over_torch_save']:.3f}, {result['s3_async_stall_over_memcpy_floor']:.2f}x the "
          f"bare memcpy of the state ({result['memcpy_floor_over_torch_save']:.3f}x torch.save)", file=sys.stderr)
    print(f"  beside the overlapped save the step ran {result['compute_with_save']['median']:.3f}s vs "
          f"{result['compute_alone']['median']:.3f}s alone; CPU burned meanwhile beyond the step's own: ours "
          f"{result['overlap_extra_cpu_client']:.2f}s, the server's {result['overlap_extra_cpu_server']:.2f}s",
          file=sys.stderr)
    print(f"  upload {result['s3storage_upload_mb_per_s']:.0f} MB/s vs put_object "
          f"{result['boto3_put_object_mb_per_s']:.0f} MB/s = {result['upload_throughput_over_put']:.2f}x "
          f"(target >= 0.8); vs a put on S3Storage's client {result['upload_throughput_over_put_same_client']:.2f}x;"
          f" vs boto3's plain multipart {result['boto3_multipart_mb_per_s']:.0f} MB/s = "
          f"{result['upload_throughput_over_plain_multipart']:.2f}x (its complete alone "
          f"{result['boto3_multipart_complete']['median']:.2f}s)", file=sys.stderr)


def _run_one(args: argparse.Namespace) -> dict[str, Any]:
    """One configuration, in this process (pinned already, for ``pinned``, by the parent's ``taskset``)."""
    with tempfile.TemporaryDirectory(prefix="checkpoint-s3-") as tmp:
        proc, endpoint = _start_moto(Path(tmp), 1 if args.child == "pinned" else None)
        try:
            return measure(args.mb, args.reps, args.warmup, args.batch, args.part_mb << 20, endpoint, proc.pid,
                           Path(tmp))
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=341, help="model size in MiB (state: about 3x; default 341: 1 GB)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1, help="uncounted repetitions first (the stall is a warm one)")
    parser.add_argument("--batch", type=int, default=32, help="rows of the training step's batch (default 32)")
    parser.add_argument("--part-mb", type=int, default=32, help="MiB per segment of S3Storage and per part of "
                        "boto3's multipart upload (default 32, S3Storage's; at least 5)")
    parser.add_argument("--configs", default=",".join(CONFIGS),
                        help="comma-separated: shared (trainer and server on every core), pinned (trainer on CPU 0, "
                        "server on CPU 1); default both")
    parser.add_argument("--child", choices=CONFIGS, help=argparse.SUPPRESS)  # one configuration, in this process
    parser.add_argument("--out", type=Path, default=None, help="write the JSON record here too")
    args = parser.parse_args(argv)
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    if args.mb < 1 or args.reps < 1 or args.warmup < 0 or args.batch < 1 or args.part_mb < 5:
        parser.error("--mb, --reps and --batch must be positive, --warmup not negative, --part-mb at least 5")
    if not configs or any(c not in CONFIGS for c in configs):
        parser.error(f"--configs takes {' and/or '.join(CONFIGS)}, got {args.configs!r}")
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    if args.child is not None:
        result = _run_one(args)
        _report(args.child, result)
        assert args.out is not None  # noqa: S101 - the parent names it
        args.out.write_text(json.dumps(result))
        return 0
    if "pinned" in configs and len(os.sched_getaffinity(0)) < 2:
        print("skipping the pinned configuration: it needs 2 CPUs", file=sys.stderr)
        configs.remove("pinned")
    load_before = [round(x, 2) for x in os.getloadavg()]
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="checkpoint-s3-") as tmp:
        for config in configs:
            out = Path(tmp) / f"{config}.json"
            pin = ["taskset", "-c", "0"] if config == "pinned" else []
            own = argv if argv is not None else sys.argv[1:]
            done = subprocess.run([*pin, sys.executable, str(Path(__file__).resolve()), *_without(own, "--out"),
                                   "--child", config, "--out", str(out)])
            if done.returncode != 0:
                print(f"the {config} configuration failed (exit {done.returncode})", file=sys.stderr)
                return done.returncode
            results[config] = json.loads(out.read_text())
    record = {"benchmark": "checkpoint_s3", "machine": machine(), "reps": args.reps, "warmup": args.warmup,
              "loadavg_before": load_before, "configs": configs}
    record.update({"result" if c == "shared" else f"result_{c}": r for c, r in results.items()})
    emit(record, args.out)
    return 0


def _without(argv: list[str], option: str) -> list[str]:
    """``argv`` without ``option`` and its value (``--out X`` or ``--out=X``)."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg == option:
            skip = True
        elif not arg.startswith(f"{option}="):
            out.append(arg)
    return out


if __name__ == "__main__":
    sys.exit(main())
