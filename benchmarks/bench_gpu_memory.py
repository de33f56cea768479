"""What a GPU's memory would hold (issue 25), on virtual devices with a GPU's semantics.

    .venv/bin/python benchmarks/bench_gpu_memory.py        # ~80 s on 2 cores

Every row trains on two ``VirtualDevice(semantics="cuda")``: memory allocated and freed
when the host issues, reused by stream as torch's CUDA caching allocator does,
``peak_reserved_bytes()`` what that allocator holds (in use plus kept for reuse). Figures
that carry over to a GPU: bytes, not seconds.

(chain) An 8-block MLP chain (d = 128), 4 microbatches, 3 AdamW steps, no memory limit:
    each device's peak allocated and peak reserved over ``fxpipe.plan.predict_memory``
    (target: reserved <= 1.3x), allocator flushes, issue waits.
(bigger) 24 blocks whose parameters are 3x one device's ``memory_limit``, 4 microbatches,
    4 AdamW steps: peak reserved over the limit (must stay <= 1), allocator flushes after
    the first step (target: 0), the loss against eager PyTorch's.
(pinned) The chain's fused step with ``pin_memory=True`` and ``False``, fp32 and
    ``param_dtype=torch.bfloat16``: ``host_pinned_bytes`` over the bytes the pinned
    buffers hold (parameters, gradients, upload copies, the staging blocks of inputs and
    labels; target <= 1.05: rounding only) and ``host_stalls`` (copies a GPU would block the issuing thread
    on; target 0 when pinned).
(graphs) Under ``RunConfig(stage_backend="cudagraphs")`` a device keeps its parameter slots,
    its graphs' inputs and outputs and their pool past every job (``predict_memory``
    counts them). The same 8-block chain (d = 64, 4 x 32 tokens, 2 microbatches) on two
    strict cuda-sim devices of a sweep of limits, compile's plan made blind to the graphs
    (the planner before, ``fxpipe.plan._graphed`` patched) and as now (planned again until
    the whole plan fits, ``plan._room_for_graphs``): the plan, its predicted peak against
    the budget (90% of the limit), what two fused steps did (ran: the most a device
    reserved, the loss against eager's; or out of memory), the planning time. Then
    Llama-3.1-8B (bf16, ``bench_issue.py``'s model on ``meta``, 16 microbatches) on one and
    on eight 80 GiB devices: the plans and their predictions only (nothing runs).

Writes ``benchmarks/results/bench_gpu_memory.json``.
"""

from __future__ import annotations

import contextlib
import copy
import json
import sys
import time
from pathlib import Path
from unittest import mock

import torch
import torch.nn as nn
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import fxpipe  # noqa: E402
from fxpipe.runtime.devices.emulator import VirtualDevice  # noqa: E402
from tests.models import MLPBlock  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "bench_gpu_memory.json"


def devices(n: int = 2, **kw) -> list[VirtualDevice]:
    return [VirtualDevice(semantics="cuda", **kw) for _ in range(n)]


def chain() -> list[dict]:
    torch.manual_seed(0)
    model = nn.Sequential(*[MLPBlock(128) for _ in range(8)])
    x, y = torch.randn(16, 64, 128), torch.randn(16, 64, 128)
    devs = devices()
    pipe = fxpipe.compile(model, example_inputs=(x,), devices=devs,
                          config=fxpipe.RunConfig(num_microbatch=4))
    opt = torch.optim.AdamW(model.parameters())
    flushes = waits = 0
    for _ in range(3):
        pipe.forward_backward((x,), label=y, loss_fn=F.mse_loss)
        flushes += pipe.stats()["allocator_flushes"]
        waits += pipe.stats()["issue_waits"]
        opt.step()
        opt.zero_grad()
    pred = fxpipe.plan.predict_memory(pipe, loss_fn=F.mse_loss, label=y)
    rows = [{"device": i, "predicted": pred.devices[i].total, "allocated": d.peak_bytes(),
             "reserved": d.peak_reserved_bytes(),
             "reserved_over_predicted": d.peak_reserved_bytes() / pred.devices[i].total,
             "allocated_over_predicted": d.peak_bytes() / pred.devices[i].total}
            for i, d in enumerate(devs)]
    for r in rows:
        r.update(allocator_flushes=flushes, issue_waits=waits)
    pipe.close()
    return rows


def bigger() -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(*[MLPBlock(64) for _ in range(24)])
    ref = copy.deepcopy(model)
    limit = sum(p.numel() * p.element_size() for p in model.parameters()) // 3
    x, y = torch.randn(8, 16, 64), torch.randn(8, 16, 64)
    devs = devices(memory_limit=limit)
    pipe = fxpipe.compile(model, example_inputs=(x,), devices=devs,
                          config=fxpipe.RunConfig(num_microbatch=4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    losses, ref_losses, flushes = [], [], []
    for _ in range(4):
        losses.append(pipe.forward_backward((x,), label=y, loss_fn=F.mse_loss).item())
        flushes.append(pipe.stats()["allocator_flushes"])
        loss = F.mse_loss(ref(x), y)
        loss.backward()
        ref_losses.append(loss.item())
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    out = {"limit": limit, "params_over_limit": 3 * limit / limit,
           "reserved_over_limit": [d.peak_reserved_bytes() / limit for d in devs],
           "allocated_over_limit": [d.peak_bytes() / limit for d in devs],
           "stages": len(pipe.plan.fwd_plan) + len(pipe.plan.bwd_plan),
           "allocator_flushes_per_step": flushes, "losses": losses, "eager_losses": ref_losses,
           "max_loss_diff": max(abs(a - b) for a, b in zip(losses, ref_losses))}
    pipe.close()
    return out


def pinned() -> list[dict]:
    rows = []
    for dtype in (None, torch.bfloat16):
        for pin in (True, False):
            torch.manual_seed(0)
            model = nn.Sequential(*[MLPBlock(128) for _ in range(8)])
            x, y = torch.randn(16, 64, 128), torch.randn(16, 64, 128)
            pipe = fxpipe.compile(model, example_inputs=(x,), devices=devices(),
                                  pin_memory=pin, param_dtype=dtype,
                                  config=fxpipe.RunConfig(num_microbatch=4))
            pipe.forward_backward((x,), label=y, loss_fn=F.mse_loss)
            stats = pipe.stats()
            host = pipe._current.runners[next(iter(pipe._current.runners))].host()
            staged = pipe._staging._blocks if pipe._staging is not None else []
            held = sum(t.numel() * t.element_size()       # what the pinned buffers hold:
                       for t in (*host.flats, *host.grad_flats, *host._copies.values())
                       ) + sum(nbytes for _, _, nbytes in staged)   # + staging blocks
            rows.append({"param_dtype": str(dtype).replace("torch.", "") if dtype else "fp32",
                         "pin_memory": pin, "host_pinned_bytes": stats["host_pinned_bytes"],
                         "bytes_held": held,
                         "pinned_over_held": stats["host_pinned_bytes"] / held,
                         "host_stalls": stats["host_stalls"]})
            pipe.close()
    return rows


def _planned(model, example: tuple, devs: list, blind: bool, **config):
    """``fxpipe.compile``'s pipe under cudagraphs, planned blind to the graphs or as now,
    and the seconds compile took (None: ``PlanError``)."""
    with mock.patch.object(fxpipe.plan, "_graphed", lambda pipe: False) if blind \
            else contextlib.nullcontext():
        start = time.perf_counter()
        try:
            pipe = fxpipe.compile(model, example_inputs=example, devices=devs,
                                  config=fxpipe.RunConfig(stage_backend="cudagraphs", **config))
        except fxpipe.PlanError:
            return None, time.perf_counter() - start
        return pipe, time.perf_counter() - start


PLANNERS = {True: "blind to the graphs (before)", False: "with room for them (now)"}


def graphs() -> dict:
    from fxpipe.passes import chain_costs
    chain_costs.HOST_MS_PER_ACTION = 0.05   # the planner's default (tests run with 0)
    x, y = torch.randn(4, 32, 64), torch.randn(4, 32, 64)
    torch.manual_seed(0)
    model = nn.Sequential(*[MLPBlock(64) for _ in range(8)])
    eager_loss = F.mse_loss(model(x), y).item()
    _planned(copy.deepcopy(model), (x,), devices(), False, num_microbatch=2)   # warm-up
    rows = []
    for kib in (1024, 1536, 2048, 3072):
        for blind in (True, False):
            devs = devices(memory_limit=kib * 1024, strict=True)
            pipe, seconds = _planned(copy.deepcopy(model), (x,), devs, blind, num_microbatch=2)
            row = {"limit": kib * 1024, "planner": PLANNERS[blind], "plan_s": seconds,
                   "budget": int(fxpipe.plan.MEMORY_FRACTION * kib * 1024)}
            rows.append(row)
            if pipe is None:
                row["outcome"] = "PlanError"
                continue
            row.update(plan=repr(pipe.plan), predicted=fxpipe.plan.predict_memory(
                pipe, run_type="fused", num_microbatch=2, loss_fn=F.mse_loss, label=y).peak)
            try:
                losses = [pipe.forward_backward((x,), label=y, loss_fn=F.mse_loss).item()
                          for _ in range(2)]   # the first captures, the second replays
                row.update(outcome="ran", reserved=max(d.peak_reserved_bytes() for d in devs),
                           loss_diff=max(abs(v - eager_loss) for v in losses))
            except fxpipe.DeviceMemoryError:
                row["outcome"] = "out of memory"
            pipe.close()
    return {"chain": rows, "llama": llama_graphs()}


def llama_graphs() -> list[dict]:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_issue import MODELS, CausalLM, config
    from fxpipe.runtime.devices.emulator import InlineDevice
    c, qk_norm = config(MODELS["Llama-3.1-8B"])
    with torch.device("meta"):
        model = CausalLM(c, qk_norm, chunked=True).to(torch.bfloat16)
    rows = []
    for gpus, seq in ((1, 16384), (8, 4096)):
        ids = torch.zeros(1, seq, dtype=torch.long, device="meta")
        for blind in (True, False):
            devs = [InlineDevice(memory_limit=80 * 2**30) for _ in range(gpus)]
            pipe, seconds = _planned(model, (ids, ids), devs, blind, num_microbatch=16)
            row = {"gpus": gpus, "seq_len": seq, "limit": 80 * 2**30, "planner": PLANNERS[blind],
                   "budget": int(fxpipe.plan.MEMORY_FRACTION * 80 * 2**30), "plan_s": seconds}
            if pipe is not None:
                row.update(plan=repr(pipe.plan),
                           predicted=fxpipe.plan.predict_memory(pipe, num_microbatch=16).peak)
                pipe.close()
            rows.append(row)
    return rows


def main() -> int:
    torch.set_num_threads(1)
    result = {"torch": torch.__version__, "chain": chain(), "bigger": bigger(),
              "pinned": pinned(), "graphs": graphs()}
    print("(chain) 8 x MLPBlock(128), 4 microbatches, 3 AdamW steps, 2 cuda-sim devices")
    print(f"{'device':>6} {'predicted':>10} {'allocated':>10} {'reserved':>10} {'res/pred':>9}"
          f" {'flushes':>8} {'issue waits':>12}")
    for r in result["chain"]:
        print(f"{r['device']:>6} {r['predicted']:>10,} {r['allocated']:>10,} {r['reserved']:>10,}"
              f" {r['reserved_over_predicted']:>9.2f} {r['allocator_flushes']:>8}"
              f" {r['issue_waits']:>12}")
    b = result["bigger"]
    print(f"\n(bigger) 24 x MLPBlock(64), parameters 3x a device's limit ({b['limit']:,} B), "
          f"{b['stages']} stages")
    print(f"  reserved / limit {['%.2f' % v for v in b['reserved_over_limit']]}, allocated / "
          f"limit {['%.2f' % v for v in b['allocated_over_limit']]}, flushes per step "
          f"{b['allocator_flushes_per_step']}, max |loss - eager| {b['max_loss_diff']:.2e}")
    print("\n(pinned) the chain's fused step")
    print(f"{'dtype':>6} {'pin':>6} {'pinned B':>12} {'held B':>12} {'ratio':>7} {'stalls':>7}")
    for r in result["pinned"]:
        print(f"{r['param_dtype']:>6} {str(r['pin_memory']):>6} {r['host_pinned_bytes']:>12,}"
              f" {r['bytes_held']:>12,} {r['pinned_over_held']:>7.3f} {r['host_stalls']:>7}")
    print("\n(graphs) 8 x MLPBlock(64) under cudagraphs, 2 strict cuda-sim devices")
    print(f"{'limit':>9} {'planner':>29} {'predicted':>10} {'budget':>10} {'outcome':>14}"
          f" {'reserved':>10} {'plan s':>7}  plan")
    for r in result["graphs"]["chain"]:
        print(f"{r['limit']:>9,} {r['planner']:>29} {r.get('predicted', 0):>10,} {r['budget']:>10,}"
              f" {r['outcome']:>14} {r.get('reserved', 0):>10,} {r['plan_s']:>7.2f}  {r.get('plan', '')}")
    print("\n(graphs) Llama-3.1-8B, bf16, 16 microbatches, 80 GiB devices (predicted)")
    for r in result["graphs"]["llama"]:
        print(f"  {r['gpus']} GPU(s) {r['seq_len']:>6} tokens, {r['planner']:>29}: "
              + (f"{r['predicted'] / 2**30:.1f} GiB of {r['budget'] / 2**30:.1f}, {r['plan']}"
                 if "plan" in r else "PlanError") + f" ({r['plan_s']:.1f} s)")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=1))
    print(f"\nwrote {OUT}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
