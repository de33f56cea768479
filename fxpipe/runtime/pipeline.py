"""One call of a compiled pipeline: split into microbatches, run the Program, merge.

``Runner`` holds, per run type and microbatch count, the lowered stages, the Program
and the parameter store (cached); ``infer``, ``fused`` and ``TrainCall`` (the
eager-style forward/backward, through ``runtime.autograd``) run calls on it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.distributed.pipelining.microbatch import TensorChunkSpec

from fxpipe.config import RunConfig
from fxpipe.errors import PlanError
from fxpipe.passes import gc_paused
from fxpipe.passes.grad_flow import grad_values
from fxpipe.passes.layer_graph import LayerGraph
from fxpipe.passes.lower import Stage, lower, lower_stage
from fxpipe.passes.schedule import Program, build_program
from fxpipe.plan import ExecutePlan
from fxpipe.runtime import amp
from fxpipe.runtime import microbatch as mb
from fxpipe.runtime import rng
from fxpipe.runtime.devices import Device
from fxpipe.runtime.executor import (
    Execution, Job, apply_writebacks, refresh_and_snapshot, restore,
)
from fxpipe.runtime.interrupts import deferred_interrupt
from fxpipe.runtime.params import ParamStore
from fxpipe.runtime.timer import LayerTimer


@dataclass
class Prepared:
    """What a run type needs: its stages, its Program and its parameter store."""

    program: Program
    stages: dict[int, Stage]
    store: ParamStore


class Runner:
    """Runs one compiled LayerGraph under one plan on ``devices``."""

    def __init__(self, lg: LayerGraph, plan: ExecutePlan, devices: list[Device],
                 timer: LayerTimer | None = None, param_dtype: torch.dtype | None = None):
        self.lg, self.plan, self.devices = lg, plan, devices
        self.timer = timer
        self.param_dtype = param_dtype  # mixed precision: devices compute in it
        self._prepared: dict[tuple[str, int], Prepared] = {}
        self._lowered: dict[str, dict[int, Stage]] = {}

    def ranges(self, run_type: str) -> tuple[list[range], list[range]]:
        """(forward ranges, backward ranges) of the plan for ``run_type``."""
        fwd, bwd = list(self.plan.fwd_plan), list(self.plan.bwd_plan)
        n = len(self.lg)
        tail = bwd[0] if bwd else None
        if run_type != "infer" and tail is None:
            raise PlanError(f"this ExecutePlan has no bwd_plan, so it can only run inference; "
                            f"a {'fused step' if run_type == 'fused' else 'backward'} needs "
                            "backward stages (bwd_plan=[...]), or use torch.no_grad()")
        if run_type == "fused":
            fwd = [range(r.start, min(r.stop, tail.start)) for r in fwd if r.start < tail.start]
            return fwd, bwd
        covered = fwd[-1].stop if fwd else 0
        if covered < n:   # a fused-style plan: the tail runs forward too
            fwd.append(range(covered, n))
        return fwd, (bwd if run_type == "train" else [])

    def stages(self, run_type: str) -> dict[int, Stage]:
        """The lowered stages of ``run_type``, by Program stage index."""
        if run_type not in self._lowered:
            with gc_paused():
                self._lowered[run_type] = self._lower(run_type)
        return self._lowered[run_type]

    def _lower(self, run_type: str) -> dict[int, Stage]:
        fwd, bwd = self.ranges(run_type)
        names = [d.name for d in self.devices]
        # a fused plan may put every layer in its tail stage: no forward stages then
        fstages = lower(self.lg, fwd, names, save_cuts=[r.start for r in bwd])[1] if fwd else []
        out = {st.index: st for st in fstages}
        for k, r in enumerate(bwd):
            i = len(fwd) + k
            out[i] = lower_stage(self.lg, r, i, i % len(names), names)
        return out

    def layer_stages(self) -> dict[int, Stage]:
        """Single-layer stages, for ``recompute_grain="layer"``."""
        if not hasattr(self, "_layer_stages"):
            names = [d.name for d in self.devices]
            self._layer_stages = {i: lower_stage(self.lg, range(i, i + 1), -1, 0, names)
                                  for i in range(len(self.lg))}
        return self._layer_stages

    def prepared(self, run_type: str, num_microbatch: int, optimizer: bool = False) -> Prepared:
        """With ``optimizer``, the Program has an ``OptimizerStep`` after each backward
        stage (a streamed optimizer step, ``fxpipe.optim``)."""
        key = (run_type, num_microbatch, optimizer)
        if key not in self._prepared:
            fwd, bwd = self.ranges(run_type)
            program = build_program(fwd, bwd, run_type, len(self.devices), num_microbatch,
                                    dispatch="stage", optimizer=optimizer)
            stages = self.stages(run_type)
            store = self._store(run_type, stages)
            self._prepared[key] = Prepared(program, stages, store)
        return self._prepared[key]

    def _store(self, run_type: str, stages: dict[int, Stage]) -> ParamStore:
        for p in self._prepared.values():  # one store per run type, shared by every M
            if p.stages is stages:
                return p.store
        lg = self.lg
        return ParamStore({i: {f: lg.params[f] for f in st.params if f in lg.params}
                           for i, st in stages.items()},
                          {i: {f: lg.buffers[f] for f in st.params if f in lg.buffers}
                           for i, st in stages.items()}, param_dtype=self.param_dtype)

    # -- calls ---------------------------------------------------------------------------
    def split(self, args: tuple, kwargs: dict, cfg: RunConfig) -> tuple[list[dict], list[int]]:
        """Per-microbatch input environments, and each microbatch's rows."""
        from fxpipe.api import check_inputs  # the call checks live with the module
        if not any(isinstance(x, mb.PackedData) for x in (*args, *kwargs.values())):
            check_inputs(self.lg, args, kwargs)  # structure errors before splitting errors
        args_mb, kwargs_mb = mb.split_input(args, kwargs, cfg.num_microbatch, cfg.split_input)
        envs, rows = [], []
        for a, k in zip(args_mb, kwargs_mb):
            tensors = check_inputs(self.lg, a, k)
            if self.param_dtype is not None:  # floating inputs enter in the compute dtype
                tensors = [t.to(self.param_dtype) if t.is_floating_point() else t for t in tensors]
            envs.append(dict(zip(self.lg.input_names, tensors)))
            first = next((t for t in tensors if t.dim() > 0), None)
            rows.append(first.shape[0] if first is not None else 1)
        return envs, rows

    def job(self, run_type: str, envs: list[dict], cfg: RunConfig, **kw: Any) -> Job:
        streamed = getattr(kw.get("optimizer"), "streamed", False)
        prep = self.prepared(run_type, len(envs), optimizer=streamed)
        seed = rng.draw_call_seed() if cfg.preserve_rng_state and \
            any(layer.random for layer in self.lg) else None
        if cfg.recompute_grain == "layer":
            kw["layer_stages"] = self.layer_stages()
        inputs = {n for env in envs for n, x in env.items()
                  if isinstance(x, torch.Tensor) and x.requires_grad}
        return Job(program=prep.program, stages=prep.stages, layers=self.lg, store=prep.store,
                   devices=self.devices, inputs=envs, call_seed=seed, grain=cfg.recompute_grain,
                   timer=self.timer, autocast=amp.captured(),
                   differentiable=grad_values(self.lg, inputs), **kw)

    def execute(self, job: Job, results: Callable[[], Any] | None = None) -> Any:
        """Run ``job``, then write its buffer updates (and with ``job.commit_grads``, its
        parameter gradients into ``.grad``) as one step that a ``KeyboardInterrupt`` cannot split.
        ``results()`` (e.g. merging outputs, which may raise) runs before anything is
        written; its value is returned. On failure put buffers back and raise (nothing
        reaches ``.grad``)."""
        snapshot = refresh_and_snapshot(job.store, self.lg.buffers)
        try:
            Execution(job).run()
            value = results() if results is not None else None
            with deferred_interrupt():
                if job.commit_grads:
                    job.accumulator.commit()  # checks everything before writing anything
                apply_writebacks(job.writebacks)
        except BaseException:
            restore(self.lg.buffers, snapshot)
            if job.accumulator is not None:
                job.accumulator.discard()
            raise
        self._update_costs()
        return value

    def _update_costs(self) -> None:
        """Measured per-layer times go into the layers' costs, where ``ExecutePlan.auto``
        prefers them to FLOP estimates (once every layer has them)."""
        if self.timer is None:
            return
        for layer in self.lg:
            times = self.timer.times(layer.index)
            cost = layer.cost
            if times is None or cost is None:
                continue
            fwd, rec, bwd = times
            layer.node.meta["cost"] = dataclasses.replace(
                cost, fwd_ms=fwd if fwd is not None else cost.fwd_ms,
                recompute_ms=rec if rec is not None else cost.recompute_ms,
                bwd_ms=bwd if bwd is not None else cost.bwd_ms)

    def outputs(self, job: Job, cfg: RunConfig) -> Any:
        per_mb = [pytree.tree_unflatten(self.lg.flat_outputs(env), self.lg.out_spec)
                  for env in job.host]
        merged = mb.merge_output(per_mb, cfg.merge_output)
        if cfg.output_device is not None and torch.device(cfg.output_device).type != "cpu":
            merged = pytree.tree_map_only(torch.Tensor, lambda t: t.to(cfg.output_device), merged)
        return merged

    def infer(self, args: tuple, kwargs: dict, cfg: RunConfig) -> Any:
        envs, _ = self.split(args, kwargs, cfg)
        job = self.job("infer", envs, cfg)
        self.execute(job)
        return self.outputs(job, cfg)

    def fused(self, args: tuple, kwargs: dict, label: Any, loss_fn: Callable,
              reduction: str, cfg: RunConfig, return_outputs: bool,
              optimizer: Any = None) -> tuple[torch.Tensor, Any]:
        """``optimizer``: an ``fxpipe.optim.Overlapped`` whose step this call runs."""
        envs, rows = self.split(args, kwargs, cfg)
        labels = mb.split_label(label, len(envs), cfg.split_label)
        weights = mb.microbatch_weights(rows) if reduction == "mean" else [1.0] * len(envs)
        if len(envs) == 1:
            weights = [1.0]
        call = optimizer.call(self, len(envs)) if optimizer is not None else None
        if call is not None:
            loss_fn = call.scale_loss(loss_fn)
        job = self.job("fused", envs, cfg, labels=labels, loss_fn=loss_fn, loss_weights=weights,
                       optimizer=call, keep_outputs=return_outputs, commit_grads=True)
        try:
            outputs = self.execute(job, results=(lambda: self.outputs(job, cfg))
                                   if return_outputs else None)
        except BaseException as e:
            if call is not None:
                call.failed(e)
            raise
        loss = job.losses[0]
        for m in range(1, len(envs)):
            loss = loss + job.losses[m]
        if call is not None:
            call.finish()
            loss = call.unscale_loss(loss)
        return loss.detach().cpu(), outputs


class TrainCall:
    """An eager-style training call: ``forward()`` now, ``backward(grads)`` later."""

    def __init__(self, runner: Runner, args: tuple, kwargs: dict, cfg: RunConfig):
        self.runner, self.cfg = runner, cfg
        self.envs, self.rows = runner.split(args, kwargs, cfg)
        self.forward_job: Job | None = None
        self.out_leaves: list[list] = []
        self.merged_flat: list = []
        self.merged_spec: Any = None

    def forward(self) -> Any:
        r = self.runner
        job = r.job("train", self.envs, self.cfg, parts=frozenset({"fwd"}))
        r.execute(job)
        self.forward_job = job
        self.out_leaves = [r.lg.flat_outputs(env) for env in job.host]
        return r.outputs(job, self.cfg)

    def backward(self, merged_grads: list) -> tuple[list[dict], dict[int, torch.Tensor]]:
        """Gradients of the merged output leaves → (per-microbatch input grads,
        parameter grads by ``id``)."""
        r, fj = self.runner, self.forward_job
        names = [a.name if hasattr(a, "name") else None
                 for a in r.lg.gm.graph.output_node().args[0]]
        M = len(self.envs)
        out_grads: list[dict[str, torch.Tensor]] = [{} for _ in range(M)]
        spec = self.cfg.merge_output
        leaf_specs = _leaf_specs(spec, r.lg, fj.host)
        for k, g in enumerate(merged_grads):
            if g is None or names[k] is None:
                continue
            parts = _unmerge(g, [leaves[k] for leaves in self.out_leaves], leaf_specs[k])
            for m, part in enumerate(parts):
                prev = out_grads[m].get(names[k])
                out_grads[m][names[k]] = part if prev is None else prev + part
        job = Job(program=fj.program, stages=fj.stages, layers=r.lg, store=fj.store,
                  devices=r.devices, inputs=fj.host, call_seed=fj.call_seed,
                  out_grads=out_grads, parts=frozenset({"bwd"}), grain=fj.grain,
                  layer_stages=fj.layer_stages, timer=fj.timer, autocast=fj.autocast,
                  differentiable=fj.differentiable)
        r.execute(job)
        params = job.accumulator.totals()
        job.accumulator.discard()
        return [{n: job.grads[m].get(n) for n in r.lg.input_names} for m in range(M)], params


def _leaf_specs(spec: Any, lg: LayerGraph, host: list[dict]) -> list[Any]:
    """How each flat output leaf was merged: ``None`` (auto) or a TensorChunkSpec."""
    n = len(lg.gm.graph.output_node().args[0])
    if spec is None or spec is True:
        return [None] * n
    if callable(spec) or spec is False:
        raise NotImplementedError(
            "backward through pipe(...) with a callable or False merge_output cannot split the "
            "output gradient into microbatches; use pipe.forward_backward(...) or the default "
            "merge_output")
    leaves = pytree.tree_leaves(spec, is_leaf=lambda x: isinstance(x, TensorChunkSpec) or x is None)
    if len(leaves) != n:
        raise NotImplementedError("merge_output spec must give one entry per output leaf for "
                                  "eager-style backward")
    return leaves


def _unmerge(grad: torch.Tensor, per_mb: list, spec: Any) -> list[torch.Tensor]:
    """Split the gradient of a merged output leaf back into its microbatches."""
    first = per_mb[0]
    if isinstance(spec, TensorChunkSpec):
        dim = spec.split_dim
    elif spec is None and isinstance(first, torch.Tensor) and first.dim() > 0:
        dim = 0
    elif spec is None and isinstance(first, torch.Tensor):
        return [grad / len(per_mb) for _ in per_mb]  # 0-dim outputs were averaged
    else:
        raise NotImplementedError(f"cannot split the gradient of an output merged with {spec!r}")
    return list(torch.split(grad, [t.shape[dim] for t in per_mb], dim=dim))
