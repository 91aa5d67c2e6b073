"""A small character-level transformer language model, trained elastically on generated text.

The corpus is generated (no downloads): additions (``17+25=42;``) and short
sentences from a tiny grammar, so after a few hundred steps the model visibly
learns to add and to spell. It shows what a realistic job uses:

- gradient accumulation (``--micro-batch``) under a fixed global batch,
- a warmup + cosine learning-rate schedule (checkpointed with the rest),
- gradient clipping, and mixed precision (``--precision bf16`` on CPU, auto on GPU),
- hooks: a tokens/s reporter that also reacts to world-size changes,
- extra checkpointed state (the best loss so far),
- rank-aware logging (``ELASTICTRAIN_LOG_JSON=1`` for JSON lines).

Run it on two local nodes that may grow to three::

    elastictrain run --local-nodes 2 --min-nodes 1 --max-nodes 3 examples/transformer_lm.py

``--sharding fsdp`` shards the model, its gradients and the optimizer state across the ranks
(FSDP2), ``--sharding hsdp`` within each node (replicated across nodes); checkpoints are then
sharded too and restore at any world size, and the job recovers in place as a DDP one does
(see docs/sharding.md)::

    elastictrain run --local-nodes 2 --nproc-per-node 2 examples/transformer_lm.py --sharding hsdp

Sharded, the model is built on the meta device (no storage, as a model that does not fit one
device must be) and the session gives it values through ``init_weights`` (``TinyLM.init_weights``,
unit by unit: no rank holds the whole model). Each transformer block is an FSDP unit of its own
(``shard_units``: gathered for its forward and backward only, as torchtitan wraps each block); the
embedding and the output layer share one weight (tied, GPT-2 style), so they stay together in the
root's unit.

Checkpoints go to ``--checkpoint-dir`` (default: under the temp dir, named
after the run id) and are removed when the job finishes, unless
``--keep-checkpoints``; start the same command again to resume a run that failed.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import shutil
import tempfile
import time
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.data import Dataset

import elastictrain

_NOUNS = ["cat", "dog", "bird", "child", "robot", "farmer", "teacher", "river"]
_VERBS = ["sees", "likes", "follows", "draws", "finds", "hears"]
_ADJS = ["small", "red", "quiet", "happy", "old", "bright"]


def generate_corpus(chars: int, seed: int = 0) -> str:
    """Deterministic text: sums and grammar sentences, about ``chars`` characters."""
    rng = random.Random(seed)
    parts: list[str] = []
    size = 0
    while size < chars:
        if rng.random() < 0.5:
            a, b = rng.randrange(100), rng.randrange(100)
            part = f"{a}+{b}={a + b};"
        else:
            part = (f"the {rng.choice(_ADJS)} {rng.choice(_NOUNS)} {rng.choice(_VERBS)} "
                    f"the {rng.choice(_NOUNS)}.")
        parts.append(part)
        size += len(part)
    return " ".join(parts)


class CharWindows(Dataset):
    """Overlapping windows of ``length + 1`` characters: inputs and next-character targets."""

    def __init__(self, text: str, length: int) -> None:
        self.vocab = sorted(set(text))
        self.index = {c: i for i, c in enumerate(self.vocab)}
        self.data = torch.tensor([self.index[c] for c in text], dtype=torch.long)
        self.length = length
        self.stride = length // 2

    def __len__(self) -> int:
        return (len(self.data) - self.length - 1) // self.stride

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.data[i * self.stride:i * self.stride + self.length + 1]
        return chunk[:-1], chunk[1:]

    def encode(self, text: str) -> torch.Tensor:
        return torch.tensor([self.index[c] for c in text], dtype=torch.long)

    def decode(self, ids: torch.Tensor) -> str:
        return "".join(self.vocab[i] for i in ids.tolist())


class TinyLM(nn.Module):
    """Pre-norm decoder-only transformer with a causal mask and tied embeddings."""

    def __init__(self, vocab: int, length: int, width: int, layers: int, heads: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        # Tied by holding the embedding's weight in the output layer (not ``h @ embed.weight.T``
        # in the root's forward): sharded, a unit must hold every module that uses a weight.
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight
        self.position = nn.Parameter(torch.zeros(length, width))
        block = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.1, batch_first=True,
                                           norm_first=True, activation="gelu")
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(length), persistent=False)
        nn.init.normal_(self.position, std=0.02)

    @staticmethod
    def init_weights(module: nn.Module) -> None:
        """``Session(init_weights=...)`` for a model built on the meta device: a ``Module.apply``
        function setting each module's own parameters and buffers as the constructor does."""
        if isinstance(module, TinyLM):
            nn.init.normal_(module.position, std=0.02)
            nn.init.normal_(module.embed.weight)  # tied: the embedding's init stands, as in the constructor
            module.mask.copy_(nn.Transformer.generate_square_subsequent_mask(module.mask.shape[0]))
        else:
            elastictrain.reset_parameters(module)  # as torch's constructors set each module

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        n = ids.shape[1]
        h = self.embed(ids) + self.position[:n]
        h = self.blocks(h, mask=self.mask[:n, :n], is_causal=True)
        h = self.norm(h)
        return self.head(h)


class Throughput(elastictrain.Hooks):
    """Reports tokens/s every ``every`` steps, and notes world-size changes."""

    def __init__(self, tokens_per_sample: int, every: int) -> None:
        self.tokens, self.every = tokens_per_sample, every
        self.log = elastictrain.get_logger("transformer_lm.hooks")

    def on_world_change(self, *, old_world_size: int, new_world_size: int) -> None:
        self.log.info("world size %d -> %d: same global batch, per-rank share rescaled",
                      old_world_size, new_world_size)

    def on_step_end(self, *, step: int, loss: float, throughput: float) -> None:
        if step % self.every == 0:
            self.log.info("step %d: loss %.3f (%.2f bits/char), %.0f tokens/s", step, loss,
                          loss / math.log(2), throughput * self.tokens)


class BestLoss(elastictrain.Hooks):
    """Keeps the lowest global loss in a dict the session checkpoints (``extra_state``)."""

    def __init__(self, best: dict[str, float]) -> None:
        self.best = best

    def on_step_end(self, *, step: int, loss: float, throughput: float) -> None:
        # sync_loss=True: every rank sees the same global loss, so the dict stays identical.
        if loss < self.best["loss"]:
            self.best.update(loss=loss, step=step)


def schedule(warmup: int, total: int) -> Callable[[int], float]:
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))
    return factor


@torch.no_grad()
def complete(model: TinyLM, data: CharWindows, prompt: str, length: int, device: torch.device) -> str:
    model.eval()
    ids = data.encode(prompt).to(device)[None]
    for _ in range(length):
        logits = model(ids[:, -data.length:])[:, -1]
        ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=1)
    model.train()
    return data.decode(ids[0])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=16, help="global batch (sequences per step)")
    parser.add_argument("--micro-batch", type=int, default=8, help="sequences per forward pass per rank")
    parser.add_argument("--length", type=int, default=32, help="characters per sequence")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16", "fp16"])
    parser.add_argument("--checkpoint-dir", default=None)
    parser.add_argument("--checkpoint-every", type=int, default=50)
    parser.add_argument("--keep-checkpoints", action="store_true")
    parser.add_argument("--sharding", default="ddp", choices=["ddp", "fsdp", "hsdp"],
                        help="ddp: every rank holds the model; fsdp: sharded across ranks; hsdp: within each node")
    args = parser.parse_args()

    context = elastictrain.WorkerContext.from_env()
    elastictrain.setup_logging(context)
    log = elastictrain.get_logger("transformer_lm", context)
    checkpoint_dir = args.checkpoint_dir or os.path.join(tempfile.gettempdir(), f"elastictrain-lm-{context.run_id}")

    data = CharWindows(generate_corpus(400_000), args.length)
    torch.manual_seed(0)  # identical initial weights on every rank and every restart
    sharded = args.sharding != "ddp"
    with torch.device("meta" if sharded else "cpu"):  # sharded: no storage; init_weights gives it values
        model = TinyLM(len(data.vocab), args.length, args.width, args.layers, args.heads)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and n != "position"]
    rest = [p for n, p in model.named_parameters() if p.dim() < 2 or n == "position"]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                                  lr=args.lr, betas=(0.9, 0.95))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule(min(50, args.steps // 10), args.steps))
    best = {"loss": float("inf"), "step": 0}

    with elastictrain.Session(
        model, optimizer, data,
        global_batch_size=args.batch, micro_batch_size=args.micro_batch,
        epochs=1_000, max_steps=args.steps, seed=1,
        scheduler=scheduler, grad_clip_norm=1.0, precision=args.precision,
        checkpoint_dir=checkpoint_dir, checkpoint_every=args.checkpoint_every, sharding=args.sharding,
        # Sharded: one unit per transformer block (then the root: embedding, tied head, norm).
        shard_units={nn.TransformerEncoderLayer} if sharded else None,
        init_weights=TinyLM.init_weights if sharded else None,
        hooks=[Throughput(args.length, every=25), BestLoss(best)], extra_state={"best": best},
        sync_loss=True, log_every=None,
    ) as session:
        log.info("%d parameters, %d training windows, vocabulary of %d", sum(p.numel() for p in model.parameters()),
                 len(data), len(data.vocab))
        started = time.perf_counter()
        for step in session.steps():
            for micro in step:
                inputs, targets = micro.batch
                logits = session.model(inputs)
                micro.backward(nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten()))
        elapsed = time.perf_counter() - started
        # Full tensors on rank 0 (every rank takes part when sharded): sample from a whole copy.
        weights = session.full_state_dict()
        if session.rank == 0:
            log.info("trained to step %d in %.1fs; best loss %.3f at step %d", session.step, elapsed,
                     best["loss"], best["step"])
            whole = TinyLM(len(data.vocab), args.length, args.width, args.layers, args.heads).to(session.device)
            whole.load_state_dict(weights)
            for prompt in ("17+25=", "the small "):
                log.info("sample: %r", complete(whole, data, prompt, 14, session.device))
    if context.rank == 0 and not args.keep_checkpoints:
        shutil.rmtree(checkpoint_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
