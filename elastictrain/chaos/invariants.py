"""What must hold after every chaos run, checked from the evidence the job and the harness wrote.

Each check returns an :class:`InvariantResult`. The checks trust neither the
job nor elastictrain's own checkpoint code: checkpoints are verified here
against their manifests (sizes and sha256) independently, and the committed
history is rebuilt from the lineage stored *inside* the final committed
checkpoint (see :mod:`elastictrain.chaos.recorder`), so steps that ran but
whose checkpoint never committed (and were redone after a restore) are not
counted.

Invariants:

- ``exit_status``: the job exited 0 on every node the harness did not kill,
  whenever at least min-nodes stayed up (or came back within the join
  timeout); otherwise the survivors exited non-zero saying why.
- ``committed_history``: the committed steps are 1..F exactly once each, and
  every committed step has the records of every rank of its round.
- ``exactly_once``: every sample of each completed epoch was consumed by
  committed steps exactly once; an unfinished epoch has no sample twice and
  as many samples as the checkpointed sampler cursor says.
- ``final_parameters``: the final parameters equal an uninterrupted reference
  run's within float tolerance (the global batch is constant; only the
  summation order differs with the world size).
- ``restores_committed``: every restore loaded a committed checkpoint that
  verifies, the newest one committed by then, holding exactly the parameters
  its producer saved (fingerprints match).
- ``checkpoints_intact``: every committed checkpoint on disk verifies, the
  last one included.
- ``world_size_bounds``: every round trained with min..max nodes' worth of workers.
- ``survivors_kept``: under in-process recovery, every worker a fault did not touch is a
  worker of the first group formed after it, in the same process.
- ``spares_fill_in``: a fault that struck while a hot spare waited left the world size as
  it was: the spare took the place of a node that left, and no member lost its seat to it.
- ``no_hang``: every fault was followed by training within the recovery bound,
  and the run ended within its deadline.
- ``no_ghost_workers``: no worker process outlived the run.
"""

from __future__ import annotations

import collections
import hashlib
import io
import json
import os
import re
import struct
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from elastictrain.chaos.recorder import MARKER
from elastictrain.checkpoint import export_safetensors
from elastictrain.checkpoint.storage import LocalStorage, Storage, storage_for

__all__ = [
    "Checkpoint", "CheckpointDir", "Evidence", "History", "InvariantResult", "check_checkpoints_intact",
    "check_committed_history",
    "check_exactly_once", "check_final_parameters", "check_restores", "check_spares_fill_in", "check_survivors_kept",
    "check_world_sizes",
    "checkpoint_dirs",
    "committed_history", "read_checkpoint", "read_lines", "total_steps", "verify_checkpoint",
]

_STEP_DIR = re.compile(r"^step_(\d+)$")
_DATA_DIR = re.compile(r"^step_\d+\.data-[0-9a-z-]+$")
_SHARDED_FORMAT = 2
"""The manifest's ``format_version`` of a sharded checkpoint (DTensor state, in shards)."""
_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                       "U8": torch.uint8, "BOOL": torch.bool}


@dataclass(frozen=True, slots=True)
class InvariantResult:
    """The outcome of one invariant."""

    name: str
    ok: bool | None
    """True: holds; False: violated; None: could not be checked (``detail`` says why)."""
    detail: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"ok": self.ok, "detail": self.detail}


def read_lines(path: Path) -> list[dict[str, Any]]:
    """JSON lines of ``path``; a torn last line (a writer killed mid-write) is dropped."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


@dataclass
class Evidence:
    """Everything a job's :class:`~elastictrain.chaos.Recorder` wrote under one directory."""

    directory: Path
    events: list[dict[str, Any]] = field(default_factory=list)
    workers: list[dict[str, Any]] = field(default_factory=list)
    steps: dict[str, dict[int, dict[int, dict[str, Any]]]] = field(default_factory=dict)
    """segment -> step -> rank -> record."""
    duplicates: list[str] = field(default_factory=list)
    """(segment, rank, step) recorded more than once: the evidence itself is wrong."""

    @classmethod
    def load(cls, directory: str | os.PathLike[str]) -> Evidence:
        directory = Path(directory)
        evidence = cls(directory, read_lines(directory / "events.jsonl"), read_lines(directory / "workers.jsonl"))
        steps_dir = directory / "steps"
        for path in sorted(steps_dir.glob("*.jsonl")) if steps_dir.exists() else []:
            for record in read_lines(path):
                by_rank = evidence.steps.setdefault(record["seg"], {}).setdefault(record["step"], {})
                if record["rank"] in by_rank:
                    evidence.duplicates.append(f"segment {record['seg']} rank {record['rank']} step {record['step']}")
                by_rank[record["rank"]] = record
        return evidence

    def of(self, kind: str) -> list[dict[str, Any]]:
        """Rank 0's events of one kind, in time order."""
        return sorted((e for e in self.events if e["kind"] == kind), key=lambda e: e["t"])

    @property
    def config(self) -> dict[str, Any] | None:
        found = self.of("config")
        return found[0] if found else None

    def checkpoint_root(self) -> str | None:
        """The job's checkpoint directory or ``s3://`` URL, as the job reported it (saves, else restores)."""
        for event in self.of("saved"):
            return str(event["dir"])
        for event in self.of("restored"):
            return str(event["path"]).rstrip("/").rpartition("/")[0]
        return None

    def total_steps(self) -> int | None:
        """Steps of a complete run, from the job's configuration; None if unknown."""
        return total_steps(self.config)


def total_steps(config: dict[str, Any] | None) -> int | None:
    """Steps of a complete run from a recorder's ``config`` event; None if unknown."""
    if config is None:
        return None
    n, g = config["num_samples"], config["global_batch"]
    total = (n // g if config["drop_last"] else -(-n // g)) * config["epochs"]
    return min(total, config["max_steps"]) if config.get("max_steps") else total


# --- checkpoints ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CheckpointDir:
    """A committed checkpoint's directory (``step_N``), read through the ``Storage`` protocol: in
    a local directory, or in an object store (where the manifest's ``data`` names the prefix its
    files are under)."""

    storage: Storage
    path: str
    """The directory's path in ``storage``."""

    @classmethod
    def local(cls, path: Path) -> CheckpointDir:
        """The checkpoint directory at local ``path``."""
        return cls(LocalStorage(path.parent), path.name)

    @property
    def name(self) -> str:
        """``step_N``."""
        return self.path.rpartition("/")[2]

    def read(self, name: str) -> bytes:
        """The bytes of file ``name`` of the directory itself (the manifest)."""
        with self.storage.open_read(f"{self.path}/{name}") as f:
            return f.read()

    def files_at(self, manifest: dict[str, Any]) -> CheckpointDir:
        """Where the manifest's files are: here, or the data prefix beside it that it names."""
        data = manifest.get("data")
        if data is None:
            return self
        if not isinstance(data, str) or not _DATA_DIR.match(data):
            raise ValueError(f"malformed data prefix {data!r}")
        parent = self.path.rpartition("/")[0]
        return CheckpointDir(self.storage, f"{parent}/{data}" if parent else data)

    def __str__(self) -> str:
        return self.storage.location(self.path)


def checkpoint_dirs(root: str | os.PathLike[str]) -> dict[int, CheckpointDir]:
    """Committed checkpoint directories (``step_N``; staging ``.tmp-`` and ``.data-`` ones excluded)
    by step, in a local directory or at an ``s3://`` URL."""
    storage, prefix = storage_for(root)
    try:
        names = storage.list_dir(prefix)
    except (FileNotFoundError, NotADirectoryError):
        return {}
    out = {int(m.group(1)): CheckpointDir(storage, f"{prefix}/{n}" if prefix else n)
           for n in names if (m := _STEP_DIR.match(n))}
    return dict(sorted(out.items()))


def _as_dir(checkpoint: CheckpointDir | Path) -> CheckpointDir:
    return checkpoint if isinstance(checkpoint, CheckpointDir) else CheckpointDir.local(checkpoint)


def verify_checkpoint(checkpoint: CheckpointDir | Path, step: int | None = None) -> str | None:
    """Check a checkpoint against its manifest; the problem, or None if it verifies.

    Independent of :mod:`elastictrain.checkpoint`'s verification (it reads through the ``Storage``
    protocol only): it recomputes every listed file's size and sha256 and requires
    ``replicated.pt``, one rank file per saved rank and, in a sharded checkpoint (format 2), every
    shard file its tensor index names.
    """
    checkpoint = _as_dir(checkpoint)
    try:
        manifest = json.loads(checkpoint.read("MANIFEST.json"))
        files = manifest["files"]
        world = int(manifest["world_size"])
        files_at = checkpoint.files_at(manifest)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        return f"{checkpoint.name}: no readable manifest ({exc})"
    if step is not None and manifest.get("step") != step:
        return f"{checkpoint.name}: manifest names step {manifest.get('step')}"
    needed = {"replicated.pt"} | {f"rank_{r:05d}.pt" for r in range(world)}
    if manifest.get("format_version") == _SHARDED_FORMAT:
        try:  # a sharded checkpoint's shards: every file its tensor index names a chunk in
            needed |= {chunk["file"] for tensor in manifest["tensors"].values() for chunk in tensor["chunks"]}
        except (KeyError, TypeError, AttributeError) as exc:
            return f"{checkpoint.name}: malformed tensor index ({exc!r})"
    if needed - files.keys():
        return f"{checkpoint.name}: manifest lacks {sorted(needed - files.keys())}"
    for name, entry in files.items():
        try:
            data = files_at.read(name)
        except OSError as exc:
            return f"{checkpoint.name}/{name}: {exc}"
        if len(data) != entry["size"] or hashlib.sha256(data).hexdigest() != entry["sha256"]:
            return f"{checkpoint.name}/{name}: size or sha256 differs from the manifest"
    return None


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """The parts of a committed checkpoint the invariants read."""

    step: int
    path: CheckpointDir | Path
    model: dict[str, torch.Tensor]
    sampler: dict[str, Any] | None
    lineage: list[dict[str, Any]] | None


def read_checkpoint(checkpoint: CheckpointDir | Path, step: int) -> Checkpoint:
    """Load a checkpoint's replicated state (``weights_only``: plain data only).

    Raises:
        ValueError: It has no model state, or its manifest is malformed.
        OSError: It cannot be read.
    """
    checkpoint = _as_dir(checkpoint)
    manifest = json.loads(checkpoint.read("MANIFEST.json"))
    raw = checkpoint.files_at(manifest if isinstance(manifest, dict) else {}).read("replicated.pt")
    content = torch.load(io.BytesIO(raw), weights_only=True, map_location="cpu")
    stateful = content.get("stateful", {}) if isinstance(content, dict) else {}
    if "model" not in stateful:
        raise ValueError(f"{checkpoint}: no model state")
    model = stateful["model"]
    if isinstance(manifest, dict) and manifest.get("format_version") == _SHARDED_FORMAT:
        # replicated.pt holds a placeholder for each sharded tensor: assemble the full ones from
        # their chunks through the checkpoint package's export (each chunk checked as it is read).
        model = _exported_model(checkpoint)
    lineage = next((v["lineage"] for v in stateful.values() if isinstance(v, dict) and v.get(MARKER)), None)
    if lineage is None:  # a recorder given as a dict of extras
        extras = content.get("extras", {})
        lineage = next((v["lineage"] for v in extras.values() if isinstance(v, dict) and v.get(MARKER)), None)
    return Checkpoint(step, checkpoint, model, stateful.get("sampler"), lineage)


def _exported_model(checkpoint: CheckpointDir) -> dict[str, torch.Tensor]:
    """The full model tensors of a sharded checkpoint: exported to one safetensors file, read back."""
    with tempfile.TemporaryDirectory(prefix="elastictrain-chaos-") as scratch:
        out = Path(scratch) / "model.safetensors"
        export_safetensors(str(checkpoint), out)
        return _read_safetensors(out)


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file (a JSON header, then raw little-endian bytes: no code).

    Raises:
        ValueError: The file is malformed or holds a dtype this reader does not know.
    """
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + length])
    body = memoryview(data)[8 + length:]
    out: dict[str, torch.Tensor] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype = _SAFETENSORS_DTYPES.get(entry["dtype"])
        if dtype is None:
            raise ValueError(f"{path}: {name} has dtype {entry['dtype']!r}")
        begin, end = entry["data_offsets"]
        chunk = bytearray(body[begin:end])
        flat = torch.frombuffer(chunk, dtype=dtype) if chunk else torch.empty(0, dtype=dtype)
        out[name] = flat.reshape(entry["shape"])
    return out


# --- committed history ------------------------------------------------------------------------


@dataclass
class History:
    """The committed steps of a run, rebuilt from the final checkpoint's lineage."""

    final_step: int
    steps: list[tuple[int, str, dict[int, dict[str, Any]]]]
    """(step, segment, rank -> record), in step order."""
    problems: list[str]


def committed_history(evidence: Evidence, final: Checkpoint) -> History:
    """The steps that make up ``final``: for each lineage link, its segment's steps up to the next link's base."""
    problems: list[str] = []
    steps: list[tuple[int, str, dict[int, dict[str, Any]]]] = []
    lineage = final.lineage
    if not lineage:
        return History(final.step, [], [f"checkpoint {final.path.name} holds no chaos lineage "
                                         "(pass the Recorder as extra_state)"])
    if lineage[0]["base"] != 0:
        problems.append(f"the lineage starts from step {lineage[0]['base']}, not from scratch")
    for k, link in enumerate(lineage):
        stop = lineage[k + 1]["base"] if k + 1 < len(lineage) else final.step
        if stop < link["base"]:
            problems.append(f"lineage goes back from step {link['base']} to {stop}")
        records = evidence.steps.get(link["seg"], {})
        for number in range(link["base"] + 1, stop + 1):
            by_rank = records.get(number)
            if not by_rank:
                problems.append(f"committed step {number} (segment {link['seg']}) has no step records")
                continue
            steps.append((number, link["seg"], by_rank))
    numbers = [s for s, _, _ in steps]
    if numbers != list(range(1, final.step + 1)) and not problems:
        problems.append(f"committed steps are not 1..{final.step}")
    return History(final.step, steps, problems)


def check_committed_history(history: History, evidence: Evidence) -> InvariantResult:
    problems = list(history.problems) + [f"recorded twice: {d}" for d in evidence.duplicates[:5]]
    for number, seg, by_rank in history.steps:
        worlds = {r["world"] for r in by_rank.values()}
        if len(worlds) != 1:
            problems.append(f"step {number}: ranks disagree on the world size {sorted(worlds)}")
            continue
        world = worlds.pop()
        if set(by_rank) != set(range(world)):
            problems.append(f"step {number} (segment {seg}, world {world}): records of ranks {sorted(by_rank)}")
        if len({r["epoch"] for r in by_rank.values()}) != 1:
            problems.append(f"step {number}: ranks disagree on the epoch")
    return InvariantResult("committed_history", not problems,
                           "; ".join(problems[:8]) or f"{len(history.steps)} committed steps, "
                           f"{len({s for _, s, _ in history.steps})} segment(s) in the lineage")


def check_exactly_once(history: History, evidence: Evidence, final: Checkpoint) -> InvariantResult:
    config = evidence.config
    sampler = final.sampler
    if config is None or sampler is None:
        return InvariantResult("exactly_once", None, "no job config or sampler state recorded")
    n, g = config["num_samples"], config["global_batch"]
    per_epoch = n - n % g if config["drop_last"] else n
    consumed: dict[int, list[int]] = collections.defaultdict(list)
    step_sizes: list[str] = []
    for number, _, by_rank in history.steps:
        idx = [i for r in sorted(by_rank) for i in by_rank[r]["idx"]]
        epoch = next(iter(by_rank.values()))["epoch"]
        consumed[epoch].extend(idx)
        if len(idx) != g and len(consumed[epoch]) != per_epoch:
            step_sizes.append(f"step {number} consumed {len(idx)} samples, not {g}")
    problems = step_sizes[:3]
    final_epoch, cursor = sampler["epoch"], sampler["cursor"]
    for epoch in range(max([final_epoch, *consumed]) + 1):
        seen = consumed.get(epoch, [])
        counts = collections.Counter(seen)
        twice = sorted(i for i, c in counts.items() if c > 1)
        if twice:
            problems.append(f"epoch {epoch}: {len(twice)} sample(s) consumed more than once, e.g. {twice[:5]}")
        if epoch < final_epoch or (epoch == final_epoch and cursor >= per_epoch):
            missing = sorted(set(range(n)) - counts.keys()) if not config["drop_last"] else []
            if missing:
                problems.append(f"epoch {epoch} (complete): {len(missing)} sample(s) never consumed, "
                                f"e.g. {missing[:5]}")
            if len(counts) != per_epoch:
                problems.append(f"epoch {epoch} (complete): {len(counts)} distinct samples, expected {per_epoch}")
        elif epoch == final_epoch:
            if len(seen) != cursor:
                problems.append(f"epoch {epoch} (unfinished): {len(seen)} samples consumed, the cursor says {cursor}")
        elif seen:
            problems.append(f"epoch {epoch}: consumed after the checkpointed epoch {final_epoch}")
    complete = sum(1 for e in range(final_epoch + 1) if e < final_epoch or cursor >= per_epoch)
    return InvariantResult("exactly_once", not problems, "; ".join(problems[:8]) or
                           f"{complete} complete epoch(s) of {n} samples, each sample once; "
                           f"{sum(map(len, consumed.values()))} samples in committed steps")


def check_final_parameters(final: Checkpoint, reference: Checkpoint | None, *, atol: float,
                           rtol: float) -> InvariantResult:
    if reference is None:
        return InvariantResult("final_parameters", None, "no reference run")
    if final.step != reference.step:
        return InvariantResult("final_parameters", False,
                               f"final step {final.step}, reference {reference.step}")
    if final.model.keys() != reference.model.keys():
        return InvariantResult("final_parameters", False, "parameter names differ from the reference")
    worst, where = 0.0, ""
    for name, expected in reference.model.items():
        actual = final.model[name]
        if actual.shape != expected.shape:
            return InvariantResult("final_parameters", False, f"{name}: shape {tuple(actual.shape)}")
        if not torch.is_floating_point(expected):
            if not torch.equal(actual, expected):
                return InvariantResult("final_parameters", False, f"{name} differs")
            continue
        excess = ((actual - expected).abs() - rtol * expected.abs()).max().item()
        if excess > worst:
            worst, where = excess, name
    diff = max(((final.model[k] - v).abs().max().item() for k, v in reference.model.items()
                if torch.is_floating_point(v)), default=0.0)
    ok = worst <= atol
    return InvariantResult("final_parameters", ok, f"max |chaos - reference| = {diff:.3g} (atol {atol:g}, "
                           f"rtol {rtol:g}){'' if ok else f'; worst in {where}'}")


def check_restores(evidence: Evidence, checkpoints: dict[int, CheckpointDir],
                   agent_events: Iterable[dict[str, Any]] = ()) -> InvariantResult:
    """Every restore loaded a committed, verified checkpoint, the newest, with its producer's parameters.

    Two witnesses: the job's recorder (fingerprints, producer segment) and the
    session's own ``restore`` events in the run's event log, each of which must
    name a step that a ``checkpoint_commit`` event or a verifying directory shows committed.
    """
    problems = []
    agent_events = list(agent_events)
    commits = [e for e in agent_events if e.get("kind") == "checkpoint_commit"]
    logged = [e for e in agent_events if e.get("kind") == "restore"]
    for event in logged:
        step = event.get("step")
        on_disk = step in checkpoints and verify_checkpoint(checkpoints[step], step) is None
        committed = any(c.get("step") == step and c["ts"] <= event["ts"] for c in commits)
        if not (on_disk or committed):
            problems.append(f"the session logged a restore of step {step}, which was never committed")
    restores = evidence.of("restored")
    saves_begun = {(e["seg"], e["step"]): e for e in evidence.of("save_begin")}
    saved = evidence.of("saved")
    for event in restores:
        step, producer = event["step"], event.get("producer")
        name = str(event["path"]).rstrip("/").rpartition("/")[2]
        match = _STEP_DIR.match(name)
        if not match or int(match.group(1)) != step:
            problems.append(f"restored {name!r} as step {step}: not a committed checkpoint directory")
            continue
        path = checkpoints.get(step)
        committed_record = any(s["seg"] == producer and s["step"] == step and s["t"] <= event["t"] for s in saved)
        if path is not None:
            error = verify_checkpoint(path, step)
            if error:
                problems.append(f"restored step {step}, which does not verify: {error}")
        elif not committed_record:
            problems.append(f"restored step {step}: no such checkpoint on disk and no commit recorded")
        began = saves_begun.get((producer, step))
        if began is None:
            problems.append(f"restored step {step}: its producer (segment {producer}) never began saving it")
        elif began.get("fp") != event.get("fp"):
            problems.append(f"restored step {step}: parameters differ from what segment {producer} saved")
        newer = [s["step"] for s in saved if s["t"] < event["t"] and s["step"] > step
                 and s["step"] in checkpoints and verify_checkpoint(checkpoints[s["step"]], s["step"]) is None]
        if newer:
            problems.append(f"restored step {step} although step {max(newer)} was committed before")
    return InvariantResult("restores_committed", not problems, "; ".join(problems[:8]) or
                           f"{len(restores)} restore(s) (the session logged {len(logged)}), each of the newest "
                           "committed checkpoint, verified, holding its producer's parameters")


def check_checkpoints_intact(checkpoints: dict[int, CheckpointDir]) -> InvariantResult:
    if not checkpoints:
        return InvariantResult("checkpoints_intact", False, "no committed checkpoint")
    errors = [e for s, p in checkpoints.items() if (e := verify_checkpoint(p, s))]
    return InvariantResult("checkpoints_intact", not errors, "; ".join(errors[:5]) or
                           f"{len(checkpoints)} committed checkpoint(s) verify, last step {max(checkpoints)}")


def check_world_sizes(evidence: Evidence, agent_events: Iterable[dict[str, Any]], *, low: int,
                      high: int) -> InvariantResult:
    seen = [("segment", e["world"]) for e in evidence.of("segment")]
    seen += [("rendezvous", e["world_size"]) for e in agent_events
             if e.get("kind") == "rendezvous" and e.get("world_size") is not None]
    seen += [("step record", r["world"]) for by_step in evidence.steps.values() for by_rank in by_step.values()
             for r in by_rank.values()]
    bad = sorted({f"{what} at world size {w}" for what, w in seen if not low <= w <= high})
    worlds = sorted({w for _, w in seen})
    return InvariantResult("world_size_bounds", not bad,
                           "; ".join(bad[:5]) or f"world sizes {worlds} within [{low}, {high}]")


def check_survivors_kept(evidence: Evidence, faults: Iterable[Any], *, in_process: bool) -> InvariantResult:
    """Under in-process recovery, a worker that a fault did not touch keeps its process.

    For each recovered fault: every worker process of the last group formed before it
    (``workers.jsonl``), except the fault's targets, must be a worker of the first group
    formed after it.
    """
    if not in_process:
        return InvariantResult("survivors_kept", None, "restart recovery: every worker restarts by design")
    starts: dict[str, float] = {}
    members: dict[str, set[int]] = {}
    for worker in evidence.workers:
        starts[worker["seg"]] = min(starts.get(worker["seg"], worker["t"]), worker["t"])
        members.setdefault(worker["seg"], set()).add(worker["pid"])
    ordered = sorted(starts, key=starts.__getitem__)
    problems, checked = [], 0
    for fault in faults:
        if fault.injected is None or fault.recovered is None or fault.below_min:
            continue
        before = [seg for seg in ordered if starts[seg] < fault.injected]
        after = [seg for seg in ordered if fault.injected < starts[seg] <= fault.recovered]
        if not before or not after:
            continue  # no new group: nobody had to survive anything
        survivors = members[before[-1]] - set(fault.target_pids)
        lost = sorted(survivors - members[after[-1]])
        checked += 1
        if lost:
            problems.append(f"fault {fault.index} ({fault.kind.value}): worker(s) {lost} did not carry on in the "
                            "next group")
    return InvariantResult("survivors_kept", not problems, "; ".join(problems[:5]) or
                           f"{checked} re-formation(s): every untouched worker kept its process")


def check_spares_fill_in(evidence: Evidence, faults: Iterable[Any]) -> InvariantResult:
    """A fault that struck while a hot spare waited leaves the world size as it was.

    For each recovered fault with ``spare_waiting`` that ended the training group: the last
    group formed before it recovered has the world size of the last group formed before it
    (a lost node's place is taken by the spare; a worker failure loses no seat).
    """
    segments = sorted(evidence.of("segment"), key=lambda g: g["t"])
    problems, checked = [], 0
    for fault in faults:
        if (not fault.spare_waiting or not fault.expects_restart or fault.injected is None
                or fault.recovered is None or fault.below_min):
            continue
        before = [g for g in segments if g["t"] < fault.injected]
        after = [g for g in segments if fault.injected < g["t"] <= fault.recovered]
        if not before or not after:
            continue
        checked += 1
        if after[-1]["world"] != before[-1]["world"]:
            problems.append(f"fault {fault.index} ({fault.kind.value}): world size {before[-1]['world']} -> "
                            f"{after[-1]['world']} with a spare waiting")
    if not checked and not problems:
        return InvariantResult("spares_fill_in", None, "no fault struck a training group while a spare waited")
    return InvariantResult("spares_fill_in", not problems, "; ".join(problems[:5]) or
                           f"{checked} fault(s) with a spare waiting: every one kept the world size")
