"""``fxpipe.compile``: run the passes in order and build the ``PipelineModule``.

``compile`` checks its arguments and resolves the devices; ``PipelineModule`` captures
the model (a new capture when no compiled graph serves a call: ``fxpipe.graph_cache``),
plans it and calls its ``Runner`` (``fxpipe.runtime.issue.pipeline``). What a pipe shows is
``fxpipe.inspecting``'s, its checkpoints ``fxpipe.checkpointing``'s."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree

from fxpipe.call_checks import (as_example_tuple, check_differentiable, check_loss_scaling,
                                check_optimizer_holds, digest)
from fxpipe import quant
from fxpipe.checkpointing import Checkpointing
from fxpipe.config import RunConfig
from fxpipe.generating import Generating
from fxpipe.inspecting import Inspecting
from fxpipe.sequence_chunks import SequenceChunking
from fxpipe.optim import Overlapped, as_overlapped
from fxpipe.optim_step import watch_fused_steps
from fxpipe.graph_cache import (CompiledGraph, dynamic_dims, find, first_microbatch, plan_key,
                                run_type_of)
from fxpipe.passes import gc_paused
from fxpipe.passes.costs import compute_costs
from fxpipe.passes.layer_graph import LayerGraph
from fxpipe.passes.loss import loss_reads_dropped
from fxpipe.passes.partition import build_layer_graph, find_block_lists
from fxpipe.passes.schedule import optimizer_spec
from fxpipe.passes.stage import Executable
from fxpipe.plan import ExecutePlan
from fxpipe.runtime.devices import pinned
from fxpipe.runtime.issue.autograd import train_call
from fxpipe.runtime.devices.cuda import CudaDevice
from fxpipe.runtime.devices.device import Device
from fxpipe.runtime.issue.device_collectives import check_data_parallel
from fxpipe.runtime.issue.distributed import DataParallel
from fxpipe.runtime.devices.emulator import VirtualDevice
from fxpipe.runtime.stages.graphs import StageGraphs
from fxpipe.runtime.issue.inputs import check_labels_like_ids
from fxpipe.runtime.issue.microbatch import batch_rows, check_rows, split_input, split_label
from fxpipe.runtime.host.params import HostParams
from fxpipe.runtime.issue.pipeline import Runner, TrainCall
from fxpipe.runtime.devices.resolve import resolve_devices
from fxpipe.runtime.issue.trace import ActionLog
from fxpipe.runtime.host.weights import load as load_weights
from fxpipe.verbose import warn


def compile(  # noqa: A001 — the public name is fxpipe.compile, like torch.compile
    model: nn.Module,
    example_inputs: tuple = (),
    example_kwargs: dict | None = None,
    *,
    devices: Sequence[str | torch.device | Device] | None = None,
    capture: Literal["auto", "fx", "dynamo", "export", "blocks"] = "auto",
    layers: str | Sequence[str] | None = None,
    config: RunConfig | None = None,
    plan: ExecutePlan | None = None,
    param_dtype: torch.dtype | None = None,
    pin_memory: bool | None = None,
    data_parallel: bool | Literal["host", "device", "zero3"] = False,
    process_group: Any = None,
    shard_optimizer: bool = False,
    broadcast_buffers: bool = True,
    collective_timeout: float = 300.0,
    weights: str | os.PathLike | None = None,
    frozen_dtype: Literal["nf4", "int8", "fp8"] | None = None,
) -> PipelineModule:
    """Compile ``model`` into a pipeline of stages (capture → partition → costs → plan → lower).

    >>> import fxpipe
    >>> model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    >>> x = torch.randn(6, 4)
    >>> pipe = fxpipe.compile(model, example_inputs=(x,), devices=["cpu", "cpu"])
    >>> print(pipe)                 # a summary and what pipe(x) runs  # doctest: +ELLIPSIS
    # PipelineModule: 3 layers on vcpu:0, vcpu:1; plan fwd [0:2] bwd [2:3, 1:2, 0:1]
    ...
    def forward(self, input_1):
        input_1_0, input_1_1, input_1_2 = split(input_1, 3)       # the caller's inputs, 3 microbatches
        refresh()                                                 # RF host
        # stage 0 fwd | layers 0-1 (0, 1) | vcpu:0 | params 160 B | saved 288 B | out 192 B | ...
        params_0 = prefetch(self.stage_0, 'vcpu:0')               # 0P vcpu:0
    ...
        input_1_0_d0 = upload(input_1_0, 'vcpu:0')                # 0U0 vcpu:0
        relu_0_d0 = self.stage_0(params_0, input_1_0_d0)          # 0F0 vcpu:0
        relu_0 = offload(relu_0_d0)                               # 0O0 vcpu:0
    ...
        return commit(linear_1_0, linear_1_1, linear_1_2)         # C host
    <BLANKLINE>
    >>> print(pipe.code("fused"))   # every stage a training step runs  # doctest: +ELLIPSIS
    def forward(self, input_1):
        # stage 0 fwd | layers 0-1 (0, 1) | vcpu:0 | ...
    ...
    def forward(self, input_1):
        # stage 3 bwd | layer 0 (0) | vcpu:1 | ...
    ...
        input_1_dev = torch.ops.fxpipe.upload.default(input_1, 1);  input_1 = None
        # a recompute for backward skips linear, linear_host: backward needs only their inputs
        linear = torch._C._nn.linear(input_1_dev, _0_weight, _0_bias);  ...
        linear_host = torch.ops.fxpipe.offload.default(linear);  linear = None
    ...
    >>> pipe(x).sum().backward()    # gradients land in model's own parameters' .grad
    >>> model[0].weight.grad.shape
    torch.Size([8, 4])

    ``param_dtype`` (e.g. ``torch.bfloat16``): mixed precision. The model's parameters
    stay the (fp32) master weights; devices get copies cast to ``param_dtype`` (floating
    inputs too) and compute in it; gradients come back and are added to the masters'
    ``.grad`` in their own dtype. Each floating buffer is held in the dtype the model
    loaded in ``param_dtype`` holds it: a Hugging Face model as
    ``from_pretrained(..., dtype=param_dtype)`` gives it (rotary ``inv_freq`` stays
    fp32), any other module as ``module.to(param_dtype)`` does (docs/optimizer.md).

    The host holds the model once: on the first call, the parameters and buffers the
    pipeline uses move into one flat buffer per dtype, laid out in layer order, and the
    model's tensors become views of it (``fxpipe.runtime.host.params.HostParams``; the
    parameter objects, ``state_dict()`` and optimizers are unchanged). ``pin_memory``:
    whether the pipe's host memory is page-locked, so that GPUs copy to and from it
    without blocking the issuing thread: the flat parameter and gradient buffers, their
    upload copies (``param_dtype``, an asynchronous optimizer's snapshot), a copy of each
    parameter that could not move into them, and a per-call staging of what the call
    uploads, each at its size rounded up to a page (``runtime.devices.pinned``; torch's
    caching host allocator rounds up to a power of two). ``None``: pinned when every
    device is a GPU or a ``VirtualDevice(semantics="cuda")`` (emulated: no CUDA call);
    ``True`` without GPUs pins emulated. Pass ``False`` on a host that cannot pin the
    whole model. ``pipe.stats()``: ``host_pinned_bytes``, ``host_stalls``.

    ``data_parallel=True`` (every rank of an initialized ``torch.distributed`` job calls
    ``compile`` with the same model and plan): each rank runs its own pipeline on its
    share of the batch and the gradients are averaged across ``process_group`` (None:
    the default group) as ``DistributedDataParallel`` does: each backward stage's bucket
    is all-reduced by an ``AR`` action of the Program's host lane as soon as that stage's
    gradients are final, while the devices back-propagate the shallower stages, and a
    streamed optimizer steps the stage after it. ``pipe.no_sync()`` or
    ``forward_backward(..., sync_gradients=False)`` accumulate locally without the
    all-reduce (the next synchronized call averages the accumulated ``.grad``).
    ``broadcast_buffers``: rank 0's buffers go to every rank at the start of each
    synchronized training call (``BC``), DDP's default. ``shard_optimizer=True``: a call
    stepping ``optimizer=`` reduce-scatters each bucket instead, steps only this rank's
    1/N (the optimizer state of the rest lives on the other ranks), then all-gathers the
    updated parameters. Where every device is a GPU (or a cuda-semantics virtual device)
    ``True`` reduces on the devices instead (NCCL; gloo on virtual devices): each stage's
    ``sAR`` all-reduces its gradients, or with ``shard_optimizer=True`` its ``sRS``
    reduce-scatters them, each rank downloading 1/N. ``"host"`` or ``"device"`` (sharded)
    say where; ``"zero3"`` also shares one host copy of the parameters among one host's
    ranks, each uploading 1/N. With ``param_dtype`` the fp32 masters are
    sharded (each rank keeps its 1/N) and the trainable floating parameters become their
    ``param_dtype`` copies (gradients stay fp32 through ``grad_dtype``):
    ``pipe.full_state_dict()`` gathers the fp32 values, ``pipe.load_state_dict`` sets
    them. ``collective_timeout`` (seconds): how long a collective waits for the other
    ranks; a training call that fails on one rank fails on every rank with
    ``fxpipe.DistributedError`` naming the rank (``fxpipe.runtime.issue.distributed``).
    Ranks that compiled different plans or parameter shapes fail here with a
    ``ValueError`` saying where they differ.

    ``weights``: a safetensors checkpoint (a ``.safetensors`` file, a directory of shards
    with ``model.safetensors.index.json``, or a Hugging Face model directory) the model's
    parameters and buffers are bound to before capture; the model may be on the ``meta``
    device (``with torch.device("meta"): model = ...``). Keys map with Hugging Face's names
    (the ``base_model_prefix``, a PEFT wrapper's names; tied weights stay one tensor);
    missing, unexpected or mis-shaped keys raise one ``ValueError`` listing them, before
    anything is loaded. Frozen parameters (``requires_grad=False``, e.g. a LoRA base)
    stay read-only memory maps of the file: the page cache holds them, never anonymous
    memory, and uploads read them from there (in ``param_dtype``). Trainable ones and
    buffers move into the host buffers at the first call. ``pipe.save_pretrained(dir)``
    writes sharded safetensors back. See docs/weights.md (``fxpipe.runtime.host.weights``).

    ``frozen_dtype`` (``"nf4"``, ``"int8"``, ``"fp8"``): the weight of each frozen
    ``nn.Linear`` (a LoRA base), the output head excepted, is quantized in place (as it is
    read, with ``weights=``); the host holds, and uploads carry, those bytes (0.5625 a
    weight in NF4), and each stage dequantizes them on its device (``fxpipe.quant``). A
    model loaded with bitsandbytes' NF4 ``Linear4bit`` is adopted as it is, either way.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"fxpipe.compile expects an nn.Module, got {type(model).__name__}")
    example_inputs = as_example_tuple(example_inputs)
    if not example_inputs and not example_kwargs:
        raise ValueError(
            "fxpipe.compile needs example inputs to capture the model: "
            "fxpipe.compile(model, example_inputs=(x,)) or example_kwargs={'input_ids': ids}, "
            "shaped like a real batch.")
    if config is not None and not isinstance(config, RunConfig):
        raise TypeError(f"config must be an fxpipe.RunConfig, got {type(config).__name__}")
    if plan is not None and not isinstance(plan, ExecutePlan):
        raise TypeError(f"plan must be an fxpipe.ExecutePlan, got {type(plan).__name__}")
    if param_dtype is not None and not (isinstance(param_dtype, torch.dtype)
                                        and param_dtype.is_floating_point):
        raise TypeError(f"param_dtype must be a floating torch.dtype (torch.bfloat16, "
                        f"torch.float16) or None, got {param_dtype!r}")
    if pin_memory not in (None, True, False):
        raise TypeError(f"pin_memory must be True, False or None (pin when every device is "
                        f"a GPU or a cuda-semantics virtual device), got {pin_memory!r}")
    on_devices, zero3 = check_data_parallel(data_parallel)
    if not data_parallel:
        given = [name for name, value, default in (
            ("process_group", process_group, None), ("shard_optimizer", shard_optimizer, False),
            ("broadcast_buffers", broadcast_buffers, True),
            ("collective_timeout", collective_timeout, 300.0)) if value != default]
        if given:
            raise ValueError(f"{', '.join(given)} only apply with data_parallel=True: "
                             "fxpipe.compile(model, ..., data_parallel=True, "
                             f"{given[0]}=...) on every rank of a torch.distributed job")
    find_block_lists(model, layers)  # a bad layers= fails before anything slow runs
    if weights is not None:
        load_weights(model, weights)   # before capture: the model is real from here on
    quant.prepare(model, frozen_dtype)
    dp = DataParallel(process_group, timeout=collective_timeout,
                      shard=bool(shard_optimizer) or data_parallel in ("device", "zero3"),
                      broadcast=bool(broadcast_buffers), on_devices=on_devices,
                      zero3=zero3) if data_parallel else None
    resolved = resolve_devices(devices)
    watch_fused_steps()  # the user's fused optimizer steps must mark parameters changed
    return PipelineModule(model, example_inputs, dict(example_kwargs or {}), devices=resolved,
                          capture=capture, layers=layers, config=config or RunConfig(),
                          plan=plan, param_dtype=param_dtype, pin_memory=pin_memory, dp=dp)


def _pinning(pin_memory: bool | None, devices: Sequence[Device]) -> tuple[bool, bool]:
    """``(pin, emulated)`` for ``compile``'s ``pin_memory`` on ``devices``: by default
    pinned when every device is a GPU or a cuda-semantics virtual device; emulated (no
    CUDA call) when none is a GPU."""
    if pin_memory is None:
        pin = all(isinstance(d, CudaDevice) or (isinstance(d, VirtualDevice)
                                                and d.semantics == "cuda") for d in devices)
    else:
        pin = pin_memory
    return pin, pin and not any(isinstance(d, CudaDevice) for d in devices)


class PipelineModule(Inspecting, Checkpointing, Generating, SequenceChunking, nn.Module):
    """A model compiled into stages. Call it like the model; see ``fxpipe.compile``.

    Parameters stay the model's own (``pipe.module``): ``pipe.parameters()``,
    ``state_dict()`` and any ``torch.optim`` optimizer work on them directly.

    This class compiles and calls; what a pipe shows (``code``, ``program``, ``stats``...)
    is ``fxpipe.inspecting``'s, its checkpoints ``fxpipe.checkpointing``'s, its chunked
    calls ``fxpipe.sequence_chunks``'."""

    def __init__(self, model: nn.Module, example_args: tuple, example_kwargs: dict, *,
                 devices: list[Device], capture: str | Callable[[], fx.GraphModule],
                 layers: str | Sequence[str] | None, config: RunConfig,
                 plan: ExecutePlan | None, param_dtype: torch.dtype | None = None,
                 pin_memory: bool | None = None, dp: DataParallel | None = None,
                 infer_only: bool = False):
        super().__init__()
        self._infer_only = infer_only   # planned for inference (a generation's step pipe)
        self._dp = dp
        self._sync = True   # pipe.no_sync() sets it False
        self.module = model
        self.param_dtype = param_dtype
        self.pin_memory = pin_memory
        self.devices = devices
        self._pin, self._pin_emulated = _pinning(pin_memory, devices)
        # the page-locked staging of what calls upload from the caller (when pinning)
        self._staging = pinned.Staging(emulate=self._pin_emulated) if self._pin else None
        self.config = config
        self._capture = capture
        self._layers_path = layers
        self._user_plan = plan
        self._cache: list[CompiledGraph] = []
        self._varying: dict[int, set[int]] = {}  # tensor input -> dims seen with other sizes
        self._closed = False
        self._log = ActionLog()
        self._graphs = StageGraphs()   # stage_backend="cudagraphs": slots and graphs
        self._generation: list = []   # generation.Steps, by batch size and cache length
        self._warned_rows = False     # a batch with fewer rows than microbatches (_fit_rows)
        if dp is not None:   # (before the plan: whether it reduces on the devices)
            dp.check_devices(self.devices)
        self._current = self._compiled_for(example_args, example_kwargs)
        if dp is not None:
            dp.check_same(digest(self._current, param_dtype, dp))
            dp.prepare_params(self._current.layers.params, param_dtype, self._host_params())

    # -- compilation -------------------------------------------------------------------
    def _compiled_for(self, args: tuple, kwargs: dict) -> CompiledGraph:
        """The compiled graph serving this call (``graph_cache.find``), else a new capture."""
        args, kwargs = first_microbatch(args, kwargs)
        compiled, tensors = find(self._cache, self.module.training, args, kwargs)
        if compiled is not None:
            return compiled
        # every dim a custom split_input may split is symbolic (None)
        dynamic = None if self.config.split_input is not None else \
            dynamic_dims(self._cache, self._varying, tensors)
        with gc_paused():
            lg = build_layer_graph(self.module, args, kwargs, capture=self._capture,
                                   layers=self._layers_path, dynamic=dynamic,
                                   param_dtype=self.param_dtype,
                                   device_memory=min((d.memory_limit for d in self.devices
                                                      if d.memory_limit is not None), default=None))
            compute_costs(lg, [x for x in pytree.tree_leaves((args, kwargs))
                               if isinstance(x, torch.Tensor)])
        compiled = CompiledGraph(layers=lg, planner=self._plan_for, device_names=[d.name for d in self.devices])
        compiled.base = compiled
        # planned now, so a plan that cannot be (or the user's, if bad) fails before
        # anything runs: the chain forward_backward runs unless asked for the logits
        (compiled if self._infer_only else compiled.trimmed(self.module)).plan
        self._cache.append(compiled)
        return compiled

    def _plan_for(self, lg: LayerGraph) -> ExecutePlan:
        """The plan of a chain: the user's, or ``ExecutePlan.auto``'s for its costs."""
        cfg = self._config(None)
        with gc_paused():
            plan = self._user_plan or ExecutePlan.auto(
                "infer" if self._infer_only else "fused",
                _Planned(lg, self.devices, cfg, self._dp),
                num_microbatch=cfg.num_microbatch,
                recompute_grain=cfg.recompute_grain)
        plan.validate(len(lg), run_type_of(plan, len(lg)))
        return plan

    def _for_loss(self, compiled: CompiledGraph, loss_fn: Callable, label: Any,
                  return_outputs: bool) -> CompiledGraph:
        """The chain a fused call runs: without the outputs no loss reads (the logits
        beside a Hugging Face model's own loss, ``fxpipe.passes.loss``) unless the call
        returns its outputs or ``loss_fn`` reads them (``loss_reads_dropped``)."""
        base = compiled.base
        if return_outputs or not base.layers.loss_free_outputs:
            return base
        if loss_reads_dropped(base.layers, loss_fn, label):
            base.kept_outputs = True
            return base
        return base.trimmed(self.module)

    # -- calling -----------------------------------------------------------------------
    def forward(self, *args: Any, run_config: RunConfig | None = None, **kwargs: Any) -> Any:
        self._check_open()
        if self._chunked_call(cfg := self._config(run_config)):
            return self._chunked(args, kwargs, cfg)
        cfg = self._fit_rows(cfg, args, kwargs)
        self._check_call(args, kwargs, None, cfg)
        compiled = self._compiled_for(args, kwargs)
        self._current = compiled
        runner = self._runner(compiled, cfg)
        params = [p for p in self.module.parameters() if p.requires_grad]
        leaves = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
        needs_grad = cfg.requires_grad and (params or any(x.requires_grad for x in leaves))
        if not needs_grad:
            with torch.no_grad():
                return runner.infer(args, kwargs, cfg)
        check_differentiable(args, kwargs, cfg)
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
        return train_call(TrainCall(runner, args, kwargs, cfg, sync=self._sync), inputs, params)

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
        optimizer: torch.optim.Optimizer | Any = None,
        sync_gradients: bool | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, Any]:
        """Forward, loss and backward as one fused pipelined step; returns the loss
        detached on the host (and the merged outputs with ``return_outputs=True``).

        The tail layers (the first backward stage) run forward, loss and backward in one
        go and are never recomputed. ``loss_fn(out, label)`` runs per microbatch and
        returns a 0-dim loss, or ``(sum, count)``. With ``loss_reduction="mean"`` each
        microbatch's loss is weighted by its share of the batch, so that the loss and the
        ``.grad``s equal eager ``loss_fn(model(*args, **kwargs), label).backward()`` for any
        ``num_microbatch``: its share of the target tokens where ``loss_fn`` returns the
        model's own mean over them (a Hugging Face model's ``labels=`` loss, ``-100``
        padding included: ``fxpipe.passes.token_means``), of a ``(sum, count)`` pair's
        count (the sums divided by the batch's count, which must come from the label
        alone), else of the rows (``fxpipe.runtime.issue.loss_weights``). ``"sum"`` adds the
        microbatch losses unweighted.

        ``optimizer``: a torch optimizer (or ``fxpipe.optim.overlapped(opt, ...)``) to
        step in this call, each stage's parameters as soon as their gradients are final,
        overlapped with the rest of the backward; the result equals eager
        ``loss.backward(); opt.step()``. See ``fxpipe.optim``.

        ``sync_gradients`` (``data_parallel=True``): whether this call averages the
        gradients across ranks. ``None``: it does, unless inside ``pipe.no_sync()`` or
        when ``optimizer=`` does not step in this call (``overlapped(opt, accumulate=k)``
        between steps); ``False`` accumulates this rank's gradients into ``.grad`` only,
        as ``DistributedDataParallel.no_sync()`` does.
        """
        if loss_reduction not in ("mean", "sum"):
            raise ValueError(f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}")
        if not isinstance(input_args, tuple):
            raise TypeError(f"input_args must be a tuple, got {type(input_args).__name__}")
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
        self._check_open()
        kwargs = dict(input_kwargs or {})
        if self._chunked_call(cfg := self._config(run_config)):
            return self._chunked(input_args, kwargs, cfg, dict(
                label=label, loss_fn=loss_fn, loss_reduction=loss_reduction, optimizer=optimizer,
                return_outputs=return_outputs, sync_gradients=sync_gradients))
        cfg = self._fit_rows(cfg, input_args, kwargs)
        self._check_call(input_args, kwargs, label, cfg)
        compiled = self._for_loss(self._compiled_for(input_args, kwargs), loss_fn, label,
                                  return_outputs)
        self._current = compiled
        if optimizer is not None:
            optimizer = as_overlapped(optimizer)
            check_optimizer_holds(optimizer.optimizer, self.module)
        check_loss_scaling(self.param_dtype, optimizer)
        if sync_gradients not in (None, True, False):
            raise TypeError(f"sync_gradients must be True, False or None, got {sync_gradients!r}")
        sync = self._sync if sync_gradients is None else sync_gradients
        if sync_gradients is None and optimizer is not None and not optimizer.will_step():
            sync = False   # accumulating between steps: the stepping call averages the sum
        if not sync and optimizer is not None and optimizer.will_step() and self._dp is not None:
            raise ValueError(
                "forward_backward(optimizer=..., sync_gradients=False) (or inside pipe.no_sync()) "
                "would step each rank with its own gradients and the ranks' parameters would "
                "differ: synchronize the call that steps (leave sync_gradients=None, outside "
                "no_sync())")
        loss, outputs = self._runner(compiled, cfg).fused(
            input_args, kwargs, label, loss_fn, loss_reduction, cfg, return_outputs, optimizer,
            sync=sync)
        return (loss, outputs) if return_outputs else loss

    def close(self) -> None:
        """Finish queued work and stop the devices' worker threads; the pipe cannot be
        called afterwards (its model and parameters are untouched). Idempotent.

        Workers start on the first call; without ``close()`` they stop when their devices
        are garbage-collected (devices ``compile`` made belong to the pipe alone). Devices
        passed in by the caller stay usable by other pipes: their workers restart on use.
        Also a context manager: ``with fxpipe.compile(model, ...) as pipe: ...``.
        """
        if self._closed:
            return
        self._closed = True
        for device in self.devices:
            device.stop_workers()
        self._graphs.close()   # the parameter slots and the graphs' buffers
        pinned.trim()   # the page-locked blocks its activations were offloaded into
        if self._dp is not None:
            self._dp.close()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """``data_parallel=True``: training calls inside the block accumulate this rank's
        gradients into ``.grad`` without averaging them across ranks (no ``AR`` in their
        Program), as ``DistributedDataParallel.no_sync()``; the first synchronized call
        after it averages the accumulated ``.grad``. For eager-style training, the
        forward (``pipe(x)``) decides, as in DDP::

            with pipe.no_sync():
                for x, y in microsteps[:-1]:
                    pipe.forward_backward((x,), label=y, loss_fn=ce)
            pipe.forward_backward((x_last,), label=y_last, loss_fn=ce, optimizer=opt)
        """
        if self._dp is None:
            raise ValueError("pipe.no_sync() applies to data-parallel pipes only: "
                             "fxpipe.compile(..., data_parallel=True)")
        before, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = before

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this PipelineModule was closed (pipe.close()); compile the model "
                               "again with fxpipe.compile(...) to keep using it")

    def __enter__(self) -> PipelineModule:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _config(self, run_config: RunConfig | None) -> RunConfig:
        if run_config is not None and not isinstance(run_config, RunConfig):
            raise TypeError(f"run_config must be an fxpipe.RunConfig, got {type(run_config).__name__}")
        return RunConfig.merge(self.config, run_config).resolved(  # GPUs: "auto" compiles
            len(self.devices), all(d.compiles_by_default for d in self.devices))

    def _check_call(self, args: tuple, kwargs: dict, label: Any, cfg: RunConfig) -> None:
        """Before anything of a call runs (a capture included): its inputs' (and label's)
        rows split alike (``check_rows``), and its ``labels=`` shaped like its
        ``input_ids`` where the example's were (``check_labels_like_ids``)."""
        if cfg.split_input is None:
            check_rows(args, kwargs, label if cfg.split_label is None else None,
                       cfg.num_microbatch)
        check_labels_like_ids(self._cache[0].layers, self.module, kwargs)

    def _fit_rows(self, cfg: RunConfig, args: tuple, kwargs: dict) -> RunConfig:
        """A batch with fewer rows than ``num_microbatch`` (a DataLoader's last batch)
        runs as one microbatch per row, with a warning the first time; the default split
        only (a custom ``split_input`` decides itself)."""
        rows = batch_rows(args, kwargs)
        if rows is None or rows >= cfg.num_microbatch or cfg.split_input is not None:
            return cfg
        if not self._warned_rows:
            self._warned_rows = True
            warn(f"fxpipe: a batch of {rows} row(s) runs as {rows} microbatch(es), not "
                 f"num_microbatch={cfg.num_microbatch} (each microbatch needs a row; said once "
                 "per pipe)")
        return dataclasses.replace(cfg, num_microbatch=rows)

    def _runner(self, compiled: CompiledGraph, cfg: RunConfig) -> Runner:
        plan = cfg.execute_plan or compiled.plan
        if plan is not compiled.plan:
            plan.validate(len(compiled.layers), run_type_of(plan, len(compiled.layers)))
        key = plan_key(plan)  # equal plans share one runner (a new ExecutePlan per call is fine)
        if key not in compiled.runners:
            compiled.runners[key] = Runner(
                compiled.layers, self.devices, functools.partial(compiled.executable, plan),
                compiled.differentiable, self._host_params, compiled.timer,
                param_dtype=self.param_dtype, log=self._log, dp=self._dp, staging=self._staging,
                graphs=self._graphs)
        return compiled.runners[key]

    def _host_params(self) -> HostParams:
        """The model's host buffers (``HostParams``; the first pipe to make them decides
        how they are pinned)."""
        return HostParams.of(self.module, pin=self._pin, emulate=self._pin_emulated)

    # -- what a call runs -------------------------------------------------------
    def _microbatch_example(self, num_microbatch: int, label: Any = None) -> tuple[list, Any]:
        """The first microbatch of the example (and of ``label``): what memory is costed on."""
        return _microbatch_example(self.layers, self.config, num_microbatch, label)

    def _executable(self, run_type: str, num_microbatch: int | None = None, *,
                    optimizer: Any = False, grain: str | None = None,
                    return_outputs: bool = False, sync_gradients: bool = True,
                    input_grads: Sequence[str] = (), compiled: CompiledGraph | None = None,
                    plan: ExecutePlan | None = None, chunks: int | None = None) -> Executable:
        """The (cached) Executable a call of this kind runs with the pipe's config: the
        call's own ``CallSpec`` (``Runner.spec``) built from these arguments, for the
        graph of the last call (or ``compiled``), under its plan (or ``plan``); ``chunks``:
        a chunk step pipe's call of that many sequence chunks."""
        if run_type not in ("infer", "train", "fused"):
            raise ValueError(f"run_type must be 'infer', 'train' or 'fused', got {run_type!r}")
        if grain not in (None, "stage", "layer"):
            raise ValueError(f"grain must be 'stage' or 'layer', got {grain!r}")
        if isinstance(optimizer, (torch.optim.Optimizer, Overlapped)):
            spec = as_overlapped(optimizer).spec()
        else:
            spec = optimizer_spec(optimizer)
        cfg = self._config(RunConfig(num_microbatch=num_microbatch, recompute_grain=grain,
                                     execute_plan=plan, sequence_chunks=chunks))
        compiled = (compiled or self._current).base
        if run_type == "fused" and not return_outputs:
            compiled = compiled.fused(self.module)     # what forward_backward runs (_for_loss)
        runner = self._runner(compiled, cfg)
        return runner.executable_for(runner.spec(
            run_type, cfg.num_microbatch, cfg, optimizer=spec, outputs=return_outputs,
            sync=sync_gradients, input_grads=input_grads), cfg)


@dataclass
class _Planned:
    """What ``ExecutePlan.auto`` reads of a pipe, before the pipe exists."""

    layers: LayerGraph
    devices: list[Device]
    config: RunConfig
    _dp: DataParallel | None = None   # data_parallel="device": room for its reduce-scatters

    def _microbatch_example(self, num_microbatch: int, label: Any = None) -> tuple[list, Any]:
        return _microbatch_example(self.layers, self.config, num_microbatch, label)


def _microbatch_example(lg: LayerGraph, config: RunConfig, num_microbatch: int,
                        label: Any = None) -> tuple[list, Any]:
    """The flat tensor inputs (and the label) of the first, largest microbatch the
    example splits into under ``config`` (what ``fxpipe.memory.chain_memory`` costs); an
    example too small to split, whole."""
    args, kwargs = pytree.tree_unflatten(lg.example_leaves, lg.in_spec)
    try:
        parts = split_input(args, kwargs, num_microbatch, config.split_input)
        labels = None if label is None else split_label(label, num_microbatch, config.split_label)
    except ValueError:
        return [x for x in lg.example_leaves if isinstance(x, torch.Tensor)], label
    leaves = pytree.tree_leaves((parts[0][0], parts[1][0]))
    return [x for x in leaves if isinstance(x, torch.Tensor)], None if labels is None else labels[0]
