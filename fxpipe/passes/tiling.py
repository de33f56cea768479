"""The tiling pass: a transformer MLP whose intermediates would not fit its share of a
device runs over the tokens in tiles (``fxpipe.tiling.tiled_mlp``).

It finds, in a captured graph (``aten`` ops), the MLPs of the two shapes transformers
use, each linear's weight a parameter, its intermediates read by nothing else:

- gated (Llama, Qwen, Mistral, Gemma): ``linear(act(linear(x, Wg)) * linear(x, Wu), Wd)``;
- plain (Phi, Falcon, BERT-style): ``linear(act(linear(x, W1, b1)), W2, b2)``;

with ``act`` SiLU, GELU (exact or tanh) or ReLU. Its tile is as many tokens as make its
intermediates (about four of ``rows x intermediate`` in the activations' dtype, forward
and backward) ``1 / TILE_FRACTION`` of the smallest device's memory. A call with no more
tokens than that runs it as one plain MLP (as eager does); only a longer one tiles, so an
MLP is rewritten unless its graph's shapes are static and fit one tile. Without a known
device memory nothing is rewritten. The tile shows in the stage code
(``fxpipe_tiling_tiled_mlp(..., act='silu', rows=...)``).
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from fxpipe.tiling import tiled_mlp

aten = torch.ops.aten
_ASSERT = aten._assert_tensor_metadata.default
TILE_FRACTION = 32
"""An MLP's intermediates may take this fraction of a device's memory before it is tiled."""
_ACTS = {aten.silu.default: "silu", aten.relu.default: "relu", aten.gelu.default: "gelu"}


def tile_rows(intermediate: int, itemsize: int, device_memory: int) -> int:
    """Tokens per tile of an MLP ``intermediate`` wide whose activations have ``itemsize``
    bytes, on devices of ``device_memory`` bytes."""
    return max(1, device_memory // TILE_FRACTION // (4 * intermediate * itemsize))


def tile_mlps(gm: fx.GraphModule, device_memory: int | None) -> int:
    """Tile every matched MLP of ``gm`` that needs it (module docstring) in place; returns
    how many were tiled."""
    if device_memory is None:
        return 0
    graph, tiled = gm.graph, 0
    for down in [n for n in graph.nodes if n.target is aten.linear.default]:
        match = _match(gm, down)
        if match is None:
            continue
        x, (w_in, b_in), gate, (w_out, b_out), act, inner = match
        val = x.meta.get("val")
        if not isinstance(val, torch.Tensor) or val.dim() < 1:
            continue
        width = operator.attrgetter(w_in.target)(gm).shape[0]
        rows = tile_rows(width, val.dtype.itemsize, device_memory)
        if not val.shape[:-1].numel() > rows and all(isinstance(d, int) for d in val.shape):
            continue   # static shapes that never need a tile
        w_gate, b_gate = gate or (None, None)
        with graph.inserting_before(down):
            out = graph.call_function(tiled_mlp, (x, w_in, b_in, w_gate, b_gate, w_out, b_out),
                                      {"act": act, "rows": rows})
        out.meta.update({k: v for k, v in down.meta.items() if k != "val"})
        down.replace_all_uses_with(out)
        for n in [down, *reversed(inner)]:
            for u in list(n.users):
                if u.target is _ASSERT:
                    graph.erase_node(u)
            graph.erase_node(n)
        tiled += 1
    if tiled:
        gm.recompile()
    return tiled


def _match(gm: fx.GraphModule, down: fx.Node):
    """``(x, (w_in, b_in), (w_gate, b_gate) | None, (w_out, b_out), act, intermediate
    nodes in order)`` if ``down`` ends an MLP (module docstring)."""
    h = down.args[0]
    w_out, b_out = _weights(gm, down)
    if w_out is None or not isinstance(h, fx.Node) or not _private(h, down):
        return None
    if h.target is aten.mul.Tensor and len(h.args) == 2:   # gated
        for a, u in (h.args, h.args[::-1]):
            act = _activation(a)
            if act is None or not (isinstance(u, fx.Node) and u.target is aten.linear.default):
                continue
            g = a.args[0]
            if not (isinstance(g, fx.Node) and g.target is aten.linear.default):
                continue
            x = g.args[0]
            if u.args[0] is not x or not (_private(a, h) and _private(g, a) and _private(u, h)):
                continue
            up, gate = _weights(gm, u), _weights(gm, g)
            if up[0] is None or gate[0] is None:
                continue
            return x, up, gate, (w_out, b_out), act, [g, a, u, h]
        return None
    act = _activation(h)
    if act is None:
        return None
    fc = h.args[0]
    if not (isinstance(fc, fx.Node) and fc.target is aten.linear.default and _private(fc, h)):
        return None
    w_in = _weights(gm, fc)
    if w_in[0] is None:
        return None
    return fc.args[0], w_in, None, (w_out, b_out), act, [fc, h]


def _activation(n) -> str | None:
    if not isinstance(n, fx.Node) or n.target not in _ACTS:
        return None
    if n.target is aten.gelu.default:
        approximate = n.kwargs.get("approximate", n.args[1] if len(n.args) > 1 else "none")
        return "gelu_tanh" if approximate == "tanh" else "gelu"
    return _ACTS[n.target]


def _weights(gm: fx.GraphModule, linear: fx.Node) -> tuple[fx.Node | None, fx.Node | None]:
    """A linear's weight and bias nodes, if both are the model's tensors (bias may be None)."""
    w = linear.args[1] if len(linear.args) > 1 else None
    b = linear.args[2] if len(linear.args) > 2 else linear.kwargs.get("bias")
    if not (isinstance(w, fx.Node) and w.op == "get_attr"):
        return None, None
    if b is not None and not (isinstance(b, fx.Node) and b.op == "get_attr"):
        return None, None
    return w, b


def _private(n: fx.Node, reader: fx.Node) -> bool:
    """Whether ``reader`` is the only reader of ``n`` (export's dtype checks aside)."""
    return all(u is reader or u.target is _ASSERT for u in n.users)
