"""Predicting a pipe's device memory before running it: every stage's peak, by kind.

``predict_memory`` composes the layers' costed memory (costed again on fake tensors
shaped like one microbatch, ``fxpipe.passes.costs``) into every stage's peak for a plan,
by kind (parameters of the stage and of the one its device prefetches meanwhile,
gradients, activations, saved tensors, workspace), over the Program the call runs.
``chain_memory`` is the per-layer memory the planner (``ExecutePlan.auto``) and the
simulator read. All are importable from ``fxpipe.plan``, the public place.

Not to be confused with: ``fxpipe.passes.stage_memory`` (the model this uses: how a stage's
peak follows from per-layer vectors, ``ChainMemory``/``stage_peak``, pure arithmetic) and
``fxpipe.live_bytes`` (the dispatch mode that counts the bytes costing measures). This
module predicts and plans nothing: the planner (``fxpipe.passes.planner``, and
``fxpipe.plan.max_sequence_length``) is above it and uses it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import torch
import torch.utils._pytree as pytree

from fxpipe.passes.costs import compute_costs
from fxpipe.passes.executable import build_executable, stage_ranges
from fxpipe.passes.layer_graph import LayerGraph
from fxpipe.passes.stage_memory import (
    KINDS,
    ChainMemory,
    StagePeak,
    device_peaks,
    human_bytes,
    program_peaks,
    with_graphs,
)
from fxpipe.passes.program import CallSpec
from fxpipe.passes.schedule import build_program
from fxpipe.runtime.host.buckets import _piece
from fxpipe.runtime.issue.device_collectives import (
    UPLOAD_CHUNK, reduce_scatter_bound, reduce_scatter_workspace,
)
from fxpipe.runtime.stages.graphs import graph_jobs
from fxpipe.sequence_plan import host_kv_bytes, with_kv
from fxpipe.stage_plan import RunType, StagePlan

def chain_memory(pipe: Any, num_microbatch: int = 1, *,
                 loss: tuple[Callable[[Any, Any], Any], Any] | None = None,
                 layers: LayerGraph | None = None) -> ChainMemory:
    """A pipe's (or ``LayerGraph``'s) memory for one microbatch, the first and largest of
    the ``num_microbatch`` its example splits into: its layers costed again on fake
    tensors shaped like it. A pipe splits as its ``RunConfig`` says
    (``pipe._microbatch_example``), a ``LayerGraph`` along dim 0; an example too small
    to split is one microbatch. ``loss=(loss_fn, label)``: also cost the loss on that
    microbatch's share of ``label``. Other pipes' layer costs are taken as one
    microbatch's. ``layers``: a chain of the pipe's other than ``pipe.layers`` (the one
    without the outputs no loss reads, ``fxpipe.passes.loss``)."""
    lg = layers or (pipe if isinstance(pipe, LayerGraph) else getattr(pipe, "layers", None))
    costs = [layer.cost for layer in lg] if lg is not None else []
    profiled = costs and all(getattr(c, "held_bytes", None) is not None for c in costs)
    if not (isinstance(lg, LayerGraph) and lg.example_leaves) or \
            (num_microbatch == 1 and loss is None and profiled):   # costed as it is
        return ChainMemory.of(costs, _input_bytes(lg))
    label = None if loss is None else loss[1]
    split = getattr(pipe, "_microbatch_example", None) or \
        (lambda m, y: _first_rows(lg.example_leaves, y, m))
    flat, label = split(num_microbatch, label)
    loss = None if loss is None else (loss[0], label)
    return ChainMemory.of(compute_costs(lg, flat, store=False, loss=loss), tensor_bytes(flat))


def _first_rows(leaves: list, label: Any, num_microbatch: int) -> tuple[list, Any]:
    """The flat tensor inputs and the label of the first of ``num_microbatch``
    microbatches, split along dim 0 (``torch.tensor_split``: the first is the largest);
    tensors too short to split stay whole."""
    def first(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] >= num_microbatch:
            return torch.tensor_split(x, num_microbatch)[0]
        return x

    flat = [first(x) for x in leaves if isinstance(x, torch.Tensor)]
    return flat, pytree.tree_map(first, label)


def _input_bytes(lg: Any) -> int:
    leaves = getattr(lg, "example_leaves", None) or []
    return tensor_bytes([x for x in leaves if isinstance(x, torch.Tensor)])


def tensor_bytes(tensors: list[torch.Tensor]) -> int:
    """The bytes of ``tensors``' elements (their storages may be larger)."""
    return sum(x.numel() * x.element_size() for x in tensors)


@dataclass(frozen=True)
class MemoryPrediction:
    """What :func:`predict_memory` returns: every stage's predicted peak
    (``fxpipe.passes.stage_memory.StagePeak``: bytes by kind, device, the layer at the peak),
    and per device the stage with the highest (``None``: a device with no stage).
    ``limit``: the smallest device limit, if any."""

    stages: list[StagePeak]
    devices: list[StagePeak | None]
    limit: int | None = None
    host: dict[str, int] = field(default_factory=dict)   # host bytes by kind (host_memory)

    @property
    def host_total(self) -> int:
        """The host bytes the call keeps (``host``'s sum)."""
        return sum(self.host.values())

    @property
    def peak(self) -> int:
        """The highest predicted peak of any device."""
        return max((p.total for p in self.stages), default=0)

    def by_device(self) -> list[dict[str, int]]:
        """Per device, its peak's bytes by kind (all zero for a device with no stage)."""
        return [dict(p.bytes) if p is not None else dict.fromkeys(KINDS, 0) for p in self.devices]

    def __str__(self) -> str:
        kinds = KINDS + (("cache",) if any(p.bytes.get("cache") for p in self.stages) else ())
        head = "stage kind   layers  dev  " + "  ".join(f"{k:>11}" for k in kinds) + "        total"
        rows = [head]
        for p in self.stages:
            rows.append(f"{p.stage:>5} {p.kind:<6} {p.layers.start:>3}:{p.layers.stop:<3} {p.device:>4}  "
                        + "  ".join(f"{human_bytes(p.bytes[k]):>11}" for k in kinds)
                        + f"  {human_bytes(p.total):>11}")
        limit = f" of {human_bytes(self.limit)}" if self.limit else ""
        rows.append(f"peak {human_bytes(self.peak)}{limit}: "
                    + ", ".join(f"device {d} {human_bytes(p.total) if p else '0 B'}"
                                for d, p in enumerate(self.devices)))
        if self.host:
            rows.append(f"host {human_bytes(self.host_total)}: "
                        + ", ".join(f"{k} {human_bytes(v)}" for k, v in self.host.items() if v))
        return "\n".join(rows)


def predict_memory(pipe: Any, plan: StagePlan | None = None, *, run_type: RunType | None = None,
                   num_microbatch: int | None = None,
                   grain: Literal["stage", "layer"] | None = None, num_devices: int | None = None,
                   loss_fn: Callable[[Any, Any], Any] | None = None,
                   label: Any = None, batch: int | None = None,
                   max_length: int | None = None,
                   return_outputs: bool = False,
                   kv_cache: Literal["host", "device", "auto"] = "host",
                   sequence_chunks: int | Literal["auto"] | None = None,
                   optimizer: torch.optim.Optimizer | None = None) -> MemoryPrediction:
    """Predicted peak device bytes of every stage of a call, before running it.

    ``pipe``: a ``PipelineModule`` (its plan, devices, ``num_microbatch`` and
    ``recompute_grain`` are the defaults) or a ``LayerGraph`` (give ``plan`` and
    ``num_devices``). ``run_type`` defaults to what ``plan`` runs (``"fused"`` when its
    forward stops before the tail). Each stage's peak counts, for one microbatch
    (costed on fake tensors shaped like it), its parameters and those of the stage its
    device prefetches meanwhile, its gradients, its activations, the tensors saved for
    backward and the workspace at its peak (``fxpipe.passes.stage_memory``). ``loss_fn`` and
    ``label`` (the whole batch's): cost the loss the fused tail runs; without them it
    counts as a cross-entropy over the model's output (``LOSS_FACTOR`` x its bytes).
    A fused call of a causal LM whose loss is fused (``fxpipe.passes.loss``) runs without
    the logits beside it unless ``return_outputs=True`` (or ``loss_fn`` reads them): what
    it predicts is what the call runs, and ``return_outputs=True`` says what the logits
    cost.

    Under ``RunConfig(stage_backend="cudagraphs")`` each device also holds its parameter
    slots and its graphs' inputs and outputs (``stage_memory.with_graphs``). A pipe
    compiled with ``data_parallel="device"`` is predicted for a call that reduces on the
    devices (one that steps): each backward stage also holds, while its gradients are
    reduce-scattered, this rank's shard and the copies its collectives read
    (:func:`with_reduce_scatter`), and ``.host``'s ``grads`` are this rank's 1/N.

    ``.host`` is the host memory the call keeps, by kind: ``params`` (the model's own
    tensors, as they are held), ``grads`` (the trainable ones', in their dtype) and
    ``activations`` (each forward stage's outputs for every microbatch, kept for the
    recompute, and the model's inputs); with ``shard_optimizer=True`` and ``param_dtype``,
    ``masters`` (this rank's pieces of the fp32 masters). ``optimizer`` (the
    ``torch.optim.Optimizer`` the calls step): also ``optimizer``, the state it keeps once
    it has stepped (:func:`optimizer_state_bytes`; with ``shard_optimizer=True`` this
    rank's 1/N); without it, the optimizer's state is not in ``.host``.

    >>> import torch, fxpipe
    >>> model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])
    >>> pipe = fxpipe.compile(model, example_inputs=(torch.randn(64, 256),), devices=["cpu"] * 2)
    >>> print(fxpipe.plan.predict_memory(pipe, num_microbatch=2))
    stage kind   layers  dev       params    gradients  activations        saved    workspace        total
        0 fwd      0:1      0       526 kB          0 B      65.5 kB          0 B      32.8 kB       625 kB
        1 fwd      1:3      1       790 kB          0 B      65.5 kB          0 B      65.5 kB       921 kB
        2 fused    3:4      0       526 kB       263 kB      65.5 kB      32.8 kB       329 kB      1.22 MB
        3 bwd      2:3      1       526 kB       263 kB       131 kB      32.8 kB       296 kB      1.25 MB
        4 bwd      1:2      0       263 kB       263 kB       131 kB      32.8 kB       296 kB       986 kB
        5 bwd      0:1      1       263 kB       263 kB       131 kB      32.8 kB       263 kB       953 kB
    peak 1.25 MB: device 0 1.22 MB, device 1 1.25 MB
    host 2.37 MB: params 1.05 MB, grads 1.05 MB, activations 197 kB, activation_grads 65.5 kB

    ``run_type="generate"`` (a pipe over a Hugging Face causal LM): a decode step of
    ``pipe.generate`` for ``batch`` sequences of up to ``max_length`` tokens (default:
    the last ``generate`` call's, else the example's batch and 64 tokens) placing the
    KV cache as ``pipe.generate(kv_cache=...)`` does (``fxpipe.kv_placement``):
    ``"host"``, ``params`` counts each stage's cache with its weights (it streams in with
    them); ``"device"``, every stage's ``cache`` counts what its device keeps resident for
    all its stages; ``"auto"``, the caches that fit. With ``num_microbatch`` the Program
    is the microbatched decode's, and activations are costed for one microbatch.

    ``sequence_chunks=K`` (a pipe over a Hugging Face causal LM, ``fxpipe.sequence_chunks``):
    a chunked call (``"fused"``, the default, or ``"infer"``) of the example's rows at
    ``max_length`` tokens (default: the example's) in ``K`` chunks (``"auto"``: as a call
    would choose), its plan the one that call runs; each stage also counts its attention
    layers' keys and values for the whole sequence (and in backward their gradients,
    ``fxpipe.sequence_plan.with_kv``), and ``.host`` the keys and values kept between the
    forward and the backward (``kv``).
    """
    chunked = None
    if sequence_chunks is not None:
        if not hasattr(pipe, "_chunk_prediction"):
            raise TypeError("predict_memory(sequence_chunks=...) takes a PipelineModule")
        if run_type not in (None, "fused", "infer") or plan is not None:
            raise ValueError("predict_memory(sequence_chunks=...) predicts a chunked call, "
                             "'fused' or 'infer', under the plan that call runs: pass no "
                             f"plan= and run_type 'fused' or 'infer', not {run_type!r}")
        run_type = run_type or "fused"
        # the chunk step's layers and plan, one chunk's memory, the keys, the call's tokens
        chunked = pipe._chunk_prediction(run_type, sequence_chunks, max_length)
    if run_type == "generate":
        from fxpipe.generation import inspected_steps
        if (batch is None) != (max_length is None):
            raise ValueError("predict_memory(run_type='generate') takes batch= and max_length= "
                             "together (or neither: the last generate call's)")
        steps = inspected_steps(pipe) if batch is None else pipe._generation_steps(batch, max_length)
        return pipe._place_cache(steps, kv_cache, num_microbatch or 1).prediction
    lg = pipe if isinstance(pipe, LayerGraph) else pipe.layers
    devices = list(getattr(pipe, "devices", None) or [])
    config = getattr(pipe, "config", None)
    kv = None
    if chunked is not None:
        lg, plan, memory, kv, tokens, num_microbatch = chunked
    elif run_type in (None, "fused") and hasattr(pipe, "_for_loss"):   # the chain the call runs
        compiled = pipe._for_loss(pipe._current, loss_fn or (lambda out, _: out), label,
                                  return_outputs)
        lg, plan = compiled.layers, plan or compiled.plan
    elif run_type in ("infer", "train") and hasattr(pipe, "_current"):   # what pipe(x) runs
        lg, plan = pipe._current.base.layers, plan or pipe._current.base.plan
    plan = plan or getattr(pipe, "plan", None)
    if plan is None:
        raise ValueError("predict_memory(layer_graph, ...) needs plan=ExecutePlan(...)")
    G = num_devices or len(devices)
    if G < 1:
        raise ValueError("predict_memory: no devices; pass num_devices=")
    M = num_microbatch or getattr(config, "num_microbatch", None) or G + 1
    grain = grain or getattr(config, "recompute_grain", None) or "stage"
    covered = plan.fwd_plan[-1].stop if plan.fwd_plan else 0
    planned = "infer" if not plan.bwd_plan else "fused" if covered < len(lg) else "train"
    run_type = run_type or planned
    # a plan made for training serves inference too (a fused plan's tail runs forward)
    plan.validate(len(lg), planned if run_type == "infer" else run_type)
    if chunked is not None:   # one chunk's, and the sequence's keys
        memory = memory if kv is None else with_kv(memory, kv, tokens)
    else:
        memory = chain_memory(pipe, M, loss=None if loss_fn is None else (loss_fn, label),
                              layers=lg)
    if isinstance(lg, LayerGraph):   # the Program the call runs: its hand-offs, its grain
        tensors = [x for x in lg.example_leaves if isinstance(x, torch.Tensor)]
        spec = CallSpec(run_type, M, grain, outputs=False, input_grads=tuple(
            n for n, x in zip(lg.input_names, tensors) if x.requires_grad))
        exe = build_executable(lg, plan, spec, [f"device {d}" for d in range(G)])
        if getattr(config, "stage_backend", None) == "cudagraphs":   # its slots and graphs
            exe = graph_jobs(exe)
        program = exe.program
    else:
        program = build_program(plan.fwd_plan, plan.bwd_plan, run_type, G, M, "stage", grain=grain)
    peaks = with_graphs(program_peaks(program, memory), program, memory)
    limits = [d.memory_limit for d in devices if getattr(d, "memory_limit", None)]
    fwd, _ = stage_ranges(plan, run_type, len(lg))
    dp = getattr(pipe, "_dp", None)
    on_devices = dp is not None and dp.on_devices   # reduced there
    world = dp.world if on_devices and dp.shard else 1   # reduce-scattered: 1/N downloaded
    host = host_memory(lg, memory, [r.stop - 1 for r in fwd], M, world) \
        if run_type in ("fused", "train") and isinstance(lg, LayerGraph) else {}
    if on_devices and host:   # a .grad held: the call adds it first (sRS+)
        peaks = with_reduce_scatter(peaks, program, lg, dp.world, accumulated=any(
            p.grad is not None for p in lg.params.values() if isinstance(p, torch.Tensor)),
            scatter=dp.shard)
    if host:
        sharded = dp is not None and dp.shard
        masters = dp.masters if sharded else {}
        if masters:
            host["masters"] = sum(m.numel() * m.element_size() for m in masters.values())
        if optimizer is not None:
            dtypes = {id(dp._mastered[n]): m.dtype for n, m in masters.items()}
            host["optimizer"] = optimizer_state_bytes(
                optimizer, dtypes, rank=dp.rank if sharded else 0, world=dp.world if sharded else 1)
    if kv is not None and run_type == "fused":
        host["kv"] = host_kv_bytes(kv, tokens)
    return MemoryPrediction(peaks, device_peaks(peaks, G), min(limits) if limits else None, host)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer, dtypes: dict[int, torch.dtype] | None = None,
                          *, rank: int = 0, world: int = 1) -> int:
    """The bytes of the state ``optimizer`` keeps for its trainable parameters once it has
    stepped (``predict_memory(optimizer=...)``'s ``.host["optimizer"]``): its class
    stepped once, with each group's settings, on stand-ins on the ``meta`` device shaped
    as what it steps: each parameter, in its own dtype or ``dtypes[id(parameter)]`` (its
    fp32 master's, when the masters are sharded); with ``world`` > 1 (``shard_optimizer``)
    only this ``rank``'s piece of it, flat, as ``fxpipe.optim_step.step_shards`` steps it.
    An optimizer whose step cannot run on ``meta`` tensors (one that reads a value on the
    host) raises ``NotImplementedError``.

    >>> import torch
    >>> w = torch.nn.Parameter(torch.zeros(1000))
    >>> optimizer_state_bytes(torch.optim.AdamW([w]))   # exp_avg, exp_avg_sq, step
    8004
    >>> optimizer_state_bytes(torch.optim.AdamW([w]), rank=1, world=4)   # its quarter
    2004
    """
    dtypes = dtypes or {}
    groups, seen = [], set()
    for group in optimizer.param_groups:
        standins = []
        for p in group["params"]:
            if id(p) in seen or not p.requires_grad:
                continue
            seen.add(id(p))
            shape: tuple[int, ...] = tuple(p.shape)
            if world > 1:
                lo, hi = _piece(p.numel(), world, rank)
                if lo >= hi:   # this rank steps none of it
                    continue
                shape = (hi - lo,)
            t = torch.empty(shape, dtype=dtypes.get(id(p), p.dtype), device="meta",
                            requires_grad=True)
            t.grad = torch.empty_like(t)
            standins.append(t)
        if standins:
            settings = {k: v for k, v in group.items() if k != "params"}
            settings.update({k: False for k in ("foreach", "fused", "capturable") if k in settings})
            groups.append({**settings, "params": standins})
    if not groups:
        return 0
    try:
        standin = _same_class(optimizer, groups)
        standin.step()
    except Exception as e:  # noqa: BLE001 — which optimizer, and why
        raise NotImplementedError(
            f"predict_memory(optimizer=...): the state of {type(optimizer).__name__} is "
            f"predicted by stepping it once on meta tensors, which failed ({type(e).__name__}: "
            f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}); predict without "
            "optimizer= and add its state yourself") from e
    return sum(t.numel() * t.element_size() for state in standin.state.values()
               for t in state.values() if isinstance(t, torch.Tensor))


def _same_class(optimizer: torch.optim.Optimizer, groups: list[dict]) -> torch.optim.Optimizer:
    """An optimizer of ``optimizer``'s class over ``groups`` (each with its settings); a
    class whose constructor requires more than its parameters (a hyperparameter without
    a default) gets its defaults too, those its constructor takes."""
    cls = type(optimizer)
    try:
        return cls(groups)
    except TypeError:
        takes = inspect.signature(cls.__init__).parameters
        if any(p.kind is p.VAR_KEYWORD for p in takes.values()):
            return cls(groups, **optimizer.defaults)
        return cls(groups, **{k: v for k, v in optimizer.defaults.items() if k in takes})


def host_grad_piece(lg: LayerGraph, layers: Iterable[int]) -> int:
    """Device bytes an ``sRS+`` (``sAR+``) of a stage over ``layers`` holds beside its gradients:
    one piece of a host ``.grad`` being added (``device_collectives.add_host_grads``: at
    most ``UPLOAD_CHUNK`` bytes, in the host gradient's dtype)."""
    return max((min(UPLOAD_CHUNK, t.numel() * t.element_size()) for i in layers
                for f in lg.layers[i].params
                if isinstance(t := lg.params.get(f), torch.Tensor) and t.requires_grad),
               default=0)


def _trained(lg: LayerGraph, layers: Iterable[int]) -> list[tuple[str, int, torch.dtype]]:
    """``(name, numel, dtype on the device)`` of each trainable parameter ``layers`` use,
    once."""
    params = {id(t): (f, t) for i in layers for f in lg.layers[i].params
              if isinstance(t := lg.params.get(f), torch.Tensor) and t.requires_grad}
    return [(f, t.numel(), lg.device_dtype(t)) for f, t in params.values()]


def with_device_reduce(memory: ChainMemory, pipe: Any) -> ChainMemory:
    """The planner's per-layer ``memory`` of a pipe that reduces on its devices
    (``data_parallel="device"``, ``True`` on GPUs; else as it is): each layer's gradients
    also count a bound of what its backward stage's reduce-scatter holds beside them
    (``device_collectives.reduce_scatter_bound``: this rank's shard, and copies of the
    gradients it may pack or pad; an all-reduce's, the copies), and its backward peak the
    piece of a host ``.grad`` an ``sRS+`` adds (:func:`host_grad_piece`), so the plan
    leaves room for them."""
    dp, lg = getattr(pipe, "_dp", None), getattr(pipe, "layers", None)
    if dp is None or not dp.on_devices or not isinstance(lg, LayerGraph):
        return memory
    extra = [reduce_scatter_bound(_trained(lg, [i]), dp.world, dp.shard) for i in range(len(lg))]
    # a piece of a host .grad an sRS+ adds: one at a time, so beside a layer's peak
    piece = [host_grad_piece(lg, [i]) for i in range(len(lg))]
    return replace(memory, grads=tuple(g + e for g, e in zip(memory.grads, extra)),
                   bwd_peak=tuple(b + e for b, e in zip(memory.bwd_peak, piece)))


def with_reduce_scatter(peaks: list[StagePeak], program: Any, lg: LayerGraph,
                        world: int, accumulated: bool = False,
                        scatter: bool = True) -> list[StagePeak]:
    """``peaks`` under ``data_parallel="device"``: a backward stage's gradients are
    reduce-scattered on its device before they download, and while that runs the device
    also holds this rank's shard of them and the copies its collectives read
    (``device_collectives.reduce_scatter_workspace``), counted under ``gradients``;
    ``accumulated`` (a call after calls that did not synchronize: ``sRS+``), also the
    piece of a host ``.grad`` being added (:func:`host_grad_piece`). Not ``scatter``
    (``data_parallel=True`` on GPUs: ``sAR``), the packed copies only."""
    out = []
    for peak in peaks:
        st = program.stages[peak.stage] if peak.stage is not None else None
        if st is not None and st.kind != "fwd":
            extra = reduce_scatter_workspace(_trained(lg, st.layers), world, scatter) + (
                host_grad_piece(lg, st.layers) if accumulated else 0)
            if extra:
                peak = replace(peak, bytes={**peak.bytes,
                                            "gradients": peak.bytes["gradients"] + extra})
        out.append(peak)
    return out


def host_memory(lg: LayerGraph, memory: ChainMemory, cuts: Iterable[int],
                num_microbatch: int, world: int = 1) -> dict[str, int]:
    """Host bytes a training call holds at most (``predict_memory``'s ``.host``): the
    model's parameters and buffers as held (``params``); the upload copies of those a
    ``param_dtype`` converts (``copies``); the trainable parameters' gradients
    (``grads``); the values live across each cut after layer ``i`` in ``cuts`` (a forward
    stage's outputs, kept for its recompute) with the model's inputs, for every
    microbatch (``activations``); and the gradients a backward stage hands the next at
    the largest cut, for every microbatch (``activation_grads``). Page-locked at their
    size (``fxpipe.runtime.devices.pinned``). Not the optimizer's state (AdamW: twice the
    trainable parameters' bytes in fp32). ``world``: the ranks reduce-scattering the
    gradients on the devices (``data_parallel="device"``), each keeping 1/``world`` of
    each gradient."""
    tensors = {id(t): t for t in [*lg.params.values(), *lg.buffers.values()]
               if isinstance(t, torch.Tensor)}.values()
    trainable = {id(p): p for p in lg.params.values() if p.requires_grad}.values()
    cuts = list(cuts)
    kept = sum(memory.boundary[i] for i in cuts) + memory.input_bytes
    return {"params": sum(t.numel() * t.element_size() for t in tensors),
            "copies": sum(t.numel() * lg.device_dtype(t).itemsize for t in tensors
                          if lg.device_dtype(t) != t.dtype),
            "grads": sum(-(-p.numel() // world) * p.element_size() for p in trainable),
            "activations": kept * num_microbatch,
            "activation_grads": max((memory.boundary[i] for i in cuts), default=0) * num_microbatch}
