"""Lowering: ``LayerGraph`` + stage ranges → stage GraphModules with explicit transfers.

Each stage is one ``GraphModule`` made by inlining its layers' graphs, with the
transfers as ``torch.ops.fxpipe.*`` nodes (``fxpipe.ops``)::

    def forward(self, embedding, expand_2):
        # stage 1 | layers 1-2 (model.layers.0, model.layers.1) | vcpu:1 | params 34.8 kB | ...
        prefetch = torch.ops.fxpipe.prefetch.default([self.model.layers.0.mlp..., ...], 1, 1)
        model_layers_0_mlp_up_proj_weight = prefetch[0]
        ...
        embedding_1 = torch.ops.fxpipe.upload.default(embedding, 1)
        ...                                       # the layers' own code
        offload = torch.ops.fxpipe.offload.default(add_14)
        release = torch.ops.fxpipe.release.default(prefetch, 1)
        return (offload,)

How the stages run (their transfers once per stage job, in which order on which
device) is the Program, a different value (``passes.schedule``); ``print(pipe)`` lists
it as code (``Executable.listing``).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch
import torch.fx as fx
import torch.nn.functional as F


from fxpipe import ops  # noqa: F401 — registers torch.ops.fxpipe.*
from fxpipe.passes.costs import Cost
from fxpipe.passes.layer_graph import LayerGraph, graph_module
from fxpipe.passes.recompute import unfilled_nodes
from fxpipe.passes.stage import Stage, comment_at_top

_op = torch.ops.fxpipe


def lower(lg: LayerGraph, ranges: list[range], device_names: list[str],
          *, first_index: int = 0, save_cuts: Sequence[int] = ()) -> list[Stage]:
    """Lower ``lg`` for forward stages ``ranges`` (in forward order, covering every layer
    once).

    Stage *i* (numbered from ``first_index``) runs on device ``i mod len(device_names)``.
    ``save_cuts``: layer indices where a backward stage starts; a forward stage spanning
    one also offloads the values live at that cut, so the backward stage can recompute
    from them.
    """
    _check_ranges(ranges, len(lg), full=not save_cuts or ranges[-1].stop == len(lg))
    return [lower_stage(lg, r, first_index + k, (first_index + k) % len(device_names),
                        device_names, save_cuts=save_cuts) for k, r in enumerate(ranges)]


def lower_stage(lg: LayerGraph, r: range, index: int, device: int,
                device_names: list[str], *, save_cuts: Sequence[int] = (), kind: str = "fwd",
                piece: bool = False) -> Stage:
    """One stage running layers ``r`` on device ``device`` (see ``lower``). ``kind``
    (``"fwd"``, ``"bwd"``, ``"fused"``) goes in its header; a ``"bwd"`` stage, which is
    recomputed for backward, gets the nodes its recompute leaves unfilled (``passes.recompute``). ``piece``:
    a layer-grain piece of backward stage ``index``."""
    made_here: set[str] = set()
    reads: list[str] = []
    for i in r:
        for name in lg.layers[i].inputs:
            if name not in made_here and name not in reads:
                reads.append(name)
        made_here.update(lg.layers[i].outputs)
    after = set(lg.boundary(r.stop - 1))
    for cut in save_cuts:
        if r.start < cut < r.stop:
            after.update(lg.boundary(cut - 1))
    outs = [v for v in lg.value_order() if v in made_here and v in after]

    g = fx.Graph()
    env: dict[str, fx.Node] = {name: g.placeholder(name) for name in reads}
    submodules: dict[str, torch.nn.Module] = {}  # bodies of higher-order ops, by reference
    # 1. parameters and buffers: one prefetch for the whole stage
    fqns: list[str] = []
    for i in r:
        for fqn in lg.layers[i].params + lg.layers[i].buffers:
            if fqn not in fqns:
                fqns.append(fqn)
    fqns.sort(key=lambda f: (f not in lg.params, 0))  # parameters first, then buffers
    host = {f: g.create_node("get_attr", f, name="host_" + f.replace(".", "_")) for f in fqns}
    fetched = None
    if fqns:
        fetched = g.create_node("call_function", _op.prefetch.default,
                                ([host[f] for f in fqns], index, device), name="params")
    resident = {}
    for j, f in enumerate(fqns):
        resident[f] = g.create_node("call_function", operator.getitem, (fetched, j),
                                    name=f.replace(".", "_"))
    # 2. inputs to the device
    for name in reads:
        env[name] = g.create_node("call_function", _op.upload.default, (env[name], device),
                                  name=f"{name}_dev")
    # 3. the layers' own code, inlined
    mutated: list[str] = []
    for i in r:
        layer = lg.layers[i]
        lenv: dict[fx.Node, fx.Node] = {}
        if layer.random:
            g.create_node("call_function", _op.rng.default, (i,),
                          name=f"rng_layer_{i}").meta["layer"] = i
        for n in layer.gm.graph.nodes:
            if n.op == "placeholder":
                lenv[n] = env[n.target]
            elif n.op == "get_attr" and n.target in resident:
                lenv[n] = resident[n.target]
            elif n.op == "get_attr":
                submodules[n.target] = getattr(layer.gm, n.target)
                lenv[n] = g.get_attr(n.target)
            elif n.op == "output":
                for o, v in zip(layer.outputs, n.args[0]):
                    env[o] = lenv[v]
            else:
                lenv[n] = g.node_copy(n, lambda a: lenv[a])
                lenv[n].meta["layer"] = i  # the runtime times layers by this
                for f in _mutated_attrs(n):
                    if f in lg.buffers and f not in mutated:
                        mutated.append(f)
    # 4. buffers the stage updated go back; outputs go to the host; parameters are released
    for f in mutated:
        g.call_function(_op.writeback.default, (host[f], resident[f]))
    params = set(resident.values())
    results = [g.create_node("call_function", _op.offload.default,
                             (_unaliased(g, env[o], params),), name=f"{o}_host")
               if _is_tensor_value(env[o]) else env[o] for o in outs]
    if fetched is not None:
        g.create_node("call_function", _op.release.default, (fetched, index), name="release")
    g.output(tuple(results))
    g.lint()
    root = {f: (lg.params.get(f) if f in lg.params else lg.buffers[f]) for f in fqns}
    root.update(submodules)
    header = stage_header(lg, r, index, device_names[device], kind, piece)
    comment_at_top(g, header)
    unfilled = unfilled_nodes(g) if kind == "bwd" else ()
    if unfilled:
        next(n for n in g.nodes if n.name == unfilled[0]).meta["comment"] = (
            f"a recompute for backward skips {', '.join(unfilled)}: backward needs only their inputs")
    if any("comment" in n.meta for n in g.nodes):
        _comment_before_nodes(g)
    gm = graph_module(root, g, class_name=f"Stage{index}" + (f"Layer{r.start}" if piece else ""))
    return Stage(index=index, layers=r, device=device, gm=gm, inputs=reads, outputs=outs,
                 params=fqns, header=header, random=any(lg.layers[i].random for i in r),
                 unfilled=unfilled, kind=kind, piece=piece)


def stage_header(lg: LayerGraph, r: range, index: int, device_name: str, kind: str = "fwd",
                 piece: bool = False) -> str:
    """``stage 3 bwd | layers 4-5 (blocks.3, blocks.4) | vcpu:1 | costs...``; a layer
    piece says ``stage 3 bwd piece``."""
    names = ", ".join(lg.layers[i].name for i in r)
    span = f"layer {r.start}" if len(r) == 1 else f"layers {r.start}-{r.stop - 1}"
    parts = [f"stage {index} {kind}{' piece' if piece else ''}", f"{span} ({names})",
             device_name]
    opaque = [lg.layers[i].name for i in r if lg.layers[i].opaque]
    if opaque:  # each runs as its module: all of its parameters (every expert) are uploaded
        parts.append(f"run as modules, all parameters uploaded: {', '.join(opaque)}")
    total = _sum_costs([lg.layers[i].cost for i in r])
    if total:
        parts.append(total)
    return " | ".join(parts)


def _sum_costs(costs) -> str | None:
    if not costs or any(c is None for c in costs):
        return None
    return str(Cost.sum(costs))


def _unaliased(g: fx.Graph, n: fx.Node, resident: set[fx.Node]) -> fx.Node:
    """``n``, or a copy of it where it is a parameter of the stage or a view of one
    (``x.to(x.dtype)`` returns ``x``): an output outlives the stage, whose parameters'
    device memory ``release`` gives back."""
    a = n
    while a not in resident and _is_view(a) and isinstance(a.args[0], fx.Node):
        a = a.args[0]
    if a not in resident:
        return n
    copy = g.create_node("call_function", torch.ops.aten.clone.default, (n,), name=f"{n.name}_copy")
    copy.meta.update({k: v for k, v in n.meta.items() if k in ("val", "layer")})
    copy.meta["comment"] = f"{n.name} is (a view of) a parameter released at the stage's end"
    return copy


def _is_tensor_value(n: fx.Node) -> bool:
    return isinstance(n.meta.get("val"), torch.Tensor)


_NORM_FNS = {F.batch_norm, torch.batch_norm, F.instance_norm, torch.instance_norm}
_NORM_OPS = {torch.ops.aten.batch_norm, torch.ops.aten.instance_norm}


_VIEW_METHODS = frozenset({"narrow", "view", "select", "__getitem__", "as_strided",
                           "expand", "unsqueeze", "squeeze", "transpose", "permute"})


def _mutated_attrs(n: fx.Node) -> list[str]:
    """Targets of ``get_attr`` inputs that node ``n`` may update in place (directly, or
    through a view of one: a write to ``cache.narrow(0, 0, rows)`` updates ``cache``)."""
    def attr(a):
        while isinstance(a, fx.Node) and a.op != "get_attr" and _is_view(a):
            a = a.args[0]
        return a.target if isinstance(a, fx.Node) and a.op == "get_attr" else None

    if "writes" in n.meta:  # a block run as its module says which buffers it may update
        return list(n.meta["writes"])
    if isinstance(n.target, torch._ops.OpOverload):
        if n.target.overloadpacket in _NORM_OPS:  # their schemas hide the stats update
            return [t for t in (attr(a) for a in n.args) if t]
        out = []
        for arg, val in zip(n.target._schema.arguments, n.args):
            if arg.alias_info is not None and arg.alias_info.is_write and attr(val):
                out.append(attr(val))
        return out
    if n.op == "call_method" and str(n.target).endswith("_") and n.args:
        return [t for t in [attr(n.args[0])] if t]
    if n.op == "call_function" and (n.target in _NORM_FNS or
                                    getattr(n.target, "__name__", "").endswith("_")):
        return [t for t in (attr(a) for a in list(n.args) + list(n.kwargs.values())) if t]
    if n.op == "call_function" and n.target is operator.setitem:
        return [t for t in [attr(n.args[0])] if t]
    return []


def _is_view(n: fx.Node) -> bool:
    """Whether ``n``'s output is a view of its first argument (aten's schema says so)."""
    if not n.args:
        return False
    if isinstance(n.target, torch._ops.OpOverload):
        returns = n.target._schema.returns
        info = returns[0].alias_info if len(returns) == 1 else None
        return info is not None and not info.is_write
    return n.op == "call_method" and n.target in _VIEW_METHODS


def _check_ranges(ranges: list[range], num_layers: int, full: bool = True) -> None:
    """Ranges are contiguous from layer 0; with ``full``, they cover every layer (a fused
    program's forward stages stop where its tail stage starts)."""
    expect = 0
    for r in ranges:
        if not isinstance(r, range) or r.step != 1 or r.start != expect or len(r) == 0:
            raise ValueError(f"stage ranges must be non-empty, contiguous and ascending from 0; "
                             f"got {r!r} where range({expect}, ...) was expected")
        expect = r.stop
    if expect > num_layers or (full and expect != num_layers):
        raise ValueError(f"stage ranges cover layers 0-{expect - 1} but the model has "
                         f"{num_layers} layers")


def _comment_before_nodes(g: fx.Graph) -> None:
    """Emit ``node.meta["comment"]`` above each node's line in the generated code."""
    comments = {n.name: n.meta["comment"] for n in g.nodes if "comment" in n.meta}

    def make(prev):
        def transform(lines):
            lines = prev(lines) if prev else lines
            out = []
            for line in lines:
                head = line.split(" = ", 1)[0].strip()
                if head in comments:
                    out.append(f"# {comments[head]}\n")
                out.append(line)
            return out
        return transform
    g.on_generate_code(make)
