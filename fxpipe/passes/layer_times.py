"""Measured layer times: every layer of a ``LayerGraph`` timed on the real tensors.

``measure_times`` runs the chain once more for real and records, per layer, its forward
without grad (``fwd_ms``), with grad (``recompute_ms``) and its backward (``bwd_ms``) in
its ``Cost`` (``fxpipe.passes.costs``, which costs everything else on fake tensors).
A pipe's calls time layers online instead (``fxpipe.runtime.stages.timer``).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx

from fxpipe.passes.costs import (Cost, _check_inputs, _detached, _DeviceCopies, _fresh_inputs,
                                 _grad_roots, _tensors, _unique, _walk, compute_costs)
from fxpipe.passes.layer_graph import Layer, LayerGraph


def measure_times(lg: LayerGraph, flat_inputs: Sequence[Any], repeats: int = 3) -> list[Cost]:
    """Time every layer on the real tensors: forward without grad (``fwd_ms``), forward
    with grad (``recompute_ms``) and the gradient w.r.t. the parameters and inputs that
    require grad (``bwd_ms``), each the minimum of ``repeats`` runs after a warm-up run.

    Returns the layers' costs (from ``compute_costs`` if missing) with the times set,
    and stores them in ``layer.node.meta["cost"]``. Parameters and their ``.grad`` are not
    touched; buffers (BatchNorm statistics) and the RNG state are restored afterwards.
    """
    if repeats < 1:
        raise ValueError(f"measure_times(repeats={repeats}): need at least one timed run")
    flat_inputs = _check_inputs(lg, flat_inputs)
    named = [*zip(lg.input_names, flat_inputs), *lg.params.items(), *lg.buffers.items()]
    for name, t in named:
        if isinstance(t, torch.Tensor) and t.device.type == "meta":
            raise ValueError(f"measure_times runs the layers for real, but {name!r} is on the meta "
                             "device; load the weights first (compute_costs needs none)")
    base = [layer.cost for layer in lg]
    if any(c is None for c in base):
        base = compute_costs(lg, flat_inputs)
    cuda = sorted({t.get_device() for _, t in named if isinstance(t, torch.Tensor) and t.is_cuda})
    backup = [(b, b.detach().clone()) for b in _unique(_tensors(lg.buffers.values()))]
    times: dict[int, tuple[float, float, float]] = {}

    on_device = _DeviceCopies(lg)

    def run(layer: Layer, args: tuple, kwargs: dict):
        out, times[layer.index] = _time_layer(layer.gm, on_device(layer.gm), args, kwargs, repeats)
        return out

    try:
        with torch.random.fork_rng(devices=cuda), torch.enable_grad():
            _walk(lg, flat_inputs, run)
    finally:
        with torch.no_grad():
            for b, copy in backup:
                b.copy_(copy)
    costs = []
    for layer, cost in zip(lg, base):
        fwd, re, bwd = times[layer.index]
        layer.node.meta["cost"] = dataclasses.replace(cost, fwd_ms=fwd, recompute_ms=re, bwd_ms=bwd)
        costs.append(layer.node.meta["cost"])
    return costs


def _time_layer(gm: fx.GraphModule, attrs: dict[str, torch.Tensor], args: tuple, kwargs: dict,
                repeats: int):
    """Run one layer (with ``attrs`` as its parameters and buffers) ``repeats + 1`` times;
    returns its outputs and the least (fwd, recompute, bwd) milliseconds over all runs but
    the first (warm-up)."""
    params = [t for t in _unique(attrs.values()) if t.requires_grad]
    call = lambda a, k: torch.func.functional_call(gm, attrs, a, k)  # noqa: E731
    samples = []
    for _ in range(repeats + 1):
        a, k, _, _ = _fresh_inputs(args, kwargs, clone=True)
        with torch.no_grad():
            fwd = _timed(lambda: call(a, k))[1]
        a, k, leaves, passed = _fresh_inputs(args, kwargs, clone=True)
        out, re = _timed(lambda: call(a, k))
        roots, wrt, bwd = _grad_roots(out), params + leaves, 0.0
        if roots and wrt:
            grads = [torch.ones_like(r) for r in roots]
            bwd = _timed(lambda: torch.autograd.grad(roots, wrt, grads, allow_unused=True))[1]
        samples.append((fwd, re, bwd))
    return _detached(out, passed), tuple(min(s[j] for s in samples[1:]) for j in range(3))


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    _sync()
    start = time.perf_counter()
    out = fn()
    _sync()
    return out, (time.perf_counter() - start) * 1e3


def _sync() -> None:
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()
