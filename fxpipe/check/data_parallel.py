"""The kit's ``data_parallel`` section: ``data_parallel="device"`` and ``"zero3"`` in a
one-rank job.

What one GPU can show: the device reduce-scatters (and zero3's all-gathers of the
parameters, from host memory in a shared file, page-locked) on the runtime's streams,
through the NCCL groups ``compile`` makes (a dry run: gloo on the virtual devices'
tensors), and the steps equal to the same pipe without data parallel (one rank's
reduce-scatter and all-gather are copies). Several ranks need a GPU each (NCCL refuses
two ranks on one GPU): the CPU suite runs 2 and 4 (tests/test_dp_devices.py,
tests/test_zero3.py).
"""

from __future__ import annotations

import contextlib
import tempfile
from typing import Any

import torch
import torch.distributed as dist

import fxpipe
from fxpipe.check.common import devices, loss_fn, model_and_batch
from fxpipe.check.harness import Kit

RTOL = 1e-5   # the same kernels in the same order: only the copy differs
LR = 1e-2


def data_parallel(kit: Kit, steps: int = 2) -> dict[str, Any]:
    """Two SGD steps of the kit's model with ``data_parallel="device"`` on one rank
    against the same plan without data parallel, then a step of two calls (the first
    under ``no_sync()``: the stepping call's reduce-scatters add the accumulated ``.grad``,
    ``sRS+``), then a call without the optimizer and the optimizer's own step (the
    devices all-reduce, ``sAR``), then a clipped step (``max_grad_norm``: the sharded
    step redone): losses, parameters and the clipped norm; the printed device
    collectives and the gradient bytes each downloaded (and uploaded, the accumulated
    ones).

    SGD, not AdamW: a parameter moves by ``lr`` times its gradient, so the parameters
    differ as the gradients do. AdamW divides by the gradient's root mean square: an
    element whose gradient is at noise level (on a GPU, the attention backward's atomic
    adds and cuBLAS's choice of kernel by address leave two runs of the same program an
    ulp apart) moves by up to ``lr`` either way, whatever reduced it (the H200's first
    run: parameters 0.39 ``lr`` apart, losses equal).

    Then ``data_parallel="zero3"``: the first ``steps`` steps against the same plain
    ones (its shared host parameters, each stage's ``sAG`` after its upload); and
    ``data_parallel=True``, which on GPUs reduces on the devices too: each stage's
    ``sAR`` in a stepping call, the optimizer unsharded."""
    n = 2 if kit.dry_run else min(2, torch.cuda.device_count())
    out: dict[str, Any] = {"devices": n, "steps": steps, "optimizer": f"SGD(lr={LR:g})",
                           "rank_backend": "gloo",
                           "device_backend": "gloo" if kit.dry_run else "nccl"}
    with tempfile.TemporaryDirectory() as d:
        started = not dist.is_initialized()
        if started:
            dist.init_process_group("gloo", init_method=f"file://{d}/store", rank=0,
                                    world_size=1)
        try:
            runs = {name: _run(kit, n, steps, dp) for name, dp in
                    (("plain", False), ("device", "device"), ("zero3", "zero3"),
                     ("true", True))}
        finally:
            if started:
                dist.destroy_process_group()
    plain, device, zero3, true = runs["plain"], runs["device"], runs["zero3"], runs["true"]
    out.update({
        "losses": {k: r["losses"] for k, r in runs.items()},   # (zero3: the first steps)
        "max_loss_rel_diff": max(abs(a - b) / max(abs(b), 1e-12)
                                 for a, b in zip(device["losses"], plain["losses"])),
        "max_param_diff": max((a - b).abs().max().item()
                              for a, b in zip(device["params"], plain["params"])),
        "device_reduce_scatters": device["reduce_scatters"],
        "accumulated_reduce_scatters": device["accumulated"],
        "device_all_reduces": device["all_reduces"],
        "d2h_bytes_grads": {k: r["d2h_bytes_grads"] for k, r in runs.items()},
        "h2d_bytes_grads": device["h2d_bytes_grads"],
        "clipped_grad_norm": {k: runs[k]["grad_norm"] for k in ("plain", "device")},
        "clipped_norm_rel_diff": abs(device["grad_norm"] - plain["grad_norm"])
        / max(plain["grad_norm"], 1e-12),
        "zero3_max_loss_rel_diff": max(abs(a - b) / max(abs(b), 1e-12)
                                       for a, b in zip(zero3["losses"], plain["losses"])),
        "zero3_max_param_diff": max((a - b).abs().max().item() for a, b in
                                    zip(zero3["stepped"], plain["stepped"])),
        "zero3_all_gathers": zero3["all_gathers"],
        "true_max_loss_rel_diff": max(abs(a - b) / max(abs(b), 1e-12)
                                      for a, b in zip(true["losses"], plain["losses"])),
        "true_max_param_diff": max((a - b).abs().max().item() for a, b in
                                   zip(true["stepped"], plain["stepped"])),
        "true_all_reduces": true["all_reduces"],
        "h2d_bytes_params": {k: r["h2d_bytes_params"] for k, r in runs.items()}})
    scale = max(p.abs().max().item() for p in plain["params"])
    out["ok"] = (out["max_loss_rel_diff"] <= RTOL and out["max_param_diff"] <= RTOL * scale
                 and out["clipped_norm_rel_diff"] <= RTOL
                 and out["device_reduce_scatters"] > 0 and device["accumulated"] > 0
                 and device["h2d_bytes_grads"] > 0 and device["all_reduces"] > 0
                 and out["zero3_max_loss_rel_diff"] <= RTOL
                 and out["zero3_max_param_diff"] <= RTOL * scale and zero3["all_gathers"] > 0
                 and out["true_max_loss_rel_diff"] <= RTOL
                 and out["true_max_param_diff"] <= RTOL * scale and true["all_reduces"] > 0)
    return out


def _run(kit: Kit, n: int, steps: int, dp: Any) -> dict[str, Any]:
    model, ids, target = model_and_batch(kit.shape)
    pipe = fxpipe.compile(model, example_inputs=(ids,), devices=devices(n, kit.dry_run),
                          **({"data_parallel": dp} if dp else {}))
    try:
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        losses = []
        for _ in range(steps):
            losses.append(float(pipe.forward_backward((ids,), label=target, loss_fn=loss_fn,
                                                      optimizer=opt)))
            opt.zero_grad(set_to_none=True)
        program = pipe.program(optimizer=True)
        d2h, h2d_params = pipe.stats()["d2h_bytes_grads"], pipe.stats()["h2d_bytes_params"]
        stepped = [p.detach().float().cpu().clone() for p in model.parameters()]   # (not views)
        if dp in ("zero3", True):   # its first steps only (zero3 refuses a call that
            printed = [str(a) for acts in program.actions for a in acts]   # does not step)
            return {"losses": losses, "stepped": stepped, "h2d_bytes_params": h2d_params,
                    "d2h_bytes_grads": d2h, "all_gathers": sum(a.endswith("AG") for a in printed),
                    "all_reduces": sum(a.endswith("AR") for a in printed)}
        # a step of two calls: the first accumulates into .grad only (without data
        # parallel, a call that does not step does that)
        with pipe.no_sync() if dp else contextlib.nullcontext():
            pipe.forward_backward((ids,), label=target, loss_fn=loss_fn)
        accumulated = sum(str(a).endswith("RS+") for acts in pipe.program(optimizer=True).actions
                          for a in acts)
        losses.append(float(pipe.forward_backward((ids,), label=target, loss_fn=loss_fn,
                                                  optimizer=opt)))
        h2d = pipe.stats()["h2d_bytes_grads"]
        # a call that steps no sharded optimizer, then the optimizer's own step: the
        # devices average the gradients in place (sAR)
        opt.zero_grad(set_to_none=True)
        all_reduces = sum(str(a).endswith("AR") for acts in pipe.program().actions
                          for a in acts)
        losses.append(float(pipe.forward_backward((ids,), label=target, loss_fn=loss_fn)))
        opt.step()
        opt.zero_grad(set_to_none=True)
        # a clipped step (a limit every norm exceeds): with "device" the ranks' norm is
        # gathered, the sharded step redone clipped and gathered again
        clipped = fxpipe.optim.overlapped(opt, max_grad_norm=1e-3)
        losses.append(float(pipe.forward_backward((ids,), label=target, loss_fn=loss_fn,
                                                  optimizer=clipped)))
        return {"losses": losses, "d2h_bytes_grads": d2h, "all_reduces": all_reduces,
                "stepped": stepped, "h2d_bytes_params": h2d_params,
                "grad_norm": float(clipped.grad_norm),
                "h2d_bytes_grads": h2d, "accumulated": accumulated,
                "params": [p.detach().float().cpu() for p in model.parameters()],
                "reduce_scatters": sum(str(a).endswith("RS") for acts in program.actions
                                       for a in acts)}
    finally:
        pipe.close()


def data_parallel_summary(r: dict[str, Any]) -> str:
    return (f"one rank, {r['devices']} device(s), {r['device_backend']}: "
            f"{r['device_reduce_scatters']} device reduce-scatters a step "
            f"({r.get('accumulated_reduce_scatters', 0)} adding the accumulated .grad after "
            f"a no_sync() call), {r.get('device_all_reduces', 0)} all-reduces in a call that "
            f"does not step; the clipped norm within {r.get('clipped_norm_rel_diff', 0):.1e}; "
            "losses within "
            f"{r['max_loss_rel_diff']:.1e}, parameters within {r['max_param_diff']:.1e} of "
            "the pipe without data parallel"
            + (f"; zero3 ({r['zero3_all_gathers']} device all-gathers a step): losses within "
               f"{r['zero3_max_loss_rel_diff']:.1e}, parameters within "
               f"{r['zero3_max_param_diff']:.1e}" if "zero3_all_gathers" in r else "")
            + (f"; data_parallel=True ({r['true_all_reduces']} device all-reduces a step): "
               f"losses within {r['true_max_loss_rel_diff']:.1e}, parameters within "
               f"{r['true_max_param_diff']:.1e}" if "true_all_reduces" in r else ""))
