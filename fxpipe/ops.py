"""The ops that appear in lowered stage graphs (``torch.ops.fxpipe.*``).

=====================================  =================================================
``prefetch(params, stage, device)``     the stage's parameters and buffers → device
``upload(x, device)``                   an input / boundary activation → device
``offload(x)``                          a boundary activation → host
``writeback(host, value)``              a buffer the stage updated (BatchNorm stats) → host
``release(params, stage)``              the device may free the stage's parameters
``rng(layer)``                          a layer drawing random numbers starts here
``dequantize(blob, fmt, shape, dtype)``  a quantized frozen weight's values, on the device
                                       (``fxpipe.quant``; ``frozen_dtype=``)
``chunk_attention(q, k, v, slot, ...)``  a token chunk's attention over the chunks before
                                       (``fxpipe.sequence_kv``; ``sequence_chunks=``)
=====================================  =================================================

They are real ops (``torch.library.custom_op``) with autograd formulas, so a stage graph
is an ordinary differentiable program: called directly (``pipe.stages[1].gm(x)``) it runs
on the host, each transfer a copy, gradients flowing back through ``prefetch`` to the
model's own parameters. The runtime executes the same graph node by node
(``fxpipe.runtime.stages.stage_code``), serving these nodes from what its Program's transfer
actions put on the device.
"""

from __future__ import annotations

import torch
from torch import Tensor


@torch.library.custom_op("fxpipe::prefetch", mutates_args=())
def prefetch(params: list[Tensor], stage: int, device: int) -> list[Tensor]:
    """Copies of ``params`` resident on ``device`` for ``stage``."""
    return [p.detach().clone() for p in params]


@prefetch.register_fake
def _(params, stage, device):
    return [torch.empty_like(p) for p in params]


def _prefetch_setup(ctx, inputs, output):
    # buffers (and frozen parameters) stay non-differentiable on the device
    ctx.mark_non_differentiable(*[o for p, o in zip(inputs[0], output) if not p.requires_grad])


def _no_setup(ctx, inputs, output):
    pass


# Gradients of the device copies are the gradients of the host parameters.
prefetch.register_autograd(lambda ctx, grads: (list(grads), None, None),
                           setup_context=_prefetch_setup)


@torch.library.custom_op("fxpipe::upload", mutates_args=())
def upload(x: Tensor, device: int) -> Tensor:
    """``x`` copied to ``device``."""
    return x.detach().clone()


@upload.register_fake
def _(x, device):
    return torch.empty_like(x)


upload.register_autograd(lambda ctx, g: (g, None), setup_context=_no_setup)


@torch.library.custom_op("fxpipe::offload", mutates_args=())
def offload(x: Tensor) -> Tensor:
    """``x`` copied to the host."""
    return x.detach().clone()


@offload.register_fake
def _(x):
    return torch.empty_like(x)


offload.register_autograd(lambda ctx, g: g, setup_context=_no_setup)


@torch.library.custom_op("fxpipe::writeback", mutates_args=("host",))
def writeback(host: Tensor, value: Tensor) -> None:
    """Copy a buffer the stage updated on the device back into the model's buffer."""
    with torch.no_grad():
        host.copy_(value)


@writeback.register_fake
def _(host, value):
    return None


@torch.library.custom_op("fxpipe::release", mutates_args=())
def release(params: list[Tensor], stage: int) -> None:
    """The stage is done with its parameters on this device."""
    return None


@release.register_fake
def _(params, stage):
    return None


@torch.library.custom_op("fxpipe::rng", mutates_args=())
def rng(layer: int) -> None:
    """Marks the start of a layer that draws random numbers: the runtime seeds it from
    (call seed, layer, microbatch). Called directly, on the host, it does nothing."""
    return None


@rng.register_fake
def _(layer):
    return None
