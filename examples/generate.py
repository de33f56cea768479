"""Generate, score, train a step, generate again: an RL-style loop on one compiled pipe.

    python examples/generate.py              # full run
    python examples/generate.py --small      # quick run (or FXPIPE_EXAMPLE_SMALL=1)

A ``LlamaForCausalLM`` built from a small config in code (random weights) is compiled
once. Each round:

1. ``pipe.generate`` samples continuations of left-padded prompts with a KV cache (the
   prompt through the stages once, then one token of every sequence per step);
2. a reward scores each continuation (here: the share of its tokens below ``vocab / 4``,
   a target the policy can learn);
3. one REINFORCE step: ``forward_backward`` of the reward-weighted log-likelihood of the
   sampled tokens, with the optimizer streamed into the backward (``optimizer=``);
4. the next round generates from the updated weights: the same host copy, no re-compile.

The first round also checks greedy ``pipe.generate`` against ``transformers``'
``model.generate`` (token for token) and prints what a decode step runs
(``pipe.program("generate")``). Exits non-zero if the tokens differ or the reward did not
rise.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

import fxpipe


def reward(new_tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    return (new_tokens < vocab // 4).float().mean(-1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", default=bool(os.environ.get("FXPIPE_EXAMPLE_SMALL")))
    ap.add_argument("--rounds", type=int, default=None)
    args = ap.parse_args()
    rounds = args.rounds or (6 if args.small else 30)
    vocab, batch, prompt, new = 128, 8, 8, 12

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        pad_token_id=0, eos_token_id=None)).eval()
    ids = torch.randint(1, vocab, (batch, prompt))
    mask = torch.ones(batch, prompt, dtype=torch.long)
    mask[: batch // 2, :3] = 0           # half the prompts are shorter: left padding
    ids[mask == 0] = 0
    pipe = fxpipe.compile(model, example_inputs=(ids,), example_kwargs={"attention_mask": mask})

    greedy = pipe.generate(ids, mask, max_new_tokens=new)
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False)
    same = torch.equal(greedy, ref)
    print(f"greedy pipe.generate equals transformers' model.generate token for token: {same}")
    print("\nWhat generate runs (prefill, then every decode step):\n")
    print(pipe.program("generate"))

    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    rewards = []
    start = time.perf_counter()
    for r in range(rounds):
        model.eval()
        seqs = pipe.generate(ids, mask, max_new_tokens=new, do_sample=True, temperature=1.0,
                             generator=gen)
        score = reward(seqs[:, prompt:], vocab)
        rewards.append(score.mean().item())
        advantage = score - score.mean()
        full_mask = torch.cat([mask, torch.ones(batch, new, dtype=torch.long)], 1)
        model.train()

        def loss_fn(out, label):     # called per microbatch, with its rows of the label
            tokens, adv = label
            logp = F.log_softmax(out.logits[:, prompt - 1:-1].float(), -1)
            taken = logp.gather(-1, tokens[:, prompt:, None]).squeeze(-1)
            return -(adv[:, None] * taken).mean()

        pipe.forward_backward((seqs,), {"attention_mask": full_mask}, label=(seqs, advantage),
                              loss_fn=loss_fn, optimizer=opt)
        opt.zero_grad(set_to_none=True)
        print(f"round {r + 1}/{rounds}: mean reward {rewards[-1]:.3f}", flush=True)
    elapsed = time.perf_counter() - start
    first, last = sum(rewards[:2]) / 2, sum(rewards[-2:]) / 2
    print(f"reward {first:.3f} -> {last:.3f} over {rounds} rounds of generate + train "
          f"({elapsed:.1f} s)")
    if not same or not last > first:
        print("FAILED: " + ("tokens differ from transformers" if not same else "reward did not rise"),
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
