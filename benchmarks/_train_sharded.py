"""The sharded benchmark training job (issue 41): a transformer LM under FSDP2, as a Session or as torchrun + DCP.

The job of ``sharded_recovery.py``: the same model, data and event file under two loops.

- ``--loop session``: ``elastictrain.Session(sharding=fsdp|hsdp)``, a sharded checkpoint every
  ``--ckpt-every`` steps (elastictrain's format; restored at any world size). It recovers as
  its launcher and the session allow: ``elastictrain run --recovery restart`` restarts every
  worker from the newest checkpoint; under ``--recovery in-process`` a session whose sharding
  does not recover in process refuses at start, in one line (the driver reports the
  combination as unsupported). ``--redundancy-every N`` (fsdp) keeps a copy of a buddy's shards
  in host memory, refreshed every N steps: a worker lost with its shards is rebuilt from memory.
- ``--loop dcp``: what a torchrun user writes today: ``fully_shard`` (each direct child that
  holds parameters, then the root, as the session's default units), AdamW, and
  ``torch.distributed.checkpoint`` ``save``/``load`` with its ``FileSystemWriter``/``Reader``
  of ``get_state_dict``/``set_state_dict``, each checkpoint in ``step_N`` with a ``COMMITTED``
  marker written by rank 0 after the save returns; at start, the newest committed one is
  loaded (resharded to the new world by DCP).

Both build the model on the meta device (no storage), as torchtitan does and as a model that
does not fit one device must be built, and give it values only when no state comes from
elsewhere, with ``elastictrain.reset_parameters`` (each module as torch's constructors set it):
the session through ``init_weights`` (unit by unit, from its seed); the DCP loop shards the
storage-less model, allocates its shards (``to_empty``) and, with no checkpoint to load, applies
it to the shards (each rank draws its own shards' values: DTensor's random ops on CPU). A worker
that restarts or replaces one thus neither initialises nor broadcasts a full model it then
overwrites.

The model: an embedding, ``--layers`` pre-norm transformer blocks of width ``--width`` (4x MLP)
in an ``nn.Sequential``, a final norm and an untied output layer; parameters and AdamW state
total about ``12 * (12 * width**2 * layers + 2 * vocab * width)`` bytes (``--width 512
--layers 8``: ~310 MB). Synthetic token data, global batch ``--global-batch``, sequences of
``--length`` tokens, each rank its contiguous share of each step's batch (the step number
picks the batch, so a restart at step S trains the batches after S again). hsdp shards within
a node (``LOCAL_WORLD_SIZE``) and replicates across nodes, for both loops.

Events (``_train_session.py``'s format, one JSON line each in ``--events``): ``boot``, ``model``,
``restored`` (dcp), ``ready`` (the loop is about to train, with the ``restored`` step), ``step``
per applied optimizer step.

Usage: ``_train_sharded.py --events FILE --ckpt-dir DIR --loop session|dcp --sharding fsdp|hsdp``
``[--width 512 --layers 8]``
"""

from __future__ import annotations

import time

_SCRIPT_START = time.time()

import argparse  # noqa: E402 - the script's start time is taken before anything else
import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import Dataset  # noqa: E402

import elastictrain  # noqa: E402
from benchmarks._train_session import _PROC_START, _Log, _StepRecorder  # noqa: E402

_IMPORTS_DONE = time.time()

VOCAB = 256
STATE_BYTES_PER_PARAM = 12  # fp32 parameter + AdamW exp_avg + exp_avg_sq


class LM(nn.Module):
    """A decoder-style transformer LM with an untied head (a sharded session shards each child)."""

    def __init__(self, width: int, layers: int, length: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.blocks = nn.Sequential(*[
            nn.TransformerEncoderLayer(width, max(1, width // 64), 4 * width, dropout=0.0, batch_first=True,
                                       norm_first=True) for _ in range(layers)])
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.blocks(self.embed(ids))))


class Tokens(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Synthetic sequences: sample ``i`` is the same on every rank and every restart."""

    def __init__(self, samples: int, length: int) -> None:
        self.data = torch.randint(0, VOCAB, (samples, length + 1), generator=torch.Generator().manual_seed(5))

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data[i, :-1], self.data[i, 1:]


def _loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())


def _session_loop(args: argparse.Namespace, log: _Log, model: nn.Module, optimizer: torch.optim.Optimizer,
                  data: Tokens) -> None:
    recorder = _StepRecorder(log)
    session = elastictrain.Session(
        model, optimizer, data, global_batch_size=args.global_batch, epochs=1_000_000, max_steps=args.steps,
        seed=7, log_every=None, backend="gloo", sharding=args.sharding, checkpoint_dir=args.ckpt_dir,
        checkpoint_every=args.ckpt_every, keep_last=2, hooks=[recorder], redundancy_every=args.redundancy_every,
        init_weights=elastictrain.reset_parameters,
    )
    with session as s:
        recorder.session = s
        log.rank, log.world_size = s.rank, s.world_size
        log("ready", step=s.step, restored=s.restored.step if s.restored is not None else None,
            in_process=s.recovers_in_process)
        for step in s.steps():
            for micro in step:
                inputs, targets = micro.batch
                micro.backward(_loss(s.model, inputs, targets))
        log("done", step=s.step)


def _newest_committed(root: Path) -> int | None:
    steps = [int(p.name[5:]) for p in root.glob("step_*") if (p / "COMMITTED").exists()]
    return max(steps, default=None)


def _dcp_loop(args: argparse.Namespace, log: _Log, model: nn.Module, optimizer: torch.optim.Optimizer,
              data: Tokens) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    log.rank, log.world_size = rank, world
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if args.sharding == "hsdp":
        mesh = init_device_mesh("cpu", (world // local, local), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    for child in model.children():
        if any(True for _ in child.parameters()):
            fully_shard(child, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")  # this rank's shards, no values yet
    sharded_optimizer = torch.optim.AdamW(model.parameters(), **{
        k: v for k, v in optimizer.defaults.items() if k in ("lr", "betas", "eps", "weight_decay")})
    root = Path(args.ckpt_dir)
    root.mkdir(parents=True, exist_ok=True)
    step = 0
    newest = _newest_committed(root)
    if newest is not None:
        model_state, optim_state = get_state_dict(model, sharded_optimizer)
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, storage_reader=dcp.FileSystemReader(str(root / f"step_{newest}")))
        set_state_dict(model, sharded_optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        step = newest
        log("restored", step=newest)
    else:
        with torch.no_grad():
            model.apply(elastictrain.reset_parameters)
    log("ready", step=step, restored=newest, in_process=False)
    share = args.global_batch // world
    while step < args.steps:
        begin = (step * args.global_batch + rank * share) % (len(data) - share)
        inputs, targets = data.data[begin:begin + share, :-1], data.data[begin:begin + share, 1:]
        sharded_optimizer.zero_grad()
        _loss(model, inputs, targets).backward()
        sharded_optimizer.step()
        step += 1
        log("step", step=step)
        if step % args.ckpt_every == 0:
            model_state, optim_state = get_state_dict(model, sharded_optimizer)
            directory = root / f"step_{step}"
            dcp.save({"model": model_state, "optim": optim_state}, storage_writer=dcp.FileSystemWriter(str(directory)))
            dist.barrier()
            if rank == 0:
                (directory / "COMMITTED").touch()
    log("done", step=step)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description="sharded benchmark job")
    parser.add_argument("--events", required=True, help="JSON-lines event file shared by all ranks")
    parser.add_argument("--ckpt-dir", required=True)
    parser.add_argument("--loop", choices=("session", "dcp"), required=True)
    parser.add_argument("--sharding", choices=("fsdp", "hsdp"), required=True)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--length", type=int, default=32, help="tokens per sequence")
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=100_000, help="stop after this many applied steps")
    parser.add_argument("--ckpt-every", type=int, default=5)
    parser.add_argument("--redundancy-every", type=int, default=None,
                        help="session loop, fsdp: keep a buddy's shards in memory, refreshed every N steps")
    args = parser.parse_args()

    log = _Log(args.events)
    log("boot", proc_start=_PROC_START, script_start=_SCRIPT_START, imports_done=_IMPORTS_DONE)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = LM(args.width, args.layers, args.length)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    params = sum(p.numel() for p in model.parameters())
    log("model", width=args.width, layers=args.layers, params=params,
        state_mb=round(params * STATE_BYTES_PER_PARAM / 1e6, 1))
    data = Tokens(args.samples, args.length)
    if args.loop == "session":
        _session_loop(args, log, model, optimizer, data)
    else:
        _dcp_loop(args, log, model, optimizer, data)


if __name__ == "__main__":
    main()
