"""The kit's ``bigger_than_device`` section: bf16 training, AdamW streamed in the call,
of a model whose bf16 weights are over twice what the device may hold (cuda:0 capped with
``torch.cuda.set_per_process_memory_fraction``; in a dry run a ``memory_limit``)."""

from __future__ import annotations

import math
import time
from typing import Any

import torch

import fxpipe
from fxpipe.check.common import (capped_devices, host_memory, loss_fn, model_and_batch, sync_fn,
                                 unsampled)
from fxpipe.check.harness import Kit


def _setup(dry_run: bool) -> tuple[int, dict[str, int], int, float]:
    """(cap in bytes, model shape, microbatches, learning rate): a deep model of small
    blocks whose bf16 weights are about 2.1x the cap."""
    if dry_run:
        cap, shape, M, lr = 160_000, dict(vocab=64, dim=32, heads=4, batch=8, seq=16), 4, 1e-2
    else:
        # 20 host bytes per parameter (fp32 master, gradient, two AdamW moments, bf16
        # copy) within a third of host RAM
        cap = int(min(2**30, host_memory() / 3 / 20 * 2 / 2.1))
        shape, M, lr = dict(vocab=8192, dim=2048, heads=16, batch=4, seq=512), 4, 3e-4
    dim = shape["dim"]
    per_block = (10 * dim * dim + 2 * dim) * 2          # bf16: qkv, o, gate, up, down; 2 norms
    rest = (shape["vocab"] * dim + dim) * 2              # tied embedding/head, final norm
    shape["depth"] = max(2, math.ceil((2.1 * cap - rest) / per_block))
    return cap, shape, M, lr


def bigger_than_device(kit: Kit, steps: int = 3) -> dict[str, Any]:
    """Train a model whose bf16 weights are over twice what the device may hold."""
    cap, shape, M, lr = _setup(kit.dry_run)
    model, ids, target = model_and_batch(shape)
    weights = sum(p.numel() for p in model.parameters()) * 2
    if weights < 2 * cap:
        raise AssertionError(f"bf16 weights {weights} B are not 2x the cap {cap} B")
    out: dict[str, Any] = {"cap_bytes": cap, "weights_bf16_bytes": weights,
                           "weights_over_limit": weights / cap, "model": shape,
                           "num_microbatch": M, "param_dtype": "bfloat16",
                           "optimizer": "torch.optim.AdamW, streamed: forward_backward(optimizer=)"}
    with capped_devices(cap, kit.dry_run, virtual=2) as (devices, figures):
        out.update(figures)
        pipe = None
        try:
            pipe = fxpipe.compile(model, example_inputs=(ids,), devices=devices,
                                  param_dtype=torch.bfloat16,
                                  config=fxpipe.RunConfig(num_microbatch=M))
            out["plan_stages"] = {"fwd": len(pipe.plan.fwd_plan), "bwd": len(pipe.plan.bwd_plan)}
            opt = torch.optim.AdamW(model.parameters(), lr=lr)
            sync = sync_fn(kit.dry_run)
            losses, seconds = [], []
            with unsampled(pipe) as sampling:
                for _ in range(steps):
                    t0 = time.perf_counter()
                    loss = pipe.forward_backward((ids,), label=target, loss_fn=loss_fn,
                                                 optimizer=opt)
                    sync()
                    seconds.append(time.perf_counter() - t0)
                    opt.zero_grad(set_to_none=True)
                    losses.append(float(loss))
            if kit.dry_run:
                reserved = max(d.peak_reserved_bytes() for d in pipe.devices)
                allocated = max(d.peak_bytes() for d in pipe.devices)
            else:
                before = figures["allocated_before_bytes"]
                reserved = torch.cuda.max_memory_reserved(0) - before
                allocated = torch.cuda.max_memory_allocated(0) - before
        finally:
            if pipe is not None:
                pipe.close()
    if kit.dry_run and reserved > cap:
        out["note"] = ("a VirtualDevice keeps freed copies for reuse past its memory_limit (a "
                       "GPU's allocator frees its cache and retries first): reserved may exceed "
                       "the cap in a dry run; peak_allocated_over_limit is what was resident")
    timed = seconds[1:] or seconds          # the first step compiles: left out when others ran
    tokens = ids.numel()
    out.update({
        "peak_reserved_over_limit": reserved / cap, "peak_allocated_over_limit": allocated / cap,
        "tokens_per_s": tokens * len(timed) / sum(timed), "step_s": seconds, "losses": losses,
        "timed_calls_sampled": sampling["sampled"],
        "ok": all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]})
    return out


def bigger_than_device_summary(r: dict[str, Any]) -> str:
    return (f"weights {r['weights_over_limit']:.2f}x the cap, peak reserved "
            f"{r['peak_reserved_over_limit']:.2f}x, {r['tokens_per_s']:.0f} tokens/s, "
            f"losses {[round(x, 3) for x in r['losses']]}")
