"""What each microbatch weighs in the batch's outputs and loss.

A call splits the batch into microbatches; a 0-dim output (a loss) merged back, and the
loss ``forward_backward`` returns and back-propagates, must be the batch's as eager
computes it. Microbatch *m* weighs, in:

- an output leaf that is a mean over target tokens (``LayerGraph.token_means``: a Hugging
  Face model's own ``labels=`` loss, ``F.cross_entropy`` with ``ignore_index``,
  ``fxpipe.linear_cross_entropy``): ``n_m / N``, its targets over the batch's. Each
  microbatch's targets are counted on the host before the call, by the count graph
  ``fxpipe.passes.token_means`` made from the model's own code (the labels' shift, its
  ``ignore_index``);
- any other 0-dim output: ``r_m / R``, its share of the batch's rows;
- the loss ``forward_backward``'s ``loss_fn`` returns (``loss_reduction="mean"``): where
  it is one of those token means (``lambda out, _: out.loss``; or it cast or scaled), by
  its targets; otherwise by rows. A ``loss_fn`` that returns ``(sum, count)`` weighs each
  sum ``1 / N``, ``N`` the total of the counts over the batch: the first microbatch that
  returns a pair has :func:`count_of` run ``loss_fn`` on every microbatch's label to get
  them, so the count must come from the label alone.

Where there is no target in the whole batch, the token weights are the rows' (each
microbatch's token mean is then 0: ``passes.token_means`` divides by at least 1).

>>> shares = Shares(rows=[0.5, 0.25, 0.25], tokens={0: [0.75, 0.0, 0.25]})
>>> shares.of(0), shares.of(1)
([0.75, 0.0, 0.25], [0.5, 0.25, 0.25])
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from fxpipe.passes.layer_graph import LayerGraph
from fxpipe.runtime.issue.microbatch import microbatch_weights


@dataclass
class Shares:
    """Each microbatch's weight in a merged 0-dim output: by output leaf (flat index) for
    the token means, ``rows`` for the others."""

    rows: list[float]
    tokens: dict[int, list[float]] = field(default_factory=dict)

    def of(self, leaf: int) -> list[float]:
        return self.tokens.get(leaf, self.rows)


def shares(lg: LayerGraph, envs: list[dict], rows: list[int]) -> Shares:
    """The ``Shares`` of a call whose microbatches' inputs are ``envs`` (name -> tensor)
    and rows ``rows``."""
    counted: dict[int, list[float]] = {}   # by TokenCount
    tokens = {}
    row_shares = _normalized(rows) or [1.0 / len(rows)] * len(rows)
    for leaf, count in lg.token_means.items():
        if id(count) not in counted:
            with torch.no_grad():
                each = [int(count(*(env[n] for n in count.inputs))) for env in envs]
            counted[id(count)] = _normalized(each) or row_shares
        tokens[leaf] = counted[id(count)]
    return Shares(row_shares, tokens)


def _normalized(sizes: Sequence[int]) -> list[float] | None:
    """Each size's share of their total; None where the total is 0 (no target at all)."""
    return microbatch_weights(sizes) if sum(sizes) else None


class LossWeights:
    """How the fused tail weighs microbatch *m*'s loss (module docstring): ``weigh``."""

    def __init__(self, lg: LayerGraph, loss_fn: Callable, labels: list, shares_: Shares,
                 reduction: str):
        self.lg, self.loss_fn, self.labels, self.shares = lg, loss_fn, labels, shares_
        self.reduction = reduction
        self._per_count: list[float] | None = None
        self._lock = threading.Lock()

    def weigh(self, m: int, value: Any, leaves: list) -> tuple[Any, float]:
        """``(loss, weight)`` of microbatch ``m`` whose ``loss_fn`` returned ``value`` on
        output leaves ``leaves`` (flat)."""
        if isinstance(value, tuple) and len(value) == 2:   # (sum, count)
            return value[0], self._count_weights()[m]
        if self.reduction == "sum" or len(self.labels) == 1:
            return value, 1.0
        leaf = _multiple_of(value, {i: leaves[i] for i in self.shares.tokens})
        return value, self.shares.of(leaf)[m] if leaf is not None else self.shares.rows[m]

    def _count_weights(self) -> list[float]:
        with self._lock:
            if self._per_count is None:
                counts = [count_of(self.lg, self.loss_fn, label) for label in self.labels]
                weight = 1.0 if self.reduction == "sum" else 1.0 / max(sum(counts), 1)
                self._per_count = [weight] * len(counts)
            return self._per_count


def _multiple_of(value: Any, means: dict[int, Any]) -> int | None:
    """The token-mean leaf (of ``means``: flat index -> this microbatch's tensor) that
    ``value`` is, or is made from by ops of one tensor input (a cast, a scale); None."""
    if not isinstance(value, torch.Tensor):
        return None
    by_fn = {id(t.grad_fn): i for i, t in means.items()
             if isinstance(t, torch.Tensor) and t.grad_fn is not None}
    for i, t in means.items():
        if value is t:
            return i
    fn = value.grad_fn
    for _ in range(8):   # a few casts and scales deep
        if fn is None:
            return None
        if id(fn) in by_fn:
            return by_fn[id(fn)]
        inputs = [f for f, _ in fn.next_functions if f is not None]
        if len(inputs) != 1:
            return None
        fn = inputs[0]
    return None


def count_of(lg: LayerGraph, loss_fn: Callable, label: Any) -> int:
    """The count a ``loss_fn`` returning ``(sum, count)`` gives for ``label``, before the
    outputs exist: ``loss_fn`` runs on stand-ins of ``lg``'s output leaves (meta tensors)
    and the real label; ops of real tensors alone (the label's) run, ops reading a
    stand-in make stand-ins. ``ValueError`` if the count reads the outputs."""
    mode = _StandIns()
    rows = next((t.shape[0] for t in pytree.tree_leaves(label)
                 if isinstance(t, torch.Tensor) and t.dim() > 0), None)
    leaves = [mode.stand_in(_shape(v, rows), v.dtype) if isinstance(v, torch.Tensor) else v
              for v in _output_vals(lg)]
    try:
        with torch.no_grad(), mode:
            value = loss_fn(pytree.tree_unflatten(leaves, lg.out_spec), label)
    except Exception as e:  # noqa: BLE001 — e.g. it reads an output's value
        raise ValueError(
            "loss_fn returned (sum, count): fxpipe needs every microbatch's count before the "
            "first backward, so it runs loss_fn on each microbatch's label with stand-ins for "
            f"the outputs (meta tensors), which failed: {type(e).__name__}: {e}. Compute the "
            "count from the label alone, in ops that do not read the outputs' values.") from e
    count = value[1] if isinstance(value, tuple) and len(value) == 2 else None
    if isinstance(count, torch.Tensor) and mode.made(count):
        raise ValueError(
            "loss_fn returned (sum, count) with a count computed from the model's outputs: "
            "fxpipe needs each microbatch's count before the first backward, so it must come "
            "from the label alone (e.g. (label != -100).sum())")
    if isinstance(count, bool) or not isinstance(count, (int, torch.Tensor)) or \
            isinstance(count, torch.Tensor) and (count.dim() != 0 or count.is_floating_point()):
        raise ValueError(f"loss_fn returned (sum, count) with count {count!r}: the count must "
                         "be an int or a 0-dim integer tensor")
    return int(count)


def _shape(val: torch.Tensor, rows: int | None) -> tuple[int, ...]:
    """A stand-in's shape: ``val``'s (its concrete sizes; 1 for a symbolic one), with the
    microbatch's ``rows`` in dim 0 (outputs are split and merged along it), so that the
    shape checks of a ``loss_fn``'s ops against the label pass."""
    sizes = [d if isinstance(d, int) else 1 for d in val.shape]
    if sizes and rows is not None:
        sizes[0] = rows
    return tuple(sizes)


def _output_vals(lg: LayerGraph) -> list:
    """A value per output leaf of ``lg``: its fake value (tensors), or the constant."""
    graph = (lg.source if lg.source is not None else lg.gm).graph
    return [a.meta.get("val", torch.empty(())) if isinstance(a, fx.Node) else a
            for a in graph.output_node().args[0]]


class _StandIns(TorchDispatchMode):
    """Runs ops of real tensors as they are; an op reading a stand-in makes stand-ins
    (meta tensors: of the op's shapes where it runs on meta, else 0-dim)."""

    def __init__(self) -> None:
        super().__init__()
        self._made: dict[int, torch.Tensor] = {}

    def stand_in(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        t = torch.empty(shape, dtype=dtype, device="meta")
        self._made[id(t)] = t
        return t

    def made(self, t: torch.Tensor) -> bool:
        return self._made.get(id(t)) is t

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not any(isinstance(x, torch.Tensor) and self.made(x)
                   for x in pytree.tree_leaves((args, kwargs))):
            return func(*args, **kwargs)
        on_meta = pytree.tree_map_only(torch.Tensor, lambda t: t.to("meta"), (args, kwargs))
        try:
            out = func(*on_meta[0], **on_meta[1])
        except Exception:  # noqa: BLE001 — a stand-in's shape need not fit: a scalar
            out = torch.empty((), device="meta")
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._made[id(t)] = t
        return out
