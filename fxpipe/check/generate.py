"""The kit's ``generate`` section: ``pipe.generate`` (KV cache) of a Hugging Face Llama whose
weights are over twice what the device may hold (``common.capped_devices``, as
``bigger_than_device``), per ``kv_cache`` placement, against ``transformers``'
``model.generate`` with every weight resident, and against the weights-over-link bound:
each decode step uploads every weight, so no placement beats ``batch x link / weight
bytes`` tokens/s, the link being the host->device bandwidth measured here."""

from __future__ import annotations

import copy
from typing import Any

import torch

import fxpipe
from fxpipe.check.common import (capped_devices, link_bandwidth, machine_neutral, settle, sync_fn,
                                 timed)
from fxpipe.check.harness import Kit

KV_CACHES = ("host", "auto", "device")
OVER_LIMIT = 2.2   # the model's weights over the device's memory_limit
DRY_RUN_COPY = 4 * 2**20


def shape_of(dry_run: bool) -> dict[str, int]:
    """The Llama's dims and the generation's sizes: tiny in a dry run (10 layers: stages
    that fit the cap, "auto" keeping some caches resident but not all; 8 do not fit, and
    each layer is seconds of capture on CPU); else fp32 weights of 3.4 GB (an H100/H200
    streams them in ~60 ms per decode step)."""
    if dry_run:
        return dict(hidden=32, layers=10, vocab=64, heads=4, kv_heads=2, batch=2, prompt=8, new=4)
    return dict(hidden=2048, layers=16, vocab=32000, heads=16, kv_heads=4, batch=16, prompt=128,
                new=32)


def build_llama(shape: dict[str, int]):
    """A seeded ``LlamaForCausalLM`` from a config, for inference: no EOS (every sequence
    runs its new tokens), no gradients (the pipe plans no backward)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=shape["vocab"], hidden_size=shape["hidden"],
        intermediate_size=shape["hidden"] * 11 // 4, num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
        max_position_embeddings=shape["prompt"] + shape["new"] + 64, pad_token_id=0)).eval()
    model.generation_config.eos_token_id = None
    return model.requires_grad_(False)


def prompts(shape: dict[str, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention_mask): every other prompt a quarter shorter, left-padded."""
    ids = torch.randint(1, shape["vocab"], (shape["batch"], shape["prompt"]))
    mask = torch.ones_like(ids)
    mask[::2, : shape["prompt"] // 4] = 0
    ids[mask == 0] = 0
    return ids, mask


def weight_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def host_link(dry_run: bool) -> tuple[float, str]:
    """(host->device bytes/s, how it was obtained). A dry run has no host link: a host
    copy's bandwidth stands for it, labelled so (the bound it gives is no GPU's)."""
    if not dry_run:
        return (link_bandwidth(False)[0],
                "measured pinned h2d copy (256 MiB, min of 5 after 2 warm-ups)")
    src = torch.ones(DRY_RUN_COPY, dtype=torch.uint8)
    dst = torch.empty_like(src)
    seconds = min(timed(lambda: dst.copy_(src), 1, 3, lambda: None))
    return DRY_RUN_COPY / seconds, "dry run: a 4 MiB host-to-host copy on the CPU, not a GPU link"


def reference(model, ids, mask, new: int, repeats: int,
              dry_run: bool) -> tuple[torch.Tensor, list[float]]:
    """``transformers``' greedy ``model.generate`` with every weight resident (on cuda:0; the
    CPU in a dry run): its tokens (the warm-up's) and the timed runs' seconds. Its copy of
    the model is freed after."""
    where = "cpu" if dry_run else "cuda:0"
    eager = copy.deepcopy(model).to(where)

    def run():
        with torch.no_grad():
            return eager.generate(ids.to(where), attention_mask=mask.to(where),
                                  max_new_tokens=new, do_sample=False).cpu()
    try:
        tokens = run()
        return tokens, timed(run, 0, repeats, sync_fn(dry_run))
    finally:
        del eager
        settle(dry_run)


def agreement(out: torch.Tensor, ref: torch.Tensor, prompt: int) -> dict[str, Any]:
    """The tokens against the reference's: equal, the share of new tokens that agree, and
    ``ok`` (equal, or over 90 % agree: fp reductions may flip a near-tie)."""
    if out.shape != ref.shape:
        return {"same_tokens": False, "token_agreement": 0.0, "ok": False}
    same = bool(torch.equal(out, ref))
    agree = float((out[:, prompt:] == ref[:, prompt:]).float().mean())
    return {"same_tokens": same, "token_agreement": agree, "ok": same or agree > 0.9}


def placement_of(pipe) -> dict[str, Any]:
    """Where the last ``generate`` kept the KV caches, its predicted decode peak, and what
    its last decode step moved (``pipe.stats()`` of the step pipe)."""
    steps = pipe._generation[-1]
    placement = steps.placement
    moved = {k: v for k, v in steps.pipe.stats().items()
             if k.startswith(("h2d_bytes", "d2h_bytes"))}
    return {"resident_stages": sorted(placement.resident),
            "decode_stages": len(steps.executables()[1].stages),
            "predicted_peak_bytes": placement.prediction.peak,
            "decode_step": moved}


def placed(pipe, kv_cache: str) -> bool:
    """Whether the last ``generate`` placed its caches as ``kv_cache`` asks (a refusal
    raises before it does: nothing ran)."""
    placement = pipe._generation[-1].placement if pipe._generation else None
    return placement is not None and placement.kv_cache == kv_cache


def run_variant(pipe, kv_cache: str, ids, mask, new: int, repeats: int,
                dry_run: bool) -> dict[str, Any]:
    """``pipe.generate`` with ``kv_cache``: a warm-up (its tokens), then ``repeats`` timed
    calls; a ``DeviceMemoryError`` refusal (at the placement: nothing ran) is recorded as
    such, one while running raised. The counted peak is the devices' over all of them
    (prefills included)."""
    def run():
        return pipe.generate(ids, mask, max_new_tokens=new, kv_cache=kv_cache)
    settle(dry_run)
    for d in pipe.devices:
        d.reset_peak()
    try:
        tokens = run()
    except fxpipe.DeviceMemoryError as e:
        if placed(pipe, kv_cache):
            raise          # out of memory while running: a failure, not a refusal
        return {"ran": False, "refused": machine_neutral(str(e))}
    seconds = timed(run, 0, repeats, sync_fn(dry_run))
    return {"ran": True, "tokens": tokens, "seconds": seconds,
            "tokens_per_s": ids.shape[0] * new / min(seconds),
            "peak_counted_bytes": max(d.peak_bytes() for d in pipe.devices),
            **placement_of(pipe)}


def generate(kit: Kit) -> dict[str, Any]:
    """``pipe.generate`` of a model bigger than the device, greedy, left-padded prompts,
    per ``kv_cache`` (``"device"`` may be refused): the tokens against ``transformers``'
    ``model.generate`` with every weight resident, tokens/s (min over the timed calls
    after a warm-up) against transformers' and against the weights-over-link bound,
    the bytes a decode step moved and the stages whose cache stayed on the device."""
    shape = shape_of(kit.dry_run)
    model = build_llama(shape)
    ids, mask = prompts(shape)
    batch, prompt, new = shape["batch"], shape["prompt"], shape["new"]
    weights = weight_bytes(model)
    cap = int(weights / OVER_LIMIT)
    repeats = max(1, min(2, kit.repeats))
    link, bound_from = host_link(kit.dry_run)
    bound = batch * link / weights
    ref, ref_seconds = reference(model, ids, mask, new, repeats, kit.dry_run)
    hf_rate = batch * new / min(ref_seconds)
    out: dict[str, Any] = {
        "model": shape, "parameters": sum(p.numel() for p in model.parameters()),
        "weight_dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "weight_bytes": weights, "cap_bytes": cap, "weights_over_limit": weights / cap,
        "num_microbatch": "default (one)", "greedy": True,
        "h2d_bytes_per_s": link, "bound_from": bound_from, "bound_tokens_per_s": bound,
        "bound": "batch x h2d_bytes_per_s / weight_bytes: each decode step uploads every weight",
        "transformers": {"where": "cpu" if kit.dry_run else "cuda:0", "seconds": ref_seconds,
                         "tokens_per_s": hf_rate},
        "variants": {}}
    with capped_devices(cap, kit.dry_run) as (devices, figures):
        out.update(figures)
        pipe = fxpipe.compile(model, example_inputs=(ids,), devices=devices)
        try:
            for kv_cache in KV_CACHES:
                row = run_variant(pipe, kv_cache, ids, mask, new, repeats, kit.dry_run)
                if row["ran"]:
                    row.update(agreement(row.pop("tokens"), ref, prompt),
                               over_bound=row["tokens_per_s"] / bound,
                               over_transformers=row["tokens_per_s"] / hf_rate)
                out["variants"][kv_cache] = row
                kit.progress(out)
        finally:
            pipe.close()
    out["ok"] = variants_ok(out["variants"])
    return out


def variants_ok(variants: dict[str, dict[str, Any]]) -> bool:
    """``"host"`` and ``"auto"`` ran (neither may refuse), and every variant that ran
    returned transformers' tokens; ``"device"`` may be refused."""
    ran = [r for r in variants.values() if r["ran"]]
    return all(variants[k]["ran"] for k in ("host", "auto")) and all(r["ok"] for r in ran)


def generate_summary(r: dict[str, Any]) -> str:
    parts = []
    for kv_cache, v in r["variants"].items():
        if not v["ran"]:
            parts.append(f"{kv_cache}: refused")
            continue
        tokens = "same tokens" if v["same_tokens"] else f"agreement {v['token_agreement']:.3f}"
        parts.append(f"{kv_cache}: {v['tokens_per_s']:.0f} tokens/s, {v['over_bound']:.2f}x the "
                     f"bound, caches resident {v['resident_stages']}, {tokens}")
    return (f"weights {r['weights_over_limit']:.2f}x the cap; bound {r['bound_tokens_per_s']:.0f} "
            f"tokens/s ({r['bound_from']}); transformers (every weight resident) "
            f"{r['transformers']['tokens_per_s']:.0f} tokens/s; " + "; ".join(parts))
