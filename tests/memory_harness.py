"""Measured device bytes of one stage job, to calibrate ``fxpipe.passes.stage_memory``'s prediction.

``measure_stage`` plays one microbatch of a stage job on the CPU as its device would hold
it, under ``LiveBytes`` (every storage allocated, by kind, until Python frees it): the
stage's parameters and the prefetched stage's are copied in (``params``), a backward
stage's gradient buffers exist (``gradients``, as from the job's second microbatch on),
its inputs, the gradients of its outputs and the previous microbatch's outputs are
copied in as many times as ``Residency`` says (``activations``), then the layers run
eagerly: a forward without grad; a recompute with grad and its backward (stage grain);
a checkpoint keeping each layer's inputs, then a recompute and backward per layer (layer
grain); the fused tail's forward, the loss and the backward. Tensors autograd saves are
``saved``; everything else the compute allocates is ``workspace``.

Only the compute is measured for real: what is resident around it is placed by the same
rules the prediction uses (``Residency``). Until ``VirtualDevice.peak_bytes(kind)``
counts every tensor a device's work allocates, this is the measurement.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.autograd.graph import saved_tensors_hooks

from fxpipe.passes.grad_flow import grad_values
from fxpipe.passes.layer_graph import LayerGraph
from fxpipe.live_bytes import LiveBytes
from fxpipe.passes.costs import _attr_tensors as _attrs
from fxpipe.passes.stage_memory import KINDS, Residency


def chain_values(lg: LayerGraph, flat_inputs: Sequence[Any]) -> dict[str, Any]:
    """Every value of the chain by name, for these inputs (no grad)."""
    env: dict[str, Any] = {}
    it = iter(flat_inputs)
    layer_of = {layer.node: layer for layer in lg}
    with torch.no_grad():
        for node in lg.gm.graph.nodes:
            args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: env[n.name])
            if node.op == "placeholder":
                env[node.name] = next(it)
            elif node.op == "call_module":
                env[node.name] = layer_of[node].gm(*args, **kwargs)
            elif node.op == "call_function":
                env[node.name] = node.target(*args, **kwargs)
    return env


def measure_stage(lg: LayerGraph, kind: str, layers: range, flat_inputs: Sequence[Any], *,
                  grain: str = "stage", residency: Residency | None = None,
                  prefetched: Sequence[torch.Tensor] = (),
                  loss: tuple[Callable[[Any, Any], torch.Tensor], Any] | None = None,
                  env: dict[str, Any] | None = None) -> dict[str, int]:
    """Peak bytes by kind (``KINDS``) and ``"total"`` of one microbatch of a stage job
    (module docstring). ``flat_inputs``: the microbatch's flat model inputs;
    ``prefetched``: the next stage's parameters; ``loss``: ``(loss_fn, label)`` for a
    fused stage; ``env``: ``chain_values(lg, flat_inputs)``, if already made."""
    res = residency or Residency()
    env = env if env is not None else chain_values(lg, flat_inputs)
    if res.alternative is not None:   # the microbatch whose residency peaks higher
        return max((measure_stage(lg, kind, layers, flat_inputs, grain=grain, residency=r,
                                  prefetched=prefetched, loss=loss, env=env)
                    for r in res.scenarios()), key=lambda out: out["total"])
    # the values backward makes leaves of, as the runtime does (passes.grad_flow)
    wanted = grad_values(lg, [n for n, x in zip(lg.input_names, flat_inputs)
                              if isinstance(x, torch.Tensor) and x.requires_grad])
    a, b = layers.start, layers.stop
    before, after = _cut(lg, a - 1), _cut(lg, b - 1)
    attrs = {id(t): t for i in layers for t in _attrs(lg.layers[i].gm).values()}
    live = LiveBytes()
    with live:
        live.kind = "params"
        device = {k: t.detach().clone().requires_grad_(t.requires_grad) for k, t in attrs.items()}
        kept = [t.detach().clone() for t in prefetched]
        if kind != "fwd":
            live.kind = "gradients"
            for t in device.values():
                if t.requires_grad:
                    t.grad = torch.zeros_like(t)
        live.kind = "activations"   # one copy each is the compute's; the rest wait
        carried_in = set(before) & set(_cut(lg, a - 2)) if a > 0 else set()
        made = [n for n in after if n not in before]
        onward = set(made) & set(_cut(lg, b)) if b < len(lg) else set()
        inputs = {n: _clone(env[n]) for n in before}
        kept += _copies(env, before, carried_in, res.inputs - 1, res.carried_inputs - 1, _clone)
        grads = {n: _grad_like(env[n]) for n in after} if kind == "bwd" else {}
        if kind == "bwd":
            kept += _copies(env, made, onward, res.grads - 1, res.carried_grads - 1, _grad_like)
        if kind == "fwd":   # its values, awaiting offload
            kept += _copies(env, made, onward, res.outputs, res.carried_outputs, _clone)
        elif a > 0:         # its input gradients, awaiting offload
            kept += _copies(env, before, carried_in, res.outputs, res.carried_outputs, _grad_like)
        live.kind = "workspace"
        with saved_tensors_hooks(lambda t: (live.retag(t, "saved", only="workspace"), t)[1], lambda t: t):
            if kind == "fwd":
                with torch.no_grad():
                    _run(lg, layers, dict(inputs), device)  # the upload stays until Free
            elif kind == "bwd" and grain == "layer" and len(layers) > 1:
                _layer_backward(lg, layers, inputs, device, grads, wanted)
            else:
                leaves = {n: _leaf(x, n in wanted) for n, x in inputs.items()}
                values = _run(lg, layers, leaves, device)
                if kind == "fused":
                    loss_fn, label = loss if loss is not None else (lambda o, _: _sum(o), None)
                    out = pytree.tree_unflatten(lg.flat_outputs(values), lg.out_spec)
                    value = loss_fn(out, label)
                    _backward({"loss": value}, {"loss": torch.ones_like(value)})
                else:
                    _backward(values, grads)
        del kept
    peak = dict(live.at_peak)
    out = {k: peak.get(k, 0) for k in KINDS}
    out["total"] = live.peak
    return out


def _run(lg: LayerGraph, layers: range, values: dict[str, Any], device: dict[int, torch.Tensor],
         keep: dict[int, list] | None = None) -> dict[str, Any]:
    """Run ``layers`` on ``values`` (by name) with the device's parameter copies, keeping
    only what later layers or the output read (as a stage's code frees values)."""
    for i in layers:
        layer = lg.layers[i]
        args = [values[n] for n in layer.inputs]
        if keep is not None:
            keep[i] = args
        outs = torch.func.functional_call(layer.gm, {k: device[id(t)] for k, t in _attrs(layer.gm).items()},
                                          tuple(args))
        values.update(zip(layer.outputs, outs))
        live = set(lg.boundary(i)) | set(lg.output_names)
        for n in [n for n in values if n not in live]:
            del values[n]
    return values


def _layer_backward(lg: LayerGraph, layers: range, inputs: dict[str, Any],
                    device: dict[int, torch.Tensor], grads: dict[str, torch.Tensor],
                    wanted: frozenset[str]) -> None:
    """Checkpoint (no grad, each layer's inputs kept), then per layer, deep to shallow,
    recompute with grad and back-propagate."""
    kept: dict[int, list] = {}
    with torch.no_grad():
        _run(lg, layers, dict(inputs), device, keep=kept)
    grads = dict(grads)
    for i in reversed(layers):
        layer = lg.layers[i]
        leaves = [_leaf(x, n in wanted) for n, x in zip(layer.inputs, kept.pop(i))]
        values = _run(lg, range(i, i + 1), dict(zip(layer.inputs, leaves)), device)
        _backward({n: values[n] for n in layer.outputs if n in values}, grads)
        for n in layer.outputs:
            grads.pop(n, None)
        for n, x in zip(layer.inputs, leaves):
            if isinstance(x, torch.Tensor) and x.grad is not None:
                grads[n] = x.grad if grads.get(n) is None else grads[n] + x.grad
        del leaves, values


def _backward(values: dict[str, Any], grads: dict[str, Any]) -> None:
    roots = [(v, grads[n]) for n, v in values.items()
             if isinstance(v, torch.Tensor) and v.requires_grad and grads.get(n) is not None]
    if roots:
        torch.autograd.backward([r for r, _ in roots], [g for _, g in roots])


def _cut(lg: LayerGraph, i: int) -> list[str]:
    """The values live after layer ``i`` (the model inputs for ``i = -1``)."""
    return lg.input_names if i < 0 else lg.boundary(i)


def _copies(env: dict[str, Any], names: Sequence[str], carried: set[str], plain: int,
            carried_count: int, make: Callable[[Any], Any]) -> list[Any]:
    """``plain`` copies of each value among ``names``, ``carried_count`` of the carried."""
    return [make(env[n]) for n in names for _ in range(carried_count if n in carried else plain)]


def _clone(x: Any) -> Any:
    return x.detach().clone() if isinstance(x, torch.Tensor) else x


def _grad_like(x: Any) -> Any:
    return torch.randn_like(x) if isinstance(x, torch.Tensor) and x.is_floating_point() else None


def _leaf(x: Any, wanted: bool) -> Any:
    if wanted and isinstance(x, torch.Tensor) and x.is_floating_point():
        return x.detach().requires_grad_()
    return x


def _sum(out: Any) -> torch.Tensor:
    return sum(o.float().sum() for o in pytree.tree_leaves(out)
               if isinstance(o, torch.Tensor) and o.is_floating_point())
