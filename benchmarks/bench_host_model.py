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
recompute-and-backward one replay plus its copies in and out, none in for the inputs its
``GraphUpload`` put in its input slot, the fused tail inductor's
kernels: ``fxpipe.sim.simulate.graph_job_kernels``; MODELLED, no CUDA graph has run). ``host / GPU`` is the issue time over the step without
host costs (``bench_issue.py``'s ``ratio``; #38's goal: <= 0.5 inductor, <= 0.25 cudagraphs);
``slowdown`` the step with host costs over the step without.

**Refit** (a CPU-ratio PROJECTION, not a GPU measurement; #55). The code has changed
since the H200 run, and no GPU has measured it since. ``H200_HOST_REFIT`` in
``fxpipe/sim/hardware.py`` is ``H200_HOST`` scaled by how much the host's work shrank on
CPU between the H200 run's code and now (``refit``; rounded as ``H200_HOST``):

- ``host_us_per_action`` x (now / then) of ``bench_issue.action_cost``: the host cost of
  one action around an empty stage. Both are measured here, in this run, on this CPU,
  alternating (``--rounds`` rounds, the minimum of each): "then" is the H200 run's commit
  (``gpu_check.json``'s run that wrote ``stats``, 38181b0), exported with ``git archive``
  and run from a temporary directory, "now" this working tree. The recorded figures are
  not used for this: the record of the H200 run's code ran on another CPU (an Intel Xeon;
  later records an AMD EPYC), and an action's microseconds do not carry across CPUs (the
  same code read 53 us there, 78 to 89 us here).
- ``host_us_per_kernel`` and ``host_us_per_grad_kernel`` x (now / then) of fxpipe's issue
  time over eager PyTorch's dispatch of the same ops (``host_issue_ms`` / ``eager_ms`` of
  ``bench_issue.py``'s Llama-3.1-8B, 8 GPUs, 4K, eager row; the same plan, 1,242 actions,
  in both), a ratio within one run, so it carries across CPUs better than microseconds.
  "Then": the ``bench_issue.json`` record of git commit 8d6b69f, which measured 754721d
  (``fxpipe/`` differs from 38181b0 only in ``fxpipe/check.py``, the GPU kit: the same
  issue path); "now": ``benchmarks/results/bench_issue.json``. The step's ratio holds its
  actions' share too, which is not separated from the kernels'. At ratio 1 fxpipe would
  issue the same ops as fast as eager PyTorch dispatches them, the floor for them
  (printed: the per-kernel figures ``x 1 / then``; not applied).

**Eight issue threads, measured** (a GPU measurement, #55). The kit's ``many_devices``
section ran eight logical devices on one H200 (eight issue threads, today's issue path,
eager stage code) and fitted the same three figures to that call
(``gpu_check.json``'s ``many_devices.backends.eager.issue.fit``): per action and per
kernel, with eight threads contending for the issue lock and the GIL. The 8-GPU rows are
simulated with it too (``*_threads8``), and ``scaling``'s ``threads8`` is those 8-GPU
tokens/s over the 1-GPU row's with the refit (one issue thread). The kernels were those of
a small model on one GPU (the kit's 16-block TinyLlama): the host's side is what is
measured, and no eight-GPU machine has run it.

The predictions are simulated with both hosts; per eager row the floor eager PyTorch's own
dispatch sets (``dispatch_floor_*``: host / GPU step over the code's ratio, as if fxpipe
added nothing to eager's dispatch), and per stage backend 8-GPU / 1-GPU tokens/s
(``scaling``: without host costs, with ``H200_HOST``, with ``H200_HOST_REFIT``), beside
issue #55's targets (``acceptance``). Rerunning re-measures the action costs: when the
printed ``H200_HOST_REFIT`` differs from ``fxpipe/sim/hardware.py``'s, set it there
(``tests/test_sim_host.py`` checks they match ``benchmarks/results/bench_host_model.json``).
``--reuse-refit`` keeps the last record's refit (its action costs, their date and
commits) and runs the rest anew: this VM's CPU is at times twice as slow for a while
(an action around an empty stage read 22.6 us one day and 43 to 51 us the next, with the
same 29.6 Python calls per action and the old code as slow), and a refit measured then
would move with it.
"""

from __future__ import annotations

import argparse
import io
import json
import re
import subprocess
import sys
import tarfile
import tempfile
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
from fxpipe.sim.hardware import H200_HOST, H200_HOST_REFIT  # noqa: E402
from fxpipe.sim.host_fit import fit_host, issue_us_by_kind  # noqa: E402
from fxpipe.sim.simulate import simulate  # noqa: E402

GiB = 2**30
CASES = [("Llama-3.1-8B", 1, 4096), ("Llama-3.1-8B", 8, 4096), ("Llama-3.1-8B", 1, 16384),
         ("Llama-3.1-8B", 8, 16384)]
BACKENDS = ("eager", "inductor", "cudagraphs")
THEN_RECORD = "8d6b69f"
"""The commit of the ``bench_issue.json`` record of the H200 run's code (module docstring)."""
TARGETS = {"inductor": 0.3, "cudagraphs": 0.15, "scaling": 7.0}
"""Issue #55's acceptance, 8 x H100, Llama-3.1-8B, 4K, the refitted host: host issue / GPU
step per backend at most, 8-GPU / 1-GPU tokens/s with the best backend at least."""


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


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout


def issue_over_eager(record: dict) -> dict:
    """fxpipe's issue time over eager PyTorch's dispatch of the same ops in a
    ``bench_issue.json`` record: its Llama-3.1-8B, 8 GPUs, 4K, eager row, and the run."""
    row = next(r for r in record["rows"] if (r["model"], r["gpus"], r["seq_len"]) ==
               ("Llama-3.1-8B", 8, 4096) and r.get("stage_backend") is None)
    run = next(r for r in record.get("runs", []) if "rows" in r.get("keys", []))
    return {"ratio": row["host_issue_ms"] / row["eager_ms"], "host_issue_ms": row["host_issue_ms"],
            "eager_ms": row["eager_ms"], "actions": row["actions"], "plan": row["plan"],
            "measured_commit": run["commit"], "date": run["date"], "machine": run["machine"]}


def action_us(root: Path, repeats: int) -> dict:
    """``bench_issue.action_cost`` of the code at ``root``, in a fresh process."""
    code = (f"import json, sys; sys.path[:0] = [{str(root)!r}, {str(root / 'benchmarks')!r}]; "
            "import torch; torch.set_num_threads(1); import bench_issue; "
            f"print(json.dumps(bench_issue.action_cost({repeats})))")
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"bench_issue.action_cost failed for the code at {root}:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def action_costs(then_commit: str, rounds: int, repeats: int = 5) -> dict:
    """The host cost of an action around an empty stage, the code of ``then_commit``
    (``git archive``) and this tree, alternating on this CPU: min over the rounds."""
    try:
        tar = subprocess.run(["git", "archive", then_commit], cwd=ROOT, capture_output=True,
                             check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise RuntimeError(f"the refit runs the H200 run's code ({then_commit}) from git; this "
                           f"checkout cannot archive it ({e}): fetch the full history "
                           "(git fetch --unshallow)") from e
    per: dict[str, list[float]] = {"then": [], "now": []}
    with tempfile.TemporaryDirectory() as tmp:
        tarfile.open(fileobj=io.BytesIO(tar)).extractall(tmp, filter="data")
        for _ in range(rounds):
            per["then"].append(action_us(Path(tmp), repeats)["min_us"])
            per["now"].append(action_us(ROOT, repeats)["min_us"])
    return {"then": {"min_us": min(per["then"]), "rounds_us": per["then"], "commit": then_commit},
            "now": {"min_us": min(per["now"]), "rounds_us": per["now"],
                    "commit": _git("rev-parse", "--short", "HEAD").strip() + " + working tree"},
            "repeats": repeats, "calls": 100}


def refit(host: dict, action_then_us: float, action_now_us: float, ratio_then: float,
          ratio_now: float) -> dict:
    """``host`` (``H200_HOST``) scaled by the CPU ratios (module docstring), rounded as it is.

    >>> refit(H200_HOST, 100.0, 50.0, 2.0, 1.0)
    {'host_us_per_action': 172.7, 'host_us_per_kernel': 9.96, 'host_us_per_grad_kernel': 18.71}
    """
    a, k = action_now_us / action_then_us, ratio_now / ratio_then
    return {"host_us_per_action": round(host["host_us_per_action"] * a, 1),
            "host_us_per_kernel": round(host["host_us_per_kernel"] * k, 2),
            "host_us_per_grad_kernel": round(host["host_us_per_grad_kernel"] * k, 2)}


def measure_refit(gpu: dict, rounds: int) -> dict:
    """The refit's inputs, measured (action costs) and read (records), and its figures."""
    then_commit = next(r["commit"] for r in gpu["runs"] if "stats" in r["keys"])
    then = issue_over_eager(json.loads(_git("show", f"{THEN_RECORD}:benchmarks/results/bench_issue.json")))
    then["record"] = THEN_RECORD
    then["fxpipe_differs_from_h200_run"] = _git(
        "diff", "--name-only", then["measured_commit"], then_commit, "--", "fxpipe").split()
    now = issue_over_eager(json.loads((ROOT / "benchmarks" / "results" / "bench_issue.json").read_text()))
    now["record"] = "benchmarks/results/bench_issue.json"
    actions = action_costs(then_commit, rounds)
    figures = refit(H200_HOST, actions["then"]["min_us"], actions["now"]["min_us"],
                    then["ratio"], now["ratio"])
    return {"figures": figures, "h200_run_commit": then_commit, "action_us": actions,
            "issue_over_eager": {"then": then, "now": now},
            "action_scale": actions["now"]["min_us"] / actions["then"]["min_us"],
            "kernel_scale": now["ratio"] / then["ratio"],
            "kernel_floor_scale": 1 / then["ratio"],
            "label": "a CPU-ratio projection of H200_HOST to the code of today, not a GPU "
                     "measurement (benchmarks/bench_host_model.py's docstring)"}


def threads8_host(gpu: dict) -> dict | None:
    """The host figures fitted to the kit's ``many_devices`` eager call (eight issue
    threads on one H200), or None where none is recorded."""
    fit = gpu.get("many_devices", {}).get("backends", {}).get("eager", {}).get("issue", {}).get("fit")
    return None if fit is None else {k: round(fit[k], 2) for k in (
        "host_us_per_action", "host_us_per_kernel", "host_us_per_grad_kernel")}


def predict(name: str, gpus: int, seq_len: int, refit_host: dict, mfu: float = 0.6,
            threads8: dict | None = None) -> list[dict]:
    """The Llama-3.1-8B step simulated without host costs, with the H200's host and with
    its refit, per backend; on several GPUs with ``threads8`` (eight issue threads,
    measured) too."""
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
    gpus_only = simulate(program, costs, gpu)
    alone = gpus_only.makespan
    # what bounds scaling on the GPUs alone: their summed compute, and where they idle
    gpu_side = {"busy_ms": sum(gpus_only.busy), "bubble_ratio": gpus_only.bubble_ratio,
                "fill": gpus_only.fill, "drain": gpus_only.drain, "intra": gpus_only.intra,
                "exposed_transfer_ms": gpus_only.exposed_transfer_ms}
    tokens = MICROBATCHES * seq_len
    out = []
    for backend in BACKENDS:
        t, u = (simulate(program, costs, Hardware(**{**vars(gpu), **host}), stage_backend=backend)
                for host in (H200_HOST, refit_host))
        out.append({"model": name, "gpus": gpus, "seq_len": seq_len, "stage_backend": backend,
                    "modelled": backend == "cudagraphs", "simulated": True,
                    "gpu_step_ms": alone, "host_issue_ms": t.host_issue_ms,
                    "host_over_gpu": t.host_issue_ms / alone, "step_ms": t.makespan,
                    "slowdown": t.makespan / alone, "plan": str(plan),
                    "tokens_per_step": tokens, "gpu_tokens_per_s": tokens / alone * 1e3,
                    "tokens_per_s": tokens / t.makespan * 1e3,
                    "host_issue_ms_refit": u.host_issue_ms,
                    "host_over_gpu_refit": u.host_issue_ms / alone, "step_ms_refit": u.makespan,
                    "slowdown_refit": u.makespan / alone,
                    "tokens_per_s_refit": tokens / u.makespan * 1e3, "gpu_side": gpu_side})
        if threads8 is not None and gpus > 1:
            m = simulate(program, costs, Hardware(**{**vars(gpu), **threads8}), stage_backend=backend)
            out[-1].update(host_issue_ms_threads8=m.host_issue_ms,
                           host_over_gpu_threads8=m.host_issue_ms / alone,
                           step_ms_threads8=m.makespan, slowdown_threads8=m.makespan / alone,
                           tokens_per_s_threads8=tokens / m.makespan * 1e3)
    return out


def scaling(rows: list[dict]) -> list[dict]:
    """8-GPU / 1-GPU tokens/s per tokens per microbatch and backend: the GPUs alone, with
    ``H200_HOST``, with the refit."""
    by = {(r["model"], r["gpus"], r["seq_len"], r["stage_backend"]): r for r in rows}
    out = []
    for (model, gpus, seq_len, backend), many in by.items():
        one = by.get((model, 1, seq_len, backend))
        if gpus > 1 and one is not None:
            # the GPUs' summed compute over one GPU's (the recompute round-robin adds), and
            # the scaling with none of the GPUs' idle time (no fill, drain or waits)
            work = many["gpu_side"]["busy_ms"] / one["gpu_side"]["busy_ms"]
            out.append({"model": model, "gpus": gpus, "seq_len": seq_len, "stage_backend": backend,
                        "modelled": many["modelled"], "simulated": True,
                        "gpu_only": many["gpu_tokens_per_s"] / one["gpu_tokens_per_s"],
                        "h200": many["tokens_per_s"] / one["tokens_per_s"],
                        "refit": many["tokens_per_s_refit"] / one["tokens_per_s_refit"],
                        "threads8": many["tokens_per_s_threads8"] / one["tokens_per_s_refit"]
                        if "tokens_per_s_threads8" in many else None,
                        "work_over_one_gpu": work, "without_idle": gpus / work,
                        "bubble_ratio": many["gpu_side"]["bubble_ratio"],
                        "fill": many["gpu_side"]["fill"], "drain": many["gpu_side"]["drain"],
                        "exposed_transfer_ms": many["gpu_side"]["exposed_transfer_ms"]})
    return out


def acceptance(rows: list[dict], scale: list[dict]) -> dict:
    """Issue #55's targets (``TARGETS``) against the refit's 8 x H100, 4K figures."""
    at = {r["stage_backend"]: r for r in rows
          if (r["model"], r["gpus"], r["seq_len"]) == ("Llama-3.1-8B", 8, 4096)}
    best = max((s for s in scale if (s["model"], s["gpus"], s["seq_len"]) ==
                ("Llama-3.1-8B", 8, 4096)),   # a tie to the backend that issues least
               key=lambda s: (round(s["refit"], 6), BACKENDS.index(s["stage_backend"])))
    out = {b: {"host_over_gpu_refit": at[b]["host_over_gpu_refit"], "at_most": TARGETS[b],
               "met": at[b]["host_over_gpu_refit"] <= TARGETS[b],
               "host_over_gpu_threads8": at[b].get("host_over_gpu_threads8")}
           for b in ("inductor", "cudagraphs")}
    out["scaling"] = {"stage_backend": best["stage_backend"], "refit": best["refit"],
                      "gpu_only": best["gpu_only"], "at_least": TARGETS["scaling"],
                      "met": best["refit"] >= TARGETS["scaling"],
                      "threads8": max((s["threads8"] for s in scale if s["threads8"] is not None
                                       and (s["model"], s["gpus"], s["seq_len"]) ==
                                       ("Llama-3.1-8B", 8, 4096)), default=None)}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print the result JSON as the last line")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "bench_host_model.json"))
    ap.add_argument("--rounds", type=int, default=5,
                    help="alternating rounds of the refit's action-cost measurement")
    ap.add_argument("--reuse-refit", action="store_true",
                    help="take the refit from the last record (--out) instead of measuring "
                    "it again: the simulations run anew, the action costs keep their date "
                    "and commits (for a CPU slower than usual for a while)")
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
    if args.reuse_refit:
        refit_in = json.loads(Path(args.out).read_text())["refit"]
        print(f"\nREFIT reused from {args.out} (not measured by this run)")
    else:
        refit_in = measure_refit(gpu, args.rounds)
    host = refit_in["figures"]
    a, ie = refit_in["action_us"], refit_in["issue_over_eager"]
    print(f"\nREFIT ({refit_in['label']}):")
    print(f"host cost of one action around an empty stage (bench_issue.action_cost, min of "
          f"{args.rounds} alternating rounds, this CPU): the H200 run's code ({a['then']['commit']}) "
          f"{a['then']['min_us']:.1f} us, now ({a['now']['commit']}) {a['now']['min_us']:.1f} us: "
          f"x{refit_in['action_scale']:.3f}")
    for when in ("then", "now"):
        r = ie[when]
        print(f"fxpipe issue / eager dispatch, Llama-3.1-8B, 8 GPUs, 4K, eager ({r['record']}, "
              f"commit {r['measured_commit']}, {r['machine'].split(',')[0]}): "
              f"{r['host_issue_ms']:.1f} / {r['eager_ms']:.1f} ms = {r['ratio']:.3f}")
    print(f"per-kernel scale x{refit_in['kernel_scale']:.3f} (eager PyTorch's floor: "
          f"x{refit_in['kernel_floor_scale']:.3f})")
    print("H200_HOST_REFIT = dict(" + ", ".join(f"{k}={v}" for k, v in host.items()) + ")")
    if host != H200_HOST_REFIT:
        print("  (fxpipe/sim/hardware.py holds " + ", ".join(
            f"{k}={v}" for k, v in H200_HOST_REFIT.items()) + ": set it to this run's)")
    threads8 = threads8_host(gpu)
    print(f"\nEIGHT ISSUE THREADS (measured, gpu_check.json many_devices, eager): {threads8}")
    rows = []
    print(f"\nSIMULATED (cudagraphs: MODELLED) {'model':<13} {'gpus':>4} {'tokens':>6} "
          f"{'backend':>10} {'GPU ms':>8} {'host ms':>8} {'host/GPU':>8} {'slowdown':>8} "
          f"{'refit ms':>8} {'host/GPU':>8} {'slowdown':>8}")
    for case in CASES:
        for r in predict(*case, refit_host=host, threads8=threads8):
            rows.append(r)
            print(f"{'':33}{r['model']:<13} {r['gpus']:>4} {r['seq_len'] // 1024:>5}K "
                  f"{r['stage_backend']:>10} {r['gpu_step_ms']:>8.1f} {r['host_issue_ms']:>8.1f} "
                  f"{r['host_over_gpu']:>8.3f} {r['slowdown']:>8.3f} "
                  f"{r['host_issue_ms_refit']:>8.1f} {r['host_over_gpu_refit']:>8.3f} "
                  f"{r['slowdown_refit']:>8.3f}", flush=True)
            if "host_over_gpu_threads8" in r:
                print(f"{'':33}{'':>48} 8 threads {r['host_issue_ms_threads8']:>8.1f} "
                      f"{r['host_over_gpu_threads8']:>8.3f} {r['slowdown_threads8']:>8.3f}")
    for r in rows:   # eager PyTorch's own dispatch (module docstring)
        if r["stage_backend"] == "eager":
            r["dispatch_floor_host_over_gpu"] = r["host_over_gpu"] / ie["then"]["ratio"]
            r["dispatch_floor_host_over_gpu_refit"] = r["host_over_gpu_refit"] / ie["now"]["ratio"]
            print(f"eager, {r['gpus']} GPUs, {r['seq_len'] // 1024}K: the floor eager PyTorch's "
                  f"dispatch sets, host / GPU step {r['dispatch_floor_host_over_gpu']:.3f} "
                  f"(H200 host) / {r['dispatch_floor_host_over_gpu_refit']:.3f} (refit)")
    scale = scaling(rows)
    print(f"\nSIMULATED 8-GPU / 1-GPU tokens/s {'tokens':>6} {'backend':>10} {'GPUs only':>9} "
          f"{'H200 host':>9} {'refit':>9} {'8 threads':>9}")
    for s in scale:
        print(f"{'':33}{s['seq_len'] // 1024:>5}K {s['stage_backend']:>10} {s['gpu_only']:>9.2f} "
              f"{s['h200']:>9.2f} {s['refit']:>9.2f} "
              + (f"{s['threads8']:>9.2f}" if s["threads8"] is not None else f"{'-':>9}"))
    acc = acceptance(rows, scale)
    print("\nissue #55 (refit host, 8 x H100, Llama-3.1-8B, 4K): " + "; ".join(
        f"{b} host / GPU {acc[b]['host_over_gpu_refit']:.3f} <= {acc[b]['at_most']}: "
        f"{'met' if acc[b]['met'] else 'NOT met'}" for b in ("inductor", "cudagraphs"))
        + f"; 8-GPU / 1-GPU, best ({acc['scaling']['stage_backend']}) "
        f"{acc['scaling']['refit']:.2f} >= {acc['scaling']['at_least']:.0f}: "
        f"{'met' if acc['scaling']['met'] else 'NOT met'} (the GPUs alone: "
        f"{acc['scaling']['gpu_only']:.2f})")
    result = {"torch": torch.__version__,
              "command": " ".join(["python", "benchmarks/bench_host_model.py", *(argv or sys.argv[1:])]),
              "calibration": fit, "refit": refit_in, "threads8": threads8,
              "rows": rows, "scaling": scale,
              "acceptance": acc}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
