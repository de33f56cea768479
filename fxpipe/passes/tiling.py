"""The tiling pass: a transformer MLP or RMSNorm whose intermediates would not fit its
share of a device runs over the tokens in tiles (``fxpipe.tiling.tiled_mlp``,
``fxpipe.tiling.tiled_rms_norm``).

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

RMSNorms of ``LlamaRMSNorm``'s form (Llama, Qwen2/3 and their q/k norms, Mistral):
``weight * cast(up * rsqrt(mean(up ** 2, -1, keepdim) + eps))``, ``up`` the input in fp32
(upcast there or already), ``cast`` back to the input's dtype or none, each intermediate
read by nothing else. Its tile is as many rows as make ``NORM_BYTES`` per element
``1 / TILE_FRACTION`` of the smallest device's memory; shown as
``fxpipe_tiling_tiled_rms_norm(x, w, eps=1e-06, dtype=torch.bfloat16, rows=...)``. Norms
written otherwise (Gemma's ``1 + weight`` in fp32, LayerNorm) are left as they are.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from fxpipe.tiling import NORM_BYTES, tiled_mlp, tiled_rms_norm

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
        _erase(graph, [down, *reversed(inner)])
        tiled += 1
    if tiled:
        gm.recompile()
    return tiled


def tile_norms(gm: fx.GraphModule, device_memory: int | None) -> int:
    """Tile every matched RMSNorm of ``gm`` that needs it (module docstring) in place;
    returns how many were tiled."""
    if device_memory is None:
        return 0
    graph, tiled = gm.graph, 0
    for out in [n for n in graph.nodes if n.target is aten.mul.Tensor]:
        match = _match_norm(out)
        if match is None:
            continue
        x, weight, eps, dtype, inner = match
        val = x.meta.get("val")
        if not isinstance(val, torch.Tensor) or val.dim() < 1:
            continue
        rows = max(1, device_memory // TILE_FRACTION // (NORM_BYTES * int(val.shape[-1])))
        if not val.shape[:-1].numel() > rows and all(isinstance(d, int) for d in val.shape):
            continue   # static shapes that never need a tile
        with graph.inserting_before(out):
            new = graph.call_function(tiled_rms_norm, (x, weight),
                                      {"eps": eps, "dtype": dtype, "rows": rows})
        new.meta.update({k: v for k, v in out.meta.items() if k != "val"})
        out.replace_all_uses_with(new)
        _erase(graph, [out, *reversed(inner)])
        tiled += 1
    if tiled:
        gm.recompile()
    return tiled


_CASTS = (aten.to.dtype, aten._to_copy.default)


def _cast_to(n) -> torch.dtype | None:
    """The dtype a cast node casts to (None: not a plain cast)."""
    if not isinstance(n, fx.Node) or n.target not in _CASTS:
        return None
    if n.target is aten.to.dtype:
        return n.args[1] if len(n.args) > 1 else n.kwargs.get("dtype")
    extra = set(n.kwargs) - {"dtype", "layout", "device"}
    return None if extra or len(n.args) > 1 else n.kwargs.get("dtype")


def _match_norm(out: fx.Node):
    """``(x, weight, eps, dtype, intermediate nodes in order)`` if ``out`` ends a
    ``LlamaRMSNorm`` (``weight * cast(up * rsqrt(mean(up ** 2, -1) + eps))``, ``up`` =
    ``x`` in fp32)."""
    if len(out.args) != 2:
        return None
    for weight, cast in (out.args, out.args[::-1]):
        if isinstance(weight, fx.Node) and weight.op == "get_attr" and isinstance(cast, fx.Node):
            break
    else:
        return None
    dtype = _cast_to(cast)
    normed = cast.args[0] if dtype is not None else cast
    if dtype is not None and not _private(cast, out):
        return None
    reader = cast if dtype is not None else out
    if not (isinstance(normed, fx.Node) and normed.target is aten.mul.Tensor
            and len(normed.args) == 2 and _private(normed, reader)):
        return None
    for up, r in (normed.args, normed.args[::-1]):
        if isinstance(r, fx.Node) and r.target is aten.rsqrt.default:
            break
    else:
        return None
    add = r.args[0]
    if not (isinstance(add, fx.Node) and add.target is aten.add.Tensor and _private(r, normed)
            and _private(add, r) and isinstance(add.args[1], float)):
        return None
    mean = add.args[0]
    if not (isinstance(mean, fx.Node) and mean.target is aten.mean.dim and _private(mean, add)):
        return None
    square = mean.args[0]
    val = up.meta.get("val") if isinstance(up, fx.Node) else None
    if not (isinstance(val, torch.Tensor) and val.dtype == torch.float32
            and list(mean.args[1]) in ([-1], [val.dim() - 1])
            and (mean.args[2] if len(mean.args) > 2 else mean.kwargs.get("keepdim")) is True):
        return None
    if not (isinstance(square, fx.Node) and square.target is aten.pow.Tensor_Scalar
            and square.args[0] is up and square.args[1] == 2 and _private(square, mean)):
        return None
    inner = [square, mean, add, r, normed] + ([cast] if dtype is not None else [])
    if _cast_to(up) == torch.float32 and all(
            u in (square, normed) or u.target is _ASSERT for u in up.users):
        return up.args[0], weight, add.args[1], dtype, [up, *inner]   # x upcast in the norm
    return up, weight, add.args[1], dtype, inner   # x in fp32 already


def _erase(graph: fx.Graph, nodes: list[fx.Node]) -> None:
    """Erase ``nodes`` (readers first) with export's dtype checks of them."""
    for n in nodes:
        for u in list(n.users):
            if u.target is _ASSERT:
                graph.erase_node(u)
        graph.erase_node(n)


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
