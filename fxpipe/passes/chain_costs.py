"""What the planner plans over and how it scores a plan: per-layer cost vectors
(``ChainCosts``, from the layers' ``Cost`` values by ``chain_costs``), the device model that
prices a layer without measured times (``NominalDevice``), the host's cost of issuing a
stage's actions, and the makespan estimate that ranks candidate plans
(``estimate_makespan``).

Not to be confused with ``fxpipe.passes.costs``, which measures each layer (its
``Cost``: bytes, FLOPs, times); this module turns those into the vectors the search in
``fxpipe.passes.planner`` packs, and into the time a plan is expected to take. Pure
functions over floats: no modules, no tensors.

>>> c = ChainCosts.from_times([1.0, 2.0])
>>> c.bwd_ms, c.recompute_ms
((2.0, 4.0), (1.0, 2.0))
>>> estimate_makespan([c.fwd_ms[0] + c.fwd_ms[1]], num_devices=1, num_microbatch=4)
3.0
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

INF = math.inf


@dataclass(frozen=True)
class NominalDevice:
    """The device model used when a layer has no measured times: a 24 GB consumer GPU
    running bf16 matmuls at a sustained 50 TFLOP/s with 800 GB/s of memory bandwidth, plus
    a fixed per-layer launch overhead. A layer's time is ``max(flops / flops_per_s,
    bytes / bytes_per_s) + layer_overhead_ms``.

    The host side, for what a plan leaves exposed (``fxpipe.passes.planner``'s tail):
    ``link_bytes_per_s``, a PCIe 4.0 x16 link each way; ``host_grad_bytes_per_s``, the
    gradient bytes (device dtype) the host takes in per second: widened into the fp32
    buffer and stepped by a streamed AdamW (``torch.optim.AdamW(fused=True)`` ran 5.1 GB/s
    of fp32 parameters on a 2-core VM, ``host_rates`` in
    ``benchmarks/results/bench_finetune.json``: 2.5 GB/s of bf16 gradients)."""

    flops_per_s: float = 50e12
    bytes_per_s: float = 800e9
    layer_overhead_ms: float = 0.02
    link_bytes_per_s: float = 25e9
    host_grad_bytes_per_s: float = 2.5e9

    def ms(self, flops: float, nbytes: float) -> float:
        return max(flops / self.flops_per_s, nbytes / self.bytes_per_s) * 1e3 + self.layer_overhead_ms


NOMINAL_DEVICE = NominalDevice()

HOST_MS_PER_ACTION = float(os.environ.get("FXPIPE_HOST_MS_PER_ACTION", 0.05))
"""The host time one action costs to issue, by default (``ExecutePlan.auto``): 0.05 ms,
``benchmarks/bench_issue.py``'s figure around an empty stage on a 2-vCPU VM (40-45 us,
``action_us``); the environment variable ``FXPIPE_HOST_MS_PER_ACTION`` sets it (``0``:
plan as if issuing were free)."""
ACTIONS_PER_MICROBATCH = 4
"""The actions a stage issues per microbatch (upload, compute, offload, free; prefetch
and release once per stage job)."""


@dataclass(frozen=True)
class ChainCosts:
    """Per-layer cost vectors of one chain (index = layer). ``act_bytes`` is saved-for-
    backward + boundary bytes (backward stages); ``fwd_act_bytes`` (default ``act_bytes``)
    is what a forward stage holds.

    >>> len(ChainCosts.from_times([1.0, 2.0]))
    2
    """

    fwd_ms: Sequence[float]
    recompute_ms: Sequence[float]
    bwd_ms: Sequence[float]
    param_bytes: Sequence[float]
    grad_bytes: Sequence[float]
    act_bytes: Sequence[float]
    fwd_act_bytes: Sequence[float] | None = None

    def __post_init__(self) -> None:
        n = len(self.fwd_ms)
        if n < 1:
            raise ValueError("ChainCosts: a chain needs at least one layer")
        for f in dataclasses.fields(self):
            raw = getattr(self, f.name)
            if raw is None:
                continue
            v = tuple(float(x) for x in raw)
            if len(v) != n:
                raise ValueError(f"ChainCosts.{f.name} has {len(v)} entries but fwd_ms has {n}")
            bad = next((i for i, x in enumerate(v) if not 0.0 <= x < INF), None)
            if bad is not None:
                raise ValueError(f"ChainCosts.{f.name}[{bad}] = {v[bad]}: must be finite, >= 0")
            object.__setattr__(self, f.name, v)

    def __len__(self) -> int:
        return len(self.fwd_ms)

    @classmethod
    def from_times(cls, fwd_ms: Sequence[float], bwd_ms: Sequence[float] | None = None,
                   recompute_ms: Sequence[float] | None = None,
                   param_bytes: Sequence[float] | None = None,
                   grad_bytes: Sequence[float] | None = None,
                   act_bytes: Sequence[float] | None = None) -> ChainCosts:
        """Defaults: backward = 2x forward, recompute = forward, bytes = 0, grads = params."""
        zeros = [0.0] * len(fwd_ms)
        return cls(fwd_ms, recompute_ms if recompute_ms is not None else fwd_ms,
                   bwd_ms if bwd_ms is not None else [2.0 * t for t in fwd_ms],
                   param_bytes or zeros, grad_bytes or param_bytes or zeros, act_bytes or zeros)


def chain_costs(cost_lists: Sequence[Sequence[Any]], device: NominalDevice = NOMINAL_DEVICE,
                need_backward: bool = True) -> list[ChainCosts]:
    """``ChainCosts`` from per-layer ``Cost`` objects (fields ``param_bytes, grad_bytes,
    saved_bytes, boundary_bytes, fwd_flops, bwd_flops, fwd_ms, recompute_ms, bwd_ms``;
    an optional ``buffer_bytes`` counts with the parameters).

    Measured times are used only when every layer of every chain has them (forward, and
    backward when ``need_backward``; a missing recompute falls back to the forward
    time), so all stages compare in one unit; otherwise all times are estimated with
    ``device``.
    """
    flat = [c for costs in cost_lists for c in costs]
    has = lambda name: all(getattr(c, name, None) is not None for c in flat)  # noqa: E731
    measured = has("fwd_ms") and (has("bwd_ms") or not need_backward)
    has_rec = has("recompute_ms")
    out = []
    for costs in cost_lists:
        g = lambda c, name: float(getattr(c, name, None) or 0.0)  # noqa: E731
        p = [g(c, "param_bytes") + g(c, "buffer_bytes") for c in costs]  # both go to the device
        gr = [g(c, "grad_bytes") for c in costs]
        sv = [g(c, "saved_bytes") for c in costs]
        bd = [g(c, "boundary_bytes") for c in costs]
        if measured:
            f = [g(c, "fwd_ms") for c in costs]
            r = [g(c, "recompute_ms") for c in costs] if has_rec else f
            b = [g(c, "bwd_ms") for c in costs]
        else:
            ff = [g(c, "fwd_flops") for c in costs]
            bf = [g(c, "bwd_flops") or 2.0 * x for c, x in zip(costs, ff)]
            # a dequantize (fxpipe.quant) is a kernel of its own: its traffic adds
            f = [device.ms(x, p[i] + sv[i] + bd[i]) + g(costs[i], "dequant_bytes")
                 / device.bytes_per_s * 1e3 for i, x in enumerate(ff)]
            r = f
            b = [device.ms(x, p[i] + gr[i] + sv[i] + 2 * bd[i]) for i, x in enumerate(bf)]
        out.append(ChainCosts(f, r, b, p, gr, [s + x for s, x in zip(sv, bd)], bd))
    return out


def estimate_makespan(stage_ms: Sequence[float], num_devices: int, num_microbatch: int,
                      host_ms: float = 0.0) -> float:
    """Round-robin makespan estimate for stage jobs run in order (stage s on device s mod G).

    Each device runs its stages back to back, so its busy time is the sum of its stage
    times; the pipeline wave adds (G-1) microbatch slots of the slowest stage for fill
    and drain; with fewer microbatches than devices a round cannot beat the wave, so busy
    time is stretched by G/M. ``max_d busy_d * max(1, G/M) + (G-1) * max_s T_s / M``.
    ``host_ms``: the host time each stage costs to issue (per microbatch, as ``stage_ms``):
    it adds to each stage's time, and one host issues every stage, so the estimate is at
    least their sum.

    >>> estimate_makespan([4, 4, 4, 4], num_devices=2, num_microbatch=4)
    9.0
    """
    G, M = num_devices, num_microbatch
    if not stage_ms:
        return 0.0
    stage_ms = [t + host_ms for t in stage_ms]
    busy = [0.0] * G
    for s, t in enumerate(stage_ms):
        busy[s % G] += t
    devices = max(busy) * max(1.0, G / M) + (G - 1) * max(stage_ms) / M
    return max(devices, len(stage_ms) * host_ms)
