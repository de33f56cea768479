"""The kit's sections that time the fused training step: ``vs_checkpoint`` (against eager
PyTorch with ``torch.utils.checkpoint`` per block, on one device) and ``scaling`` (on
1 .. N devices; with one GPU, also on two logical devices over it)."""

from __future__ import annotations

import copy
import statistics
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

import fxpipe
from fxpipe.check.common import (build_model, call_path, devices, loss_fn, model_and_batch,
                                 say, settle, sync_fn, timed, unsampled)
from fxpipe.check.harness import Kit
from fxpipe.demo import rotary_tables


def vs_checkpoint(kit: Kit) -> dict[str, Any]:
    """The fused step on one device against eager with ``torch.utils.checkpoint`` per
    block (the whole model resident on that one GPU). Repeats interleave the two; before
    each variant's warm-up + timed call the allocator is cleaned up (``settle``)."""
    shape, dry_run = kit.shape, kit.dry_run
    model, ids, target = model_and_batch(shape)
    pipe = fxpipe.compile(model, example_inputs=(ids,), devices=devices(1, dry_run))
    try:
        return _vs_checkpoint(kit, pipe, model, ids, target)
    finally:      # also when the section's alarm cuts it off
        pipe.close()


def _vs_checkpoint(kit: Kit, pipe, model, ids, target) -> dict[str, Any]:
    shape, dry_run = kit.shape, kit.dry_run
    where = "cpu" if dry_run else "cuda:0"
    eager = build_model(shape).to(where)
    eager.load_state_dict(model.state_dict())
    e_ids, e_target = ids.to(where), target.to(where)

    def eager_step():
        x = eager.embed(e_ids)
        cos, sin = rotary_tables(e_ids.shape[1], eager.head_dim, e_ids.device, x.dtype)
        for layer in eager.layers:
            x = checkpoint(layer, x, cos, sin, use_reentrant=False)
        loss_fn(eager.lm_head(eager.norm(x)), e_target).backward()
        eager.zero_grad(set_to_none=True)

    def fxpipe_step():
        pipe.forward_backward((ids,), label=target, loss_fn=loss_fn)
        model.zero_grad(set_to_none=True)

    sync = sync_fn(dry_run)
    ratios, times = [], {"fxpipe": [], "eager_checkpoint": []}
    with unsampled(pipe) as sampling:
        for _ in range(kit.repeats):      # interleaved: drift hits both alike
            settle(dry_run)
            f = timed(fxpipe_step, 1, 1, sync)[0]
            settle(dry_run)
            e = timed(eager_step, 1, 1, sync)[0]
            times["fxpipe"].append(f)
            times["eager_checkpoint"].append(e)
            ratios.append(f / e)
    path = call_path(pipe)
    return {"fxpipe_s": min(times["fxpipe"]), "eager_checkpoint_s": min(times["eager_checkpoint"]),
            "ratio_min": min(ratios), "ratio_median": statistics.median(ratios),
            "params": sum(p.numel() for p in model.parameters()),
            "timed_calls_sampled": sampling["sampled"], "last_call": path}


def vs_checkpoint_summary(r: dict[str, Any]) -> str:
    return (f"fxpipe / eager+checkpoint: min {r['ratio_min']:.3f}, "
            f"median {r['ratio_median']:.3f}")


def scaling(kit: Kit) -> dict[str, Any]:
    """The fused step on 1 .. N devices; speed-up over one."""
    model, ids, target = model_and_batch(kit.shape)
    sync = sync_fn(kit.dry_run)
    rows: dict[int, dict[str, Any]] = {}
    sampled = []
    for n in range(1, kit.num + 1):
        settle(kit.dry_run)
        pipe = fxpipe.compile(model, example_inputs=(ids,), devices=devices(n, kit.dry_run),
                              config=fxpipe.RunConfig(num_microbatch=max(2, n + 1)))
        try:
            with unsampled(pipe) as sampling:
                t = timed(lambda: (pipe.forward_backward((ids,), label=target, loss_fn=loss_fn),
                                   model.zero_grad(set_to_none=True)), 2, kit.repeats, sync)
        finally:
            pipe.close()
        sampled.append(sampling["sampled"])
        rows[n] = {"step_s_min": min(t), "step_s_median": statistics.median(t)}
        say(f"  {n} device(s): {rows[n]['step_s_median']:.3f} s/step")
    base = rows[1]["step_s_median"]
    for n, r in rows.items():
        r["speedup_median"] = base / r["step_s_median"]
    out = {"devices": rows, "timed_calls_sampled": None if None in sampled else any(sampled),
           "note": None if kit.num > 1 else "one device visible: no scaling to measure"}
    if kit.num == 1 or kit.dry_run:
        out["logical"] = logical_devices(kit)
        out["ok"] = out["logical"]["ok"]
    return out


def logical_devices(kit: Kit, steps: int = 2) -> dict[str, Any]:
    """Two logical devices over one GPU (two ``CudaDevice(0)``, each with its own streams,
    events and copies; in a dry run two VirtualDevices) against one: the cross-device
    ordering code on real CUDA. SGD steps from the same weights; the losses must agree
    within 1e-4 (the same kernels on the same inputs, in another order: equal so far)."""
    from fxpipe.runtime.devices.cuda import CudaDevice

    def two() -> list[Any]:
        if kit.dry_run:
            return devices(2, True)
        half = torch.cuda.get_device_properties(0).total_memory // 2
        return [CudaDevice(0, memory_limit=half, name=f"cuda:0/{i}") for i in range(2)]

    model, ids, target = model_and_batch({**kit.shape, "depth": min(4, kit.shape["depth"])})
    state = copy.deepcopy(model.state_dict())
    losses: dict[str, list[float]] = {}
    for name, make in (("one", lambda: devices(1, kit.dry_run)), ("two_logical", two)):
        model.load_state_dict(state)
        settle(kit.dry_run)
        pipe = fxpipe.compile(model, example_inputs=(ids,), devices=make(),
                              config=fxpipe.RunConfig(num_microbatch=3))
        try:
            opt = torch.optim.SGD(model.parameters(), lr=1e-2)
            losses[name] = []
            for _ in range(steps):
                losses[name].append(float(pipe.forward_backward((ids,), label=target,
                                                                loss_fn=loss_fn, optimizer=opt)))
                opt.zero_grad(set_to_none=True)
            if name == "two_logical":
                plan = repr(pipe.plan)
        finally:
            pipe.close()
    diff = max(abs(a - b) for a, b in zip(losses["one"], losses["two_logical"]))
    return {"losses": losses, "max_loss_diff": diff, "plan": plan,
            "ok": diff <= 1e-4 * max(1.0, abs(losses["one"][0]))}


def scaling_summary(r: dict[str, Any]) -> str:
    line = ", ".join(f"{n}: {v['speedup_median']:.2f}x" for n, v in r["devices"].items())
    if "logical" in r:
        line += f"; two logical devices on one: loss difference {r['logical']['max_loss_diff']:.1e}"
    return line
