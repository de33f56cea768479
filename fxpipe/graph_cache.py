"""The graphs a pipe has compiled, and which one serves a call.

A ``PipelineModule`` keeps one ``CompiledGraph`` per kind of call it has seen: the
training mode, the autocast state, the static dims a capture specialized and the values
of its non-tensor inputs (``find`` picks the one that fits, or says a new capture is
needed; at most ``MAX_CONSTANT_VARIANTS`` sets of non-tensor values). Each holds its
layer chain, its plan (planned at first use) and what was built for it: an
``Executable`` per (plan, ``CallSpec``), a ``Runner`` per plan (``plan_key``), the
measured layer times; and the same chain trimmed of the outputs no loss reads.

Not to be confused with ``fxpipe.runtime.stages.compiled``, which compiles a stage's layers
for a stage backend (inductor); this module caches whole captured chains.
``fxpipe.api`` (``fxpipe.compile``, ``PipelineModule``) builds them and calls them.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
import torch.utils._pytree as pytree

from fxpipe.passes import gc_paused
from fxpipe.passes.costs import compute_costs
from fxpipe.passes.executable import build_executable
from fxpipe.passes.grad_flow import grad_values
from fxpipe.passes.layer_graph import LayerGraph
from fxpipe.passes.partition import without_loss_free_outputs
from fxpipe.passes.program import CallSpec
from fxpipe.passes.stage import Executable
from fxpipe.plan import ExecutePlan
from fxpipe.runtime.stages import amp
from fxpipe.runtime.issue.inputs import (changed_constant, check_structure, same_constants,
                                   static_dim_problem)
from fxpipe.runtime.issue.microbatch import PackedData
from fxpipe.runtime.issue.pipeline import Runner
from fxpipe.runtime.stages.timer import LayerTimer
from fxpipe.verbose import is_verbose


@dataclass
class CompiledGraph:
    """Everything compiled for one (training mode, input signature): the layer chain, its
    auto (or the user's) plan, and every Executable built for it, cached by the kind of
    call (``executable``)."""

    layers: LayerGraph
    planner: Callable[[LayerGraph], ExecutePlan]   # the user's plan, or ExecutePlan.auto's
    device_names: list[str]
    runners: dict[tuple, Runner] = field(default_factory=dict)  # by plan_key of the plan
    executables: dict[tuple, Executable] = field(default_factory=dict)
    timer: LayerTimer = field(default_factory=LayerTimer)     # measured per-layer times
    # the chain whose outputs no loss reads are left out (passes.loss), and the one it
    # was made from (itself where nothing can be left out)
    base: CompiledGraph | None = None
    _trimmed: CompiledGraph | None = None
    _plan: ExecutePlan | None = None
    kept_outputs: bool = False   # a fused call's loss_fn read outputs the trimmed chain drops

    @property
    def plan(self) -> ExecutePlan:
        """The plan (planned at first use: a chain whose fused calls run trimmed is
        planned with its full outputs only when a call needs them)."""
        if self._plan is None:
            self._plan = self.planner(self.layers)
        return self._plan

    def trimmed(self, model: nn.Module) -> CompiledGraph:
        """The chain without the outputs no loss reads (``without_loss_free_outputs``),
        costed and planned on its own; this one where there are none."""
        if self._trimmed is None:
            lg = without_loss_free_outputs(self.layers, model)
            if lg is self.layers:
                self._trimmed = self
            else:
                with gc_paused():
                    compute_costs(lg, [x for x in lg.example_leaves if isinstance(x, torch.Tensor)])
                self._trimmed = CompiledGraph(layers=lg, planner=self.planner,
                                              device_names=self.device_names, timer=self.timer,
                                              base=self)
        return self._trimmed

    def fused(self, model: nn.Module) -> CompiledGraph:
        """The chain a fused call that does not return its outputs runs: the trimmed one,
        unless a call's ``loss_fn`` read what it drops (``kept_outputs``)."""
        return self.base if self.base.kept_outputs else self.base.trimmed(model)

    def executable(self, plan: ExecutePlan, spec: CallSpec) -> Executable:
        """The Executable a call of ``spec`` runs under ``plan``: lowered and scheduled
        once per (plan, ``CallSpec``), then cached. The call and ``pipe.program()`` both
        come here."""
        key = (plan_key(plan), spec)
        if key not in self.executables:
            self.executables[key] = build_executable(self.layers, plan, spec, self.device_names)
        return self.executables[key]

    def differentiable(self, inputs: Collection[str]) -> frozenset[str]:
        return grad_values(self.layers, inputs)


def plan_key(plan: ExecutePlan) -> tuple:
    """What identifies a plan's runner: its ranges."""
    return tuple(plan.fwd_plan), tuple(plan.bwd_plan)


def run_type_of(plan: ExecutePlan, num_layers: int) -> str:
    """What ``plan`` can run: ``"infer"`` (no backward stages: inference only),
    ``"fused"`` (the forward stops before the tail) or ``"train"``."""
    if not plan.bwd_plan:
        return "infer"
    return "fused" if is_fused(plan, num_layers) else "train"


def is_fused(plan: ExecutePlan, num_layers: int) -> bool:
    covered = plan.fwd_plan[-1].stop if plan.fwd_plan else 0
    return covered < num_layers


def find(cache: Sequence[CompiledGraph], training: bool, args: tuple, kwargs: dict
         ) -> tuple[CompiledGraph | None, list[torch.Tensor]]:
    """The cached graph serving a call with ``args``/``kwargs`` (their first microbatch:
    ``first_microbatch``): one of the same training mode whose static dims (export
    specializes some) and non-tensor inputs fit the call; with the call's tensor inputs.
    ``None`` when a new capture must serve it: a structurally different call raises instead
    (every cached graph has the example's structure, so checking against one suffices),
    and so does yet another set of non-tensor values past ``MAX_CONSTANT_VARIANTS``;
    verbose mode says why no cached graph served."""
    leaves = pytree.tree_leaves((args, kwargs))
    tensors = check_structure(cache[0].layers, args, kwargs, constants=False) \
        if cache else [x for x in leaves if isinstance(x, torch.Tensor)]
    reasons = []
    for compiled in cache:
        reason = mismatch(compiled.layers, training, tensors, leaves)
        if reason is None:
            return compiled, tensors
        reasons.append(reason)
    if reasons:
        check_constant_variants([c.layers for c in cache], leaves)
    if reasons and is_verbose():
        others = (f" (nor does any of the {len(reasons) - 1} other graphs)"
                  if len(reasons) > 1 else "")
        print(f"fxpipe: capturing the model again ({len(cache) + 1} graphs cached "
              f"after this): {reasons[0]}{others}", file=sys.stderr)
    return None, tensors


def dynamic_dims(cache: Sequence[CompiledGraph], varying: dict[int, set[int]],
                 tensors: Sequence[torch.Tensor]) -> list[set[int]]:
    """The dims of each tensor input a new capture keeps symbolic: the batch dim
    (microbatches split it), and every dim seen with another size than a cached graph's
    (so a second capture serves every size there, as dynamo's automatic dynamic shapes
    do); ``varying`` (tensor input -> those dims) is updated. Specializing the rest makes
    export much faster."""
    for compiled in cache:
        examples = [x for x in compiled.layers.example_leaves if isinstance(x, torch.Tensor)]
        for i, (t, ex) in enumerate(zip(tensors, examples)):
            varying.setdefault(i, set()).update(
                d for d in range(t.dim()) if t.shape[d] != ex.shape[d])
    return [({0} if t.dim() else set()) | varying.get(i, set())
            for i, t in enumerate(tensors)]


def first_microbatch(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The call with each ``PackedData`` argument (per-microbatch values from another
    pipe) replaced by its first microbatch: what the graph sees."""
    def first(x: Any) -> Any:
        return x[0] if isinstance(x, PackedData) and len(x) else x
    return tuple(first(a) for a in args), {k: first(v) for k, v in kwargs.items()}


def mismatch(lg: LayerGraph, training: bool, tensors: Sequence[torch.Tensor],
              leaves: Sequence[Any]) -> str | None:
    """Why the graph ``lg`` cannot serve a call with these tensor leaves and pytree
    ``leaves`` (``None``: it can)."""
    if lg.training != training:
        return f"the model is in {'training' if training else 'eval'} mode"
    if lg.autocast != amp.captured():
        return (f"the call is under {amp.describe(amp.captured())}, the graph was captured "
                f"under {amp.describe(lg.autocast)}")
    changed = changed_constant(lg, leaves)
    if changed is not None:
        name, value, captured = changed
        return f"input {name!r} is {value!r}, the captured graph has the constant {captured!r}"
    return static_dim_problem(lg, tensors)


MAX_CONSTANT_VARIANTS = 8  # sets of non-tensor input values a pipe captures a graph for


def check_constant_variants(cached: Sequence[LayerGraph], leaves: Sequence[Any]) -> None:
    """Refuse a capture for yet another set of non-tensor input values past the bound."""
    variants: list[list] = []
    for lg in cached:
        if not any(same_constants(lg.example_leaves, v) for v in variants):
            variants.append(lg.example_leaves)
    if len(variants) < MAX_CONSTANT_VARIANTS or any(same_constants(leaves, v) for v in variants):
        return
    name, value, captured = changed_constant(cached[0], leaves)
    raise ValueError(
        f"input {name!r} is {value!r}: the pipeline has captured the model for "
        f"{MAX_CONSTANT_VARIANTS} sets of values of its non-tensor inputs already (the first "
        f"had {captured!r}), the most it keeps. Pass {name!r} as a tensor (e.g. "
        f"torch.tensor({value!r})), so that one graph serves every value, or call it with a "
        "value already captured.")
