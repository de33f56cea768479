"""Attention with dropout whose kernel does not depend on the grad mode.

``scaled_dot_product_attention`` picks its kernel (flash, memory-efficient, cuDNN, math)
partly by whether its inputs require grad, and the kernels draw their dropout masks
differently. fxpipe runs a stage's forward without grad and recomputes it with grad for
the backward (``fxpipe.passes.recompute``): where the two picks differed, the recompute's
masks would not be the forward's, and the gradients would be those of another forward.

So an attention with dropout runs as it would with grad, always
(:func:`scaled_dot_product_attention`): the forward and the recompute pick the same
kernel, and draw the same masks from the layer's seed (``fxpipe.runtime.stages.rng``). It costs
the autograd record of one op in the forward; an attention without dropout runs as it is.

- Captured graphs call it in place of ``F.scaled_dot_product_attention`` (or ``aten``'s)
  wherever ``dropout_p`` is not ``0`` (``fxpipe.passes.partition``): it shows in the stage
  code as ``fxpipe_attention_scaled_dot_product_attention(...)``.
- A block run as its own module (``fxpipe.passes.blocks``) in training mode runs under
  :class:`SameKernelMode`, which sends its attention calls here.

>>> q = torch.randn(1, 2, 4, 8)
>>> with torch.no_grad():
...     out = scaled_dot_product_attention(q, q, q, dropout_p=0.5)
>>> out.shape, out.requires_grad
(torch.Size([1, 2, 4, 8]), False)
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

SDPA = frozenset({torch._C._nn.scaled_dot_product_attention,
                  torch.ops.aten.scaled_dot_product_attention,
                  torch.ops.aten.scaled_dot_product_attention.default})
"""What an attention call is, in a graph or under a function mode: ``F``'s and aten's."""


def scaled_dot_product_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                 attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                                 is_causal: bool = False, scale: float | None = None,
                                 enable_gqa: bool = False) -> torch.Tensor:
    """``F.scaled_dot_product_attention``, run as it is run with grad when ``dropout_p`` is
    not 0: its kernel, so its dropout masks, are those of the recompute."""
    kw: dict[str, Any] = dict(attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                              scale=scale, enable_gqa=enable_gqa)
    qkv = (query, key, value)
    if not dropout_p or (torch.is_grad_enabled() and any(t.requires_grad for t in qkv)):
        return F.scaled_dot_product_attention(*qkv, **kw)
    with torch.enable_grad():   # as the recompute of a trainable layer calls it
        out = F.scaled_dot_product_attention(*(t.detach().requires_grad_() for t in qkv), **kw)
    return out.detach()


class SameKernelMode(TorchFunctionMode):
    """Sends every attention call made under it to :func:`scaled_dot_product_attention`
    (a block run as its module, whose code fxpipe does not rewrite); ``seen``: whether one
    of them had dropout."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in SDPA:
            return func(*args, **kwargs)
        dropout = kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0)
        self.seen = self.seen or bool(dropout)
        return scaled_dot_product_attention(*args, **kwargs)


# --- the FLOPs of attention, which FlopCounterMode counts 0 on CPU -------------------

def register_sdpa_flops() -> None:
    """Teach ``FlopCounterMode`` the attention ops CPU dispatches to (it counts them 0).
    Registers only what is missing: idempotent, and torch's own formulas win."""
    from torch.utils import flop_counter
    aten = torch.ops.aten

    def missing(*names: str) -> list:
        ops = [getattr(aten, n) for n in names if hasattr(aten, n)]
        return [op for op in ops if op not in flop_counter.flop_registry]

    fwd = missing("_scaled_dot_product_flash_attention_for_cpu", "scaled_dot_product_attention")
    if fwd:
        flop_counter.register_flop_formula(fwd)(_sdpa_flops)
    bwd = missing("_scaled_dot_product_flash_attention_for_cpu_backward")
    if bwd:
        flop_counter.register_flop_formula(bwd)(_sdpa_backward_flops)


def _sdpa_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    """scores = q @ k^T, out = scores @ v, over any leading (batch, head) dims."""
    batch, (s_q, d), s_k, d_v = math.prod(query_shape[:-2]), query_shape[-2:], key_shape[-2], value_shape[-1]
    return 2 * batch * s_q * s_k * (d + d_v)


def _sdpa_backward_flops(grad_out_shape, query_shape, key_shape, value_shape, *args,
                         out_shape=None, **kwargs) -> int:
    """The scores recomputed, then the gradients of scores, v, q and k: five matmuls."""
    batch, (s_q, d), s_k, d_v = math.prod(query_shape[:-2]), query_shape[-2:], key_shape[-2], value_shape[-1]
    return 2 * batch * s_q * s_k * (3 * d + 2 * d_v)
