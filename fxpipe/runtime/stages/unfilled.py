"""A recompute that records some of a stage's nodes for autograd without computing them.

``passes.recompute`` names the nodes (``Stage.unfilled``) whose values backward does not
read. Recomputing for backward, the stage's runnable code (``runtime.stages.stage_code``) runs
each of them inside :class:`Unfilled`: autograd records every op as usual (the same
derivative formula, saving the same input tensors), but the compute kernels below
autograd (``mm``, ``addmm``, ``bmm``, ``baddbmm``, ``add``) do not run; their outputs
are allocated and left unwritten. Backward then runs autograd's own formulas for those ops, which read
their inputs and never their outputs, so the gradients are the ones a full recompute
gives, bit for bit, on any backend: the same kernels run on the same tensors.

View ops run as usual on unwritten values; any other op that would read one raises (a
node needing a value must not be left unfilled: ``passes.recompute`` guarantees it).

>>> import torch.nn.functional as F
>>> x, w = torch.randn(3, 4), torch.randn(2, 4, requires_grad=True)
>>> with Unfilled():
...     y = F.linear(x, w)                   # recorded for autograd, matmul not run
>>> y.grad_fn.name()
'MmBackward0'
>>> backprop([(y, torch.ones(3, 2))])
>>> ref = w.detach().clone().requires_grad_()
>>> F.linear(x, ref).backward(torch.ones(3, 2))
>>> torch.equal(w.grad, ref.grad)
True
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
# ops whose derivative formulas (derivatives.yaml) read their inputs only, never their result
SKIPPED = frozenset({aten.mm.default, aten.addmm.default, aten.bmm.default,
                     aten.baddbmm.default, aten.add.Tensor})
_IN_PLACE = frozenset({aten.add_.Tensor})   # a bias added into an unwritten matmul result
_METADATA = frozenset({aten._unsafe_view.default})  # a view the schema does not mark as one


class Unfilled(TorchDispatchMode):
    """Inside it, the ops in ``SKIPPED`` return unwritten tensors (see the module docstring)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = _tensors(args, kwargs)
        reads_unwritten = any(_is_unwritten(t) for t in tensors)
        if func in SKIPPED:
            shape = _contiguous_result(func, args, kwargs)
            if shape is not None:
                return _mark(torch.empty(shape, dtype=tensors[0].dtype, device=tensors[0].device))
            meta = func(*pytree.tree_map_only(torch.Tensor, _meta, args),
                        **pytree.tree_map_only(torch.Tensor, _meta, kwargs))
            out = torch.empty_strided(meta.shape, meta.stride(), dtype=meta.dtype,
                                      device=tensors[0].device)
            return _mark(out)
        if func in _IN_PLACE and _is_unwritten(args[0]):
            return args[0]
        out = func(*args, **kwargs)
        if reads_unwritten:
            if not (func.is_view or func in _METADATA):
                raise RuntimeError(
                    f"fxpipe internal error: {func} reads a value the recompute for backward "
                    "skipped (Stage.unfilled must hold only values backward never reads)")
            pytree.tree_map_only(torch.Tensor, _mark, out)
        return out


def _tensors(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors an aten op takes: its arguments, and those in list arguments (an op's
    schema nests no deeper); the pytree walk costs more on the host than most ops."""
    out = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out += [t for t in a if isinstance(t, torch.Tensor)]
    return out


def _contiguous_result(func: Any, args: tuple, kwargs: dict) -> tuple[int, ...] | None:
    """The shape of ``func``'s result where it is a new contiguous tensor of its
    inputs' dtype without running anything: the matmuls, and an add of two contiguous
    tensors of one shape and dtype. None: ask the op's meta function (slower on the
    host: many are Python)."""
    if kwargs and func is not aten.add.Tensor:
        return None
    if func is aten.mm.default or func is aten.bmm.default:
        a, b = args
        return (*a.shape[:-1], b.shape[-1])
    if func is aten.addmm.default or func is aten.baddbmm.default:
        _, a, b = args[:3]
        return (*a.shape[:-1], b.shape[-1])
    a, b = args[0], args[1]
    if isinstance(b, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype \
            and a.is_contiguous() and b.is_contiguous():
        return tuple(a.shape)
    return None


def _meta(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


def _mark(t: torch.Tensor) -> torch.Tensor:
    t._fxpipe_unwritten = True
    return t


def _is_unwritten(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and getattr(t, "_fxpipe_unwritten", False)


def backprop(pairs: Iterable[tuple[Any, torch.Tensor | None]]) -> None:
    """Back-propagate each ``(value, grad)`` in one autograd call; values without a
    gradient, or that need none, are skipped, and a value listed twice gets the sum."""
    tensors, grads = _roots(pairs)
    if tensors:
        torch.autograd.backward(tensors, grads)


def grads_of(pairs: Iterable[tuple[Any, torch.Tensor | None]],
             inputs: list[torch.Tensor]) -> tuple[torch.Tensor | None, ...]:
    """:func:`backprop`'s gradients of ``inputs`` returned instead of accumulated into
    ``.grad`` (``None`` for one the values do not depend on): what a device graph of a
    backward captures (``runtime.stages.graphs``)."""
    tensors, grads = _roots(pairs)
    if not tensors or not inputs:
        return (None,) * len(inputs)
    return torch.autograd.grad(tensors, inputs, grads, allow_unused=True)


def _roots(pairs: Iterable[tuple[Any, torch.Tensor | None]]) -> tuple[list, list]:
    roots: dict[int, list] = {}  # id(tensor) -> [tensor, summed grad]
    for value, grad in pairs:
        if grad is None or not (isinstance(value, torch.Tensor) and value.requires_grad):
            continue
        root = roots.setdefault(id(value), [value, None])
        root[1] = grad if root[1] is None else root[1] + grad
    return [r[0] for r in roots.values()], [r[1] for r in roots.values()]
