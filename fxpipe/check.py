"""The GPU acceptance kit: ``python -m fxpipe.check [--dry-run] [--out FILE]``.

On whatever GPUs are visible it runs the CUDA tests, then measures and prints, and writes
as JSON:

1. ``vs_checkpoint``: the fused training step against eager PyTorch with
   ``torch.utils.checkpoint`` per block, both on one GPU (min and median ratio over
   interleaved repeats);
2. ``scaling``: the fused step on 1, 2, ... N GPUs (speed-up over one);
3. ``hidden_prefetch``: the fraction of parameter-transfer time hidden behind compute,
   from the CUDA-event timeline of a traced step (``pipe.trace()``), per device;
4. ``predicted_vs_measured``: ``fxpipe.simulate`` with the layer times measured in that
   step and the host links' measured bandwidth, against the traced step's makespan;
5. ``stats``: ``pipe.stats()`` of a step (host waits, bytes moved by kind).

The model is a Llama-style decoder (``fxpipe.demo.TinyLlama``) sized to the GPU: its fp32
parameters about a quarter of one GPU's memory (at most 8% of host RAM), so the run stays
under 10 minutes on one GPU. ``--dry-run`` runs the same code path on two CPU virtual
devices with a GPU's semantics (``VirtualDevice(semantics="cuda")``) and a tiny model: what
CI runs, so the kit cannot rot without a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import fxpipe
from fxpipe.demo import TinyLlama, progression_batch, rotary_tables
from fxpipe.sim import Hardware

ROOT = Path(__file__).resolve().parents[1]
CUDA_TESTS = ["tests/test_cuda.py", "tests/test_devices.py", "tests/test_params.py"]


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), target.flatten())


def _say(msg: str) -> None:
    print(f"[fxpipe.check] {msg}", flush=True)


# ---------------------------------------------------------------------------- setup

def _model_shape(dry_run: bool) -> dict[str, int]:
    """Dims of the Llama-style model: tiny for a dry run; else fp32 parameters about a
    quarter of one GPU's memory, capped at 8% of host RAM."""
    if dry_run:
        return dict(vocab=256, dim=64, heads=4, depth=4, batch=4, seq=32)
    gpu = torch.cuda.get_device_properties(0).total_memory
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    budget = min(0.25 * gpu, 0.08 * host)
    dim = 2048
    per_block = 12 * dim * dim * 4          # attention 4d^2 + MLP 8d^2, fp32
    depth = max(2, min(64, int(budget // per_block)))
    return dict(vocab=32000, dim=dim, heads=16, depth=depth, batch=4, seq=1024)


def _devices(n: int, dry_run: bool) -> list[Any]:
    if dry_run:
        return [fxpipe.VirtualDevice(semantics="cuda") for _ in range(n)]
    return [f"cuda:{i}" for i in range(n)]


def _time(fn, warmup: int, repeats: int, sync) -> list[float]:
    for _ in range(warmup):
        fn()
    sync()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - t0)
    return out


# ---------------------------------------------------------------------------- parts

def run_cuda_tests(dry_run: bool) -> dict[str, Any]:
    """``pytest`` over the CUDA tests (skipped, and said so, without a GPU or a checkout)."""
    if not (ROOT / "tests").is_dir():
        return {"ran": False, "why": "no tests/ beside the package (not a source checkout)"}
    cmd = [sys.executable, "-m", "pytest", *CUDA_TESTS, "-q", "-p", "no:logging", "-k",
           "cuda or gpu or Cuda"]
    _say("running the CUDA tests: " + " ".join(cmd[3:]))
    t0 = time.perf_counter()
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    tail = (run.stdout + run.stderr).strip().splitlines()[-1:] or [""]
    _say(f"  {tail[0]}")
    return {"ran": True, "returncode": run.returncode, "summary": tail[0],
            "seconds": round(time.perf_counter() - t0, 1),
            "gpu": torch.cuda.is_available() and not dry_run}


def _model(shape: dict) -> TinyLlama:
    return TinyLlama(vocab=shape["vocab"], dim=shape["dim"], heads=shape["heads"],
                     depth=shape["depth"])


def _model_and_batch(shape: dict) -> tuple[TinyLlama, torch.Tensor, torch.Tensor]:
    """The kit's model (seeded) and its batch, for ``shape``."""
    torch.manual_seed(0)
    ids, target = progression_batch(shape["batch"], shape["seq"], shape["vocab"],
                                    torch.Generator().manual_seed(0))
    return _model(shape), ids, target


def _sync(dry_run: bool) -> Callable[[], None]:
    """What waits for the GPU's queued work (nothing to wait for in a dry run)."""
    return (lambda: None) if dry_run else torch.cuda.synchronize


def vs_checkpoint(shape: dict, dry_run: bool, repeats: int) -> dict[str, Any]:
    """The fused step on one device against eager with ``torch.utils.checkpoint`` per
    block (the whole model resident on that one GPU)."""
    model, ids, target = _model_and_batch(shape)
    pipe = fxpipe.compile(model, example_inputs=(ids,), devices=_devices(1, dry_run))
    where = "cpu" if dry_run else "cuda:0"
    eager = _model(shape).to(where)
    eager.load_state_dict(model.state_dict())
    e_ids, e_target = ids.to(where), target.to(where)

    def eager_step():
        x = eager.embed(e_ids)
        cos, sin = rotary_tables(e_ids.shape[1], eager.head_dim, e_ids.device)
        for layer in eager.layers:
            x = checkpoint(layer, x, cos, sin, use_reentrant=False)
        loss_fn(eager.lm_head(eager.norm(x)), e_target).backward()
        eager.zero_grad(set_to_none=True)

    def fxpipe_step():
        pipe.forward_backward((ids,), label=target, loss_fn=loss_fn)
        model.zero_grad(set_to_none=True)

    sync = _sync(dry_run)
    ratios, times = [], {"fxpipe": [], "eager_checkpoint": []}
    for _ in range(repeats):      # interleaved: drift hits both alike
        f = _time(fxpipe_step, 1, 1, sync)[0]
        e = _time(eager_step, 1, 1, sync)[0]
        times["fxpipe"].append(f)
        times["eager_checkpoint"].append(e)
        ratios.append(f / e)
    pipe.close()
    return {"fxpipe_s": min(times["fxpipe"]), "eager_checkpoint_s": min(times["eager_checkpoint"]),
            "ratio_min": min(ratios), "ratio_median": statistics.median(ratios),
            "params": sum(p.numel() for p in model.parameters())}


def scaling(shape: dict, num_devices: int, dry_run: bool, repeats: int) -> dict[str, Any]:
    """The fused step on 1 .. N devices; speed-up over one."""
    model, ids, target = _model_and_batch(shape)
    sync = _sync(dry_run)
    rows = {}
    for n in range(1, num_devices + 1):
        pipe = fxpipe.compile(model, example_inputs=(ids,), devices=_devices(n, dry_run),
                              config=fxpipe.RunConfig(num_microbatch=max(2, n + 1)))
        t = _time(lambda: (pipe.forward_backward((ids,), label=target, loss_fn=loss_fn),
                           model.zero_grad(set_to_none=True)), 2, repeats, sync)
        rows[n] = {"step_s_min": min(t), "step_s_median": statistics.median(t)}
        pipe.close()
    base = rows[1]["step_s_median"]
    for n, r in rows.items():
        r["speedup_median"] = base / r["step_s_median"]
    return {"devices": rows, "note": None if num_devices > 1 else
            "one device visible: no scaling to measure"}


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _overlap(a: tuple[float, float], spans: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(a[1], b) - max(a[0], s)) for s, b in spans)


def link_bandwidth(dry_run: bool) -> tuple[float, float]:
    """Measured host→device and device→host bytes/s of GPU 0 (pinned, 256 MiB)."""
    if dry_run:
        return float("inf"), float("inf")
    n = 256 * 2**20
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(n, dtype=torch.uint8, device="cuda:0")
    up = min(_time(lambda: dev.copy_(host, non_blocking=True), 2, 5, torch.cuda.synchronize))
    down = min(_time(lambda: host.copy_(dev, non_blocking=True), 2, 5, torch.cuda.synchronize))
    return n / up, n / down


def traced_step(shape: dict, num_devices: int, dry_run: bool) -> dict[str, Any]:
    """A traced step: hidden prefetch fraction, predicted vs measured, stats."""
    model, ids, target = _model_and_batch(shape)
    M = max(2, num_devices + 1)
    pipe = fxpipe.compile(model, example_inputs=(ids,), devices=_devices(num_devices, dry_run),
                          config=fxpipe.RunConfig(num_microbatch=M))
    for _ in range(2):
        pipe.forward_backward((ids,), label=target, loss_fn=loss_fn)
    pipe.timings.reset()
    pipe.timings.warmup = 0
    with pipe.trace() as rec:
        pipe.forward_backward((ids,), label=target, loss_fn=loss_fn)
    stats = pipe.stats()
    hidden = {}
    for d in range(num_devices):
        ivs = [iv for iv in rec.timeline.intervals if iv.device == d]
        compute = _union([(iv.start, iv.end) for iv in ivs if iv.kind != "transfer"])
        prefetch = [(iv.start, iv.end) for iv in ivs if iv.stream == "prefetch"]
        total = sum(b - a for a, b in prefetch)
        hidden[d] = (sum(_overlap(p, compute) for p in prefetch) / total) if total else None
    h2d, d2h = link_bandwidth(dry_run)
    hw = Hardware(h2d_bandwidth=h2d, d2h_bandwidth=d2h)
    predicted = fxpipe.simulate(pipe, hw, num_microbatch=M).makespan
    measured = rec.timeline.makespan
    pipe.close()
    return {"hidden_prefetch": hidden, "predicted_ms": predicted, "measured_ms": measured,
            "predicted_over_measured": predicted / measured if measured else None,
            "h2d_bytes_per_s": h2d, "d2h_bytes_per_s": d2h, "stats": stats,
            "bubble_ratio_measured": rec.timeline.bubble_ratio, "plan": repr(pipe.plan)}


# ---------------------------------------------------------------------------- main

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fxpipe.check", description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true",
                    help="no GPU needed: virtual devices with GPU semantics, a tiny model")
    ap.add_argument("--out", default=None, help="JSON file (default: fxpipe_check.json, or "
                    "benchmarks/results/gpu_check[_dry_run].json in a source checkout)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--skip-tests", action="store_true", help="measure only")
    args = ap.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("fxpipe.check: no CUDA GPU visible (torch.cuda.is_available() is False); run on a "
              "GPU machine, or use --dry-run to exercise the kit on CPU", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    if args.dry_run:
        torch.set_num_threads(1)   # as each virtual device's workers: a like-for-like eager
    num = 2 if args.dry_run else torch.cuda.device_count()
    shape = _model_shape(args.dry_run)
    report: dict[str, Any] = {
        "dry_run": args.dry_run, "torch": torch.__version__, "python": platform.python_version(),
        "devices": (["virtual (semantics=cuda)"] * num if args.dry_run else
                    [torch.cuda.get_device_name(i) for i in range(num)]),
        "model": shape}
    _say(f"{num} device(s): {report['devices']}; model {shape}")
    if not args.skip_tests:
        report["cuda_tests"] = run_cuda_tests(args.dry_run)
    _say("fused step vs eager + checkpoint on one device ...")
    report["vs_checkpoint"] = vs_checkpoint(shape, args.dry_run, args.repeats)
    _say(f"  ratio min {report['vs_checkpoint']['ratio_min']:.3f}, "
         f"median {report['vs_checkpoint']['ratio_median']:.3f}")
    _say(f"scaling over 1..{num} device(s) ...")
    report["scaling"] = scaling(shape, num, args.dry_run, args.repeats)
    for n, r in report["scaling"]["devices"].items():
        _say(f"  {n}: {r['step_s_median']:.3f} s/step, speed-up {r['speedup_median']:.2f}x")
    _say("traced step: hidden prefetch, predicted vs measured, stats ...")
    report["traced"] = traced_step(shape, num, args.dry_run)
    tr = report["traced"]
    _say(f"  hidden prefetch {tr['hidden_prefetch']}, predicted/measured "
         f"{tr['predicted_over_measured']:.3f}, host waits {tr['stats']['host_waits']}")
    report["seconds"] = round(time.perf_counter() - t0, 1)
    if args.out:
        out = Path(args.out)
    elif (ROOT / "benchmarks").is_dir():
        out = ROOT / "benchmarks" / "results" / ("gpu_check_dry_run.json" if args.dry_run
                                                 else "gpu_check.json")
    else:
        out = Path("fxpipe_check.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1, default=str))
    _say(f"done in {report['seconds']} s; wrote {out}")
    failed = report.get("cuda_tests", {}).get("returncode", 0) != 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
