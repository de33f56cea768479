"""The fine-tuning kit's models and their FLOPs (``fxpipe.check.finetune``): a Hugging
Face causal LM from its config with random weights made straight in host memory
(:func:`host_model`: each parameter allocated once, never on the device first), peft LoRA
on it (:func:`with_lora`), a device copy made tensor by tensor (:func:`device_copy`), and
a step's model and hardware FLOPs (:func:`step_flops`, :func:`recompute_share`:
docs/benchmarks.md has the formulas).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn as nn

from fxpipe import quant


@contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Modules built inside register their parameters on ``meta`` (buffers stay real:
    a model's rotary tables are computed as usual)."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def _fill(t: torch.Tensor, name: str, std: float, gen: torch.device) -> None:
    """Random weights: 1-D norm weights one, other 1-D parameters zero, the rest
    N(0, std) (generated on ``gen`` one tensor at a time, copied into ``t``)."""
    if t.dim() == 1:
        t.fill_(1.0 if "norm" in name else 0.0)
    elif gen.type == "cpu":
        t.normal_(0.0, std)
    else:
        t.copy_(torch.randn(t.shape, dtype=t.dtype, device=gen).mul_(std))


def host_model(config: Any, dtype: torch.dtype, gen: torch.device) -> nn.Module:
    """``AutoModelForCausalLM.from_config(config)`` with random weights in ``dtype``,
    each parameter allocated once, in host memory (tied parameters once)."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    with _parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config)
    made: dict[int, nn.Parameter] = {}
    std = getattr(config, "initializer_range", 0.02)
    for mod_name, module in model.named_modules():
        for name, p in list(module._parameters.items()):
            if p is None:
                continue
            if id(p) not in made:
                t = torch.empty(p.shape, dtype=dtype)
                _fill(t, f"{mod_name}.{name}", std, gen)
                made[id(p)] = nn.Parameter(t, requires_grad=p.requires_grad)
            module._parameters[name] = made[id(p)]
    return model.train()


def with_lora(model: nn.Module, rank: int = 16) -> nn.Module:
    """peft LoRA ``r=rank`` on every linear layer of the blocks (``all-linear``: the
    output head left out); the adapters in fp32 (peft's default over a bf16 base)."""
    import peft
    return peft.get_peft_model(model, peft.LoraConfig(
        r=rank, lora_alpha=2 * rank, target_modules="all-linear", lora_dropout=0.0))


def host_bytes(model: nn.Module) -> int:
    """The bytes of ``model``'s parameters and buffers as the host holds them (a quantized
    weight as its blob)."""
    return sum(t.nbytes for t in (*model.parameters(), *model.buffers()))


def device_copy(model: nn.Module, device: torch.device | str) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers are copied to ``device`` one by
    one (no second host copy): ``deepcopy`` with the tensors pre-seeded in its memo."""
    memo: dict[int, Any] = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(p.detach().to(device, copy=True), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = b.to(device, copy=True)
    return copy.deepcopy(model, memo)


# ---------------------------------------------------------------------------- FLOPs

def _linear_params(model: nn.Module) -> tuple[int, int, int]:
    """(every Linear's weight elements, the trainable ones, the output head's)."""
    total = trainable = head = 0
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    for m in model.modules():
        if isinstance(m, nn.Linear):
            n = quant.weight_numel(m)
            total += n
            trainable += n if quant.quantized_weight(m) is None and m.weight.requires_grad else 0
            head += n if m is out else 0
    return total, trainable, head


def step_flops(model: nn.Module, config: Any, tokens: int, seq: int,
               recomputed: float = 1.0) -> dict[str, float]:
    """One step's FLOPs: ``model`` (6·N·T, N every parameter, a quantized weight counted
    as its elements) and ``hardware``: the
    matmuls' forward, the recompute of the blocks' forward (the share ``recomputed`` of
    it: 1 for eager's gradient checkpointing, :func:`recompute_share` for a fxpipe plan),
    the input gradients, the weight gradients of trainable weights only; causal attention
    (score and value products: 2·S·T·d per layer forward, twice that backward, once more
    where recomputed)."""
    n_all = quant.parameter_count(model)
    lin, trainable, head = _linear_params(model)
    layers = config.num_hidden_layers
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    d_attn = config.num_attention_heads * head_dim
    matmul = tokens * (2 * lin + recomputed * 2 * (lin - head) + 2 * lin + 2 * trainable)
    attention = layers * 2 * seq * tokens * d_attn * (1 + recomputed + 2)
    return {"model": 6.0 * n_all * tokens, "hardware": float(matmul + attention)}


def recompute_share(layers: Any, plan: Any) -> dict[str, float]:
    """What a fused ``plan`` of ``layers`` (``pipe.layers``, costed) recomputes, by the
    cost pass's FLOPs: ``recomputed``, the recomputed layers' share of the forward FLOPs
    of every layer but the last (the head, never recomputed); ``flops_ratio``, hardware
    over model FLOPs (forward and backward, plus the recompute): 1.0 when nothing is
    recomputed, about 4/3 when every block is."""
    costs = [layer.cost for layer in layers]
    rec = plan.recomputed("fused")
    fwd = [c.fwd_flops for c in costs]
    model = sum(c.fwd_flops + c.bwd_flops for c in costs)
    return {"recomputed": sum(fwd[i] for i in rec) / (sum(fwd[:-1]) or 1.0),
            "flops_ratio": (model + sum(fwd[i] for i in rec)) / model}
