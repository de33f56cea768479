"""Capturing a model in ``param_dtype``: its floating parameters (and the buffers
``passes.buffer_dtypes`` finds) stood in for by copies in that dtype while tracing
(:func:`parameters_in`), the graph's attributes pointed back at the model's own tensors
after (:func:`rebind`), and a graph whose products mix floating dtypes refused
(:func:`check_operand_dtypes`: ``MixedDtypeError``, which ``capture`` reports by op and
module). Floating inputs are cast as the devices get them (:func:`cast_floating`).
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Collection, Iterator
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from fxpipe import quant
from fxpipe.passes import fetch_attr
from fxpipe.runtime.stages import amp


def cast_floating(x: Any, dtype: torch.dtype | None) -> Any:
    """``x`` in ``dtype`` if it is a floating tensor and ``dtype`` is given (how a mixed-
    precision pipe's floating inputs reach the devices), else ``x``."""
    if dtype is not None and isinstance(x, torch.Tensor) and x.is_floating_point() \
            and x.dtype != dtype:
        return x.detach().to(dtype).requires_grad_(x.requires_grad)
    return x


@contextlib.contextmanager
def parameters_in(model: nn.Module, dtype: torch.dtype | None, values: bool = True,
                  buffers: Collection[torch.Tensor] = ()) -> Iterator[dict[int, torch.Tensor]]:
    """Within the block, each floating parameter of ``model`` is stood in for by a
    ``dtype`` tensor of its shape (a tied parameter by one, wherever it is registered),
    as a device holds it under ``param_dtype``, and so is each of ``buffers`` (those
    ``passes.buffer_dtypes`` finds; the others are left alone); yields ``{id(stand-in):
    the model's tensor}``. With ``values`` the parameters' stand-ins are copies of their
    values (a capture at block granularity runs the model once); else uninitialized
    memory that is never touched (tracing reads no value), so capturing a model bound to
    a checkpoint (``weights=``) reads none of it into memory. The buffers' are always
    copies (a trace may read or update one). Quantized weights (``fxpipe.quant``)
    dequantize to ``dtype``. On the tensors' device (``meta`` stays ``meta``); nothing
    of the model changes after the block.

    >>> lin = nn.Linear(2, 2)
    >>> with parameters_in(lin, torch.bfloat16) as masters:
    ...     lin.weight.dtype, masters[id(lin.weight)] is not lin.weight
    (torch.bfloat16, True)
    >>> lin.weight.dtype
    torch.float32
    """
    if dtype is None:
        yield {}
        return
    with quant.dequantizing_to(model, dtype), _swapped(model, dtype, values, buffers) as m:
        yield m


@contextlib.contextmanager
def _swapped(model: nn.Module, dtype: torch.dtype, values: bool,
             buffers: Collection[torch.Tensor]) -> Iterator[dict[int, torch.Tensor]]:
    copies: dict[int, torch.Tensor] = {}
    masters: dict[int, torch.Tensor] = {}
    swapped: list[tuple[dict, str, torch.Tensor]] = []
    low = {id(b) for b in buffers}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None or not p.is_floating_point() or p.dtype == dtype:
                continue
            if id(p) not in copies:
                with torch.no_grad():
                    t = p.detach().to(dtype) if values else \
                        torch.empty(p.shape, dtype=dtype, device=p.device)
                copies[id(p)] = nn.Parameter(t, requires_grad=p.requires_grad)
                masters[id(copies[id(p)])] = p
            swapped.append((module._parameters, name, p))
            module._parameters[name] = copies[id(p)]
        for name, b in list(module._buffers.items()):
            if b is None or id(b) not in low:
                continue
            if id(b) not in copies:
                copies[id(b)] = b.detach().to(dtype)
                masters[id(copies[id(b)])] = b
            swapped.append((module._buffers, name, b))
            module._buffers[name] = copies[id(b)]
    try:
        yield masters
    finally:
        for where, name, t in swapped:
            where[name] = t


_aten = torch.ops.aten
# ops whose two floating operands (at these argument positions) must have one dtype: as
# export records them, and as fx does
_SAME_DTYPE_OPERANDS = {
    _aten.mm.default: (0, 1), _aten.bmm.default: (0, 1), _aten.matmul.default: (0, 1),
    _aten.mv.default: (0, 1), _aten.dot.default: (0, 1), _aten.linear.default: (0, 1),
    _aten.addmm.default: (1, 2), _aten.baddbmm.default: (1, 2), _aten.addmv.default: (1, 2),
    _aten.convolution.default: (0, 1), _aten.conv1d.default: (0, 1),
    _aten.conv2d.default: (0, 1), _aten.conv3d.default: (0, 1),
    torch._C._nn.linear: (0, 1), torch.matmul: (0, 1), operator.matmul: (0, 1),
    torch.mm: (0, 1), torch.bmm: (0, 1), torch.conv1d: (0, 1), torch.conv2d: (0, 1),
    torch.conv3d: (0, 1),
}


class MixedDtypeError(RuntimeError):
    """The captured graph multiplies tensors of two dtypes (names the op and module)."""


def check_operand_dtypes(gm: fx.GraphModule) -> None:
    """Refuse a graph whose matrix products or convolutions mix floating dtypes outside an
    autocast region: the model's own code does (under ``param_dtype``, an fp32 value it
    makes explicitly meets a bf16 weight), and a device would fail on it as eager does,
    only later, as a stage error. Before ``rebind``: a weight is the tensor a device holds."""
    if amp.captured():   # autocast casts the operands when the graph runs
        return

    def value(a: Any) -> Any:
        if not isinstance(a, fx.Node):
            return None
        return fetch_attr(gm, a.target) if a.op == "get_attr" else a.meta.get("val")
    for n in gm.graph.nodes:
        positions = _SAME_DTYPE_OPERANDS.get(n.target) if n.op == "call_function" else None
        if positions is None:
            continue
        vals = [value(n.args[i]) for i in positions if i < len(n.args)]
        dtypes = [v.dtype for v in vals if isinstance(v, torch.Tensor) and v.is_floating_point()]
        if len(set(dtypes)) > 1:
            where = n.meta.get("module_path") or "the model's own forward"
            op = getattr(getattr(n.target, "overloadpacket", n.target), "__name__", n.target)
            raise MixedDtypeError(f"{op} ({n.name}) in {where} multiplies a {dtypes[0]} tensor "
                                  f"by a {dtypes[1]} one, which it cannot mix")


def rebind(gm: fx.GraphModule, masters: dict[int, torch.Tensor]) -> None:
    """Point ``gm``'s attributes that are stand-ins (:func:`parameters_in`) back at the
    model's own parameters and buffers, which the captured graph reads."""
    if not masters:
        return
    for n in gm.graph.nodes:
        if n.op != "get_attr":
            continue
        owner, _, name = n.target.rpartition(".")
        module = gm.get_submodule(owner)
        master = masters.get(id(getattr(module, name)))
        if master is None:
            continue
        if name in module._parameters:
            module._parameters[name] = master
        elif name in module._buffers:
            module._buffers[name] = master
        else:
            setattr(module, name, master)
