"""``fxpipe.compile``: run the passes in order and build the ``PipelineModule``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree

from fxpipe.config import RunConfig
from fxpipe.passes import gc_paused
from fxpipe.passes.costs import compute_costs
from fxpipe.passes.layer_graph import LayerGraph
from fxpipe.passes.lower import Stage, lower
from fxpipe.passes.partition import build_layer_graph, find_blocks
from fxpipe.passes.schedule import Program
from fxpipe.plan import ExecutePlan
from fxpipe.runtime.autograd import train_call
from fxpipe.runtime.devices import Device, resolve_devices
from fxpipe.runtime.pipeline import Runner, TrainCall
from fxpipe.runtime.timer import LayerTimer
from fxpipe.runtime.trace import trace as _trace


def compile(  # noqa: A001 — the public name is fxpipe.compile, like torch.compile
    model: nn.Module,
    example_inputs: tuple = (),
    example_kwargs: dict | None = None,
    *,
    devices: Sequence[str | torch.device | Device] | None = None,
    capture: Literal["auto", "fx", "dynamo", "export"] = "auto",
    layers: str | None = None,
    config: RunConfig | None = None,
    plan: ExecutePlan | None = None,
) -> PipelineModule:
    """Compile ``model`` into a pipeline of stages (capture → partition → costs → plan → lower).

    >>> pipe = fxpipe.compile(model, example_inputs=(x,))
    >>> print(pipe)                 # the rewritten graph, with its transfers
    >>> pipe(x).sum().backward()    # gradients land in model's own parameters' .grad
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"fxpipe.compile expects an nn.Module, got {type(model).__name__}")
    if not isinstance(example_inputs, tuple):
        example_inputs = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else \
            _bad_example(example_inputs)
    if not example_inputs and not example_kwargs:
        raise ValueError(
            "fxpipe.compile needs example inputs to capture the model: "
            "fxpipe.compile(model, example_inputs=(x,)) or example_kwargs={'input_ids': ids}, "
            "shaped like a real batch.")
    if config is not None and not isinstance(config, RunConfig):
        raise TypeError(f"config must be an fxpipe.RunConfig, got {type(config).__name__}")
    if plan is not None and not isinstance(plan, ExecutePlan):
        raise TypeError(f"plan must be an fxpipe.ExecutePlan, got {type(plan).__name__}")
    find_blocks(model, layers)  # a bad layers= fails before anything slow runs
    resolved = resolve_devices(devices)
    return PipelineModule(model, example_inputs, dict(example_kwargs or {}), devices=resolved,
                          capture=capture, layers=layers, config=config or RunConfig(),
                          plan=plan)


def _bad_example(x: Any):
    raise TypeError(f"example_inputs must be a tuple of positional arguments, got "
                    f"{type(x).__name__}; write example_inputs=(x,)")


@dataclass
class _Compiled:
    """Everything compiled for one (training mode, input signature)."""

    layers: LayerGraph
    plan: ExecutePlan
    program: fx.GraphModule       # top-level graph calling the forward stages
    stages: list[Stage]
    runners: dict[int, Runner] = field(default_factory=dict)  # by id of the plan
    timer: LayerTimer = field(default_factory=LayerTimer)     # measured per-layer times


class PipelineModule(nn.Module):
    """A model compiled into stages. Call it like the model; see ``fxpipe.compile``.

    Parameters stay the model's own (``pipe.module``): ``pipe.parameters()``,
    ``state_dict()`` and any ``torch.optim`` optimizer work on them directly.
    """

    def __init__(self, model: nn.Module, example_args: tuple, example_kwargs: dict, *,
                 devices: list[Device], capture: str, layers: str | None, config: RunConfig,
                 plan: ExecutePlan | None):
        super().__init__()
        self.module = model
        self.devices = devices
        self.config = config
        self._capture = capture
        self._layers_path = layers
        self._user_plan = plan
        self._cache: list[_Compiled] = []
        self._current = self._compiled_for(example_args, example_kwargs)

    # -- compilation -------------------------------------------------------------------
    def _compiled_for(self, args: tuple, kwargs: dict) -> _Compiled:
        """The compiled graph serving this call: one of the same training mode whose
        static dims (export specializes some) fit the call, else a new capture."""
        for compiled in self._cache:
            if compiled.layers.training == self.module.training and \
                    _fits_static_dims(compiled.layers, args, kwargs):
                return compiled
        with gc_paused():
            lg = build_layer_graph(self.module, args, kwargs, capture=self._capture,
                                   layers=self._layers_path)
            leaves = pytree.tree_leaves((args, kwargs))
            compute_costs(lg, [x for x in leaves if isinstance(x, torch.Tensor)])
            plan = self._user_plan or ExecutePlan.auto("fused", _Planned(lg, self.devices))
            plan.validate(len(lg), "fused" if _is_fused(plan, len(lg)) else "train")
            ranges = list(plan.fwd_plan)
            if _is_fused(plan, len(lg)):
                ranges.append(plan.bwd_plan[0])  # a plain call runs the fused tail forward too
            names = [d.name for d in self.devices]
            program, stages = lower(lg, ranges, names)
        compiled = _Compiled(layers=lg, plan=plan, program=program, stages=stages)
        self._cache.append(compiled)
        return compiled

    # -- calling -----------------------------------------------------------------------
    def forward(self, *args: Any, run_config: RunConfig | None = None, **kwargs: Any) -> Any:
        cfg = self._config(run_config)
        compiled = self._compiled_for(args, kwargs)
        self._current = compiled
        runner = self._runner(compiled, cfg)
        params = [p for p in self.module.parameters() if p.requires_grad]
        leaves = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
        needs_grad = cfg.requires_grad and (params or any(x.requires_grad for x in leaves))
        if not needs_grad:
            with torch.no_grad():
                return runner.infer(args, kwargs, cfg)
        inputs = []
        tensor_leaves = iter(compiled.layers.input_names)
        for x in leaves:
            name = next(tensor_leaves)
            if x.requires_grad:
                if cfg.split_input is not None:
                    raise NotImplementedError(
                        f"input {name!r} requires grad and split_input is custom: fxpipe cannot "
                        "route its gradient back yet; use the default split_input")
                inputs.append((name, x, 0 if x.dim() > 0 else None))
        return train_call(TrainCall(runner, args, kwargs, cfg), inputs, params)

    def forward_backward(
        self,
        input_args: tuple = (),
        input_kwargs: dict | None = None,
        label: Any = None,
        loss_fn: Callable[[Any, Any], torch.Tensor] = lambda out, label: out,
        *,
        loss_reduction: Literal["mean", "sum"] = "mean",
        return_outputs: bool = False,
        run_config: RunConfig | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, Any]:
        """Forward, loss and backward as one fused pipelined step; returns the loss
        detached on the host (and the merged outputs with ``return_outputs=True``).

        The tail layers (the first backward stage) run forward, loss and backward in one
        go and are never recomputed. With ``loss_reduction="mean"`` each microbatch's
        loss is weighted by its share of the batch, so for a batch-mean ``loss_fn`` the
        loss and the ``.grad``s equal eager ``loss_fn(model(*args, **kwargs), label).backward()``.
        """
        if loss_reduction not in ("mean", "sum"):
            raise ValueError(f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}")
        if not isinstance(input_args, tuple):
            raise TypeError(f"input_args must be a tuple, got {type(input_args).__name__}")
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
        kwargs = dict(input_kwargs or {})
        cfg = self._config(run_config)
        compiled = self._compiled_for(input_args, kwargs)
        self._current = compiled
        loss, outputs = self._runner(compiled, cfg).fused(
            input_args, kwargs, label, loss_fn, loss_reduction, cfg, return_outputs)
        return (loss, outputs) if return_outputs else loss

    def _config(self, run_config: RunConfig | None) -> RunConfig:
        if run_config is not None and not isinstance(run_config, RunConfig):
            raise TypeError(f"run_config must be an fxpipe.RunConfig, got {type(run_config).__name__}")
        return RunConfig.merge(self.config, run_config).resolved(len(self.devices))

    def _runner(self, compiled: _Compiled, cfg: RunConfig) -> Runner:
        plan = cfg.execute_plan or compiled.plan
        if plan is not compiled.plan:
            plan.validate(len(compiled.layers), "fused" if _is_fused(plan, len(compiled.layers))
                          else "train")
        key = id(plan)
        if key not in compiled.runners:
            compiled.runners[key] = Runner(compiled.layers, plan, self.devices, compiled.timer)
        return compiled.runners[key]

    # -- inspecting --------------------------------------------------------------------
    @property
    def layers(self) -> LayerGraph:
        """The layer chain, each layer with its costs (``pipe.layers[i].cost``)."""
        return self._current.layers

    @property
    def stages(self) -> list[Stage]:
        return self._current.stages

    @property
    def plan(self) -> ExecutePlan:
        return self._current.plan

    @property
    def code(self) -> str:
        """The rewritten program: the top-level graph, then every stage's code."""
        parts = [self._current.program.code.strip("\n")]
        for st in self.stages:
            parts.append(f"# ---- stage_{st.index} ----\n" + st.gm.code.strip("\n"))
        return "\n\n".join(parts) + "\n"

    def __str__(self) -> str:
        return self.code

    def extra_repr(self) -> str:
        return (f"layers={len(self.layers)}, stages={len(self.stages)}, "
                f"devices=[{', '.join(d.name for d in self.devices)}]")

    def program(self, run_type: Literal["infer", "train", "fused"] = "fused",
                num_microbatch: int | None = None) -> Program:
        """The schedule a call of ``run_type`` runs: per device, its ordered actions.

        >>> print(pipe.program("fused", num_microbatch=2))   # devices x steps table
        """
        if run_type not in ("infer", "train", "fused"):
            raise ValueError(f"run_type must be 'infer', 'train' or 'fused', got {run_type!r}")
        cfg = self._config(RunConfig(num_microbatch=num_microbatch))
        return self._runner(self._current, cfg).prepared(run_type, cfg.num_microbatch).program

    def trace(self, path: str | None = None):
        """Record the devices' streams during a ``with`` block into a timeline (the
        simulator's ``Timeline``: ``plot``, ``to_chrome_trace``, ``bubble_ratio``)::

            with pipe.trace("run.json") as rec:
                pipe.forward_backward((x,), label=y, loss_fn=loss_fn)
            rec.timeline.plot("run.png")
        """
        return _trace(self.devices, path)

    # -- the model's own state ---------------------------------------------------------
    def state_dict(self, *args, **kwargs):
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)


@dataclass
class _Planned:
    """What ``ExecutePlan.auto`` reads of a pipe, before the pipe exists."""

    layers: LayerGraph
    devices: list[Device]


def _is_fused(plan: ExecutePlan, num_layers: int) -> bool:
    covered = plan.fwd_plan[-1].stop if plan.fwd_plan else 0
    return covered < num_layers


def check_inputs(lg: LayerGraph, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensor leaves of a call, after checking it has the compiled structure."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    if spec != lg.in_spec:
        raise TypeError(_structure_message(lg.in_spec, spec))
    example = lg.example_leaves
    tensors = []
    for i, (x, ex) in enumerate(zip(leaves, example)):
        if isinstance(ex, torch.Tensor):
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"input {lg.leaf_names[i]!r} was a tensor when compiled, got "
                                f"{type(x).__name__}")
            if x.dim() != ex.dim():
                raise ValueError(f"input {lg.leaf_names[i]!r} has {x.dim()} dims, compiled with "
                                 f"{ex.dim()} (shape {tuple(ex.shape)})")
            name = lg.input_names[len(tensors)]
            for d, size in lg.static_dims.get(name, {}).items():
                if x.shape[d] != size:
                    raise ValueError(
                        f"input {lg.leaf_names[i]!r}: dim {d} is {x.shape[d]}, but the captured "
                        f"graph is specific to {size} there (the model specializes on it). If "
                        "this is a microbatch, the batch cannot be split along that dim: use "
                        "num_microbatch=1 or a split_input spec on another dim.")
            tensors.append(x)
        elif not _same_constant(x, ex):
            raise ValueError(f"input {lg.leaf_names[i]!r} was compiled as the constant {ex!r}, "
                             f"got {x!r}; recompile with the new value")
    return tensors


def _fits_static_dims(lg: LayerGraph, args: tuple, kwargs: dict) -> bool:
    leaves = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
    for name, x in zip(lg.input_names, leaves):
        dims = lg.static_dims.get(name, {})
        if any(d >= x.dim() or x.shape[d] != size for d, size in dims.items()):
            return False
    return True


def _same_constant(a: Any, b: Any) -> bool:
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # noqa: BLE001 — incomparable values are different
        return a is b


def _structure_message(expected, got) -> str:
    def describe(spec):
        args_spec, kwargs_spec = spec.children_specs
        return (f"{args_spec.num_children} positional argument(s) and keyword arguments "
                f"{sorted(kwargs_spec.context) if kwargs_spec.context else []}")
    try:
        return (f"the pipeline was compiled for {describe(expected)}; called with "
                f"{describe(got)}. Call it with the same arguments as the example.")
    except Exception:  # noqa: BLE001
        return f"the call's argument structure differs from the example's:\n{expected}\nvs\n{got}"
