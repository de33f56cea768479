"""Write docs/benchmarks.md and the README's headline figures from the committed results.

    python benchmarks/report.py            # rewrite docs/benchmarks.md and README.md's block
    python benchmarks/report.py --check    # exit 1, with a diff, if either differs

Every figure the documentation quotes from a benchmark comes from a JSON file under
``benchmarks/results/``, written by the benchmark itself and stamped by
``benchmarks/record.py`` with the command that made it, the commit and the machine. A
section whose JSON (or the part of it a table needs) is missing is listed as not
recorded, with the command that would record it; no figure is typed in by hand. The
README carries a generated block between ``<!-- report:headline -->`` and
``<!-- /report:headline -->``. Pure Python (no torch): CI runs ``--check``.
"""

from __future__ import annotations

import argparse
import difflib
import json
import math
import re
import sys
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DOC = ROOT / "docs" / "benchmarks.md"
README = ROOT / "README.md"
BEGIN, END = "<!-- report:headline -->", "<!-- /report:headline -->"
GUARANTEES = ROOT / "docs" / "guarantees.md"
STATUS_BEGIN, STATUS_END = "<!-- report:status -->", "<!-- /report:status -->"


# ----------------------------------------------------------------------------- formatting

def mb(n: float) -> str:
    """Bytes as decimal MB, 3 significant digits (``148 MB``, ``80.6 MB``)."""
    v = n / 1e6
    return f"{v:,.0f} MB" if v >= 99.95 else f"{v:.1f} MB" if v >= 9.995 else f"{v:.2f} MB"


def num(x: float, digits: int = 2) -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:,.{digits}f}"


def pct(x: float, signed: bool = True) -> str:
    return f"{100 * x:+.1f}%" if signed else f"{100 * x:.1f}%"


def table(header: list[str], rows: list[list[Any]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return out


def span(values: list[float], digits: int = 2) -> str:
    lo, hi = min(values), max(values)
    return num(lo, digits) if f"{lo:.{digits}f}" == f"{hi:.{digits}f}" else f"{num(lo, digits)}–{num(hi, digits)}"


def load(name: str) -> dict | None:
    path = RESULTS / name
    return json.loads(path.read_text()) if path.exists() else None


def runs_for(data: dict, key: str) -> list[dict]:
    """The recorded runs of ``data`` that wrote ``key``."""
    return [r for r in data.get("runs", []) if key in r.get("keys", [])]


# ------------------------------------------------------------------------------ sections
# Each section: (title, json file, key in it, what it measures, renderer(data) -> lines).

def _issue(d: dict) -> list[str]:
    def kernels(r: dict) -> str:
        return f"{r['kernels_per_layer']:.0f}" if "kernels_per_layer" in r else "—"

    def modelled(r: dict) -> str:
        if "graph_launch_ms_modelled" in r:
            return (f"{r['ratio']:.3f} ({r['graph_replays']} replays' launches modelled, "
                    f"{r['graph_launch_ms_modelled']:.1f} ms of the host's)")
        return (f"{r['ratio_modelled']:.3f} (modelled)" if "ratio_modelled" in r else "")
    rows = [[r["model"], r["gpus"], f"{r['seq_len'] // 1024}K", r.get("stage_backend") or "eager",
             f"{r['actions']:,}", kernels(r),
             f"{r['host_issue_ms']:,.0f} ({r['host_issue_ms_median']:,.0f})", f"{r['eager_ms']:,.0f}",
             f"{r['predicted_gpu_ms']:,.0f}", f"{r['ratio']:.3f}", modelled(r)] for r in d["rows"]]
    a = d["action_us"]
    mfu = d["rows"][0]["mfu"]
    out = table(["model", "GPUs", "tokens per microbatch", "stage backend", "actions",
                 "kernels per layer and microbatch", "host ms, min (median)",
                 "eager dispatch ms", f"H100 step ms (predicted, {mfu:.0%} of 989 TFLOP/s)",
                 "host / predicted step (measured)", "with the compiled kernel count"], rows) + [
        "", f"One action around an empty stage: {a['min_us']:.1f} µs (median {a['median_us']:.1f} µs); "
        f"a call's fixed cost: {a['call_fixed_us'] / 1000:.2f} ms."
        + (f" With eight devices' issue threads taking turns at the issue lock: "
           f"{a['devices_8']['min_us']:.1f} µs (median {a['devices_8']['median_us']:.1f} µs) "
           "per action." if "devices_8" in a else "")]
    if "modelled" in d:
        out += ["", "Inductor rows run its CPU code here (its C++ wrapper standing for its GPU "
                "wrapper): measured. The last column is modelled, not measured: "
                f"{d['modelled']}."]
    graphed = [r for r in d["rows"] if r.get("graph_replays")]
    if graphed:
        launch_us = graphed[0]["graph_launch_ms_modelled"] * 1e3 / graphed[0]["graph_replays"]
        out += ["", "Cudagraphs rows: a CUDA graph cannot run here. The graphs' kernels are "
                "elided (devices whose graphs, once captured, replay by returning their "
                "outputs): measured is everything the host does around them, every action's "
                "Python, the copies into the graphs' inputs, the output clones, the gradient "
                "additions, the address checks, and the fused tail's inductor code; one launch "
                "per replay is added, modelled at the H200 host's fitted cost of one kernel "
                f"({launch_us:.1f} µs): the host figure is part measured, part modelled."]
    if d.get("issue_lock"):
        lk = d["issue_lock"]
        names = {"ordered": f"ordered, kept up to {lk['slack']} steps ahead (today's)"
                 if "slack" in lk else "ordered, handed over after every action",
                 "ordered-each": "ordered, handed over after every action",
                 "fifo": "first come, first served", "plain": "a plain `threading.Lock`"}
        out += ["", f"The issue lock, the 8-GPU {lk['model']} step at {lk['seq_len'] // 1024}K on "
                "`InlineDevice`s (eager stage code), locks interleaved:", ""] + table(
            ["issue lock", "host ms, min (median)", "the devices' summed wait ms (median)",
             "waits per step (median)"],
            [[names[k], f"{lk[k]['host_ms_min']:,.0f} ({lk[k]['host_ms_median']:,.0f})",
              f"{lk[k]['lock_wait_ms_median']:,.0f}",
              f"{lk[k]['lock_waits_median']:,.0f}" if "lock_waits_median" in lk[k] else ""]
             for k in names if k in lk])
    if "compile_time" in d:
        c = d["compile_time"]
        out += ["", f"Inductor's compile time, Llama-3.1-8B shape at tiny widths, each in a fresh "
                f"process and cache: 1 block {c['one_block']['compile_s']:.1f} s "
                f"({c['one_block']['artifacts']} distinct layer graphs), 32 blocks "
                f"{c['blocks_32']['compile_s']:.1f} s ({c['blocks_32']['artifacts']}): "
                f"{c['ratio']:.2f}x."]
    return out


def _host_model(d: dict) -> list[str]:
    c = d["calibration"]
    fit = table(["action kind (H200 run)", "actions", "kernels", "measured ms", "fitted ms"],
                [[r["kind"], r["actions"], f"{r['kernels']:,.0f}", num(r["measured_us"] / 1e3, 1),
                  num(r["fitted_us"] / 1e3, 1)] for r in c["kinds"]])
    rows = [[r["model"], r["gpus"], f"{r['seq_len'] // 1024}K",
             r["stage_backend"] + (" (modelled)" if r["modelled"] else ""),
             f"{r['gpu_step_ms']:,.0f}", f"{r['host_issue_ms']:,.0f}", f"{r['host_over_gpu']:.3f}",
             f"{r['slowdown']:.3f}", f"{r['host_issue_ms_refit']:,.0f}",
             f"{r['host_over_gpu_refit']:.3f}", f"{r['slowdown_refit']:.3f}"] for r in d["rows"]]
    rf = d["refit"]
    f, a, ie = rf["figures"], rf["action_us"], rf["issue_over_eager"]
    floors = [r for r in d["rows"] if "dispatch_floor_host_over_gpu_refit" in r and r["gpus"] > 1]
    scaling = [[f"{s['seq_len'] // 1024}K", s["stage_backend"] + (" (modelled)" if s["modelled"] else ""),
                f"{s['gpu_only']:.2f}", f"{s['h200']:.2f}", f"{s['refit']:.2f}",
                f"{s['threads8']:.2f}" if s.get("threads8") is not None else "–"]
               for s in d["scaling"]]
    t8 = d.get("threads8")
    threads8 = [r for r in d["rows"] if "host_over_gpu_threads8" in r]
    acc = d["acceptance"]

    def verdict(ok: bool) -> str:
        return "met" if ok else "not met"
    return [f"Fitted to the H200 run ({c['program_actions']} actions rebuilt, the run counted "
            f"{c['run_actions']}): {c['host_us_per_action']:.1f} µs per action, "
            f"{c['host_us_per_kernel']:.2f} µs per kernel without grad, "
            f"{c['host_us_per_grad_kernel']:.2f} µs per kernel with grad "
            f"(`fxpipe.sim.hardware.H200_HOST`); the fit gives the run's "
            f"{c['measured_host_issue_ms']:.1f} ms of issuing as "
            f"{c['simulated_host_issue_ms']:.1f} ms. The same step re-estimated per stage "
            "backend (simulated; cudagraphs modelled): " + ", ".join(
                f"{b} {ms:,.0f} ms ({1 - ms / c['simulated_host_issue_ms']:.0%} less)"
                for b, ms in c["by_backend_ms"].items())
            + f"; `RecomputeBackward` held {c['recompute_backward_share']:.0%} of the "
            "measured issuing.", ""] + fit + [
        "",
        f"**Refit** (`fxpipe.sim.hardware.H200_HOST_REFIT`), a PROJECTION from CPU ratios, not a "
        f"GPU measurement: {f['host_us_per_action']:.1f} µs per action, "
        f"{f['host_us_per_kernel']:.2f} µs per kernel without grad, "
        f"{f['host_us_per_grad_kernel']:.2f} with. Per action, `H200_HOST`'s × "
        f"{rf['action_scale']:.3f}: the host cost of one action around an empty stage, today's "
        f"code ({a['now']['commit'].split()[0]}) {a['now']['min_us']:.1f} µs over the H200 "
        f"run's ({a['then']['commit']}) "
        f"{a['then']['min_us']:.1f} µs, both measured in the same run on this CPU (the record of "
        "the H200 run's code ran on another CPU, whose microseconds do not compare). Per kernel, "
        f"× {rf['kernel_scale']:.3f}: fxpipe's issue time over eager PyTorch's dispatch of the "
        f"same ops (Llama-3.1-8B, 8 GPUs, 4K, eager), {ie['now']['ratio']:.3f} today (commit "
        f"{ie['now']['measured_commit']}) over {ie['then']['ratio']:.3f} for the H200 run's code "
        f"(commit {ie['then']['measured_commit']}, the `bench_issue.json` of {ie['then']['record']}).",
        ""] + table(
        ["model", "GPUs", "tokens per microbatch", "stage backend", "GPU step ms (simulated)",
         "host issue ms (simulated)", "host / GPU step", "step with host / without",
         "host issue ms, refit", "host / GPU step, refit", "step with host / without, refit"],
        rows) + [
        "",
        "Eager PyTorch's own dispatch of the same ops sets a floor for eager stage code (host / "
        "GPU step over fxpipe's issue / dispatch ratio): " + "; ".join(
            f"{r['gpus']} GPUs at {r['seq_len'] // 1024}K {r['dispatch_floor_host_over_gpu_refit']:.2f} "
            f"with the refit ({r['dispatch_floor_host_over_gpu']:.2f} from `H200_HOST`)"
            for r in floors) + ".",
        "",
        "8-GPU / 1-GPU tokens/s, simulated (RoundPipe reports \"roughly linear\"; the same 16 "
        "microbatches per step, each count of GPUs with its own plan):", ""] + table(
        ["tokens per microbatch", "stage backend", "GPUs only (no host costs)",
         "with `H200_HOST`", "with `H200_HOST_REFIT`", "eight issue threads, measured"],
        scaling) + [
        "",
        "Issue #55's targets, simulated with the refit, 8 × H100, Llama-3.1-8B, 4K: "
        + "; ".join(f"{b} host / GPU step {acc[b]['host_over_gpu_refit']:.3f} (at most "
                    f"{acc[b]['at_most']}: {verdict(acc[b]['met'])})" for b in ("inductor", "cudagraphs"))
        + f"; 8-GPU / 1-GPU tokens/s with the best backend ({acc['scaling']['stage_backend']}) "
        f"{acc['scaling']['refit']:.2f} (at least {acc['scaling']['at_least']:.0f}: "
        f"{verdict(acc['scaling']['met'])}; the GPUs alone {acc['scaling']['gpu_only']:.2f})."
    ] + ([
        "",
        f"**Eight issue threads, measured** on one H200 (the kit's `many_devices`, eager stage "
        f"code, eight logical devices: a GPU measurement of today's issue path, not a "
        f"projection): {t8['host_us_per_action']:.1f} µs per action, "
        f"{t8['host_us_per_kernel']:.2f} µs per kernel without grad, "
        f"{t8['host_us_per_grad_kernel']:.2f} with, against the refit's one thread above. "
        "The 8-GPU steps simulated with it, host / GPU step: " + "; ".join(
            f"{r['seq_len'] // 1024}K {r['stage_backend']} {r['host_over_gpu_threads8']:.2f} "
            f"(step × {r['slowdown_threads8']:.2f})" for r in threads8)
        + ". The scaling column above divides those 8-GPU tokens/s by the 1-GPU refit's."
    ] if t8 else []) + _gpu_side(d["scaling"])


def _gpu_side(scaling: list[dict]) -> list[str]:
    """What bounds the 8-GPU step on the GPUs alone (simulated), per tokens per microbatch."""
    seen = {}
    for s in scaling:
        if "work_over_one_gpu" in s:
            seen.setdefault(s["seq_len"], s)
    if not seen:
        return []
    return ["", "What bounds it on the GPUs alone (simulated, no host costs): " + "; ".join(
        f"at {n // 1024}K the {s['gpus']} GPUs compute {s['work_over_one_gpu']:.2f}× one GPU's "
        f"work (the round-robin recomputes what one GPU's plan keeps), so with no idle time "
        f"they would run {s['without_idle']:.2f}× one GPU; they idle {s['bubble_ratio']:.0f}% "
        f"of the step (fill {s['fill']:.0f}%, drain {s['drain']:.0f}%; transfers exposed "
        f"{s['exposed_transfer_ms']:,.0f} ms)" for n, s in sorted(seen.items())) + "."]


def _schedule(d: dict) -> list[str]:
    rows = []
    for name, m in d["models"].items():
        tr = m["transfers_fxpipe_plan"]
        rows.append([name, num(m["roundpipe_sync_published"]), num(m["roundpipe_sync_reproduced"]),
                     num(m["fxpipe_exact"]), f"{m['makespan_ratio']:.3f}",
                     f"{tr['makespan_ms'] / m['fxpipe_makespan_ms']:.3f}",
                     "yes" if tr["prefetch_hidden"] else "no"])
    return table(["model", "RoundPipe sync bubble % (published)", "RoundPipe's plan in fxpipe.sim",
                  "fxpipe exact bubble %", "makespan fxpipe / RoundPipe",
                  "makespan with transfers / without", "prefetch hidden in steady state"], rows)


def _numa(d: dict) -> list[str]:
    rows = [[r["case"], num(r["step_ms"], 1), num(r["exposed_transfer_ms"], 1),
             f"{r['vs_one_socket']:.3f}"] for r in d["rows"]]
    return table(["host (simulated)", "step (ms)", "exposed transfers (ms)", "step / one socket"], rows)


def _optimizer_sim(d: dict) -> list[str]:
    s = d["sim"]
    out = []
    for label, r in s["by_rate"].items():
        stated = any("--params-per-core" in r["command"] for r in runs_for(d, "sim"))
        why = (f"{s['params_per_s_per_core'] / 1e6:.0f}M/s per core × {s['host_cores']} cores, the per-core "
               + ("rate stated by `--params-per-core`" if stated else "rate measured on this machine")
               if label == "measured" else "the median rate RoundPipe's published async / sync ratios imply")
        out += [f"Host AdamW at {r['params_per_s'] / 1e9:.2f} G parameters/s ({why}):", ""]
        rows = []
        for name, m in r["models"].items():
            rel, rp, fx = m["relative_throughput"], m["roundpipe"], m["fxpipe"]
            pub = rel["published_roundpipe_async"]
            rows.append([name, num(rp["optimizer_ms"] / 1e3), num(rp["compute_ms"] / 1e3), "1.00",
                         num(rel["fxpipe_exact"]), num(rel["roundpipe_async"]),
                         "–" if pub is None else num(pub), num(fx["exact_exposed_ms"] / 1e3)])
        out += table(["model", "host step (s)", "step without it (s)", "RoundPipe-sync",
                      "fxpipe-exact", "RoundPipe-async", "published RoundPipe async / sync",
                      "exact: exposed step (s)"], rows) + [""]
    return out[:-1]


def _optimizer_runtime(d: dict) -> list[str]:
    out = []
    for key, r in d["runtime"].items():
        m = r["model"]
        out += [f"{key.replace('_', ' ')}: {m['depth']} blocks of dim {m['dim']}, "
                f"{m['parameters'] / 1e6:.1f}M parameters, {m['microbatches']} microbatches; the optimizer "
                f"step alone {r['optimizer_step_s']['min']:.3f} s (median {r['optimizer_step_s']['median']:.3f} s).", ""]
        out += table(["mode", "s, min (median)", "/ sync (paired median)", "hidden in wall time",
                      "hidden before the devices' last compute"],
                     [[name, f"{v['min_s']:.3f} ({v['median_s']:.3f})", f"{v['ratio_vs_sync_median']:.3f}",
                       "" if name == "none" else pct(v["hidden_paired_median"], signed=False),
                       "" if name == "none" else pct(v["hidden_tail"], signed=False)]
                      for name, v in r["variants"].items()]) + [""]
    return out[:-1]


def _optimizer_cpu(d: dict) -> list[str]:
    c = d["cpu"]
    lim = c["limit_params_per_s"]
    rows = [[name, f"{r['params_per_s'] / 1e6:,.0f} ({r['params_per_s_median'] / 1e6:,.0f})",
             num(r["over_in_place_limit"]), num(r["over_copy_limit"])] for name, r in c["adamw"].items()]
    return [f"{c['parameters'] / 1e6:.1f}M fp32 parameters, {c['cores']} cores; limits at "
            f"{c['bytes_per_param']} B per parameter: in place {lim['in place'] / 1e6:,.0f}M params/s, "
            f"copy {lim['copy'] / 1e6:,.0f}M params/s.", ""] + table(
        ["implementation, threads", "M params/s best (median)", "/ in-place limit", "/ copy limit"], rows)


def _memory_b(measure: str) -> Callable[[dict], list[str]]:
    def render(d: dict) -> list[str]:
        rows = []
        for r in d["predicted_vs_measured"]:
            pred, meas = r["predicted_total"], r["measured"]["total"]
            row = [r["model"], r["grain"], r["device"], mb(pred), mb(meas), pct(pred / meas - 1)]
            if measure == "cuda-sim":
                row.append(num(r["measured"]["reserved"] / pred))
            if measure == "harness":
                row.append(pct(r["worst_stage_error"], signed=False))
            rows.append(row)
        head = ["model", "grain", "device", "predicted", "measured", "predicted / measured - 1"]
        if measure == "cuda-sim":
            head.append("reserved / predicted")
        if measure == "harness":
            head.append("worst stage error")
        return table(head, rows)
    return render


def _gpu_memory(d: dict) -> list[str]:
    out = ["8-block d = 128 chain, 4 microbatches, cuda-sim devices:", ""]
    out += table(["device", "predicted", "allocated", "reserved", "reserved / predicted", "allocator flushes"],
                 [[c["device"], mb(c["predicted"]), mb(c["allocated"]), mb(c["reserved"]),
                   num(c["reserved_over_predicted"]), c["allocator_flushes"]] for c in d["chain"]])
    b = d["bigger"]
    out += ["", f"Parameters {b['params_over_limit']:.1f}× a device's limit ({mb(b['limit'])}), "
            f"{b['stages']} stages: reserved / limit {', '.join(num(x) for x in b['reserved_over_limit'])} "
            f"per device, allocator flushes per step {b['allocator_flushes_per_step']}, "
            f"loss within {b['max_loss_diff']:.1e} of eager.", "", "Pinned host memory:", ""]
    out += table(["param_dtype", "pin_memory", "host_pinned_bytes", "bytes held", "pinned / held", "host_stalls"],
                 [[p["param_dtype"], p["pin_memory"], f"{p['host_pinned_bytes']:,}", f"{p['bytes_held']:,}",
                   f"{p['pinned_over_held']:.3f}", p["host_stalls"]] for p in d["pinned"]])
    g = d.get("graphs")
    if g is None:
        return out
    out += ["", "Under `stage_backend=\"cudagraphs\"` (the slots, the graphs' inputs and outputs "
            "and their pool stay on a device past every job): compile's plan made blind to them "
            "(before) and with room for them (now), 8 × MLPBlock(64), 4 × 32 tokens, "
            "2 microbatches, two strict cuda-sim devices, two fused steps:", ""]
    out += table(["limit", "planner", "plan", "predicted peak", "budget", "two steps",
                  "reserved (max)", "compile s"],
                 [[mb(r["limit"]), r["planner"], f"`{r['plan']}`" if "plan" in r else "–",
                   mb(r["predicted"]) if "predicted" in r else "–", mb(r["budget"]),
                   {"ran": f"ran, loss within {r.get('loss_diff', 0):.1e} of eager",
                    "PlanError": "`PlanError` at compile"}.get(r["outcome"], r["outcome"]),
                   mb(r["reserved"]) if "reserved" in r else "–", f"{r['plan_s']:.2f}"]
                  for r in g["chain"]])
    out += ["", "Llama-3.1-8B (bf16, 16 microbatches, 80 GiB devices; PREDICTED, nothing ran):", ""]
    out += table(["GPUs", "tokens", "planner", "plan", "predicted peak", "budget", "compile s"],
                 [[r["gpus"], f"{r['seq_len']:,}", r["planner"],
                   f"`{r['plan']}`" if "plan" in r else "`PlanError`",
                   mb(r["predicted"]) if "predicted" in r else "–", mb(r["budget"]),
                   f"{r['plan_s']:.1f}"] for r in g["llama"]])
    return out


def _longest(d: dict) -> list[str]:
    rows = []
    for r in d["longest_sequence"]:
        hf = r.get("hf_labels_tokens")
        rows.append([r["model"], f"{r['devices']} x {r['device_gib']} GiB", f"{r['roundpipe_k']}K",
                     f"{r['logits_ce_tokens'] // 1024}K", f"**{r['chunked_ce_tokens'] // 1024}K** "
                     f"({r['chunked_ce_tokens'] / 1024 / r['roundpipe_k']:.2f}x)",
                     "–" if hf is None else f"**{hf // 1024}K** ({hf / 1024 / r['roundpipe_k']:.2f}x)"])
    out = table(["model", "devices", "RoundPipe (published)", "fxpipe, logits + fp32 CE in `loss_fn`",
                 "fxpipe, `linear_cross_entropy`", "HF model with `labels=` (`--hf`)"], rows)
    lora = d.get("longest_sequence_lora") or []
    if lora:
        out += ["", f"{lora[0]['model']} (transformers' class, `labels=`), peft LoRA r=16, one "
                f"{lora[0]['device_gib']} GiB device, one microbatch; Unsloth publishes "
                f"{lora[0]['unsloth_k']}K:", ""]
        out += table(["host limit", "longest sequence", "vs Unsloth"],
                     [["none" if r["host_gib"] is None else f"{r['host_gib']} GiB",
                       f"**{r['hf_labels_tokens'] // 1024}K**",
                       f"{r['hf_labels_tokens'] / 1024 / r['unsloth_k']:.2f}x"] for r in lora])
    return out


def _long_planned(d: dict) -> list[str]:
    rows = [[r["model"], r["mode"], f"{r['devices']} x {r['device_gib']} GiB",
             "–" if r["host_gib"] is None else f"{r['host_gib']} GiB",
             f"{r['whole_tokens'] // 1024}K", f"**{r['chunked_tokens'] // 1024}K**",
             f"{r['sequence_chunks']:,}", f"{r['host_bytes'] / 2**30:,.0f} GiB", r["anchor"]]
            for r in d["planned"]]
    return table(["model", "mode", "devices", "host limit", "whole sequences",
                  "in chunks (`sequence_chunks=\"auto\"`)", "chunks", "host holds",
                  "anchor (published)"], rows)


def _long_simulated(d: dict) -> list[str]:
    base = d["simulated"][0]["tokens_per_s"]
    rows = [[f"{r['devices']} x H100", f"{r['sequence_chunks']}", f"{r['tokens_per_s']:,.0f}",
             f"{r['step_s']:.1f}", f"**{r['tokens_per_s'] / base:.2f}x**",
             f"{r['busy_fraction']:.0%}"] for r in d["simulated"]]
    return table(["GPUs", "chunks", "tokens/s (simulated)", "step s", "vs one GPU",
                  "GPUs busy"], rows)


def _dist_sim(d: dict) -> list[str]:
    s = d["sim"]
    nets = list(s["networks"])
    first = s["networks"][nets[0]]["models"]
    counts = sorted({int(k) for m in first.values() for k in m if k.isdigit()} - {1})
    head = ["model (1 node tok/s)"]
    for n in nets:
        head += [f"{n}: {' / '.join(map(str, counts))} nodes", f"{n}: {counts[-1]}, sharded"]
    rows = []
    for model in first:
        row = [f"{model} ({first[model]['1']['tokens_per_s']:,.0f})"]
        for n in nets:
            m = s["networks"][n]["models"][model]
            row += [" / ".join(num(m[str(c)]["efficiency"]) for c in counts),
                    num(m[f"{counts[-1]}_sharded"]["efficiency"])]
        rows.append(row)
    return [f"Host AdamW at {s['host_params_per_s'] / 1e9:g} G parameters/s; scaling efficiency = "
            "tokens/s over N × one node.", ""] + table(head, rows)


def _dist_nccl(d: dict) -> list[str]:
    n = d["nccl"]
    nodes = sorted(n["rates"]["stated"]["modes"]["host-gloo"], key=int)
    big = nodes[-1]
    out = [f"{n['model']}, plan `{n['plan']}`; {n['parameters'] / 1e9:.2f}B parameters; "
           f"{n['tokens_per_step_per_node']:,} tokens per node and step; "
           f"{n['network_bytes_per_s'] * 8 / 1e9:.0f} Gb/s per node. Tokens/s of the job "
           "(scaling efficiency: over N × one node, which runs no collective); per rank at "
           f"{big} nodes, per step, the gradient bytes downloaded, the parameter bytes "
           "uploaded and the bytes its collectives send over the node's link, and the host "
           "bytes it holds (MODELLED: 2 B of bf16 parameters, 4 B of fp32 masters, 4 B of "
           "fp32 gradients, 8 B of AdamW moments a parameter, the sharded ones over N).", ""]
    for label, r in n["rates"].items():
        rate = r["host_params_per_s"]
        head = ["host AdamW " + (f"{rate / 1e9:g} G params/s" if rate else "free")]
        head += [f"{c} node{'s' * (c != '1')} tok/s (eff)" for c in nodes]
        head += [f"grads down, {big} nodes", "params up", "network", "host (MODELLED)"]
        rows = []
        for mode, row in r["modes"].items():
            last = row[big]
            rows.append([mode + (" (MODELLED)" if mode in n["modelled"] else "")]
                        + [f"{row[c]['tokens_per_s']:,.0f} ({num(row[c]['efficiency'])})"
                           for c in nodes]
                        + [f"{last[k] / 1e9:.1f} GB" for k in ("d2h_bytes_grads",
                                                              "h2d_bytes_params", "network_bytes")]
                        + [f"{last['host_bytes_modelled'] / 1e9:.0f} GB"])
        out += table(head, rows) + [""]
    a, free = n["acceptance"], n["acceptance"]["optimizer_free"]
    out.append(f"Issue 58's target, 2 nodes ≥ {a['at_least']}× one node's tokens/s with device "
               f"collectives: {a['device_speedup']:.2f}× ({'met' if a['met'] else 'not met'}); "
               f"host-gloo {a['host_gloo_speedup']:.2f}×, host-gloo sharded "
               f"{a['host_gloo_sharded_speedup']:.2f}×: at this host rate the optimizer step "
               "bounds one node's step, and sharding it (on the host or with device "
               "collectives) is what scales. With the host optimizer free (the GPUs and links "
               f"alone): device-NCCL {free['device-NCCL']:.2f}×, zero3 {free['zero3']:.2f}×, "
               f"host-gloo {free['host-gloo']:.2f}×, host-gloo sharded "
               f"{free['host-gloo sharded']:.2f}×"
               + (f", device-NCCL all-reduce {free['device-NCCL all-reduce']:.2f}× "
                  "(`data_parallel=True` on GPUs: the optimizer whole on every rank, as "
                  "host-gloo's)" if "device-NCCL all-reduce" in free else "") + ".")
    return out


def _dist_devices(d: dict) -> list[str]:
    v = d["devices"]
    rows = [[world, mode, f"{r['d2h_bytes_grads']:,}", num(r["grads_down_over_host"]),
             f"{r.get('h2d_bytes_grads', 0):,}", f"{r['h2d_bytes_params']:,}",
             f"{r['collectives']:,}" if "collectives" in r else "",
             f"{r['host_collective_bytes']:,}" if "host_collective_bytes" in r else "",
             f"{r['host_grad_buffer_bytes']:,}",
             f"{r['host_param_bytes']:,.0f}" if "host_param_bytes" in r else "",
             f"{r['min_s']:.4f}", f"{r['median_s']:.4f}"]
            for world in ("2", "4") if world in v for mode, r in v[world].items()]
    return [f"{v['parameters']:,} parameters, global batch {v['batch']}, {v['steps']} steps "
            f"after {v['warmup']} warm-up, modes interleaved. \"accumulate 2\": a step of two "
            "calls, the first under `no_sync()`; the bytes and collectives are the stepping "
            "call's (with `\"device\"` its `sRS+` uploads the accumulated `.grad`, then reduces "
            "it on the devices). \"opt.step()\": a call without the optimizer, then "
            "`opt.step()` (with `\"device\"` the devices all-reduce: `sAR`). zero3: the ranks "
            "share one host copy of the parameters (counted 1/N a rank in the host parameter "
            "bytes), each uploads 1/N of every stage, the devices all-gather the rest.", ""] + table(
        ["ranks", "mode", "gradient bytes down", "/ host-gloo's", "gradient bytes up",
         "parameter bytes up", "collectives / step", "bytes into host (gloo) collectives",
         "host gradient buffer bytes", "host parameter bytes",
         "min s/step", "median s/step"],
        rows)


def _dist_memory(d: dict) -> list[str]:
    m = d["memory"]
    rows = []
    for key, ranks in m.items():
        if not isinstance(ranks, list):
            continue
        n, _, dtype, sharded = key.split("_")
        worst = max(ranks, key=lambda r: r["host_total_bytes"])
        ratio = m.get(f"{n}_ranks_{dtype}_sharded_state_and_masters_x_n_over_unsharded")
        rows.append([n, dtype, "yes" if sharded == "sharded" else "no", f"{worst['optimizer_state_bytes']:,}",
                     f"{worst['master_bytes']:,}",
                     f"{ratio:.3f}" if sharded == "sharded" and ratio is not None else "—",
                     f"{worst['host_total_bytes']:,}",
                     ", ".join(f"{r['predicted_optimizer_state_bytes']:,} / "
                               f"{r['optimizer_state_bytes_with_steps']:,}" for r in ranks)
                     if "predicted_optimizer_state_bytes" in worst else "—"])
    return ["Host bytes per rank after one AdamW step (the worst rank); the optimizer state "
            "`predict_memory(..., optimizer=opt)` gave before the step against what each rank "
            "then held (step counters included):", ""] + table(
        ["ranks", "param_dtype", "sharded", "optimizer state B", "fp32 masters B",
         "(state + masters) × N / unsharded", "host total B",
         "optimizer state predicted / held, per rank"], rows)


def _dist_measured(d: dict) -> list[str]:
    m = d["measured"]
    rows = [[k, num(v["median_s"], 3), num(v["min_s"], 3)] for k, v in m.items() if isinstance(v, dict)]
    return table(["ranks", "s per step, median", "min"], rows) + [
        "", f"2 ranks / 1 rank step time (median): {m['ratio_2_over_1_median']:.2f}."]


def _planner(d: dict) -> list[str]:
    rows = [[q["family"], q["k"], q["instances"], num(q["fxpipe_max"], 3), num(q["block_max"], 3),
             num(q["uniform_max"], 3), num(q["params_max"], 3), num(q["roundpipe_max"], 3)]
            for q in d["quality"]]
    out = ["Bottleneck over the optimum, worst instance per family (1.000 = optimal):", ""]
    out += table(["family", "stages", "instances", "fxpipe", "block partition", "uniform",
                  "parameter balance", "RoundPipe-style greedy"], rows)
    out += ["", "Solve time:", ""] + table(
        ["case", "layers", "ms, min", "median"],
        [[t["case"], t["layers"], num(t["min_ms"], 2), num(t["median_ms"], 2)] for t in d["timing"]])
    return out


def _peft(d: dict) -> list[str]:
    rows = []
    for name in ("full", "lora"):
        r = d["variants"][name]
        rows.append([name, f"{r['trainable'] / 1e6:.2f}M", f"{r['h2d_bytes_params']:,}",
                     f"{r['d2h_bytes_grads']:,}", f"{r['h2d_bytes_activations']:,}",
                     f"{r['d2h_bytes_activations']:,}", f"{r['min_s']:.3f} s ({r['median_s']:.3f} s)"])
    lo = d["lora_over_full"]
    return [f"{d['variants']['full']['parameters'] / 1e6:.1f}M parameters, {d['devices']} virtual "
            f"devices, {d['repeats']} interleaved rounds.", ""] + table(
        ["", "trainable", "h2d parameters B", "d2h gradients B", "h2d activations B",
         "d2h activations B", "step, min (median)"], rows) + [
        "", f"LoRA / full step time: {lo['paired_median']:.3f} (paired median), {lo['from_mins']:.3f} "
        f"(from the minima); gradient bytes downloaded: {lo['d2h_bytes_grads']:.4f}×."]


def _precision(d: dict) -> list[str]:
    rows = []
    for name in ("fp32", "param_dtype", "autocast"):
        r = d["variants"][name]
        rows.append([name, f"{r['h2d_bytes_params']:,}", f"{r['d2h_bytes_grads']:,}",
                     f"{r['h2d_bytes_activations']:,}", mb(r["predicted_peak_bytes"]),
                     mb(r["measured_peak_bytes"]), f"{r['losses'][-1]:.4f}",
                     f"{r['min_s']:.3f} s ({r['median_s']:.3f} s)"])
    over = [[name, f"{o['h2d_bytes_params']:.3f}", f"{o['d2h_bytes_grads']:.3f}",
             f"{o['h2d_bytes_activations']:.3f}", f"{o['predicted_peak_bytes']:.3f}",
             f"{o['measured_peak_bytes']:.3f}", f"{o['loss_relative_difference']:.1e}",
             f"{o['time_paired_median']:.3f}"] for name, o in d["over_fp32"].items()]
    return [f"{d['parameters'] / 1e6:.1f}M parameters, {d['devices']} virtual devices, "
            f"{d['repeats']} interleaved rounds.", ""] + table(
        ["", "h2d parameters B", "d2h gradients B", "h2d activations B", "device peak, predicted",
         "measured", "loss (last step)", "step, min (median)"], rows) + ["", "Against fp32:", ""] + table(
        ["", "parameter bytes up", "gradient bytes down", "activation bytes up", "predicted peak",
         "measured peak", "loss, largest relative difference", "step time (paired median, CPU)"],
        over)


def _exactness(d: dict) -> list[str]:
    rows = [[r["model"], r["microbatches"], f"{r['loss_rel_diff']:.1e}", f"{r['grad_rel_diff']:.1e}",
             f"{r['rows_loss_rel_diff']:.1e}", f"{r['rows_grad_rel_diff']:.1e}"] for r in d["rows"]]
    timing = [[t["model"], t["microbatches"], f"{t['count_us_min']:,.0f}",
               f"{t['count_us_median']:,.0f}"] for t in d.get("count_time", [])]
    return table(["model", "microbatches", "loss: by target tokens", "gradients: by target tokens",
                  "loss: by rows (before)", "gradients: by rows (before)"], rows) + [
        "", "The host time counting every microbatch's targets adds to a call:", ""] + table(
        ["model", "microbatches", "µs, min", "µs, median"], timing)


def _sim_vs_measured(d: dict) -> list[str]:
    rows = [[f"{r['measured_ms']:,.1f}", f"{r['simulated_ms']:,.1f}", f"{r['ratio']:.3f}",
             f"{r['measured_bubble']:.1f}%", f"{r['simulated_bubble']:.1f}%"] for r in d["rows"]]
    return [f"{d['devices']} virtual devices, {d['num_microbatch']} microbatches, `{d['plan']}`; "
            f"median |simulated / measured − 1|: {d['abs_error_median']:.3f}.", ""] + table(
        ["measured ms", "simulated ms", "simulated / measured", "bubble, measured", "bubble, simulated"], rows)


def _passes(d: dict) -> list[str]:
    keys = ["capture", "partition", "costs", "lower", "passes_without_capture"]
    return ["Seconds, min (median), one thread:", ""] + table(
        ["layers", "hidden", *keys],
        [[r["layers"], r["hidden"], *(f"{r[k]['min']:.3f} ({r[k]['median']:.3f})" for k in keys)]
         for r in d["rows"]])


def _zoo(d: dict) -> list[str]:
    rows = d["architectures"]
    families = list(dict.fromkeys(r["family"] for r in rows))

    def cell(p: str, f: str) -> str:
        c = d["counts"][p]["by_family"][f]
        return f"{c['passed']} / {c['failed']} / {c['skipped']}"
    out = [f"transformers {d['transformers']}, torch {d['torch']}; {d['devices']} virtual devices, "
           f"{d['num_microbatch']} microbatches; a loss within {d['rtol']['fp32']:g} (fp32) and "
           f"{d['rtol']['bf16']:g} (bf16) of the reference's passes.", ""]
    out += table(["family", "architectures", "fp32 passed / failed / skipped",
                  "bf16 passed / failed / skipped"],
                 [[f, sum(r["family"] == f for r in rows), cell("fp32", f), cell("bf16", f)]
                  for f in families]
                 + [["all", len(rows), *(" / ".join(str(d["counts"][p][s]) for s in
                                                   ("passed", "failed", "skipped"))
                                         for p in ("fp32", "bf16"))]])
    def why(text: str) -> str:   # a CaptureError: what capture at block granularity hit
        if text.startswith("CaptureError") and "- blocks: " in text:
            text = "CaptureError, at block granularity: " + text.split("- blocks: ", 1)[1]
        return text[:200].replace("|", "/")
    failed = []
    for r in rows:
        ps = [p for p in ("fp32", "bf16") if r[p]["status"] == "failed"]
        if len(ps) == 2 and r["fp32"]["why"] == r["bf16"]["why"]:
            ps = ["fp32, bf16"]
        failed += [[f"{r['family']}/{r['model_type']}", p, why(r[p.split(",")[0]]["why"])]
                   for p in ps]
    if failed:
        out += ["", "Failed:", ""] + table(["architecture", "precision", "why"], failed)
    kinds: dict[str, list[str]] = {}
    for r in rows:
        for p in ("fp32", "bf16"):
            if r[p]["status"] == "skipped" and (p == "fp32" or r["fp32"]["status"] != "skipped"):
                kind = r[p]["why"].split(":")[0]
                kind = "too big after shrinking its config" if kind.startswith("still") else kind
                kinds.setdefault(f"{kind} ({p})" if p == "bf16" else kind, []).append(
                    f"{r['family']}/{r['model_type']}")
    if kinds:
        out += ["", "Skipped (the reasons per architecture are in the JSON):", ""] + table(
            ["why", "architectures"], [[k, f"{len(v)}: {', '.join(v)}"] for k, v in sorted(kinds.items())])
    return out


def _capture(d: dict) -> list[str]:
    policies = list(next(iter(d["seconds"].values())))
    return table(["model", *(f"{p} (s)" for p in policies)],
                 [[name, *(num(row[p], 2) for p in policies)] for name, row in d["seconds"].items()]) + [
        "", f"Min of {d['repeats']} interleaved repeat(s), one thread."]


def _big_weights(d: dict) -> list[str]:
    rows = []
    for name, label in (("weights", "`weights=` on a meta model"),
                        ("from_pretrained", "`from_pretrained`, then compile")):
        r = d["summary"][name]
        rows.append([label, span(r["anon_growth_over_frozen"]), span(r["peak_anon_over_frozen"]),
                     f"{min(r['first_step_s']):.1f} s"])
    v = d["verdict"]
    frozen = d["summary"]["weights"]["frozen_bytes"]
    return [f"A frozen {mb(frozen)} fp32 base with a LoRA adapter trained on it, each row in a "
            "fresh process; anonymous memory (`RssAnon`) over the frozen bytes.", ""] + table(
        ["loaded with", "RssAnon growth after the steps / frozen", "peak RssAnon / frozen",
         "time to first step (min)"], rows) + [
        "", f"Target for `weights=`: growth below {v['anon_growth_target']} of the frozen bytes "
        f"({'met' if v['anon_growth_ok'] else 'NOT met'}); the losses are "
        f"{'equal' if v['same_losses'] else 'NOT equal'}. The peak counts the virtual devices' "
        "memory, host memory here (a GPU's on a GPU)."]


def _gpu_check(d: dict) -> list[str]:
    vc, hp, pm, st = d["vs_checkpoint"], d["hidden_prefetch"], d["predicted_vs_measured"], d["stats"]
    big, w = d["bigger_than_device"], d["weights"]
    m = d["model"]
    hidden = ", ".join(f"{v['hidden_fraction']:.3f}" for v in hp["devices"].values())
    rows = [
        ["fused training step time / eager with `torch.utils.checkpoint` per block, same GPU "
         "(lower is better)",
         f"{vc['ratio_min']:.3f} ({vc['ratio_median']:.3f})",
         f"{vc['params'] / 1e9:.2f}B fp32 parameters streamed from host memory every step; "
         f"eager holds them on the GPU"],
        ["parameter prefetch hidden behind compute", hidden,
         f"the compute stream waited {hp['exposed_ms_total']:.1f} ms for parameters"],
        ["`fxpipe.simulate` / measured step", f"{pm['predicted_over_measured']:.3f}",
         f"{pm['measured_ms']:,.0f} ms step; host links {pm['h2d_bytes_per_s'] / 1e9:.0f} GB/s up, "
         f"{pm['d2h_bytes_per_s'] / 1e9:.0f} GB/s down"],
        ["host issue time / device compute time", ", ".join(f"{v:.2f}" for v in st["issue_vs_busy"].values()),
         f"{st['actions']} actions, {st['host_issue_ms']:,.0f} ms of issuing; {st['host_stalls']} host stalls"],
        ["bf16 weights over a capped device's memory", f"{big['weights_over_limit']:.2f}×",
         f"peak reserved {big['peak_reserved_over_limit']:.2f}× the cap, {big['tokens_per_s']:,.0f} tokens/s, "
         f"losses {', '.join(f'{x:.3f}' for x in big['losses'])}"],
        ["frozen parameters file-backed (`weights=`)", f"{w['frozen_file_backed']}/{w['frozen_params']}",
         f"{'registered for DMA' if w['registered'] else 'through the pinned ring'}; "
         f"loss difference {w['max_loss_diff']:.1e}"],
    ]
    logical = d.get("scaling", {}).get("logical")
    if logical:
        rows.append(["two logical devices on one GPU / one device: loss difference",
                     f"{logical['max_loss_diff']:.1e}", "two `CudaDevice(0)`s, each with its own "
                     "streams, events and copies: the cross-device ordering code on real CUDA"])
    g = d.get("generate")
    if g and g.get("ok"):
        rows += _kit_generate(g)
    for r in d.get("finetune", {}).get("runs", []):
        e = r.get("eager", {})
        figure = (f"{r['tokens_per_s']:,.0f} tokens/s, MFU {r['mfu']:.1%}"
                  + (f", step {r['vs_eager']:.2f}× eager's" if r.get("vs_eager") else "")
                  if r.get("ok") else
                  f"FAILED ({r['error']['type']})" if "error" in r else
                  f"FAILED (losses {', '.join(str(x)[:6] for x in r['losses'][:3])}...)"
                  if r.get("losses") else "not run")
        eager = (f"eager + checkpointing: {r['tokens_per_step'] / e['step_s']:,.0f} tokens/s "
                 f"({e['step_s']:.2f} s/step, peak {e['peak_device_bytes'] / 2**30:.1f} GiB)"
                 if e.get("ran") else f"eager: {e.get('why', 'not run')}")
        backend = f", stage_backend={r['stage_backend']}" if r.get("stage_backend") else ""
        rows.append([f"bf16 {r['mode']} fine-tune, {r['model']} shape, "
                     f"{r.get('tokens_per_step', 0):,} tokens per step{backend}", figure, eager])
    dp = d.get("data_parallel")
    if dp and "max_param_diff" in dp:
        rows.append(["`data_parallel=\"device\"` on one rank (NCCL) / the same pipe without: "
                     "parameters after two steps", f"{dp['max_param_diff']:.1e} apart",
                     f"{dp['device_reduce_scatters']} device reduce-scatters a step, "
                     f"{dp.get('optimizer', 'AdamW')}; losses {dp['max_loss_rel_diff']:.1e} "
                     "apart (relative)" + ("" if dp.get("ok") else "; FAILED")])
    md = d.get("many_devices")
    if md and md.get("backends"):
        for name, b in md["backends"].items():
            if not b.get("ran"):
                continue
            i, idle, mem = b["issue"], b["issue_idle"], b["memory"]
            per_kernel = (f", {i['issue_us_per_kernel']:.1f} µs/kernel"
                          if i.get("issue_us_per_kernel") else "")
            rows.append([f"{md['logical_devices']} logical devices on one GPU "
                         f"(`many_devices`), stage_backend={name}: host issue",
                         f"{i['issue_us_per_action']:,.0f} µs/action{per_kernel}",
                         f"{i['device_actions']} device actions in {i['host_issue_ms']:,.0f} ms "
                         f"of issue; the issue lock waited {b['issue_lock_wait_ms']:,.0f} ms "
                         f"(summed over the devices' threads); traced call "
                         f"{idle['makespan_ms']:,.0f} ms, compute busy "
                         f"{idle['compute_busy_ms']:,.0f} ms (summed over the logical devices); "
                         f"reserved / predicted memory {mem['reserved_over_predicted']:.2f}; "
                         f"graph captures {b['captures_after_step']}"
                         + ("; a call with the issue lock kept between a thread's actions / "
                            "handed over after each: "
                            f"{b['lock_ab']['kept']['call_ms']:,.0f} / "
                            f"{b['lock_ab']['each']['call_ms']:,.0f} ms"
                            if "lock_ab" in b else "")])
        rows.append([f"`many_devices`: loss difference, {'/'.join(md['backends'])}",
                     f"{md['max_loss_rel_diff']:.1e}",
                     f"relative, over {len(md['backends']['eager']['steps'])} calls of two "
                     f"lengths {md['lengths']}; captures plateau: {md['plateau']}"])
    tests = [f"CUDA tests at the recorded commit: {d['cuda_tests']['summary']}."]
    if d.get("finetune", {}).get("note"):
        tests.append(f"Fine-tuning: {d['finetune']['note']}")
    if "failed_2026_11_27" in d:
        tests.append(f"Also on 2026-11-27: {d['failed_2026_11_27']['note']}")
    for name, f in d.get("failed_2026_11_30", {}).items():
        tests.append(f"Failed on 2026-11-30, `{name}`: {f['type']}: {f['message']}.")
    for r in d.get("runs", []):
        if "vs_checkpoint" not in r["keys"]:
            tests.append(f"`{', '.join(k for k in r['keys'] if not k.startswith('failed'))}` from "
                         f"`{r['command']}` (commit {r['commit']}, {r['date']}; {r['machine']}).")
    if "cuda_tests_after_fix" in d:
        fix = d["cuda_tests_after_fix"]
        tests.append(f"After the fixes ({'; '.join(fix['fixed'])}): {fix['summary']} "
                     f"({fix['skipped']}).")
    return [f"{', '.join(d['devices'])}, torch {d['torch']}; a Llama-style model of {m['depth']} "
            f"blocks, dim {m['dim']}, batch {m['batch']} × {m['seq']} tokens.", ""] + table(
        ["", "figure", "details"], rows) + [""] + tests


def _finetune(d: dict) -> list[str]:
    m = d["measured"]
    where = ("tiny widths of the same classes on 2 CPU virtual devices (`--dry-run`): the code "
             "path, not the speed" if m["dry_run"] else f"{m['devices']} GPU(s)")
    rows = [[r["mode"], r["model"], f"{r['params'] / 1e6:,.2f}M", f"{r['tokens_per_step']:,}",
             f"{r['step_s']:.3f}", f"{r['tokens_per_s']:,.0f}",
             "–" if r["mfu"] is None else f"{r['mfu']:.1%}",
             "–" if r["vs_eager"] is None else f"{r['vs_eager']:.2f}",
             f"{r['predicted_peak_bytes'] / r['peak_device_bytes']:.2f}",
             "–" if r["predicted_over_measured"] is None else
             f"{r['predicted_over_measured']:.2f}"] if r.get("ok") else
            [r["mode"], r["model"], "FAILED", "", "", "", "", "", "", ""] for r in m["runs"]]
    out = [f"Measured: {where}.", ""] + table(
        ["run", "shape", "parameters", "tokens/step", "step s", "tokens/s", "MFU",
         "step time / eager (lower is better)", "peak predicted / counted",
         "step predicted / measured"], rows)
    p = d.get("predicted")
    if p:
        prow = [[r["mode"], r["model"], r["gpu"], r["host_work"],
                 r.get("stage_backend", "eager") + (" (modelled)" if r.get("modelled") else ""),
                 f"{r['host_issue_s']:.2f}" if "host_issue_s" in r else "–",
                 r.get("recompute", "full"),
                 f"{r['recomputed']:.0%}" if "recomputed" in r else "–",
                 f"{r['flops_ratio']:.2f}" if "flops_ratio" in r else "–",
                 f"{r['predicted_step_s']:.2f}",
                 f"{r['tokens_per_s']:,.0f}", f"{r['model_tflops']:.0f}",
                 f"{r['model_tflops'] / 989.4:.1%}", f"{r['predicted_peak_bytes'] / 1e9:.1f}"]
                for r in p["rows"]]
        hr = p["host_rates"]
        out += ["", f"**{p['label']}**: the full-size runs on one GPU, the layers' FLOPs at "
                f"{p['flops_per_s'] / 1e12:.0f} TFLOP/s ({p['flops_source']}), the host link "
                f"{p['link_bytes_per_s'] / 1e9:.0f} GB/s each way (the H200's, measured), the "
                f"host's AdamW at {hr['optimizer_bytes_per_s'] / 1e9:.2f} GB/s and casts at "
                f"{hr['copy_bytes_per_s'] / 1e9:.1f} GB/s ({p['host_rates_source']}) or free. "
                + (f"With this machine's host work the host also issues each action and kernel "
                   f"at the H200 run's fitted cost ({_host_issue(p['host_issue'])}), per stage "
                   "backend (what each launches; the kernels run at the same rate under all "
                   "three, no fusion speedup modelled; cudagraphs' replays modelled); host "
                   "issue s: the host's issue time per step, hidden while under the GPU's. "
                   if p.get("host_issue") else "") +
                "MFU against 989.4 TFLOP/s (H100 SXM and H200 dense bf16). Recompute `auto` "
                "(the default): the fused tail keeps the layers that fit and pay, planned for "
                "each row's machine; `full`: every block recomputed; recomputed: the share of "
                "the blocks' forward FLOPs recomputed; hardware / model: the cost pass's FLOPs "
                "of the plan that runs over the model's forward and backward.", ""] + table(
            ["run", "shape", "GPU", "host work", "stage backend", "host issue s", "recompute",
             "recomputed", "hardware / model", "step s", "tokens/s", "model TFLOP/s", "MFU",
             "peak GB"], prow)
    if p and p.get("qlora"):
        q = p["qlora"]
        qrow = [[r["mode"], r["model"], f"{r['gpus']} × 24 GiB", f"8 × {r['seq']:,}",
                 f"{r['host_param_bytes'] / 2**30:.1f}", f"{r['predicted_host_bytes'] / 2**30:.1f}",
                 f"{r['tokens_per_s']:,.0f}", f"{r['bubble_ratio']:.0f}%",
                 f"{r['longest']:,}" if r["longest"] else
                 "none fits" if r.get("longest_why") else "not searched",
                 f"{r['host_memory'] / 2**30:.0f}"] for r in q]
        out += ["", f"**{p['label']}**, LoRA r=16 on every block linear of Llama-3.1-70B and "
                "Qwen3-32B, its frozen base in bf16 (`lora`) or NF4 (`qlora`, "
                "`frozen_dtype=\"nf4\"`: embeddings and head in bf16), on RTX 4090s (24 GiB, "
                "PCIe 4.0 at 25 GB/s each way, 1,008 GB/s device memory pricing the "
                "dequantizes; FLOPs at 60% of 165 TFLOP/s, assumed), 8 × 4,096 tokens a step "
                "(and, on 8 GPUs, 8 × 1,024: a step short enough for the link to bind); "
                "host GiB: the parameters as held, and what the plan keeps "
                "(`predict_memory(..., optimizer=).host_total`: parameters, gradients, the kept "
                "activations and the adapters' AdamW state); the longest sequence: one "
                "sequence a step, within the host memory given (the AdamW state included).", ""] + table(
            ["run", "model", "GPUs", "tokens/step", "host params GiB", "host total GiB", "tokens/s",
             "bubble", "longest sequence", "host limit GiB"], qrow)
    return out


def _host_issue(h: dict) -> str:
    return (f"{h['host_us_per_action']:.0f} µs per action, {h['host_us_per_kernel']:.1f} / "
            f"{h['host_us_per_grad_kernel']:.1f} µs per kernel without / with grad")


def _quant(d: dict) -> list[str]:
    rows = [[r["variant"], f"{r['host_param_bytes'] / 1e9:.2f}", f"{r.get('host_cut', 1):.2f}×",
             f"{r['h2d_bytes_params'] / 1e9:.2f}", f"{r.get('h2d_cut', 1):.2f}×",
             "–" if r["bytes_per_quantized_weight"] is None else f"{r['bytes_per_quantized_weight']:.4f}",
             f"{r['quantize_s']:.1f}", f"{r['loss']:.4f}"] for r in d["rows"]]
    out = table(["variant", "host params GB", "÷ (bf16 / this)", "h2d params GB / step",
                 "÷ (bf16 / this)", "bytes / quantized weight", "quantize s", "loss"], rows)
    c = d.get("computed") or {}
    if c:
        out += ["", f"Computed, not run: the embedding table in NF4 too, "
                f"{c['nf4_everything_h2d_cut']:.2f}× fewer parameter bytes up than bf16; its "
                f"rows gathered on the host instead (no table upload), "
                f"{c['nf4_head_embedding_on_host_h2d_cut']:.2f}×."]
    return out


def _kit_generate(g: dict) -> list[list[str]]:
    """The kit's ``generate`` rows: per ``kv_cache`` (a model bigger than the device, against
    the weights-over-link bound), or the one row of a JSON from before the variants."""
    if "variants" not in g:
        return [["`pipe.generate` (KV cache) tokens equal `transformers`' `generate`",
                 "yes" if g["same_tokens"] else f"agreement {g['token_agreement']:.3f}",
                 f"{g['tokens_per_s']['fxpipe']:,.0f} tokens/s, {g['over_transformers']:.2f}× "
                 f"transformers with every weight resident (the cache on the host)"]]
    rows = []
    for kv, v in g["variants"].items():
        name = (f"`pipe.generate(kv_cache=\"{kv}\")`, weights {g['weights_over_limit']:.2f}× "
                "the device's cap: tokens/s / the weights-over-link bound")
        if not v["ran"]:
            rows.append([name, "refused", v["refused"].split(". Nothing ran")[0]])
            continue
        tokens = "same tokens" if v["same_tokens"] else f"token agreement {v['token_agreement']:.3f}"
        resident = ", ".join(map(str, v["resident_stages"])) or "none"
        rows.append([name, f"{v['over_bound']:.2f}",
                     f"{v['tokens_per_s']:,.0f} of {g['bound_tokens_per_s']:,.0f} tokens/s "
                     f"({g['bound_from']}, {g['h2d_bytes_per_s'] / 1e9:.0f} GB/s); {tokens} as "
                     f"`transformers` with every weight resident "
                     f"({g['transformers']['tokens_per_s']:,.0f} tokens/s); caches resident: "
                     f"stages {resident}"])
    return rows


def _generate_measured(d: dict) -> list[str]:
    m = d["measured"]["model"]
    rows = [[name, f"{r['tokens_per_s_max']:,.1f} ({r['tokens_per_s_median']:,.1f})",
             f"{r['over_transformers_median']:.2f}", "yes" if r["same_tokens"] else "NO"]
            for name, r in d["measured"]["rows"].items()]
    moved = [[name, mb(b["h2d_bytes_params"]), mb(b["d2h_bytes_cache"]),
              mb(b["h2d_bytes_activations"]), mb(b["d2h_bytes_activations"]),
              (", ".join(map(str, b["resident_stages"])) or "none") if "resident_stages" in b else "–"]
             for name, r in d["measured"]["rows"].items() if "bytes_per_step" in r
             for b in [r["bytes_per_step"]]]
    return [f"A Llama-style model of {m['parameters'] / 1e6:.1f}M parameters ({m['layers']} blocks, "
            f"hidden {m['hidden']}), batch {m['batch']}, a {m['prompt']}-token prompt, "
            f"{m['new']} new tokens, 2 virtual CPU devices; `kv` is `kv_cache`, `mb` "
            "`num_microbatch`.", ""] + table(
        ["", "tokens/s, max (median)", "/ transformers (median)", "same tokens"], rows) + [
        "", f"Bytes one decode step moved (the last; `pipe._generation[-1].pipe.stats()`; "
        f"without a cache: its last call, the whole sequence). The weights are "
        f"{mb(m['weight_bytes'])} (the tied embedding once; the two stages that use it "
        "each upload it); `h2d params` counts each stage's uploaded weights and the caches "
        "streamed with them.", ""] + table(
        ["", "h2d params", "d2h cache", "h2d activations", "d2h activations",
         "stages with a resident cache"], moved)


def _generate_simulated(d: dict) -> list[str]:
    s = d["simulated"]
    key = lambda r: (r["model"], r["gpu"], r["gpus"], r.get("microbatches", 1))  # noqa: E731
    device = {key(r): r for r in s["rows"] if r["kv_placement"] == "device"}

    def cells(r: dict) -> list[str]:
        if not r.get("fits", True):
            return ["no fit", "–"]
        return [str(r["batch"]), f"{r['tokens_per_s']:,.2f}"]

    rows = []
    for h in (r for r in s["rows"] if r["kv_placement"] == "host"):
        g = device[key(h)]
        both = h.get("fits", True) and g.get("fits", True)
        rows.append([h["model"], f"{h['gpus']} × {h['gpu']}", h.get("microbatches", 1),
                     *cells(h), f"{h['host_bytes'] / 1e9:,.0f}", *cells(g),
                     f"{g['bound_tokens_per_s']:,.2f}" if g.get("fits", True) else "–",
                     f"{g['tokens_per_s'] / h['tokens_per_s']:.2f}" if both else "–",
                     "; ".join(h["published"]) or "–"])
    return [f"A decode step at {s['context']} + {s['new']} tokens of context, fp16 weights; "
            "the KV cache in host memory, streamed with its layer (`host`), or resident on "
            "the GPUs (`device`). Simulated, not run.", ""] + table(
        ["model", "GPUs", "microbatches", "host: batch", "host: tokens/s (simulated)",
         "host GB (weights and cache)", "device: batch", "device: tokens/s (simulated)",
         "bound at the device batch: weights over the links", "device / host",
         "published (their setups)"], rows)


SECTIONS: list[tuple[str, str, str, str, Callable[[dict], list[str]]]] = [
    ("GPU acceptance check", "gpu_check.json", "vs_checkpoint",
     "`python -m fxpipe.check` on a real GPU (see its docstring for each section); "
     "min (median) over interleaved repeats.", _gpu_check),
    ("Host issue cost", "bench_issue.json", "rows",
     "The host time a training step's issuing takes, with the device work elided: fxpipe's "
     "plan for the full-size model (built on `meta`, 80 GiB devices, 16 microbatches) run on "
     "a model of the same architecture at tiny widths on `InlineDevice`s, beside the same tiny "
     "model run eagerly (the op dispatch any eager step pays) and the predicted GPU time of "
     "the full-size step. A ratio below 1 means the host keeps up with the GPUs. The host "
     "time is this CPU's, whose speed varies between runs on these machines (the eager "
     "8-GPU 4K row has read from 0.87 to 2.31 with the same actions): compare backends "
     "within one run.", _issue),
    ("The host in the simulator, calibrated on the H200", "bench_host_model.json", "rows",
     "`fxpipe.simulate` prices the host's issuing (`Hardware.host_us_per_action`, "
     "`host_us_per_kernel`, `host_us_per_grad_kernel`, the kernels the cost pass counts). "
     "The figures are fitted to the one GPU run's issue time per action kind (its Program "
     "rebuilt on `meta`); the refit scales them by how much the host's work shrank on CPU "
     "since that run's code (a projection for one issue thread, not a GPU measurement; the "
     "kit's `many_devices` measured eight threads on a GPU: \"Eight issue threads, "
     "measured\" below). The second table "
     "is simulated: the Llama-3.1-8B step of the host "
     "issue benchmark above (16 microbatches, 60 % of an H100's bf16 FLOP/s, 50 GB/s links) "
     "with either host, per stage backend; inductor launches 0.31 of eager's kernels (measured "
     "on CPU), cudagraphs a graph job's replay and its copies in and out (none in for the "
     "inputs its upload put in its input slot), the fused tail "
     "inductor's kernels (modelled: no replay's launch has been timed).",
     _host_model),
    ("Schedules", "bench_schedule.json", "models",
     "RoundPipe's published simulator inputs (`tests/data/roundpipe_simulation.json`: 8 "
     "GPUs, 16 microbatches, their measured layer times); fxpipe searches partitions and "
     "dispatch orders with its simulator as objective, exact (non-stale) semantics, and "
     "compares with RoundPipe's published synchronous schedule. The last column simulates "
     "the same schedule with transfers on (RTX 4090, PCIe 4.0 ×16).", _schedule),
    ("Two sockets (NUMA), simulated", "bench_numa.json", "rows",
     "A Llama-3.1-8B-shaped step (32 blocks of 436 MB in bf16, 8 microbatches of 4,096 tokens, "
     "8 GPUs, 50 GB/s links) in `fxpipe.simulate` on a dual-socket host: fxpipe's host memory "
     "on one node today (the far socket's GPUs share the socket link), against each stage's "
     "memory on its GPUs' node, which the runtime does not do yet. Simulated, not measured.",
     _numa),
    ("Host optimizer in the simulator", "bench_optimizer.json", "sim",
     "RoundPipe's five configurations with a host AdamW step, relative throughput "
     "(RoundPipe-sync = 1): the step after the backward, fxpipe's streamed exact step, and "
     "RoundPipe's one-step-stale optimizer.", _optimizer_sim),
    ("Optimizer modes on virtual devices", "bench_optimizer.json", "runtime",
     "The step without the optimizer (`none`), the optimizer after the backward (`sync`), "
     "streamed into the backward (`exact`) and one step stale (`async`), interleaved rounds. "
     "A virtual device's compute runs on the host's CPU, so the wall-time overlap depends on "
     "a free core; the devices' records show what ran before their last compute.",
     _optimizer_runtime),
    ("Host optimizer step", "bench_optimizer.json", "cpu",
     "One AdamW step over 16.8M fp32 parameters against the memory-bandwidth limit "
     "(28 B per parameter).", _optimizer_cpu),
    ("Device memory", "bench_memory.json", "predicted_vs_measured",
     "Each device's predicted peak against a CPU replay of every stage job under the "
     "devices' byte counting (`--measure harness`), 2 devices, 2 microbatches, fixed plans.",
     _memory_b("harness")),
    ("Device memory, counted by the devices", "bench_memory_virtual.json", "predicted_vs_measured",
     "The same calls run on virtual devices; measured is the devices' own count of every "
     "byte their work allocated.", _memory_b("virtual")),
    ("Device memory, reserved by a GPU-like allocator", "bench_memory_cuda_sim.json",
     "predicted_vs_measured",
     "The same calls on cuda-sim devices (memory allocated at issue, a caching allocator): "
     "what the allocator reserves against the prediction.", _memory_b("cuda-sim")),
    ("GPU allocator emulation", "bench_gpu_memory.json", "chain",
     "cuda-sim devices: reserved over predicted with 4 microbatches, a model whose "
     "parameters are 3× a device's limit, page-locked host bytes, and compile's plan under "
     "device graphs.", _gpu_memory),
    ("Longest sequence", "bench_memory.json", "longest_sequence",
     "The longest sequence (multiples of 1024 tokens) for which the planner finds a plan "
     "whose every stage fits, 8 devices, bf16, microbatch 1: predictions on `meta`, not runs. "
     "Since issue 39 the HF column is transformers' model as users call it (`labels=`).",
     _longest),
    ("Host memory", "bench_memory.json", "host_memory",
     "Peak RSS above the process baseline over the model's parameter bytes P (24-block "
     "MLP-style model, 2 virtual devices, 2 microbatches, SGD, three steps, each row in a "
     "fresh process): eager training; fxpipe's fused step; the fused step, an eager-style "
     "step and `no_grad` inference in one process; the fused step with bf16 parameters.",
     lambda d: [f"glibc: {d.get('host_memory_malloc', '?')}.", ""] + table(
         ["row", "RSS / P", "device / P", "target", "met"],
         [[r["row"], num(r["rss_over_P"]), num(r["device_over_P"]),
           "" if r.get("target_over_P") is None else f"≤ {r['target_over_P']:.2f}",
           {None: "", True: "yes", False: "no"}[r.get("met")]] for r in d["host_memory"]])),
    ("Data parallel", "bench_distributed.json", "sim",
     "RoundPipe's five configurations (8 RTX 4090 per node) on 1–16 nodes, one rank per "
     "node, a ring all-reduce per backward stage on the host's collective stream.", _dist_sim),
    ("Data parallel on the devices, simulated", "bench_distributed.json", "nccl",
     "SIMULATED; zero3 MODELLED across nodes (the runtime runs `data_parallel=\"zero3\"` on "
     "one host's ranks only); device-NCCL is the Program "
     "`data_parallel=\"device\"` runs, priced as it prints. "
     "Llama-3.1-8B full fine-tune (bf16 `param_dtype`, fp32 masters, AdamW streamed on the "
     "host) on 1, 2 and 4 nodes of 8 H100s (80 GiB, 60 % of 989 TFLOP/s, 50 GB/s host links "
     "each way), one rank per node, `fxpipe.simulate` with `Hardware.collectives`: "
     "host-gloo (the fp32 gradients all-reduced on the host), host-gloo sharded "
     "(`shard_optimizer`), device-NCCL (each stage's bf16 gradients reduce-scattered on its "
     "device, 1/N downloaded and stepped, the bf16 parameters all-gathered on the host), "
     "device-NCCL all-reduce (`data_parallel=True` on GPUs without `shard_optimizer`: each "
     "stage's bf16 gradients all-reduced on its device, all downloaded and stepped) and "
     "zero3 (also 1/N of the parameters held and uploaded, all-gathered on the devices before "
     "each stage computes). The host's issue time and host copies are left out.", _dist_nccl),
    ("Data parallel on the devices, measured", "bench_distributed.json", "devices",
     "MEASURED on this machine: 2 and 4 ranks (gloo, localhost), 2 virtual CPU devices each, "
     "a 6-block MLP, AdamW streamed: where the gradients are reduced. host-gloo "
     "(`data_parallel=True`), host-gloo sharded (`shard_optimizer=True`), device "
     "(`data_parallel=\"device\"`: each stage's gradients reduce-scattered on its device, gloo "
     "on the virtual devices' tensors where a GPU runs NCCL), zero3 (`data_parallel=\"zero3\"`). "
     "Per rank and step, from "
     "`pipe.stats()`; step times informational (the ranks share this machine's cores).",
     _dist_devices),
    ("Data parallel host memory", "bench_distributed.json", "memory",
     "A 414K-parameter MLP, AdamW, sharded (`shard_optimizer=True`) or not.", _dist_memory),
    ("Data parallel step time", "bench_distributed.json", "measured",
     "Global batch 64, 6-block MLP, AdamW, 2 virtual devices per rank (informational where "
     "all ranks share a few CPU cores).", _dist_measured),
    ("Planner", "bench_planner.json", "quality",
     "fxpipe's exact bottleneck-optimal partition against heuristics, on families of random "
     "layer costs.", _planner),
    ("peft LoRA", "bench_peft.json", "variants",
     "A Llama-style model from a config, LoRA r=8 on `q_proj`/`v_proj` against full "
     "training; bytes per step from `pipe.stats()`.", _peft),
    ("Fine-tuning in bf16", "bench_finetune.json", "measured",
     "`benchmarks/bench_finetune.py` (and the GPU kit's `finetune` section): LoRA r=16 on "
     "every block linear of the Llama-3.1-8B shape (bf16 base on the host, fp32 adapters) "
     "and a full fine-tune of the Qwen3-4B shape (fp32 masters, AdamW streamed into the "
     "backward), bf16 device copies, 16 microbatches of 4,096 tokens, random weights made "
     "in host memory. Per step, T tokens, N every parameter: model FLOPs = 6·N·T (the "
     "convention of MegaTrain's and RoundPipe's figures); hardware FLOPs = T·(2·L + 2·L_blocks "
     "+ 2·L + 2·L_trainable) + layers·8·S·T·d_attn (L: the Linear weights, their forward, "
     "the blocks' recompute, the input gradients and the trainable ones' weight gradients; "
     "causal attention's two products, forward, backward twice, recompute once; S the "
     "sequence, d_attn heads × head dim); MFU = model FLOPs / step / the GPU's dense bf16 "
     "peak; `step time / eager` = fxpipe's step time over eager transformers' (below 1: "
     "fxpipe faster; gradient checkpointing, bf16 "
     "autocast, the microbatches accumulated, fused AdamW) on the same GPU.", _finetune),
    ("One sequence in chunks: the longest", "bench_long_context.json", "planned",
     "`benchmarks/bench_long_context.py` part (a): `fxpipe.plan.max_sequence_length` for "
     "transformers' classes built on `meta`, bf16, their own loss (`labels=`), whole "
     "sequences (`sequence_chunks=None`) against token chunks (the default), up to 8M "
     "tokens; the host bytes the longest needs (`details=`: every attention layer's keys "
     "and values, the parameters, the boundary activations of the plan's cuts). Planned, "
     "not run.", _long_planned),
    ("One sequence in chunks: throughput", "bench_long_context.json", "simulated",
     "`benchmarks/bench_long_context.py` part (b): one 256K-token sequence of "
     "Llama-3.1-8B (full, bf16) in chunks, `fxpipe.simulate` of the chunked Program "
     "(`pipe.program(sequence_chunks=K)`) on H100s (80 GiB, 50 GB/s each way, 60 % of "
     "989 TFLOP/s): each chunk attention costed for the average chunk's keys, each "
     "layer's keys and values crossing the link once per job. Simulated.", _long_simulated),
    ("Quantized frozen weights", "bench_quant.json", "rows",
     "`benchmarks/bench_quant.py`: the Llama-3.1-8B shape (32 blocks, its vocabulary), peft "
     "LoRA r=16 on every block linear, the frozen base held in bf16 or quantized by "
     "`frozen_dtype` (`nf4+head`: the output head too), one training step on one device "
     "(a 3 GiB cuda-sim virtual device here) with bf16 device copies: the host's parameter "
     "bytes and the bytes the step's uploads carried (`pipe.stats()[\"h2d_bytes_params\"]`), "
     "each variant in a fresh process. Bytes carry over to a GPU as they are.", _quant),
    ("Mixed precision", "bench_precision.json", "variants",
     "A Llama-style model from a config trained in fp32, with `param_dtype=torch.bfloat16` "
     "and under `torch.autocast` (bf16) around the call; bytes per step from `pipe.stats()`, "
     "device peaks predicted and counted. The bytes and peaks carry over to a GPU; the step "
     "time does not: a CPU without bf16 units runs bf16 matmuls several times slower than "
     "fp32 ones (the time column measures its kernels), where a GPU runs them faster.",
     _precision),
    ("Exactness on padded batches", "bench_exactness.json", "rows",
     "Hugging Face Llama, T5 and BERT trained one fused step with their own `labels=` loss on "
     "a batch of 4 with `-100` labels (a masked prompt, a row cut short, a row with no "
     "target), 2 virtual devices: the loss's relative difference from eager's and the largest "
     "gradient difference over the largest gradient (fp32), each microbatch weighted by its "
     "share of the target tokens (fxpipe) or of the rows (the design before issue 52; where a "
     "microbatch holds no target, 3 and 4 microbatches here, that design's loss was NaN, "
     "its mean over no target: shown with today's mean, 0).", _exactness),
    ("Simulator against a real run", "bench_sim_vs_measured.json", "rows",
     "Virtual devices, layer times from the same run.", _sim_vs_measured),
    ("Weights bigger than host RAM", "bench_big_weights.json", "summary",
     "`fxpipe.compile(model_on_meta, ..., weights=DIR)` binds the parameters to the "
     "checkpoint's safetensors by memory map: frozen ones stay file-backed (read from the "
     "page cache), against loading the same model with `from_pretrained` first.", _big_weights),
    ("Generation", "bench_generate.json", "measured",
     "`pipe.generate` with its KV cache on the host (`kv_cache=\"host\"`: each stage's "
     "weights and cache uploaded every token, the new position written back), resident on "
     "the devices (`\"device\"`) or placed by memory (`\"auto\"`; the virtual devices "
     "have no `memory_limit`, so every cache stays), each in 1 and 2 microbatches, against "
     "`transformers`' `model.generate` (KV cache, eager on the CPU, its weights never move) "
     "and fxpipe without a cache (the whole sequence per token), greedy, interleaved rounds "
     "after a warm-up. A virtual device computes on one intra-op thread (every fxpipe worker "
     "does) and copies each stage's weights (and streamed cache) into its memory every "
     "token; transformers computes in place on both cores.",
     _generate_measured),
    ("Generation on GPUs, simulated", "bench_generate.json", "simulated",
     "`fxpipe.simulate` over the Program a decode step runs (every decoder layer a stage, "
     "round-robin over the GPUs; one microbatch, or one per GPU), per layer its FLOPs at the "
     "preset's rate and over the host link its weights, plus its KV cache when the cache "
     "is on the host. The batch is the largest power of two (up to 1024) that fits 90% of a "
     "GPU: with the cache on the host, two layers' weights and caches (the stage and the one "
     "it prefetches); resident, the caches of all the GPU's layers and two layers' weights; "
     "and the activations. The host cache's write-back (the other link direction) is not "
     "timed.", _generate_simulated),
    ("Architectures", "bench_zoo.json", "architectures",
     "`benchmarks/bench_zoo.py`: every transformers causal LM, seq2seq LM, masked LM and image "
     "classifier whose default config shrinks to a tiny model in code (nothing downloaded), one "
     "training step with its own `labels=` loss through `fxpipe.compile` in fp32 and with "
     "`param_dtype=torch.bfloat16`, against eager: fp32 the model itself, bf16 a copy as "
     "`from_pretrained(..., dtype=torch.bfloat16)` holds it (`tests/hf_zoo.py`, `Eager`). "
     "Skipped: what cannot be built tiny, or fails eagerly on the batch.", _zoo),
    ("Capture", "bench_capture.json", "seconds",
     "Capturing a tiny Swin and a tiny Qwen3-Next with every dim symbolic, with the batch dim "
     "symbolic only (what `capture=\"auto\"` uses), and at block granularity, each with the "
     "capture cache emptied first; and a second instance of the same model (a deep copy) "
     "right after the first, which the capture cache serves.", _capture),
    ("Passes", "bench_passes.json", "rows",
     "Partition, costs and lowering (capture excluded) of an MLP-style chain.", _passes),
]


def anchor(title: str) -> str:
    return "".join(c for c in title.lower().replace(" ", "-") if c.isalnum() or c in "-_")


def _section(title: str, file: str, key: str, what: str, render) -> tuple[list[str], bool]:
    data = load(file)
    head = [f"## {title}", "", what, ""]
    if data is None or key not in data:
        return head + [f"Not recorded: no `{key}` in `benchmarks/results/{file}`."], False
    try:
        body = render(data)
    except (KeyError, TypeError, ValueError, IndexError) as e:
        return head + [f"Not rendered: `benchmarks/results/{file}` lacks {e!r} (record it again)."], False
    runs = runs_for(data, key)
    src = [f"From `benchmarks/results/{file}`"]
    for r in runs:
        busy = f"; load average {r['load'][0]} → {r['load'][1]}" if "load" in r else ""
        src.append(f"`{r['command']}` (commit {r['commit']}, {r['date']}; {r['machine']}{busy})")
    if not runs:
        src.append("(no recorded command)")
    return head + body + ["", src[0] + ": " + "; ".join(src[1:]) + "."], True


def benchmarks_md() -> str:
    out = ["# Benchmarks", "",
           "Generated by `python benchmarks/report.py` from the JSON files in "
           "`benchmarks/results/`; do not edit by hand (`report.py --check` runs in CI and "
           "fails when this page differs from the JSON). Record a result with "
           "`python benchmarks/record.py benchmarks/results/NAME.json -- python "
           "benchmarks/bench_NAME.py ...`, then run `report.py`.", "",
           "CPU timings come from a small shared VM (see each table's machine): they are "
           "noisy, so ratios and min/median pairs are given; figures that carry to a GPU "
           "(bytes moved, predicted against measured memory, simulated schedules, host "
           "issue time against a predicted GPU step) are the ones to read first.", ""]
    missing = []
    for title, file, key, what, render in SECTIONS:
        lines, ok = _section(title, file, key, what, render)
        if not ok:
            missing.append((title, file))
        out += lines + [""]
    recorded = {f for _, f, *_ in SECTIONS}
    scripts = sorted(p.stem for p in (ROOT / "benchmarks").glob("bench_*.py"))
    untracked = [s for s in scripts if not any(f.startswith(s) for f in recorded)]
    if untracked:
        out += ["## Without a recorded result", "",
                "These benchmarks have no committed JSON here; run them to measure:", ""]
        out += [f"- `python benchmarks/{s}.py`" for s in untracked] + [""]
    return "\n".join(out).rstrip("\n") + "\n"


# --------------------------------------------------------------------------------- status

# Each capability and its evidence, strongest first: a GPU run (a section of
# gpu_check.json, or one of its finetune runs by mode and stage backend), else a CPU or
# cuda-sim measurement (file, key), else a model (file, key: simulated or predicted).
STATUS: list[tuple[str, Any, tuple[str, str] | None, tuple[str, str] | None]] = [
    ("the CUDA backend's tests (one GPU; those needing two GPUs skip)", "cuda_tests", None, None),
    ("a fused training step, parameters streamed from the host, against eager + checkpointing",
     "vs_checkpoint", ("bench_sim_vs_measured.json", "rows"), None),
    ("prefetch hidden behind compute", "hidden_prefetch", None, ("bench_schedule.json", "models")),
    ("the simulator's step time against a measured step", "predicted_vs_measured",
     ("bench_sim_vs_measured.json", "rows"), None),
    ("a model bigger than the device's memory (bf16, streamed AdamW)", "bigger_than_device",
     ("bench_gpu_memory.json", "bigger"), None),
    ("`weights=`: a frozen base memory-mapped from safetensors", "weights",
     ("bench_big_weights.json", "summary"), None),
    ("two logical devices on one GPU", "scaling", None, None),
    ("`pipe.generate` with a KV cache", "generate", ("bench_generate.json", "measured"), None),
    ("bf16 LoRA fine-tune, Llama-3.1-8B shape, eager stage code", ("lora", None),
     None, ("bench_finetune.json", "predicted")),
    ("bf16 full fine-tune, Qwen3-4B shape, eager stage code", ("full", None),
     None, ("bench_finetune.json", "predicted")),
    ("the longest sequence, Llama-3.1-8B LoRA on one GPU", ("longest", None),
     None, ("bench_memory.json", "longest_sequence_lora")),
    ("`stage_backend=\"inductor\"` training", ("lora", "inductor"),
     ("bench_issue.json", "rows"), None),
    ("`stage_backend=\"cudagraphs\"` training (CUDA graphs), bf16 LoRA fine-tune",
     ("lora", "cudagraphs"), ("bench_issue.json", "rows"), ("bench_host_model.json", "rows")),
    ("`stage_backend=\"cudagraphs\"` (CUDA graphs), eight logical devices", "many_devices",
     ("bench_issue.json", "rows"), ("bench_host_model.json", "rows")),
    ("eight logical devices on one GPU, issued from one host process", "many_devices",
     ("bench_issue.json", "rows"), ("bench_host_model.json", "scaling")),
    ("several GPUs in one pipeline", None, ("bench_memory_cuda_sim.json", "predicted_vs_measured"),
     ("bench_schedule.json", "models")),
    ("data parallel across processes", None, ("bench_distributed.json", "measured"),
     ("bench_distributed.json", "sim")),
    ("`data_parallel=\"device\"`: gradients reduce-scattered on a GPU through NCCL (one rank)",
     "data_parallel", ("bench_distributed.json", "devices"), None),
    ("QLoRA: the frozen base held and streamed in NF4, Llama-3.1-8B shape", ("qlora", None),
     ("bench_quant.json", "rows"), ("bench_finetune.json", "predicted")),
    ("one sequence in token chunks across the GPUs (`sequence_chunks`)", None, None,
     ("bench_long_context.json", "simulated")),
    ("losses and gradients equal to eager on padded batches", None,
     ("bench_exactness.json", "rows"), None),
    ("transformers architectures training through `fxpipe.compile` (fp32, bf16)", None,
     ("bench_zoo.json", "counts"), None),
]


def _run_of(data: dict, key: str) -> dict:
    """The latest recorded run that wrote ``key`` (its command, date, machine), else the
    file's latest run."""
    runs = runs_for(data, key) or data.get("runs", [])
    return runs[-1] if runs else {}


def _torch_of(data: dict, run: dict) -> str:
    found = re.search(r"torch ([\w.+]+)", run.get("machine", "")) or \
        re.search(r"^([\w.+]+)", str(data.get("torch", "")))
    return f"torch {found.group(1)}" if found else "torch not recorded"


def _gpu_where(gpu: dict, key: str) -> str:
    run = _run_of(gpu, key)
    device = gpu["devices"][0].replace("NVIDIA ", "")
    return f"one {device}, {_torch_of(gpu, run)}, {run.get('date', 'undated')}, `gpu_check.json` `{key}`"


def _gpu_evidence(gpu: dict | None, what: Any) -> tuple[bool, str] | None:
    """``(ran, where)`` for a GPU section or finetune run recorded in gpu_check.json, or None."""
    if gpu is None or what is None:
        return None
    if isinstance(what, str):
        section = gpu.get(what)
        if not isinstance(section, dict):
            return None
        return bool(section.get("ok", True)), _gpu_where(gpu, what)
    mode, backend = what
    for i, r in enumerate(gpu.get("finetune", {}).get("runs", [])):
        if r.get("mode") == mode and (r.get("stage_backend") or "eager") == (backend or "eager"):
            key = f"finetune.runs[{i}]"
            where = _gpu_where(gpu, key if runs_for(gpu, key) else "finetune").replace(
                "`finetune`", f"`{key}`")
            return bool(r.get("ok")), where
    return None


def _file_evidence(ref: tuple[str, str] | None) -> str | None:
    if ref is None:
        return None
    data = load(ref[0])
    if data is None or ref[1] not in data:
        return None
    run = _run_of(data, ref[1])
    machine = run.get("machine", "").split(",")[0] or "a CPU"
    return (f"{machine}, {_torch_of(data, run)}, {run.get('date', 'undated')}, "
            f"`{ref[0]}` `{ref[1]}`")


def status_rows() -> list[list[str]]:
    gpu = load("gpu_check.json")
    rows = []
    for what, gpu_ref, cpu_ref, model_ref in STATUS:
        ran = _gpu_evidence(gpu, gpu_ref)
        cpu, model = _file_evidence(cpu_ref), _file_evidence(model_ref)
        if ran and ran[0]:
            status, where = "ran on a GPU", ran[1]
        elif cpu:
            status, where = "CPU / cuda-sim only", cpu
        elif model:
            status, where = "modelled only (simulated or predicted)", model
        else:
            status, where = "not measured", "no recorded result"
        if ran and not ran[0]:
            status += "; failed on a GPU"
            where += f"; the GPU run: {ran[1]}"
        elif not (ran and ran[0]) and (cpu and model):
            where += f"; modelled: {model}"
        rows.append([what, status, where])
    return rows


def status() -> list[str]:
    return [STATUS_BEGIN, "<!-- generated by python benchmarks/report.py from benchmarks/results/*.json -->",
            *table(["capability", "status", "evidence (machine, torch, date, result)"], status_rows()),
            STATUS_END]


# -------------------------------------------------------------------------------- headline

def cpu_on(data: dict, key: str) -> str:
    """Where a CPU figure was measured: "a 2-CPU VM, torch 2.13" from its recorded run."""
    run = _run_of(data, key)
    cpus = re.search(r"(\d+) CPUs", run.get("machine", ""))
    torch_v = _torch_of(data, run)
    return f"{cpus.group(1) + '-CPU' if cpus else 'a CPU'} VM" + \
        ("" if torch_v.endswith("not recorded") else f", {torch_v}")


def headline() -> list[str]:
    """The README's figures: each from a JSON file, or left out when it is missing."""
    rows = []
    gpu = load("gpu_check.json")
    gpu_on = f"one {gpu['devices'][0].replace('NVIDIA ', '')}, {_torch_of(gpu, {})}" if gpu else ""
    if gpu and "vs_checkpoint" in gpu:
        rows.append([f"fused training step on one {gpu['devices'][0].replace('NVIDIA ', '')}, "
                     f"{gpu['vs_checkpoint']['params'] / 1e9:.1f}B parameters streamed from the host "
                     "/ eager + checkpoint holding them on the GPU",
                     f"{gpu['vs_checkpoint']['ratio_min']:.3f}; prefetch "
                     f"{min(v['hidden_fraction'] for v in gpu['hidden_prefetch']['devices'].values()):.0%} "
                     f"hidden; simulated / measured step {gpu['predicted_vs_measured']['predicted_over_measured']:.3f}",
                     gpu_on, "time, fxpipe / eager: lower is better", "gpu-acceptance-check"])
    issue = load("bench_issue.json")
    if issue:
        r = {(x["model"], x["gpus"], x["seq_len"], x.get("stage_backend")): x
             for x in issue["rows"]}
        a, b = r.get(("Llama-3.1-8B", 8, 4096, None)), r.get(("Llama-3.1-8B", 8, 16384, None))
        c = r.get(("Llama-3.1-8B", 8, 4096, "inductor"))
        g = r.get(("Llama-3.1-8B", 8, 4096, "cudagraphs"))
        if a and b:
            compiled = (f"; inductor stage code: {c['kernels_per_layer']:.0f} kernels per layer "
                        f"for {a['kernels_per_layer']:.0f} ops, {c['ratio_modelled']:.2f} at 4K "
                        "(modelled from the kernel count)" if c and "ratio_modelled" in c else "")
            compiled += (f"; cudagraphs {g['ratio']:.2f} at 4K (measured around the graphs, "
                         "their launches modelled)" if g else "")
            rows.append(["host time to issue a training step / predicted H100 step, Llama-3.1-8B on 8 GPUs",
                         f"{a['ratio']:.2f} at 4K tokens, {b['ratio']:.2f} at 16K{compiled}",
                         cpu_on(issue, "rows") + " (host, measured); H100 step predicted", "host / GPU time: below 1 the host keeps up", "host-issue-cost"])
    host = load("bench_host_model.json")
    if host:
        r = {(x["gpus"], x["seq_len"], x["stage_backend"]): x for x in host["rows"]
             if x["model"] == "Llama-3.1-8B"}
        if all((8, 4096, b) in r for b in ("eager", "inductor", "cudagraphs")):
            c = host["calibration"]
            rows.append(["SIMULATED with the host fitted to the H200 run: host issue / GPU step, "
                         "Llama-3.1-8B on 8 H100s at 4K tokens (the row above issues to tiny CPU "
                         "ops; a GPU's host pays "
                         f"{c['host_us_per_kernel']:.1f}–{c['host_us_per_grad_kernel']:.1f} µs per "
                         f"kernel launch and {c['host_us_per_action']:.0f} µs per action, as fitted: "
                         "this row is the one for GPUs)",
                         ", ".join(f"{b} {r[(8, 4096, b)]['host_over_gpu']:.2f}"
                                   for b in ("eager", "inductor")) +
                         f", cudagraphs {r[(8, 4096, 'cudagraphs')]['host_over_gpu']:.2f} (modelled)",
                         "simulated (the H200 host's costs per action and kernel launch, fitted)", "host / GPU time: below 1 the host keeps up", "the-host-in-the-simulator-calibrated-on-the-h200"])
        if "scaling" in host and all((1, 4096, b) in r for b in ("eager", "inductor", "cudagraphs")):
            sc = {s["stage_backend"]: s for s in host["scaling"]
                  if (s["model"], s["gpus"], s["seq_len"]) == ("Llama-3.1-8B", 8, 4096)}
            f = host["refit"]["figures"]
            rows.append(["SIMULATED: Llama-3.1-8B on 8 H100s at 4K: host issue / GPU step per "
                         "backend, 8-GPU / 1-GPU throughput (tokens/s), the H200 host refitted "
                         "to today's code by CPU ratios (`H200_HOST_REFIT`: "
                         f"{f['host_us_per_kernel']:.1f}–{f['host_us_per_grad_kernel']:.1f} µs per "
                         f"kernel, {f['host_us_per_action']:.0f} µs per action; a projection, not "
                         "a GPU measurement)",
                         f"host / GPU eager {r[(8, 4096, 'eager')]['host_over_gpu_refit']:.2f} "
                         "(at eager PyTorch's own dispatch: "
                         f"{r[(8, 4096, 'eager')]['dispatch_floor_host_over_gpu_refit']:.2f}), "
                         f"inductor {r[(8, 4096, 'inductor')]['host_over_gpu_refit']:.3f}, "
                         f"cudagraphs {r[(8, 4096, 'cudagraphs')]['host_over_gpu_refit']:.3f} "
                         "(modelled); 8-GPU / 1-GPU " + ", ".join(
                             f"{b} {sc[b]['refit']:.2f}×" for b in ("eager", "inductor", "cudagraphs"))
                         + f" (the GPUs alone {sc['eager']['gpu_only']:.2f}×)",
                         "simulated (the H200 host's fitted costs scaled by CPU ratios)",
                         "host / GPU time: below 1 the host keeps up; throughput ratio: 8 is linear",
                         "the-host-in-the-simulator-calibrated-on-the-h200"])
            t8 = host.get("threads8")
            if t8 and all("host_over_gpu_threads8" in r[(8, 4096, b)] for b in sc):
                rows.append(["SIMULATED with the host MEASURED issuing for eight devices "
                             "(eight logical devices on one H200: "
                             f"{t8['host_us_per_kernel']:.1f}–{t8['host_us_per_grad_kernel']:.1f} "
                             f"µs per kernel, {t8['host_us_per_action']:.0f} µs per action): "
                             "Llama-3.1-8B on 8 H100s at 4K, host issue / GPU step per backend, "
                             "8-GPU / 1-GPU throughput",
                             "host / GPU " + ", ".join(
                                 f"{b} {r[(8, 4096, b)]['host_over_gpu_threads8']:.2f}"
                                 for b in ("eager", "inductor", "cudagraphs"))
                             + " (cudagraphs modelled); 8-GPU / 1-GPU " + ", ".join(
                                 f"{b} {sc[b]['threads8']:.2f}×"
                                 for b in ("eager", "inductor", "cudagraphs")),
                             "simulated (host costs measured on one H200, eight issue threads)",
                             "host / GPU time: below 1 the host keeps up; throughput ratio: 8 is "
                             "linear", "the-host-in-the-simulator-calibrated-on-the-h200"])
    sched = load("bench_schedule.json")
    if sched:
        ratios = [m["makespan_ratio"] for m in sched["models"].values()]
        rows.append([f"simulated makespan against RoundPipe's published schedules ({len(ratios)} models, 8 GPUs)",
                     f"{span(ratios, 3)}× (exact optimizer semantics)", "simulated", "time, fxpipe / RoundPipe: lower is better", "schedules"])
    opt = load("bench_optimizer.json")
    if opt and "sim" in opt and "measured" in opt["sim"]["by_rate"]:
        rel = [m["relative_throughput"] for m in opt["sim"]["by_rate"]["measured"]["models"].values()]
        rows.append(["simulated step throughput with a host AdamW, exact streamed step / RoundPipe's sync step",
                     f"{span([r['fxpipe_exact'] for r in rel])}× (RoundPipe's stale step: "
                     f"{span([r['roundpipe_async'] for r in rel])}×)", "simulated", "throughput: higher is better", "host-optimizer-in-the-simulator"])
    mem = load("bench_memory.json")
    if mem and "predicted_vs_measured" in mem:
        errs = [r["predicted_total"] / r["measured"]["total"] - 1 for r in mem["predicted_vs_measured"]]
        rows.append([f"predicted device memory peak against a replay of the run ({len(errs)} device peaks, 3 models)",
                     f"{pct(min(errs))} to {pct(max(errs))}", cpu_on(mem, "predicted_vs_measured") + " (virtual devices)", "error: nearer 0 is better", "device-memory"])
    cs = load("bench_memory_cuda_sim.json")
    if cs and "predicted_vs_measured" in cs:
        rr = [r["measured"]["reserved"] / r["predicted_total"] for r in cs["predicted_vs_measured"]]
        rows.append(["reserved by a GPU-like caching allocator / predicted peak",
                     f"{span(rr)}", cpu_on(cs, "predicted_vs_measured") + " (cuda-sim)", "about 1: the prediction holds", "device-memory-reserved-by-a-gpu-like-allocator"])
    gm = load("bench_gpu_memory.json")
    if gm:
        b = gm["bigger"]
        rows.append([f"a model whose parameters are {b['params_over_limit']:.0f}× one device's memory: "
                     "reserved / limit", f"{' and '.join(num(x) for x in b['reserved_over_limit'])}, "
                     f"loss within {b['max_loss_diff']:.1e} of eager", cpu_on(gm, "bigger") + " (cuda-sim)", "below 1: within the limit", "gpu-allocator-emulation"])
    if mem and "longest_sequence" in mem:
        for r in mem["longest_sequence"]:
            if r["model"] == "Llama-3.1-8B" and r.get("hf_labels_tokens"):
                rows.append([f"longest trainable sequence, transformers' Llama-3.1-8B with `labels=`, "
                             f"8 x {r['device_gib']} GiB (predicted)",
                             f"{r['hf_labels_tokens'] // 1024}K tokens (RoundPipe: {r['roundpipe_k']}K)",
                             "predicted", "higher is better", "longest-sequence"])
        for r in mem.get("longest_sequence_lora", []):
            if r["host_gib"] is not None:
                rows.append([f"longest sequence, transformers' Llama-3.1-8B, LoRA, 1 x {r['device_gib']} GiB, "
                             f"host <= {r['host_gib']} GiB (predicted)",
                             f"{r['hf_labels_tokens'] // 1024}K tokens (Unsloth: {r['unsloth_k']}K)",
                             "predicted", "higher is better", "longest-sequence"])
    lc = load("bench_long_context.json")
    for r in (lc or {}).get("planned", []):
        if r["model"] == "Llama-3.1-8B" and r["mode"] == "full" and r["devices"] == 8 \
                and r["device_gib"] == 80:
            rows.append(["PREDICTED: longest sequence in token chunks (`sequence_chunks`), "
                         "transformers' Llama-3.1-8B with `labels=`, 8 x 80 GiB",
                         f"{r['chunked_tokens'] / 2**20:.1f}M tokens, {r['sequence_chunks']:,} "
                         f"chunks, host {r['host_bytes'] / 2**30:,.0f} GiB ({r['anchor']}; "
                         f"whole sequences {r['whole_tokens'] // 1024}K)", "predicted",
                         "higher is better", "one-sequence-in-chunks-the-longest"])
    sims = (lc or {}).get("simulated", [])
    if len(sims) > 1:
        rows.append(["SIMULATED: one 256K-token sequence, Llama-3.1-8B, 8 H100s / one H100, "
                     "tokens/s", f"{sims[-1]['tokens_per_s'] / sims[0]['tokens_per_s']:.2f}x "
                     f"({sims[-1]['tokens_per_s']:,.0f} / {sims[0]['tokens_per_s']:,.0f})",
                     "simulated", "higher is better (8: linear)",
                     "one-sequence-in-chunks-throughput"])
    dist = load("bench_distributed.json")
    if dist and "sim" in dist:
        nets = dist["sim"]["networks"]
        for net in nets:
            effs = [m["16"]["efficiency"] for m in nets[net]["models"].values() if "16" in m]
            rows.append([f"simulated data-parallel efficiency on 16 nodes, {net}", span(effs), "simulated", "higher is better (1: linear)", "data-parallel"])
    if dist and "nccl" in dist:
        a = dist["nccl"]["acceptance"]
        free = dist["nccl"]["rates"].get("free", {}).get("modes")
        both = f"; host optimizer free: {free['device-NCCL']['2']['speedup']:.2f}× / " \
            f"{free['host-gloo']['2']['speedup']:.2f}×" if free else ""
        rows.append(["SIMULATED: Llama-3.1-8B full fine-tune, 2 nodes × 8 H100 / one node, "
                     "tokens/s, device collectives / host-gloo",
                     f"{a['device_speedup']:.2f}× / {a['host_gloo_speedup']:.2f}×{both}",
                     "simulated", "higher is better (2: linear)",
                     "data-parallel-on-the-devices-simulated"])
    if dist and "devices" in dist:
        v = dist["devices"]
        rows.append(["`data_parallel=\"device\"`: gradient bytes each rank downloads / "
                     "host-gloo's, 2 and 4 ranks (fp32, bf16)",
                     " / ".join(num(v[w][f"{t} device"]["grads_down_over_host"])
                                for w in ("2", "4") for t in ("fp32", "bf16")),
                     "measured (bytes counted)", "lower is better (1/N)",
                     "data-parallel-on-the-devices-measured"])
        two = v.get("2", {})
        acc, own = two.get("fp32 device, accumulate 2"), two.get("fp32 device, opt.step()")
        if acc and own and "host_collective_bytes" in acc:
            host_acc = two["fp32 host-gloo sharded, accumulate 2"]["host_collective_bytes"]
            host_own = two["fp32 host-gloo, opt.step()"]["host_collective_bytes"]
            rows.append(["`data_parallel=\"device\"`: bytes into gloo per step / host-gloo's, 2 "
                         "ranks fp32: after a `no_sync()` call (`sRS+`), a call then "
                         "`opt.step()` (`sAR`)",
                         f"{acc['host_collective_bytes'] / host_acc:.2f} / "
                         f"{own['host_collective_bytes'] / host_own:.2f}",
                         "measured (bytes counted)", "lower is better (no gradient on gloo)",
                         "data-parallel-on-the-devices-measured"])
        if all("fp32 zero3" in v[w] for w in ("2", "4")):
            rows.append(["`data_parallel=\"zero3\"`: parameter bytes each rank uploads / "
                         "`\"device\"`'s, and host parameter bytes per rank / `\"device\"`'s, "
                         "2 and 4 ranks fp32",
                         " / ".join(f"{v[w]['fp32 zero3'][k] / v[w]['fp32 device'][k]:.2f}"
                                    for k in ("h2d_bytes_params", "host_param_bytes")
                                    for w in ("2", "4")),
                         "measured (bytes counted)", "lower is better (1/N)",
                         "data-parallel-on-the-devices-measured"])
    peft = load("bench_peft.json")
    if peft and "lora_over_full" in peft:
        rows.append(["LoRA: gradient bytes downloaded per step / full training",
                     f"{peft['lora_over_full']['d2h_bytes_grads']:.4f}", cpu_on(peft, "lora_over_full") + " (bytes counted)", "lower is better", "peft-lora"])
    quant_d = load("bench_quant.json")
    if quant_d:
        q = {r["variant"]: r for r in quant_d["rows"]}
        if "bf16" in q and "nf4" in q and q["bf16"]["layers"] == 32:
            rows.append(["QLoRA, Llama-3.1-8B shape, LoRA r=16: an NF4 frozen base (embeddings and "
                         "head bf16) / bf16, host parameter bytes; parameter bytes uploaded per step",
                         f"{1 / q['nf4']['host_cut']:.2f}; {1 / q['nf4']['h2d_cut']:.2f} "
                         f"({q['nf4']['bytes_per_quantized_weight']:.4f} bytes per quantized weight)",
                         cpu_on(quant_d, "rows") + " (bytes counted)", "lower is better",
                         "quantized-frozen-weights"])
    ft = load("bench_finetune.json")
    if ft and (ft.get("predicted") or {}).get("qlora"):
        by = {(r["mode"], r["model"], r["gpus"], r["seq"]): r for r in ft["predicted"]["qlora"]}
        r, b = by.get(("qlora", "Llama-3.1-70B", 1, 4096)), by.get(("lora", "Llama-3.1-70B", 1, 4096))
        if r and b:
            rows.append(["PREDICTED: Llama-3.1-70B LoRA, NF4 base, one 24 GiB GPU (PCIe 4.0), "
                         "8 × 4,096 tokens/step: host bytes the plan keeps; longest sequence "
                         "with host ≤ 64 GiB",
                         f"{r['predicted_host_bytes'] / 2**30:.1f} GiB (bf16 base: "
                         f"{b['predicted_host_bytes'] / 2**30:.1f} GiB); "
                         + (f"{r['longest'] // 1024}K tokens" if r["longest"] else "none fits"),
                         "predicted", "lower host bytes, longer sequence are better",
                         "fine-tuning-in-bf16"])
    if ft and ft.get("predicted"):
        by = {(r["mode"], r["host_work"], r.get("stage_backend", "eager")): r
              for r in ft["predicted"]["rows"] if r.get("recompute", "auto") == "auto"}
        for mode, what in (("lora", "LoRA r=16, Llama-3.1-8B shape"),
                           ("full", "full fine-tune, Qwen3-4B shape, fp32 masters")):
            free = by.get((mode, "free", "eager"))
            mine = [(b, by.get((mode, "this machine", b))) for b in ("eager", "inductor", "cudagraphs")]
            mine = [(b, r) for b, r in mine if r]
            if free and mine:
                per = ", ".join(f"{b}{' (modelled)' if r.get('modelled') else ''} "
                                f"{r['tokens_per_s']:,.0f} (MFU {r['model_tflops'] / 989.4:.0%})"
                                for b, r in mine)
                issued = " issuing at the H200's fitted cost" if mine[0][1].get("host_issue_fit") else ""
                rows.append([f"PREDICTED, one {free['gpu']}: bf16 {what}, 16 × 4,096 tokens/step "
                             f"(host AdamW at this 2-core machine's rate{issued}, per stage "
                             "backend; a free host)",
                             f"{per}; free host {free['tokens_per_s']:,.0f} tokens/s "
                             f"(MFU {free['model_tflops'] / 989.4:.0%})"
                             + (f"; hardware / model FLOPs {free['flops_ratio']:.2f}"
                                if "flops_ratio" in free else ""),
                             "predicted", "throughput: higher is better", "fine-tuning-in-bf16"])
    by_mode: dict[str, list[dict]] = {}
    for r in (gpu or {}).get("finetune", {}).get("runs", []):
        if r.get("ok") and r.get("eager", {}).get("ran"):
            by_mode.setdefault(r["mode"], []).append(r)
    for mode, runs in by_mode.items():
        r = runs[0]
        rows.append([f"measured on one {gpu['devices'][0].replace('NVIDIA ', '')}: fxpipe bf16 "
                     f"{mode}, {r['model']} shape, {r['microbatches']} × {r['seq']:,} "
                     "tokens/step, parameters streamed from the host, per stage backend: "
                     "tokens/s (MFU; throughput over eager transformers + checkpointing "
                     "holding them, timed in the same run)",
                     "; ".join(f"{x.get('stage_backend') or 'eager'} {x['tokens_per_s']:,.0f} "
                               f"({x['mfu']:.1%}; {x['eager']['step_s'] / x['step_s']:.2f}×)"
                               for x in runs), gpu_on,
                     "throughput, fxpipe / eager: higher is better", "gpu-acceptance-check"])
    prec = load("bench_precision.json")
    if prec and "over_fp32" in prec:
        o = prec["over_fp32"]["param_dtype"]
        rows.append(["`param_dtype=torch.bfloat16` / fp32: parameter bytes uploaded per step, "
                     "device peak (predicted, measured)", f"{o['h2d_bytes_params']:.2f}; "
                     f"{o['predicted_peak_bytes']:.2f}, {o['measured_peak_bytes']:.2f}",
                     cpu_on(prec, "over_fp32") + " (virtual devices)", "lower is better", "mixed-precision"])
    gen = load("bench_generate.json")
    if gen and "measured" in gen:
        measured = gen["measured"]["rows"]
        host, device = measured["pipe.generate kv=host mb=1"], measured["pipe.generate kv=device mb=1"]
        uncached = measured["fxpipe without a cache"]
        same = all(r["same_tokens"] for r in measured.values())
        rows.append(["`pipe.generate` (KV cache) tokens/s on 2 virtual CPU devices / transformers' "
                     "`generate` with its weights in place", f"{host['over_transformers_median']:.2f} "
                     f"(cache on the host), {device['over_transformers_median']:.2f} (resident)"
                     f"{'; same tokens' if same else '; TOKENS DIFFER'}; "
                     f"{host['tokens_per_s_median'] / uncached['tokens_per_s_median']:.1f}× "
                     "fxpipe without a cache", cpu_on(gen, "measured") + " (virtual devices)", "throughput, fxpipe / transformers: higher is better", "generation"])
    big = load("bench_big_weights.json")
    if big and "summary" in big:
        w, f = big["summary"]["weights"], big["summary"]["from_pretrained"]
        rows.append(["anonymous memory growth training a LoRA on a frozen base / its bytes, "
                     "loaded with `weights=`", f"{max(w['anon_growth_over_frozen']):.2f} "
                     f"(`from_pretrained`: {max(f['anon_growth_over_frozen']):.2f})",
                     cpu_on(big, "summary"), "lower is better", "weights-bigger-than-host-ram"])
    out = table(["", "figure", "measured on", "how to read it", "details"],
                [[w, f, on, reads, f"[benchmarks](docs/benchmarks.md#{a})"]
                 for w, f, on, reads, a in rows])
    return [BEGIN, "<!-- generated by python benchmarks/report.py from benchmarks/results/*.json -->",
            *out, END]


def with_block(text: str, name: str, begin: str, end: str, lines: list[str]) -> str:
    """``text`` with its generated block from ``begin`` to ``end`` replaced by ``lines``."""
    if begin not in text or end not in text:
        raise SystemExit(f"{name} has no {begin} ... {end} block")
    pre, rest = text.split(begin, 1)
    _, post = rest.split(end, 1)
    return pre + "\n".join(lines) + post


def readme_with_headline(text: str) -> str:
    return with_block(text, "README.md", BEGIN, END, headline())


# ------------------------------------------------------------------------------------ main

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true",
                    help="regenerate in memory; exit 1 with a diff if a file differs")
    args = ap.parse_args(argv)
    want = {DOC: benchmarks_md(), README: readme_with_headline(README.read_text()),
            GUARANTEES: with_block(GUARANTEES.read_text(), "docs/guarantees.md", STATUS_BEGIN,
                                   STATUS_END, status())}
    if not args.check:
        for path, text in want.items():
            path.write_text(text)
            print(f"wrote {path.relative_to(ROOT)}")
        return 0
    bad = 0
    for path, text in want.items():
        have = path.read_text() if path.exists() else ""
        if have != text:
            bad += 1
            sys.stdout.writelines(difflib.unified_diff(
                have.splitlines(True), text.splitlines(True),
                f"{path.relative_to(ROOT)} (committed)", f"{path.relative_to(ROOT)} (from the JSON)"))
    if bad:
        print(f"\nreport --check: {bad} file(s) differ from benchmarks/results/*.json; "
              "run `python benchmarks/report.py` and commit the result", file=sys.stderr)
        return 1
    print("report --check: docs/benchmarks.md, README.md's figures and docs/guarantees.md's status "
          "match benchmarks/results/*.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
