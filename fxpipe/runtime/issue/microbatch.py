"""Split inputs and labels into microbatches, merge outputs back (``RunConfig`` semantics).

The spec vocabulary is ``torch.distributed.pipelining.microbatch``'s: ``TensorChunkSpec(dim)``
splits (or concatenates) along ``dim``, ``_Replicate`` (the class or an instance) copies
the value to every microbatch (or checks the outputs are equal), ``_CustomReducer(init,
fn)`` folds the outputs with ``fn``. A spec mirrors the value's structure (tuples, lists,
dicts, registered pytree types); ``None`` anywhere in it means "auto" for that subtree, a
dict spec may leave keys out (auto), and a leaf spec placed on a container applies to
every leaf below it.

Auto rules: tensors with >= 1 dim split along dim 0 (sizes as ``torch.tensor_split``:
they differ by at most one, first chunks larger); 0-dim tensors and other values are
replicated; unregistered custom types are leaves. Merging concatenates >= 1-dim tensors on
dim 0, averages 0-dim tensors (a pipe's call weights each microbatch by its share of the
batch: ``fxpipe.runtime.issue.loss_weights``) and requires everything else to be equal.

>>> import torch
>>> args, kwargs = split_input((torch.arange(5),), {"scale": 2.0}, 2, None)
>>> [a[0].tolist() for a in args], kwargs[1]
([[0, 1, 2], [3, 4]], {'scale': 2.0})
>>> merge_output([torch.ones(2), torch.zeros(1)], None).tolist()
[1.0, 1.0, 0.0]
"""

from __future__ import annotations

import functools
import importlib
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

__all__ = ["PackedData", "merge_output",
           "microbatch_weights", "split_input", "split_label"]

# The spec types live in torch.distributed.pipelining, whose import takes 1.5 s (DTensor,
# dynamo): fxpipe does not import it. A spec object exists only once its caller has.
_SPECS = "torch.distributed.pipelining.microbatch"


def __getattr__(name: str) -> Any:
    """``TensorChunkSpec``, ``_CustomReducer``, ``_Replicate``: imported on first use."""
    if name in ("TensorChunkSpec", "_CustomReducer", "_Replicate"):
        return getattr(importlib.import_module(_SPECS), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _spec_type(name: str) -> type | None:
    module = sys.modules.get(_SPECS)
    return None if module is None else getattr(module, name)


def is_chunk_spec(spec: Any) -> bool:
    """Whether ``spec`` is a ``TensorChunkSpec``."""
    kind = _spec_type("TensorChunkSpec")
    return kind is not None and isinstance(spec, kind)


def _is_reducer(spec: Any) -> bool:
    kind = _spec_type("_CustomReducer")
    return kind is not None and isinstance(spec, kind)

_AUTO = object()  # "no spec here": apply the auto rules


class PackedData(list):
    """One output leaf kept per microbatch (``merge_output=False``): ``PackedData[i]`` is
    microbatch *i*'s value.

    Transfers that are still in flight can be attached with ``add_pending(event)`` (any
    object with ``.synchronize()`` — a CUDA event — or ``.wait()`` — a ``threading.Event``);
    ``synchronize()`` waits for them and returns ``self``. Given to ``split_input``, a
    ``PackedData`` feeds its microbatches directly instead of being split.

    >>> p = PackedData([1, 2])
    >>> p.synchronize() == [1, 2], p
    (True, PackedData([1, 2]))
    """

    def __init__(self, values: Any = (), pending: Sequence[Any] = ()):
        super().__init__(values)
        self._pending = list(pending)

    def add_pending(self, event: Any) -> None:
        """Attach a transfer event that ``synchronize()`` must wait for."""
        self._pending.append(event)

    @property
    def pending(self) -> int:
        """How many attached events have not been waited for."""
        return len(self._pending)

    def synchronize(self) -> PackedData:
        """Wait for every attached event, then return ``self``."""
        while self._pending:
            event = self._pending.pop(0)
            wait = getattr(event, "synchronize", None) or getattr(event, "wait")
            wait()
        return self

    def __repr__(self) -> str:
        return f"PackedData({list.__repr__(self)})"


# --- helpers -------------------------------------------------------------------------


def _is_replicate(spec: Any) -> bool:
    kind = _spec_type("_Replicate")
    return kind is not None and (spec is kind or isinstance(spec, kind))


def _is_spec_leaf(spec: Any) -> bool:
    return _is_replicate(spec) or is_chunk_spec(spec) or _is_reducer(spec)


def _node(x: Any) -> tuple[list[Any], list[str], pytree.TreeSpec] | None:
    """One level of a pytree node: (children, key strings, spec); ``None`` for a leaf."""
    if isinstance(x, PackedData) or pytree.tree_is_leaf(x):
        return None
    try:
        pairs, spec = pytree.tree_flatten_with_path(x, is_leaf=lambda y: y is not x)
        return [c for _, c in pairs], [pytree.keystr(k) for k, _ in pairs], spec
    except ValueError:  # a type registered without key paths
        children, spec = pytree.tree_flatten(x, is_leaf=lambda y: y is not x)
        return children, [f"[{i}]" for i in range(len(children))], spec


def _describe(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"a tensor of shape {tuple(x.shape)}"
    text = repr(x)
    return f"{type(x).__name__} {text if len(text) <= 60 else text[:57] + '...'}"


def _structure(node: tuple | None, x: Any) -> str:
    """A short description of a value's container shape, for error messages."""
    if node is None:
        return _describe(x)
    children, _, spec = node
    name = getattr(spec.type, "__name__", str(spec.type))
    if spec.type in (dict, pytree.OrderedDict, pytree.defaultdict):
        return f"{name} with keys {list(spec.context)}"
    return f"{name} of {len(children)}"


def _match_spec(value_node: tuple, spec: Any, path: str) -> list[Any]:
    """The child specs of a container ``spec`` lined up with ``value``'s children."""
    children, keys, vspec = value_node
    if isinstance(spec, Mapping):
        if vspec.type not in (dict, pytree.OrderedDict, pytree.defaultdict):
            raise ValueError(f"{path}: spec is a dict but the value is {vspec.type.__name__}")
        names = list(vspec.context)
        extra = [k for k in spec if k not in names]
        if extra:
            raise ValueError(f"{path}: spec has keys {extra} that the value does not have "
                             f"(value keys: {names})")
        return [spec.get(k, _AUTO) for k in names]
    snode = _node(spec)
    if snode is None:
        raise TypeError(f"{path}: unknown spec {spec!r}; use None, TensorChunkSpec(dim), "
                        f"_Replicate, _CustomReducer (merge only) or a tuple/list/dict of them")
    sequences = (tuple, list, pytree.namedtuple)
    same_kind = (snode[2].type in (tuple, list) and vspec.type in sequences) or \
        snode[2].type is vspec.type
    if not same_kind or len(snode[0]) != len(children):
        raise ValueError(f"{path}: spec is {_structure(snode, spec)} but the value is "
                         f"{_structure(value_node, None)}")
    return snode[0]


# --- splitting -----------------------------------------------------------------------


def _split_tensor(t: torch.Tensor, dim: int, n: int, path: str) -> list[torch.Tensor]:
    if t.dim() == 0:
        raise ValueError(f"{path}: cannot split a 0-dim tensor along dim {dim}; "
                         f"replicate it with _Replicate")
    d = dim + t.dim() if dim < 0 else dim
    if not 0 <= d < t.dim():
        raise ValueError(f"{path}: split dim {dim} is out of range for shape {tuple(t.shape)}")
    if t.size(d) < n:
        raise ValueError(f"{path}: cannot split {t.size(d)} rows along dim {d} (shape "
                         f"{tuple(t.shape)}) into {n} microbatches; lower num_microbatch to "
                         f"at most {t.size(d)} or replicate it with _Replicate")
    return list(torch.tensor_split(t, n, d))


def _split(value: Any, spec: Any, n: int, path: str) -> list[Any]:
    if spec is None:
        spec = _AUTO
    if isinstance(value, PackedData):
        if len(value) != n:
            raise ValueError(f"{path}: PackedData holds {len(value)} microbatches but "
                             f"num_microbatch is {n}; run both pipes with the same num_microbatch")
        return list(value.synchronize())
    if _is_replicate(spec):
        return [value] * n
    if _is_reducer(spec):
        raise TypeError(f"{path}: _CustomReducer only merges outputs; split with "
                        f"TensorChunkSpec(dim) or _Replicate")
    node = _node(value)
    if spec is _AUTO or is_chunk_spec(spec):
        if isinstance(value, torch.Tensor):
            if spec is _AUTO:
                return [value] * n if value.dim() == 0 else _split_tensor(value, 0, n, path)
            return _split_tensor(value, spec.split_dim, n, path)
        if node is None:
            if spec is _AUTO:
                return [value] * n
            raise TypeError(f"{path}: {spec} given for {_describe(value)}; only tensors can "
                            f"be split (use _Replicate)")
        child_specs = [spec] * len(node[0])
    else:
        if node is None:
            raise ValueError(f"{path}: spec {spec!r} is a container but the value is "
                             f"{_describe(value)}")
        child_specs = _match_spec(node, spec, path)
    children, keys, treespec = node
    parts = [_split(c, s, n, path + k) for c, s, k in zip(children, child_specs, keys)]
    return [pytree.tree_unflatten([p[i] for p in parts], treespec) for i in range(n)]


def _check_n(n: int) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"num_microbatch must be an int >= 1, got {n!r}")


def uses_callable(spec: Any) -> bool:
    return callable(spec) and not _is_spec_leaf(spec) and not isinstance(spec, (tuple, list, dict))


def split_input(args: Sequence[Any], kwargs: Mapping[str, Any] | None, n: int,
                spec: Any = None) -> tuple[list[tuple], list[dict]]:
    """Split positional and keyword arguments into ``n`` microbatches.

    ``spec``: ``None`` (auto), ``(args_spec, kwargs_spec)`` (either may be ``None``), or a
    callable ``(args, kwargs, n) -> (list[tuple], list[dict])``.

    >>> import torch
    >>> from torch.distributed.pipelining.microbatch import TensorChunkSpec
    >>> a, k = split_input((torch.zeros(4, 6),), {}, 3, ((TensorChunkSpec(1),), None))
    >>> [x[0].shape[1] for x in a]
    [2, 2, 2]
    """
    _check_n(n)
    args, kwargs = tuple(args), dict(kwargs or {})
    if uses_callable(spec):
        out = spec(args, kwargs, n)
        if not (isinstance(out, (tuple, list)) and len(out) == 2):
            raise TypeError("split_input callable must return (args_list, kwargs_list), got "
                            f"{type(out).__name__}")
        args_list, kwargs_list = list(out[0]), list(out[1])
        if len(args_list) != n or len(kwargs_list) != n:
            raise ValueError(f"split_input callable returned {len(args_list)} args and "
                             f"{len(kwargs_list)} kwargs microbatches; expected {n} "
                             f"(num_microbatch) of each")
        for i, kw in enumerate(kwargs_list):
            if not isinstance(kw, Mapping):
                raise TypeError(f"split_input callable: kwargs microbatch {i} is "
                                f"{type(kw).__name__}, expected a dict")
        return [tuple(a) for a in args_list], [dict(k) for k in kwargs_list]
    if spec is None:
        args_spec = kwargs_spec = None
    elif isinstance(spec, (tuple, list)) and len(spec) == 2:
        args_spec, kwargs_spec = spec
    else:
        raise TypeError("split_input must be None, (args_spec, kwargs_spec) or a callable "
                        f"(args, kwargs, n) -> (list[tuple], list[dict]); got {spec!r}")
    return _split(args, args_spec, n, "args"), _split(kwargs, kwargs_spec, n, "kwargs")


def batch_rows(args: Sequence[Any], kwargs: Mapping[str, Any] | None = None) -> int | None:
    """The rows of a call's batch as the default split sees them: dim 0 of its first
    tensor with a dim (``None``: none, or the call passes ``PackedData``).

    >>> batch_rows((torch.zeros(3, 8),), {"mask": torch.ones(3, 8)})
    3
    """
    leaves = pytree.tree_leaves((tuple(args), dict(kwargs or {})))
    if any(isinstance(x, PackedData) for x in leaves):
        return None
    return next((x.shape[0] for x in leaves if isinstance(x, torch.Tensor) and x.dim() > 0), None)


def check_rows(args: Sequence[Any], kwargs: Mapping[str, Any] | None, label: Any,
               n: int) -> None:
    """Before a call splits its inputs (and ``label``) into ``n`` microbatches along dim 0
    (the default split): each tensor's microbatch ``m`` must hold the rows matching the
    batch's microbatch ``m`` (the same rows, or a fixed multiple of them, e.g. labels
    flattened per token), else a ``ValueError`` naming the caller's shapes (not one
    microbatch's, where an op of the model or its loss would report it).

    >>> check_rows((torch.zeros(6, 4),), {}, torch.zeros(5), 2)
    Traceback (most recent call last):
    ...
    ValueError: label has 5 rows (shape (5,)) and the inputs 6 (args[0], shape (6, 4)): ...
    """
    rows = batch_rows(args, kwargs)
    if rows is None or n < 2:
        return
    parts = _part_rows(rows, min(n, rows))
    paths = pytree.tree_flatten_with_path((tuple(args), dict(kwargs or {})))[0]
    tensors = [(_input_name(p), x, "split_input") for p, x in paths
               if isinstance(x, torch.Tensor) and x.dim() > 0]
    name, first, _ = tensors[0]
    labels = [("label" + pytree.keystr(p), t, "split_label")
              for p, t in pytree.tree_flatten_with_path(label)[0]]
    for what, t, spec in tensors[1:] + labels:
        if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] == rows:
            continue
        got = _part_rows(t.shape[0], len(parts))
        if all(g * rows == p * t.shape[0] for g, p in zip(got, parts)):
            continue   # a fixed multiple, split alike (e.g. one label per token)
        fix = f"split it yourself (RunConfig({spec}=...))"
        raise ValueError(
            f"{what} has {t.shape[0]} rows (shape {tuple(t.shape)}) and the inputs {rows} "
            f"({name}, shape {tuple(first.shape)}): both are split into {len(parts)} "
            f"microbatches along dim 0, whose rows would not match. Give {what} one row per "
            f"input row, or {fix}.")


def _input_name(path: tuple) -> str:
    """``args[0]``, ``labels``, ``batch['ids']``: a call's input leaf by its pytree path."""
    head = f"args[{path[1].idx}]" if path[0].idx == 0 else str(path[1].key)
    return head + pytree.keystr(path[2:])


def _part_rows(rows: int, n: int) -> list[int]:
    """The rows of each of the ``n`` parts ``torch.tensor_split`` cuts ``rows`` into (no
    tensor work: a call does none outside its Program)."""
    return [rows // n + (1 if i < rows % n else 0) for i in range(n)]


def split_label(label: Any, n: int, spec: Any = None) -> list[Any]:
    """Split a label into ``n`` microbatches: ``spec`` is ``None`` (auto), a spec mirroring
    the label, or a callable ``(label, n) -> list``.

    >>> import torch
    >>> from torch.distributed.pipelining.microbatch import TensorChunkSpec
    >>> [t.shape for t in split_label(torch.zeros(2, 5), 2, TensorChunkSpec(1))]
    [torch.Size([2, 3]), torch.Size([2, 2])]
    """
    _check_n(n)
    if uses_callable(spec):
        out = spec(label, n)
        if not isinstance(out, (list, tuple)) or len(out) != n:
            got = len(out) if isinstance(out, (list, tuple)) else type(out).__name__
            raise ValueError(f"split_label callable returned {got}; expected a list of {n} "
                             f"(num_microbatch) labels")
        return list(out)
    return _split(label, spec, n, "label")


# --- merging -------------------------------------------------------------------------


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and \
            a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b.to(a.device))
    try:
        return bool(a == b)
    except Exception:  # e.g. an object whose == returns an array
        return a is b


def _check_equal(values: list[Any], path: str) -> Any:
    for i, v in enumerate(values[1:], 1):
        if not _equal(values[0], v):
            raise ValueError(f"{path}: microbatch outputs differ ({_describe(values[0])} in "
                             f"microbatch 0, {_describe(v)} in microbatch {i}); values that "
                             f"are not split must be equal across microbatches — give "
                             f"merge_output a spec or a callable to combine them")
    return values[0]


def _average(values: list[torch.Tensor], weights: Sequence[float] | None) -> torch.Tensor:
    stacked = torch.stack(values)
    if not (stacked.is_floating_point() or stacked.is_complex()):
        stacked = stacked.to(torch.get_default_dtype())
    if weights is None:
        return stacked.mean(0)
    w = torch.tensor([float(x) for x in weights], dtype=stacked.dtype, device=stacked.device)
    return (stacked * (w / w.sum())).sum(0)


def _merge(values: list[Any], spec: Any, path: str,
           weights: Callable[[str], Sequence[float] | None]) -> Any:
    if spec is None:
        spec = _AUTO
    if _is_reducer(spec):
        return functools.reduce(spec.reduce_fn, values, spec.init_value)
    if _is_replicate(spec):
        return _check_equal(values, path)
    first = values[0]
    if isinstance(first, torch.Tensor) and (spec is _AUTO or is_chunk_spec(spec)):
        for i, v in enumerate(values):
            if not isinstance(v, torch.Tensor):
                raise ValueError(f"{path}: microbatch 0 returned a tensor but microbatch {i} "
                                 f"returned {_describe(v)}")
        if spec is _AUTO and first.dim() == 0:
            return _average(values, weights(path))
        dim = 0 if spec is _AUTO else spec.split_dim
        if any(v.dim() == 0 for v in values):
            raise ValueError(f"{path}: cannot concatenate 0-dim tensors along dim {dim}; use "
                             f"_Replicate or _CustomReducer")
        return torch.cat(values, dim)
    node = _node(first)
    if node is None:
        if spec is _AUTO:
            return _check_equal(values, path)
        if is_chunk_spec(spec):
            raise TypeError(f"{path}: {spec} given for {_describe(first)}; only tensors can "
                            f"be concatenated")
        raise ValueError(f"{path}: spec {spec!r} is a container but the output is "
                         f"{_describe(first)}")
    children, keys, treespec = node
    child_specs = [spec] * len(children) if spec is _AUTO or is_chunk_spec(spec) \
        else _match_spec(node, spec, path)
    columns = [children]
    for i, v in enumerate(values[1:], 1):
        vnode = _node(v)
        if vnode is None or vnode[2] != treespec:
            raise ValueError(f"{path}: microbatch {i} returned {_structure(vnode, v)} but "
                             f"microbatch 0 returned {_structure(node, first)}")
        columns.append(vnode[0])
    merged = [_merge([col[j] for col in columns], s, path + k, weights)
              for j, (s, k) in enumerate(zip(child_specs, keys))]
    return pytree.tree_unflatten(merged, treespec)


def _pack(outputs: list[Any]) -> Any:
    leaves0, treespec = pytree.tree_flatten(outputs[0], is_leaf=lambda x: isinstance(x, PackedData))
    columns = [leaves0]
    for i, out in enumerate(outputs[1:], 1):
        leaves, spec = pytree.tree_flatten(out, is_leaf=lambda x: isinstance(x, PackedData))
        if spec != treespec:
            raise ValueError(f"output: microbatch {i} has structure {spec} but microbatch 0 "
                             f"has {treespec}")
        columns.append(leaves)
    packed = [PackedData(col[j] for col in columns) for j in range(len(leaves0))]
    return pytree.tree_unflatten(packed, treespec)


def merge_output(outputs: Sequence[Any], spec: Any = None, *,
                 weights: Sequence[float] | None = None,
                 leaf_weights: Mapping[str, Sequence[float]] | None = None) -> Any:
    """Merge per-microbatch outputs into one value.

    ``spec``: ``None``/``True`` (auto), a spec mirroring the output, a callable
    ``(list) -> Any``, or ``False`` (every leaf becomes a ``PackedData``). ``weights``
    (e.g. ``microbatch_weights(sizes)``) makes the auto average of 0-dim tensors a
    weighted one, so a batch-mean loss over uneven microbatches equals the eager one;
    ``leaf_weights`` gives a leaf (by its path, :func:`leaf_paths`) weights of its own
    (a mean over target tokens: ``fxpipe.runtime.issue.loss_weights``).

    >>> import torch
    >>> merge_output([(torch.ones(1), 3), (torch.ones(1), 3)], False)
    (PackedData([tensor([1.]), tensor([1.])]), PackedData([3, 3]))
    """
    outputs = list(outputs)
    if not outputs:
        raise ValueError("merge_output: there are no microbatch outputs to merge")
    if spec is False:
        return _pack(outputs)
    if spec is None or spec is True:
        spec = _AUTO
    elif uses_callable(spec):
        return spec(outputs)
    for w in (weights, *(leaf_weights or {}).values()):
        if w is not None and len(w) != len(outputs):
            raise ValueError(f"merge_output: {len(w)} weights for {len(outputs)} microbatches")
    by_path = dict(leaf_weights or {})
    return _merge(outputs, spec, "output", lambda path: by_path.get(path, weights))


def leaf_paths(value: Any, path: str = "output") -> list[str]:
    """The path ``merge_output`` names each leaf of ``value`` by, in pytree order.

    >>> leaf_paths({"loss": 1, "logits": (2, 3)})
    ["output['loss']", "output['logits'][0]", "output['logits'][1]"]
    """
    node = _node(value)
    if node is None:
        return [path]
    children, keys, _ = node
    return [p for child, k in zip(children, keys) for p in leaf_paths(child, path + k)]


def microbatch_weights(sizes: Sequence[int]) -> list[float]:
    """Each microbatch's share of the batch (for ``loss_reduction="mean"``).

    >>> microbatch_weights([3, 3, 2])
    [0.375, 0.375, 0.25]
    """
    sizes = list(sizes)
    if not sizes or any(s < 0 for s in sizes) or sum(sizes) == 0:
        raise ValueError(f"microbatch sizes must be >= 0 with a positive total, got {sizes}")
    total = sum(sizes)
    return [s / total for s in sizes]
