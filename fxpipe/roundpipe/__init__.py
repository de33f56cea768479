"""RoundPipe's API on fxpipe: a script written against ``roundpipe`` runs with its import
changed to ``fxpipe.roundpipe``.

>>> import torch
>>> from fxpipe.roundpipe import RoundPipe, RoundPipeRunConfig
>>> model = RoundPipe(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(),
...                                       torch.nn.Linear(8, 2)), devices=["cpu", "cpu"])
>>> x, y = torch.randn(6, 4), torch.randn(6, 2)
>>> loss = model.forward_backward(input_args=(x,), label=y,
...                               loss_fn=lambda out, label: ((out - label) ** 2).sum(),
...                               run_config=RoundPipeRunConfig(num_microbatch=3))
>>> loss.shape, model.num_layers
(torch.Size([]), 3)

What maps onto what (RoundPipe's semantics, ``docs/from-roundpipe.md``):

- ``RoundPipe(model, optim_dtype=None, name=None, model_run_config=..., pin_model=...)``
  compiles ``model`` with ``fxpipe.compile`` on its first call (RoundPipe takes no example
  inputs; fxpipe captures on the first batch). An ``nn.Sequential`` is cut one layer per
  child, as RoundPipe does, so hand-written plans index the same layers; any other model
  is cut by fxpipe into its own layer chain (RoundPipe makes it one layer): plans then
  index fxpipe's layers (``model.num_layers`` after the first call). Extra keyword:
  ``devices=`` (``fxpipe.compile``'s; default every GPU, else two virtual CPU devices).
- ``RoundPipeRunConfig`` is ``fxpipe.RunConfig`` (same fields, same model-level /
  call-level merging); ``ModelExecutePlan`` is ``fxpipe.ExecutePlan`` built empty and
  filled by attribute as RoundPipe's is.
- ``forward_backward`` calls ``loss_fn`` once per microbatch and returns the **sum** of
  the microbatch losses (``loss_reduction="sum"``), as RoundPipe does.
- ``step(step_fn, is_async=True)`` runs ``step_fn`` on a host thread and returns at once;
  the next call through the model (or ``synchronize()``) waits for it, so a step never
  runs on parameters one step old (RoundPipe's asynchronous step does): results equal
  ``is_async=False`` and eager PyTorch.

Not supported (``NotImplementedError`` naming it): ``GradScaler`` (fp16 loss scaling),
``OptimizerCtx``, ``save_for_recompute`` / ``get_recompute_data`` / ``doing_recompute``,
``wrap_model_to_roundpipe``'s ``skip_modules`` and ``override_config``.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import threading
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal

import torch
import torch.nn as nn
import torch.utils._pytree as pytree

from fxpipe.api import PipelineModule, compile
from fxpipe.config import RunConfig
from fxpipe.plan import ExecutePlan
from fxpipe.runtime.issue import microbatch as mb
from fxpipe.runtime.issue.microbatch import PackedData

__all__ = ["GradScaler", "ModelExecutePlan", "OptimizerCtx", "RoundPipe", "RoundPipeRunConfig",
           "doing_recompute", "get_recompute_data", "optim", "save_for_recompute",
           "wrap_model_to_roundpipe"]

RoundPipeRunConfig = RunConfig
RoundPipePackedData = PackedData


class ModelExecutePlan(ExecutePlan):
    """RoundPipe's execution plan: ``ModelExecutePlan()`` then ``plan.fwd_plan = [...]``,
    ``plan.bwd_plan = [...]`` (an ``fxpipe.ExecutePlan``; ranges may also be passed).

    >>> plan = ModelExecutePlan()
    >>> plan.fwd_plan = [range(0, 3)]
    >>> plan.bwd_plan = [range(3, 4), range(2, 3), range(1, 2), range(0, 1)]
    >>> plan.validate(4, "fused")
    """

    def __init__(self, fwd_plan: Sequence[range] | None = None,
                 bwd_plan: Sequence[range] | None = None) -> None:
        super().__init__(list(fwd_plan or []), list(bwd_plan or []))

    @classmethod
    def auto(cls, run_type: Literal["infer", "train", "fused"], *models: Any,
             min_stages: int | None = None, upper_threshold: float = 1.1,
             model_memory_limit: float | None = None) -> ExecutePlan | list[ExecutePlan]:
        """Plan ``models`` together from their layer costs (measured times once they have
        run; ``fxpipe.ExecutePlan.auto``). One plan for one model, a list for several.
        A ``RoundPipe`` that has not run yet has no layers: its plan is made on its first
        call (with every other model of this call that has run by then)."""
        if not models:
            raise ValueError("ModelExecutePlan.auto needs at least one model")
        kw = dict(min_stages=min_stages, upper_threshold=upper_threshold,
                  model_memory_limit=model_memory_limit)
        rps = [m for m in models if isinstance(m, RoundPipe)]
        if len(rps) == len(models) and all(m._pipe is not None for m in rps):
            plans = ExecutePlan.auto(run_type, *[m._pipe for m in rps], **kw)
            plans = plans if isinstance(plans, list) else [plans]
            out = [cls(p.fwd_plan, p.bwd_plan) for p in plans]
        elif len(rps) == len(models):
            group = _AutoGroup(run_type, rps, kw)
            out = [_AutoPlan(group, i) for i in range(len(rps))]
        else:   # fxpipe pipes (anything ExecutePlan.auto reads)
            plans = ExecutePlan.auto(run_type, *[m._pipe if isinstance(m, RoundPipe) else m
                                                 for m in models], **kw)
            plans = plans if isinstance(plans, list) else [plans]
            out = [cls(p.fwd_plan, p.bwd_plan) for p in plans]
        return out[0] if len(out) == 1 else out


class _AutoGroup:
    """Models planned together by ``ModelExecutePlan.auto`` before they had run."""

    def __init__(self, run_type: str, models: list[RoundPipe], kw: dict):
        self.run_type, self.models, self.kw = run_type, models, kw
        self.plans: list[ExecutePlan] | None = None

    def plan_for(self, index: int) -> ExecutePlan:
        if self.plans is not None:
            return self.plans[index]
        ready = [m._pipe is not None for m in self.models]
        if all(ready):
            plans = ExecutePlan.auto(self.run_type, *[m._pipe for m in self.models], **self.kw)
            self.plans = plans if isinstance(plans, list) else [plans]
            return self.plans[index]
        # the others have not run yet: this model alone for now
        return ExecutePlan.auto(self.run_type, self.models[index]._pipe, **self.kw)


class _AutoPlan(ModelExecutePlan):
    """A plan ``ModelExecutePlan.auto`` could not make yet; resolved on the model's first
    call (its ranges are then filled in)."""

    def __init__(self, group: _AutoGroup, index: int):
        super().__init__()
        self._group, self._index = group, index

    def resolve(self) -> ExecutePlan:
        plan = self._group.plan_for(self._index)
        self.fwd_plan, self.bwd_plan = list(plan.fwd_plan), list(plan.bwd_plan)
        return ExecutePlan(list(plan.fwd_plan), list(plan.bwd_plan))

    def __repr__(self) -> str:
        return "ModelExecutePlan(auto, planned on the model's first call)" if not \
            self.fwd_plan and not self.bwd_plan else super().__repr__()


_PIN = {"alloc": None, "register": None, "off": False}


class RoundPipe(nn.Module):
    """A model run as a RoundPipe pipeline, on fxpipe (see the module docstring)."""

    def __init__(self, model: nn.Module, optim_dtype: torch.dtype | None = None,
                 name: str | None = None, model_run_config: RunConfig | None = None,
                 pin_model: Literal["alloc", "register", "off"] = "alloc", *,
                 devices: Sequence[Any] | None = None):
        super().__init__()
        if not isinstance(model, nn.Module):
            raise TypeError(f"RoundPipe expects an nn.Module, got {type(model).__name__}")
        if model_run_config is not None and not isinstance(model_run_config, RunConfig):
            raise TypeError(f"model_run_config must be a RoundPipeRunConfig, got "
                            f"{type(model_run_config).__name__}")
        if pin_model not in _PIN:
            raise ValueError(f"pin_model must be 'alloc', 'register' or 'off', got {pin_model!r}")
        if optim_dtype is not None and not (isinstance(optim_dtype, torch.dtype)
                                            and optim_dtype.is_floating_point):
            raise TypeError(f"optim_dtype must be a floating torch.dtype or None, got "
                            f"{optim_dtype!r}")
        self.module = model
        self.name = name or type(model).__name__
        self.model_run_config = model_run_config or RunConfig()
        self.optim_dtype = optim_dtype
        self._pin = _PIN[pin_model]
        self._devices = list(devices) if devices is not None else None
        self._pipe: PipelineModule | None = None
        self._masters: list[tuple[nn.Parameter, torch.Tensor]] | None = None
        self._in_step = False
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: concurrent.futures.Future | None = None
        self._lock = threading.Lock()

    # -- the pipe ----------------------------------------------------------------------------
    def _compiled(self, args: tuple, kwargs: dict) -> PipelineModule:
        if self._pipe is None:
            config = self.model_run_config
            auto = config.execute_plan if isinstance(config.execute_plan, _AutoPlan) else None
            if auto is not None:   # planned once the model has layers (below)
                config = dataclasses.replace(config, execute_plan=None)
            self._pipe = compile(
                self.module, example_inputs=tuple(args), example_kwargs=kwargs,
                devices=self._devices, config=config,
                layers="" if isinstance(self.module, nn.Sequential) else None,
                pin_memory=self._pin)
            if auto is not None:
                self._pipe.config = dataclasses.replace(config, execute_plan=auto.resolve())
        return self._pipe

    @property
    def pipe(self) -> PipelineModule | None:
        """The ``fxpipe.PipelineModule`` (None before the first call)."""
        return self._pipe

    @property
    def num_layers(self) -> int:
        """The layers plans index (known after the first call)."""
        if self._pipe is None:
            if isinstance(self.module, nn.Sequential):
                return len(self.module)
            raise RuntimeError(f"{self.name}: the layers are known after the first call "
                               "(fxpipe captures the model on its first batch)")
        return len(self._pipe.layers)

    def _run_config(self, run_config: RunConfig | None) -> RunConfig | None:
        if run_config is None:
            return None
        if not isinstance(run_config, RunConfig):
            raise TypeError(f"run_config must be a RoundPipeRunConfig, got "
                            f"{type(run_config).__name__}")
        plan = run_config.execute_plan
        if isinstance(plan, _AutoPlan):
            run_config = dataclasses.replace(run_config, execute_plan=plan.resolve())
        return run_config

    # -- calls ---------------------------------------------------------------------------
    def forward(self, *args: Any, roundpipe_run_config: RunConfig | None = None,
                **kwargs: Any) -> Any:
        """``model(x)``, ``model.forward(*args, roundpipe_run_config=..., **kwargs)`` or
        ``model.forward(input_args=(...), input_kwargs={...}, run_config=...)``."""
        if not args and ({"input_args", "input_kwargs", "run_config"} & kwargs.keys()):
            extra = kwargs.keys() - {"input_args", "input_kwargs", "run_config"}
            if extra:
                raise TypeError(f"RoundPipe.forward(input_args=..., ...) takes input_args, "
                                f"input_kwargs and run_config only; got also {sorted(extra)}")
            args = tuple(kwargs.get("input_args", ()))
            run_config = kwargs.get("run_config", roundpipe_run_config)
            kwargs = dict(kwargs.get("input_kwargs") or {})
        else:
            run_config = roundpipe_run_config
        self.wait()
        pipe = self._compiled(args, kwargs)
        cfg = self._run_config(run_config) or RunConfig()
        plan = cfg.execute_plan
        if plan is not None and plan.bwd_plan and plan.fwd_plan \
                and plan.fwd_plan[-1].stop == plan.bwd_plan[0].start < len(pipe.layers):
            # a "fused" plan (ModelExecutePlan.auto("fused", ...)) used for forward: its
            # tail becomes the last forward stage
            cfg = dataclasses.replace(cfg, execute_plan=ExecutePlan(
                [*plan.fwd_plan, plan.bwd_plan[0]], list(plan.bwd_plan)))
        full = RunConfig.merge(pipe.config, cfg)
        if full.merge_output is False and _needs_grad(self.module, full, args, kwargs):
            # fxpipe cannot differentiate through per-microbatch (PackedData) outputs yet:
            # return the merged output, which the next model splits into the same
            # microbatches (the values RoundPipe's chain computes)
            cfg = dataclasses.replace(cfg, merge_output=None)
        return pipe(*args, run_config=cfg, **kwargs)

    def forward_backward(self, input_args: tuple = (), input_kwargs: dict | None = None,
                         label: Any = None,
                         loss_fn: Callable[[Any, Any], Any] = lambda outputs, labels: outputs,
                         return_outputs: bool = False,
                         run_config: RunConfig | None = None) -> Any:
        """Forward, ``loss_fn`` once per microbatch, backward into the parameters' ``.grad``;
        returns the sum of the microbatch losses (``(loss_sum, merged_outputs)`` with
        ``return_outputs=True``). ``loss_fn`` may return a tensor or a sequence of tensors
        (each back-propagated; the result is then a sequence of sums)."""
        if not torch.is_grad_enabled():
            raise AssertionError("RoundPipe.forward_backward requires grad enabled "
                                 "(it is called under torch.no_grad())")
        if not isinstance(input_args, tuple):
            input_args = tuple(input_args) if isinstance(input_args, list) else (input_args,)
        kwargs = dict(input_kwargs or {})
        self.wait()
        pipe = self._compiled(input_args, kwargs)
        parts: dict[int, list] = {}
        kind: list = []
        lock = threading.Lock()

        def loss(outputs: Any, labels: Any) -> torch.Tensor:
            value = loss_fn(outputs, labels)
            if isinstance(value, torch.Tensor):
                return value
            if not isinstance(value, (list, tuple)) or not value or \
                    not all(isinstance(v, torch.Tensor) for v in value):
                raise TypeError(f"loss_fn must return a tensor or a sequence of tensors, got "
                                f"{type(value).__name__}")
            with lock:
                kind[:] = [type(value)]
                for i, v in enumerate(value):
                    parts.setdefault(i, []).append(v.detach().to("cpu"))
            return sum(value[1:], value[0])

        cfg = self._run_config(run_config)
        if cfg is not None and cfg.execute_plan is not None:
            # RoundPipe's rule: forward_backward's forward plan stops where the first
            # backward stage starts (its layers run forward only there)
            cfg.execute_plan.validate(len(pipe.layers), "fused")
        if _inputs_require_grad(input_args, kwargs):
            # an input made by another model's differentiable forward (a chain): the fused
            # step cannot back-propagate into it, so forward through the pipe
            # differentiably, loss per microbatch here, one backward through both models
            total, outputs = self._chained_step(pipe, input_args, kwargs, label, loss, cfg,
                                                return_outputs)
        else:
            result = pipe.forward_backward(input_args, kwargs, label=label, loss_fn=loss,
                                           loss_reduction="sum", return_outputs=return_outputs,
                                           run_config=cfg)
            total, outputs = result if return_outputs else (result, None)
        if parts:
            sums = [sum(parts[i][1:], parts[i][0]) for i in sorted(parts)]
            total = kind[0](sums) if kind[0] is not list else sums
        return (total, outputs) if return_outputs else total

    def _chained_step(self, pipe: PipelineModule, args: tuple, kwargs: dict, label: Any,
                      loss: Callable, cfg: RunConfig | None,
                      return_outputs: bool) -> tuple[torch.Tensor, Any]:
        full = pipe._config(cfg)
        if full.merge_output not in (None, True):
            raise NotImplementedError(
                "RoundPipe.forward_backward with an input that requires grad (another model's "
                "output) and a custom merge_output: fxpipe splits the merged output back into "
                "microbatches for the loss; use the default merge_output here")
        call = dataclasses.replace(cfg or RunConfig(), requires_grad=True, merge_output=None)
        out = pipe(*args, run_config=call, **kwargs)
        n = full.num_microbatch
        outs = mb.split_label(out, n, None)
        labels = mb.split_label(label, n, full.split_label)
        total = None
        for o, lab in zip(outs, labels):
            value = loss(o, lab)
            total = value if total is None else total + value
        total.backward()
        return total.detach(), (pytree.tree_map_only(torch.Tensor, torch.Tensor.detach, out)
                                if return_outputs else None)

    # -- optimizer -------------------------------------------------------------------------
    def _master_pairs(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """``(parameter, its optimizer copy)``: the parameter itself unless ``optim_dtype``
        differs from its dtype (then an fp32 master, say, of a bf16 weight)."""
        if self._masters is None:
            pairs = []
            for p in self.module.parameters():
                if self.optim_dtype is not None and p.is_floating_point() \
                        and p.dtype != self.optim_dtype:
                    master = p.detach().to(self.optim_dtype).clone().requires_grad_(p.requires_grad)
                    pairs.append((p, master))
                else:
                    pairs.append((p, p))
            self._masters = pairs
        return self._masters

    def optim_parameters(self) -> Iterator[torch.Tensor]:
        """The tensors an optimizer should step: the parameters, or their ``optim_dtype``
        copies."""
        return iter([m for _, m in self._master_pairs()])

    def optim_named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        names = [n for n, _ in self.module.named_parameters()]
        return iter(list(zip(names, [m for _, m in self._master_pairs()])))

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        if self._in_step:   # inside step_fn: the optimizer's copies, as RoundPipe does
            return self.optim_parameters()
        return super().parameters(recurse)

    def named_parameters(self, *args: Any, **kwargs: Any):
        if self._in_step:
            return self.optim_named_parameters()
        return super().named_parameters(*args, **kwargs)

    def step(self, step_fn: Callable[..., Any], is_async: bool = True, *args: Any,
             **kwargs: Any) -> Any:
        """Run ``step_fn(*args, **kwargs)`` (``optimizer.step(); optimizer.zero_grad()``,
        clipping, ...) on a host thread, ``model.parameters()`` meaning the optimizer's
        copies inside it. ``is_async=True`` returns at once (the next call waits for it);
        ``False`` waits and returns ``step_fn``'s result."""
        if not callable(step_fn):
            raise TypeError(f"step_fn must be callable, got {type(step_fn).__name__}")
        self.wait()
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="roundpipe-step")
        future = self._pool.submit(self._step, step_fn, args, kwargs)
        if is_async:
            self._pending = future
            return None
        return future.result()

    def _step(self, step_fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        pairs = [(p, m) for p, m in self._master_pairs() if m is not p]
        for p, m in pairs:   # device gradients -> the optimizer copies' .grad
            if p.grad is not None:
                g = p.grad.detach().to(m.dtype)
                m.grad = g if m.grad is None else m.grad.add_(g)
                p.grad = None
        with self._stepping():
            result = step_fn(*args, **kwargs)
        with torch.no_grad():
            for p, m in pairs:
                p.copy_(m)
        return result

    @contextlib.contextmanager
    def _stepping(self) -> Iterator[None]:
        with self._lock:
            self._in_step = True
            try:
                yield
            finally:
                self._in_step = False

    def wait(self) -> None:
        """Wait for a pending asynchronous ``step`` (raising its error, if it failed)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def synchronize(self) -> None:
        """Wait for pending work; the model's parameters then hold the optimizer's values
        (before evaluation, checkpointing, inspecting ``.grad``)."""
        self.wait()

    # -- the model's own state and attributes -----------------------------------------------
    def state_dict(self, *args: Any, **kwargs: Any):
        self.wait()
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False):
        self.wait()
        result = self.module.load_state_dict(state_dict, strict=strict, assign=assign)
        if self._masters is not None:
            with torch.no_grad():
                for p, m in self._masters:
                    if m is not p:
                        m.copy_(p)
        return result

    def close(self) -> None:
        """Stop the device workers and the step thread."""
        self.wait()
        if self._pipe is not None:
            self._pipe.close()
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = self._modules.get("module")
            if module is None:
                raise
            return getattr(module, name)   # config, vocab_size, ...

    def extra_repr(self) -> str:
        return f"name={self.name!r}"


def _needs_grad(model: nn.Module, cfg: RunConfig, args: tuple, kwargs: dict) -> bool:
    wanted = torch.is_grad_enabled() if cfg.requires_grad is None else cfg.requires_grad
    return bool(wanted) and (any(p.requires_grad for p in model.parameters())
                             or _inputs_require_grad(args, kwargs))


def _inputs_require_grad(args: tuple, kwargs: dict) -> bool:
    return any(isinstance(t, torch.Tensor) and t.requires_grad
               for t in pytree.tree_leaves((args, kwargs)))


def wrap_model_to_roundpipe(model: nn.Module, use_sequential_preset: bool | None = None,
                            lower_threshold: int = 16 * 1024, upper_threshold: int | None = None,
                            skip_modules: Sequence[Any] = (), override_config: dict | None = None,
                            model_run_config: RunConfig | None = None, name: str | None = None,
                            **roundpipe_kwargs: Any) -> RoundPipe:
    """``RoundPipe(model, ...)``: fxpipe captures the model and finds its repeated blocks
    itself, so the presets (Llama, Qwen3, ...) and the wrapping thresholds, which decide
    how RoundPipe cuts a model into layers, are not needed; the model's attributes
    (``config``, ``vocab_size``) stay reachable on the result. ``skip_modules`` and
    ``override_config`` (per-module run configs) are not supported."""
    if list(skip_modules):
        raise NotImplementedError("wrap_model_to_roundpipe(skip_modules=...): fxpipe pipelines "
                                  "the whole model as one chain of layers; leave skip_modules "
                                  "empty")
    if override_config:
        raise NotImplementedError("wrap_model_to_roundpipe(override_config=...): per-module run "
                                  "configs are not supported; pass run_config= per call")
    return RoundPipe(model, model_run_config=model_run_config, name=name, **roundpipe_kwargs)


def _unsupported(what: str, why: str) -> Callable[..., Any]:
    def fail(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"fxpipe.roundpipe.{what} is not supported: {why}")
    fail.__name__ = what
    return fail


class GradScaler:
    """RoundPipe's fp16 loss scaler: not supported (fxpipe's fused step does not scale the
    loss); train in bf16 or fp32."""

    def __init__(self, *args: Any, **kwargs: Any):
        raise NotImplementedError("fxpipe.roundpipe.GradScaler is not supported: fp16 loss "
                                  "scaling is not routed through the fused step; use bf16 or "
                                  "fp32 weights")


class OptimizerCtx:
    """Not supported (see ``GradScaler``)."""

    def __init__(self, *args: Any, **kwargs: Any):
        raise NotImplementedError("fxpipe.roundpipe.OptimizerCtx is not supported: use "
                                  "model.step(step_fn) with a torch optimizer")


save_for_recompute = _unsupported("save_for_recompute", "fxpipe recomputes whole stages "
                                  "(RunConfig.recompute_grain), with no user hooks")
get_recompute_data = _unsupported("get_recompute_data", "see save_for_recompute")
doing_recompute = _unsupported("doing_recompute", "see save_for_recompute")

# RoundPipe's CPU optimizers: torch's own step the host copies the same way
optim = types.SimpleNamespace(Adam=torch.optim.Adam, AdamW=torch.optim.AdamW,
                              SGD=torch.optim.SGD)
