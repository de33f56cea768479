"""Costs: what each layer of a ``LayerGraph`` weighs and how much work it is.

``compute_costs`` runs the chain once on fake tensors (``FakeTensorMode``: shapes, no
data), so a model built on the ``meta`` device is costed without its weights, and the
model's own tensors are never read or written. Per layer it records a ``Cost``:

- ``param_bytes`` / ``grad_bytes`` / ``buffer_bytes``: the tensors the layer uses. A tied
  parameter is counted in *every* layer that uses it (each stage holding it must have it
  resident), so the layers add up to more than the model; ``total_param_bytes(lg)``
  counts each tensor once.
- ``boundary_bytes``: the values live across the cut after the layer
  (``lg.boundary(i)``): each distinct tensor's bytes, tensors sharing a storage counted
  at most the storage's size.
- ``saved_bytes``: what autograd saves for backward when the layer runs with grad
  (``saved_tensors_hooks``), each storage once, parameters and buffers excluded.
- ``fwd_flops`` / ``bwd_flops``: ``FlopCounterMode`` over the forward, and over the
  gradient w.r.t. the parameters and float inputs that require grad. Like the counter it
  counts matmul-like ops only (mm, conv, attention); causal attention counts in full.
- the memory profile (``LiveBytes`` over the layer's own allocations, its inputs and
  parameters already there): ``out_bytes``, the new values it hands on;
  ``carried_bytes``, the part of ``boundary_bytes`` it passed on unchanged (values made
  before it, or model inputs);
  ``fwd_peak_bytes``, the most a forward without grad allocates at once;
  ``recompute_peak_bytes`` and ``held_bytes``, the same with grad and what stays
  allocated after it (saved tensors and outputs); ``bwd_peak_bytes``, the most allocated
  at once during its backward (``held_bytes`` included), with its parameters' gradient
  buffers already there, as in a stage's later microbatches. ``fxpipe.passes.stage_memory``
  composes them into a stage's peak. With ``loss=(loss_fn, label)`` the last layer also
  gets ``loss_bytes``, what the loss allocates at its peak (forward and backward).
- ``fwd_kernels`` / ``bwd_kernels``: the ops of its forward and of its backward that
  launch a kernel (``live_bytes.launches_kernel``), as an eager stage issues them: the
  host time ``fxpipe.simulate`` prices per kernel (``Hardware.host_us_per_kernel``).

``meta`` tensors are costed as CPU tensors (attention dispatches to a fused kernel, as on
a GPU, not to the math fallback that materializes the score matrix; its FLOPs:
``fxpipe.attention.register_sdpa_flops``). ``fxpipe.passes.layer_times.measure_times``
adds wall-clock times measured on the real tensors.

A layer that cannot run on fake tensors (data-dependent code: ``.nonzero()`` or
``.tolist()`` in an MoE router, a block captured opaquely) is costed by running the
chain once on the real inputs up to it, counting its FLOPs and saved bytes as it runs
for the example (its routing); with no real weights (``meta``) its FLOPs are bounded
instead (see ``_bounded``). Verbose mode (``fxpipe.set_verbose``) says which layers.

>>> from torch import nn
>>> from fxpipe.passes.partition import build_layer_graph
>>> x = torch.randn(32, 256)
>>> lg = build_layer_graph(nn.Sequential(nn.Linear(256, 256), nn.ReLU()), (x,))
>>> print(compute_costs(lg, [x])[0])
params 263 kB | saved 32.8 kB | out 32.8 kB | fwd 4.19 MFLOP | bwd 4.19 MFLOP
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.autograd.graph import saved_tensors_hooks
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from fxpipe import quant
from fxpipe.attention import register_sdpa_flops
from fxpipe.passes import cost_cache
from fxpipe.passes.capture_dtypes import cast_floating
from fxpipe.passes.layer_graph import Layer, LayerGraph
from fxpipe.runtime.host.params import grad_dtype
from fxpipe.live_bytes import LiveBytes
from fxpipe.live_bytes import storage_key as _storage_key
from fxpipe.units import human as _human
from fxpipe.verbose import is_verbose


@dataclass(frozen=True, slots=True)
class Cost:
    """One layer's cost: bytes, FLOPs and (when measured) milliseconds."""

    param_bytes: int = 0         # on a device (in ``param_dtype`` under mixed precision)
    grad_bytes: int = 0          # on a device: of the parameters that require grad
    buffer_bytes: int = 0
    boundary_bytes: int = 0      # what crosses the cut after the layer
    saved_bytes: int = 0         # activations autograd keeps for backward
    fwd_flops: int = 0
    bwd_flops: int = 0
    fwd_ms: float | None = None
    recompute_ms: float | None = None  # forward with grad (building the autograd graph)
    bwd_ms: float | None = None
    # memory profile (module docstring); a stage's peak is not a sum: fxpipe.passes.stage_memory
    out_bytes: int | None = None
    carried_bytes: int | None = None
    fwd_peak_bytes: int | None = None
    recompute_peak_bytes: int | None = None
    held_bytes: int | None = None
    bwd_peak_bytes: int | None = None
    loss_bytes: int | None = None
    fwd_kernels: int | None = None   # ops launching a kernel in forward (a recompute: as many)
    bwd_kernels: int | None = None   # and in backward
    dequant_bytes: int = 0   # device memory traffic of its dequantizes, per forward (fxpipe.quant)
    # on the host, where they differ (mixed precision: the fp32 masters, and their gradients
    # as downloaded, in the masters' gradient dtype); None: as on a device
    host_param_bytes: int | None = None
    host_grad_bytes: int | None = None

    @property
    def host_params(self) -> int:
        """Bytes of the parameters on the host (what the optimizer steps)."""
        return self.param_bytes if self.host_param_bytes is None else self.host_param_bytes

    @property
    def host_grads(self) -> int:
        """Bytes of the gradients on the host (what a download moves, clipping reads and a
        collective sums)."""
        return self.grad_bytes if self.host_grad_bytes is None else self.host_grad_bytes

    def __str__(self) -> str:
        parts = [f"params {_human(self.param_bytes, 'B')}"]
        if self.host_params != self.param_bytes:
            parts[0] += f" (host {_human(self.host_params, 'B')})"
        if self.grad_bytes != self.param_bytes:
            parts.append(f"grads {_human(self.grad_bytes, 'B')}")
        if self.buffer_bytes:
            parts.append(f"buffers {_human(self.buffer_bytes, 'B')}")
        parts += [f"saved {_human(self.saved_bytes, 'B')}", f"out {_human(self.boundary_bytes, 'B')}",
                  f"fwd {_human(self.fwd_flops, 'FLOP')}", f"bwd {_human(self.bwd_flops, 'FLOP')}"]
        for label, ms in (("fwd", self.fwd_ms), ("re", self.recompute_ms), ("bwd", self.bwd_ms)):
            if ms is not None:
                parts.append(f"{label} {_human_ms(ms)}")
        return " | ".join(parts)

    @classmethod
    def sum(cls, costs: Iterable[Cost]) -> Cost:
        """The cost of consecutive layers: fields added up, except ``boundary_bytes``,
        which is the last layer's (what leaves the run), and the memory profile, which
        does not add up (``None``; ``fxpipe.passes.stage_memory.stage_peak`` composes it). A
        time is ``None`` unless every layer has it. A parameter tied between the layers
        counts once per layer."""
        costs = list(costs)
        if not costs:
            return cls()

        def total(name: str):
            values = [getattr(c, name) for c in costs]
            return None if any(v is None for v in values) else sum(values)

        fields = {f.name: None if f.name in _PROFILE else total(f.name)
                  for f in dataclasses.fields(cls)}
        if any(c.host_param_bytes is not None for c in costs):
            fields.update(host_param_bytes=sum(c.host_params for c in costs),
                          host_grad_bytes=sum(c.host_grads for c in costs))
        return cls(**{**fields, "boundary_bytes": costs[-1].boundary_bytes})


_PROFILE = ("out_bytes", "carried_bytes", "fwd_peak_bytes", "recompute_peak_bytes", "held_bytes",
            "bwd_peak_bytes", "loss_bytes")


def total_param_bytes(lg: LayerGraph) -> int:
    """Bytes of the model's parameters, each tensor counted once (tied weights once)."""
    return sum(map(_nbytes, _unique(lg.params.values())))


def compute_costs(lg: LayerGraph, flat_inputs: Sequence[Any], *, store: bool = True,
                  loss: tuple[Callable[[Any, Any], Any], Any] | None = None) -> list[Cost]:
    """Cost every layer of ``lg`` for inputs shaped like ``flat_inputs`` (the flat model
    inputs, one per ``lg.input_names``; real or ``meta`` tensors). Stores each ``Cost``
    in ``layer.node.meta["cost"]`` (unless ``store=False``) and returns them in layer
    order. ``loss=(loss_fn, label)``: also cost ``loss_fn(outputs, label)`` (the last
    layer's ``loss_bytes``).

    Inputs, parameters and buffers are replaced by fake stand-ins: the model's tensors,
    their ``.grad`` and buffer updates (BatchNorm statistics) are left untouched. The
    stand-ins have the dtype the devices hold (``lg.param_dtype``: mixed precision), so
    parameter, gradient and activation bytes are the devices'. A layer
    identical to an earlier one (same graph up to names, same input and parameter
    shapes) is not run again: repeated blocks are costed once, and a layer costed by an
    earlier call in the same precision (``cost_cache``: the chain trimmed of its loss-free
    outputs, another pipe over the same blocks) is not either.
    """
    register_sdpa_flops()
    flat_inputs = _check_inputs(lg, flat_inputs)
    mode = FakeTensorMode()
    fakes: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(real) -> (real, fake)

    def fake(t: torch.Tensor, from_input: bool = False) -> torch.Tensor:
        if id(t) not in fakes:
            if from_input and t.device.type != "meta":  # keeps aliasing between inputs
                f = mode.from_tensor(t.detach())
            else:
                with mode:
                    device = _CPU if t.device.type == "meta" else t.device
                    f = torch.empty_strided(t.shape, t.stride(), dtype=lg.device_dtype(t),
                                            device=device)
            fakes[id(t)] = (t, f.requires_grad_(True) if t.requires_grad else f)
        return fakes[id(t)][1]

    counter = FlopCounterMode(display=False)
    flops: dict[int, tuple] = {}   # layer -> (fwd flops, bwd flops, saved bytes, profile)
    seen: dict[tuple, tuple] = {}  # layer key -> (flops, output recipe), this call's
    failed: dict[int, Exception] = {}  # layers that cannot run on fake tensors
    tensors = [*_tensors(flat_inputs), *lg.params.values(), *_tensors(lg.buffers.values())]
    on_meta = any(t.device.type == "meta" for t in tensors)
    context = (on_meta, cost_cache.autocast_state())

    def run(layer: Layer, args: tuple, kwargs: dict):
        attrs = _attr_tensors(layer.gm)
        key, lasting = cost_cache.layer_key(layer.gm, attrs, args, kwargs)
        if key is not None:   # the attributes as the devices hold them (param_dtype)
            key = (key, context, tuple(lg.device_dtype(t) for t in attrs.values()))
        hit = seen.get(key) or cost_cache.costed(key)
        if hit is not None:
            flops[layer.index], recipe = hit
            return cost_cache.rebuild(recipe, args, kwargs)
        try:
            attrs = {name: fake(t) for name, t in attrs.items()}
            out, flops[layer.index] = _fake_layer(layer.gm, attrs, args, kwargs, counter)
        except Exception as e:  # noqa: BLE001 — measured (or bounded) below instead
            failed[layer.index] = e
            return _outputs_as_captured(layer)
        if key is not None:
            seen[key] = flops[layer.index], cost_cache.recipe(out, args, kwargs)
            if lasting:
                cost_cache.costed(key, seen[key])
        return out

    inputs = [fake(x, from_input=True) if isinstance(x, torch.Tensor) else x for x in flat_inputs]
    loss_bytes = None
    if loss is not None:
        loss_fn, label = loss
        label = pytree.tree_map(
            lambda t: fake(t, from_input=True) if isinstance(t, torch.Tensor) else t, label)
    with mode, _MetaAsCPU() if on_meta else contextlib.nullcontext(), torch.enable_grad():
        env = _walk(lg, inputs, run)
        if loss is not None:
            loss_bytes = _fake_loss(lg, env, loss_fn, label)
    if failed:
        flops.update(_measured(lg, flat_inputs, failed) if not on_meta else
                     {i: _bounded(lg[i], env) for i in failed})
        if is_verbose():
            for i, e in failed.items():
                how = ("FLOPs bounded by 2 x parameters x tokens (no weights: meta)" if on_meta
                       else "measured on the example's real tensors")
                print(f"fxpipe: layer {i} ({lg[i].name}) cannot run on fake tensors "
                      f"({type(e).__name__}: {_first_line(e)}); its costs are {how}",
                      file=sys.stderr)

    costs = []
    for layer in lg:
        params = list(_unique(lg.params[p] for p in layer.params))
        fwd, bwd, saved, profile = flops[layer.index]
        last = layer.index == len(lg) - 1
        cut = lg.boundary(layer.index)
        before = set(lg.input_names if layer.index == 0 else lg.boundary(layer.index - 1))
        on_device = lambda t: t.numel() * lg.device_dtype(t).itemsize  # noqa: E731
        trainable = [p for p in params if p.requires_grad]
        host = {} if lg.param_dtype is None else dict(
            host_param_bytes=sum(map(_nbytes, params)),
            host_grad_bytes=sum(p.numel() * grad_dtype(p).itemsize for p in trainable))
        cost = Cost(
            param_bytes=sum(map(on_device, params)),
            grad_bytes=sum(map(on_device, trainable)), **host,
            buffer_bytes=sum(map(on_device, _unique(_tensors(lg.buffers[b] for b in layer.buffers)))),
            boundary_bytes=_boundary_bytes([env[name] for name in cut]),
            saved_bytes=saved, fwd_flops=fwd, bwd_flops=bwd,
            carried_bytes=_boundary_bytes([env[name] for name in cut if name in before]),
            loss_bytes=loss_bytes if last else None,
            dequant_bytes=quant.dequantize_traffic(layer.gm), **profile)
        if store:
            layer.node.meta["cost"] = cost
        costs.append(cost)
    return costs


# --- running the chain -------------------------------------------------------------

def _walk(lg: LayerGraph, inputs: list, run: Callable[[Layer, tuple, dict], Any],
          until: int | None = None) -> dict[str, Any]:
    """Evaluate ``lg.gm`` node by node, ``run`` computing each layer (up to layer
    ``until``); every value by name."""
    layer_of = {layer.node: layer for layer in lg}
    env: dict[str, Any] = {}
    it = iter(inputs)
    for node in lg.gm.graph.nodes:
        if node.op == "call_module" and until is not None and layer_of[node].index > until:
            break
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: env[n.name])
        if node.op == "placeholder":
            env[node.name] = next(it)
        elif node.op == "call_module":
            env[node.name] = run(layer_of[node], args, kwargs)
        elif node.op == "call_function":  # getitem of a layer's outputs
            env[node.name] = node.target(*args, **kwargs)
        elif node.op != "output":
            raise ValueError(f"unexpected {node.op} node {node.name!r} in the layer chain")
    return env


def _fresh_inputs(args: tuple, kwargs: dict, clone: bool):
    """A layer's inputs cut from the earlier layers' autograd graphs: each tensor that
    requires grad becomes a leaf (in ``leaves``) sharing the given value's storage. With
    ``clone`` the layer gets copies (of the leaves, so in-place ops on them stay legal).
    ``passed`` maps the id of each tensor handed to the layer to (it, the given value)."""
    leaves: list[torch.Tensor] = []
    passed: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    memo: dict[int, torch.Tensor] = {}

    def fresh(a: Any) -> Any:
        if not isinstance(a, torch.Tensor):
            return a
        if id(a) not in memo:
            x = a.detach()
            if a.requires_grad:
                leaves.append(x.requires_grad_(True))
            memo[id(a)] = x = x.clone() if clone else x
            passed[id(x)] = (x, a)
        return memo[id(a)]

    args, kwargs = pytree.tree_map(fresh, (args, kwargs))
    return args, kwargs, leaves, passed


def _detached(out: Any, passed: dict) -> Any:
    """A layer's outputs as values for later layers: an input passed straight through is
    the given value, other tensors are detached and keep their ``requires_grad``."""
    def detach(o: Any) -> Any:
        if not isinstance(o, torch.Tensor):
            return o
        if id(o) in passed:
            return passed[id(o)][1]
        return o.detach().requires_grad_(True) if o.requires_grad else o.detach()

    return pytree.tree_map(detach, out)


def _grad_roots(out: Any) -> list[torch.Tensor]:
    return [o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor) and o.requires_grad]


# --- on fake tensors -----------------------------------------------------------------

_CPU = torch.device("cpu")


class _MetaAsCPU(TorchDispatchMode):
    """``device=meta`` baked into a graph (factory calls, export's metadata asserts)
    becomes CPU, to match the fake CPU tensors meta tensors are costed as."""

    supports_higher_order_operators = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(kwargs.get("device"), torch.device) and kwargs["device"].type == "meta":
            kwargs = {**kwargs, "device": _CPU}
        if any(isinstance(a, torch.device) for a in args):
            args = tuple(_CPU if isinstance(a, torch.device) and a.type == "meta" else a for a in args)
        return func(*args, **kwargs)


def _fake_layer(gm: fx.GraphModule, attrs: dict[str, torch.Tensor], args: tuple, kwargs: dict,
                counter: FlopCounterMode):
    """Run one layer on fakes; returns its outputs and (fwd flops, bwd flops, saved bytes,
    memory profile): a forward with grad, its backward, and a forward without grad."""
    held = {_storage_key(t) for t in attrs.values()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if _storage_key(t) not in held:
            saved.setdefault(_storage_key(t), t.untyped_storage().nbytes())
        return t

    for clone in (False, True):  # inputs as leaves; copies if the layer writes into them
        a, k, leaves, passed = _fresh_inputs(args, kwargs, clone)
        saved.clear()
        live = LiveBytes()
        try:
            with saved_tensors_hooks(pack, lambda t: t), counter, live:
                out = torch.func.functional_call(gm, attrs, a, k)
            break
        except RuntimeError as e:
            if clone or "leaf Variable that requires grad" not in str(e):
                raise
    fwd, bwd, fwd_kernels = counter.get_total_flops(), 0, live.kernels
    profile = dict(out_bytes=live.new_bytes(pytree.tree_leaves(out)),
                   recompute_peak_bytes=live.peak, held_bytes=live.bytes,
                   fwd_kernels=fwd_kernels, bwd_kernels=0)
    roots = _grad_roots(out)
    params = [t for t in _unique(attrs.values()) if t.requires_grad]
    wrt = list(_unique(params + leaves))
    live.reset_peak()
    if roots and wrt:
        grads = [torch.ones_like(r) for r in roots]
        for p in params:  # gradient buffers exist, as in a stage job's later microbatches
            p.grad = torch.zeros_like(p)
        try:
            with counter, live:
                torch.autograd.backward(roots, grads, inputs=wrt)
        finally:
            for t in wrt:
                t.grad = None
        bwd = counter.get_total_flops()
        profile["bwd_kernels"] = live.kernels - fwd_kernels
    profile["bwd_peak_bytes"] = live.peak
    a, k, _, _ = _fresh_inputs(args, kwargs, clone)
    with torch.no_grad(), LiveBytes() as live:
        torch.func.functional_call(gm, attrs, a, k)
    profile["fwd_peak_bytes"] = live.peak
    return _detached(out, passed), (fwd, bwd, sum(saved.values()), profile)


def _fake_loss(lg: LayerGraph, env: dict[str, Any], loss_fn: Callable[[Any, Any], Any],
               label: Any) -> int:
    """What ``loss_fn(outputs, label)`` allocates at its peak, forward and backward, on the
    fake outputs of the chain (``label``: fake too)."""
    out = pytree.tree_unflatten(lg.flat_outputs(env), lg.out_spec)
    roots = _grad_roots(out)
    with LiveBytes() as live:
        loss = loss_fn(out, label)
        if isinstance(loss, torch.Tensor) and loss.requires_grad and roots:
            torch.autograd.grad(loss, roots, allow_unused=True)
    return live.peak


# --- layers that cannot run on fake tensors ------------------------------------------

def _outputs_as_captured(layer: Layer) -> tuple:
    """Fake outputs for ``layer``, shaped as its captured graph recorded them for the
    example (``meta["val"]``, sizes at their example values)."""
    outs = layer.gm.graph.output_node().args[0]

    def like(v: Any) -> Any:
        if isinstance(v, torch.SymInt):
            if v.node.hint is None:  # a data-dependent size
                raise RuntimeError(f"layer {layer.index} ({layer.name!r}) cannot run on fake "
                                   f"tensors and returns a value of data-dependent size ({v}), so "
                                   "the layers after it cannot be costed")
            return v.node.hint
        if not isinstance(v, torch.Tensor):
            return v
        t = torch.empty([like(s) for s in v.shape], dtype=v.dtype,
                        device=_CPU if v.device.type == "meta" else v.device)
        return t.requires_grad_(True) if t.is_floating_point() else t

    if any(isinstance(o, fx.Node) and "val" not in o.meta for o in outs):
        raise RuntimeError(f"layer {layer.index} ({layer.name!r}) cannot run on fake tensors and "
                           "its graph records no output shapes to continue costing with")
    vals = [o.meta["val"] if isinstance(o, fx.Node) else o for o in outs]
    return tuple(pytree.tree_map(like, vals))


def _measured(lg: LayerGraph, flat_inputs: list, failed: dict[int, Exception]) -> dict[int, tuple]:
    """(fwd FLOPs, bwd FLOPs, saved bytes, memory profile) of the ``failed`` layers,
    counted while the chain runs on the real inputs up to the last of them (buffers and
    the RNG restored)."""
    counts: dict[int, tuple] = {}
    last = max(failed)

    on_device = _DeviceCopies(lg)

    def run(layer: Layer, args: tuple, kwargs: dict):
        try:
            out, counts[layer.index] = _fake_layer(layer.gm, on_device(layer.gm), args, kwargs,
                                                   FlopCounterMode(display=False))
        except Exception as e:
            if layer.index not in failed:
                raise
            raise RuntimeError(f"costing layer {layer.index} ({layer.name!r}) failed on fake "
                               f"tensors ({type(failed[layer.index]).__name__}: "
                               f"{_first_line(failed[layer.index])}) and when run on the example: "
                               f"{type(e).__name__}: {e}") from e
        return out

    backup = [(b, b.detach().clone()) for b in _unique(_tensors(lg.buffers.values()))]
    cuda = sorted({t.get_device() for t in lg.params.values() if t.is_cuda})
    try:
        with torch.random.fork_rng(devices=cuda), torch.enable_grad():
            _walk(lg, flat_inputs, run, until=last)
    finally:
        with torch.no_grad():
            for b, saved in backup:
                b.copy_(saved)
                if b.grad_fn is not None:   # written in place from a value with grad
                    b.detach_()
    return {i: counts[i] for i in failed}


def _bounded(layer: Layer, env: dict[str, Any]) -> tuple[int, int, int, dict]:
    """(fwd FLOPs, bwd FLOPs, saved bytes, memory profile) bounds for a layer that cannot
    run, from sizes alone: every parameter used once per token (all experts of an MoE
    layer, an upper bound for top-k routing), backward twice the forward, and 16 bytes
    saved per byte of its largest input (a transformer block saves about that much at
    fp32); no profile (``fxpipe.passes.stage_memory`` falls back to saved and boundary bytes)."""
    inputs = [t for t in _tensors(env[n] for n in layer.inputs) if t.dim() > 0]
    tokens = max((t.numel() // max(t.shape[-1], 1) for t in inputs if t.is_floating_point()),
                 default=1)
    numel = sum(p.numel() for p in _unique(_attr_tensors(layer.gm).values()))
    fwd = 2 * numel * tokens
    return fwd, 2 * fwd, 16 * max((_nbytes(t) for t in inputs), default=0), {}


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0][:200]


# --- bytes and printing --------------------------------------------------------------

def _check_inputs(lg: LayerGraph, flat_inputs: Sequence[Any]) -> list:
    """The flat inputs as the devices get them (floating ones in ``lg.param_dtype``)."""
    flat_inputs = list(flat_inputs)
    if len(flat_inputs) != len(lg.input_names):
        raise ValueError(f"the layer chain takes {len(lg.input_names)} flat inputs "
                         f"({', '.join(lg.input_names)}), got {len(flat_inputs)}")
    return [cast_floating(x, lg.param_dtype) for x in flat_inputs]


def _attr_tensors(gm: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A layer module's parameters and buffers by attribute path (tied: every path)."""
    return {**dict(gm.named_parameters(remove_duplicate=False)),
            **dict(gm.named_buffers(remove_duplicate=False))}


class _DeviceCopies:
    """A layer's parameters and buffers as the devices hold them, for running it on real
    tensors: floating parameters cast to ``lg.param_dtype`` (one copy per tensor, made
    on first use), the rest the model's own."""

    def __init__(self, lg: LayerGraph):
        self.lg = lg
        self.copies: dict[int, torch.Tensor] = {}

    def __call__(self, gm: torch.nn.Module) -> dict[str, torch.Tensor]:
        return {name: self.copy(t) for name, t in _attr_tensors(gm).items()}

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        dtype = self.lg.device_dtype(t)
        if dtype == t.dtype:
            return t
        if id(t) not in self.copies:
            self.copies[id(t)] = t.detach().to(dtype).requires_grad_(t.requires_grad)
        return self.copies[id(t)]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _tensors(values: Iterable[Any]) -> Iterable[torch.Tensor]:
    return (v for v in values if isinstance(v, torch.Tensor))


def _unique(tensors: Iterable[torch.Tensor]) -> Iterable[torch.Tensor]:
    seen: set[int] = set()
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            yield t


def _boundary_bytes(values: list) -> int:
    """Bytes of the distinct tensors among ``values``; those sharing a storage count at
    most the storage's size."""
    storages: dict[int, tuple[int, dict]] = {}
    for t in _tensors(pytree.tree_leaves(values)):
        cap, views = storages.setdefault(_storage_key(t), (t.untyped_storage().nbytes(), {}))
        views[(t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)] = _nbytes(t)
    return sum(min(cap, sum(views.values())) for cap, views in storages.values())


def _human_ms(ms: float) -> str:
    if ms >= 999.5:
        return f"{ms / 1000:#.3g}".rstrip(".") + " s"
    return f"{ms:#.3g}".rstrip(".") + " ms"
