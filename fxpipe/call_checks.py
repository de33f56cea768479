"""What a ``PipelineModule`` checks of a call before anything of it runs, beyond its inputs'
structure (``fxpipe.runtime.issue.inputs``) and rows (``fxpipe.runtime.issue.microbatch``): gradients
that would be lost, fp16 without loss scaling, an optimizer that holds none of the
model's parameters; and what every rank of a data-parallel pipe must agree on.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.utils._pytree as pytree

from fxpipe.config import RunConfig
from fxpipe.graph_cache import CompiledGraph
from fxpipe.optim import Overlapped
from fxpipe.runtime.stages import amp
from fxpipe.runtime.issue.distributed import DataParallel
from fxpipe.runtime.issue.microbatch import PackedData


def digest(compiled: CompiledGraph, param_dtype: torch.dtype | None,
            dp: DataParallel) -> dict[str, Any]:
    """What must be equal on every rank of a data-parallel pipe (``check_same``): the plan
    (its collectives must match), the parameters and buffers (names, shapes, dtypes:
    the buckets must match) and the options that change the Program."""
    lg, plan = compiled.layers, compiled.plan
    spans = lambda rs: [f"{r.start}:{r.stop}" for r in rs]  # noqa: E731
    return {
        "the number of layers": len(lg),
        "the plan's forward stages": spans(plan.fwd_plan),
        "the plan's backward stages": spans(plan.bwd_plan),
        "the parameters (name, shape, dtype, requires_grad)": [
            (n, tuple(p.shape), str(p.dtype), p.requires_grad) for n, p in lg.params.items()],
        "the buffers (name, shape, dtype)": [
            (n, tuple(b.shape), str(b.dtype)) for n, b in lg.buffers.items()],
        "param_dtype": str(param_dtype),
        "shard_optimizer / broadcast_buffers": (dp.shard, dp.broadcast),
    }


def check_differentiable(args: tuple, kwargs: dict, cfg: RunConfig) -> None:
    """Refuse what would silently lose gradients: PackedData in and out are not
    differentiable (their microbatches bypass the merged autograd graph)."""
    if cfg.merge_output is False:
        raise NotImplementedError(
            "merge_output=False (PackedData outputs) is not differentiable yet, and this call "
            "needs gradients: run it under torch.no_grad() or RunConfig(requires_grad=False) "
            "for inference, or keep the default merge_output to train through the output")
    for x in (*args, *kwargs.values()):
        if isinstance(x, PackedData) and any(isinstance(t, torch.Tensor) and t.requires_grad
                                             for t in pytree.tree_leaves(list(x))):
            raise NotImplementedError(
                "a PackedData input requires grad, but gradients cannot flow back through "
                "PackedData yet: pass the merged tensor (merge_output=True on the pipe that "
                "made it) to train through both pipes")


def check_loss_scaling(param_dtype: torch.dtype | None, optimizer: Overlapped | None) -> None:
    """A step computing in float16 (``param_dtype`` or autocast) needs its loss scaled,
    which ``forward_backward`` does only with a ``GradScaler``: else ``ValueError``."""
    fp16 = param_dtype == torch.float16 or any(dtype == torch.float16
                                               for _, dtype, _ in amp.captured())
    scaler = optimizer.scaler if optimizer is not None else None
    if fp16 and (scaler is None or not scaler.is_enabled()):
        raise ValueError(
            "forward_backward computing in float16 (param_dtype or autocast) without loss "
            "scaling: fp16 gradients underflow to 0. Pass optimizer=fxpipe.optim.overlapped("
            "opt, scaler=torch.amp.GradScaler()) (the pipeline scales the loss, unscales and "
            "skips inf steps as eager AMP does; call scaler.update() after), or compute in "
            "torch.bfloat16, which needs no scaling.")


def check_optimizer_holds(optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
    """Refuse an ``optimizer=`` that holds none of ``model``'s trainable parameters (built
    on a copy of the model, or on another one): its step would change nothing and the
    gradients would keep accumulating in ``.grad``."""
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    trainable = [p for p in model.parameters() if p.requires_grad]
    if not trainable or any(id(p) in held for p in trainable):
        return
    n = len(held)
    raise ValueError(
        f"optimizer= ({type(optimizer).__name__}) holds none of the trainable parameters of "
        f"the compiled {type(model).__name__} ({n} tensor{'s' if n != 1 else ''} in its "
        "param groups, none of them this model's): its step would change nothing while the "
        "gradients keep accumulating. Build it on the model you compiled, e.g. "
        "torch.optim.AdamW(model.parameters()) (not on a copy of it).")


def as_example_tuple(example_inputs: Any) -> tuple:
    """``compile``'s ``example_inputs`` as a tuple (one tensor becomes ``(x,)``)."""
    if isinstance(example_inputs, tuple):
        return example_inputs
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,)
    raise TypeError(f"example_inputs must be a tuple of positional arguments, got "
                    f"{type(example_inputs).__name__}; write example_inputs=(x,)")
