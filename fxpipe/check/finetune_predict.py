"""The kit's fine-tuning runs as ``fxpipe.simulate`` predicts them, before (or beside) the
measurement (``fxpipe.check.finetune``): the run's model on ``meta``, fxpipe's plan for
it, its FLOPs at a given (or an eager step's) rate and the host's rates for its work.
``benchmarks/bench_finetune.py --predict`` prints them.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

import fxpipe
from fxpipe import quant
from fxpipe.check.finetune_models import recompute_share, step_flops, with_lora


def host_rates(numel: int = 1 << 24) -> dict[str, float]:
    """This host's rates the simulator prices host work with, measured on ``numel``
    fp32 parameters (minimum of 3 after one): ``optimizer_bytes_per_s``, parameter
    bytes per second of ``torch.optim.AdamW(fused=True)``'s step (what fxpipe's streamed
    step runs for an AdamW left at torch's defaults; ``optimizer_default_bytes_per_s``:
    torch's own default on CPU, the per-parameter loop) and ``copy_bytes_per_s``, an
    fp32 to bf16 cast (the upload copies' refresh)."""
    def adamw(**kw: Any) -> Callable[[], Any]:
        params = [torch.zeros(numel // 4, requires_grad=True) for _ in range(4)]
        for p in params:
            p.grad = torch.full_like(p, 1e-3)
        return torch.optim.AdamW(params, lr=1e-5, **kw).step
    src, dst = torch.ones(numel), torch.empty(numel, dtype=torch.bfloat16)

    def rate(fn: Callable[[], Any]) -> float:
        fn()
        best = math.inf
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
        return numel * 4 / best
    return {"optimizer_bytes_per_s": rate(adamw(fused=True)),
            "optimizer_default_bytes_per_s": rate(adamw()),
            "copy_bytes_per_s": rate(lambda: dst.copy_(src))}


def meta_model(spec: dict[str, Any]) -> nn.Module:
    """The run's model on ``meta`` (no weights), LoRA-wrapped for ``lora`` and ``qlora``
    (its frozen linears then quantized to NF4), in its host dtype: what the planner and
    the simulator read."""
    from transformers import AutoModelForCausalLM
    lora = spec["mode"] in ("lora", "qlora")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(spec["config"])
        model = model.to(torch.bfloat16 if lora else torch.float32)
        if lora:
            model = with_lora(model)
    if spec["mode"] == "qlora":
        quant.quantize_frozen(model, "nf4")
    return model.train()


def costed_step_flops(pipe: Any, num_microbatch: int) -> float:
    """One checkpointed step's FLOPs as fxpipe's cost pass counts them (per microbatch,
    every layer's forward twice, the recompute, and its backward): what an eager step
    with gradient checkpointing runs, in the simulator's own units."""
    return num_microbatch * sum(2 * layer.cost.fwd_flops + layer.cost.bwd_flops
                                for layer in pipe.layers)


def predict(spec: dict[str, Any], *, memory: float, link: float,
            hosts: dict[str, tuple[float, float]], flops: float | None = None,
            eager_step_s: float | None = None, num_devices: int = 1,
            recompute: tuple[str, ...] = ("auto",),
            device_bytes_per_s: float = math.inf,
            host_issue: dict[str, float] | None = None,
            backends: tuple[str, ...] = ("eager",)) -> list[dict[str, Any]]:
    """The run's step as ``fxpipe.simulate`` predicts it: fxpipe's own plan for
    ``num_devices`` devices of ``memory`` bytes, its layers' FLOPs at ``flops`` per
    second (or, given a measured eager checkpointed step of this run,
    :func:`costed_step_flops` over it: the rate eager reached, in the cost pass's own
    FLOP counting), ``link`` bytes/s each way; one row per ``hosts`` entry, ``name:
    (optimizer bytes/s, copy bytes/s)``: the streamed AdamW and the upload copies'
    refresh on the host at those rates. Each row is planned for its machine
    (``ExecutePlan.auto(device=hardware.nominal_device())``) under each of ``recompute``
    (``"auto"``: the fused tail keeps what fits and pays; ``"full"``: every block but the
    head recomputed): how much the tail keeps depends on what the host and the link can
    hide. ``device_bytes_per_s``: the device's memory bandwidth, which prices a
    ``qlora`` run's dequantizes (``Hardware.device_bytes_per_s``). Each row has the
    plan's ``predicted_host_bytes`` (``predict_memory(...).host_total``, the AdamW state
    of the trainable parameters included).

    ``host_issue``: the host's time to issue actions and kernels (``fxpipe.sim.Hardware``'s
    ``host_us_per_*``, e.g. ``fxpipe.sim.hardware.H200_HOST``; default none: a free
    host); then one row per ``backends`` entry (``RunConfig.stage_backend``: what the
    compute actions launch, so what the host issues; the kernels run at ``flops`` under
    every backend, no fusion speedup modelled)."""
    from fxpipe.plan import ExecutePlan, chain_memory, layer_costs
    from fxpipe.sim import Hardware, LayerCost, simulate
    if (flops is None) == (eager_step_s is None):
        raise ValueError("predict: pass flops= (FLOP/s) or eager_step_s= (a measured eager "
                         "step that calibrates them), one of the two")
    model = meta_model(spec)
    adamw = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])   # its state
    M, seq = spec["microbatches"], spec["seq"]
    ids = torch.zeros(1, seq, dtype=torch.long, device="meta")   # one microbatch: its FLOPs
    devices = [fxpipe.VirtualDevice(semantics="cuda", memory_limit=int(memory))
               for _ in range(num_devices)]
    pipes: dict[str, Any] = {}

    def pipe_for(plan: ExecutePlan | None) -> Any:   # one capture per plan
        if repr(plan) not in pipes:
            pipes[repr(plan)] = fxpipe.compile(
                model, example_kwargs=dict(input_ids=ids, labels=ids), devices=devices,
                param_dtype=torch.bfloat16,
                config=fxpipe.RunConfig(num_microbatch=M, execute_plan=plan))
        return pipes[repr(plan)]

    try:
        costed = pipe_for(None)
        pipes.setdefault(repr(costed.plan), costed)   # it also serves its own plan
        if flops is None:
            flops = costed_step_flops(costed, M) / eager_step_s
        tokens = M * seq
        rows = []
        for host, (optimizer_rate, copy_rate) in hosts.items():
            hw = Hardware(flops=flops, memory=memory, h2d_bandwidth=link, d2h_bandwidth=link,
                          cpu_optimizer_bytes_per_s=optimizer_rate,
                          host_copy_bytes_per_s=copy_rate, device_bytes_per_s=device_bytes_per_s,
                          **(host_issue or {}))
            plans = {policy: ExecutePlan.auto("fused", costed, num_microbatch=M, recompute=policy,
                                              device=hw.nominal_device()) for policy in recompute}
            for policy, backend in itertools.product(recompute, backends):
                plan = plans[policy]
                pipe = pipe_for(plan)   # its program runs the plan (pipe.plan: the one compiled)
                t = simulate(pipe.program("fused", M, optimizer=True),
                             [LayerCost.of(c, hw) for c in layer_costs(pipe)], hw,
                             memory=chain_memory(pipe, M), stage_backend=backend)
                step_s = t.makespan / 1e3
                share = recompute_share(pipe.layers, plan)
                f = step_flops(model, spec["config"], tokens, seq, share["recomputed"])
                rows.append({"model": spec["model"], "mode": spec["mode"], "devices": num_devices,
                             "host_work": host, "recompute": policy, "stage_backend": backend,
                             "host_issue_s": t.host_issue_ms / 1e3,
                             "params": quant.parameter_count(model),
                             "tokens_per_step": tokens, "plan": repr(plan), **share,
                             "predicted_step_s": step_s, "tokens_per_s": tokens / step_s,
                             "model_tflops": f["model"] / step_s / 1e12,
                             "hardware_tflops": f["hardware"] / step_s / 1e12,
                             "predicted_peak_bytes": max(t.peak_memory), "flops_per_s": flops,
                             "predicted_host_bytes": fxpipe.plan.predict_memory(
                                 pipe, run_type="fused", loss_fn=lambda o, _: o.loss,
                                 optimizer=adamw).host_total,
                             "bubble_ratio": t.bubble_ratio})
        return rows
    finally:
        for pipe in {id(p): p for p in pipes.values()}.values():   # one pipe, two keys
            pipe.close()
