"""What a GPU's memory would hold (issue 25), on virtual devices with a GPU's semantics.

    .venv/bin/python benchmarks/bench_gpu_memory.py        # ~30 s on 2 cores

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

Writes ``benchmarks/results/bench_gpu_memory.json``.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

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


def main() -> int:
    torch.set_num_threads(1)
    result = {"torch": torch.__version__, "chain": chain(), "bigger": bigger(),
              "pinned": pinned()}
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
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=1))
    print(f"\nwrote {OUT}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
