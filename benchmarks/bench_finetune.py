"""bf16 fine-tuning of Hugging Face models from host memory: measured, and predicted.

    python benchmarks/bench_finetune.py              # on a GPU: the two runs; else --dry-run
    python benchmarks/bench_finetune.py --dry-run    # tiny widths, 2 CPU virtual devices (~1 min)
    python benchmarks/bench_finetune.py --predict    # and the full-size runs predicted (~5 min)
    python benchmarks/bench_finetune.py --json       # the last line printed is the JSON
    python benchmarks/bench_finetune.py --stage-backends eager,inductor,cudagraphs   # per backend

Measured (``fxpipe.check.finetune``, also the kit's ``finetune`` section): LoRA r=16 on
the Llama-3.1-8B shape and a full fine-tune of the Qwen3-4B shape, 16 x 4,096 tokens per
step, bf16 device copies, against eager ``transformers`` with gradient checkpointing on
the same GPU (``vs_eager``); tokens/s, model and hardware TFLOP/s, MFU, peaks.

Predicted (``--predict``), labelled so: the same two runs at full size, built on ``meta``,
planned by fxpipe for one H100 (80 GB) and run through
``fxpipe.simulate`` with the H200's measured host link (55 GB/s each way, from
``benchmarks/results/gpu_check.json``), the layers' FLOPs at the rate eager
``transformers`` with gradient checkpointing reached on the H200 in the LoRA run (its
step's FLOPs as fxpipe's cost pass counts them over its measured step; else 60% of
989 TFLOP/s), and the host's AdamW and cast rates measured on this machine
(``host_rates``), and again with the host work free: the two bracket a host of a
different core count. With this machine's host work, the host also issues each action
and kernel at the H200 run's fitted cost (``fxpipe.sim.hardware.H200_HOST``), once per
stage backend (eager, inductor, cudagraphs: what each launches; the kernels run at the
same rate under all three, no fusion speedup modelled; cudagraphs' replays MODELLED).
Writes ``benchmarks/results/bench_finetune.json``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fxpipe.check import finetune as ft  # noqa: E402
from fxpipe.check import finetune_predict as fp  # noqa: E402
from fxpipe.config import STAGE_BACKENDS  # noqa: E402
from fxpipe.check.common import jsonable, link_bandwidth, sync_fn, timed  # noqa: E402
from fxpipe.check.finetune_models import host_bytes  # noqa: E402
from fxpipe.sim.hardware import H200_HOST  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "bench_finetune.json"
GPU_CHECK = ROOT / "benchmarks" / "results" / "gpu_check.json"
GPUS = {"H100": 80e9}     # an H200 predicts the same: the same FLOP rate and link
H200_LINK = 55e9
BACKENDS = ("eager", "inductor", "cudagraphs")
H100_HBM = 3.35e12        # bytes/s of device memory: prices a qlora run's dequantizes


def measured(dry_run: bool, modes: tuple[str, ...], eager: bool,
             backends: tuple[str | None, ...] = ("eager",)) -> dict:
    num = 2 if dry_run else torch.cuda.device_count()
    sync = sync_fn(dry_run)
    link = link_bandwidth(dry_run)
    ctx = ft.context(dry_run, num, lambda fn, w, r: timed(fn, w, r, sync), sync, link)
    rows = ft.run_all(ctx, modes=modes, eager=eager, backends=backends)
    return {"dry_run": dry_run, "devices": num, "peak_bf16_tflops": ctx["peak_tflops"],
            "h2d_bytes_per_s": link[0], "d2h_bytes_per_s": link[1], "runs": rows}


def _eager_step() -> tuple[float | None, str]:
    """The LoRA run's eager step on the H200 (gpu_check.json), which calibrates the
    simulator's FLOP rate; None: not on record."""
    try:
        runs = json.loads(GPU_CHECK.read_text())["finetune"]["runs"]
        row = next(r for r in runs if r["mode"] == "lora" and r["eager"]["ran"])
    except (OSError, KeyError, StopIteration, TypeError):
        return None, "assumed: 60% of 989 TFLOP/s (no eager run on record)"
    return row["eager"]["step_s"], (f"the rate eager transformers reached in the H200 LoRA "
                                    f"run ({row['eager']['step_s']:.2f} s/step, gpu_check.json), "
                                    "in the cost pass's FLOP counting")


def predicted(modes: tuple[str, ...], say=print) -> dict:
    eager_s, source = _eager_step()
    flops = None                         # the LoRA run calibrates it, on the eager step
    if eager_s is None or "lora" not in modes:
        flops = 0.6 * 989.4e12
        if eager_s is not None:
            source = "assumed: 60% of 989 TFLOP/s (the calibrating LoRA run was left out)"
    rates = fp.host_rates()
    say(f"host AdamW(fused=True) {rates['optimizer_bytes_per_s'] / 1e9:.2f} GB/s (without fused "
        f"{rates['optimizer_default_bytes_per_s'] / 1e9:.2f}), cast "
        f"{rates['copy_bytes_per_s'] / 1e9:.1f} GB/s (this machine)")
    # this machine's host work, issuing at the H200's fitted cost, per stage backend; and
    # a free host (nothing to issue)
    hosts = [({"this machine": (rates["optimizer_bytes_per_s"], rates["copy_bytes_per_s"])},
              H200_HOST, BACKENDS),
             ({"free": (float("inf"), float("inf"))}, None, ("eager",))]
    rows = []
    specs = sorted((s for s in ft.run_specs(False) if s["mode"] in modes and s["seq"] is not None),
                   key=lambda s: s["mode"] != "lora")       # lora first: it calibrates
    for spec in specs:
        for (gpu, memory), (host, issue, backends) in itertools.product(GPUS.items(), hosts):
            t0 = time.perf_counter()
            calibrate = flops is None and spec["mode"] == "lora"
            for row in fp.predict(spec, memory=memory, link=H200_LINK, hosts=host,
                                  flops=flops, eager_step_s=eager_s if calibrate else None,
                                  recompute=("auto", "full"), device_bytes_per_s=H100_HBM,
                                  host_issue=issue, backends=backends):
                row.update(gpu=gpu, seconds=time.perf_counter() - t0,
                           host_issue_fit="H200_HOST" if issue else None,
                           modelled=row["stage_backend"] == "cudagraphs")
                rows.append(row)
                say(f"  {row['mode']:>4} {row['model']:<13} {gpu} host work {row['host_work']:<12} "
                    f"{row['stage_backend']:<10} recompute {row['recompute']} "
                    f"({row['recomputed']:.0%} of the blocks; "
                    f"hardware/model FLOPs {row['flops_ratio']:.2f}): "
                    f"{row['predicted_step_s']:6.2f} s/step (host issue {row['host_issue_s']:.2f} s), "
                    f"{row['tokens_per_s']:7,.0f} tokens/s, "
                    f"{row['model_tflops']:5.0f} model TFLOP/s, MFU {row['model_tflops'] / 989.4:.1%} "
                    f"(at {row['flops_per_s'] / 1e12:.0f} TFLOP/s)")
            flops = rows[-1]["flops_per_s"]
    out = {"label": "PREDICTED (fxpipe.simulate), not measured", "flops_per_s": flops,
           "flops_source": source, "link_bytes_per_s": H200_LINK, "host_rates": rates,
           "host_rates_source": "measured on the machine that ran this benchmark",
           "host_issue": dict(H200_HOST), "rows": rows}
    if "qlora" in modes:
        out["qlora"] = predicted_qlora(rates, say)
    return out


# --predict with qlora: the large LoRA runs on 24 GiB cards, bf16 base against NF4
QLORA_MODELS = {
    "Llama-3.1-70B": dict(cls="LlamaConfig", vocab_size=128256, hidden_size=8192,
                          intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                          num_key_value_heads=8, max_position_embeddings=131072,
                          rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False),
    "Qwen3-32B": dict(cls="Qwen3Config", vocab_size=151936, hidden_size=5120,
                      intermediate_size=25600, num_hidden_layers=64, num_attention_heads=64,
                      num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                      rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False)}
RTX4090 = dict(memory=24 * 2**30, link=25e9, flops=0.6 * 165e12, hbm=1008e9)
QLORA_MACHINES = {1: 64 * 2**30, 8: 256 * 2**30}   # GPUs: the host memory a plan may use
QLORA_SEQ, QLORA_MICROBATCHES = 4096, 8
QLORA_SHORT = 1024   # and on 8 GPUs, 8 x 1,024 tokens a step: where the link binds


def predicted_qlora(rates: dict, say=print) -> list[dict]:
    """Llama-3.1-70B and Qwen3-32B LoRA (r=16, every linear of the blocks) with a bf16
    base and an NF4 one, on 1 and 8 RTX 4090s (24 GiB, PCIe 4.0 at 25 GB/s each way,
    1,008 GB/s of device memory; the FLOPs at 60% of 165 TFLOP/s, assumed): each run
    ``QLORA_MICROBATCHES`` x ``QLORA_SEQ`` tokens a step, planned and simulated
    (``fp.predict``: tokens/s, the host bytes its plan keeps), and the longest sequence
    (``fxpipe.plan.max_sequence_length``, one sequence a step) within
    ``QLORA_MACHINES``' host memory; on 8 GPUs also ``QLORA_SHORT``-token sequences,
    a step short enough for the link to bind (no longest-sequence search)."""
    import transformers
    import fxpipe
    rows = []
    for name, cfg in QLORA_MODELS.items():
        cfg = dict(cfg)
        config = getattr(transformers, cfg.pop("cls"))(**cfg, use_cache=False)
        runs = [(gpus, host, QLORA_SEQ) for gpus, host in QLORA_MACHINES.items()]
        runs.append((8, QLORA_MACHINES[8], QLORA_SHORT))
        for gpus, host, seq in runs:
            for mode in ("lora", "qlora"):
                t0 = time.perf_counter()
                spec = dict(mode=mode, model=name, config=config, seq=seq,
                            microbatches=QLORA_MICROBATCHES)
                row = fp.predict(spec, memory=RTX4090["memory"], link=RTX4090["link"],
                                 hosts={"this machine": (rates["optimizer_bytes_per_s"],
                                                         rates["copy_bytes_per_s"])},
                                 flops=RTX4090["flops"], num_devices=gpus,
                                 device_bytes_per_s=RTX4090["hbm"])[0]
                model = fp.meta_model(spec)
                row["host_param_bytes"] = host_bytes(model)

                def batch(n):
                    ids = torch.zeros(1, n, dtype=torch.long, device="meta")
                    return {"input_ids": ids, "labels": ids}
                try:
                    row["longest"] = fxpipe.plan.max_sequence_length(
                        model, batch, device_memory=RTX4090["memory"], num_devices=gpus,
                        num_microbatch=1, host_memory=host, step=4096, max_length=1 << 20,
                        sequence_chunks=None, optimizer=torch.optim.AdamW(
                            [p for p in model.parameters() if p.requires_grad])
                    ) if seq == QLORA_SEQ else None
                except fxpipe.PlanError as e:
                    row["longest"], row["longest_why"] = None, str(e)
                row.update(gpus=gpus, host_memory=host, seq=seq, seconds=time.perf_counter() - t0)
                rows.append(row)
                longest = f"{row['longest']:,}" if row["longest"] else \
                    "none fits" if seq == QLORA_SEQ else "not searched"
                say(f"  {mode:>5} {name:<13} {gpus} x 4090, {seq:,} tokens: host "
                    f"{row['predicted_host_bytes'] / 2**30:6.1f} GiB "
                    f"(params {row['host_param_bytes'] / 2**30:6.1f} GiB), "
                    f"{row['tokens_per_s']:7,.0f} tokens/s, longest {longest} tokens "
                    f"(host <= {host / 2**30:.0f} GiB)")
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="tiny widths on CPU virtual devices")
    ap.add_argument("--predict", action="store_true", help="also the full-size runs, predicted")
    ap.add_argument("--modes", default="lora,full",
                    help="runs to do: lora, qlora, full, longest (default lora,full)")
    ap.add_argument("--no-eager", action="store_true", help="leave the eager reference out")
    ap.add_argument("--stage-backends", default="eager", metavar="NAME,...",
                    help="fxpipe's RunConfig.stage_backend for each run (eager, inductor, "
                         "auto, cudagraphs)")
    ap.add_argument("--json", action="store_true", help="print the JSON as the last line")
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args(argv)
    modes = tuple(m.strip() for m in args.modes.split(","))
    if not set(modes) <= {"lora", "qlora", "full", "longest"}:
        ap.error(f"--modes {args.modes!r}: the runs are lora, qlora, full and longest")
    backends = tuple(b.strip() for b in args.stage_backends.split(","))
    if not set(backends) <= set(STAGE_BACKENDS):
        ap.error(f"--stage-backends {args.stage_backends!r}: each is one of "
                 f"{', '.join(STAGE_BACKENDS)}")
    dry_run = args.dry_run or not torch.cuda.is_available()
    if dry_run and not args.dry_run:
        print("no CUDA GPU visible: the runs at tiny widths on CPU virtual devices (--dry-run)")
    if dry_run:
        torch.set_num_threads(1)   # as each virtual device's workers: a like-for-like eager
    res = {"measured": measured(dry_run, modes, not args.no_eager, backends)}
    if args.predict:
        torch.set_num_threads(torch.get_num_threads() if not dry_run else 2)
        res["predicted"] = predicted(modes)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(jsonable(res), indent=1) + "\n")
    print(f"wrote {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}")
    if args.json:
        print(json.dumps(jsonable(res)))
    return 0 if all(r["ok"] for r in res["measured"]["runs"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
