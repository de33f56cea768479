"""ExecutePlan: which layers form each forward stage and each backward stage.

``fwd_plan`` lists forward stages shallow to deep, ``bwd_plan`` backward stages deep to
shallow; each stage is a ``range`` of layer indices. Forward and backward are planned
independently (backward is about 2-3x forward, so backward stages hold fewer layers).
For ``"fused"`` (``forward_backward``) the first backward stage also runs the forward of
its layers and the loss, so those tail layers are not in ``fwd_plan``.

>>> plan = ExecutePlan([range(0, 3)], [range(3, 4), range(2, 3), range(0, 2)])
>>> plan
ExecutePlan(fwd=[0:3], bwd=[3:4, 2:3, 0:2])
>>> plan.validate(4, "fused")
>>> ExecutePlan.default(3, "train")
ExecutePlan(fwd=[0:1, 1:2, 2:3], bwd=[2:3, 1:2, 0:1])

Memory: ``predict_memory`` gives each stage's predicted peak bytes on its device, by kind
(``fxpipe.passes.memory``); ``ExecutePlan.auto`` keeps every stage within the device
limit; ``max_sequence_length`` (``fxpipe.plan.seqlen``) finds the longest sequence a plan
fits.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.utils._pytree as pytree

from fxpipe.errors import PlanError
from fxpipe.passes import planner
from fxpipe.passes.costs import compute_costs
from fxpipe.passes.layer_graph import LayerGraph
from fxpipe.passes.memory import (KINDS, ChainMemory, StagePeak, device_peaks, human_bytes,
                                  program_peaks)
from fxpipe.passes.schedule import build_program

RunType = Literal["infer", "train", "fused"]
_RUN_TYPES = ("infer", "train", "fused")
MEMORY_FRACTION = 0.9
"""The share of the smallest device's ``memory_limit`` a plan may use at its predicted
peak by default; the rest covers the prediction's error and allocator fragmentation."""


def _fmt(r: range) -> str:
    return f"{r.start}:{r.stop}" if r.step == 1 else f"{r.start}:{r.stop}:{r.step}"


def _check_run_type(run_type: str) -> None:
    if run_type not in _RUN_TYPES:
        raise ValueError(f"run_type must be one of {_RUN_TYPES}, got {run_type!r}")


def _layers(a: int, b: int) -> str:
    """Human text for layers a..b-1."""
    return f"layer {a}" if b - a == 1 else f"layers {a}..{b - 1}"


@dataclass
class ExecutePlan:
    """Forward and backward stage ranges (see the module docstring)."""

    fwd_plan: list[range] = field(default_factory=list)
    bwd_plan: list[range] = field(default_factory=list)

    def __post_init__(self) -> None:
        for name in ("fwd_plan", "bwd_plan"):
            value = getattr(self, name)
            if isinstance(value, range) or not isinstance(value, Iterable):
                raise PlanError(f"{name} must be a list of range objects, got {value!r}")
            setattr(self, name, list(value))

    def __repr__(self) -> str:
        fwd = ", ".join(_fmt(r) if isinstance(r, range) else repr(r) for r in self.fwd_plan)
        bwd = ", ".join(_fmt(r) if isinstance(r, range) else repr(r) for r in self.bwd_plan)
        return f"ExecutePlan(fwd=[{fwd}], bwd=[{bwd}])"

    # --- validation --------------------------------------------------------------------

    def validate(self, num_layers: int, run_type: RunType) -> None:
        """Raise ``PlanError`` naming the offending range and the rule it breaks.

        Rules: every range is a non-empty, step-1 range inside ``0 .. num_layers-1``;
        forward ranges cover ``0 .. L-1`` exactly once in ascending order (``"fused"``:
        ``0 .. bwd_plan[0].start-1``, so ``fwd_plan[-1].stop == bwd_plan[0].start``);
        backward ranges (``"train"``, ``"fused"``) cover ``0 .. L-1`` exactly once in
        descending order. ``"infer"`` ignores ``bwd_plan``.

        >>> ExecutePlan([range(0, 2)], []).validate(3, "infer")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        fxpipe.errors.PlanError: fwd_plan: forward ranges must cover layers 0..2 ...
        """
        _check_run_type(run_type)
        if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
            raise ValueError(f"num_layers must be an int >= 1, got {num_layers!r}")
        L = num_layers
        _check_ranges("fwd_plan", self.fwd_plan, L)
        if run_type == "infer":
            _check_chain("fwd_plan", self.fwd_plan, 0, L, ascending=True,
                         rule=f"forward ranges must cover layers 0..{L - 1} exactly once "
                              f"in ascending order")
            return
        _check_ranges("bwd_plan", self.bwd_plan, L)
        _check_chain("bwd_plan", self.bwd_plan, 0, L, ascending=False,
                     rule=f"backward ranges must cover layers 0..{L - 1} exactly once in "
                          f"descending order (deep to shallow)")
        if run_type == "train":
            _check_chain("fwd_plan", self.fwd_plan, 0, L, ascending=True,
                         rule=f"forward ranges must cover layers 0..{L - 1} exactly once "
                              f"in ascending order")
            return
        tail = self.bwd_plan[0]
        _check_chain("fwd_plan", self.fwd_plan, 0, tail.start, ascending=True,
                     rule=f"for \"fused\", forward ranges must cover layers "
                          f"0..{tail.start - 1} exactly once in ascending order and "
                          f"fwd_plan[-1].stop must equal bwd_plan[0].start = {tail.start} "
                          f"(the tail {_layers(tail.start, tail.stop)} runs only in the fused "
                          f"first backward stage bwd_plan[0] = {_fmt(tail)})")

    # --- constructors ------------------------------------------------------------------

    @classmethod
    def default(cls, num_layers: int, run_type: RunType) -> ExecutePlan:
        """One layer per stage; for ``"fused"`` the tail (first backward stage) is the last
        layer. ``"infer"`` gets no ``bwd_plan``.

        >>> ExecutePlan.default(3, "fused")
        ExecutePlan(fwd=[0:1, 1:2], bwd=[2:3, 1:2, 0:1])
        """
        _check_run_type(run_type)
        if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
            raise ValueError(f"num_layers must be an int >= 1, got {num_layers!r}")
        fwd_stop = num_layers - 1 if run_type == "fused" else num_layers
        fwd = [range(i, i + 1) for i in range(fwd_stop)]
        bwd = [] if run_type == "infer" else [range(i, i + 1) for i in reversed(range(num_layers))]
        return cls(fwd, bwd)

    @classmethod
    def auto(cls, run_type: RunType, *pipes: Any, min_stages: int | None = None,
             upper_threshold: float = 1.1, model_memory_limit: float | None = None,
             num_devices: int | None = None, num_microbatch: int | None = None,
             recompute_grain: Literal["stage", "layer"] = "stage") -> ExecutePlan | list[ExecutePlan]:
        """Plan stages from per-layer costs (see ``fxpipe.passes.planner.plan_chains``).

        A pipe has ``.layers`` (a ``LayerGraph``, or items with ``.cost``), ``.devices``
        (items with an optional ``.memory_limit`` in bytes) and optionally ``.timings``
        (a ``LayerTimer``: measured times replace the estimates, see :func:`layer_costs`)
        and ``.config`` (a ``RunConfig``: its ``split_input``).

        Memory: every stage's predicted peak on its device (:func:`predict_memory`: its
        parameters and those of the stage its device prefetches meanwhile, gradients,
        activations, saved tensors and workspace, for one microbatch of
        ``num_microbatch``, default devices + 1, at ``recompute_grain``) fits
        ``model_memory_limit`` GB (2**30 bytes; default ``MEMORY_FRACTION`` = 90% of the
        smallest device limit, no limit when no device has one). A pipe whose ``layers``
        is a ``LayerGraph`` is costed again on fake tensors shaped like one microbatch;
        other costs are taken as one microbatch's.

        ``min_stages`` defaults to the number of devices (a hint: a short model may get
        fewer). ``upper_threshold`` bounds the granularity: no more stages than needed to
        keep every stage within ``upper_threshold`` x the best achievable bottleneck
        (about the slowest layer); the bottleneck itself is always the exact optimum for
        the chosen stage count. Several pipes share one bottleneck. Returns one plan for
        one pipe, a list for several.
        """
        _check_run_type(run_type)
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
                raise ValueError(f"model_memory_limit must be > 0 GB, got {model_memory_limit}")
            limit = model_memory_limit * 2**30
        M = num_microbatch or num_devices + 1
        cost_lists = [layer_costs(p) for p in pipes]
        for k, costs in enumerate(cost_lists):
            for i, cost in enumerate(costs):
                if cost is None:
                    raise PlanError(f"pipe {k} layer {i} has no cost; run the cost pass "
                                    f"(fxpipe.passes.costs) before ExecutePlan.auto")
        chains = planner.chain_costs(cost_lists, need_backward=run_type != "infer")
        memory = None if limit is None else [chain_memory(p, M) for p in pipes]
        planned = planner.plan_chains(run_type, chains, num_devices=num_devices, num_microbatch=M,
                                      min_stages=min_stages, upper_threshold=upper_threshold,
                                      memory=memory, memory_limit=limit,
                                      recompute_grain=recompute_grain)
        plans = [cls(fwd, bwd) for fwd, bwd in planned]
        for plan, costs in zip(plans, cost_lists):
            plan.validate(len(costs), run_type)
        return plans[0] if len(plans) == 1 else plans


def layer_costs(pipe: Any) -> list[Any]:
    """A pipe's per-layer costs as the planner and simulator read them: the layers'
    ``cost`` with the times measured so far (``pipe.timings``, when it has them)."""
    layers = list(pipe.layers)
    timings = getattr(pipe, "timings", None)
    if timings is not None:
        return timings.costs(layers)
    return [getattr(layer, "cost", None) for layer in layers]


def chain_memory(pipe: Any, num_microbatch: int = 1, *,
                 loss: tuple[Callable[[Any, Any], Any], Any] | None = None) -> ChainMemory:
    """A pipe's (or ``LayerGraph``'s) memory for one microbatch, the first and largest of
    ``num_microbatch``: its layers costed again on fake tensors shaped like it (split as
    ``pipe.config.split_input`` says). ``loss=(loss_fn, label)``: also cost the loss on
    that microbatch's share of ``label``. Other pipes' layer costs are taken as one
    microbatch's."""
    from fxpipe.runtime.microbatch import split_input, split_label

    lg = pipe if isinstance(pipe, LayerGraph) else getattr(pipe, "layers", None)
    if not (isinstance(lg, LayerGraph) and lg.example_leaves):
        return ChainMemory.of(layer_costs(pipe))
    args, kwargs = pytree.tree_unflatten(lg.example_leaves, lg.in_spec)
    if loss is not None and num_microbatch > 1:
        loss = loss[0], split_label(loss[1], num_microbatch)[0]
    if num_microbatch > 1:
        spec = getattr(getattr(pipe, "config", None), "split_input", None)
        args, kwargs = (x[0] for x in split_input(args, kwargs, num_microbatch, spec))
    flat = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
    costs = compute_costs(lg, flat, store=False, loss=loss)
    return ChainMemory.of(costs, sum(x.numel() * x.element_size() for x in flat))


@dataclass(frozen=True)
class MemoryPrediction:
    """What :func:`predict_memory` returns: every stage's predicted peak
    (``fxpipe.passes.memory.StagePeak``: bytes by kind, device, the layer at the peak),
    and per device the stage with the highest (``None``: a device with no stage).
    ``limit``: the smallest device limit, if any."""

    stages: list[StagePeak]
    devices: list[StagePeak | None]
    limit: int | None = None

    @property
    def peak(self) -> int:
        """The highest predicted peak of any device."""
        return max((p.total for p in self.stages), default=0)

    def by_device(self) -> list[dict[str, int]]:
        """Per device, its peak's bytes by kind (all zero for a device with no stage)."""
        return [dict(p.bytes) if p is not None else dict.fromkeys(KINDS, 0) for p in self.devices]

    def __str__(self) -> str:
        head = "stage kind   layers  dev  " + "  ".join(f"{k:>11}" for k in KINDS) + "        total"
        rows = [head]
        for p in self.stages:
            rows.append(f"{p.stage:>5} {p.kind:<6} {p.layers.start:>3}:{p.layers.stop:<3} {p.device:>4}  "
                        + "  ".join(f"{human_bytes(p.bytes[k]):>11}" for k in KINDS)
                        + f"  {human_bytes(p.total):>11}")
        limit = f" of {human_bytes(self.limit)}" if self.limit else ""
        rows.append(f"peak {human_bytes(self.peak)}{limit}: "
                    + ", ".join(f"device {d} {human_bytes(p.total) if p else '0 B'}"
                                for d, p in enumerate(self.devices)))
        return "\n".join(rows)


def predict_memory(pipe: Any, plan: ExecutePlan | None = None, *, run_type: RunType | None = None,
                   num_microbatch: int | None = None,
                   grain: Literal["stage", "layer"] | None = None, num_devices: int | None = None,
                   loss_fn: Callable[[Any, Any], Any] | None = None,
                   label: Any = None) -> MemoryPrediction:
    """Predicted peak device bytes of every stage of a call, before running it.

    ``pipe``: a ``PipelineModule`` (its plan, devices, ``num_microbatch`` and
    ``recompute_grain`` are the defaults) or a ``LayerGraph`` (give ``plan`` and
    ``num_devices``). ``run_type`` defaults to what ``plan`` runs (``"fused"`` when its
    forward stops before the tail). Each stage's peak counts, for one microbatch
    (costed on fake tensors shaped like it), its parameters and those of the stage its
    device prefetches meanwhile, its gradients, its activations, the tensors saved for
    backward and the workspace at its peak (``fxpipe.passes.memory``). ``loss_fn`` and
    ``label`` (the whole batch's): cost the loss the fused tail runs; without them it
    counts as a cross-entropy over the model's output (``LOSS_FACTOR`` x its bytes).

    >>> import torch, fxpipe
    >>> model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])
    >>> pipe = fxpipe.compile(model, example_inputs=(torch.randn(64, 256),), devices=["cpu"] * 2)
    >>> print(fxpipe.plan.predict_memory(pipe, num_microbatch=2))
    stage kind   layers  dev       params    gradients  activations        saved    workspace        total
        0 fwd      0:1      0       526 kB          0 B      98.3 kB          0 B      32.8 kB       657 kB
        1 fwd      1:3      1       790 kB          0 B      98.3 kB          0 B      65.5 kB       953 kB
        2 fused    3:4      0       526 kB       263 kB      98.3 kB      32.8 kB       329 kB      1.25 MB
        3 bwd      2:3      1       526 kB       263 kB       164 kB      32.8 kB       296 kB      1.28 MB
        4 bwd      1:2      0       263 kB       263 kB       164 kB      32.8 kB       296 kB      1.02 MB
        5 bwd      0:1      1       263 kB       263 kB       131 kB      32.8 kB       263 kB       953 kB
    peak 1.28 MB: device 0 1.25 MB, device 1 1.28 MB
    """
    lg = pipe if isinstance(pipe, LayerGraph) else pipe.layers
    devices = list(getattr(pipe, "devices", None) or [])
    config = getattr(pipe, "config", None)
    plan = plan or getattr(pipe, "plan", None)
    if plan is None:
        raise ValueError("predict_memory(layer_graph, ...) needs plan=ExecutePlan(...)")
    G = num_devices or len(devices)
    if G < 1:
        raise ValueError("predict_memory: no devices; pass num_devices=")
    M = num_microbatch or getattr(config, "num_microbatch", None) or G + 1
    grain = grain or getattr(config, "recompute_grain", None) or "stage"
    if run_type is None:
        covered = plan.fwd_plan[-1].stop if plan.fwd_plan else 0
        run_type = "infer" if not plan.bwd_plan else "fused" if covered < len(lg) else "train"
    plan.validate(len(lg), run_type)
    memory = chain_memory(pipe, M, loss=None if loss_fn is None else (loss_fn, label))
    program = build_program(plan.fwd_plan, plan.bwd_plan, run_type, G, M, "stage", grain=grain)
    peaks = program_peaks(program, memory)
    limits = [d.memory_limit for d in devices if getattr(d, "memory_limit", None)]
    return MemoryPrediction(peaks, device_peaks(peaks, G), min(limits) if limits else None)


def _check_ranges(name: str, ranges: Sequence[Any], num_layers: int) -> None:
    for i, r in enumerate(ranges):
        where = f"{name}[{i}]"
        if not isinstance(r, range):
            raise PlanError(f"{where} = {r!r}: every stage must be a range of layer indices")
        if r.step != 1:
            raise PlanError(f"{where} = {r!r}: a stage must be a contiguous range (step 1)")
        if r.start >= r.stop:
            raise PlanError(f"{where} = {r!r}: a stage must be non-empty (start < stop)")
        if r.start < 0 or r.stop > num_layers:
            raise PlanError(f"{where} = {r!r}: layers must be in 0..{num_layers - 1} "
                            f"(the model has {num_layers} layers)")


def _check_chain(name: str, ranges: Sequence[range], lo: int, hi: int, *, ascending: bool,
                 rule: str) -> None:
    """``ranges`` must tile ``lo .. hi-1`` exactly once, listed ascending or descending."""
    if not ranges:
        if hi > lo:
            raise PlanError(f"{name}: {rule}; the plan is empty, so {_layers(lo, hi)} "
                            f"not covered")
        return
    tagged = sorted(enumerate(ranges), key=lambda ir: (ir[1].start, ir[1].stop))
    where = [f"{name}[{i}] = {_fmt(r)}" for i, r in tagged]
    (_, first), (_, last) = tagged[0], tagged[-1]
    if first.start < lo:
        raise PlanError(f"{name}: {rule}; {where[0]} includes {_layers(first.start, lo)}, "
                        f"which must not be in {name}")
    if first.start > lo:
        raise PlanError(f"{name}: {rule}; {_layers(lo, first.start)} not covered by "
                        f"any range")
    for k in range(1, len(tagged)):
        prev, cur = tagged[k - 1][1], tagged[k][1]
        if cur.start < prev.stop:
            raise PlanError(f"{name}: {rule}; {where[k - 1]} and {where[k]} overlap: "
                            f"{_layers(cur.start, min(prev.stop, cur.stop))} covered twice")
        if cur.start > prev.stop:
            raise PlanError(f"{name}: {rule}; {_layers(prev.stop, cur.start)} not "
                            f"covered (gap between {where[k - 1]} and {where[k]})")
    if last.stop > hi:
        raise PlanError(f"{name}: {rule}; {where[-1]} includes {_layers(hi, last.stop)}, "
                        f"which must not be in {name}")
    if last.stop < hi:
        raise PlanError(f"{name}: {rule}; {_layers(last.stop, hi)} not covered by "
                        f"any range")
    for i in range(1, len(ranges)):
        a, b = ranges[i - 1], ranges[i]
        if (a.start > b.start) if ascending else (a.start < b.start):
            word = "ascending (shallow to deep)" if ascending else "descending (deep to shallow)"
            raise PlanError(f"{name}: {rule}; {name}[{i - 1}] = {_fmt(a)} comes before "
                            f"{name}[{i}] = {_fmt(b)}: ranges must be listed in {word} order")
