"""Checks that a call fits the graph it runs: the example's argument structure, and the
sizes the captured graph is specific to."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree

from fxpipe.passes.layer_graph import LayerGraph


def check_structure(lg: LayerGraph, args: tuple, kwargs: dict, *,
                    constants: bool = True) -> list[torch.Tensor]:
    """The tensor leaves of a call, after checking it is shaped like the example: the
    same arguments and nesting, tensors where tensors were (of the same rank), and with
    ``constants`` the same non-tensor values. Sizes may differ (see :func:`check_inputs`)."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    if spec != lg.in_spec:
        raise TypeError(_structure_message(lg.in_spec, spec))
    tensors = []
    for i, (x, ex) in enumerate(zip(leaves, lg.example_leaves)):
        if isinstance(ex, torch.Tensor):
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"input {lg.leaf_names[i]!r} was a tensor when compiled, got "
                                f"{type(x).__name__}")
            if x.dim() != ex.dim():
                raise ValueError(f"input {lg.leaf_names[i]!r} has {x.dim()} dims, compiled with "
                                 f"{ex.dim()} (shape {tuple(ex.shape)})")
            tensors.append(x)
        elif constants and not _same_constant(x, ex):
            raise ValueError(f"input {lg.leaf_names[i]!r} was compiled as the constant {ex!r}, "
                             f"got {x!r}; this graph serves only that value")
    return tensors


def changed_constant(lg: LayerGraph, leaves: Sequence[Any]) -> tuple[str, Any, Any] | None:
    """``(name, value, captured value)`` of the first non-tensor input of a call (its
    pytree ``leaves``) that differs from the constant ``lg`` was captured with."""
    for name, x, ex in zip(lg.leaf_names, leaves, lg.example_leaves):
        if not isinstance(ex, torch.Tensor) and not _same_constant(x, ex):
            return name, x, ex
    return None


def check_inputs(lg: LayerGraph, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensor leaves of a (microbatch) call, after checking its structure and the
    sizes the captured graph is specific to."""
    return _sized(lg, check_structure(lg, args, kwargs))


def split_tensors(lg: LayerGraph, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """:func:`check_inputs` of a microbatch that ``runtime.issue.microbatch`` split from a
    call :func:`check_inputs` accepted by its own rules (not a user's callable): its
    structure, ranks and constants are the call's, so only the sizes are checked (one
    flattening, no structure compared: per microbatch, on every call)."""
    leaves = [*args, *kwargs.values()]   # (pytree's order: a dict's in insertion order)
    if not all(isinstance(x, torch.Tensor) for x in leaves):   # nested, or constants
        leaves = pytree.tree_leaves((args, kwargs))
    return _sized(lg, [x for x, ex in zip(leaves, lg.example_leaves)
                       if isinstance(ex, torch.Tensor)])


def _sized(lg: LayerGraph, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    problem = static_dim_problem(lg, tensors)
    if problem is not None:
        raise ValueError(
            f"{problem}. If this is a microbatch, the batch cannot be split along that dim: "
            "use num_microbatch=1 or a split_input spec on another dim.")
    return tensors


def static_dim_problem(lg: LayerGraph, tensors: Sequence[torch.Tensor]) -> str | None:
    """Why ``tensors`` (the call's tensor leaves) do not fit the sizes ``lg`` specializes on."""
    leaf_names = [n for n, ex in zip(lg.leaf_names, lg.example_leaves) if isinstance(ex, torch.Tensor)]
    for name, leaf, x in zip(lg.input_names, leaf_names, tensors):
        for d, size in lg.static_dims.get(name, {}).items():
            if x.shape[d] != size:
                return (f"input {leaf!r}: dim {d} is {x.shape[d]}, but the captured graph is "
                        f"specific to {size} there (the model specializes on it)")
    return None


def same_constants(a: Sequence[Any], b: Sequence[Any]) -> bool:
    """Whether two calls' pytree leaves have the same non-tensor values."""
    return all(isinstance(x, torch.Tensor) or _same_constant(x, y) for x, y in zip(a, b))


def _same_constant(a: Any, b: Any) -> bool:
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # noqa: BLE001 — incomparable values are different
        return a is b


def _structure_message(expected, got) -> str:
    """Which argument a call has that the example did not, or lacks (else the two trees)."""
    try:
        (exp_args, exp_kw), (got_args, got_kw) = expected.children(), got.children()
        missing = [k for k in exp_kw.context if k not in got_kw.context]
        extra = [k for k in got_kw.context if k not in exp_kw.context]
    except (AttributeError, ValueError, TypeError):
        return f"the call's argument structure differs from the example's:\n{expected}\nvs\n{got}"
    problems = []
    if exp_args.num_children != got_args.num_children:
        problems.append(f"has {got_args.num_children} positional argument(s) where the example had "
                        f"{exp_args.num_children}")
    if missing:
        problems.append(f"is missing keyword argument(s) {', '.join(map(repr, missing))}")
    if extra:
        problems.append(f"has unexpected keyword argument(s) {', '.join(map(repr, extra))}")
    if not problems:
        problems.append(f"has an argument nested differently from the example:\n{expected}\nvs\n{got}")
    return ("the pipeline was compiled for the example's arguments; this call "
            + "; ".join(problems) + ". Call it with the same arguments as the example "
            "(sizes may differ), or compile again for the new signature.")


def check_labels_like_ids(lg: LayerGraph, model: Any, kwargs: dict) -> None:
    """A token-level LM's ``labels=`` (the example's had ``input_ids``'s shape; a model
    that is not an encoder-decoder) must have its ``input_ids``'s shape: else a
    ``ValueError`` before anything runs, instead of a new capture failing inside the
    model's loss.

    A seq2seq model's labels (the decoder's length) and a classifier's (one per row)
    may differ from ``input_ids``: the example says which the model is.
    """
    ids, labels = kwargs.get("input_ids"), kwargs.get("labels")
    if not (isinstance(ids, torch.Tensor) and isinstance(labels, torch.Tensor)) \
            or ids.shape == labels.shape:
        return
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        return
    example = dict(zip(lg.leaf_names, lg.example_leaves))
    ex_ids, ex_labels = example.get("input_ids"), example.get("labels")
    if isinstance(ex_ids, torch.Tensor) and isinstance(ex_labels, torch.Tensor) \
            and ex_ids.shape == ex_labels.shape:
        raise ValueError(
            f"labels has shape {tuple(labels.shape)} and input_ids {tuple(ids.shape)}: "
            f"{type(model).__name__} takes one label per token (the example's labels had "
            "input_ids's shape), so they must have the same shape. Pad labels with -100 "
            "where there is no target.")
