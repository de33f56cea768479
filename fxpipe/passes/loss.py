"""The loss pass: a causal LM's head and cross-entropy become ``linear_cross_entropy``.

A Hugging Face causal LM given ``labels=`` computes its loss as (``ForCausalLMLoss``)::

    logits = lm_head(hidden)                     # (batch, seq, vocab)
    logits = cap * tanh(logits / cap)            # Gemma 2's final soft-capping, if any
    loss = cross_entropy(logits.float().view(-1, vocab), shifted_labels.view(-1),
                         ignore_index=-100, reduction="mean" | "sum")  # / num_items_in_batch

which holds the whole (tokens, vocab) logits in fp32, and as much again for their gradient:
63 GiB each for a 128K-token sequence over Llama 3's 128K vocabulary. ``fuse_linear_cross_entropy``
finds that chain in a captured graph (the ``aten`` ops export and dynamo record) and has
the cross-entropy read ``fxpipe.linear_cross_entropy(hidden, lm_head.weight, labels,
chunk_size, ...)`` instead, which makes the logits a chunk of tokens at a time, in forward
and again in backward (``fxpipe.losses``). What the chain matches:

- the head: ``aten.linear(hidden, weight[, bias])``;
- then, in any order the model wrote them: views and reshapes that keep the vocabulary as
  the last dim, a cast (``.float()``), the soft-capping ``mul(tanh(div(z, c)), c)``;
- the loss: ``aten.cross_entropy_loss`` over 2-d logits, class-index targets, no class
  weights, no label smoothing, reduction mean or sum (a following division by
  ``num_items_in_batch`` is left as it is).

The shift of the labels, the ignore index and the reduction are the model's own nodes and
arguments; the loss keeps the cross-entropy's dtype (fp32 after the upcast). Anything else
(class weights, label smoothing, ``reduction="none"``, logits used by the loss in another
way) is left unchanged.

The logits the model returns beside its loss are still computed by the graph. Nothing in
the loss reads them any more, so a training call that does not want them can leave them
out: the pass lists those output leaves in ``gm.meta["loss_free_outputs"]``, and
``trim_outputs`` makes the graph that returns ``None`` in their place (what
``forward_backward`` runs unless ``return_outputs=True`` or its ``loss_fn`` reads them).

The chunk (``chunk_size`` tokens, printed in the code) comes from the devices' memory
(``chunk_rows``): a 64th of the smallest device's memory, at most ``losses.CHUNK_BYTES``,
of fp32 logits.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode

from fxpipe.losses import CHUNK_BYTES, linear_cross_entropy
from fxpipe.passes import fetch_attr

aten = torch.ops.aten
_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
_CASTS = {aten.to.dtype, aten._to_copy.default, aten.to.dtype_layout}
_ASSERT = aten._assert_tensor_metadata.default
_REDUCTIONS = {1: "mean", 2: "sum"}   # at::Reduction: 0 none, 1 mean, 2 sum
CHUNK_FRACTION = 64
"""The logits chunk is at most this fraction of the device's memory (its backward holds
about three chunks at once: the fp32 probabilities, their cast and the matmul's output)."""


def chunk_rows(vocab: int, device_memory: int | None) -> int:
    """Tokens per chunk of ``linear_cross_entropy`` for a ``vocab``-wide head on devices of
    ``device_memory`` bytes (``None``: unknown, ``CHUNK_BYTES`` of fp32 logits)."""
    limit = CHUNK_BYTES if device_memory is None else min(CHUNK_BYTES, device_memory // CHUNK_FRACTION)
    return max(1, limit // (4 * vocab))


def fuse_linear_cross_entropy(gm: fx.GraphModule, device_memory: int | None = None) -> int:
    """Rewrite every matched head + cross-entropy of ``gm`` (module docstring) in place;
    returns how many. Records the output leaves only the user reads afterwards in
    ``gm.meta["loss_free_outputs"]``."""
    graph = gm.graph
    rewritten, chains = 0, set()
    for ce in [n for n in graph.nodes if n.op == "call_function"
               and n.target is aten.cross_entropy_loss.default]:
        match = _match(gm, ce)
        if match is None:
            continue
        head, chain, softcap = match
        hidden, weight, *rest = head.args
        bias = rest[0] if rest else head.kwargs.get("bias")
        target, reduction, ignore_index = _ce_args(ce)[1:4]
        vocab = fetch_attr(gm, weight.target).shape[0]
        with graph.inserting_before(ce):
            flat = graph.call_function(aten.flatten.using_ints, (hidden, 0, -2))
            kwargs = {"bias": bias, "softcap": softcap, "out_dtype": _dtype(ce)}
            loss = graph.call_function(
                linear_cross_entropy,
                (flat, weight, target, chunk_rows(vocab, device_memory), ignore_index,
                 _REDUCTIONS[reduction]),
                {k: v for k, v in kwargs.items() if v is not None})
        flat.meta.update({k: v for k, v in ce.meta.items() if k != "val"})
        loss.meta.update(ce.meta)   # the same scalar, in the same dtype
        ce.replace_all_uses_with(loss)
        graph.erase_node(ce)
        chains |= chain
        rewritten += 1
    if rewritten:
        _eliminate_dead_code(graph)
        gm.recompile()
        leaves = graph.output_node().args[0]
        gm.meta["loss_free_outputs"] = tuple(
            i for i, a in enumerate(leaves) if isinstance(a, fx.Node) and a in chains
            and not _feeds_a_loss(a))
    return rewritten


def trim_outputs(gm: fx.GraphModule, leaves: Sequence[int]) -> fx.GraphModule:
    """A copy of the captured ``gm`` that returns ``None`` for the output ``leaves`` (flat
    indices) and no longer computes what only they needed."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    out = graph.graph_copy(gm.graph, env)
    drop = set(leaves)
    graph.output(type(out)(None if i in drop else a for i, a in enumerate(out)))
    _eliminate_dead_code(graph)
    trimmed = fx.GraphModule(gm, graph, class_name=type(gm).__name__)
    trimmed.meta = {**gm.meta, "loss_free_outputs": ()}
    return trimmed


def loss_reads_dropped(lg: Any, loss_fn: Callable[[Any, Any], Any], label: Any) -> bool:
    """Whether ``loss_fn(outputs, label)`` needs an output leaf of ``lg`` (a ``LayerGraph``)
    that no loss reads (``lg.loss_free_outputs``): ``loss_fn`` is run once on stand-ins
    (fake tensors of the outputs' dtypes and ranks, ``None`` for those leaves) and needs
    them if it fails or returns no tensor. It reads ``out.loss`` and not ``out.logits``:
    ``False``."""
    vals = [a.meta.get("val") if isinstance(a, fx.Node) else a
            for a in lg.source.graph.output_node().args[0]]
    drop = set(lg.loss_free_outputs)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        leaves = [None if i in drop else
                  torch.empty((1,) * v.dim(), dtype=v.dtype) if isinstance(v, torch.Tensor) else v
                  for i, v in enumerate(vals)]
        fake_label = pytree.tree_map_only(torch.Tensor, mode.from_tensor, label)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                loss = loss_fn(pytree.tree_unflatten(leaves, lg.out_spec), fake_label)
        except Exception:  # noqa: BLE001 — any failure: it reads them
            return True
    if isinstance(loss, tuple) and len(loss) == 2:   # (sum, count): fxpipe.runtime.issue.loss_weights
        loss = loss[0]
    return not isinstance(loss, torch.Tensor)


def _match(gm: fx.GraphModule, ce: fx.Node) -> tuple[fx.Node, set[fx.Node], float | None] | None:
    """``(head, chain nodes, softcap)`` if ``ce`` is a cross-entropy over a head's logits."""
    logits, target, reduction, _, weight, smoothing = _ce_args(ce)
    if weight is not None or smoothing != 0.0 or reduction not in _REDUCTIONS:
        return None
    if not isinstance(logits, fx.Node) or not isinstance(target, fx.Node):
        return None
    val, tval = logits.meta.get("val"), target.meta.get("val")
    if val is None or tval is None or val.dim() != 2 or tval.dim() != 1 \
            or tval.dtype not in (torch.int64, torch.int32):
        return None
    vocab = val.shape[-1]
    chain, x, softcap = set(), logits, None
    while isinstance(x, fx.Node) and x.op == "call_function":
        v = x.meta.get("val")
        if not isinstance(v, torch.Tensor) or v.shape[-1] != vocab:
            return None
        if x.target is aten.linear.default:
            w = x.args[1]
            if not (isinstance(w, fx.Node) and w.op == "get_attr"
                    and tuple(fetch_attr(gm, w.target).shape)[:1] == (vocab,)):
                return None
            chain.add(x)
            return x, chain, softcap
        if x.target in _VIEWS or x.target in _CASTS:
            chain.add(x)
            x = x.args[0]
            continue
        capped = _softcap(x)
        if capped is None or softcap is not None:
            return None
        softcap, inner, nodes = capped
        chain |= nodes
        x = inner
    return None


def _softcap(x: fx.Node) -> tuple[float, fx.Node, set[fx.Node]] | None:
    """``(cap, z, nodes)`` if ``x`` is ``mul(tanh(div(z, cap)), cap)``."""
    if x.target is not aten.mul.Tensor or len(x.args) != 2:
        return None
    t, cap = x.args
    if not (isinstance(t, fx.Node) and t.target is aten.tanh.default and isinstance(cap, (int, float))):
        return None
    d = t.args[0]
    if not (isinstance(d, fx.Node) and d.target is aten.div.Tensor and d.args[1] == cap):
        return None
    return float(cap), d.args[0], {x, t, d}


def _ce_args(ce: fx.Node) -> tuple:
    """``(input, target, reduction, ignore_index, weight, label_smoothing)`` of an
    ``aten.cross_entropy_loss`` node, defaults filled in."""
    names = ("self", "target", "weight", "reduction", "ignore_index", "label_smoothing")
    values = dict(zip(names, (None, None, None, 1, -100, 0.0)))
    values.update(zip(names, ce.args))
    values.update(ce.kwargs)
    return (values["self"], values["target"], values["reduction"], values["ignore_index"],
            values["weight"], values["label_smoothing"])


def _feeds_a_loss(node: fx.Node) -> bool:
    """Whether anything but the graph's output (or export's dtype checks) still reads ``node``."""
    return any(u.op != "output" and u.target is not _ASSERT for u in node.users)


def _eliminate_dead_code(graph: fx.Graph) -> None:
    """Dead code elimination that also drops export's dtype checks of values nothing
    else reads (fx keeps them: they are side effects)."""
    while True:
        graph.eliminate_dead_code()
        checks = [a for a in graph.nodes if a.target is _ASSERT and isinstance(a.args[0], fx.Node)
                  and all(u.target is _ASSERT for u in a.args[0].users)]
        if not checks:
            return
        for a in checks:
            graph.erase_node(a)


def _dtype(node: fx.Node) -> torch.dtype | None:
    val = node.meta.get("val")
    return val.dtype if isinstance(val, torch.Tensor) else None
