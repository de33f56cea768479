"""GRPO on one compiled pipe: generate a group of completions per prompt, score them,
take clipped policy-gradient steps on group-normalized advantages, generate again.

    python examples/grpo.py              # full run
    python examples/grpo.py --small      # quick run (or FXPIPE_EXAMPLE_SMALL=1)

GRPO (Group Relative Policy Optimization, DeepSeekMath) needs no value model: the baseline
of a completion is the mean reward of the other completions of the same prompt. A
``LlamaForCausalLM`` built from a small config in code (random weights) is compiled once;
each round, on the same pipe and the same host copy of the weights:

1. **Generate.** Each of ``P`` prompts is repeated ``G`` times and ``pipe.generate``
   samples a completion for each (the KV cache on the host, one token of every sequence
   per decode step).
2. **Score.** A programmatic reward: the share of a completion's tokens below
   ``vocab / 4`` (a target the policy can learn, no reward model).
3. **Advantages.** Per group: ``(reward - mean) / (std + 1e-4)``; every token of a
   completion gets its completion's advantage.
4. **Old log-probabilities.** One inference call, ``pipe(seqs, attention_mask=...)``: the
   sampling policy's log-probability of each sampled token.
5. **Policy steps.** ``INNER`` fused steps (``forward_backward(..., optimizer=opt)``: the
   optimizer streamed into the backward) of the clipped surrogate
   ``-min(ratio * A, clip(ratio, 1 - EPS, 1 + EPS) * A)``, ``ratio = exp(logp - old)``,
   averaged over the completion tokens. The first step's ratio is 1; the second's is not,
   which the clip bounds. No KL penalty to a reference model (``beta = 0``, as DAPO and
   Dr. GRPO train); adding one is a second inference call on a reference pipe.

The next round samples from the updated weights with no re-compile. Exits non-zero unless
the mean reward rose.
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

EPS = 0.2      # the ratio's clip range
INNER = 2      # policy steps per generated batch


def reward(completions: torch.Tensor, vocab: int) -> torch.Tensor:
    """The share of each completion's tokens below ``vocab / 4``."""
    return (completions < vocab // 4).float().mean(-1)


def group_advantages(rewards: torch.Tensor, group: int) -> torch.Tensor:
    """``(r - mean) / (std + 1e-4)`` within each group of ``group`` consecutive rows."""
    r = rewards.view(-1, group)
    return ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)).view(-1)


def token_logp(logits: torch.Tensor, seqs: torch.Tensor, prompt: int) -> torch.Tensor:
    """Each completion token's log-probability under ``logits`` (``[B, L, V]``)."""
    logp = F.log_softmax(logits[:, prompt - 1:-1].float(), -1)
    return logp.gather(-1, seqs[:, prompt:, None]).squeeze(-1)


def clipped_loss(out, label, prompt: int) -> torch.Tensor:
    """GRPO's clipped surrogate, per microbatch (its rows of ``label``)."""
    seqs, old, adv = label
    ratio = torch.exp(token_logp(out.logits, seqs, prompt) - old)
    a = adv[:, None]
    return -torch.min(ratio * a, ratio.clamp(1 - EPS, 1 + EPS) * a).mean()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", default=bool(os.environ.get("FXPIPE_EXAMPLE_SMALL")))
    ap.add_argument("--rounds", type=int, default=None)
    args = ap.parse_args()
    rounds = args.rounds or (6 if args.small else 30)
    vocab, prompts, group, prompt, new = 128, 4, 4, 8, 12
    batch = prompts * group

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        pad_token_id=0, eos_token_id=None)).eval()
    ids = torch.randint(1, vocab, (prompts, prompt)).repeat_interleave(group, 0)
    mask = torch.ones(batch, prompt, dtype=torch.long)
    full_mask = torch.ones(batch, prompt + new, dtype=torch.long)
    example = torch.randint(1, vocab, (batch, prompt + new))
    pipe = fxpipe.compile(model, example_inputs=(example,),
                          example_kwargs={"attention_mask": full_mask})
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    rewards, clipped = [], []
    start = time.perf_counter()
    for r in range(rounds):
        model.eval()
        # the KV cache stays on the devices where it fits; the batch decodes in microbatches
        seqs = pipe.generate(ids, mask, max_new_tokens=new, do_sample=True, temperature=1.0,
                             generator=gen, kv_cache="auto")
        score = reward(seqs[:, prompt:], vocab)
        rewards.append(score.mean().item())
        adv = group_advantages(score, group)
        with torch.no_grad():
            old = token_logp(pipe(seqs, attention_mask=full_mask).logits, seqs, prompt)
        model.train()
        for step in range(INNER):
            pipe.forward_backward((seqs,), {"attention_mask": full_mask}, label=(seqs, old, adv),
                                  loss_fn=lambda out, label: clipped_loss(out, label, prompt),
                                  optimizer=opt)
            opt.zero_grad(set_to_none=True)
        with torch.no_grad():   # how far the policy moved: tokens whose ratio left the clip
            ratio = torch.exp(token_logp(pipe(seqs, attention_mask=full_mask).logits, seqs, prompt) - old)
        clipped.append(((ratio - 1).abs() > EPS).float().mean().item())
        print(f"round {r + 1}/{rounds}: mean reward {rewards[-1]:.3f}, "
              f"tokens past the clip {clipped[-1]:.1%}", flush=True)
    elapsed = time.perf_counter() - start
    first, last = sum(rewards[:2]) / 2, sum(rewards[-2:]) / 2
    print(f"GRPO: reward {first:.3f} -> {last:.3f} over {rounds} rounds of {prompts} prompts x "
          f"{group} completions ({elapsed:.1f} s)")
    if not last > first:
        print("FAILED: the reward did not rise", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
