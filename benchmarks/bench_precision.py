"""Mixed precision benchmark: what bf16 changes in a training step, fp32 against both routes.

    .venv/bin/python benchmarks/bench_precision.py          # ~5 min on 2 cores

A Llama-style decoder (transformers' ``LlamaForCausalLM`` from a config in code, nothing
downloaded) trained one fused step per call on 2 virtual devices with its own ``labels=``
loss and AdamW passed to the call, three ways: fp32; ``param_dtype=torch.bfloat16`` (bf16
device copies of the fp32 masters); ``torch.autocast("cpu", dtype=torch.bfloat16)``
around the call (fp32 parameters). Per step, from ``pipe.stats()``: parameter bytes
uploaded, gradient bytes downloaded, activation bytes both ways; the predicted device
peak (``fxpipe.plan.predict_memory``) and the measured one (the virtual devices' byte
count); the loss after the same steps, against fp32's; and wall time (interleaved rounds,
min and median). Bytes and peaks carry over to a GPU; CPU time does not (a CPU without
bf16 units runs bf16 matmuls several times slower than fp32 ones). Ratios against fp32.

Writes ``benchmarks/results/bench_precision.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import fxpipe  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "bench_precision.json"
BYTES = ("h2d_bytes_params", "d2h_bytes_grads", "h2d_bytes_activations", "d2h_bytes_activations")
VARIANTS = ("fp32", "param_dtype", "autocast")


def build(args):
    import transformers as T
    torch.manual_seed(0)
    cfg = T.LlamaConfig(vocab_size=args.vocab, hidden_size=args.dim, intermediate_size=args.ffn,
                        num_hidden_layers=args.depth, num_attention_heads=args.dim // 64,
                        num_key_value_heads=args.dim // 64, max_position_embeddings=args.seq,
                        use_cache=False)
    return T.LlamaForCausalLM(cfg).eval()


def precision(variant: str):
    """The context a call of ``variant`` runs in."""
    if variant == "autocast":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--ffn", type=int, default=1408)
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    kw = {"input_ids": ids, "labels": ids}
    runs = {}
    for name in VARIANTS:
        model = build(args)
        devices = [fxpipe.VirtualDevice() for _ in range(2)]
        pipe = fxpipe.compile(model, example_kwargs=kw, devices=devices,
                              config=fxpipe.RunConfig(num_microbatch=args.microbatches),
                              param_dtype=torch.bfloat16 if name == "param_dtype" else None)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step(pipe=pipe, opt=opt, name=name) -> tuple[float, float]:
            t0 = time.perf_counter()
            with precision(name):
                loss = pipe.forward_backward((), kw, loss_fn=lambda out, _: out.loss, optimizer=opt)
            opt.zero_grad(set_to_none=True)
            return time.perf_counter() - t0, loss.item()
        runs[name] = (model, pipe, devices, step)
    times: dict[str, list[float]] = {name: [] for name in runs}
    losses: dict[str, list[float]] = {name: [] for name in runs}
    stats: dict[str, dict] = {}
    predicted: dict[str, int] = {}
    for name, (_, pipe, devices, step) in runs.items():   # warm-up: the first step makes the state
        for d in devices:
            d.reset_peak()
        for _ in range(2):
            losses[name].append(step()[1])
        stats[name] = pipe.stats()
        with precision(name):   # the graph the calls run (captured under their autocast state)
            predicted[name] = fxpipe.plan.predict_memory(pipe).peak
    for _ in range(args.repeats):
        for name, (_, pipe, _, step) in runs.items():   # interleaved
            seconds, loss = step()
            times[name].append(seconds)
            losses[name].append(loss)
            assert all(pipe.stats()[k] == stats[name][k] for k in BYTES)  # the same every step
    res = {"model": {k: getattr(args, k) for k in ("dim", "ffn", "depth", "vocab", "batch", "seq",
                                                     "microbatches")},
           "parameters": sum(p.numel() for p in runs["fp32"][0].parameters()),
           "devices": 2, "repeats": args.repeats, "variants": {}, "over_fp32": {}}
    print(f"\nLlama-style decoder, {args.depth} blocks, dim {args.dim}, vocab {args.vocab}, "
          f"{res['parameters'] / 1e6:.1f}M parameters; batch {args.batch}x{args.seq}, "
          f"{args.microbatches} microbatches, 2 virtual devices, AdamW streamed; per step:")
    print(f"{'variant':>11} | {'h2d params':>10} | {'d2h grads':>10} | {'h2d act':>8} | "
          f"{'d2h act':>8} | {'peak pred':>10} | {'peak meas':>10} | {'last loss':>9} | "
          f"{'min s':>6} | {'median s':>8}")
    for name, (_, _, devices, _) in runs.items():
        row = {**{k: stats[name][k] for k in BYTES},
               "predicted_peak_bytes": predicted[name],
               "measured_peak_bytes": max(d.peak_bytes() for d in devices),
               "losses": losses[name], "min_s": min(times[name]),
               "median_s": statistics.median(times[name]), "times_s": times[name]}
        res["variants"][name] = row
        mib = {k: f"{row[k] / 2**20:.1f} MiB" for k in (*BYTES, "predicted_peak_bytes",
                                                       "measured_peak_bytes")}
        print(f"{name:>11} | {mib['h2d_bytes_params']:>10} | {mib['d2h_bytes_grads']:>10} | "
              f"{mib['h2d_bytes_activations']:>8} | {mib['d2h_bytes_activations']:>8} | "
              f"{mib['predicted_peak_bytes']:>10} | {mib['measured_peak_bytes']:>10} | "
              f"{losses[name][-1]:9.4f} | {row['min_s']:6.3f} | {row['median_s']:8.3f}")
    fp32 = res["variants"]["fp32"]
    for name in ("param_dtype", "autocast"):
        row = res["variants"][name]
        paired = [a / b for a, b in zip(times[name], times["fp32"])]
        res["over_fp32"][name] = {
            **{k: row[k] / fp32[k] for k in (*BYTES, "predicted_peak_bytes", "measured_peak_bytes")},
            "loss_relative_difference": max(abs(a - b) / abs(b) for a, b in
                                            zip(row["losses"], fp32["losses"])),
            "time_paired_median": statistics.median(paired),
            "time_from_mins": row["min_s"] / fp32["min_s"]}
        o = res["over_fp32"][name]
        print(f"  {name} / fp32: parameter bytes up {o['h2d_bytes_params']:.3f}, gradient bytes "
              f"down {o['d2h_bytes_grads']:.3f}, activation bytes up "
              f"{o['h2d_bytes_activations']:.3f}, predicted peak {o['predicted_peak_bytes']:.3f}, "
              f"measured peak {o['measured_peak_bytes']:.3f}; losses within "
              f"{o['loss_relative_difference']:.2e}; time {o['time_paired_median']:.3f} "
              f"(paired median)")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
