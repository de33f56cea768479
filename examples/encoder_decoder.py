"""Two pipelines chained: an encoder pipe feeding a decoder pipe (a seq2seq model).

    python examples/encoder_decoder.py              # full run
    python examples/encoder_decoder.py --small      # quick run (or FXPIPE_EXAMPLE_SMALL=1)

The encoder and the decoder are separate modules, each compiled into its own pipeline.
The decoder's blocks all read the encoder output (``memory``), which fxpipe carries
along the decoder's layer chain.

Inference: the encoder pipe is compiled with ``RunConfig(merge_output=False)``, so it
returns ``fxpipe.PackedData`` (one tensor per microbatch) instead of concatenating its
microbatches; given to the decoder pipe, each microbatch goes straight into the
decoder's matching microbatch. Both pipes must use the same ``num_microbatch``.

Training: gradients do **not** flow back through ``PackedData`` in this version of
fxpipe (with grad enabled its tensors do not require grad, and the encoder silently gets
no ``.grad``). So the training step asks the encoder pipe for its merged output instead
(``run_config=RunConfig(merge_output=True)``): a tensor that requires grad, which the
decoder pipe accepts like any input; ``loss.backward()`` then runs the decoder's
pipelined backward, hands the gradient of ``memory`` to the encoder pipe and runs its
backward too.

The script checks inference and every gradient against the eager composed model and
exits non-zero on any mismatch.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import fxpipe


def attention(query: torch.Tensor, source: torch.Tensor, q: nn.Linear, kv: nn.Linear,
              out: nn.Linear, heads: int, causal: bool) -> torch.Tensor:
    """Multi-head attention of ``query`` over ``source`` (self-attention when they are equal)."""
    b, t, d = query.shape
    s = source.shape[1]
    k, v = kv(source).split(d, dim=-1)
    q_ = q(query).view(b, t, heads, d // heads).transpose(1, 2)
    k = k.view(b, s, heads, d // heads).transpose(1, 2)
    v = v.view(b, s, heads, d // heads).transpose(1, 2)
    a = F.scaled_dot_product_attention(q_, k, v, is_causal=causal)
    return out(a.transpose(1, 2).reshape(b, t, d))


class EncoderBlock(nn.Module):
    """Pre-norm self-attention and MLP."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.q, self.kv, self.o = nn.Linear(dim, dim), nn.Linear(dim, 2 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + attention(h, h, self.q, self.kv, self.o, self.heads, causal=False)
        return x + self.mlp(self.norm2(x))


class DecoderBlock(nn.Module):
    """Pre-norm causal self-attention, cross-attention over ``memory``, MLP."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2, self.norm3 = nn.LayerNorm(dim), nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.q, self.kv, self.o = nn.Linear(dim, dim), nn.Linear(dim, 2 * dim), nn.Linear(dim, dim)
        self.xq, self.xkv, self.xo = nn.Linear(dim, dim), nn.Linear(dim, 2 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + attention(h, h, self.q, self.kv, self.o, self.heads, causal=True)
        x = x + attention(self.norm2(x), memory, self.xq, self.xkv, self.xo, self.heads, causal=False)
        return x + self.mlp(self.norm3(x))


class Encoder(nn.Module):
    """Token + learned position embeddings, ``depth`` encoder blocks, a final norm."""

    def __init__(self, vocab: int, dim: int, heads: int, depth: int, max_len: int = 64):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(max_len, dim) * 0.02)
        self.blocks = nn.ModuleList([EncoderBlock(dim, heads) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)

    def forward(self, src: torch.Tensor) -> torch.Tensor:
        x = self.embed(src) + self.pos[: src.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


class Decoder(nn.Module):
    """Embeddings, ``depth`` decoder blocks all reading ``memory``, a norm and a vocab head."""

    def __init__(self, vocab: int, dim: int, heads: int, depth: int, max_len: int = 64):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(max_len, dim) * 0.02)
        self.blocks = nn.ModuleList([DecoderBlock(dim, heads) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tgt: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        x = self.embed(tgt) + self.pos[: tgt.shape[1]]
        for block in self.blocks:
            x = block(x, memory)
        return self.head(self.norm(x))


def check_grads(models: list[nn.Module], refs: list[nn.Module]) -> float:
    """Largest gradient difference; raises if a parameter has a gradient on one side only."""
    worst = 0.0
    for model, ref in zip(models, refs):
        for (name, p), r in zip(model.named_parameters(), ref.parameters()):
            if p.grad is None or r.grad is None:
                raise AssertionError(f"{type(model).__name__}.{name}: .grad is "
                                     f"{'None' if p.grad is None else 'set'} through the pipes, "
                                     f"{'None' if r.grad is None else 'set'} in eager")
            torch.testing.assert_close(p.grad, r.grad, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, n=name: f"{type(model).__name__}.{n}: {m}")
            worst = max(worst, (p.grad - r.grad).abs().max().item())
    return worst


def main(argv: list[str] | None = None) -> int:
    """Compile both pipes, check inference and training against eager; returns the exit code."""
    small_default = os.environ.get("FXPIPE_EXAMPLE_SMALL", "") not in ("", "0")
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", default=small_default,
                    help="a quick run (also FXPIPE_EXAMPLE_SMALL=1)")
    args = ap.parse_args(argv)
    vocab, dim, depth, batch, src_len, tgt_len = \
        (32, 32, 2, 6, 10, 7) if args.small else (256, 128, 6, 12, 32, 24)

    torch.manual_seed(0)
    encoder, decoder = Encoder(vocab, dim, 4, depth), Decoder(vocab, dim, 4, depth)
    src = torch.randint(0, vocab, (batch, src_len))
    tgt = torch.randint(0, vocab, (batch, tgt_len + 1))
    tgt_in, tgt_out = tgt[:, :-1], tgt[:, 1:]

    start = time.perf_counter()
    devices = [fxpipe.VirtualDevice(), fxpipe.VirtualDevice()]   # both pipes share them
    enc_pipe = fxpipe.compile(encoder, (src,), devices=devices,
                              config=fxpipe.RunConfig(merge_output=False))
    with torch.no_grad():
        memory_example = encoder(src)
    dec_pipe = fxpipe.compile(decoder, (tgt_in, memory_example), devices=devices)
    print(f"compiled encoder ({len(enc_pipe.layers)} layers, plan {enc_pipe.plan}) and decoder "
          f"({len(dec_pipe.layers)} layers, plan {dec_pipe.plan}) in "
          f"{time.perf_counter() - start:.1f} s")

    # -- inference: PackedData from the encoder straight into the decoder --------------
    with torch.no_grad():
        memory = enc_pipe(src)                        # fxpipe.PackedData, one per microbatch
        logits = dec_pipe(tgt_in, memory)
        expected = decoder(tgt_in, encoder(src))
    print(f"encoder pipe returned {type(memory).__name__} of {len(memory)} microbatches, "
          f"shapes {[tuple(m.shape) for m in memory]}")
    torch.testing.assert_close(logits, expected)
    print(f"inference: decoder(encoder(src)) through two pipes equals eager "
          f"(max abs difference {(logits - expected).abs().max().item():.1e})")

    # -- training through the chain (merged memory; see the module docstring) ----------
    enc_ref, dec_ref = copy.deepcopy(encoder), copy.deepcopy(decoder)
    memory = enc_pipe(src, run_config=fxpipe.RunConfig(merge_output=True))  # requires grad
    loss = F.cross_entropy(dec_pipe(tgt_in, memory).flatten(0, 1), tgt_out.flatten())
    loss.backward()                                   # decoder backward, then encoder's
    ref_loss = F.cross_entropy(dec_ref(tgt_in, enc_ref(src)).flatten(0, 1), tgt_out.flatten())
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss)
    try:
        worst = check_grads([encoder, decoder], [enc_ref, dec_ref])
    except AssertionError as e:
        print(f"FAILED: {e}", file=sys.stderr)
        return 1
    n = sum(p.numel() for m in (encoder, decoder) for p in m.parameters())
    print(f"training: loss {loss.item():.4f} (eager {ref_loss.item():.4f}); all {n:,} "
          f"gradients of encoder and decoder equal eager (max abs difference {worst:.1e})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
