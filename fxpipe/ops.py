"""The transfer ops that appear in lowered stage graphs (``torch.ops.fxpipe.*``).

=====================================  =================================================
``prefetch(params, stage, device)``     the stage's parameters and buffers → device
``upload(x, device)``                   an input / boundary activation → device
``offload(x)``                          a boundary activation → host
``writeback(host, value)``              a buffer the stage updated (BatchNorm stats) → host
``release(params, stage)``              the device may free the stage's parameters
=====================================  =================================================

They are real ops (``torch.library.custom_op``) with autograd formulas, so a stage graph
is an ordinary differentiable program: on the host (no runtime active) each transfer is
a copy, and gradients flow back through ``prefetch`` to the model's own parameters and
through ``upload``/``offload`` to the activations. A runtime that owns real devices
installs a ``Transfers`` implementation with ``using(transfers)``; the graph the user
printed is then executed as-is, with each transfer served by the device's streams.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence

import torch
from torch import Tensor

HOST = -1  # device index meaning "the host"


class Transfers:
    """How transfer ops move tensors. The default copies on the host."""

    def prefetch(self, params: Sequence[Tensor], stage: int, device: int) -> list[Tensor]:
        return [p.detach().clone() for p in params]

    def upload(self, x: Tensor, device: int) -> Tensor:
        return x.detach().clone()

    def offload(self, x: Tensor) -> Tensor:
        return x.detach().clone()

    def writeback(self, host: Tensor, value: Tensor) -> None:
        with torch.no_grad():
            host.copy_(value)

    def release(self, params: Sequence[Tensor], stage: int) -> None:
        return None

    def rng(self, layer: int) -> None:
        return None


_DEFAULT = Transfers()
_local = threading.local()


def current() -> Transfers:
    """The transfers in effect on this thread."""
    return getattr(_local, "transfers", _DEFAULT)


@contextlib.contextmanager
def using(transfers: Transfers) -> Iterator[None]:
    """Run transfer ops on this thread through ``transfers``."""
    prev = getattr(_local, "transfers", None)
    _local.transfers = transfers
    try:
        yield
    finally:
        if prev is None:
            del _local.transfers
        else:
            _local.transfers = prev


@torch.library.custom_op("fxpipe::prefetch", mutates_args=())
def prefetch(params: list[Tensor], stage: int, device: int) -> list[Tensor]:
    """Copies of ``params`` resident on ``device`` for ``stage``."""
    return current().prefetch(params, stage, device)


@prefetch.register_fake
def _(params, stage, device):
    return [torch.empty_like(p) for p in params]


def _prefetch_setup(ctx, inputs, output):
    # buffers (and frozen parameters) stay non-differentiable on the device
    params = inputs[0]
    ctx.mark_non_differentiable(*[o for p, o in zip(params, output) if not p.requires_grad])


def _no_setup(ctx, inputs, output):
    pass


def _prefetch_backward(ctx, grads):
    # Gradients of the device copies are the gradients of the host parameters.
    return list(grads), None, None


prefetch.register_autograd(_prefetch_backward, setup_context=_prefetch_setup)


@torch.library.custom_op("fxpipe::upload", mutates_args=())
def upload(x: Tensor, device: int) -> Tensor:
    """``x`` copied to ``device``."""
    return current().upload(x, device)


@upload.register_fake
def _(x, device):
    return torch.empty_like(x)


upload.register_autograd(lambda ctx, g: (g, None), setup_context=_no_setup)


@torch.library.custom_op("fxpipe::offload", mutates_args=())
def offload(x: Tensor) -> Tensor:
    """``x`` copied to the host."""
    return current().offload(x)


@offload.register_fake
def _(x):
    return torch.empty_like(x)


offload.register_autograd(lambda ctx, g: g, setup_context=_no_setup)


@torch.library.custom_op("fxpipe::writeback", mutates_args=("host",))
def writeback(host: Tensor, value: Tensor) -> None:
    """Copy a buffer the stage updated on the device back into the model's buffer."""
    current().writeback(host, value)


@writeback.register_fake
def _(host, value):
    return None


@torch.library.custom_op("fxpipe::release", mutates_args=())
def release(params: list[Tensor], stage: int) -> None:
    """The stage is done with its parameters on this device."""
    current().release(params, stage)


@release.register_fake
def _(params, stage):
    return None


@torch.library.custom_op("fxpipe::rng", mutates_args=())
def rng(layer: int) -> None:
    """Marks the start of a layer that draws random numbers: a runtime seeds it from
    (call seed, layer, microbatch). On the host, without a runtime, it does nothing."""
    current().rng(layer)


@rng.register_fake
def _(layer):
    return None


TRANSFER_OPS = (
    torch.ops.fxpipe.prefetch.default,
    torch.ops.fxpipe.upload.default,
    torch.ops.fxpipe.offload.default,
    torch.ops.fxpipe.writeback.default,
    torch.ops.fxpipe.release.default,
)
