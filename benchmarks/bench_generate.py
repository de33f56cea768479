"""``pipe.generate`` (issue 28): measured here, and simulated on GPU presets.

    python benchmarks/bench_generate.py                  # both parts, 3 rounds
    python benchmarks/bench_generate.py --repeat 1       # quicker
    python benchmarks/bench_generate.py --only simulated # one part, the other kept from the JSON

**Measured** (this machine, 2 virtual CPU devices): tokens/s of greedy generation of a
Llama-style ``LlamaForCausalLM`` from a config (hidden ``--hidden``, ``--layers`` blocks,
vocab 4096; random weights), batch ``--batch`` of ``--prompt``-token prompts (every other
one a quarter shorter, left-padded, with its ``attention_mask``) and ``--new`` new
tokens, interleaved, ``--repeat`` rounds after a warm-up (min and median of the rounds):
``transformers``' ``model.generate`` with its KV cache (eager on the CPU: the weights
stay put); ``pipe.generate`` with ``kv_cache`` in ``"host"`` (every stage's weights and
cache uploaded per token, the new position written back), ``"device"`` (each stage's
cache resident on its device for the call) and ``"auto"`` (the caches that fit the
device's ``memory_limit`` resident; the virtual devices here have none, so all of them),
each with ``num_microbatch`` 1 and 2; and fxpipe without a cache (``pipe(ids)`` over the
whole sequence per token, what ``examples/inference.py`` did). All must return the
tokens transformers does (``same_tokens``). After each fxpipe variant's last timed run,
the step pipe's ``stats()`` give the bytes its last decode step moved (without a cache:
the last call) and ``placement.resident`` the stages whose cache stayed on a device.

**Simulated** (labelled so: no GPU ran it): a decode step as ``fxpipe.simulate`` times the
Program ``pipe.generate`` runs per token (every decoder layer a stage, round-robin over
the GPUs, each stage's prefetch overlapping the previous stage's compute; its compute
the layer's FLOPs at the preset's rate, attention over the context included), with the
KV cache in one of two places:

- ``kv_placement="host"``: per layer its fp16 weights plus its KV cache cross the host
  link; a GPU holds two layers' weights and caches (the stage and the one it
  prefetches) plus the activations. The cache's write-back runs on the other link
  direction, which a decode step otherwise leaves idle, and is not timed.
- ``kv_placement="device"``: only the weights cross the link each step; a GPU holds the
  caches of all its layers (``layers / gpus``), two layers' weights and the activations.

Each at one microbatch (the default) and, on several GPUs, at one microbatch per GPU
(``num_microbatch=gpus``: ``build_program(..., gpus, "stage")``, each stage's prefetch once
for all of them, the compute of ``batch / gpus`` sequences each). The batch is the
largest (powers of two up to 1024) that fits 90% of a GPU. Beside it: the physical
bound (the weights cross the host links once per step: ``batch x gpus x link / weight
bytes``) and the published figures of FlexGen, ZeRO-Inference and HF accelerate (their
own setups: FlexGen and accelerate on one T4 with 208 GB of host RAM, ZeRO-Inference
with 4-bit weights on an A6000).

Prints the tables (measured tokens/s, measured bytes per decode step, simulated host
against device) and writes ``benchmarks/results/bench_generate.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

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

HF = "transformers generate (KV cache)"
UNCACHED = "fxpipe without a cache"
KV_CACHES, MICROBATCHES = ("host", "device", "auto"), (1, 2)
STEP_BYTES = ("h2d_bytes_params", "d2h_bytes_cache", "h2d_bytes_activations",
              "d2h_bytes_activations")


def grid_name(kv_cache: str, num_microbatch: int) -> str:
    return f"pipe.generate kv={kv_cache} mb={num_microbatch}"


@dataclass
class Variant:
    run: Callable[[], torch.Tensor]
    step_stats: Callable[[], dict] | None = None    # what its last decode step moved
    info: dict = field(default_factory=dict)


def llama_and_prompts(args):
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
    return model, ids, mask


def variants(model, pipe, ids, mask, new: int) -> dict[str, Variant]:
    def hf():
        with torch.no_grad():
            return model.generate(ids, attention_mask=mask, max_new_tokens=new,
                                  do_sample=False, pad_token_id=0)

    def cached(kv_cache: str, num_microbatch: int):
        return lambda: pipe.generate(ids, mask, max_new_tokens=new, pad_token_id=0,
                                     kv_cache=kv_cache, num_microbatch=num_microbatch)

    def uncached():
        seq, m = ids, mask
        with torch.no_grad():
            for _ in range(new):
                pos = (m.cumsum(-1) - 1).clamp(min=0)
                token = pipe(seq, attention_mask=m, position_ids=pos).logits[:, -1].argmax(-1)
                seq = torch.cat([seq, token[:, None]], 1)
                m = torch.cat([m, torch.ones_like(m[:, :1])], 1)
        return seq

    out = {HF: Variant(hf)}
    for kv in KV_CACHES:
        for mb in MICROBATCHES:
            out[grid_name(kv, mb)] = Variant(cached(kv, mb), lambda: _step_stats(pipe),
                                             {"kv_cache": kv, "num_microbatch": mb})
    out[UNCACHED] = Variant(uncached, lambda: _bytes_moved(pipe.stats()))
    return out


def _bytes_moved(stats: dict) -> dict:
    return {k: stats.get(k, 0) for k in STEP_BYTES}


def _step_stats(pipe) -> dict:
    """What the last decode step moved (the step pipe's ``stats()``) and where the call
    kept the caches."""
    steps = pipe._generation[-1]
    return {**_bytes_moved(steps.pipe.stats()), "microbatches": steps.microbatches,
            "resident_stages": sorted(steps.placement.resident)}


def time_rounds(runs: dict[str, Variant], repeat: int) -> tuple[dict, dict]:
    """Seconds of each variant over ``repeat`` interleaved rounds, and the bytes of a
    decode step after its last timed run."""
    seconds = {name: [] for name in runs}
    moved = {}
    for _ in range(repeat):
        for name, v in runs.items():
            t0 = time.perf_counter()
            v.run()
            seconds[name].append(time.perf_counter() - t0)
            if v.step_stats is not None:
                moved[name] = v.step_stats()
    return seconds, moved


def measured(args) -> dict:
    model, ids, mask = llama_and_prompts(args)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    pipe = fxpipe.compile(model, example_inputs=(ids,), devices=["cpu", "cpu"],
                          example_kwargs={"attention_mask": mask, "position_ids": positions})
    runs = variants(model, pipe, ids, mask, args.new)
    outs = {name: v.run() for name, v in runs.items()}     # warm-up, and the same tokens
    seconds, moved = time_rounds(runs, args.repeat)
    tokens = args.batch * args.new
    rows = {}
    for name, s in seconds.items():
        rows[name] = {"tokens_per_s_max": tokens / min(s),
                      "tokens_per_s_median": tokens / statistics.median(s), "seconds": s,
                      "same_tokens": bool(torch.equal(outs[name], outs[HF])),
                      **runs[name].info}
        if name in moved:
            rows[name]["bytes_per_step"] = moved[name]
    base = rows[HF]["tokens_per_s_median"]
    for r in rows.values():
        r["over_transformers_median"] = r["tokens_per_s_median"] / base
    params = list(model.parameters())
    return {"model": {"hidden": args.hidden, "layers": args.layers,
                      "parameters": sum(p.numel() for p in params),
                      "weight_bytes": sum(p.numel() * p.element_size() for p in params),
                      "batch": args.batch, "prompt": args.prompt, "new": args.new},
            "rows": rows}


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


def layers_per_gpu(layers: int, gpus: int) -> int:
    return -(-layers // gpus)


def fits(model: str, gpu: str, gpus: int, batch: int, kv_placement: str) -> bool:
    """Whether a GPU holds what a decode step needs there: two layers' weights (the stage
    computing and the one it prefetches), their caches streamed with them (``"host"``) or
    the caches of every layer it runs (``"device"``), and the activations."""
    L, h, _, _, _, vocab, _ = MODELS[model]
    w, kvb, _ = layer_cost(model, batch, CONTEXT + NEW)
    activations = 8 * batch * h * 2 + batch * vocab * 4
    held = 2 * (w + kvb) if kv_placement == "host" else 2 * w + layers_per_gpu(L, gpus) * kvb
    return held + activations <= GPUS[gpu][1] * 0.9


def step_ms(model: str, gpu: str, gpus: int, batch: int, kv_placement: str,
            microbatches: int) -> float:
    """``fxpipe.simulate`` of a decode step: every layer a stage, ``microbatches`` of
    ``batch / microbatches`` sequences; a stage's prefetch its weights, plus its whole
    cache when the cache is on the host."""
    L, h, *_ = MODELS[model]
    flops_s, memory, link = GPUS[gpu]
    hw = Hardware(flops=flops_s, memory=memory, h2d_bandwidth=link, d2h_bandwidth=link)
    w, kvb, _ = layer_cost(model, batch, CONTEXT + NEW)
    fl = layer_cost(model, batch // microbatches, CONTEXT + NEW)[2]
    costs = [LayerCost(hw.compute_ms(fl), 0.0,
                       param_bytes=w + kvb if kv_placement == "host" else w,
                       boundary_bytes=batch // microbatches * h * 2) for _ in range(L)]
    program = build_program([range(i, i + 1) for i in range(L)], [], "infer", gpus,
                            microbatches, "stage")
    return simulate(program, costs, hw).makespan


def simulated_row(model: str, gpu: str, gpus: int, kv_placement: str = "host",
                  microbatches: int = 1) -> dict:
    """The batch (a power of two, up to 1024, a multiple of ``microbatches``) that fits
    and gives the most tokens/s, with its step."""
    L, *_ = MODELS[model]
    link = GPUS[gpu][2]
    best = None
    for batch in [2**i for i in range(0, 11) if 2**i >= microbatches]:
        if not fits(model, gpu, gpus, batch, kv_placement):
            break
        ms = step_ms(model, gpu, gpus, batch, kv_placement, microbatches)
        w, kvb, _ = layer_cost(model, batch, CONTEXT + NEW)
        row = {"batch": batch, "step_ms": ms, "tokens_per_s": batch / ms * 1e3,
               "kv_bytes_per_layer": kvb, "weight_bytes_per_layer": w}
        if best is None or row["tokens_per_s"] > best["tokens_per_s"]:
            best = row
    if best is None:
        return {"model": model, "gpu": gpu, "gpus": gpus, "kv_placement": kv_placement,
                "microbatches": microbatches, "batch": 0, "fits": False,
                "published": PUBLISHED.get(model, [])}
    weights = L * best["weight_bytes_per_layer"]
    on_host = kv_placement == "host"
    cache_layers = (L, 0) if on_host else (0, layers_per_gpu(L, gpus))   # (host, each GPU)
    best.update(model=model, gpu=gpu, gpus=gpus, kv_placement=kv_placement,
                microbatches=microbatches, fits=True,
                bound_tokens_per_s=best["batch"] * gpus * link / weights,
                host_bytes=weights + cache_layers[0] * best["kv_bytes_per_layer"],
                resident_cache_bytes_per_gpu=cache_layers[1] * best["kv_bytes_per_layer"],
                published=PUBLISHED.get(model, []))
    return best


def simulated_rows() -> list[dict]:
    """Each setup with the cache on the host and on the GPUs, one microbatch and (several
    GPUs) one per GPU."""
    rows = []
    for model, gpu, gpus in SETUPS:
        for microbatches in sorted({1, gpus}):
            for kv_placement in ("host", "device"):
                rows.append(simulated_row(model, gpu, gpus, kv_placement, microbatches))
    return rows


# ---------------------------------------------------------------------------------- main

def report_measured(m: dict, args) -> dict:
    print(f"\nMeasured: Llama-style, {m['model']['parameters'] / 1e6:.1f}M parameters, batch "
          f"{args.batch}, prompt {args.prompt}, {args.new} new tokens, 2 virtual CPU devices")
    print(f"{'':36} {'tokens/s max':>13} {'median':>9} {'/ transformers':>15} {'same tokens':>12}")
    for name, r in m["rows"].items():
        print(f"{name:36} {r['tokens_per_s_max']:13.1f} {r['tokens_per_s_median']:9.1f} "
              f"{r['over_transformers_median']:15.2f} {str(r['same_tokens']):>12}")
    print(f"\nMeasured bytes of one decode step (the last; fxpipe without a cache: its last "
          f"call), MB; the weights are {m['model']['weight_bytes'] / 1e6:.1f} MB")
    print(f"{'':36} {'h2d params':>11} {'d2h cache':>10} {'h2d act':>8} {'d2h act':>8}  resident stages")
    for name, r in m["rows"].items():
        if "bytes_per_step" in r:
            b = r["bytes_per_step"]
            print(f"{name:36} {b['h2d_bytes_params'] / 1e6:11.2f} {b['d2h_bytes_cache'] / 1e6:10.3f} "
                  f"{b['h2d_bytes_activations'] / 1e6:8.3f} {b['d2h_bytes_activations'] / 1e6:8.3f}  "
                  f"{b.get('resident_stages', '-')}")
    return m


def report_simulated() -> dict:
    rows = simulated_rows()
    print(f"\nSimulated (fxpipe.simulate; a decode step at {CONTEXT}+{NEW} tokens of context, "
          "fp16 weights; KV cache in host memory, streamed with its layer, or resident on the GPUs):")
    print(f"{'model':15} {'GPUs':24} {'mb':>3} | {'host: batch':>11} {'tokens/s':>9} {'bound':>9} "
          f"| {'device: batch':>13} {'tokens/s':>9} {'bound':>9} | {'dev/host':>8}  published")
    for host, device in simulated_pairs(rows):
        print(f"{host['model']:15} {str(host['gpus']) + ' x ' + host['gpu']:24} "
              f"{host['microbatches']:3d} | {_sim_cells(host, 11)} | {_sim_cells(device, 13)} | "
              f"{_ratio(device, host):>8}  {'; '.join(host['published'])}")
    return {"context": CONTEXT, "new": NEW, "rows": rows}


def simulated_pairs(rows: list[dict]) -> list[tuple[dict, dict]]:
    """(host row, device row) of each setup and microbatch count."""
    key = lambda r: (r["model"], r["gpu"], r["gpus"], r["microbatches"])  # noqa: E731
    device = {key(r): r for r in rows if r["kv_placement"] == "device"}
    return [(r, device[key(r)]) for r in rows if r["kv_placement"] == "host"]


def _sim_cells(r: dict, width: int) -> str:
    if not r["fits"]:
        return f"{'no fit':>{width}} {'-':>9} {'-':>9}"
    return f"{r['batch']:{width}d} {r['tokens_per_s']:9.2f} {r['bound_tokens_per_s']:9.2f}"


def _ratio(device: dict, host: dict) -> str:
    if not (device["fits"] and host["fits"]):
        return "-"
    return f"{device['tokens_per_s'] / host['tokens_per_s']:.2f}"


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
