"""Back-propagation through a stage whose linear tail was not recomputed.

``passes.recompute`` names the nodes (``Stage.tail``) whose values backward does not
need. The interpreter, recomputing for backward, makes a :class:`Deferred` for each
instead of running it. :func:`backprop` then walks the deferred nodes from the outputs
back, computing each one's input gradients from its inputs with the kernels autograd's
own formulas use (so the result is the same, bit for bit, as running the node and
back-propagating through it), and hands the gradients that reach real tensors to
autograd in one call.

A deferred node whose rule does not apply at run time (a non-contiguous input, mixed
dtypes) is computed after all, with grad, and back-propagated normally. Under autocast
nothing is deferred (``interpret.run_stage``): the ops would have run in another dtype.

>>> x = torch.randn(3, 4, requires_grad=True)
>>> w = torch.randn(2, 4, requires_grad=True)
>>> y = Deferred(torch._C._nn.linear, (x, w, None))
>>> backprop([(y, torch.ones(3, 2))])
>>> torch.equal(w.grad, torch.ones(3, 2).t().mm(x.detach()))
True
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import Any

import torch

from fxpipe.passes.recompute import ADD, IDENTITY, LINEAR

_order = itertools.count()


class Deferred:
    """A node's value that was not computed: its op and its (possibly deferred) inputs."""

    __slots__ = ("target", "args", "seq", "grad", "value")

    def __init__(self, target: Any, args: tuple):
        self.target, self.args = target, args
        self.seq = next(_order)  # made in graph order: a node after its inputs
        self.grad: torch.Tensor | None = None
        self.value: torch.Tensor | None = None  # once computed after all

    def materialize(self) -> Any:
        """Compute the value (with grad), its deferred inputs first."""
        if self.value is None:
            args = [a.materialize() if isinstance(a, Deferred) else a for a in self.args]
            self.value = args[0] if self.target in IDENTITY else self.target(*args)
        return self.value

    def __repr__(self) -> str:
        return f"Deferred({getattr(self.target, '__name__', self.target)})"


def backprop(pairs: Iterable[tuple[Any, torch.Tensor | None]]) -> None:
    """Back-propagate each ``(value, grad)``; values may be :class:`Deferred`."""
    roots: dict[int, list] = {}  # id(tensor) -> [tensor, summed grad]
    pending: dict[int, Deferred] = {}

    def send(value: Any, grad: torch.Tensor | None) -> None:
        if grad is None:
            return
        if isinstance(value, Deferred):
            value.grad = grad if value.grad is None else value.grad + grad
            pending[value.seq] = value
        elif isinstance(value, torch.Tensor) and value.requires_grad:
            root = roots.setdefault(id(value), [value, None])
            root[1] = grad if root[1] is None else root[1] + grad

    for value, grad in pairs:
        send(value, grad)
    while pending:
        d = pending.pop(max(pending))  # the latest first: all its users are done
        grads = _rule(d)
        if grads is None:  # the rule does not apply here: compute it after all
            send(d.materialize(), d.grad)
        else:
            for a, g in zip(d.args, grads):
                send(a, g)
    if roots:
        tensors, grads = zip(*roots.values())
        torch.autograd.backward(list(tensors), list(grads))


def _rule(d: Deferred) -> list[torch.Tensor | None] | None:
    """The gradients of ``d``'s inputs (None where none is wanted), or None when the
    rule does not apply and ``d`` must be computed."""
    g = d.grad
    if d.value is not None:
        return None
    if d.target in IDENTITY:
        return [g]
    if d.target in ADD:
        shapes = [_shape_dtype(a) for a in d.args]
        if any(s is None or s[1] != g.dtype for s in shapes):
            return None
        return [g if s[0] == g.shape else g.sum_to_size(s[0]) for s in shapes]
    if d.target in LINEAR:
        x, w, b = (*d.args, None)[:3]
        if not (isinstance(x, torch.Tensor) and isinstance(w, torch.Tensor) and x.dim() >= 2
                and w.dim() == 2 and x.is_contiguous() and w.is_contiguous()
                and x.dtype == w.dtype == g.dtype and g.shape == _shape_dtype(d)[0]
                and (b is None or (isinstance(b, torch.Tensor) and b.dim() == 1
                                   and b.dtype == g.dtype))):
            return None
        # as autograd for linear: matmul/addmm on the input folded to 2-d
        g2 = g.reshape(-1, w.shape[0])
        gx = g2.mm(w).view(x.shape) if x.requires_grad else None
        gw = g2.t().mm(x.reshape(-1, w.shape[1])) if w.requires_grad else None
        gb = g2.sum(0) if b is not None and b.requires_grad else None
        return [gx, gw, gb][:len(d.args)]
    return None


def _shape_dtype(a: Any) -> tuple[torch.Size, torch.dtype] | None:
    """Shape and dtype of a tensor input, computed or deferred (None for anything else)."""
    if isinstance(a, torch.Tensor):
        return a.shape, a.dtype
    if not isinstance(a, Deferred):
        return None
    if a.target in IDENTITY:
        return _shape_dtype(a.args[0])
    parts = [_shape_dtype(x) for x in a.args if x is not None]
    if any(p is None for p in parts):
        return None
    if a.target in LINEAR:
        (xs, dt), (ws, _) = parts[0], parts[1]
        return torch.Size((*xs[:-1], ws[0])), dt
    if a.target in ADD and parts[0][1] == parts[1][1]:
        return torch.broadcast_shapes(parts[0][0], parts[1][0]), parts[0][1]
    return None
