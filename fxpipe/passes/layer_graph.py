"""LayerGraph: the model cut into an ordered chain of layers.

It is one fx ``GraphModule`` (``LayerGraph.gm``) whose body calls the layers in order::

    def forward(self, input_ids):
        # layer 0 | prefix (model.embed_tokens, ...) | params 8.2 kB | ...
        layer_0 = self.layer_0(input_ids)
        getitem = layer_0[0]
        getitem_1 = layer_0[1]
        layer_1 = self.layer_1(getitem, getitem_1)
        ...
        return (getitem_7,)

Every ``self.layer_i`` is itself a small ``GraphModule`` taking the values it reads and
returning a tuple of the values later layers (or the output) need. Values made once and
used by several later layers (masks, rotary tables, skip connections, inputs) are passed
explicitly from the layer that made them: that is what "carried along the chain" means,
and the set of values live across the cut after layer *i* is ``LayerGraph.boundary(i)``.

Parameters and buffers are ``get_attr`` nodes inside the layer graphs. They refer to the
model's own tensors (no copies). A tensor used by several layers (tied weights) is the
same object in each of them, listed in ``Layer.params`` of each, and reported by
``LayerGraph.shared_params``.

Per-layer costs live in the call node's ``meta["cost"]`` (see ``fxpipe.passes.costs``).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch.utils._pytree import TreeSpec



# Floating buffers a device holds in ``param_dtype`` (mixed precision), as the parameters:
# those the model loaded in that dtype holds in it (``passes.buffer_dtypes`` marks them
# when it captures; ``LayerGraph.device_dtype`` and the runtime's uploads read it). The
# others keep their dtype on the devices.
_IN_PARAM_DTYPE: dict[int, weakref.ref] = {}


def mark_in_param_dtype(*tensors: torch.Tensor) -> None:
    """Mark buffers as held in ``param_dtype`` on the devices (see ``_IN_PARAM_DTYPE``)."""
    for t in tensors:
        _IN_PARAM_DTYPE[id(t)] = weakref.ref(
            t, lambda _, key=id(t): _IN_PARAM_DTYPE.pop(key, None))


def in_param_dtype(t: torch.Tensor) -> bool:
    """Whether a device holds ``t`` in ``param_dtype``: a floating parameter, or a buffer
    marked so (:func:`mark_in_param_dtype`)."""
    if not t.is_floating_point():
        return False
    if isinstance(t, torch.nn.Parameter):
        return True
    ref = _IN_PARAM_DTYPE.get(id(t))
    return ref is not None and ref() is t


@dataclass
class Layer:
    """One link of the chain: a view onto a ``call_module`` node of ``LayerGraph.gm``."""

    index: int
    name: str                      # "prefix", "suffix" or the block's module path
    node: fx.Node                  # the call_module node in LayerGraph.gm
    gm: fx.GraphModule             # the layer's own graph
    inputs: list[str]              # names (in LayerGraph.gm) of the values it reads
    outputs: list[str]             # names of the values it produces for later layers
    params: list[str] = field(default_factory=list)   # FQNs of parameters it uses
    buffers: list[str] = field(default_factory=list)  # FQNs of buffers it uses
    random: bool = False           # runs random ops (dropout): gets its own RNG state
    opaque: bool = False           # calls a block as its module (``passes.blocks``)

    @property
    def cost(self):
        """The layer's ``Cost`` (``fxpipe.passes.costs``), or ``None`` before costing."""
        return self.node.meta.get("cost")

    def __repr__(self) -> str:
        return f"Layer({self.index}, {self.name!r}, params={len(self.params)})"


@dataclass
class LayerGraph:
    """An ordered chain of layers (see module docstring)."""

    gm: fx.GraphModule
    layers: list[Layer]
    in_spec: TreeSpec              # pytree spec of (args, kwargs) the model was called with
    out_spec: TreeSpec             # pytree spec of what the model returns
    input_names: list[str]         # flat placeholders of gm, one per input leaf
    output_names: list[str]        # flat values returned, one per output leaf
    params: dict[str, torch.Tensor]   # FQN -> the model's own tensor (parameters)
    buffers: dict[str, torch.Tensor]  # FQN -> the model's own tensor (buffers)
    capture: str = "fx"            # the capture method that produced it
    leaf_names: list[str] = field(default_factory=list)  # a name per leaf of (args, kwargs)
    example_leaves: list = field(default_factory=list)   # the example's leaves
    static_dims: dict[str, dict[int, int]] = field(default_factory=dict)  # input -> {dim: size}
    training: bool = True          # the module's mode when captured (dropout, BatchNorm)
    # mixed precision: the dtype devices hold floating parameters in (None: their own),
    # and the buffers ``device_dtype`` says; the graph was captured with them in it, and
    # costs count them in it
    param_dtype: torch.dtype | None = None
    # the torch.autocast regions the graph was captured (and runs) under (runtime.stages.amp)
    autocast: tuple = ()
    # the captured flat graph it was cut from, and the block lists it was cut at
    source: fx.GraphModule | None = None
    containers: tuple[str, ...] = ()
    # output leaves (flat indices) no loss reads: the logits beside a fused loss
    # (passes.loss; a chain cut from the graph returning None for them has none)
    loss_free_outputs: tuple[int, ...] = ()
    # output leaves (flat indices) that are means over target tokens, and the count of
    # targets each divides by (``passes.token_means``; the runtime weights by it)
    token_means: dict[int, Any] = field(default_factory=dict)

    def device_dtype(self, t: torch.Tensor) -> torch.dtype:
        """The dtype ``t`` (one of the model's parameters or buffers) has on a device:
        ``param_dtype`` for a floating parameter and the buffers the model loaded in it
        holds in it (``passes.buffer_dtypes``), else its own."""
        if self.param_dtype is not None and in_param_dtype(t):
            return self.param_dtype
        return t.dtype

    def __len__(self) -> int:
        return len(self.layers)

    def __iter__(self):
        return iter(self.layers)

    def __getitem__(self, i: int) -> Layer:
        return self.layers[i]

    def boundary(self, i: int) -> list[str]:
        """Names of the values live across the cut after layer ``i`` (produced at or
        before ``i``, read after it or returned)."""
        produced = set(self.input_names)
        for layer in self.layers[: i + 1]:
            produced.update(layer.outputs)
        needed: set[str] = set(self.output_names)
        for layer in self.layers[i + 1:]:
            needed.update(layer.inputs)
        return [n for n in self.value_order() if n in produced and n in needed]

    def value_order(self) -> list[str]:
        """Every carried value's name, in the order it is made."""
        names = list(self.input_names)
        for layer in self.layers:
            names.extend(layer.outputs)
        return names

    @property
    def shared_params(self) -> dict[str, list[int]]:
        """Parameters used by more than one layer: FQN -> indices of the layers using it."""
        users: dict[str, list[int]] = {}
        for layer in self.layers:
            for p in layer.params:
                users.setdefault(p, []).append(layer.index)
        return {p: idx for p, idx in users.items() if len(idx) > 1}

    def flat_outputs(self, values: dict[str, Any]) -> list:
        """The model's flat output leaves, taking each graph value from ``values`` by name
        (constant leaves are returned as they are)."""
        return self.flat_outputs_of([values])[0]

    def flat_outputs_of(self, envs: Sequence[dict[str, Any]]) -> list[list]:
        """:meth:`flat_outputs` of each of ``envs`` (the output node looked up once)."""
        out = self.gm.graph.output_node().args[0]
        return [[values[a.name] if isinstance(a, fx.Node) else a for a in out]
                for values in envs]

    @property
    def code(self) -> str:
        return self.gm.code

    def __str__(self) -> str:
        return self.gm.code.strip("\n")


try:  # generates its Python code on first use (.code, a call), as torch.compile's graphs do
    from torch.fx._lazy_graph_module import _LazyGraphModule as _GraphModule
except ImportError:  # pragma: no cover — older torch
    _GraphModule = fx.GraphModule


def graph_module(root: dict[str, Any], graph: fx.Graph, class_name: str) -> fx.GraphModule:
    """``fx.GraphModule(root, graph)``, with its code generated on first use, and without
    recompiling child GraphModules (fx recompiles every GraphModule child whenever a
    parent compiles, so the parent is built around stand-ins and gets them after).

    Most layer and stage graphs are interpreted or inspected, never called compiled:
    the runtime interprets stages node by node and costs reuse identical blocks.
    """
    children = {k: v for k, v in root.items() if isinstance(v, fx.GraphModule) and "." not in k}
    stand_ins = {k: (torch.nn.Module() if k in children else v) for k, v in root.items()}
    gm = _GraphModule(stand_ins, graph, class_name=class_name)
    for name, child in children.items():
        setattr(gm, name, child)
    return gm


_RANDOM_FUNCTIONS = {
    "dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout",
    "rrelu", "bernoulli", "rand", "randn", "randint", "rand_like", "randn_like",
    "randint_like", "normal", "multinomial", "randperm", "poisson",
}
_RANDOM_METHODS = {"bernoulli", "bernoulli_", "uniform_", "normal_", "random_", "exponential_",
                   "geometric_", "cauchy_", "log_normal_"}


def is_random(node: fx.Node) -> bool:
    """Whether ``node`` draws random numbers (an active dropout, ``rand``, ``bernoulli_``...).
    A node that says so itself (``meta["random"]``: a block run as its module) is believed."""
    if "random" in node.meta:
        return bool(node.meta["random"])
    if isinstance(node.target, torch._ops.OpOverload):
        if torch.Tag.nondeterministic_seeded not in node.target.tags:
            return False
        if node.target.overloadpacket is torch.ops.aten.dropout:
            return node.args[2] is not False and node.args[1] != 0
        if node.target.overloadpacket is torch.ops.aten.scaled_dot_product_attention:
            return _sdpa_dropout(node) != 0
        return True
    if node.op == "call_method":
        return node.target in _RANDOM_METHODS
    if node.op != "call_function":
        return False
    name = getattr(node.target, "__name__", "")
    if name == "scaled_dot_product_attention":  # F.scaled_dot_product_attention
        return _sdpa_dropout(node) != 0
    if name not in _RANDOM_FUNCTIONS:
        return False
    if "dropout" in name:  # F.dropout(x, p, training): inactive unless training and p != 0
        training = node.kwargs.get("training", node.args[2] if len(node.args) > 2 else True)
        p = node.kwargs.get("p", node.args[1] if len(node.args) > 1 else 0.5)
        return training is not False and p != 0
    return True


def _sdpa_dropout(node: fx.Node) -> Any:
    """``dropout_p`` of a scaled-dot-product attention call (query, key, value, attn_mask,
    dropout_p, ...): random only when it is not 0."""
    return node.kwargs.get("dropout_p", node.args[4] if len(node.args) > 4 else 0.0)
