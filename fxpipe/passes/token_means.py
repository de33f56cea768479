"""Token-mean losses: the outputs a microbatch must weight by its target tokens.

A loss that averages over its targets (``cross_entropy(..., ignore_index=-100)``, a Hugging
Face model's own ``labels=`` loss, ``fxpipe.linear_cross_entropy``, reduction ``"mean"``)
divides by the number of targets *in the microbatch*. With padding or masked prompts the
microbatches hold different numbers of them, and neither the average of the microbatch
means nor their average weighted by rows is the batch's mean (the gradient-accumulation
bug transformers fixed in 4.46 with ``num_items_in_batch``). The batch's loss is
``sum_m S_m / N``, ``N`` the batch's count of targets: microbatch *m*, holding ``n_m`` of
them, contributes its mean weighted by ``n_m / N``.

``find_token_means(gm)`` is a pass over the captured graph. For every output leaf that is
such a mean (the loss itself, or it cast, viewed or scaled by a constant):

- it records in ``gm.meta["token_means"]`` the leaf's ``TokenCount``: a small graph from
  the model's inputs to ``(target != ignore_index).sum()``, made of the nodes that make
  the loss's target (the labels' shift, views and casts). The runtime runs it on each
  microbatch's inputs on the host before a call (``fxpipe.runtime.issue.loss_weights``).
- it rewrites the mean as ``sum / clamp_min(count, 1)`` in the graph, which is what the stage
  prints and runs. The value is the mean's (the same sum divided by the same count), but a
  microbatch with no target gives 0 and a zero gradient instead of NaN. Its weight is 0,
  and 0 times NaN is NaN in the decompositions compiled stage code runs.

A target made from anything but inputs and constants (parameters, a random op, a block
run as its module) has no count graph: that leaf keeps the rows' weights, and verbose
mode says so.

>>> import torch.nn.functional as F
>>> from fxpipe.passes.capture import capture
>>> class LM(torch.nn.Module):
...     def __init__(self):
...         super().__init__()
...         self.head = torch.nn.Linear(4, 10)
...     def forward(self, x, labels):
...         return F.cross_entropy(self.head(x).flatten(0, 1), labels[:, 1:].flatten())
>>> gm = capture(LM(), (torch.randn(2, 3, 4), torch.randint(0, 10, (2, 4))))
>>> find_token_means(gm)
1
>>> (leaf, count), = gm.meta["token_means"].items()
>>> count.inputs, int(count(torch.tensor([[0, 1, -100, 2]])))
(('labels',), 2)
"""

from __future__ import annotations

import builtins
import inspect
import operator
import sys
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from fxpipe.losses import linear_cross_entropy
from fxpipe.passes import fetch_attr
from fxpipe.passes.blocks import run_block
from fxpipe.passes.layer_graph import is_random
from fxpipe.verbose import is_verbose

aten = torch.ops.aten
_MEAN = 1            # at::Reduction::Mean (aten's losses take the enum)
_SUM = 2
_ATEN_LOSSES = {aten.cross_entropy_loss.default, aten.nll_loss.default, aten.nll_loss_nd.default}
_TORCH_LOSSES = {F.cross_entropy, F.nll_loss}
# ops that keep a loss a multiple of itself: casts, views, copies (a scale by a constant
# is checked apart: ``_scaled_by_constant``)
_SAME = {aten._to_copy.default, aten.to.dtype, aten.to.dtype_layout, aten.clone.default,
         aten.alias.default, aten.view.default, aten.reshape.default, aten._unsafe_view.default,
         aten.squeeze.default, aten.unsqueeze.default, aten.detach.default}
_SAME_METHODS = {"to", "float", "type", "clone", "view", "reshape", "squeeze", "unsqueeze"}
_SCALES = {aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar, operator.mul,
           operator.truediv, torch.mul, torch.div}


@dataclass(eq=False)
class TokenCount:
    """The count of targets a token-mean loss divides by: ``gm`` maps the graph inputs
    named ``inputs`` (the microbatch's tensors, in that order) to a 0-dim integer tensor."""

    gm: fx.GraphModule
    inputs: tuple[str, ...]

    def __call__(self, *tensors: torch.Tensor) -> torch.Tensor:
        return self.gm(*tensors)

    def __str__(self) -> str:
        return self.gm.code.strip("\n")


def find_token_means(gm: fx.GraphModule) -> int:
    """Record (``gm.meta["token_means"]``: output leaf index -> ``TokenCount``) and rewrite
    every output leaf of ``gm`` that is a mean over target tokens (module docstring);
    returns how many."""
    leaves = gm.graph.output_node().args[0]
    counts: dict[fx.Node, TokenCount] = {}
    found: dict[int, TokenCount] = {}
    for i, leaf in enumerate(leaves):
        loss = _loss_under(leaf) if isinstance(leaf, fx.Node) else None
        if loss is None:
            continue
        if loss not in counts:
            target, ignore_index = _target(loss)
            count = _count_graph(gm, target, ignore_index)
            if count is None:
                if is_verbose():
                    print(f"fxpipe: the loss {loss.name} averages over a target not made from the "
                          "inputs alone: its microbatches are weighted by their rows",
                          file=sys.stderr)
                continue
            counts[loss] = count
            _as_sum_over_count(gm, loss, target, ignore_index)
        found[i] = counts[loss]
    gm.meta["token_means"] = found
    if counts:
        gm.recompile()
    return len(found)


def _loss_under(node: fx.Node) -> fx.Node | None:
    """The mean-reduction loss ``node`` is (through casts, views and constant scales), or None."""
    while isinstance(node, fx.Node):
        if _is_mean_loss(node):
            return node
        if node.op == "call_function" and node.target in _SAME or \
                node.op == "call_method" and node.target in _SAME_METHODS:
            node = node.args[0]
        elif _scaled_by_constant(node):
            node = node.args[0]
        else:
            return None
    return None


def _scaled_by_constant(node: fx.Node) -> bool:
    return (node.op == "call_function" and node.target in _SCALES
            or node.op == "call_method" and node.target in ("mul", "div")) \
        and len(node.args) == 2 and isinstance(node.args[1], (int, float)) \
        and not isinstance(node.args[1], bool)


def _is_mean_loss(node: fx.Node) -> bool:
    if node.op != "call_function":
        return False
    args = _loss_args(node)
    return args is not None and args["reduction"] in ("mean", _MEAN) \
        and args.get("weight") is None


def _loss_args(node: fx.Node) -> dict[str, Any] | None:
    """The arguments of a loss node by name, defaults filled in (None: not a known loss)."""
    if node.target in _ATEN_LOSSES:
        schema = node.target._schema
        values = {a.name: a.default_value for a in schema.arguments if a.has_default_value()}
        values.update(zip((a.name for a in schema.arguments), node.args))
        values.update(node.kwargs)
        return {"input": values["self"], **values}
    if node.target in _TORCH_LOSSES or node.target is linear_cross_entropy:
        bound = inspect.signature(node.target).bind(*node.args, **node.kwargs)
        bound.apply_defaults()
        values = dict(bound.arguments)
        if node.target is linear_cross_entropy:
            values["target"] = values["labels"]
            values["weight"] = None   # the head's weight, not class weights
        elif values.get("size_average") is not None or values.get("reduce") is not None:
            return None   # the legacy arguments decide the reduction
        return values
    return None


def _target(loss: fx.Node) -> tuple[fx.Node, int]:
    args = _loss_args(loss)
    return args["target"], int(args["ignore_index"])


def _as_sum_over_count(gm: fx.GraphModule, loss: fx.Node, target: fx.Node,
                       ignore_index: int) -> None:
    """``loss`` (a mean) becomes ``sum / clamp_min((target != ignore_index).sum(), 1)``."""
    graph = gm.graph
    fx_style = gm.meta.get("capture") == "fx"
    ne, total, at_least_one, div = (
        (torch.ne, torch.sum, torch.clamp_min, operator.truediv) if fx_style else
        (aten.ne.Scalar, aten.sum.default, aten.clamp_min.default, aten.div.Tensor))
    users = list(loss.users)
    _set_reduction(loss, "sum")
    with graph.inserting_before(loss.next):   # in this order, right after the loss
        mask = graph.create_node("call_function", ne, (target, ignore_index), name="targets")
        count = graph.create_node("call_function", total, (mask,), name="num_targets")
        clamped = graph.create_node("call_function", at_least_one, (count, 1), name="divisor")
        mean = graph.create_node("call_function", div, (loss, clamped), name=f"{loss.name}_mean")
    for n in (mask, count, clamped, mean):
        n.meta.update({k: v for k, v in loss.meta.items() if k != "val"})
    _fake_value(mask, count, clamped)
    if "val" in loss.meta:
        mean.meta["val"] = loss.meta["val"]
    for u in users:
        u.replace_input_with(loss, mean)


def _set_reduction(loss: fx.Node, reduction: str) -> None:
    if loss.target in _ATEN_LOSSES:
        names = [a.name for a in loss.target._schema.arguments]
        at = names.index("reduction")
        value = _SUM if reduction == "sum" else _MEAN
    else:
        names = list(inspect.signature(loss.target).parameters)
        at = names.index("reduction")
        value = reduction
    if len(loss.args) > at:
        loss.args = (*loss.args[:at], value, *loss.args[at + 1:])
    else:
        loss.kwargs = {**loss.kwargs, "reduction": value}


def _fake_value(*nodes: fx.Node) -> None:
    """Fill ``meta["val"]`` of ``nodes`` (in order) from their inputs' fake values, as
    capture left every other node (the cost pass reads them)."""
    for n in nodes:
        args = fx.node.map_arg(n.args, lambda a: a.meta.get("val"))
        vals = [a for a in args if isinstance(a, torch.Tensor)]
        mode = getattr(vals[0], "fake_mode", None) if vals else None
        if mode is None or len(vals) != sum(isinstance(a, fx.Node) for a in n.args):
            return
        with mode:
            n.meta["val"] = n.target(*args)


def _count_graph(gm: fx.GraphModule, target: fx.Node, ignore_index: int) -> TokenCount | None:
    """The graph from ``gm``'s inputs to ``(target != ignore_index).sum()``, made of the
    nodes ``target`` is made from; None if they read anything but inputs and constants."""
    needed: set[fx.Node] = set()
    devices: set[fx.Node] = set()   # `x.device` (labels.to(logits.device)): the host's here
    todo = [target]
    while todo:
        n = todo.pop()
        if n in needed or n in devices:
            continue
        if n.op == "call_function" and n.target is builtins.getattr and n.args[1] == "device":
            devices.add(n)
            continue
        if not _host_computable(gm, n):
            return None
        needed.add(n)
        todo.extend(n.all_input_nodes)
    graph = fx.Graph()
    env: dict[fx.Node, Any] = {d: torch.device("cpu") for d in devices}
    for n in gm.graph.nodes:
        if n in needed:
            env[n] = graph.node_copy(n, lambda a: env[a])
            if "device" in n.kwargs:   # (labels.to(device)) on the host here
                env[n].kwargs = {k: v for k, v in n.kwargs.items() if k != "device"}
    graph.output(graph.call_function(torch.sum, (graph.call_function(
        torch.ne, (env[target], ignore_index)),)))
    graph.lint()
    inputs = tuple(n.name for n in gm.graph.nodes if n.op == "placeholder" and n in needed)
    return TokenCount(fx.GraphModule(gm, graph, class_name="TokenCount"), inputs)


def _host_computable(gm: fx.GraphModule, n: fx.Node) -> bool:
    """Whether ``n`` may run on the host before the call: an input, a constant tensor (not
    a parameter), or a deterministic op of them."""
    if n.op == "placeholder":
        return True
    if n.op == "get_attr":
        value = fetch_attr(gm, n.target)
        return not isinstance(value, nn.Parameter) and not (
            isinstance(value, torch.Tensor) and value.requires_grad)
    if n.op not in ("call_function", "call_method"):
        return False
    return n.target is not run_block and n.target is not linear_cross_entropy and not is_random(n)
