"""The stage plan as plain data: which layers form each forward and each backward stage.

``fwd_plan`` lists forward stages shallow to deep, ``bwd_plan`` backward stages deep to
shallow; each stage is a ``range`` of layer indices. Forward and backward are planned
independently (backward is about 2-3x forward, so backward stages hold fewer layers).
For ``"fused"`` (``forward_backward``) the first backward stage also runs the forward of
its layers and the loss, so those tail layers are not in ``fwd_plan``.

>>> plan = StagePlan([range(0, 3)], [range(3, 4), range(2, 3), range(0, 2)])
>>> plan
StagePlan(fwd=[0:3], bwd=[3:4, 2:3, 0:2])
>>> plan.validate(4, "fused")
>>> StagePlan.default(3, "train")
StagePlan(fwd=[0:1, 1:2, 2:3], bwd=[2:3, 1:2, 0:1])

A leaf: it imports nothing of fxpipe but ``fxpipe.errors``, so the runtime, ``RunConfig``
and the passes read plans without loading the planner. ``RunType`` (the three kinds of
call) is defined here once.

Not to be confused with: ``fxpipe.plan``, the public module, whose ``fxpipe.ExecutePlan``
is a ``StagePlan`` that can also plan itself (``ExecutePlan.auto``); and
``fxpipe.passes.planner``, the planning algorithm over per-layer cost vectors. This
module plans nothing: it holds and validates the ranges.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from fxpipe.errors import PlanError

RunType = Literal["infer", "train", "fused"]
"""The three kinds of call: ``pipe(...)`` without grad (``"infer"``), with grad then
``loss.backward()`` (``"train"``), and ``forward_backward`` (``"fused"``)."""
RUN_TYPES: tuple[str, ...] = get_args(RunType)


def _fmt(r: range) -> str:
    return f"{r.start}:{r.stop}" if r.step == 1 else f"{r.start}:{r.stop}:{r.step}"


def check_run_type(run_type: str) -> None:
    if run_type not in RUN_TYPES:
        raise ValueError(f"run_type must be one of {RUN_TYPES}, got {run_type!r}")


def _layers(a: int, b: int) -> str:
    """Human text for layers a..b-1."""
    return f"layer {a}" if b - a == 1 else f"layers {a}..{b - 1}"


@dataclass
class StagePlan:
    """Forward and backward stage ranges (see the module docstring); ``fxpipe.ExecutePlan``
    is this plus the planner (``ExecutePlan.auto``)."""

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
        return f"{type(self).__name__}(fwd=[{fwd}], bwd=[{bwd}])"

    # --- validation --------------------------------------------------------------------

    def validate(self, num_layers: int, run_type: RunType) -> None:
        """Raise ``PlanError`` naming the offending range and the rule it breaks.

        Rules: every range is a non-empty, step-1 range inside ``0 .. num_layers-1``;
        forward ranges cover ``0 .. L-1`` exactly once in ascending order (``"fused"``:
        ``0 .. bwd_plan[0].start-1``, so ``fwd_plan[-1].stop == bwd_plan[0].start``);
        backward ranges (``"train"``, ``"fused"``) cover ``0 .. L-1`` exactly once in
        descending order. ``"infer"`` ignores ``bwd_plan``.

        >>> StagePlan([range(0, 2)], []).validate(3, "infer")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        fxpipe.errors.PlanError: fwd_plan: forward ranges must cover layers 0..2 ...
        """
        check_run_type(run_type)
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

    def recomputed(self, run_type: RunType) -> range:
        """The layers a call of ``run_type`` recomputes for backward: every layer for
        ``"train"``, none for ``"infer"``, and for ``"fused"`` those before the tail
        (``bwd_plan[0]`` runs forward and backward in one stage, its activations kept).

        >>> StagePlan([range(0, 3)], [range(3, 6), range(0, 3)]).recomputed("fused")
        range(0, 3)
        """
        check_run_type(run_type)
        if run_type == "infer" or not self.bwd_plan:
            return range(0)
        stop = max(r.stop for r in self.bwd_plan)
        return range(0, self.bwd_plan[0].start if run_type == "fused" else stop)

    # --- constructors ------------------------------------------------------------------

    @classmethod
    def default(cls, num_layers: int, run_type: RunType) -> StagePlan:
        """One layer per stage; for ``"fused"`` the tail (first backward stage) is the last
        layer. ``"infer"`` gets no ``bwd_plan``.

        >>> StagePlan.default(3, "fused")
        StagePlan(fwd=[0:1, 1:2], bwd=[2:3, 1:2, 0:1])
        """
        check_run_type(run_type)
        if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
            raise ValueError(f"num_layers must be an int >= 1, got {num_layers!r}")
        fwd_stop = num_layers - 1 if run_type == "fused" else num_layers
        fwd = [range(i, i + 1) for i in range(fwd_stop)]
        bwd = [] if run_type == "infer" else [range(i, i + 1) for i in reversed(range(num_layers))]
        return cls(fwd, bwd)


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
