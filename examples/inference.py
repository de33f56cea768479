"""Inference through a compiled pipeline: greedy decoding with a Hugging Face Llama.

    python examples/inference.py              # full run
    python examples/inference.py --small      # quick run (or FXPIPE_EXAMPLE_SMALL=1)

A ``LlamaForCausalLM`` built from a small config in code (random weights) is compiled
once; under ``torch.no_grad()`` a call of the pipe runs only forward stages (no
activations kept for backward) and returns what the model returns, merged over
microbatches. The prompts are left-padded, with an ``attention_mask``. Each greedy step
feeds the whole sequence again (no KV cache), so every call has a new length: the
captured graph keeps the sequence length dynamic, and one compiled pipe serves them all.

The script checks that the pipe's logits equal eager ``model(...)``'s at every step and
that both decode the same tokens, prints the rewritten program and the timings, and
exits non-zero on any mismatch.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import fxpipe

VOCAB = 64


def left_padded_prompts(batch: int, length: int, generator: torch.Generator
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)``; row ``i`` has ``i`` pad tokens (id 0) on the left."""
    ids = torch.randint(1, VOCAB, (batch, length), generator=generator)
    mask = torch.ones_like(ids)
    for row in range(batch):
        pad = min(row, length - 1)
        ids[row, :pad], mask[row, :pad] = 0, 0
    return ids, mask


def main(argv: list[str] | None = None) -> int:
    """Compile, decode through the pipe and eagerly, compare; returns the exit code."""
    small_default = os.environ.get("FXPIPE_EXAMPLE_SMALL", "") not in ("", "0")
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", default=small_default,
                    help="a quick run (also FXPIPE_EXAMPLE_SMALL=1)")
    ap.add_argument("--new-tokens", type=int, help="tokens to generate per prompt")
    args = ap.parse_args(argv)
    hidden, layers, batch, prompt = (64, 2, 4, 8) if args.small else (256, 8, 8, 16)
    new_tokens = args.new_tokens or (4 if args.small else 16)

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=128, use_cache=False)
    model = LlamaForCausalLM(config).eval()
    ids, mask = left_padded_prompts(batch, prompt, torch.Generator().manual_seed(0))

    start = time.perf_counter()
    pipe = fxpipe.compile(model, example_kwargs={"input_ids": ids, "attention_mask": mask})
    compile_s = time.perf_counter() - start
    print(f"compiled in {compile_s:.1f} s: {len(pipe.layers)} layers, {len(pipe.stages)} "
          f"stages on {', '.join(d.name for d in pipe.devices)}\n")

    # print(pipe) lists what pipe(x) runs: its Program's actions (transfers, stage calls,
    # host actions); pipe.code("infer") every stage GraphModule an inference call runs.
    # Here: the listing, and stage 1's transfer nodes.
    print(str(pipe).rstrip())
    stage_1 = pipe.stages[1].code
    transfers = [line.split(";")[0] for line in stage_1.splitlines()
                 if "torch.ops.fxpipe." in line]
    print(f"\n# stage_1: {len(stage_1.splitlines())} lines, of which the transfers are:")
    for line in transfers:
        print(line if len(line) <= 110 else line[:100] + " ...")
    print()

    pipe_ms: list[float] = []
    eager_ms: list[float] = []
    worst = 0.0
    with torch.no_grad():
        for _ in range(new_tokens):
            start = time.perf_counter()
            out = pipe(input_ids=ids, attention_mask=mask)
            pipe_ms.append((time.perf_counter() - start) * 1e3)
            start = time.perf_counter()
            ref = model(input_ids=ids, attention_mask=mask)
            eager_ms.append((time.perf_counter() - start) * 1e3)

            torch.testing.assert_close(out.logits, ref.logits)  # raises on a mismatch
            worst = max(worst, (out.logits - ref.logits).abs().max().item())
            next_pipe = out.logits[:, -1].argmax(-1, keepdim=True)
            next_eager = ref.logits[:, -1].argmax(-1, keepdim=True)
            if not torch.equal(next_pipe, next_eager):
                print(f"FAILED: at length {ids.shape[1]} the pipe decoded "
                      f"{next_pipe.flatten().tolist()}, eager {next_eager.flatten().tolist()}",
                      file=sys.stderr)
                return 1
            ids = torch.cat([ids, next_pipe], dim=1)
            mask = torch.cat([mask, torch.ones_like(next_pipe)], dim=1)

    print(f"generated {new_tokens} tokens for {batch} prompts: logits equal to eager at every "
          f"step (max abs difference {worst:.1e}), same tokens")
    print(f"last row: {ids[-1].tolist()}")
    print(f"per call, median over {new_tokens} lengths: pipe {statistics.median(pipe_ms):.1f} ms, "
          f"eager {statistics.median(eager_ms):.1f} ms (the first pipe call, "
          f"{pipe_ms[0]:.1f} ms, also builds its schedule; CPU timings are noisy, "
          f"see benchmarks/ for measured ratios)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
