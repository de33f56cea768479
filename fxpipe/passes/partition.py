"""Partition: flat captured graph → ``LayerGraph`` (an ordered chain of layer graphs).

1. Find the repeated blocks: the ``ModuleList``/``Sequential`` holding the most
   parameters, or the module named by ``layers=``. Each child is a block.
2. Assign every node a layer from its module path (``node.meta["module_path"]``, taken
   from the *values* of ``nn_module_stack`` by capture): a node inside block *i* belongs
   to block *i*'s layer; a node outside every block belongs to the prefix layer if it
   runs before the first block, to the suffix layer if it runs after the last block,
   and otherwise to the block that ran just before it.
3. Cut: every layer becomes a ``GraphModule`` whose inputs are the values it reads from
   earlier layers (or the model inputs) and whose outputs are the values later layers
   or the model output read. Parameters are ``get_attr`` nodes in each layer that uses
   them, all referring to the same tensor.
"""

from __future__ import annotations

import difflib
import operator
from collections.abc import Callable

import torch
import torch.fx as fx
import torch.nn as nn

from fxpipe.passes.capture import capture as capture_graph
from fxpipe.passes.layer_graph import Layer, LayerGraph, graph_module, is_random


def build_layer_graph(model: nn.Module, args: tuple = (), kwargs: dict | None = None, *,
                      capture: str | Callable[[], fx.GraphModule] = "auto",
                      layers: str | None = None) -> LayerGraph:
    """Capture ``model(*args, **kwargs)`` and cut it into a chain of layers. ``capture``
    is a method name, or a function returning an already captured graph (of ``model``).

    >>> lg = build_layer_graph(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), (torch.randn(2, 4),))
    >>> [layer.name for layer in lg]
    ['0', '1']
    """
    container = find_blocks(model, layers)  # fail on a bad layers= before the slow capture
    gm = capture() if callable(capture) else capture_graph(model, args, kwargs, capture)
    return partition(gm, model, container)



def find_blocks(model: nn.Module, layers: str | None = None) -> str:
    """Module path of the repeated blocks: ``layers`` if given (checked), else the
    ``ModuleList``/``Sequential`` with the most parameters (``""``: the model itself)."""
    modules = dict(model.named_modules())
    if layers is not None:
        if layers not in modules:
            close = difflib.get_close_matches(layers, [k for k in modules if k], n=3)
            hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
            raise ValueError(f"layers={layers!r} names no submodule of {type(model).__name__}."
                             f"{hint} Give the dotted path of the module holding the repeated "
                             "blocks, e.g. layers='model.layers'.")
        if not list(modules[layers].children()):
            raise ValueError(f"layers={layers!r} is a {type(modules[layers]).__name__} with no "
                             "child modules; it must hold the repeated blocks (one layer each).")
        return layers
    best, best_count = None, -1
    for path, mod in modules.items():
        if isinstance(mod, (nn.ModuleList, nn.Sequential)) and len(mod) > 0:
            count = sum(p.numel() for p in mod.parameters())
            if count > best_count:
                best, best_count = path, count
    return best if best is not None else ""


def partition(gm: fx.GraphModule, model: nn.Module, container: str) -> LayerGraph:
    """Cut a captured graph (``fxpipe.passes.capture``) into a ``LayerGraph``."""
    children = [name for name, _ in modules_children(model, container)]
    layer_of = _assign_layers(gm, container, children)
    order = sorted(set(layer_of.values()))
    names = {k: _layer_name(k, container, children) for k in order}
    index = {k: i for i, k in enumerate(order)}  # dense layer indices, empty layers dropped

    graph = gm.graph
    nodes = list(graph.nodes)
    output = nodes[-1]
    inputs = [n for n in nodes if n.op == "placeholder"]
    members: dict[int, list[fx.Node]] = {i: [] for i in index.values()}
    for n in nodes:
        if n in layer_of:
            members[index[layer_of[n]]].append(n)
    owner = {n: i for i, ns in members.items() for n in ns}

    def read_later(n: fx.Node, i: int) -> bool:
        return any(u is output or owner.get(u, -1) > i for u in n.users)

    top = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for p in inputs:
        env[p] = top.placeholder(p.name)
    root: dict[str, torch.nn.Module] = {}
    chain: list[Layer] = []
    for i, ns in members.items():
        reads = _reads(ns)
        outs = [n for n in ns if read_later(n, i)]
        sub, params = _layer_module(gm, ns, reads, outs)
        name = f"layer_{i}"
        root[name] = sub
        call = top.call_module(name, tuple(env[r] for r in reads if r.op != "get_attr"))
        call.meta["layer_name"] = names[[k for k in order if index[k] == i][0]]
        for j, o in enumerate(outs):
            env[o] = top.create_node("call_function", operator.getitem, (call, j), name=o.name)
        is_param = {p: isinstance(_fetch(gm, p), nn.Parameter) for p in params}
        chain.append(Layer(index=i, name=call.meta["layer_name"], node=call, gm=sub,
                           inputs=[env[r].name for r in reads if r.op != "get_attr"],
                           outputs=[o.name for o in outs],
                           params=[p for p in params if is_param[p]],
                           buffers=[p for p in params if not is_param[p]],
                           random=any(is_random(n) for n in ns)))
    top.output(fx.node.map_arg(output.args[0], lambda a: env[a]))
    top_gm = graph_module(root, top, class_name="LayerChain")
    tensors = {n.target: _fetch(gm, n.target) for n in nodes if n.op == "get_attr"}
    tensors = {k: v for k, v in tensors.items() if isinstance(v, torch.Tensor)}
    out_names = [a.name for a in fx.node.map_arg(output.args[0], lambda a: env[a])
                 if isinstance(a, fx.Node)]
    return LayerGraph(
        gm=top_gm, layers=chain, in_spec=gm.meta["in_spec"], out_spec=gm.meta["out_spec"],
        input_names=[p.name for p in inputs], output_names=out_names,
        params={k: v for k, v in tensors.items() if isinstance(v, nn.Parameter)},
        buffers={k: v for k, v in tensors.items() if not isinstance(v, nn.Parameter)},
        capture=gm.meta.get("capture", "fx"), leaf_names=gm.meta.get("leaf_names", []),
        example_leaves=gm.meta.get("input_leaves", []), static_dims=gm.meta.get("static_dims", {}),
        training=gm.meta.get("training", True))


def modules_children(model: nn.Module, container: str):
    return list(model.get_submodule(container).named_children()) if container else \
        list(model.named_children())


def _fetch(gm: fx.GraphModule, target: str):
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _block_of(path: str, container: str, child_index: dict[str, int]) -> int | None:
    if container:
        if not path.startswith(container + "."):
            return None
        rest = path[len(container) + 1:]
    else:
        rest = path
    return child_index.get(rest.split(".")[0]) if rest else None


def _assign_layers(gm: fx.GraphModule, container: str, children: list[str]) -> dict:
    """node -> layer key: 0 = prefix, 1 + b = block b, len(children) + 1 = suffix."""
    child_index = {c: i for i, c in enumerate(children)}
    compute = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method")]
    block = {n: _block_of(n.meta.get("module_path", ""), container, child_index) for n in compute}
    last_block_pos = max((i for i, n in enumerate(compute) if block[n] is not None), default=-1)
    suffix = len(children) + 1
    layer_of: dict[fx.Node, int] = {}
    current = 0
    seen_block = -1
    for pos, n in enumerate(compute):
        b = block[n]
        if b is not None:
            if b < seen_block:
                raise ValueError(
                    f"block {_child_path(container, children[b])} runs after block "
                    f"{_child_path(container, children[seen_block])} (op {n.name!r}); fxpipe "
                    "needs blocks that run once each, in order. Pass layers= naming a "
                    "container whose blocks run in sequence.")
            seen_block = b
            current = 1 + b
        elif pos > last_block_pos:
            current = suffix
        layer_of[n] = current
    for n, k in layer_of.items():  # every value must come from this layer or an earlier one
        for a in n.all_input_nodes:
            if a in layer_of and layer_of[a] > k:
                raise ValueError(f"op {n.name!r} in {_describe(k, container, children)} reads "
                                 f"{a.name!r} made later in {_describe(layer_of[a], container, children)}; "
                                 "the model is not a chain of blocks at this cut. Pass layers=.")
    return layer_of


def _child_path(container: str, child: str) -> str:
    return f"{container}.{child}" if container else child


def _layer_name(k: int, container: str, children: list[str]) -> str:
    if k == 0:
        return "prefix"
    if k == len(children) + 1:
        return "suffix"
    return _child_path(container, children[k - 1])


def _describe(k: int, container: str, children: list[str]) -> str:
    return f"layer {_layer_name(k, container, children)!r}"


def _reads(ns: list[fx.Node]) -> list[fx.Node]:
    """Values the nodes read from outside themselves, in first-use order."""
    inside = set(ns)
    seen: dict[fx.Node, None] = {}
    for n in ns:
        for a in n.all_input_nodes:
            if a not in inside:
                seen.setdefault(a, None)
    # placeholders/values first in graph order, then attributes: stable and readable
    vals = [a for a in seen if a.op != "get_attr"]
    attrs = [a for a in seen if a.op == "get_attr"]
    order = {n: i for i, n in enumerate(ns[0].graph.nodes)}
    return sorted(vals, key=order.__getitem__) + attrs


def _layer_module(gm: fx.GraphModule, ns: list[fx.Node], reads: list[fx.Node],
                  outs: list[fx.Node]) -> tuple[fx.GraphModule, list[str]]:
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    root: dict[str, torch.Tensor] = {}
    params: list[str] = []
    for r in reads:
        if r.op == "get_attr":
            env[r] = g.create_node("get_attr", r.target, name=r.name)
            env[r].meta = dict(r.meta)
            root[r.target] = _fetch(gm, r.target)
            if isinstance(root[r.target], torch.Tensor):  # not a higher-order op's body
                params.append(r.target)
        else:
            env[r] = g.placeholder(r.name)
            if "val" in r.meta:
                env[r].meta["val"] = r.meta["val"]
    for n in ns:
        env[n] = g.node_copy(n, lambda a: env[a])
    g.output(tuple(env[o] for o in outs))
    return graph_module(root, g, class_name="Layer"), params
