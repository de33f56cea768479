"""Eager-style training: ``out = pipe(x); loss_fn(out, y).backward()``.

``PipelineFunction`` runs the forward stages (keeping only stage inputs, on the host)
in ``forward``, and the backward stages (recompute, then back-propagate, round-robin)
in ``backward``. Its inputs are the call's input tensors *and* the parameters, so
autograd itself adds the parameter gradients to ``.grad`` — only when the whole
backward succeeded — and hands input gradients back to inputs that require grad.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree

from fxpipe.runtime.issue.pipeline import TrainCall


class PipelineFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, call: TrainCall, leaf_slots: list, params: list, *tensors):
        merged = call.forward()
        flat, spec = pytree.tree_flatten(merged)
        ctx.call, ctx.params, ctx.leaf_slots = call, params, leaf_slots
        ctx.num_inputs = len(tensors) - len(params)
        ctx.out_spec = spec
        outs = tuple(x for x in flat if isinstance(x, torch.Tensor))
        ctx.mark_non_differentiable(*[o for o in outs if not o.is_floating_point()])
        ctx.tensor_pos = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor)]
        ctx.num_leaves = len(flat)
        call.merged_flat, call.merged_spec = flat, spec
        return outs

    @staticmethod
    def backward(ctx, *grads):
        flat_grads: list[Any] = [None] * ctx.num_leaves
        for pos, g in zip(ctx.tensor_pos, grads):
            flat_grads[pos] = g
        per_mb, param_grads = ctx.call.backward(flat_grads)
        input_grads = []
        for name, split_dim in ctx.leaf_slots:  # the call's input tensors, in apply order
            parts = [g[name] for g in per_mb]
            if all(p is None for p in parts):
                input_grads.append(None)
            elif split_dim is None:  # replicated into every microbatch: gradients add
                input_grads.append(sum(p for p in parts if p is not None))
            else:
                input_grads.append(torch.cat(parts, dim=split_dim))
        return (None, None, None, *input_grads,
                *[param_grads.get(id(p)) for p in ctx.params])


def train_call(call: TrainCall, inputs: list[tuple[str, torch.Tensor, int | None]],
               params: list[torch.Tensor]) -> Any:
    """Run ``call`` as a differentiable function of ``inputs`` (name, tensor, split dim)
    and ``params``; returns the merged output structure."""
    leaf_slots = [(name, dim) for name, _, dim in inputs]
    outs = PipelineFunction.apply(call, leaf_slots, params, *[t for _, t, _ in inputs], *params)
    flat = list(call.merged_flat)
    for pos, o in zip([i for i, x in enumerate(flat) if isinstance(x, torch.Tensor)], outs):
        flat[pos] = o
    return pytree.tree_unflatten(flat, call.merged_spec)
