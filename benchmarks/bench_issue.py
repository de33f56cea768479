"""Host issue cost of one training step, with the device work elided, vs the GPU time of it.

    python benchmarks/bench_issue.py [--quick] [--repeats 3] [--json]

One process issues every GPU's work from Python threads sharing one GIL. This measures
that host work on the real issue path (the executor's issue threads, the Program's
actions, the stage code, events, the host lane) and sets it beside the time the GPUs
would compute the same step:

- The plan is fxpipe's own (``ExecutePlan.auto("fused", ...)``) for the full-size model,
  built on ``meta`` (no weights) at the row's tokens per microbatch, on 80 GiB devices.
- The step is then run with that plan on a model of the same architecture (layer count,
  ops per layer, parameters per layer) at tiny widths, on ``InlineDevice``s: each
  action's Python runs at issue on its device's issue thread, as on a ``CudaDevice``,
  and its kernels run at once on tensors of a few hundred elements, so they cost next to
  nothing. ``host_issue_ms`` is the wall time of the fused call (every thread, GIL-
  serialized as they are): the host time of one step. Kernels on ``meta`` tensors would
  elide the work too, but an elementwise op on ``meta`` costs 130-150 us of Python here
  (torch's meta functions), 20x a CUDA launch, so they would measure torch, not fxpipe.
- ``eager_ms``: the same tiny model run eagerly on the host, per microbatch a forward
  without grad (the recompute) and a forward and backward: the op dispatch an eager
  PyTorch step pays anyway. ``overhead_ms`` = host - eager: what fxpipe adds.
- ``predicted_gpu_ms``: the cost model's FLOPs of the full-size step (per microbatch:
  forward, recompute but in the fused tail, backward; ``fxpipe.passes.costs``) over the
  GPUs at ``--mfu`` of H100 SXM bf16 dense (989 TFLOP/s) and RTX 4090 bf16 (165 TFLOP/s,
  fp32 accumulate).
  ``ratio`` = host_issue_ms / predicted_gpu_ms: above 1 the GPUs wait for Python.
- ``action_us``: the host cost of one action around an empty stage (one
  ``Linear(1, 1)``, one device, inference): the call's time at 16 microbatches less its
  time at 1, over the actions it adds; and what a call costs besides its actions.

Rows: Llama-3.1-8B, Qwen3-1.7B and Qwen3-32B shapes; 1, 2, 4 and 8 GPUs; RoundPipe's
published step (16 microbatches, ``tests/data/roundpipe_simulation.json``) at 4K and
16K tokens per microbatch. CPU wall time is noisy: calls are interleaved, repeated, and
the minimum and median reported. Writes benchmarks/results/bench_issue.json; with
``--json`` the last line printed is that JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn as nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import fxpipe  # noqa: E402
from bench_memory import CausalLM  # noqa: E402
from fxpipe.runtime.devices import InlineDevice  # noqa: E402

GiB = 2**30
PEAK = {"h100": 989e12, "rtx4090": 165e12}   # bf16 dense FLOP/s
MICROBATCHES = 16                             # RoundPipe's published step
MODELS = {   # transformers' configs' shapes (untied embeddings)
    "Llama-3.1-8B": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                         head_dim=128, rope_theta=500000.0, qk_norm=False),
    "Qwen3-1.7B": dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, rope_theta=1000000.0, qk_norm=True),
    "Qwen3-32B": dict(vocab_size=151936, hidden_size=5120, intermediate_size=25600,
                      num_hidden_layers=64, num_attention_heads=64, num_key_value_heads=8,
                      head_dim=128, rope_theta=1000000.0, qk_norm=True),
}
TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8)
TINY_TOKENS = 8


def config(shape: dict, **override) -> tuple[SimpleNamespace, bool]:
    c = {**shape, **override}
    qk_norm = c.pop("qk_norm")
    theta = c.pop("rope_theta")
    return SimpleNamespace(rms_norm_eps=1e-6, rope_parameters={"rope_theta": theta}, **c), qk_norm


def full_size(name: str, gpus: int, seq_len: int) -> tuple[fxpipe.ExecutePlan, float]:
    """fxpipe's plan for the full-size model on ``gpus`` 80 GiB devices, and one step's
    FLOPs (every microbatch's forward, recompute and backward; the fused tail, the first
    backward stage, is not recomputed)."""
    c, qk_norm = config(MODELS[name])
    with torch.device("meta"):
        model = CausalLM(c, qk_norm, chunked=True).to(torch.bfloat16)
    ids = torch.zeros(1, seq_len, dtype=torch.long, device="meta")
    devices = [InlineDevice(memory_limit=80 * GiB) for _ in range(gpus)]
    pipe = fxpipe.compile(model, example_inputs=(ids, ids), devices=devices)
    plan = fxpipe.ExecutePlan.auto("fused", pipe, num_microbatch=MICROBATCHES)
    tail = plan.bwd_plan[0]
    flops = sum((1 if i in tail else 2) * layer.cost.fwd_flops + layer.cost.bwd_flops
                for i, layer in enumerate(pipe.layers))
    return plan, flops * MICROBATCHES


def tiny_pipe(name: str, gpus: int, plan: fxpipe.ExecutePlan):
    c, qk_norm = config(MODELS[name], **TINY)
    torch.manual_seed(0)
    model = CausalLM(c, qk_norm, chunked=True)
    ids = torch.randint(0, c.vocab_size, (MICROBATCHES, TINY_TOKENS))
    pipe = fxpipe.compile(model, example_inputs=(ids, ids),
                          devices=[InlineDevice() for _ in range(gpus)], plan=plan,
                          config=fxpipe.RunConfig(num_microbatch=MICROBATCHES))
    return model, pipe, ids


def timed(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        out.append((time.perf_counter() - start) * 1e3)
    return out


def eager_step(model: nn.Module, ids: torch.Tensor) -> None:
    for m in range(MICROBATCHES):
        x = ids[m:m + 1]
        with torch.no_grad():
            model(x, x)
        model(x, x).backward()
    model.zero_grad(set_to_none=True)


def action_cost(repeats: int) -> dict:
    """Host microseconds per action around an empty stage (one ``Linear(1, 1)``, one
    device, inference): the call's time at 1 and 16 microbatches; the difference over
    the difference in actions is one action's cost, what remains at 1 the call's own."""
    pipes = {}
    for m in (1, 16):
        pipe = fxpipe.compile(nn.Sequential(nn.Linear(1, 1)), example_inputs=(torch.zeros(m, 1),),
                              devices=[InlineDevice()], config=fxpipe.RunConfig(num_microbatch=m))
        x = torch.zeros(m, 1)
        for _ in range(20):
            pipe(x)
        pipes[m] = (pipe, x, pipe.stats()["actions"])
    calls = 100
    us: dict[int, list[float]] = {1: [], 16: []}
    for _ in range(repeats):   # interleaved
        for m, (pipe, x, _) in pipes.items():
            start = time.perf_counter()
            for _ in range(calls):
                pipe(x)
            us[m].append((time.perf_counter() - start) * 1e6 / calls)
    (_, _, a1), (_, _, a16) = pipes[1], pipes[16]
    per = [(b - a) / (a16 - a1) for a, b in zip(us[1], us[16])]
    return {"actions": [a1, a16], "call_us_min": [min(us[1]), min(us[16])],
            "min_us": min(per), "median_us": statistics.median(per),
            "call_fixed_us": min(us[1]) - a1 * min(per)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--mfu", type=float, default=0.6)
    ap.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    ap.add_argument("--gpus", nargs="+", type=int, default=[1, 2, 4, 8])
    ap.add_argument("--tokens", nargs="+", type=int, default=[4096, 16384],
                    help="tokens per microbatch")
    ap.add_argument("--quick", action="store_true", help="Llama-3.1-8B on 1 and 8 GPUs at 4K only")
    ap.add_argument("--json", action="store_true", help="print the result JSON as the last line")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "bench_issue.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    if args.quick:
        args.models, args.gpus, args.tokens = ["Llama-3.1-8B"], [1, 8], [4096]
    cases = [(m, g, n) for m in args.models for g in args.gpus for n in args.tokens]
    action = action_cost(args.repeats)
    print(f"host cost of one action around an empty stage: {action['min_us']:.1f} us min, "
          f"{action['median_us']:.1f} us median; a call's own: {action['call_fixed_us']:.0f} us")
    head = (f"{'model':<14} {'gpus':>4} {'tokens':>6} {'stages f/b':>10} {'actions':>7} "
            f"{'host ms':>8} {'eager ms':>8} {'fxpipe+':>8} {'H100 ms':>8} {'ratio':>6} "
            f"{'4090 ms':>8} {'ratio':>6}")
    print(head)
    rows = []
    for name, gpus, seq_len in cases:
        plan, flops = full_size(name, gpus, seq_len)
        model, pipe, ids = tiny_pipe(name, gpus, plan)
        step = lambda: pipe.forward_backward((ids, ids))   # noqa: E731
        eager = lambda: eager_step(model, ids)            # noqa: E731
        step(), eager()   # warm up (the first call builds the Program and its stores)
        host, base = [], []
        for _ in range(args.repeats):   # interleaved
            host += timed(step, 1)
            base += timed(eager, 1)
        stats = pipe.stats()
        predicted = {k: flops / (gpus * peak * args.mfu) * 1e3 for k, peak in PEAK.items()}
        row = {"model": name, "gpus": gpus, "seq_len": seq_len, "microbatches": MICROBATCHES,
               "plan": repr(plan), "fwd_stages": len(plan.fwd_plan),
               "bwd_stages": len(plan.bwd_plan),
               "actions": stats["actions"], "host_issue_ms": min(host),
               "host_issue_ms_median": statistics.median(host), "eager_ms": min(base),
               "eager_ms_median": statistics.median(base),
               "overhead_ms": min(host) - min(base),
               "host_issue_us_by_kind": {k.split(".", 1)[1]: v for k, v in stats.items()
                                         if k.startswith("host_issue_us.")},
               "step_tflop": flops / 1e12, "mfu": args.mfu,
               "predicted_gpu_ms": predicted["h100"], "ratio": min(host) / predicted["h100"],
               "predicted_gpu_ms_rtx4090": predicted["rtx4090"],
               "ratio_rtx4090": min(host) / predicted["rtx4090"]}
        rows.append(row)
        stages = f"{len(plan.fwd_plan):>5}/{len(plan.bwd_plan):<4}"
        print(f"{name:<14} {gpus:>4} {seq_len // 1024:>5}K {stages} "
              f"{row['actions']:>7} {row['host_issue_ms']:>8.1f} {row['eager_ms']:>8.1f} "
              f"{row['overhead_ms']:>8.1f} {row['predicted_gpu_ms']:>8.1f} {row['ratio']:>6.3f} "
              f"{row['predicted_gpu_ms_rtx4090']:>8.1f} {row['ratio_rtx4090']:>6.3f}", flush=True)
        pipe.close()
    result = {"torch": torch.__version__,
              "command": " ".join(["python", "benchmarks/bench_issue.py", *(argv or sys.argv[1:])]),
              "action_us": action, "rows": rows}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
