"""``pipe.generate`` (issue 28): measured here, and simulated on GPU presets.

    python benchmarks/bench_generate.py                  # both parts
    python benchmarks/bench_generate.py --repeat 1       # quicker

**Measured** (this machine, 2 virtual CPU devices): tokens/s of greedy generation of a
Llama-style ``LlamaForCausalLM`` from a config (hidden ``--hidden``, ``--layers`` blocks,
vocab 4096; random weights), batch ``--batch`` of ``--prompt``-token prompts (every other
one a quarter shorter, left-padded, with its ``attention_mask``) and ``--new`` new
tokens, three ways, interleaved, ``--repeat`` rounds after a warm-up:
``transformers``' ``model.generate`` with its KV cache (eager on the CPU: the weights
stay put), ``pipe.generate`` (KV cache, every stage's weights and cache uploaded per
token), and fxpipe without a cache (``pipe(ids)`` over the whole sequence per token, what
``examples/inference.py`` did). All three must return the same tokens.

**Simulated** (labelled so: no GPU ran it): a decode step as ``fxpipe.simulate`` times the
Program ``pipe.generate`` runs per token (every decoder layer a stage, one microbatch,
round-robin over the GPUs, each stage's prefetch overlapping the previous stage's
compute): per layer its fp16 weights plus its KV cache (host-resident, as fxpipe keeps
it) cross the host link, its compute is its FLOPs at the preset's rate (attention over
the context included). The cache's write-back runs on the other link direction, which a
decode step otherwise leaves idle, and is not timed. The batch is the largest (powers of
two) whose stage, the one it prefetches, their caches and activations fit one GPU.
Beside it: the physical bound (the weights cross the host link once per step: ``batch x
link / weight bytes``) and the published figures of FlexGen, ZeRO-Inference and HF
accelerate (their own setups: FlexGen and accelerate on one T4 with 208 GB of host RAM,
ZeRO-Inference with 4-bit weights on an A6000).

Prints both tables and writes ``benchmarks/results/bench_generate.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
RESULTS = os.path.join(ROOT, "benchmarks", "results", "bench_generate.json")

import fxpipe  # noqa: E402
from fxpipe.passes.schedule import build_program  # noqa: E402
from fxpipe.sim import Hardware, LayerCost, simulate  # noqa: E402

# name: (layers, hidden, ffn, heads, kv heads, vocab, gated mlp)
MODELS = {
    "OPT-30B": (48, 7168, 28672, 56, 56, 50272, False),
    "Llama-3.1-8B": (32, 4096, 14336, 32, 8, 128256, True),
    "Llama-3.1-70B": (80, 8192, 28672, 64, 8, 128256, True),
}
# name: (dense fp16 FLOP/s, bytes, host link bytes/s each way)
GPUS = {
    "T4 (PCIe 3.0)": (65e12, 16 * 2**30, 12e9),
    "RTX 4090 (PCIe 4.0)": (165e12, 24 * 2**30, 25e9),
    "H100 (PCIe 5.0)": (989e12, 80 * 2**30, 50e9),
}
SETUPS = [("OPT-30B", "T4 (PCIe 3.0)", 1), ("Llama-3.1-8B", "RTX 4090 (PCIe 4.0)", 1),
          ("Llama-3.1-8B", "H100 (PCIe 5.0)", 1), ("Llama-3.1-70B", "RTX 4090 (PCIe 4.0)", 8),
          ("Llama-3.1-70B", "H100 (PCIe 5.0)", 8)]
PUBLISHED = {   # tokens/s, as issue 28 quotes them (each from its own paper or blog)
    "OPT-30B": ["FlexGen 7.32 (1 T4, batch 144 effective)", "HF accelerate 0.62 (1 T4)"],
    "Llama-3.1-70B": ["ZeRO-Inference 23.44 on Llama2-70B (1 A6000, 4-bit weights, batch 96)"],
}
CONTEXT, NEW = 512, 32   # the simulated prompt and new tokens (the cache at its last step)


# ----------------------------------------------------------------------------- measured

def measured(args) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=4096, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
        num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
        max_position_embeddings=args.prompt + args.new + 64, tie_word_embeddings=True)).eval()
    model.generation_config.eos_token_id = None     # every sequence runs its --new tokens
    ids = torch.randint(3, 4096, (args.batch, args.prompt))
    mask = torch.ones_like(ids)
    mask[::2, : args.prompt // 4] = 0       # every other prompt a quarter shorter: left-padded
    ids[mask == 0] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    pipe = fxpipe.compile(model, example_inputs=(ids,), devices=["cpu", "cpu"],
                          example_kwargs={"attention_mask": mask, "position_ids": positions})

    def hf():
        with torch.no_grad():
            return model.generate(ids, attention_mask=mask, max_new_tokens=args.new,
                                  do_sample=False, pad_token_id=0)

    def cached():
        return pipe.generate(ids, mask, max_new_tokens=args.new, pad_token_id=0)

    def uncached():
        seq, m = ids, mask
        with torch.no_grad():
            for _ in range(args.new):
                pos = (m.cumsum(-1) - 1).clamp(min=0)
                token = pipe(seq, attention_mask=m, position_ids=pos).logits[:, -1].argmax(-1)
                seq = torch.cat([seq, token[:, None]], 1)
                m = torch.cat([m, torch.ones_like(m[:, :1])], 1)
        return seq

    variants = {"transformers generate (KV cache)": hf, "pipe.generate (KV cache)": cached,
                "fxpipe without a cache": uncached}
    outs = {name: fn() for name, fn in variants.items()}          # warm-up, and the same tokens
    ref = outs["transformers generate (KV cache)"]
    same = {name: bool(torch.equal(o, ref)) for name, o in outs.items()}
    seconds = {name: [] for name in variants}
    for _ in range(args.repeat):
        for name, fn in variants.items():
            t0 = time.perf_counter()
            fn()
            seconds[name].append(time.perf_counter() - t0)
    tokens = args.batch * args.new
    rows = {name: {"tokens_per_s_max": tokens / min(s), "tokens_per_s_median": tokens / statistics.median(s),
                   "seconds": s, "same_tokens": same[name]} for name, s in seconds.items()}
    base = rows["transformers generate (KV cache)"]
    for r in rows.values():
        r["over_transformers_median"] = r["tokens_per_s_median"] / base["tokens_per_s_median"]
    params = sum(p.numel() for p in model.parameters())
    return {"model": {"hidden": args.hidden, "layers": args.layers, "parameters": params,
                      "batch": args.batch, "prompt": args.prompt, "new": args.new},
            "rows": rows, "stats_decode_step": _decode_stats(pipe, ids)}


def _decode_stats(pipe, ids) -> dict:
    """Bytes one decode step moved (``pipe.stats()`` of the step pipe)."""
    steps = pipe._generation[-1]
    return {k: v for k, v in steps.pipe.stats().items()
            if k.startswith(("h2d", "d2h", "actions", "host_waits"))}


# ---------------------------------------------------------------------------- simulated

def layer_cost(model: str, batch: int, context: int) -> tuple[int, int, float]:
    """(weight bytes, KV bytes, decode FLOPs) of one decoder layer, fp16."""
    L, h, ffn, heads, kv, vocab, gated = MODELS[model]
    head_dim = h // heads
    attn = h * h * 2 + 2 * h * kv * head_dim
    mlp = (3 if gated else 2) * h * ffn
    weights = (attn + mlp) * 2
    kv_bytes = 2 * batch * context * kv * head_dim * 2
    flops = 2 * (attn + mlp) * batch + 4 * batch * context * h
    return weights, kv_bytes, flops


def simulated_row(model: str, gpu: str, gpus: int) -> dict:
    L, h, ffn, heads, kv, vocab, gated = MODELS[model]
    flops_s, memory, link = GPUS[gpu]
    hw = Hardware(flops=flops_s, memory=memory, h2d_bandwidth=link, d2h_bandwidth=link)
    context = CONTEXT + NEW
    best = None
    for batch in [2**i for i in range(0, 11)]:
        w, kvb, fl = layer_cost(model, batch, context)
        activations = 8 * batch * h * 2 + batch * vocab * 4
        if 2 * (w + kvb) + activations > memory * 0.9:
            break
        costs = [LayerCost(hw.compute_ms(fl), 0.0, param_bytes=w + kvb,
                           boundary_bytes=batch * h * 2) for _ in range(L)]
        program = build_program([range(i, i + 1) for i in range(L)], [], "infer", gpus, 1, "stage")
        step_ms = simulate(program, costs, hw).makespan
        row = {"batch": batch, "step_ms": step_ms, "tokens_per_s": batch / step_ms * 1e3,
               "kv_bytes_per_layer": kvb, "weight_bytes_per_layer": w}
        if best is None or row["tokens_per_s"] > best["tokens_per_s"]:
            best = row
    weights = L * layer_cost(model, 1, 1)[0]
    best["bound_tokens_per_s"] = best["batch"] * gpus * link / weights
    best["host_bytes"] = L * (best["weight_bytes_per_layer"] + best["kv_bytes_per_layer"])
    best.update(model=model, gpu=gpu, gpus=gpus, kv_placement="host (streamed with its layer)",
                published=PUBLISHED.get(model, []))
    return best


# ---------------------------------------------------------------------------------- main

def report_measured(m: dict, args) -> dict:
    print(f"\nMeasured: Llama-style, {m['model']['parameters'] / 1e6:.1f}M parameters, batch "
          f"{args.batch}, prompt {args.prompt}, {args.new} new tokens, 2 virtual CPU devices")
    print(f"{'':36} {'tokens/s max':>13} {'median':>9} {'/ transformers':>15} {'same tokens':>12}")
    for name, r in m["rows"].items():
        print(f"{name:36} {r['tokens_per_s_max']:13.1f} {r['tokens_per_s_median']:9.1f} "
              f"{r['over_transformers_median']:15.2f} {str(r['same_tokens']):>12}")
    return m


def report_simulated() -> dict:
    sim = [simulated_row(*s) for s in SETUPS]
    print(f"\nSimulated (fxpipe.simulate; a decode step at {CONTEXT}+{NEW} tokens of context, "
          "fp16 weights, KV cache in host memory):")
    print(f"{'model':15} {'GPUs':22} {'batch':>6} {'step ms':>9} {'tokens/s':>9} {'bound':>9} "
          f"{'host GB':>8}  published")
    for r in sim:
        print(f"{r['model']:15} {str(r['gpus']) + ' x ' + r['gpu']:22} {r['batch']:6d} "
              f"{r['step_ms']:9.1f} {r['tokens_per_s']:9.2f} {r['bound_tokens_per_s']:9.2f} "
              f"{r['host_bytes'] / 1e9:8.0f}  {'; '.join(r['published'])}")
    return {"context": CONTEXT, "new": NEW, "rows": sim}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--only", choices=["measured", "simulated"], default=None,
                    help="run one part; the other is kept from the existing JSON")
    args = ap.parse_args()
    result = {}
    if args.only and os.path.exists(RESULTS):
        with open(RESULTS) as f:
            result = {k: v for k, v in json.load(f).items() if k != args.only}
    if args.only != "simulated":
        result["measured"] = report_measured(measured(args), args)
    if args.only != "measured":
        result["simulated"] = report_simulated()
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with open(RESULTS, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
