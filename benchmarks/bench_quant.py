"""Quantized frozen weights (``frozen_dtype=``, ``fxpipe.quant``): the bytes a LoRA step
holds on the host and moves over the link, measured on the Llama-3.1-8B shape.

    python benchmarks/bench_quant.py --variants bf16,nf4,int8,nf4+head   # 32 blocks (~25 min, ~17 GB RAM)
    python benchmarks/bench_quant.py --layers 2   # the same widths, 2 blocks, every variant

One process per variant (``bf16``: the base as it is; ``nf4``, ``int8``, ``fp8``:
``frozen_dtype``'s formats, embeddings and head kept in bf16, QLoRA's default;
``nf4+head``: the output head quantized too, ``quantize_frozen(skip=())``), each: the
model built in bf16 in host memory, peft LoRA r=16 on every linear of the blocks, the
frozen linears quantized, one training step of one 2-token sequence on one device (a
GPU if there is one, else a virtual device of 3 GiB with a GPU's semantics). Recorded:
``host_param_bytes`` (every parameter and buffer as the host holds it),
``h2d_bytes_params`` (``pipe.stats()`` of the step: what the uploads carried),
``quantize_s``, the step's wall time (CPU figures: the dequantizes run on the host's
cores) and peak RSS. The ratios against ``bf16`` are what carry to a GPU: bytes are bytes.
What quantizing the embedding table too would give is computed (not run): its bytes at
0.5625 per weight; and what gathering its rows on the host would give: no table upload.
Writes ``benchmarks/results/bench_quant.json``.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

OUT = ROOT / "benchmarks" / "results" / "bench_quant.json"
VARIANTS = ("bf16", "nf4", "int8", "fp8", "nf4+head")
SEQ = 2   # tokens: the bytes do not depend on it; a CPU's bf16 matmuls of a backward are slow


def child(variant: str, layers: int) -> dict:
    import fxpipe
    from fxpipe import quant
    from fxpipe.check.finetune import run_specs
    from fxpipe.check.finetune_models import host_bytes, host_model, with_lora
    torch.manual_seed(0)
    config = next(s for s in run_specs(False) if s["mode"] == "lora")["config"]
    config.num_hidden_layers = layers
    gpu = torch.cuda.is_available()
    t0 = time.perf_counter()
    model = with_lora(host_model(config, torch.bfloat16, torch.device("cuda" if gpu else "cpu")))
    build_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    if variant != "bf16":
        fmt, _, head = variant.partition("+")
        quant.quantize_frozen(model, fmt, skip=() if head else None)
    quantize_s = time.perf_counter() - t0
    held, weights = quant.quantized_bytes(model)
    ids = torch.randint(0, config.vocab_size, (1, SEQ))
    batch = {"input_ids": ids, "labels": ids}
    devices = ["cuda:0"] if gpu else [fxpipe.VirtualDevice(semantics="cuda", memory_limit=3 * 2**30)]
    pipe = fxpipe.compile(model, example_kwargs=batch, devices=devices, param_dtype=torch.bfloat16,
                          config=fxpipe.RunConfig(num_microbatch=1))
    t0 = time.perf_counter()
    loss = pipe.forward_backward((), batch, loss_fn=lambda o, _: o.loss)
    step_s = time.perf_counter() - t0
    st = pipe.stats()
    embed = model.get_input_embeddings().weight
    at = next(layer.index for layer in pipe.layers if any("embed_tokens" in p for p in layer.params))
    uploads = sum(at in r for r in (*pipe.plan.fwd_plan, *pipe.plan.bwd_plan))
    return {"variant": variant, "layers": layers, "device": "cuda:0" if gpu else "virtual (cpu)",
            "params": quant.parameter_count(model),
            "host_param_bytes": host_bytes(model),
            "quantized_bytes": held, "quantized_weight_bytes_bf16": weights,
            "bytes_per_quantized_weight": held / (weights / 2) if weights else None,
            "embedding_bytes": embed.nbytes, "embedding_weights": embed.numel(),
            "embedding_uploads": uploads,   # the stages of the step holding the table
            "h2d_bytes_params": st["h2d_bytes_params"], "d2h_bytes_grads": st["d2h_bytes_grads"],
            "loss": float(loss), "build_s": build_s, "quantize_s": quantize_s, "step_s": step_s,
            "plan": repr(pipe.plan),
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32, help="blocks of the 8B shape (default 32)")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.layers)))
        return 0
    rows = []
    for v in args.variants.split(","):
        p = subprocess.run([sys.executable, __file__, "--child", v, "--layers", str(args.layers)],
                           capture_output=True, text=True)
        if p.returncode:
            print(p.stderr[-3000:], file=sys.stderr)
            raise SystemExit(f"variant {v} failed")
        rows.append(json.loads(p.stdout.strip().splitlines()[-1]))
        r = rows[-1]
        print(f"{v:>9}: host params {r['host_param_bytes'] / 1e9:6.2f} GB, h2d params "
              f"{r['h2d_bytes_params'] / 1e9:6.2f} GB, quantize {r['quantize_s']:5.1f} s, "
              f"step {r['step_s']:6.1f} s ({r['device']}), loss {r['loss']:.4f}", flush=True)
    base = next((r for r in rows if r["variant"] == "bf16"), None)
    print(f"\n{'variant':>9} | host params | ÷ bf16 | h2d params | ÷ bf16 | bytes/quantized weight")
    for r in rows:
        if base:
            r["host_cut"] = base["host_param_bytes"] / r["host_param_bytes"]
            r["h2d_cut"] = base["h2d_bytes_params"] / r["h2d_bytes_params"]
        per = r["bytes_per_quantized_weight"]
        print(f"{r['variant']:>9} | {r['host_param_bytes'] / 1e9:8.2f} GB | {r.get('host_cut', 1):5.2f}x "
              f"| {r['h2d_bytes_params'] / 1e9:7.2f} GB | {r.get('h2d_cut', 1):5.2f}x | "
              f"{'-' if per is None else f'{per:.4f}'}")
    computed = {}
    head = next((r for r in rows if r["variant"] == "nf4+head"), None)
    if base and head:   # the embedding table in NF4 too, and not uploaded at all (computed)
        k = head["embedding_uploads"]
        table, nf4_table = k * head["embedding_bytes"], k * head["embedding_weights"] * 0.5625
        computed = {
            "nf4_everything_h2d_cut": base["h2d_bytes_params"] / (head["h2d_bytes_params"] - table + nf4_table),
            "nf4_head_embedding_on_host_h2d_cut": base["h2d_bytes_params"] / (head["h2d_bytes_params"] - table),
            "note": "computed from the nf4+head row: the embedding table's uploads (its bf16 "
                    "bytes, once per stage of the step holding it: embedding_uploads) replaced "
                    "by its NF4 bytes, or by none"}
        print(f"computed: embeddings in NF4 too {computed['nf4_everything_h2d_cut']:.2f}x; "
              f"their rows gathered on the host (no table upload) {computed['nf4_head_embedding_on_host_h2d_cut']:.2f}x")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"layers": args.layers, "rows": rows, "computed": computed}, indent=1) + "\n")
    print(f"wrote {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
