"""The host's issue time in ``fxpipe.simulate``: calibrated on the H200 run, then used to
predict when a GPU step is host-bound, per stage backend (#38).

    python benchmarks/bench_host_model.py [--json]

**Calibration** (measured inputs only). The one GPU run (``benchmarks/results/gpu_check.json``,
an H200, fp32, the kit's 2.3B TinyLlama: 53 blocks, batch 4 x 1,024 tokens, 2 microbatches,
one device) recorded the host's issue time per action kind (``stats.host_issue_us.*``).
This rebuilds that call's Program from the recorded plan (the model on ``meta``: same
graph, no weights), counts its actions per kind (checked against the run's 656) and the
kernels each compute action launches (``Cost.fwd_kernels`` / ``bwd_kernels``, counted by
the cost pass), and fits ``fxpipe.sim.Hardware``'s host figures (``fxpipe.sim.host_fit``):

- ``host_us_per_action``: the issue time of the actions that launch no kernel of the
  stage code (Prefetch, Upload, Offload, Free, Release, DownloadGrads), per action;
- ``host_us_per_kernel``: the ``Forward`` actions' time less that, per kernel (no grad);
- ``host_us_per_grad_kernel``: the ``RecomputeBackward`` and ``FusedBackward`` actions'
  time less that, per kernel (recompute and backward, with grad: autograd's recording
  and engine).

The same step is then re-estimated per stage backend (#38's acceptance: its issue time
should fall by the share ``RecomputeBackward`` held, 63 %). ``H200_HOST`` in
``fxpipe/sim/hardware.py`` holds them (``tests/test_sim_host.py`` checks
they are what this fit gives). One run on one machine: the figures are that host's (a
16-core VM) with eager fp32 stage code; no other GPU host has been measured.

**Prediction** (SIMULATED). The Llama-3.1-8B step of ``bench_issue.py`` (fxpipe's plan for
the full-size model on 80 GiB devices, 16 microbatches, bf16 FLOPs at 60 % of an H100's
989 TFLOP/s, 50 GB/s links each way) simulated with and without ``H200_HOST``, for each
stage backend: ``eager`` (the counted kernels), ``inductor`` (``INDUCTOR_KERNELS`` of them,
measured on CPU by ``bench_issue.py``) and ``cudagraphs`` (a forward job or stage
recompute-and-backward one replay plus its copies in and out, the fused tail inductor's
kernels: ``fxpipe.sim.simulate.graph_job_kernels``; MODELLED, no CUDA graph has run). ``host / GPU`` is the issue time over the step without
host costs (``bench_issue.py``'s ``ratio``; #38's goal: <= 0.5 inductor, <= 0.25 cudagraphs);
``slowdown`` the step with host costs over the step without.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import fxpipe  # noqa: E402
from fxpipe.demo import TinyLlama  # noqa: E402
from fxpipe.plan import layer_costs  # noqa: E402
from fxpipe.runtime.devices.emulator import InlineDevice  # noqa: E402
from fxpipe.sim import Hardware, LayerCost  # noqa: E402
from fxpipe.sim.hardware import H200_HOST  # noqa: E402
from fxpipe.sim.host_fit import fit_host, issue_us_by_kind  # noqa: E402
from fxpipe.sim.simulate import simulate  # noqa: E402

GiB = 2**30
CASES = [("Llama-3.1-8B", 1, 4096), ("Llama-3.1-8B", 8, 4096), ("Llama-3.1-8B", 8, 16384)]
BACKENDS = ("eager", "inductor", "cudagraphs")


def _plan(text: str) -> fxpipe.ExecutePlan:
    """An ``ExecutePlan`` from its printed form."""
    def ranges(part: str) -> list[range]:
        return [range(int(a), int(b)) for a, b in re.findall(r"(\d+):(\d+)", part)]
    fwd, bwd = re.fullmatch(r"ExecutePlan\(fwd=\[(.*)\], bwd=\[(.*)\]\)", text).groups()
    return fxpipe.ExecutePlan(ranges(fwd), ranges(bwd))


def h200_call(gpu: dict):
    """The H200 run's stats call rebuilt: its Program and the layers' costs."""
    shape = gpu["model"]
    with torch.device("meta"):
        model = TinyLlama(vocab=shape["vocab"], dim=shape["dim"], heads=shape["heads"],
                          depth=shape["depth"])
    ids = torch.zeros(shape["batch"], shape["seq"], dtype=torch.long, device="meta")
    pipe = fxpipe.compile(model, example_inputs=(ids,), devices=[InlineDevice()],
                          plan=_plan(gpu["predicted_vs_measured"]["plan"]),
                          config=fxpipe.RunConfig(num_microbatch=2))
    program = pipe.program("fused", 2)
    costs = [LayerCost.of(c, Hardware()) for c in layer_costs(pipe)]   # kernels, no times
    pipe.close()
    return program, costs


def calibrate(gpu: dict) -> dict:
    """Fit the host figures to the H200 run (module docstring)."""
    program, costs = h200_call(gpu)
    us = issue_us_by_kind(gpu["stats"])
    fit = fit_host(program, costs, us)
    fitted = Hardware(**{k: fit[k] for k in H200_HOST})
    return {**fit, "program_actions": sum(len(acts) for _, acts in program.lanes()),  # host lane too
            "run_actions": gpu["stats"]["actions"],
            "measured_host_issue_ms": gpu["stats"]["host_issue_ms"],
            "simulated_host_issue_ms": simulate(program, costs, fitted).host_issue_ms,
            # the same step's issuing re-estimated per stage backend (SIMULATED; cudagraphs
            # MODELLED), beside the share of it RecomputeBackward held
            "by_backend_ms": {b: simulate(program, costs, fitted, stage_backend=b).host_issue_ms
                              for b in BACKENDS},
            "recompute_backward_share": us.get("RecomputeBackward", 0.0) / sum(us.values())}


def predict(name: str, gpus: int, seq_len: int, mfu: float = 0.6) -> list[dict]:
    """The Llama-3.1-8B step simulated with and without the H200's host, per backend."""
    from bench_issue import MICROBATCHES, MODELS, PEAK, CausalLM, config
    c, qk_norm = config(MODELS[name])
    with torch.device("meta"):
        model = CausalLM(c, qk_norm, chunked=True).to(torch.bfloat16)
    ids = torch.zeros(1, seq_len, dtype=torch.long, device="meta")
    pipe = fxpipe.compile(model, example_inputs=(ids, ids),
                          devices=[InlineDevice(memory_limit=80 * GiB) for _ in range(gpus)])
    plan = fxpipe.ExecutePlan.auto("fused", pipe, num_microbatch=MICROBATCHES)
    pipe = fxpipe.compile(model, example_inputs=(ids, ids), plan=plan,
                          devices=[InlineDevice(memory_limit=80 * GiB) for _ in range(gpus)])
    gpu = Hardware(flops=PEAK["h100"] * mfu, h2d_bandwidth=50e9, d2h_bandwidth=50e9)
    program = pipe.program("fused", MICROBATCHES)
    costs = [LayerCost.of(cost, gpu) for cost in layer_costs(pipe)]
    pipe.close()
    alone = simulate(program, costs, gpu).makespan
    out = []
    for backend in BACKENDS:
        t = simulate(program, costs, Hardware(**{**vars(gpu), **H200_HOST}),
                     stage_backend=backend)
        out.append({"model": name, "gpus": gpus, "seq_len": seq_len, "stage_backend": backend,
                    "modelled": backend == "cudagraphs", "simulated": True,
                    "gpu_step_ms": alone, "host_issue_ms": t.host_issue_ms,
                    "host_over_gpu": t.host_issue_ms / alone, "step_ms": t.makespan,
                    "slowdown": t.makespan / alone, "plan": str(plan)})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print the result JSON as the last line")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "bench_host_model.json"))
    args = ap.parse_args(argv)
    gpu = json.loads((ROOT / "benchmarks" / "results" / "gpu_check.json").read_text())
    fit = calibrate(gpu)
    print(f"H200 run rebuilt: {fit['program_actions']} actions (the run: {fit['run_actions']})")
    print(f"fitted: {fit['host_us_per_action']:.1f} us per action, "
          f"{fit['host_us_per_kernel']:.2f} us per kernel without grad, "
          f"{fit['host_us_per_grad_kernel']:.2f} us per kernel with grad")
    print(f"{'kind':<18} {'actions':>7} {'kernels':>8} {'measured ms':>12} {'fitted ms':>10}")
    for r in fit["kinds"]:
        print(f"{r['kind']:<18} {r['actions']:>7} {r['kernels']:>8} "
              f"{r['measured_us'] / 1e3:>12.1f} {r['fitted_us'] / 1e3:>10.1f}")
    print(f"issue time: measured {fit['measured_host_issue_ms']:.1f} ms, simulated with the fit "
          f"{fit['simulated_host_issue_ms']:.1f} ms")
    print("the same step re-estimated (simulated; cudagraphs modelled): " + ", ".join(
        f"{b} {ms:.1f} ms" for b, ms in fit["by_backend_ms"].items())
        + f"; RecomputeBackward held {fit['recompute_backward_share']:.0%} of the measured issuing")
    rows = []
    print(f"\nSIMULATED (cudagraphs: MODELLED) {'model':<13} {'gpus':>4} {'tokens':>6} "
          f"{'backend':>10} {'GPU ms':>8} {'host ms':>8} {'host/GPU':>8} {'slowdown':>8}")
    for case in CASES:
        for r in predict(*case):
            rows.append(r)
            print(f"{'':33}{r['model']:<13} {r['gpus']:>4} {r['seq_len'] // 1024:>5}K "
                  f"{r['stage_backend']:>10} {r['gpu_step_ms']:>8.1f} {r['host_issue_ms']:>8.1f} "
                  f"{r['host_over_gpu']:>8.3f} {r['slowdown']:>8.3f}", flush=True)
    result = {"torch": torch.__version__,
              "command": " ".join(["python", "benchmarks/bench_host_model.py", *(argv or sys.argv[1:])]),
              "calibration": fit, "rows": rows}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
