"""A causal-LM loss that never holds the (tokens, vocab) logits.

``linear_cross_entropy(hidden, weight, labels)`` is
``F.cross_entropy(F.linear(hidden, weight).flatten(0, -2), labels.flatten())``, computed
``chunk_size`` tokens at a time: the forward makes one chunk's logits (in fp32), keeps its
log-sum-exp and target logit, and frees them; the backward makes them again, chunk by
chunk, and turns each into its share of the gradients of ``hidden`` and ``weight``. Only
``hidden``, ``weight`` and ``labels`` are kept for backward, so a 128K-token sequence
over a 128K vocabulary needs one chunk's logits (256 MiB by default) instead of 63 GiB
of fp32 logits and as much again for their gradient. The head's matmul runs twice.

In a pipeline, the loss belongs to the model: its last layer reads the hidden states and
the labels (a model input, split into microbatches with the tokens) and returns the loss,
and ``forward_backward``'s default ``loss_fn`` (the output itself) is the loss::

    class CausalLM(nn.Module):
        def forward(self, input_ids, labels):
            hidden = self.norm(self.body(input_ids))
            return fxpipe.linear_cross_entropy(hidden, self.lm_head.weight, labels)

    pipe = fxpipe.compile(CausalLM(...), example_inputs=(ids, labels))
    loss = pipe.forward_backward((ids, labels))

Captured (fx, export or dynamo) it is one opaque op, ``torch.ops.fxpipe.linear_cross_entropy``;
``fxpipe.passes.capture`` binds it back to this function, so the runtime (and the cost
model, on fake tensors) runs the chunks, each op visible to byte accounting. On fake or
meta tensors (costing) only the first and the last chunk run: every chunk allocates and
frees the same, and ``torch.ops.fxpipe.matmul_flops`` counts the others' matmuls.

>>> h, w, y = torch.randn(6, 4, requires_grad=True), torch.randn(10, 4), torch.arange(6)
>>> loss = linear_cross_entropy(h, w, y, chunk_size=4)
>>> torch.allclose(loss, torch.nn.functional.cross_entropy(h @ w.t(), y))
True
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake
from torch.utils.flop_counter import register_flop_formula

CHUNK_BYTES = 2**28
"""The default chunk: as many tokens as make 256 MiB of fp32 logits."""


def linear_cross_entropy(hidden: Tensor, weight: Tensor, labels: Tensor, chunk_size: int | None = None,
                         ignore_index: int = -100, reduction: str = "mean") -> Tensor:
    """``F.cross_entropy(F.linear(hidden, weight).flatten(0, -2), labels.flatten(),
    ignore_index=ignore_index, reduction=reduction)`` without the logits (module
    docstring). ``hidden``: ``(..., H)``; ``weight``: ``(V, H)`` (an LM head's, no bias);
    ``labels``: ``(...)`` class indices; ``chunk_size``: tokens per chunk (``None`` or 0:
    ``CHUNK_BYTES`` of fp32 logits); ``reduction``: ``"mean"`` (over labels that are not
    ``ignore_index``) or ``"sum"``. The loss has ``hidden``'s dtype; the logits are made
    in fp32, ``weight``'s gradient is summed over chunks in ``weight``'s dtype.
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"linear_cross_entropy: reduction must be 'mean' or 'sum', got {reduction!r}")
    chunk = chunk_size or 0
    if isinstance(hidden, fx.Proxy) or torch.compiler.is_compiling():
        return torch.ops.fxpipe.linear_cross_entropy(hidden, weight, labels, chunk, ignore_index,
                                                     reduction)
    _check(hidden, weight, labels)
    return _LinearCrossEntropy.apply(hidden, weight, labels, chunk, ignore_index, reduction)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk, ignore_index, reduction):
        ctx.save_for_backward(hidden, weight, labels)
        ctx.options = chunk, ignore_index, reduction
        return _loss(hidden, weight, labels, chunk, ignore_index, reduction)

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, labels = ctx.saved_tensors
        dh, dw = _grads(grad, hidden, weight, labels, *ctx.options,
                        want=ctx.needs_input_grad[:2])
        return dh, dw, None, None, None, None


def _check(hidden: Tensor, weight: Tensor, labels: Tensor) -> None:
    if weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"linear_cross_entropy: weight must be (vocab, {hidden.shape[-1]}) for "
                         f"hidden of shape {tuple(hidden.shape)}, got {tuple(weight.shape)}")
    if labels.shape != hidden.shape[:-1]:
        raise ValueError(f"linear_cross_entropy: labels must have shape {tuple(hidden.shape[:-1])} "
                         f"(hidden without its last dim), got {tuple(labels.shape)}")


def _starts(h: Tensor, weight: Tensor, chunk: int, matmuls: int) -> tuple[int, list[int]]:
    """Rows per chunk and the chunks' first rows; on fake or meta tensors the first and
    the last chunk only, the others' ``matmuls`` head matmuls each counted as FLOPs."""
    n = h.shape[0]
    rows = chunk if chunk > 0 else max(1, min(n, CHUNK_BYTES // (4 * weight.shape[0])))
    starts = list(range(0, n, rows))
    if len(starts) > 2 and (is_fake(h) or h.device.type == "meta"):
        torch.ops.fxpipe.matmul_flops(h[:rows], weight, (len(starts) - 2) * matmuls)
        starts = [starts[0], starts[-1]]
    return rows, starts


def _chunk_logits(h: Tensor, weight: Tensor) -> Tensor:
    """One chunk's logits, in fp32 at least."""
    logits = F.linear(h, weight)
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


def _loss(hidden: Tensor, weight: Tensor, labels: Tensor, chunk: int, ignore_index: int,
          reduction: str) -> Tensor:
    h, y = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    rows, starts = _starts(h, weight, chunk, 1)
    total = torch.zeros((), dtype=torch.promote_types(h.dtype, torch.float32), device=h.device)
    for s in starts:
        logits = _chunk_logits(h[s:s + rows], weight)
        yc = y[s:s + rows]
        picked = logits.gather(1, yc.clamp(min=0).unsqueeze(1)).squeeze(1)
        nll = torch.logsumexp(logits, dim=1) - picked
        del logits
        total = total + torch.where(yc != ignore_index, nll, 0.0).sum()
    if reduction == "mean":
        total = total / (y != ignore_index).sum()
    return total.to(hidden.dtype)


def _grads(grad: Tensor, hidden: Tensor, weight: Tensor, labels: Tensor, chunk: int,
           ignore_index: int, reduction: str, want: tuple[bool, bool] = (True, True)
           ) -> tuple[Tensor | None, Tensor | None]:
    """The gradients of ``hidden`` and ``weight`` (those ``want`` asks for) of the loss
    scaled by ``grad``: per chunk, ``(softmax(logits) - onehot(labels)) * scale``."""
    h, y = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    rows, starts = _starts(h, weight, chunk, 1 + want[0] + want[1])
    scale = grad.to(torch.promote_types(grad.dtype, torch.float32))
    if reduction == "mean":
        scale = scale / (y != ignore_index).sum()
    dh = torch.empty_like(h) if want[0] else None
    dw = torch.zeros_like(weight) if want[1] else None
    for s in starts:
        hc, yc = h[s:s + rows], y[s:s + rows]
        p = _chunk_logits(hc, weight)
        p.sub_(torch.logsumexp(p, dim=1, keepdim=True)).exp_()          # softmax, in place
        p.scatter_add_(1, yc.clamp(min=0).unsqueeze(1), torch.full_like(p[:, :1], -1.0))
        p.mul_(torch.where(yc != ignore_index, scale, 0.0).unsqueeze(1))
        g = p.to(h.dtype)
        del p
        if dh is not None:
            dh[s:s + rows] = g @ weight
        if dw is not None:
            torch.addmm(dw, g.t(), hc, out=dw)   # counted by FlopCounterMode, addmm_ is not
        del g   # before the next chunk's logits
    return (None if dh is None else dh.view_as(hidden)), dw


# --- the op a capture records ---------------------------------------------------------

@torch.library.custom_op("fxpipe::linear_cross_entropy", mutates_args=())
def _op(hidden: Tensor, weight: Tensor, labels: Tensor, chunk: int, ignore_index: int,
        reduction: str) -> Tensor:
    return _loss(hidden, weight, labels, chunk, ignore_index, reduction)


@_op.register_fake
def _(hidden, weight, labels, chunk, ignore_index, reduction):
    return hidden.new_empty(())


def _op_setup(ctx, inputs, output):
    hidden, weight, labels, *options = inputs
    ctx.save_for_backward(hidden, weight, labels)
    ctx.options = tuple(options)


_op.register_autograd(_LinearCrossEntropy.backward, setup_context=_op_setup)


@torch.library.custom_op("fxpipe::matmul_flops", mutates_args=())
def _matmul_flops(a: Tensor, b: Tensor, times: int) -> None:
    """Nothing: stands for ``times`` more ``a @ b.t()`` for ``FlopCounterMode`` (costing
    runs one chunk of each shape, see ``_starts``)."""
    return None


@_matmul_flops.register_fake
def _(a, b, times):
    return None


@register_flop_formula(torch.ops.fxpipe.matmul_flops)
def _(a_shape, b_shape, times, *args, out_shape=None, **kwargs) -> int:
    return 2 * times * a_shape[0] * a_shape[1] * b_shape[0]
