"""The fxpipe demo: compile a small Llama-style model, print it, and train it.

    python -m fxpipe.demo [--steps 200] [--layers 4] [--dim 64] [--quiet]

The task is synthetic and learnable: each sequence is an arithmetic progression modulo
the vocabulary (``x[i+1] = x[i] + step``, with a random start and a step from a small
set), so the model must read the previous tokens to predict the next; the loss falls
from ~ln(vocab) towards zero within a few hundred steps.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class DecoderLayer(nn.Module):
    """Pre-norm attention with rotary embeddings, then a SwiGLU MLP (as in Llama)."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.attn_norm = RMSNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)
        self.mlp_norm = RMSNorm(dim)
        self.gate = nn.Linear(dim, 2 * dim, bias=False)
        self.up = nn.Linear(dim, 2 * dim, bias=False)
        self.down = nn.Linear(2 * dim, dim, bias=False)

    def forward(self, x, cos, sin):
        b, t, d = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).split(d, dim=-1)
        q, k, v = (y.view(b, t, self.heads, d // self.heads).transpose(1, 2) for y in (q, k, v))
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, d))
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


def rotary_tables(seq: int, head_dim: int, device=None,
                  dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables of rotary position embeddings for ``seq`` positions, computed in
    fp32 and given in ``dtype`` (the activations': bf16 tables keep q and k in bf16 next
    to v, as scaled_dot_product_attention requires)."""
    inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))
    freqs = torch.outer(torch.arange(seq, device=device).float(), inv)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class TinyLlama(nn.Module):
    """A Llama-shaped decoder: tied embedding/head, decoder layers in a ModuleList."""

    def __init__(self, vocab: int = 64, dim: int = 64, heads: int = 4, depth: int = 4):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList([DecoderLayer(dim, heads) for _ in range(depth)])
        self.norm = RMSNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.embed.weight
        self.head_dim = dim // heads
        nn.init.normal_(self.embed.weight, std=0.02)

    def forward(self, ids):
        x = self.embed(ids)
        cos, sin = rotary_tables(ids.shape[1], self.head_dim, ids.device, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.norm(x))


def progression_batch(batch: int, seq: int, vocab: int, generator: torch.Generator):
    """Token sequences x[i+1] = x[i] + step (mod vocab); returns (inputs, next-token labels)."""
    start = torch.randint(0, vocab, (batch, 1), generator=generator)
    step = torch.randint(1, 4, (batch, 1), generator=generator)
    seqs = (start + step * torch.arange(seq + 1)) % vocab
    return seqs[:, :-1], seqs[:, 1:]


def main(argv: list[str] | None = None) -> int:
    import fxpipe

    ap = argparse.ArgumentParser(prog="python -m fxpipe.demo", description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--devices", default=None,
                    help="comma-separated devices, e.g. 'cuda:0,cuda:1' or 'cpu' (default: every "
                    "visible GPU, else two virtual CPU devices)")
    ap.add_argument("--quiet", action="store_true", help="no graph printout")
    ap.add_argument("--timeline", default="timeline.png",
                    help="draw the last step's measured timeline here ('' to skip; needs matplotlib)")
    args = ap.parse_args(argv)

    torch.manual_seed(0)
    vocab = 64
    model = TinyLlama(vocab=vocab, dim=args.dim, depth=args.layers)
    gen = torch.Generator().manual_seed(0)
    ids, labels = progression_batch(args.batch, args.seq, vocab, gen)

    t0 = time.perf_counter()
    devices = args.devices.split(",") if args.devices else None
    pipe = fxpipe.compile(model, example_inputs=(ids,), devices=devices)
    print(f"compiled {sum(p.numel() for p in model.parameters()):,} parameters into "
          f"{len(pipe.layers)} layers and {len(pipe.stages)} stages on "
          f"{', '.join(d.name for d in pipe.devices)} in {time.perf_counter() - t0:.1f} s")
    print(f"plan: {pipe.plan}\n")
    if not args.quiet:
        print("The rewritten program: what pipe(x) runs, every action of its Program "
              "(pipe.code() prints every stage a training step runs, pipe.program() its "
              "lanes):\n")
        print(str(pipe).rstrip())
        middle = pipe.stages[len(pipe.stages) // 2]   # the only one where the model fits a device
        print(f"\n{middle.code.strip()}\n")

    def loss_fn(logits, target):
        return F.cross_entropy(logits.flatten(0, 1), target.flatten())

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    bar = _progress(args.steps)
    first = last = None
    tokens = 0
    start = time.perf_counter()
    recording = None
    for step in range(args.steps):
        ids, labels = progression_batch(args.batch, args.seq, vocab, gen)
        if step == args.steps - 1 and args.timeline:
            with pipe.trace() as recording:  # the last step, as the devices ran it
                loss = pipe.forward_backward((ids,), label=labels, loss_fn=loss_fn)
        else:
            loss = pipe.forward_backward((ids,), label=labels, loss_fn=loss_fn)
        opt.step()
        opt.zero_grad(set_to_none=True)
        tokens += ids.numel()
        last = loss.item()
        first = last if first is None else first
        bar.update(1, loss=last, tok_s=tokens / (time.perf_counter() - start))
    bar.close()
    print(f"loss {first:.3f} -> {last:.3f} (ln(vocab) = {math.log(vocab):.3f}) over {args.steps} "
          f"steps, {tokens / (time.perf_counter() - start):,.0f} tokens/s")
    if recording is not None:
        tl = recording.timeline
        try:
            tl.plot(args.timeline)
            print(f"timeline of the last step ({tl.makespan:.0f} ms, bubble {tl.bubble_ratio:.1f}%): "
                  f"{args.timeline}")
        except ImportError:
            print("install matplotlib (pip install 'fxpipe[plot]') to draw the timeline")
    if not last < first:
        print("loss did not fall", file=sys.stderr)
        return 1
    return 0


class _progress:
    """tqdm when installed (the demo extra), else a plain one-line counter."""

    def __init__(self, total: int):
        try:
            from tqdm import tqdm
            self.bar = tqdm(total=total, desc="training", unit="step", dynamic_ncols=True)
        except ImportError:
            self.bar = None
        self.total, self.n = total, 0

    def update(self, n: int, **stats: float) -> None:
        self.n += n
        text = ", ".join(f"{k}={v:.3f}" if v < 100 else f"{k}={v:,.0f}" for k, v in stats.items())
        if self.bar is not None:
            self.bar.set_postfix_str(text, refresh=False)
            self.bar.update(n)
        elif self.n % max(1, self.total // 20) == 0 or self.n == self.total:
            print(f"step {self.n}/{self.total} {text}", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


if __name__ == "__main__":
    raise SystemExit(main())
