"""Costed layers remembered: a layer that costs what one costed before is not run again.

A layer costs what an earlier one did when its graph is the same up to names and its
inputs and attributes have the same metadata and aliasing (the repeated blocks of a
model): ``layer_key`` describes a layer call so, ``recipe`` records how to rebuild the
earlier layer's (fake) outputs for the next one and ``rebuild`` rebuilds them.
``fxpipe.passes.costs.compute_costs`` keeps this call's layers by key, and the layers of
earlier calls in ``costed`` (a bounded, least-recently-used cache across calls, keyed
with the precision and autocast they ran in): a chain costed again (trimmed of its
loss-free outputs, another pipe over the same blocks) runs only its new layers.

What a layer costs, and how it is measured, is ``fxpipe.passes.costs``; this module only
decides when an earlier measurement serves.

>>> import torch.fx as fx
>>> gm = fx.symbolic_trace(torch.nn.Linear(4, 4))
>>> attrs = dict(gm.named_parameters())
>>> a, _ = layer_key(gm, attrs, (torch.empty(2, 4),), {})
>>> b, lasting = layer_key(gm, attrs, (torch.empty(2, 4),), {})
>>> a == b, lasting
(True, True)
"""

from __future__ import annotations

import collections
import threading
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from fxpipe.live_bytes import storage_key

# costed layers by key (``layer_key``, with the precision and autocast they ran in),
# across calls, least recently used first: a chain costed again (trimmed of its
# loss-free outputs, another pipe over the same blocks) runs only its new layers
_COSTED: collections.OrderedDict[tuple, tuple] = collections.OrderedDict()
_COSTED_LOCK = threading.Lock()   # pipes may be compiled on several threads
COSTED_SIZE = 1024


def costed(key: tuple | None, value: tuple | None = None) -> tuple | None:
    """``_COSTED[key]`` (now the most recently used), or None; with ``value``, store it."""
    if key is None:
        return None
    with _COSTED_LOCK:
        if value is not None:
            _COSTED[key] = value
            while len(_COSTED) > COSTED_SIZE:
                _COSTED.popitem(last=False)
        elif key in _COSTED:
            _COSTED.move_to_end(key)
        return _COSTED.get(key)


def layer_key(gm: fx.GraphModule, attrs: dict[str, torch.Tensor], args: tuple,
              kwargs: dict) -> tuple[tuple | None, bool]:
    """A hashable description of a layer call (or ``None``), and whether it holds for
    later calls too (``False``: it names an unhashable object by ``id``, which a later
    object may reuse)."""
    storages: dict[int, int] = {}
    index: dict[fx.Node, int] = {}
    lasting = True

    def value(a: Any) -> Any:
        if isinstance(a, fx.Node):
            return ("node", index[a])
        if isinstance(a, torch.Tensor):
            alias = storages.setdefault(storage_key(a), len(storages))
            return (tuple(a.shape), a.stride(), a.storage_offset(), a.dtype, a.device,
                    a.requires_grad, alias, a.untyped_storage().nbytes())
        if isinstance(a, (list, tuple)):
            return (type(a).__name__, tuple(value(x) for x in a))
        if isinstance(a, dict):
            return ("dict", tuple((k, value(v)) for k, v in a.items()))
        if isinstance(a, slice):
            return ("slice", value(a.start), value(a.stop), value(a.step))
        try:
            hash(a)
        except TypeError:
            nonlocal lasting
            lasting = False
            return ("id", id(a))  # the very same object in both layers, or no match
        return (type(a), a)

    parts: list = [value((args, kwargs))]
    for n in gm.graph.nodes:
        index[n] = len(index)
        if n.op == "call_module" or (n.op == "get_attr" and n.target not in attrs):
            return None, False  # a submodule (e.g. a higher-order op's body): not compared
        if n.op == "get_attr":
            target = value(attrs[n.target])
        else:
            target = None if n.op == "placeholder" else n.target
        parts.append((n.op, target, value(n.args), value(n.kwargs)))
    key = tuple(parts)
    try:
        hash(key)
    except TypeError:  # a symbolic size (a data-dependent shape): not compared
        return None, False
    return key, lasting


def autocast_state() -> tuple:
    """The autocast settings a layer's fake run sees (they change its dtypes)."""
    return tuple((d, torch.get_autocast_dtype(d)) for d in ("cpu", "cuda")
                 if torch.is_autocast_enabled(d))


def recipe(out: Any, args: tuple, kwargs: dict) -> tuple:
    """How to rebuild ``out`` (a layer's detached outputs) for another call."""
    position = {id(a): i for i, a in enumerate(pytree.tree_leaves((args, kwargs)))}
    groups: dict[int, int] = {}
    leaves, spec = pytree.tree_flatten(out)
    steps = []
    for o in leaves:
        if not isinstance(o, torch.Tensor):
            steps.append(("value", o))
        elif id(o) in position:
            steps.append(("input", position[id(o)]))
        else:
            group = groups.setdefault(storage_key(o), len(groups))
            size = o.untyped_storage().nbytes() // o.element_size()
            steps.append(("tensor", tuple(o.shape), o.stride(), o.storage_offset(), o.dtype,
                          o.device, o.requires_grad, group, size))
    return spec, steps


def rebuild(recipe: tuple, args: tuple, kwargs: dict) -> Any:
    spec, steps = recipe
    inputs = pytree.tree_leaves((args, kwargs))
    bases: dict[int, torch.Tensor] = {}  # outputs sharing a storage share it again
    out = []
    for kind, *step in steps:
        if kind == "value":
            out.append(step[0])
        elif kind == "input":
            out.append(inputs[step[0]])
        else:
            shape, stride, offset, dtype, device, requires_grad, group, size = step
            if group not in bases or bases[group].dtype != dtype:
                bases[group] = torch.empty(size, dtype=dtype, device=device)
            t = bases[group].as_strided(shape, stride, offset)
            out.append(t.requires_grad_(True) if requires_grad else t)
    return pytree.tree_unflatten(out, spec)
