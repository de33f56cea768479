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

Captured (fx, export or dynamo) or traced by AOTAutograd (``stage_backend="inductor"``)
it is one opaque op, ``torch.ops.fxpipe.linear_cross_entropy``, whose backward is another
(``fxpipe::linear_cross_entropy_backward``), so compiled code runs every chunk;
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
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor
from torch.utils.flop_counter import register_flop_formula

CHUNK_BYTES = 2**28
"""The default chunk: as many tokens as make 256 MiB of fp32 logits."""


def linear_cross_entropy(hidden: Tensor, weight: Tensor, labels: Tensor, chunk_size: int | None = None,
                         ignore_index: int = -100, reduction: str = "mean", *,
                         bias: Tensor | None = None, softcap: float | None = None,
                         out_dtype: torch.dtype | None = None) -> Tensor:
    """``F.cross_entropy(F.linear(hidden, weight, bias).flatten(0, -2), labels.flatten(),
    ignore_index=ignore_index, reduction=reduction)`` without the logits (module
    docstring). ``hidden``: ``(..., H)``; ``weight``: ``(V, H)`` (an LM head's);
    ``bias``: ``(V,)`` or ``None``; ``labels``: ``(...)`` class indices; ``chunk_size``:
    tokens per chunk (``None`` or 0: ``CHUNK_BYTES`` of fp32 logits); ``reduction``:
    ``"mean"`` (over labels that are not ``ignore_index``) or ``"sum"``; ``softcap``: the
    logits are ``softcap * tanh(logits / softcap)`` first (Gemma 2's final soft-capping),
    in the matmul's dtype. The logits are made in the matmul's dtype (``weight``'s, or
    autocast's) and the loss computed from them in fp32 (as Hugging Face's loss upcasts
    them); the backward's matmuls run in that same dtype. The loss has ``out_dtype``
    (``None``: ``hidden``'s); ``weight``'s gradient is summed over chunks in ``weight``'s
    dtype, ``bias``'s in fp32.
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"linear_cross_entropy: reduction must be 'mean' or 'sum', got {reduction!r}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"linear_cross_entropy: softcap must be > 0 or None, got {softcap!r}")
    chunk = chunk_size or 0
    options = (chunk, ignore_index, reduction, softcap, out_dtype)
    if isinstance(hidden, (fx.Proxy, FunctionalTensor)) or torch.compiler.is_compiling():
        # traced (fx, dynamo, or AOTAutograd: stage_backend="inductor"): the opaque op,
        # whose forward and backward run the chunks on real tensors when the code runs
        return torch.ops.fxpipe.linear_cross_entropy(hidden, weight, labels, bias, *options)
    _check(hidden, weight, labels, bias)
    return _LinearCrossEntropy.apply(hidden, weight, labels, bias, *options)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, bias, chunk, ignore_index, reduction, softcap, out_dtype):
        ctx.save_for_backward(hidden, weight, labels, bias)
        ctx.options = chunk, ignore_index, reduction, softcap
        # the matmul's dtype (autocast's, if on): the backward's matmuls run in it too
        ctx.compute_dtype = _compute_dtype(hidden, weight)
        return _loss(hidden, weight, labels, bias, chunk, ignore_index, reduction, softcap, out_dtype)

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, labels, bias = ctx.saved_tensors
        dh, dw, db = _grads(grad, hidden, weight, labels, bias, *ctx.options,
                            compute_dtype=ctx.compute_dtype,
                            want=(ctx.needs_input_grad[0], ctx.needs_input_grad[1],
                                  ctx.needs_input_grad[3]))
        return dh, dw, None, db, None, None, None, None, None


def _check(hidden: Tensor, weight: Tensor, labels: Tensor, bias: Tensor | None) -> None:
    if weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"linear_cross_entropy: weight must be (vocab, {hidden.shape[-1]}) for "
                         f"hidden of shape {tuple(hidden.shape)}, got {tuple(weight.shape)}")
    if labels.shape != hidden.shape[:-1]:
        raise ValueError(f"linear_cross_entropy: labels must have shape {tuple(hidden.shape[:-1])} "
                         f"(hidden without its last dim), got {tuple(labels.shape)}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"linear_cross_entropy: bias must be ({weight.shape[0]},), got "
                         f"{tuple(bias.shape)}")


def _compute_dtype(hidden: Tensor, weight: Tensor) -> torch.dtype:
    """The dtype the head's matmuls compute in: autocast's when it is on; else, where
    ``hidden`` and ``weight`` differ (a matmul of two dtypes, which ``F.linear`` refuses),
    the narrower one: what autocast chose when the code around the op was traced (stage
    code compiled under autocast runs with its casts in the graph and autocast off:
    ``runtime.stages.compiled``, so the op meets bf16 hidden states and fp32 weights)."""
    device = hidden.device.type
    if device != "meta" and hidden.is_floating_point() and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    wide = torch.promote_types(hidden.dtype, weight.dtype)
    if hidden.dtype != weight.dtype and hidden.is_floating_point() and weight.is_floating_point():
        return weight.dtype if wide == hidden.dtype else hidden.dtype
    return wide


def _starts(h: Tensor, weight: Tensor, chunk: int, matmuls: int) -> tuple[int, list[int]]:
    """Rows per chunk and the chunks' first rows; on fake or meta tensors the first and
    the last chunk only, the others' ``matmuls`` head matmuls each counted as FLOPs."""
    n = h.shape[0]
    rows = chunk if chunk > 0 else max(1, min(n, CHUNK_BYTES // (4 * weight.shape[0])))
    starts = list(range(0, n, rows))
    if len(starts) > 2 and (isinstance(h, FakeTensor) or h.device.type == "meta"):
        torch.ops.fxpipe.matmul_flops(h[:rows], weight, (len(starts) - 2) * matmuls)
        starts = [starts[0], starts[-1]]
    return rows, starts


def _chunk_logits(h: Tensor, weight: Tensor, bias: Tensor | None, softcap: float | None
                  ) -> tuple[Tensor, Tensor | None]:
    """One chunk's logits in fp32 at least (soft-capped in the matmul's dtype first), and
    with ``softcap`` the derivative of the capping, ``1 - tanh(z / softcap)**2`` (fp32)."""
    logits = F.linear(h, weight, bias)
    slope = None
    if softcap is not None:
        t = torch.tanh(logits / softcap)
        slope = 1 - t.float().square()
        logits = t * softcap
    return logits.to(torch.promote_types(logits.dtype, torch.float32)), slope


def _loss(hidden: Tensor, weight: Tensor, labels: Tensor, bias: Tensor | None, chunk: int,
          ignore_index: int, reduction: str, softcap: float | None,
          out_dtype: torch.dtype | None) -> Tensor:
    h, y = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    rows, starts = _starts(h, weight, chunk, 1)
    total = torch.zeros((), dtype=torch.promote_types(h.dtype, torch.float32), device=h.device)
    cd = _compute_dtype(hidden, weight)   # autocast's cast, made here (as in _grads)
    w, b = weight.to(cd), None if bias is None else bias.to(cd)
    for s in starts:
        with torch.autocast(h.device.type, enabled=False):
            logits, _ = _chunk_logits(h[s:s + rows].to(cd), w, b, softcap)
        yc = y[s:s + rows]
        picked = logits.gather(1, yc.clamp(min=0).unsqueeze(1)).squeeze(1)
        nll = torch.logsumexp(logits, dim=1) - picked
        del logits
        total = total + torch.where(yc != ignore_index, nll, 0.0).sum()
    if reduction == "mean":
        total = total / (y != ignore_index).sum()
    return total.to(out_dtype or hidden.dtype)


def _grads(grad: Tensor, hidden: Tensor, weight: Tensor, labels: Tensor, bias: Tensor | None,
           chunk: int, ignore_index: int, reduction: str, softcap: float | None = None, *,
           compute_dtype: torch.dtype | None = None, want: tuple[bool, bool, bool] = (True, True, True)
           ) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """The gradients of ``hidden``, ``weight`` and ``bias`` (those ``want`` asks for) of
    the loss scaled by ``grad``: per chunk, ``(softmax(logits) - onehot(labels)) * scale``
    (times the capping's slope), in ``compute_dtype`` for the matmuls."""
    h, y = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    cd = compute_dtype or torch.promote_types(hidden.dtype, weight.dtype)
    rows, starts = _starts(h, weight, chunk, 1 + want[0] + want[1])
    scale = grad.to(torch.promote_types(grad.dtype, torch.float32))
    if reduction == "mean":
        scale = scale / (y != ignore_index).sum()
    w = weight.to(cd)
    dh = torch.empty_like(h) if want[0] else None
    dw = torch.zeros_like(weight) if want[1] else None
    db = torch.zeros_like(bias, dtype=torch.promote_types(bias.dtype, torch.float32)) \
        if want[2] and bias is not None else None
    for s in starts:
        hc, yc = h[s:s + rows].to(cd), y[s:s + rows]
        with torch.autocast(h.device.type, enabled=False):
            p, slope = _chunk_logits(hc, w, None if bias is None else bias.to(cd), softcap)
        p.sub_(torch.logsumexp(p, dim=1, keepdim=True)).exp_()          # softmax, in place
        p.scatter_add_(1, yc.clamp(min=0).unsqueeze(1), torch.full_like(p[:, :1], -1.0))
        p.mul_(torch.where(yc != ignore_index, scale, 0.0).unsqueeze(1))
        if slope is not None:
            p.mul_(slope)
            del slope
        if db is not None:
            db += p.sum(0)
        g = p.to(cd)
        del p
        if dh is not None:
            dh[s:s + rows] = g @ w
        if dw is not None:
            if dw.dtype == cd:
                torch.addmm(dw, g.t(), hc, out=dw)   # counted by FlopCounterMode, addmm_ is not
            else:
                dw.add_(g.t() @ hc)                  # autocast: its products, summed in fp32
        del g   # before the next chunk's logits
    return ((None if dh is None else dh.view_as(hidden)), dw,
            None if db is None else db.to(bias.dtype))


# --- the op a capture records ---------------------------------------------------------

@torch.library.custom_op("fxpipe::linear_cross_entropy", mutates_args=())
def _op(hidden: Tensor, weight: Tensor, labels: Tensor, bias: Tensor | None, chunk: int,
        ignore_index: int, reduction: str, softcap: float | None,
        out_dtype: torch.dtype | None) -> Tensor:
    return _loss(hidden, weight, labels, bias, chunk, ignore_index, reduction, softcap, out_dtype)


@_op.register_fake
def _(hidden, weight, labels, bias, chunk, ignore_index, reduction, softcap, out_dtype):
    return hidden.new_empty((), dtype=out_dtype or hidden.dtype)


def _op_setup(ctx, inputs, output):
    hidden, weight, labels, bias, *options = inputs
    ctx.save_for_backward(hidden, weight, labels, bias)
    ctx.options = tuple(options[:4])
    ctx.compute_dtype = _compute_dtype(hidden, weight)


def _op_grads(ctx, grad):
    """The op's backward: another opaque op, so a trace of it (AOTAutograd's) runs the
    chunks when the code runs instead of recording them on fake tensors."""
    hidden, weight, labels, bias = ctx.saved_tensors
    want = (ctx.needs_input_grad[0], ctx.needs_input_grad[1],
            bias is not None and ctx.needs_input_grad[3])
    dh, dw, db = torch.ops.fxpipe.linear_cross_entropy_backward(
        grad, hidden, weight, labels, bias, *ctx.options, ctx.compute_dtype, *want)
    return (dh if want[0] else None, dw if want[1] else None, None,
            db if want[2] else None, None, None, None, None, None)


@torch.library.custom_op("fxpipe::linear_cross_entropy_backward", mutates_args=())
def _op_backward(grad: Tensor, hidden: Tensor, weight: Tensor, labels: Tensor,
                 bias: Tensor | None, chunk: int, ignore_index: int, reduction: str,
                 softcap: float | None, compute_dtype: torch.dtype, want_hidden: bool,
                 want_weight: bool, want_bias: bool) -> tuple[Tensor, Tensor, Tensor]:
    """``_grads``; a gradient not wanted is an empty tensor (an op returns tensors)."""
    grads = _grads(grad, hidden, weight, labels, bias, chunk, ignore_index, reduction, softcap,
                   compute_dtype=compute_dtype, want=(want_hidden, want_weight, want_bias))
    return tuple(g if g is not None else hidden.new_empty(0) for g in grads)


@_op_backward.register_fake
def _(grad, hidden, weight, labels, bias, chunk, ignore_index, reduction, softcap,
      compute_dtype, want_hidden, want_weight, want_bias):
    return (torch.empty_like(hidden) if want_hidden else hidden.new_empty(0),
            torch.empty_like(weight) if want_weight else hidden.new_empty(0),
            torch.empty_like(bias) if want_bias else hidden.new_empty(0))


_op.register_autograd(_op_grads, setup_context=_op_setup)


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
