"""Where a generation's decode step keeps each stage's KV cache (``pipe.generate(kv_cache=)``).

``place_cache`` decides it from the decode step's predicted memory
(``fxpipe.memory_prediction``): with every cache streamed with its stage's weights
(``"host"``), each stage's peak counts its cache and the one of the stage its device
prefetches meanwhile in ``params``; keeping a stage's cache resident moves those bytes
out of ``params`` and into a ``"cache"`` share that every stage on that device carries
for the whole call. ``"device"`` keeps them all (or refuses with the numbers), ``"auto"``
what fits under ``AUTO_HEADROOM`` of each device's limit. ``predict_memory(run_type=
"generate", kv_cache=...)`` is the placement's prediction; the runtime holds the chosen
caches in a ``runtime.host.scratch.ResidentBuffers``.

Where the step pipe's own plan (cut for weights streamed with their caches) cannot hold
every cache, ``cache_plan`` cuts the decode again for the cache: each device must hold
its stages' caches for the whole call beside two stages' weights, so the stages get
smaller until that fits (round-robin puts about 1/devices of the caches on each device
whatever the cut; smaller stages leave it more room). The placement then runs that plan.

``prefill_chunk`` bounds the prefill the same way: a prompt whose prefill would not fit
the devices (its activations grow with the prompt; the prefill's plan was costed on the
example the step pipe was captured with) is run in chunks, each a prefill call at its
cache positions, the largest that fits.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

from fxpipe.errors import DeviceMemoryError, PlanError
from fxpipe.generation import KV_CACHE, cache_tensors
from fxpipe.memory_prediction import MemoryPrediction, tensor_bytes
from fxpipe.passes.costs import compute_costs
from fxpipe.passes.stage_memory import ChainMemory, device_peaks, human_bytes, program_peaks
from fxpipe.plan import MEMORY_FRACTION, ExecutePlan
from fxpipe.runtime.issue.inputs import static_dim_problem
from fxpipe.runtime.host.params import is_scratch

__all__ = ["AUTO_HEADROOM", "CachePlacement", "cache_plan", "place_cache", "prefill_chunk"]

AUTO_HEADROOM = 0.9
"""``kv_cache="auto"`` keeps caches on a device while its predicted decode peak stays
within this share of its ``memory_limit`` (the rest of it: the allocator's rounding and
fragmentation, which the prediction does not see)."""


@dataclass(frozen=True)
class CachePlacement:
    """Where a decode step keeps each stage's KV cache: ``resident``, the decode stages
    whose cache stays on their device for the whole ``generate`` call (the others stream
    in with their weights each step); ``kept``, the ids of those caches' host tensors
    (what ``runtime.host.scratch.ResidentBuffers`` holds); ``prediction``, the decode step's
    predicted memory with it (``fxpipe.plan.predict_memory``; each stage's ``"cache"``
    bytes: what its device keeps resident for all its stages); ``plan``, the decode's
    plan cut for the cache (:func:`cache_plan`), ``None`` where the step pipe's own plan
    holds it."""

    kv_cache: str
    resident: frozenset[int]
    kept: frozenset[int]
    prediction: MemoryPrediction
    plan: ExecutePlan | None = None


def place_cache(steps: Any, kv_cache: str, num_microbatch: int = 1) -> CachePlacement:
    """Place the decode step's KV caches: ``"host"`` none resident, ``"device"`` all (or a
    ``DeviceMemoryError`` with the numbers, before anything runs), ``"auto"`` per device,
    in its stages' order, each stage's cache while the device's predicted peak stays
    within ``AUTO_HEADROOM`` of its ``memory_limit`` (no limit: all). Where the step
    pipe's plan cannot keep every cache but :func:`cache_plan`'s can, the decode runs
    that plan (``plan``)."""
    if kv_cache not in KV_CACHE:
        raise ValueError(f"kv_cache must be one of {KV_CACHE}, got {kv_cache!r}")
    limits = [d.memory_limit for d in steps.pipe.devices]
    plan = None
    exe, base, caches = _decode(steps, num_microbatch, None)
    cached = [s for s in caches if caches[s]]
    share = 1.0 if kv_cache == "device" else AUTO_HEADROOM
    if kv_cache != "host" and not _fits(_with_cache(base, exe, caches, set(cached)).stages,
                                        limits, share):
        recut = cache_plan(steps, num_microbatch)
        if recut is not None:
            trial = _decode(steps, num_microbatch, recut)
            held = {s for s in trial[2] if trial[2][s]}
            if _fits(_with_cache(trial[1], trial[0], trial[2], held).stages, limits, share):
                plan, (exe, base, caches), cached = recut, trial, sorted(held)
    resident: set[int] = set()
    if kv_cache == "device":
        resident = set(cached)
    elif kv_cache == "auto":
        for d in range(len(limits)):
            for s in [p.stage for p in base.stages if p.device == d and p.stage in cached]:
                trial = _with_cache(base, exe, caches, resident | {s})
                peak = max((p.total for p in trial.stages if p.device == d), default=0)
                if limits[d] is None or peak <= AUTO_HEADROOM * limits[d]:
                    resident.add(s)
    prediction = _with_cache(base, exe, caches, resident)
    if kv_cache == "device":
        for d, limit in enumerate(limits):
            mine = [p for p in prediction.stages if p.device == d]
            worst = max(mine, key=lambda p: p.total, default=None)
            if limit is not None and worst is not None and worst.total > limit:
                stages = sorted(p.stage for p in mine if p.stage in resident)
                raise DeviceMemoryError(
                    f"pipe.generate(kv_cache='device'): {steps.pipe.devices[d].name} would hold "
                    f"the KV cache of stages {stages} ({human_bytes(worst.bytes['cache'])}, "
                    f"{steps.module.batch} sequences of {steps.module.length} positions) "
                    f"resident, and peaks at {human_bytes(worst.total)} in stage {worst.stage} "
                    f"({', '.join(f'{k} {human_bytes(v)}' for k, v in worst.bytes.items() if v)})"
                    f" > memory_limit {human_bytes(limit)}. Nothing ran. Use kv_cache='auto' "
                    "(the caches that fit stay, the others stream from the host), 'host', fewer "
                    "sequences or new tokens, or more devices.")
    kept = frozenset(id(t) for s in resident for t in caches[s])
    return CachePlacement(kv_cache, frozenset(resident), kept, prediction, plan)


def cache_plan(steps: Any, num_microbatch: int = 1) -> ExecutePlan | None:
    """The decode step planned for its caches resident: each layer's cache out of its
    streamed bytes, and each device's limit less the caches it holds for its stages
    (``MEMORY_FRACTION`` of the smallest limit, as ``ExecutePlan.auto`` plans). That
    share depends on the cut: it starts at the caches over the devices and is raised to
    the largest device's share under the last plan until a plan holds its own.
    ``None`` where no device has a limit or no cut fits."""
    limits = [d.memory_limit for d in steps.pipe.devices]
    if not limits or any(limit is None for limit in limits):
        return None
    lg = steps.compiled()[1].layers
    cache = [sum(_nbytes(lg.buffers[f]) for f in layer.buffers if is_scratch(lg.buffers[f]))
             for layer in lg]
    layers = [SimpleNamespace(cost=dataclasses.replace(
        layer.cost, buffer_bytes=layer.cost.buffer_bytes - c)) for layer, c in zip(lg, cache)]
    n = len(limits)
    share = sum(cache) / n
    for _ in range(4):
        budget = MEMORY_FRACTION * min(limits) - share
        if budget <= 0:
            return None
        devices = [SimpleNamespace(memory_limit=budget / MEMORY_FRACTION)] * n
        try:
            plan = ExecutePlan.auto("infer", SimpleNamespace(layers=layers, devices=devices),
                                    num_microbatch=num_microbatch)
        except PlanError:
            return None
        exe, base, caches = _decode(steps, num_microbatch, plan)
        held = max(p.bytes["cache"] for p in
                   _with_cache(base, exe, caches, {s for s in caches if caches[s]}).stages)
        if held <= share:
            return plan
        share = held
    return None


def prefill_chunk(steps: Any, prompt: int, num_microbatch: int = 1) -> int:
    """The most prompt tokens one prefill call of ``steps`` takes: the whole ``prompt``
    where no device has a ``memory_limit`` or its predicted peak stays within
    ``AUTO_HEADROOM`` of every limit; else ``prompt`` is halved (rounded up) until a
    chunk fits, and the chunk is then bisected up to ``REFINE`` times towards the
    smallest length that did not; at least 1. Each length is predicted with the graph a
    call of that length runs (captured now if none serves it: the call would capture it)
    and its plan, the layers costed again on fake tensors of its first microbatch
    (:func:`_step_memory`)."""
    limits = [d.memory_limit for d in steps.pipe.devices]
    if all(limit is None for limit in limits):
        return prompt

    def fits(chunk: int) -> bool:
        example = steps.module.example(chunk)
        compiled = steps.pipe._compiled_for(example, {})
        exe = steps.pipe._executable("infer", num_microbatch, compiled=compiled)
        return _fits(program_peaks(exe.program, _step_memory(compiled.layers, example,
                                                              num_microbatch)),
                     limits, AUTO_HEADROOM)

    if fits(prompt):
        return prompt
    over, chunk = prompt, -(-prompt // 2)   # over: the shortest length known not to fit
    while chunk > 1 and not fits(chunk):
        over, chunk = chunk, -(-chunk // 2)
    if chunk <= 1:
        return 1
    for _ in range(REFINE):
        mid = (chunk + over) // 2
        if mid <= chunk:
            break
        chunk, over = (mid, over) if fits(mid) else (chunk, mid)
    return chunk


REFINE = 3
"""Bisection steps ``prefill_chunk`` takes between the halved chunk that fits and the
one that did not (each a costing of the prefill on fake tensors)."""


def _decode(steps: Any, num_microbatch: int, plan: ExecutePlan | None):
    """The decode step's Executable under ``plan`` (``None``: the step pipe's), its
    prediction with every cache streamed, and each stage's caches."""
    exe = steps.pipe._executable("infer", num_microbatch, compiled=steps.compiled()[1], plan=plan)
    caches = {s: cache_tensors(steps, st) for s, st in exe.stages.items()}
    return exe, _decode_prediction(steps, exe), caches


def _step_memory(lg: Any, example: Any, num_microbatch: int) -> ChainMemory:
    """A step graph's memory for the first of ``num_microbatch`` microbatches of
    ``example`` (``input_ids, attention_mask, position_ids, cache_position``), its layers
    costed again on fake tensors: the rows ``generation.split_spec()`` gives it, the cache
    positions whole. A graph the capture specialized on the whole batch (export may tie
    the batch to a cache dimension of the same size; the runtime serves each microbatch
    its rows of the cache, the costing cannot) is costed for the whole batch, an upper
    bound."""
    ids, mask, positions, cache_position = example
    rows = -(-ids.shape[0] // num_microbatch)
    flat = [ids[:rows], mask[:rows], positions[:rows], cache_position]
    if static_dim_problem(lg, flat) is not None:
        flat = list(example)
    return ChainMemory.of(compute_costs(lg, flat, store=False), tensor_bytes(flat))


def _fits(peaks: Any, limits: list[int | None], share: float) -> bool:
    """Whether every stage peak stays within ``share`` of its device's limit (if any)."""
    return all(limits[p.device] is None or p.total <= share * limits[p.device] for p in peaks)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _decode_prediction(steps: Any, exe: Any) -> MemoryPrediction:
    """The decode step's predicted memory with every cache streamed (``kv_cache="host"``),
    over the Program ``exe`` runs: each stage's cache in its ``params``, with its weights,
    and activations costed for one microbatch of the Program's (:func:`_step_memory`)."""
    lg = steps.compiled()[1].layers
    peaks = program_peaks(exe.program, _step_memory(lg, lg.example_leaves,
                                                    exe.program.num_microbatches))
    limits = [d.memory_limit for d in steps.pipe.devices if d.memory_limit]
    return MemoryPrediction(peaks, device_peaks(peaks, len(steps.pipe.devices)),
                            min(limits) if limits else None)


def _with_cache(pred: Any, exe: Any, caches: dict[int, list[torch.Tensor]],
                resident: set[int]) -> MemoryPrediction:
    """``pred`` (every cache streamed) with the caches of ``resident`` stages kept on their
    devices: out of the ``params`` of their stage and of the stage prefetched meanwhile,
    into every stage's ``"cache"`` on that device."""
    nbytes = {s: sum(_nbytes(t) for t in ts) for s, ts in caches.items()}
    by_layers = {(st.layers.start, st.layers.stop): s for s, st in exe.stages.items()}
    held: dict[int, int] = {}
    for p in pred.stages:
        if p.stage in resident:
            held[p.device] = held.get(p.device, 0) + nbytes[p.stage]
    stages = []
    for p in pred.stages:
        nxt = by_layers.get((p.prefetch.start, p.prefetch.stop)) if p.prefetch else None
        out = sum(nbytes[s] for s in (p.stage, nxt) if s is not None and s in resident)
        stages.append(dataclasses.replace(p, bytes={**p.bytes, "params": p.bytes["params"] - out,
                                                    "cache": held.get(p.device, 0)}))
    return dataclasses.replace(pred, stages=stages,
                               devices=device_peaks(stages, len(pred.devices)))
