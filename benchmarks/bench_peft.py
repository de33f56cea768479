"""peft LoRA benchmark: bytes moved and time per training step, with and without LoRA.

    .venv/bin/python benchmarks/bench_peft.py               # ~3 min on 2 cores

A Llama-style decoder (transformers' ``LlamaForCausalLM``, built from a config in code,
nothing downloaded) trained one fused step per call on 2 virtual devices with its own
``labels=`` loss and AdamW passed to the call (the streamed step): the full model, and
the same weights under peft LoRA on the q/v projections (``LoraConfig(r=8,
target_modules=["q_proj", "v_proj"])``: the base weights frozen). Per step, from
``pipe.stats()``: parameter bytes uploaded, gradient bytes downloaded, activation bytes
both ways; and the wall time per step of each (interleaved rounds, min and median) with
the LoRA / full ratio per round. The frozen base weights still go to the devices (the
forward and the backward's recompute need them); what LoRA saves is their gradients
(none on the devices, none downloaded, no optimizer state or step).

Writes ``benchmarks/results/bench_peft.json``.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import fxpipe  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "bench_peft.json"
BYTES = ("h2d_bytes_params", "d2h_bytes_grads", "h2d_bytes_activations", "d2h_bytes_activations")


def build(args):
    import peft
    import transformers as T
    torch.manual_seed(0)
    cfg = T.LlamaConfig(vocab_size=args.vocab, hidden_size=args.dim, intermediate_size=args.ffn,
                        num_hidden_layers=args.depth, num_attention_heads=args.dim // 64,
                        num_key_value_heads=args.dim // 64, max_position_embeddings=args.seq,
                        use_cache=False)
    full = T.LlamaForCausalLM(cfg).eval()
    lora = peft.get_peft_model(copy.deepcopy(full), peft.LoraConfig(
        r=args.rank, lora_alpha=2 * args.rank, target_modules=["q_proj", "v_proj"],
        lora_dropout=0.0)).eval()
    return {"full": full, "lora": lora}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--ffn", type=int, default=1408)
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    kw = {"input_ids": ids, "labels": ids}
    models = build(args)
    runs = {}
    for name, model in models.items():
        pipe = fxpipe.compile(model, example_kwargs=kw, devices=[fxpipe.VirtualDevice() for _ in range(2)],
                              config=fxpipe.RunConfig(num_microbatch=args.microbatches))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step(pipe=pipe, opt=opt) -> float:
            t0 = time.perf_counter()
            pipe.forward_backward((), kw, loss_fn=lambda out, _: out.loss, optimizer=opt)
            opt.zero_grad(set_to_none=True)
            return time.perf_counter() - t0
        runs[name] = (model, pipe, opt, step)
    times: dict[str, list[float]] = {name: [] for name in runs}
    stats: dict[str, dict] = {}
    for name, (_, pipe, _, step) in runs.items():   # warm-up: the first step makes the state
        step()
        step()
        stats[name] = pipe.stats()
    for _ in range(args.repeats):
        for name, (_, pipe, _, step) in runs.items():   # interleaved
            times[name].append(step())
            assert all(pipe.stats()[k] == stats[name][k] for k in BYTES)  # the same every step
    res = {"model": {k: getattr(args, k) for k in ("dim", "ffn", "depth", "vocab", "batch", "seq",
                                                     "microbatches", "rank")},
           "devices": 2, "repeats": args.repeats, "variants": {}}
    full_params = sum(p.numel() for p in models["full"].parameters())
    print(f"\nLlama-style decoder, {args.depth} blocks, dim {args.dim}, vocab {args.vocab}, "
          f"{full_params / 1e6:.1f}M parameters; batch {args.batch}x{args.seq}, "
          f"{args.microbatches} microbatches, 2 virtual devices, AdamW streamed; per step:")
    print(f"{'variant':>7} | {'trainable':>10} | {'h2d params':>10} | {'d2h grads':>10} | "
          f"{'h2d act':>8} | {'d2h act':>8} | {'min s':>6} | {'median s':>8}")
    for name, (model, pipe, opt, _) in runs.items():
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        row = {"parameters": sum(p.numel() for p in model.parameters()), "trainable": trainable,
               "optimizer_state_tensors": sum(len(s) for s in opt.state.values()),
               **{k: stats[name][k] for k in BYTES},
               "min_s": min(times[name]), "median_s": statistics.median(times[name]),
               "times_s": times[name]}
        res["variants"][name] = row
        mib = {k: f"{row[k] / 2**20:.1f} MiB" for k in BYTES}
        print(f"{name:>7} | {trainable / 1e6:9.2f}M | {mib['h2d_bytes_params']:>10} | "
              f"{mib['d2h_bytes_grads']:>10} | {mib['h2d_bytes_activations']:>8} | "
              f"{mib['d2h_bytes_activations']:>8} | {row['min_s']:6.3f} | {row['median_s']:8.3f}")
    paired = [lo / fu for lo, fu in zip(times["lora"], times["full"])]
    res["lora_over_full"] = {"paired_median": statistics.median(paired),
                             "from_mins": min(times["lora"]) / min(times["full"]),
                             "d2h_bytes_grads": res["variants"]["lora"]["d2h_bytes_grads"]
                             / res["variants"]["full"]["d2h_bytes_grads"]}
    print(f"  LoRA / full time per step: {res['lora_over_full']['paired_median']:.3f} (paired "
          f"median), {res['lora_over_full']['from_mins']:.3f} (mins); gradient bytes "
          f"downloaded: {res['lora_over_full']['d2h_bytes_grads']:.4f}x")
    for _, pipe, _, _ in runs.values():
        pipe.close()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    print(f"wrote {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
