"""Partition: flat captured graph → ``LayerGraph`` (an ordered chain of layer graphs).

1. Find the repeated blocks: the ``ModuleList``/``Sequential`` holding the most
   parameters, and every other one (neither inside nor around it) holding at least an
   eighth as many: an encoder's and a decoder's blocks are both found. Or the modules
   named by ``layers=``. Each child is a block.
2. Assign every node a layer from the module calls around it (``node.meta["module_stack"]``,
   else its ``module_path``): each *call* of a block is a layer, in the order they run;
   a block object registered at two places of its list, or called twice, is one layer
   per call (its parameters shared by them, like tied weights). A node outside every
   block belongs to the prefix layer if it runs before the first block, to the suffix
   layer if it runs after the last block, and otherwise to the block that ran just
   before it (so an encoder's final norm goes with its last block, and the encoder's
   output is carried to every decoder layer that reads it).
3. Cut: every layer becomes a ``GraphModule`` whose inputs are the values it reads from
   earlier layers (or the model inputs) and whose outputs are the values later layers
   or the model output read. Parameters are ``get_attr`` nodes in each layer that uses
   them, all referring to the same tensor.
"""

from __future__ import annotations

import difflib
import operator
from collections.abc import Callable, Collection, Sequence

import torch
import torch.fx as fx
import torch.nn as nn

from fxpipe import attention
from fxpipe.passes import fetch_attr
from fxpipe.passes.blocks import run_block
from fxpipe.passes.capture import capture as capture_graph
from fxpipe.passes.layer_graph import Layer, LayerGraph, graph_module, is_random
from fxpipe.passes.loss import fuse_linear_cross_entropy, trim_outputs
from fxpipe.passes.tiling import tile_mlps, tile_norms
from fxpipe.passes.token_means import find_token_means


def build_layer_graph(model: nn.Module, args: tuple = (), kwargs: dict | None = None, *,
                      capture: str | Callable[[], fx.GraphModule] = "auto",
                      layers: str | Sequence[str] | None = None,
                      dynamic: Sequence[Collection[int]] | None = None,
                      param_dtype: torch.dtype | None = None,
                      device_memory: int | None = None) -> LayerGraph:
    """Capture ``model(*args, **kwargs)`` and cut it into a chain of layers. ``capture``
    is a method name, or a function returning an already captured graph (of ``model``);
    ``dynamic``: the dims of each tensor input export keeps symbolic (``None``: all);
    ``param_dtype``: the devices' dtype for floating parameters (mixed precision: the
    graph is captured in it, ``fxpipe.passes.capture``). A causal LM's head and
    cross-entropy become ``linear_cross_entropy`` (``fxpipe.passes.loss``), chunked for
    devices of ``device_memory`` bytes (``None``: unknown), a loss that averages over
    target tokens divides its sum by a count the runtime weights microbatches by
    (``fxpipe.passes.token_means``), and an MLP or RMSNorm whose intermediates would not
    fit its share of them runs in tiles (``fxpipe.passes.tiling``).

    >>> lg = build_layer_graph(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), (torch.randn(2, 4),))
    >>> [layer.name for layer in lg]
    ['0', '1']
    """
    containers = find_block_lists(model, layers)  # fail on a bad layers= before the slow capture
    if callable(capture):
        gm = capture()
    else:
        blocks = [path for path, _ in _positions(model, containers)]
        gm = capture_graph(model, args, kwargs, capture, dynamic=dynamic, blocks=blocks,
                           param_dtype=param_dtype)
    fuse_linear_cross_entropy(gm, device_memory)
    find_token_means(gm)
    tile_mlps(gm, device_memory)
    tile_norms(gm, device_memory)
    same_attention_kernels(gm)
    try:
        return partition(gm, model, containers)
    except ValueError:
        if layers is not None or len(containers) == 1:
            raise
        return partition(gm, model, containers[:1])  # the other lists do not run in sequence


def same_attention_kernels(gm: fx.GraphModule) -> None:
    """Each attention with dropout in ``gm`` calls ``fxpipe.attention``'s, which picks the
    kernel, so the dropout masks, of the recompute in the forward too."""
    changed = False
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target in attention.SDPA and is_random(n):
            n.target, changed = attention.scaled_dot_product_attention, True
    if changed:
        gm.recompile()


def without_loss_free_outputs(lg: LayerGraph, model: nn.Module) -> LayerGraph:
    """``lg`` whose output leaves that no loss reads (``LayerGraph.loss_free_outputs``: the
    logits beside a fused loss, ``fxpipe.passes.loss``) are ``None`` and not computed: what
    a training call that returns no outputs runs."""
    if not lg.loss_free_outputs or lg.source is None:
        return lg
    return partition(trim_outputs(lg.source, lg.loss_free_outputs), model, lg.containers)


def find_block_lists(model: nn.Module, layers: str | Sequence[str] | None = None) -> list[str]:
    """Module paths of the lists of repeated blocks, the largest first: ``layers`` (a path
    or several, checked), else the ``ModuleList``/``Sequential`` with the most parameters
    and each other one, neither inside nor around a chosen one, holding at least an eighth
    as many (``[""]``: the model's own children).

    >>> t5 = nn.Module()
    >>> t5.encoder, t5.decoder = nn.ModuleList([nn.Linear(4, 4)]), nn.ModuleList([nn.Linear(4, 8)])
    >>> find_block_lists(t5)
    ['decoder', 'encoder']
    """
    modules = dict(model.named_modules())
    if layers is not None:
        paths = [layers] if isinstance(layers, str) else list(layers)
        for path in paths:
            _check_layers(model, modules, path)
        return paths
    counts = {path: sum(p.numel() for p in mod.parameters()) for path, mod in modules.items()
              if isinstance(mod, (nn.ModuleList, nn.Sequential)) and len(mod) > 0}
    if not counts:
        return [""]
    chosen = [max(counts, key=counts.__getitem__)]  # the first of equals, in module order
    for path in sorted(counts, key=lambda p: -counts[p]):
        if counts[path] and 8 * counts[path] >= counts[chosen[0]] and \
                not any(_nested(path, c) for c in chosen):
            chosen.append(path)
    return chosen


def find_blocks(model: nn.Module, layers: str | Sequence[str] | None = None) -> str:
    """Module path of the main list of repeated blocks (see ``find_block_lists``)."""
    return find_block_lists(model, layers)[0]


def _check_layers(model: nn.Module, modules: dict[str, nn.Module], layers: str) -> None:
    if layers not in modules:
        close = difflib.get_close_matches(layers, [k for k in modules if k], n=3)
        hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
        raise ValueError(f"layers={layers!r} names no submodule of {type(model).__name__}."
                         f"{hint} Give the dotted path of the module holding the repeated "
                         "blocks, e.g. layers='model.layers'.")
    if not list(modules[layers].children()):
        raise ValueError(f"layers={layers!r} is a {type(modules[layers]).__name__} with no "
                         "child modules; it must hold the repeated blocks (one layer each).")


def _nested(a: str, b: str) -> bool:
    return a == b or not a or not b or a.startswith(b + ".") or b.startswith(a + ".")


def partition(gm: fx.GraphModule, model: nn.Module, containers: str | Sequence[str]) -> LayerGraph:
    """Cut a captured graph (``fxpipe.passes.capture``) into a ``LayerGraph`` at the
    blocks of ``containers`` (module paths of block lists)."""
    containers = [containers] if isinstance(containers, str) else list(containers)
    layer_of, names = _assign_layers(gm, _positions(model, containers))
    order = sorted(set(layer_of.values()))
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
        call.meta["layer_name"] = names[order[i]]
        for j, o in enumerate(outs):
            env[o] = top.create_node("call_function", operator.getitem, (call, j), name=o.name)
        is_param = {p: isinstance(fetch_attr(gm, p), nn.Parameter) for p in params}
        chain.append(Layer(index=i, name=call.meta["layer_name"], node=call, gm=sub,
                           inputs=[env[r].name for r in reads if r.op != "get_attr"],
                           outputs=[o.name for o in outs],
                           params=[p for p in params if is_param[p]],
                           buffers=[p for p in params if not is_param[p]],
                           random=any(is_random(n) for n in ns),
                           opaque=any(n.target is run_block for n in ns)))
    top.output(fx.node.map_arg(output.args[0], lambda a: env[a]))
    top_gm = graph_module(root, top, class_name="LayerChain")
    tensors = {n.target: fetch_attr(gm, n.target) for n in nodes if n.op == "get_attr"}
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
        training=gm.meta.get("training", True), param_dtype=gm.meta.get("param_dtype"),
        autocast=gm.meta.get("autocast", ()), source=gm, containers=tuple(containers),
        loss_free_outputs=gm.meta.get("loss_free_outputs", ()),
        token_means=gm.meta.get("token_means", {}))


def _positions(model: nn.Module, containers: Sequence[str]) -> list[tuple[str, nn.Module]]:
    """``(path, block)`` for every place of every block list, a block registered twice
    included (``named_children`` would list it once)."""
    out = []
    for c in containers:
        for name, child in (model.get_submodule(c) if c else model)._modules.items():
            if child is not None:
                out.append((f"{c}.{name}" if c else name, child))
    return out


_SUFFIX = float("inf")


def _assign_layers(gm: fx.GraphModule, positions: list[tuple[str, nn.Module]]
                   ) -> tuple[dict[fx.Node, float], dict[float, str]]:
    """node -> layer key (0 = prefix, k = the k-th block call to run, ``_SUFFIX``), and
    each key's layer name."""
    at_path = {path: i for i, (path, _) in enumerate(positions)}
    places: dict[int, list[int]] = {}  # id(block) -> its places in the lists
    for i, (_, block) in enumerate(positions):
        places.setdefault(id(block), []).append(i)

    def call_of(n: fx.Node) -> tuple[int, int] | None:
        """(place, extra): the block call ``n`` is in. The k-th call of a block registered
        at several places is its k-th place; calls beyond its places are extra calls."""
        for path, k in n.meta.get("module_stack", ()):
            if path in at_path:
                mine = places[id(positions[at_path[path]][1])]
                j = mine.index(at_path[path]) + k
                return (mine[j], 0) if j < len(mine) else (mine[-1], j - len(mine) + 1)
        path = n.meta.get("module_path", "")  # a graph without module stacks (torch.compile)
        return next(((i, 0) for i, (p, _) in enumerate(positions)
                     if path == p or path.startswith(p + ".")), None)

    def name(c: tuple[int, int]) -> str:
        return positions[c[0]][0] + (f"@{c[1]}" if c[1] else "")

    compute = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method")]
    calls = {n: call_of(n) for n in compute}
    last_block_pos = max((i for i, n in enumerate(compute) if calls[n] is not None), default=-1)
    keys: dict[tuple[int, int], int] = {}  # block call -> its key, in the order calls run
    names: dict[float, str] = {0: "prefix", _SUFFIX: "suffix"}
    layer_of: dict[fx.Node, float] = {}
    current: float = 0
    active = None
    for pos, n in enumerate(compute):
        c = calls[n]
        if c is not None and c != active:
            if c in keys:
                raise ValueError(
                    f"block {name(c)} runs again after block {name(active)} started (op "
                    f"{n.name!r}); fxpipe needs each block call to run as one piece, one "
                    "after the other. Pass layers= naming a container whose blocks run in "
                    "sequence.")
            keys[c] = current = len(keys) + 1
            names[current] = name(c)
            active = c
        elif c is None and pos > last_block_pos:
            current = _SUFFIX
        layer_of[n] = current
    for n, k in layer_of.items():  # every value must come from this layer or an earlier one
        for a in n.all_input_nodes:
            if a in layer_of and layer_of[a] > k:
                raise ValueError(f"op {n.name!r} in layer {names[k]!r} reads {a.name!r} made "
                                 f"later in layer {names[layer_of[a]]!r}; the model is not a "
                                 "chain of blocks at this cut. Pass layers=.")
    return layer_of, names


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
            root[r.target] = fetch_attr(gm, r.target)
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
