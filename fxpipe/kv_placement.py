"""Where a generation's decode step keeps each stage's KV cache (``pipe.generate(kv_cache=)``).

``place_cache`` decides it from the decode step's predicted memory
(``fxpipe.memory_prediction``): with every cache streamed with its stage's weights
(``"host"``), each stage's peak counts its cache and the one of the stage its device
prefetches meanwhile in ``params``; keeping a stage's cache resident moves those bytes
out of ``params`` and into a ``"cache"`` share that every stage on that device carries
for the whole call. ``"device"`` keeps them all (or refuses with the numbers), ``"auto"``
what fits under ``AUTO_HEADROOM`` of each device's limit. ``predict_memory(run_type=
"generate", kv_cache=...)`` is the placement's prediction; the runtime holds the chosen
caches in a ``runtime.scratch.ResidentBuffers``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from fxpipe.errors import DeviceMemoryError
from fxpipe.generation import KV_CACHE, cache_tensors
from fxpipe.memory_prediction import MemoryPrediction, chain_memory
from fxpipe.passes.stage_memory import device_peaks, human_bytes, program_peaks

__all__ = ["AUTO_HEADROOM", "CachePlacement", "place_cache"]

AUTO_HEADROOM = 0.9
"""``kv_cache="auto"`` keeps caches on a device while its predicted decode peak stays
within this share of its ``memory_limit`` (the rest of it: the allocator's rounding and
fragmentation, which the prediction does not see)."""


@dataclass(frozen=True)
class CachePlacement:
    """Where a decode step keeps each stage's KV cache: ``resident``, the decode stages
    whose cache stays on their device for the whole ``generate`` call (the others stream
    in with their weights each step); ``kept``, the ids of those caches' host tensors
    (what ``runtime.scratch.ResidentBuffers`` holds); ``prediction``, the decode step's
    predicted memory with it (``fxpipe.plan.predict_memory``; each stage's ``"cache"``
    bytes: what its device keeps resident for all its stages)."""

    kv_cache: str
    resident: frozenset[int]
    kept: frozenset[int]
    prediction: MemoryPrediction


def place_cache(steps: Any, kv_cache: str, num_microbatch: int = 1) -> CachePlacement:
    """Place the decode step's KV caches: ``"host"`` none resident, ``"device"`` all (or a
    ``DeviceMemoryError`` with the numbers, before anything runs), ``"auto"`` per device,
    in its stages' order, each stage's cache while the device's predicted peak stays
    within ``AUTO_HEADROOM`` of its ``memory_limit`` (no limit: all)."""
    if kv_cache not in KV_CACHE:
        raise ValueError(f"kv_cache must be one of {KV_CACHE}, got {kv_cache!r}")
    _, decode = steps.compiled()
    exe = steps.pipe._executable("infer", num_microbatch, compiled=decode)
    base = _decode_prediction(steps, exe)
    caches = {s: cache_tensors(steps, st) for s, st in exe.stages.items()}
    cached = [s for s in caches if caches[s]]
    limits = [d.memory_limit for d in steps.pipe.devices]
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
    return CachePlacement(kv_cache, frozenset(resident), kept, prediction)


def _decode_prediction(steps: Any, exe: Any) -> MemoryPrediction:
    """The decode step's predicted memory with every cache streamed (``kv_cache="host"``),
    over the Program ``exe`` runs: each stage's cache in its ``params``, with its weights.
    Activations are costed for the whole batch (an upper bound when it is split into
    microbatches)."""
    peaks = program_peaks(exe.program, chain_memory(steps.compiled()[1].layers))
    limits = [d.memory_limit for d in steps.pipe.devices if d.memory_limit]
    return MemoryPrediction(peaks, device_peaks(peaks, len(steps.pipe.devices)),
                            min(limits) if limits else None)


def _with_cache(pred: Any, exe: Any, caches: dict[int, list[torch.Tensor]],
                resident: set[int]) -> MemoryPrediction:
    """``pred`` (every cache streamed) with the caches of ``resident`` stages kept on their
    devices: out of the ``params`` of their stage and of the stage prefetched meanwhile,
    into every stage's ``"cache"`` on that device."""
    nbytes = {s: sum(t.numel() * t.element_size() for t in ts) for s, ts in caches.items()}
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
