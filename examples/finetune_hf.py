"""Fine-tune a Hugging Face ``LlamaForCausalLM`` with fxpipe and a plain AdamW loop.

    python examples/finetune_hf.py              # full run
    python examples/finetune_hf.py --small      # quick run (or FXPIPE_EXAMPLE_SMALL=1)

The model is built from a small ``LlamaConfig`` in code (random weights, nothing is
downloaded) and compiled with plain ``fxpipe.compile(model, example_kwargs=...)``: no
per-model code. The task is synthetic and learnable: arithmetic progressions modulo the
vocabulary (``fxpipe.demo.progression_batch``). Some rows are right-padded: their
``attention_mask`` is 0 there and their labels are -100, so the model's own ``labels=``
loss ignores them.

One optimizer step = ``--accum`` calls of ``pipe.forward_backward(...)`` (each a fused,
pipelined forward + loss + backward that adds into the model's own ``.grad``), then
``opt.step()`` and ``opt.zero_grad()``, exactly as in an eager loop. The eager-style
form works too::

    out = pipe(**batch)                 # differentiable, returns CausalLMOutputWithPast
    (out.loss / accum).backward()       # the pipelined backward, into .grad

Either way the model's loss is a mean over each microbatch's own tokens, combined over
microbatches (``forward_backward`` weights them by rows, ``out.loss`` is their plain
mean): with padded rows that is close to, not exactly, eager's mean over the batch's
tokens. docs/user-guide.md shows the exact form (``loss_reduction="sum"``).

The script exits non-zero unless the loss fell to less than half its first value.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import fxpipe
from fxpipe.demo import progression_batch

VOCAB = 64


def make_batch(batch: int, seq: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """A padded batch in Hugging Face form: ``input_ids``, ``attention_mask``, ``labels``.

    Every other row is right-padded by a random amount (mask 0, label -100 there).
    Hugging Face shifts ``labels`` itself, so labels are the input ids.
    """
    ids, _ = progression_batch(batch, seq, VOCAB, generator)
    mask = torch.ones_like(ids)
    for row in range(0, batch, 2):
        keep = int(torch.randint(seq // 2, seq + 1, (), generator=generator))
        mask[row, keep:] = 0
    ids = ids.masked_fill(mask == 0, 0)          # pad token 0
    labels = ids.masked_fill(mask == 0, -100)    # a new tensor, not an alias of input_ids
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def build_model(hidden: int, layers: int) -> LlamaForCausalLM:
    """A small Llama from a config, with random weights (nothing is downloaded)."""
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=128, use_cache=False)
    return LlamaForCausalLM(config)


def main(argv: list[str] | None = None) -> int:
    """Compile, train, report; returns the exit code (1 if the loss did not fall)."""
    small_default = os.environ.get("FXPIPE_EXAMPLE_SMALL", "") not in ("", "0")
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", default=small_default,
                    help="a quick run (also FXPIPE_EXAMPLE_SMALL=1)")
    ap.add_argument("--steps", type=int, help="optimizer steps")
    ap.add_argument("--accum", type=int, default=2, help="forward_backward calls per step")
    ap.add_argument("--batch", type=int, default=8, help="rows per forward_backward call")
    ap.add_argument("--lr", type=float, help="AdamW learning rate")
    args = ap.parse_args(argv)
    steps = args.steps or (20 if args.small else 100)
    lr = args.lr or (1e-2 if args.small else 3e-3)
    hidden, layers, seq = (64, 2, 16) if args.small else (128, 4, 32)

    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    model = build_model(hidden, layers)

    start = time.perf_counter()
    pipe = fxpipe.compile(model, example_kwargs=make_batch(args.batch, seq, gen))
    print(f"compiled LlamaForCausalLM ({sum(p.numel() for p in model.parameters()):,} "
          f"parameters, {layers} decoder layers) into {len(pipe.layers)} layers on "
          f"{', '.join(d.name for d in pipe.devices)} in {time.perf_counter() - start:.1f} s; "
          f"plan {pipe.plan}")

    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses: list[float] = []
    tokens = 0
    start = time.perf_counter()
    for step in range(1, steps + 1):
        step_loss = 0.0
        for _ in range(args.accum):
            batch = make_batch(args.batch, seq, gen)
            # The model computes its own loss from labels=; scale it for accumulation.
            loss = pipe.forward_backward((), batch, loss_fn=lambda out, _: out.loss / args.accum)
            step_loss += loss.item()
            tokens += int(batch["attention_mask"].sum())
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(step_loss)
        if step == 1 or step % max(1, steps // 10) == 0 or step == steps:
            print(f"step {step:4d}/{steps}  loss {step_loss:.3f}  "
                  f"{tokens / (time.perf_counter() - start):,.0f} tokens/s", flush=True)

    first, last = losses[0], sum(losses[-3:]) / len(losses[-3:])
    print(f"loss {first:.3f} -> {last:.3f} over {steps} steps of {args.accum} x {args.batch} "
          f"rows (ln(vocab) = {math.log(VOCAB):.3f})")
    if not last < 0.5 * first:
        print(f"FAILED: the loss did not fall below half its first value ({0.5 * first:.3f})",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
