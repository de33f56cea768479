"""The kit's ``generate`` section: ``pipe.generate`` (KV cache) of a Hugging Face Llama
against ``transformers``' ``model.generate`` with every weight resident on the device."""

from __future__ import annotations

import copy
import time
from typing import Any

import torch

import fxpipe
from fxpipe.check.common import devices, sync_fn
from fxpipe.check.harness import Kit


def generate(kit: Kit, new: int = 32) -> dict[str, Any]:
    """``pipe.generate`` (KV cache) of a Hugging Face Llama from a config, greedy, left-
    padded prompts: the tokens against ``transformers``' ``model.generate`` on the same
    device with every weight resident there, and the tokens per second of both (min
    over two timed runs after a warm-up)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if kit.dry_run:
        shape, batch, prompt = dict(hidden=32, layers=2, vocab=64), 2, 8
    else:
        shape, batch, prompt = dict(hidden=2048, layers=16, vocab=32000), 16, 128
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=shape["vocab"], hidden_size=shape["hidden"],
        intermediate_size=shape["hidden"] * 11 // 4, num_hidden_layers=shape["layers"],
        num_attention_heads=16 if not kit.dry_run else 4, num_key_value_heads=4 if not kit.dry_run else 2,
        max_position_embeddings=prompt + new + 64, pad_token_id=0)).eval()
    model.generation_config.eos_token_id = None
    ids = torch.randint(1, shape["vocab"], (batch, prompt))
    mask = torch.ones_like(ids)
    mask[::2, : prompt // 4] = 0
    ids[mask == 0] = 0
    where = "cpu" if kit.dry_run else "cuda:0"
    eager = copy.deepcopy(model).to(where)
    pipe = fxpipe.compile(model, example_inputs=(ids,), devices=devices(1, kit.dry_run))
    sync = sync_fn(kit.dry_run)
    try:
        def fx():
            return pipe.generate(ids, mask, max_new_tokens=new)

        def hf():
            with torch.no_grad():
                return eager.generate(ids.to(where), attention_mask=mask.to(where),
                                      max_new_tokens=new, do_sample=False).cpu()
        outs, seconds = {}, {"fxpipe": [], "transformers": []}
        for name, fn in (("fxpipe", fx), ("transformers", hf)) * 3:
            sync()
            t0 = time.perf_counter()
            outs[name] = fn()
            sync()
            seconds[name].append(time.perf_counter() - t0)
        tokens = batch * new
        rate = {k: tokens / min(v[1:]) for k, v in seconds.items()}
        same = bool(torch.equal(outs["fxpipe"], outs["transformers"]))
        agree = float((outs["fxpipe"][:, prompt:] == outs["transformers"][:, prompt:]).float().mean())
        return {"model": shape, "batch": batch, "prompt": prompt, "new": new,
                "parameters": sum(p.numel() for p in model.parameters()),
                "same_tokens": same, "token_agreement": agree,
                "tokens_per_s": rate, "over_transformers": rate["fxpipe"] / rate["transformers"],
                "kv_cache": "host", "ok": same or agree > 0.9}
    finally:
        pipe.close()


def generate_summary(r: dict[str, Any]) -> str:
    return (f"tokens equal transformers: {r['same_tokens']} (agreement "
            f"{r['token_agreement']:.3f}); {r['tokens_per_s']['fxpipe']:.0f} tokens/s, "
            f"{r['over_transformers']:.2f}x transformers with its weights resident")
