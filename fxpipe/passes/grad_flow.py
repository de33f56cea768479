"""Which carried values can have a gradient: a dataflow pass over the layer chain.

A backward stage recomputes its layers from their inputs, made leaves that require grad
so autograd hands back the gradients of those inputs for the stages before. An input
that depends on nothing trainable (a rotary table or a mask computed from a sequence
length, position ids) gets a gradient nobody reads: computing it costs a reduction per
use in every layer, and moving it costs transfers. This pass finds the values that may
carry a gradient, so the runtime makes leaves of those only.

Per layer, once: which of the layer's inputs and attributes (parameters, buffers) each
output depends on, through its graph's nodes. A node depends on everything its inputs
depend on, except where it provably carries no gradient: its recorded value
(``meta["val"]``) holds no floating-point or complex tensor (sizes, integer indices,
masks), or it is a ``detach``. Anything unknown counts as a dependency, so the answer
errs towards too many values (more work), never too few (a wrong gradient).

Per call: a value carries a gradient when it depends on a model input that requires
grad or an attribute whose tensor requires grad (the caller may freeze parameters or
pass inputs that require grad between calls).

>>> import torch, torch.nn as nn
>>> from fxpipe.passes.partition import build_layer_graph
>>> class Blocks(nn.Module):
...     def __init__(self):
...         super().__init__()
...         self.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
...     def forward(self, x):
...         pos = torch.arange(x.shape[-1], dtype=x.dtype)  # depends on nothing trainable
...         for block in self.blocks:
...             x = block(x) + pos
...         return x
>>> lg = build_layer_graph(Blocks(), (torch.randn(2, 4),))
>>> [(layer.name, layer.inputs, layer.outputs) for layer in lg]
[('prefix', ['x'], ['arange']), ('blocks.0', ['x', 'arange'], ['add']), ('blocks.1', ['add'], ['linear_1']), ('suffix', ['arange', 'linear_1'], ['add_1'])]
>>> sorted(grad_values(lg, inputs=()))
['add', 'add_1', 'linear_1']
>>> lg.params["blocks.0.weight"].requires_grad_(False).is_leaf  # freeze block 0
True
>>> _ = lg.params["blocks.0.bias"].requires_grad_(False)
>>> sorted(grad_values(lg, inputs=()))
['add_1', 'linear_1']
>>> sorted(grad_values(lg, inputs=["x"]))
['add', 'add_1', 'linear_1', 'x']
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from fxpipe.passes import fetch_attr
from fxpipe.passes.layer_graph import Layer, LayerGraph

# (layer input positions, attribute targets) an output depends on
Sources = tuple[frozenset[int], frozenset[str]]

_NONE: Sources = (frozenset(), frozenset())
_DETACH = {torch.Tensor.detach, torch.detach, torch.ops.aten.detach.default, "detach"}
_SHAPE_ATTRS = {"shape", "dtype", "device", "ndim", "is_cuda", "layout", "requires_grad"}
_SHAPE_METHODS = {"size", "dim", "numel", "stride", "nelement", "element_size", "get_device"}


def layer_sources(layer: Layer) -> list[Sources]:
    """For each of ``layer.outputs``: the inputs (positions in ``layer.inputs``) and
    attribute targets (FQNs) its gradient may reach. Cached on the layer's graph."""
    cached = layer.gm.meta.get("fxpipe_grad_sources")
    if cached is not None:
        return cached
    deps: dict[fx.Node, Sources] = {}
    position = 0
    result: list[Sources] = []
    for node in layer.gm.graph.nodes:
        if node.op == "placeholder":
            deps[node] = (frozenset({position}), frozenset())
            position += 1
        elif node.op == "get_attr":
            deps[node] = (frozenset(), frozenset({node.target}))
        elif node.op == "output":
            outs = node.args[0]
            outs = outs if isinstance(outs, (tuple, list)) else (outs,)
            result = [_union(deps[a] for a in _nodes(o)) for o in outs]
        elif _carries_nothing(node):
            deps[node] = _NONE
        else:
            deps[node] = _union(deps[a] for a in node.all_input_nodes)
    if len(result) != len(layer.outputs):
        raise ValueError(f"layer {layer.index} ({layer.name}) returns {len(result)} values but "
                         f"lists {len(layer.outputs)} outputs")
    layer.gm.meta["fxpipe_grad_sources"] = result
    return result


def grad_values(lg: LayerGraph, inputs: Iterable[str]) -> frozenset[str]:
    """Names of the carried values that may have a gradient, when the model inputs named
    ``inputs`` require grad (and the layers' parameters and buffers as they are now)."""
    carries = set(inputs)
    for layer in lg.layers:
        for name, (ins, attrs) in zip(layer.outputs, layer_sources(layer)):
            if any(layer.inputs[i] in carries for i in ins) or any(
                    getattr(fetch_attr(layer.gm, a), "requires_grad", False) for a in attrs):
                carries.add(name)
    return frozenset(carries)


def _nodes(x) -> list[fx.Node]:
    return [a for a in pytree.tree_leaves(x) if isinstance(a, fx.Node)]


def _union(parts: Iterable[Sources]) -> Sources:
    ins: set[int] = set()
    attrs: set[str] = set()
    for i, a in parts:
        ins |= i
        attrs |= a
    return frozenset(ins), frozenset(attrs)


def _carries_nothing(node: fx.Node) -> bool:
    """Provably no gradient flows through ``node``'s value."""
    if node.target in _DETACH:
        return True
    if node.op == "call_method" and node.target in _SHAPE_METHODS:
        return True
    if node.op == "call_function" and node.target is getattr \
            and len(node.args) > 1 and node.args[1] in _SHAPE_ATTRS:
        return True
    if "val" in node.meta:
        leaves = pytree.tree_leaves(node.meta["val"])
        return not any(isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex())
                       for v in leaves)
    return False
