"""Planning: ``ExecutePlan`` (stage ranges that can plan themselves) and memory planning.

``fxpipe.ExecutePlan`` is a ``fxpipe.stage_plan.StagePlan`` (the ranges, their
validation, ``default``) plus ``ExecutePlan.auto``, which plans stages from the layers'
costs with ``fxpipe.passes.planner`` (the pure algorithm over cost vectors) and keeps
every stage's predicted peak within the device limit.

>>> plan = ExecutePlan([range(0, 3)], [range(3, 4), range(2, 3), range(0, 2)])
>>> plan
ExecutePlan(fwd=[0:3], bwd=[3:4, 2:3, 0:2])
>>> plan.validate(4, "fused")
>>> ExecutePlan.default(3, "train")
ExecutePlan(fwd=[0:1, 1:2, 2:3], bwd=[2:3, 1:2, 0:1])

Memory: ``predict_memory`` (each stage's predicted peak bytes on its device, by kind),
``MemoryPrediction`` and ``chain_memory`` are ``fxpipe.memory_prediction``'s, importable
from here; ``max_sequence_length`` (here) finds the longest sequence for which a plan
fits. Layers, low to high: ``stage_plan`` (the ranges, as data) < ``memory_prediction``
(estimates) < ``passes.planner`` (the algorithm, over ``passes.chain_costs``' cost
vectors) < this module (what users call).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.nn as nn
import torch.utils._pytree as pytree

from fxpipe.errors import PlanError
from fxpipe.memory_prediction import host_memory as host_bytes
from fxpipe.memory_prediction import (MemoryPrediction, chain_memory,  # noqa: F401 (public here)
                                      optimizer_state_bytes, predict_memory, tensor_bytes,
                                      with_device_reduce)
from fxpipe.passes import chain_costs, planner
from fxpipe.passes.costs import compute_costs
from fxpipe.passes.layer_graph import LayerGraph
from fxpipe.passes.stage_memory import ChainMemory, human_bytes
from fxpipe.passes.loss import loss_reads_dropped
from fxpipe.passes.partition import build_layer_graph, without_loss_free_outputs
from fxpipe.sequence_plan import chunk_counts, host_kv_bytes, kv_layout, with_kv
from fxpipe.stage_plan import RunType, StagePlan, check_run_type

MEMORY_FRACTION = 0.9
"""The share of the smallest device's ``memory_limit`` a plan may use at its predicted
peak by default; the rest covers the prediction's error and allocator fragmentation."""


class ExecutePlan(StagePlan):
    """Forward and backward stage ranges (``StagePlan``), and ``auto``, which plans them
    (see the module docstring)."""

    @classmethod
    def auto(cls, run_type: RunType, *pipes: Any, min_stages: int | None = None,
             upper_threshold: float = 1.1, model_memory_limit: float | None = None,
             num_devices: int | None = None, num_microbatch: int | None = None,
             recompute_grain: Literal["stage", "layer"] = "stage",
             host_ms_per_action: float | None = None,
             recompute: Literal["auto", "full"] = "auto",
             device: chain_costs.NominalDevice | None = None) -> ExecutePlan | list[ExecutePlan]:
        """Plan stages from per-layer costs (see ``fxpipe.passes.planner.plan_chains``).

        A pipe has ``.layers`` (a ``LayerGraph``, or items with ``.cost``), ``.devices``
        (items with an optional ``.memory_limit`` in bytes) and optionally ``.timings``
        (a ``LayerTimer``: measured times replace the estimates, see :func:`layer_costs`)
        and ``.config`` (a ``RunConfig``: its ``split_input``).

        Memory: every stage's predicted peak on its device (:func:`predict_memory`: its
        parameters and those of the stage its device prefetches meanwhile, gradients,
        activations, saved tensors and workspace, for one microbatch of
        ``num_microbatch``, default devices + 1, at ``recompute_grain``) fits
        ``model_memory_limit`` GiB (2**30 bytes; default ``MEMORY_FRACTION`` = 90% of the
        smallest device limit, no limit when no device has one). A pipe whose ``layers``
        is a ``LayerGraph`` is costed again on fake tensors shaped like one microbatch;
        other costs are taken as one microbatch's. A pipe compiled with
        ``data_parallel="device"`` also leaves room, beside each backward stage's
        gradients, for what its reduce-scatter holds (``memory_prediction.with_device_reduce``).
        A pipe whose ``RunConfig`` replays device graphs (``stage_backend="cudagraphs"``)
        is planned until its whole plan, with each device's parameter slots, graph inputs
        and outputs and graph pool (``predict_memory``), fits: on a smaller budget while it
        does not (:func:`_room_for_graphs`).

        ``min_stages`` defaults to the number of devices (a hint: a short model may get
        fewer). ``upper_threshold`` bounds the granularity: no more stages than needed to
        keep every stage within ``upper_threshold`` x the best achievable bottleneck
        (about the slowest layer); the bottleneck itself is always the exact optimum for
        the chosen stage count. Several pipes share one bottleneck. Returns one plan for
        one pipe, a list for several.

        ``host_ms_per_action``: the host time one action costs to issue (default
        ``chain_costs.HOST_MS_PER_ACTION``, ``benchmarks/bench_issue.py``'s figure): each
        stage costs it per microbatch and action, and one host issues every device's actions,
        so layers too small to pay for their issuing share a stage. ``0`` plans as if
        issuing were free.

        ``recompute``: ``"auto"`` (default) recomputes only what does not fit: where a
        device limit is known, a ``"fused"`` plan's tail (the first backward stage, which
        runs forward, loss and backward without recompute) takes every layer whose
        activations fit the device beside it, one microbatch at a time, while the
        estimated makespan falls; the other layers are recomputed in their backward stage.
        ``"full"``: the tail is only as long as balancing the stages' times makes it.
        The plan shows the choice (``bwd_plan[0]`` of a fused plan: layers kept;
        :meth:`StagePlan.recomputed`: the others).

        ``device``: the device model (``chain_costs.NominalDevice``: FLOP rate, link and
        host rates) that times layers without measured times and prices what a long tail
        leaves exposed; default ``chain_costs.NOMINAL_DEVICE``;
        ``fxpipe.sim.Hardware.nominal_device()`` plans for a simulated machine.
        """
        if recompute not in ("auto", "full"):
            raise ValueError(f"ExecutePlan.auto: recompute must be 'auto' or 'full', got {recompute!r}")
        check_run_type(run_type)
        if not pipes:
            raise ValueError("ExecutePlan.auto needs at least one pipe")
        devices = [d for p in pipes for d in getattr(p, "devices", None) or []]
        if num_devices is None:
            num_devices = max(len(getattr(p, "devices", None) or []) for p in pipes)
        if num_devices < 1:
            raise ValueError("ExecutePlan.auto: no devices; pass num_devices=")
        if model_memory_limit is None:
            limits = [d.memory_limit for d in devices if getattr(d, "memory_limit", None)]
            limit = MEMORY_FRACTION * min(limits) if limits else None
        else:
            if model_memory_limit <= 0:
                raise ValueError(f"model_memory_limit must be > 0 GiB, got {model_memory_limit}")
            limit = model_memory_limit * 2**30
        M = num_microbatch or num_devices + 1
        cost_lists = [layer_costs(p) for p in pipes]
        for k, costs in enumerate(cost_lists):
            for i, cost in enumerate(costs):
                if cost is None:
                    raise PlanError(f"pipe {k} layer {i} has no cost; run the cost pass "
                                    f"(fxpipe.passes.costs) before ExecutePlan.auto")
        device = chain_costs.NOMINAL_DEVICE if device is None else device
        chains = chain_costs.chain_costs(cost_lists, device, need_backward=run_type != "infer")
        memory = None if limit is None else [with_device_reduce(chain_memory(p, M), p)
                                             for p in pipes]

        def plan_at(budget: float | None) -> list[ExecutePlan]:
            planned = planner.plan_chains(
                run_type, chains, num_devices=num_devices, num_microbatch=M,
                min_stages=min_stages, upper_threshold=upper_threshold, memory=memory,
                memory_limit=budget, recompute_grain=recompute_grain, recompute=recompute,
                device=device, host_ms_per_action=chain_costs.HOST_MS_PER_ACTION
                if host_ms_per_action is None else host_ms_per_action)
            return [cls(fwd, bwd) for fwd, bwd in planned]

        graphed = [k for k, p in enumerate(pipes) if _graphed(p)]
        plans = plan_at(limit) if limit is None or not graphed else _room_for_graphs(
            plan_at, [pipes[k] for k in graphed], graphed, limit, run_type=run_type,
            num_devices=num_devices, num_microbatch=M, grain=recompute_grain)
        for plan, costs in zip(plans, cost_lists):
            plan.validate(len(costs), run_type)
        return plans[0] if len(plans) == 1 else plans


GRAPH_FIT_TRIES = 8
"""How many plans ``ExecutePlan.auto`` tries at most for a pipe replaying device graphs
(:func:`_room_for_graphs`) before it gives up."""


def _graphed(pipe: Any) -> bool:
    """Whether ``pipe``'s calls replay stage jobs as device graphs (its ``RunConfig``)."""
    return isinstance(getattr(pipe, "layers", None), LayerGraph) and \
        getattr(getattr(pipe, "config", None), "stage_backend", None) == "cudagraphs"


def _room_for_graphs(plan_at: Callable[[float], list[ExecutePlan]], pipes: list[Any],
                     which: list[int], limit: float, **predict: Any) -> list[ExecutePlan]:
    """``plan_at(budget)``'s plans, whose ``which``-th are those of ``pipes`` (replaying
    graphs), at about the largest budget where those pipes' peaks fit ``limit`` with the
    devices' graphs counted.

    Under ``stage_backend="cudagraphs"`` a device also holds, past each job, its parameter
    slots, every graph's inputs and outputs and its graphs' pool
    (``stage_memory.with_graphs``): memory of the device, set by every stage it runs, which
    the planner, packing stages one at a time, cannot price. So each plan of a graphed
    pipe is predicted whole (:func:`predict_memory`, the Program with its graph jobs) and,
    while a device's peak exceeds ``limit``, planned again on a smaller budget: first that
    excess less, then twice the last cut less (smaller stages and a shorter fused tail:
    smaller slots and pools), until a plan fits or the planner finds none; then halfway
    between the budgets that bracket the largest that fits, to within
    ``limit / 32``."""
    hi, failed, fits = limit, None, None   # overflowed; no plan; (budget, plans) that fit
    budget, cut, last, why = limit, 0.0, None, None
    for _ in range(GRAPH_FIT_TRIES):
        try:
            plans = plan_at(budget)
        except PlanError as e:
            if budget == limit:
                raise
            if fits is not None:   # above a budget that fit: as if it overflowed
                hi = budget
            else:
                failed, why = budget, e
        else:
            last = max(predict_memory(p, plan=plans[k], **predict).peak
                       for p, k in zip(pipes, which))
            if last <= limit:
                fits = (budget, plans)
            else:
                hi, cut = budget, max(last - limit, 2 * cut)
        low = fits[0] if fits is not None else failed
        if low is None:
            budget = hi - cut
        elif hi - low <= limit / 32:
            break
        else:
            budget = (low + hi) / 2
    if fits is not None:
        return fits[1]
    if why is not None:
        raise PlanError(
            f"{why}\nUnder stage_backend='cudagraphs' each device also keeps its parameter "
            "slots, its graphs' inputs and outputs and their pool past every job: a plan for "
            f"{human_bytes(limit)} would hold {human_bytes(last)} with them, and no plan fits "
            f"in {human_bytes(failed)} or less. Use larger devices, more of them, or "
            "stage_backend='inductor' (the same compiled code without graphs)") from None
    raise PlanError(
        f"Under stage_backend='cudagraphs' no plan of {GRAPH_FIT_TRIES} tried fits "
        f"{human_bytes(limit)} with its graphs (the last predicted {human_bytes(last)}): use "
        "larger devices, more of them, or stage_backend='inductor'")


def layer_costs(pipe: Any) -> list[Any]:
    """A pipe's per-layer costs as the planner and simulator read them: the layers'
    ``cost`` with the times measured so far (``pipe.timings``, when it has them)."""
    layers = list(pipe.layers)
    timings = getattr(pipe, "timings", None)
    if timings is not None:
        return timings.costs(layers)
    return [getattr(layer, "cost", None) for layer in layers]


def _takes_labels(model: nn.Module) -> str | None:
    """If ``model`` (or the model a wrapper such as peft's forwards to, whose own
    signature is ``*args, **kwargs``) takes ``labels``: the name its token ids go by
    (``input_ids``, else its first parameter); else None."""
    while model is not None:
        params = inspect.signature(model.forward).parameters
        if "labels" in params:
            return "input_ids" if "input_ids" in params else next(iter(params))
        get_base = getattr(model, "get_base_model", None)
        base = get_base() if callable(get_base) else None
        model = base if base is not model else None
    return None


def max_sequence_length(model: nn.Module, example_inputs: Callable[[int], tuple] | None = None, *,
                        device_memory: int, num_devices: int, microbatch_size: int = 1,
                        num_microbatch: int | None = None,
                        dtype: torch.dtype | None = torch.bfloat16,
                        recompute_grain: Literal["stage", "layer"] = "stage",
                        loss_fn: Callable[[Any, Any], Any] | None = None,
                        label: Callable[[int], Any] | None = None,
                        memory_fraction: float = MEMORY_FRACTION, step: int = 1024,
                        max_length: int = 1 << 23, layers: str | None = None,
                        capture: Literal["auto", "fx", "dynamo", "export"] = "auto",
                        host_memory: int | None = None,
                        optimizer: torch.optim.Optimizer | None = None,
                        sequence_chunks: int | Literal["auto"] | None = "auto",
                        details: dict | None = None) -> int:
    """The longest sequence, a multiple of ``step`` up to ``max_length``, that trains on
    ``num_devices`` devices of ``device_memory`` bytes each: the largest for which
    ``ExecutePlan.auto("fused", ...)`` finds a plan whose every stage's predicted peak fits
    ``memory_fraction`` of ``device_memory`` (:func:`predict_memory`).

    ``model``: best built on the ``meta`` device (no weights are read). ``dtype``: the
    device copies' dtype (``compile``'s ``param_dtype``): floating parameters, their
    gradients and the activations are sized in it, buffers in their own; ``None`` keeps
    the model's. ``example_inputs(seq_len)``: the model's positional inputs for
    one microbatch of ``microbatch_size`` sequences (default: token ids
    ``(microbatch_size, seq_len)`` on ``meta``), or a dict of its keyword arguments (a
    Hugging Face causal LM: ``{"input_ids": ids, "labels": ids}``). A step runs
    ``num_microbatch`` microbatches (default devices + 1). ``loss_fn`` and
    ``label(seq_len)`` (default: ids-shaped labels): the loss the fused tail runs,
    costed; without it the tail counts a cross-entropy over the model's output
    (``LOSS_FACTOR`` x its bytes); a model that returns its loss needs neither: a
    Hugging Face model given ``labels=`` (its head and loss become the chunked
    ``linear_cross_entropy``, ``fxpipe.passes.loss``, and the logits beside the loss are
    not computed) or one calling ``fxpipe.linear_cross_entropy`` itself.
    ``host_memory``: the host's bytes, which must hold the parameters, their gradients
    and every microbatch's boundary activations (``predict_memory``'s ``.host``), and, with
    ``optimizer`` (one over the ``meta`` model's parameters: ``torch.optim.AdamW(
    model.parameters())``), the state it keeps (``memory_prediction.optimizer_state_bytes``).

    ``sequence_chunks`` (``RunConfig.sequence_chunks``): ``"auto"`` (default) — for a
    Hugging Face model whose attention a chunked call runs (``fxpipe.sequence_chunks``),
    a length that does not fit whole is tried in token chunks of ``step * 2**j`` tokens
    that divide it, the longest first (the fewest chunks that fit are taken): one
    sequence of ``microbatch_size`` rows, its chunks the step's microbatches, each
    attention layer's stage holding its keys and values of the whole sequence for its
    job, and the host all of them (``fxpipe.sequence_plan``); an int — exactly that many
    chunks (a model whose attention cannot run in chunks raises ``NotImplementedError``);
    ``None`` — whole sequences in ``num_microbatch`` microbatches only. Without ``loss_fn``,
    a model that takes ``labels`` is costed with them by default (its own loss, the head
    and loss chunked: the default ``example_inputs`` is ``{"input_ids": ids, "labels":
    ids}``, its ids under its first parameter's name where it has no ``input_ids``); with
    ``loss_fn`` the ids alone, positionally. ``details``: a dict that
    gets the longest length's ``sequence_chunks``, ``host_bytes`` (what the host holds:
    ``predict_memory``'s ``.host`` kinds at every layer's cut, or, where ``host_memory``
    binds a chunked step, at the cuts of the fewest stages that fit; plus the keys and
    values) and ``device_bytes`` (the limit the plan fits).

    The model is captured once at ``step`` tokens and costed on fake tensors at each
    length tried (a graph specialized on the sequence length is captured again); the
    search doubles, then bisects. Raises ``PlanError`` (what does not fit, by kind)
    when not even ``step`` tokens fit.

    >>> import torch, fxpipe
    >>> from fxpipe.demo import TinyLlama
    >>> with torch.device("meta"):
    ...     model = TinyLlama(vocab=256, dim=64, depth=2)
    >>> fxpipe.plan.max_sequence_length(model, device_memory=64 * 2**20, num_devices=2, step=256,
    ...                                 dtype=None)
    7168
    """
    if step < 1 or max_length < step:
        raise ValueError(f"max_sequence_length: need 1 <= step <= max_length, got step={step}, "
                         f"max_length={max_length}")
    if device_memory <= 0 or not 0 < memory_fraction <= 1:
        raise ValueError(f"max_sequence_length: device_memory must be > 0 bytes and "
                         f"memory_fraction in (0, 1], got {device_memory} and {memory_fraction}")
    if host_memory is not None and host_memory <= 0:
        raise ValueError(f"max_sequence_length: host_memory must be > 0 bytes or None, got {host_memory}")
    if sequence_chunks not in (None, "auto") and (isinstance(sequence_chunks, bool) or not
                                                 isinstance(sequence_chunks, int) or
                                                 sequence_chunks < 1):
        raise ValueError(f"max_sequence_length: sequence_chunks must be None, 'auto' or an int "
                         f">= 1, got {sequence_chunks!r}")
    ids_name = _takes_labels(model) if example_inputs is None and loss_fn is None else None
    if ids_name is not None:   # its own loss (a loss_fn given computes the loss outside)
        def make(n: int) -> Any:
            ids = torch.zeros(microbatch_size, n, dtype=torch.long, device="meta")
            return {ids_name: ids, "labels": ids}
    else:
        make = example_inputs or (lambda n: (torch.zeros(microbatch_size, n, dtype=torch.long,
                                                         device="meta"),))
    make_label = label or (lambda n: torch.zeros(microbatch_size, n, dtype=torch.long, device="meta"))
    M = num_microbatch or num_devices + 1
    limit = memory_fraction * device_memory
    state = 0 if optimizer is None else optimizer_state_bytes(optimizer)
    graph: list[LayerGraph] = []
    layout: list = []   # the KV layout of graph[0] (None: no chunked attention)
    costed: dict[int, ChainMemory] = {}   # tokens -> one microbatch's memory, current graph

    def memory_at(n: int) -> ChainMemory:
        if n in costed:
            return costed[n]
        args = make(n)
        if not isinstance(args, (tuple, dict)):
            raise TypeError(f"example_inputs(seq_len) must return a tuple of positional "
                            f"arguments or a dict of keyword arguments, got {type(args).__name__}")
        args, kwargs = ((), args) if isinstance(args, dict) else (args, {})
        flat = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
        if not graph or any(x.shape[d] != size for name, x in zip(graph[0].input_names, flat)
                            for d, size in graph[0].static_dims.get(name, {}).items()):
            lg = build_layer_graph(model, args, kwargs, capture=capture, layers=layers,
                                   param_dtype=dtype, device_memory=device_memory)
            if loss_fn is None or not loss_reads_dropped(lg, loss_fn, make_label(n)):
                lg = without_loss_free_outputs(lg, model)
            graph[:] = [lg]
            layout[:] = [kv_layout(model, lg, dtype)]
            costed.clear()
        loss = None if loss_fn is None else (loss_fn, make_label(n))
        costs = compute_costs(graph[0], flat, store=False, loss=loss)
        costed[n] = ChainMemory.of(costs, tensor_bytes(flat))
        return costed[n]

    def check_chunks(n: int, chunks: int) -> None:
        memory = memory_at(n // chunks)
        kv = layout[0] if chunks > 1 else None
        if chunks > 1:
            memory = with_kv(memory, kv, n * microbatch_size)
        steps = M if chunks == 1 else chunks
        planner.check_memory("fused", [memory], limit, num_devices=num_devices,
                             num_microbatch=steps, recompute_grain=recompute_grain)

        def host_at(cuts: Any) -> int:
            return sum(host_bytes(graph[0], memory, cuts, steps).values()) + state + (
                host_kv_bytes(kv, n * microbatch_size) if kv is not None else 0)

        host = host_at(range(len(memory) - 1))   # every layer's boundary: the finest plan's
        if kv is not None and host_memory is not None and host > host_memory:
            (_, bwd), = planner.plan_chains(   # the fewest stages that fit: fewest cuts
                "fused", [chain_costs.ChainCosts.from_times([1.0] * len(memory))],
                num_devices=num_devices, num_microbatch=steps, memory=[memory],
                memory_limit=limit, min_stages=1, recompute_grain=recompute_grain,
                host_ms_per_action=1e6)
            host = host_at([r.start - 1 for r in bwd if r.start > 0])
        if host_memory is not None and host > host_memory:
            raise PlanError(f"the host would hold {human_bytes(host)} at {n} tokens "
                            f"(parameters, gradients, {steps} microbatches' activations at "
                            f"every layer's cut{', the keys and values' if kv else ''}"
                            f"{', the optimizer state' if state else ''}), over "
                            f"host_memory={human_bytes(host_memory)}")
        found[n] = {"sequence_chunks": chunks, "host_bytes": host, "device_bytes": int(limit)}

    found: dict[int, dict] = {}   # tokens -> what fits them (details)
    failed: dict[int, int] = {}   # chunk length (0: whole) -> the fewest tokens it failed at

    def check(n: int) -> None:
        memory_at(min(n, step))   # the graph, and its attention layers
        if isinstance(sequence_chunks, int) and sequence_chunks > 1 and layout[0] is None:
            raise NotImplementedError(
                f"max_sequence_length(sequence_chunks={sequence_chunks}): "
                f"{type(model).__name__}'s attention cannot run in chunks (a Hugging Face "
                "causal LM whose attention goes through transformers' attention interface "
                "can); pass sequence_chunks=None")
        if sequence_chunks is None or layout[0] is None:
            counts = [1]
        elif sequence_chunks == "auto":   # chunk lengths step * 2**j: costed once each
            counts = chunk_counts(n, step)
        else:
            if n % sequence_chunks:
                raise PlanError(f"{sequence_chunks} chunks do not divide {n} tokens")
            counts = [sequence_chunks]
        failure = None
        for chunks in counts:
            # a chunk length that failed at fewer tokens fails here too (it holds more)
            if n >= failed.get(n // chunks if chunks > 1 else 0, n + 1):
                continue
            try:
                return check_chunks(n, chunks)
            except PlanError as e:
                failed[n // chunks if chunks > 1 else 0] = n
                failure = failure or e
        raise failure or PlanError(f"no chunk length fits {n} tokens")

    def fits(n: int) -> bool:
        try:
            check(n)
        except PlanError:
            return False
        return True

    try:
        check(step)
    except PlanError as e:
        raise PlanError(f"max_sequence_length: not even {step} tokens fit "
                        f"{memory_fraction:.0%} of {human_bytes(device_memory)}: {e}") from None
    lo, hi = step, None
    while hi is None:
        n = min(2 * lo, max_length) // step * step
        if n <= lo:   # max_length reached
            break
        lo, hi = (n, None) if fits(n) else (lo, n)
    while hi is not None and hi - lo > step:
        mid = (lo + hi) // 2 // step * step
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    if details is not None:
        details.update(found[lo])
    return lo
