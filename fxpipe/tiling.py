"""A transformer MLP (and an RMSNorm) run over the tokens a tile at a time: Unsloth's
"tiled MLP".

At long sequences a decoder layer's largest tensors are its MLP's: Llama-3.1-8B's gate and
up projections are 3.5 x the hidden size, so at 128K tokens each is 3.5 GiB in bf16, and
the backward keeps four of them (gate, its activation, up, their product). Every token's
MLP is independent of the others', so ``tiled_mlp`` computes it ``rows`` tokens at a time:

- forward: each tile's output, nothing kept but the input (and the weights);
- backward: each tile's forward again, with grad, then its backward; the weights'
  gradients are summed over the tiles in fp32.

So the MLP holds one tile's intermediates instead of the sequence's, for one more MLP
forward in backward. ``tiled_rms_norm`` does the same for a block's RMSNorm, whose fp32
upcast would otherwise be kept for the whole sequence. A call with at most ``rows`` tokens runs the plain MLP, as eager does. ``fxpipe.passes.tiling`` puts it where a model's MLP would hold
more than its share of a device; it shows in the stage code as
``fxpipe_tiling_tiled_mlp(x, ..., act='silu', rows=7281)``.

>>> x, w1, w2, w3 = torch.randn(2, 6, 4), torch.randn(8, 4), torch.randn(8, 4), torch.randn(4, 8)
>>> ref = F.linear(F.silu(F.linear(x, w2)) * F.linear(x, w1), w3)
>>> torch.allclose(tiled_mlp(x, w1, None, w2, None, w3, None, act="silu", rows=5), ref, atol=1e-6)
True
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "relu")
NORM_BYTES = 14
"""Bytes per element an RMSNorm holds for its backward, untiled, at most (the input upcast
to fp32, its normalized fp32 value, the cast back, and the square while it is made):
what its tile is sized by (``fxpipe.passes.tiling``)."""


def tiled_mlp(x: Tensor, w_in: Tensor, b_in: Tensor | None, w_gate: Tensor | None,
              b_gate: Tensor | None, w_out: Tensor, b_out: Tensor | None, *, act: str,
              rows: int) -> Tensor:
    """``linear(act(linear(x, w_gate, b_gate)) * linear(x, w_in, b_in), w_out, b_out)`` (a
    gated MLP: SwiGLU, GeGLU), or without ``w_gate`` ``linear(act(linear(x, w_in, b_in)),
    w_out, b_out)``, ``rows`` tokens (rows of ``x`` flattened to 2-d) at a time (module
    docstring). ``act``: one of ``ACTIVATIONS``."""
    if act not in ACTIVATIONS:
        raise ValueError(f"tiled_mlp: act must be one of {ACTIVATIONS}, got {act!r}")
    if rows < 1:
        raise ValueError(f"tiled_mlp: rows must be >= 1, got {rows}")
    if x.shape[:-1].numel() <= rows:   # one tile: the MLP as eager runs it
        return _mlp(x, act, w_in, b_in, w_gate, b_gate, w_out, b_out)
    return _TiledMLP.apply(x, act, rows, w_in, b_in, w_gate, b_gate, w_out, b_out)


def _mlp(x: Tensor, act: str, w_in, b_in, w_gate, b_gate, w_out, b_out) -> Tensor:
    h = F.linear(x, w_in, b_in)
    if w_gate is not None:
        h = _act(F.linear(x, w_gate, b_gate), act) * h
    else:
        h = _act(h, act)
    return F.linear(h, w_out, b_out)


def _act(x: Tensor, act: str) -> Tensor:
    if act == "silu":
        return F.silu(x)
    if act == "relu":
        return F.relu(x)
    return F.gelu(x, approximate="tanh" if act == "gelu_tanh" else "none")


def _autocast(device: torch.device) -> tuple[bool, torch.dtype | None]:
    if device.type == "meta" or not torch.is_autocast_enabled(device.type):
        return False, None
    return True, torch.get_autocast_dtype(device.type)


class _TiledMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, act, rows, *weights):
        ctx.save_for_backward(x, *weights)
        ctx.act, ctx.rows, ctx.autocast = act, rows, _autocast(x.device)
        flat = x.reshape(-1, x.shape[-1])
        w_out = weights[4]
        out = flat.new_empty(*x.shape[:-1], w_out.shape[0],
                             dtype=_autocast(x.device)[1] or torch.promote_types(x.dtype, w_out.dtype))
        rows_out = out.view(-1, w_out.shape[0])   # not the output itself: callers may write it
        for s in range(0, flat.shape[0], rows):
            rows_out[s:s + rows] = _mlp(flat[s:s + rows], act, *weights)
        return out

    @staticmethod
    def backward(ctx, grad):
        x, *weights = ctx.saved_tensors
        wants = ctx.needs_input_grad
        flat, g = x.reshape(-1, x.shape[-1]), grad.reshape(-1, grad.shape[-1])
        leaves = [None if w is None else w.detach().requires_grad_(wants[3 + i])
                  for i, w in enumerate(weights)]
        sums = [torch.zeros(w.shape, dtype=torch.promote_types(w.dtype, torch.float32),
                            device=w.device) if w is not None and wants[3 + i] else None
                for i, w in enumerate(weights)]
        dx = torch.empty_like(flat) if wants[0] else None
        on, dtype = ctx.autocast
        for s in range(0, flat.shape[0], ctx.rows):
            xc = flat[s:s + ctx.rows].detach().requires_grad_(wants[0])
            with torch.enable_grad(), torch.autocast(x.device.type, dtype=dtype, enabled=on):
                out = _mlp(xc, ctx.act, *leaves)
            inputs = [t for t in (xc, *leaves) if t is not None and t.requires_grad]
            grads = iter(torch.autograd.grad(out, inputs, g[s:s + ctx.rows]))
            if xc.requires_grad:
                dx[s:s + ctx.rows] = next(grads)
            for leaf, total in zip(leaves, sums):
                if leaf is not None and leaf.requires_grad:
                    total += next(grads)
            del out, grads
        dws = [None if t is None else t.to(w.dtype) for t, w in zip(sums, weights)]
        return (None if dx is None else dx.view_as(x)), None, None, *dws


def tiled_rms_norm(x: Tensor, weight: Tensor, *, eps: float, dtype: torch.dtype | None,
                   rows: int) -> Tensor:
    """``weight * rms_norm(x)`` as transformers' ``LlamaRMSNorm`` (Llama, Qwen, Mistral)
    computes it: ``up = x.float()``, ``up * rsqrt(up.pow(2).mean(-1, keepdim=True) +
    eps)``, cast to ``dtype`` (None: no cast), times ``weight``; ``rows`` tokens (rows of
    ``x`` flattened to 2-d) at a time. Forward keeps only ``x``: the fp32 upcast and its
    normalized value, about seven times the input's bytes at 2-byte elements, exist for
    one tile, in forward and again in backward. A call with at most ``rows`` tokens runs
    the plain norm.

    >>> x, w = torch.randn(3, 5, 8), torch.randn(8)
    >>> up = x.float()
    >>> ref = w * (up * torch.rsqrt(up.pow(2).mean(-1, keepdim=True) + 1e-6))
    >>> torch.equal(tiled_rms_norm(x, w, eps=1e-6, dtype=None, rows=4), ref)
    True
    """
    if rows < 1:
        raise ValueError(f"tiled_rms_norm: rows must be >= 1, got {rows}")
    if x.shape[:-1].numel() <= rows:   # one tile: the norm as eager runs it
        return _rms_norm(x, weight, eps, dtype)
    return _TiledRMSNorm.apply(x, weight, eps, dtype, rows)


def _rms_norm(x: Tensor, weight: Tensor, eps: float, dtype: torch.dtype | None) -> Tensor:
    up = x.to(torch.float32)
    normed = up * torch.rsqrt(up.pow(2).mean(-1, keepdim=True) + eps)
    return weight * (normed if dtype is None else normed.to(dtype))


class _TiledRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, dtype, rows):
        ctx.save_for_backward(x, weight)
        ctx.eps, ctx.dtype, ctx.rows, ctx.autocast = eps, dtype, rows, _autocast(x.device)
        flat = x.reshape(-1, x.shape[-1])
        first = _rms_norm(flat[:rows], weight, eps, dtype)
        out = flat.new_empty(flat.shape, dtype=first.dtype)
        out[:rows] = first
        del first
        for s in range(rows, flat.shape[0], rows):   # each tile into the output as made
            out[s:s + rows] = _rms_norm(flat[s:s + rows], weight, eps, dtype)
        return out.view(x.shape)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        wants = ctx.needs_input_grad
        flat, g = x.reshape(-1, x.shape[-1]), grad.reshape(-1, grad.shape[-1])
        w = weight.detach().requires_grad_(wants[1])
        dw = torch.zeros(weight.shape, dtype=torch.promote_types(weight.dtype, torch.float32),
                         device=weight.device) if wants[1] else None
        dx = torch.empty_like(flat) if wants[0] else None
        on, dtype = ctx.autocast
        for s in range(0, flat.shape[0], ctx.rows):
            xc = flat[s:s + ctx.rows].detach().requires_grad_(wants[0])
            with torch.enable_grad(), torch.autocast(x.device.type, dtype=dtype, enabled=on):
                out = _rms_norm(xc, w, ctx.eps, ctx.dtype)
            inputs = [t for t in (xc, w) if t.requires_grad]
            grads = iter(torch.autograd.grad(out, inputs, g[s:s + ctx.rows]))
            if xc.requires_grad:
                dx[s:s + ctx.rows] = next(grads)
            if w.requires_grad:
                dw += next(grads)
            del out, grads
        return (None if dx is None else dx.view_as(x)), \
            (None if dw is None else dw.to(weight.dtype)), None, None, None
