"""``FxpipeTrainer``: a ``transformers.Trainer`` that trains through an fxpipe pipeline.

Constructed like ``Trainer`` (plus ``fxpipe_config=``, ``devices=``, ``plan=``,
``param_dtype=``), it compiles the model on the first batch and runs each training step
as one fused ``pipe.forward_backward``; the Trainer's own loop does the rest (gradient
accumulation, ``max_grad_norm`` clipping, the optimizer and scheduler it builds,
logging, evaluation, checkpoints and resume, callbacks)::

    from fxpipe.integrations.transformers import FxpipeTrainer
    trainer = FxpipeTrainer(model=model, args=TrainingArguments(...),
                            train_dataset=ds, devices=["cuda:0", "cuda:1"])
    trainer.train()

How a step maps onto the pipe:

- the loss is the Trainer's: ``compute_loss`` runs once per microbatch inside the pipe's
  fused tail on that microbatch's outputs (the model's own ``labels=`` loss,
  ``compute_loss_func``, label smoothing, a subclass's ``compute_loss`` such as TRL's).
  When the loss is normalized by the step's token count (``num_items_in_batch``, what
  Trainer does for models that accept loss kwargs), microbatch losses add
  (``loss_reduction="sum"``), so loss and gradients equal one eager pass over the batch,
  padding included; otherwise each microbatch's mean is weighted by its rows.
- the optimizer (``stream_optimizer=None``: when it allows, i.e. a ``torch.optim``
  optimizer with a per-parameter update: SGD, Adam, AdamW, ...): the accumulation step
  that ends an optimizer step passes it to ``forward_backward`` as
  ``fxpipe.optim.overlapped(opt, max_grad_norm=args.max_grad_norm)``, so each stage is
  stepped as soon as its gradients are final (clipping speculated, redone when the norm
  exceeds the limit); the Trainer's own ``optimizer.step()`` then does nothing, its
  scheduler steps as usual. The logged ``grad_norm`` is the norm before clipping, as
  the plain Trainer logs it (``Overlapped.grad_norm``).
  ``stream_optimizer=False``: the Trainer steps after the call.
- gradient accumulation: each accumulation step is one ``forward_backward`` call adding
  into ``.grad``; the pipe also splits each batch into ``fxpipe_config.num_microbatch``
  microbatches (default: devices + 1).
- the parameters stay the model's, on the host: the Trainer's optimizer, clipping,
  ``save_model`` and checkpoints see them unchanged. The model is never moved to
  ``args.device`` nor wrapped in ``DataParallel``/``DistributedDataParallel``.
- ``args.bf16``: devices compute in bfloat16 copies of the fp32 masters
  (``param_dtype=torch.bfloat16``, the default); with ``param_dtype=torch.float32`` the
  parameters stay fp32 and each call runs under ``torch.autocast(..., torch.bfloat16)``,
  as the plain Trainer's model does. Never silently in fp32.
- ``fxpipe_config=RunConfig(sequence_chunks=K)``: each step's rows run as ``K`` token
  chunks (``fxpipe.sequence_chunks``) with the model's own ``labels=`` loss over
  ``num_items_in_batch``; what would need the whole logits (label smoothing,
  ``compute_loss_func``, a ``compute_loss`` override) is refused at construction.
- ``evaluate()`` / ``predict()`` run the model through the pipe (a second pipe for the
  evaluation batches' keys, compiled on their first batch).
- under ``torchrun`` / ``accelerate launch`` (``torch.distributed`` initialized, world
  size > 1) the training pipe is compiled with ``data_parallel=True``: each rank trains
  its share of the batch and gradients are averaged in the pipeline's backward (on the
  GPUs, NCCL, where every device is one; else on the host, gloo); the Trainer's
  non-final accumulation steps run under ``pipe.no_sync()``.
  ``data_parallel="device"``: the gradients reduce-scattered on the devices, each rank
  stepping 1/N of the optimizer (and of the fp32 masters under ``bf16``) in the pipe,
  clipping included; its checkpoints hold the shards (``fxpipe_shards/``, written by
  every rank with ``pipe.save_checkpoint``) and resume from them exactly.
  ``data_parallel="zero3"`` (one host's ranks): the same, with one host copy of the
  parameters shared by the ranks, each uploading 1/N of every stage.

Options fxpipe cannot honour raise at construction: DeepSpeed, FSDP, ``fp16`` (loss
scaling), LOMO optimizers. ``gradient_checkpointing=True`` (TRL's default) is turned off:
fxpipe recomputes each stage's forward for its backward already; TRL's default
``loss_type="chunked_nll"`` becomes ``"nll"`` (the same math; its chunk loop cannot be
captured). TRL: ``fxpipe_trainer(trl.SFTTrainer)(model=..., args=SFTConfig(...), ...)``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

try:
    import transformers
except ImportError as e:   # the core depends on torch alone
    raise ImportError("fxpipe.integrations.transformers needs transformers (and accelerate): "
                      "pip install 'fxpipe[hf]'") from e

import fxpipe
from fxpipe.integrations.trainer_options import (check_args, check_chunks, check_trainer,
                                                torch_compile_config)
from fxpipe.runtime.devices.cuda import CudaDevice
from fxpipe.runtime.issue.microbatch import merge_output

__all__ = ["FxpipeMixin", "FxpipeTrainer", "fxpipe_trainer"]
SHARDS = "fxpipe_shards"   # a checkpoint's folder of optimizer shards (data_parallel="device")
SHARDING = ("device", "zero3")   # the data_parallel= values that step each rank's shard


class _Replay(nn.Module):
    """Stands in for the model inside ``compute_loss``, which runs per microbatch in the
    pipe's tail: calling it returns the outputs the pipe computed for that microbatch."""

    def __init__(self, model: nn.Module, outputs: Any):
        super().__init__()
        object.__setattr__(self, "_model", model)   # not a submodule: no parameters
        object.__setattr__(self, "_outputs", outputs)

    def forward(self, *args: Any, fused_lm_head: bool = False, **kwargs: Any) -> Any:
        if fused_lm_head and not hasattr(self._outputs, "log_probs"):
            return _fused_head(self._outputs, kwargs.get("labels"),
                               kwargs.get("num_items_in_batch"))
        return self._outputs

    def _get_name(self) -> str:   # compute_loss picks label smoothing's shift by it
        model = self._model
        if _is_peft(model):
            return model.base_model.model._get_name()
        return model._get_name()

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._model, name)


def _fused_head(outputs: Any, labels: torch.Tensor | None,
                num_items_in_batch: torch.Tensor | int | None) -> Any:
    """What TRL's fused LM head (``trl.trainer.utils.add_fused_lm_head``: SFTTrainer calls
    ``model(..., fused_lm_head=True)``) returns, from the logits the pipe computed: per
    next-token label (0 where it is -100) its log-probability, the entropy of the
    distribution and whether it is the most likely token; the loss their negated sum over
    ``num_items_in_batch`` (the label count when None). The head itself, chunked over the
    vocabulary, is a loop no capture can trace; the pipe runs the model's own forward."""
    from trl.trainer.utils import FusedCausalLMOutput
    if labels is None:
        raise ValueError("FxpipeTrainer: the fused LM head (fused_lm_head=True) needs labels=")
    logits = outputs["logits"][:, :-1].float()
    labels = labels[:, 1:].to(logits.device)
    mask = labels != -100
    logp = logits.log_softmax(-1)
    log_probs = logp.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1).masked_fill(~mask, 0)
    entropy = -(logp.exp() * logp).sum(-1).masked_fill(~mask, 0)
    is_top1 = (logits.argmax(-1) == labels) & mask
    count = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
    return FusedCausalLMOutput(loss=-log_probs.sum() / count, log_probs=log_probs,
                               entropy=entropy.detach(), is_top1=is_top1, label_mask=mask)


class _PipedModel(nn.Module):
    """What the Trainer's loop holds as its (wrapped) model: the user's model (its
    parameters, ``train()``/``eval()``, ``zero_grad()``) whose calls run through the
    trainer's pipes. Returned by ``_wrap_model`` so that neither accelerate nor the
    Trainer wraps the model in DataParallel / DistributedDataParallel or moves it."""

    def __init__(self, trainer: FxpipeMixin, model: nn.Module):
        super().__init__()
        self.module = model
        object.__setattr__(self, "_trainer", trainer)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        trainer = self._trainer
        run_config = None
        if trainer.model_accepts_loss_kwargs and "labels" in kwargs:
            # the batch's loss exactly, padding included: each microbatch's loss normalized
            # by the batch's label count (as Trainer passes it), the microbatch losses added
            n = kwargs.get("num_items_in_batch")
            if n is None:
                n = trainer._get_num_items_in_batch([kwargs], torch.device("cpu"))
            if isinstance(n, int):
                n = torch.tensor(n)
            if isinstance(n, torch.Tensor):
                kwargs = {**kwargs, "num_items_in_batch": n.detach().cpu()}
                run_config = fxpipe.RunConfig(merge_output=_sum_loss)
        pipe = trainer._fxpipe_pipe(args, kwargs, training=False)
        with trainer._fxpipe_autocast(pipe):
            return pipe(*args, run_config=run_config, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulation steps before the last: no gradient averaging across ranks (the
        training step runs its call under ``pipe.no_sync()``, also the first one, which
        compiles the pipe)."""
        trainer = self._trainer
        trainer._fxpipe_unsynced = True
        try:
            yield
        finally:
            trainer._fxpipe_unsynced = False


def _sum_loss(outputs: list) -> Any:
    """Merge microbatch outputs as usual, their ``loss`` (each already divided by the
    batch's label count) added."""
    merged = merge_output(outputs)
    first = outputs[0]
    loss = first.get("loss") if isinstance(first, dict) else None
    if isinstance(loss, torch.Tensor):
        merged["loss"] = sum(out["loss"] for out in outputs)
    return merged


def _is_peft(model: nn.Module) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def _signature(args: tuple, kwargs: dict) -> tuple:
    """The structure of a call's inputs: one pipe serves calls of one structure."""
    def leaf(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return ("tensor", x.dim(), x.dtype)
        return ("value", type(x).__name__)
    return (tuple(leaf(a) for a in args), tuple(sorted((k, leaf(v)) for k, v in kwargs.items())))


class FxpipeMixin:
    """The fxpipe part of ``FxpipeTrainer``; mix it in front of any ``Trainer`` subclass
    (``fxpipe_trainer(trl.SFTTrainer)``)."""

    def __init__(self, *args: Any, fxpipe_config: fxpipe.RunConfig | None = None,
                 devices: Sequence[Any] | None = None, plan: fxpipe.ExecutePlan | None = None,
                 param_dtype: torch.dtype | None = None, stream_optimizer: bool | None = None,
                 data_parallel: bool | str = True, **kwargs: Any):
        if fxpipe_config is not None and not isinstance(fxpipe_config, fxpipe.RunConfig):
            raise TypeError(f"fxpipe_config must be an fxpipe.RunConfig, got "
                            f"{type(fxpipe_config).__name__}")
        if plan is not None and not isinstance(plan, fxpipe.ExecutePlan):
            raise TypeError(f"plan must be an fxpipe.ExecutePlan, got {type(plan).__name__}")
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        check_args(training_args)
        fxpipe_config = torch_compile_config(training_args, fxpipe_config)
        if getattr(training_args, "bf16", False) and \
                param_dtype not in (None, torch.bfloat16, torch.float32):
            raise ValueError(f"FxpipeTrainer: TrainingArguments(bf16=True) with "
                             f"param_dtype={param_dtype}: leave param_dtype out (bfloat16 "
                             "device copies of the fp32 masters) or give torch.float32 (fp32 "
                             "parameters, the calls autocast to bfloat16)")
        self._fxpipe_config = fxpipe_config
        self._fxpipe_devices = list(devices) if devices is not None else None
        self._fxpipe_plan = plan
        self._fxpipe_param_dtype = param_dtype
        if stream_optimizer not in (None, True, False):
            raise TypeError(f"stream_optimizer must be True, False or None (stream when the "
                            f"optimizer allows), got {stream_optimizer!r}")
        self._fxpipe_stream = stream_optimizer
        if data_parallel not in (True, "host", "device", "zero3"):
            raise ValueError(f"FxpipeTrainer: data_parallel must be True, 'host', 'device' "
                             f"or 'zero3' (under torchrun), got {data_parallel!r}")
        if data_parallel in SHARDING and stream_optimizer is False:
            raise ValueError(f"FxpipeTrainer(data_parallel={data_parallel!r}) steps each rank's "
                             "shard of the optimizer in the pipe: leave stream_optimizer on")
        self._fxpipe_dp = data_parallel
        self._fxpipe_resume: str | None = None   # sharded state to load into the train pipe
        self._fxpipe_unsynced = False   # inside the accumulation's no_sync()
        self._fxpipe_stepped = False
        self._fxpipe_pipes: dict[tuple, fxpipe.PipelineModule] = {}
        self._fxpipe_train_pipe: fxpipe.PipelineModule | None = None
        self._fxpipe_wrapped: _PipedModel | None = None
        self._fxpipe_group: Any = None
        super().__init__(*args, **kwargs)
        check_trainer(self)
        check_chunks(self)

    # -- the pipes -------------------------------------------------------------------------
    def _fxpipe_pipe(self, args: tuple, kwargs: dict, *, training: bool) -> fxpipe.PipelineModule:
        """The pipe for calls shaped like ``(args, kwargs)``, compiled on the first one."""
        key = (training, _signature(args, kwargs))
        pipe = self._fxpipe_pipes.get(key)
        if pipe is None:
            dtype = self._fxpipe_param_dtype
            if dtype is None and self.args.bf16:
                dtype = torch.bfloat16

            _checkpointing_off(self.model)   # fxpipe recomputes each stage itself
            dp = training and dist.is_available() and dist.is_initialized() \
                and dist.get_world_size() > 1
            extra = {}
            if dp:
                # a group of its own: the pipe's all-reduces run on its host lane while the
                # Trainer's code in the tail (TRL's gather_for_metrics) may use the default
                if self._fxpipe_group is None:
                    self._fxpipe_group = dist.new_group()
                extra["process_group"] = self._fxpipe_group
            pipe = fxpipe.compile(self.model, example_inputs=tuple(args), example_kwargs=kwargs,
                                  devices=self._fxpipe_devices, config=self._fxpipe_config,
                                  plan=self._fxpipe_plan, param_dtype=dtype,
                                  data_parallel=self._fxpipe_dp if dp else False, **extra)
            self._fxpipe_pipes[key] = pipe
            if training and self._fxpipe_resume is not None:   # (_load_optimizer_and_scheduler)
                pipe.load_checkpoint(self._fxpipe_resume, self._fxpipe_inner())
                self._fxpipe_resume = None
        if training:
            self._fxpipe_train_pipe = pipe
        return pipe

    def _fxpipe_autocast(self, pipe: fxpipe.PipelineModule) -> contextlib.AbstractContextManager:
        """``args.bf16`` with a pipe whose devices compute in fp32 (``param_dtype=
        torch.float32`` given): ``torch.autocast`` to bfloat16 around its calls, on its
        devices' type, as the plain Trainer autocasts the model's forward; else nothing
        (``param_dtype=torch.bfloat16`` computes in bfloat16 already). Never fp32 silently."""
        if not self.args.bf16 or pipe.param_dtype == torch.bfloat16:
            return contextlib.nullcontext()
        cuda = any(isinstance(d, CudaDevice) for d in pipe.devices)
        return torch.autocast("cuda" if cuda else "cpu", dtype=torch.bfloat16)

    def close_pipes(self) -> None:
        """Stop the pipes' device workers (the model and its parameters stay)."""
        for pipe in self._fxpipe_pipes.values():
            pipe.close()
        self._fxpipe_pipes.clear()
        self._fxpipe_train_pipe = None

    # -- Trainer hooks -----------------------------------------------------------------------
    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader: Any = None):
        if isinstance(model, _PipedModel):
            return model
        if self._fxpipe_wrapped is None or self._fxpipe_wrapped.module is not self.model:
            self._fxpipe_wrapped = _PipedModel(self, self.model)
        return self._fxpipe_wrapped

    def _move_model_to_device(self, model: nn.Module, device: torch.device) -> None:
        """The parameters stay in host memory: the pipe uploads what each stage needs."""

    def _prepare_input(self, data: Any) -> Any:
        """Batches stay on the host: the pipe uploads each microbatch to its device."""
        if isinstance(data, dict):
            return type(data)({k: self._prepare_input(v) for k, v in data.items()})
        if isinstance(data, (tuple, list)):
            return type(data)(self._prepare_input(v) for v in data)
        return data

    def _get_num_items_in_batch(self, batch_samples: list, device: torch.device):
        # single-process multi-GPU is fxpipe's pipeline, not DataParallel: no n_gpu split
        n_gpu = self.args._n_gpu
        self.args._n_gpu = 1
        try:
            return super()._get_num_items_in_batch(batch_samples, torch.device("cpu"))
        finally:
            self.args._n_gpu = n_gpu

    def training_step(self, model: nn.Module, inputs: dict[str, Any],
                      num_items_in_batch: torch.Tensor | int | None = None) -> torch.Tensor:
        """One accumulation step: ``compute_loss`` per microbatch in the pipe's fused tail,
        backward into the model's ``.grad`` (the Trainer's loop then clips and steps)."""
        self.model.train()
        if hasattr(self.optimizer, "train") and callable(self.optimizer.train):
            self.optimizer.train()
        inputs = self._prepare_inputs(inputs)
        model_inputs = dict(inputs)
        if (self.label_smoother is not None or self.compute_loss_func is not None) \
                and "labels" in model_inputs:
            model_inputs.pop("labels")
        if isinstance(num_items_in_batch, torch.Tensor):
            num_items_in_batch = num_items_in_batch.detach().cpu()
        elif isinstance(num_items_in_batch, int):
            num_items_in_batch = torch.tensor(num_items_in_batch)
        if self.model_accepts_loss_kwargs and num_items_in_batch is not None:
            model_inputs["num_items_in_batch"] = num_items_in_batch
        # older transformers (5.17, the GPU machines') have no loss_is_scaled_for_ga: their
        # Trainer decides as below
        scaled = getattr(self, "loss_is_scaled_for_ga", None)
        if scaled is None:
            scaled = (self.model_accepts_loss_kwargs and num_items_in_batch is not None) \
                or self.compute_loss_func is not None
        ga = self.current_gradient_accumulation_steps
        trainer, module = self, self.model
        # token chunks (``fxpipe.sequence_chunks``): each chunk's compute_loss is the model's
        # own labels= loss (check_chunks), over the step's num_items_in_batch
        chunked = self._fxpipe_config is not None and \
            self._fxpipe_config.sequence_chunks is not None

        def loss_fn(outputs: Any, mb_inputs: Any) -> torch.Tensor:
            loss = trainer.compute_loss(_Replay(module, outputs), dict(mb_inputs or {}),
                                        num_items_in_batch=num_items_in_batch)
            return loss if scaled else loss / ga

        pipe = self._fxpipe_pipe((), model_inputs, training=True)
        step = self._fxpipe_streamed_step()
        summed = "num_items_in_batch" in model_inputs if chunked else scaled
        label = None if chunked else dict(inputs)
        unsynced = pipe.no_sync() if self._fxpipe_unsynced and pipe._dp is not None \
            else contextlib.nullcontext()
        with self._fxpipe_autocast(pipe), unsynced:
            loss = pipe.forward_backward((), model_inputs, label=label, loss_fn=loss_fn,
                                         loss_reduction="sum" if summed else "mean",
                                         optimizer=step)
        if step is not None:
            self._fxpipe_skip_next_step()
        return loss.to(self.args.device)

    # -- the streamed optimizer --------------------------------------------------------------
    def _fxpipe_streamed_step(self) -> Any:
        """On the accumulation step that ends an optimizer step: the Trainer's optimizer as
        an ``fxpipe.optim.overlapped`` step streamed into the pipeline's backward (each
        stage stepped as soon as its gradients are final; clipping speculated), when the
        optimizer allows it; else None (the Trainer steps after the call)."""
        if self._fxpipe_stream is False or not self.accelerator.gradient_state.sync_gradients:
            return None
        inner = self._fxpipe_inner()
        reason = _why_not_streamed(self, inner)
        if reason is not None:
            if self._fxpipe_stream or self._fxpipe_dp in SHARDING:
                raise NotImplementedError(f"FxpipeTrainer(stream_optimizer=True or data_parallel="
                                          f"{self._fxpipe_dp!r}): {reason}")
            return None
        clip = self.args.max_grad_norm if self.args.max_grad_norm and \
            self.args.max_grad_norm > 0 else None
        step = inner.__dict__.get("_fxpipe_trainer_step")
        if step is None or step.max_grad_norm != clip:
            step = fxpipe.optim.overlapped(inner, max_grad_norm=clip)
            inner.__dict__["_fxpipe_trainer_step"] = step
        return step

    def _fxpipe_inner(self) -> torch.optim.Optimizer:
        return getattr(self.optimizer, "optimizer", self.optimizer)

    def _fxpipe_train_dp(self) -> Any:
        """The training pipe's ``DataParallel``, or None."""
        pipe = self._fxpipe_train_pipe
        return pipe._dp if pipe is not None else None

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """``data_parallel="device"``: every rank writes its optimizer shards (and fp32
        masters) with ``pipe.save_checkpoint``; the scheduler as the Trainer saves it."""
        dp = self._fxpipe_train_dp()
        if dp is None or not dp.shard:
            return super()._save_optimizer_and_scheduler(output_dir)
        self._fxpipe_train_pipe.save_checkpoint(os.path.join(output_dir, SHARDS),
                                                self._fxpipe_inner())
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, "scheduler.pt"))

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Under sharded fp32 masters (``data_parallel="device"`` with ``bf16``) the model's
        parameters are their bf16 copies: every rank gathers the masters
        (``pipe.full_state_dict``), rank 0 saves them, so the saved model is the fp32 one
        the unsharded Trainer saves."""
        dp = self._fxpipe_train_dp()
        if dp is None or not dp.masters:
            return super().save_model(output_dir, _internal_call)
        state = self._fxpipe_train_pipe.full_state_dict()
        if self.args.should_save:
            self._save(output_dir if output_dir is not None else self.args.output_dir,
                       state_dict=state)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save",
                             revision=getattr(self.args, "hub_revision", None))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """A checkpoint with optimizer shards: the scheduler now, the shards into the
        training pipe once it is compiled (on the first batch)."""
        if checkpoint is None or not os.path.isdir(os.path.join(checkpoint, SHARDS)):
            return super()._load_optimizer_and_scheduler(checkpoint)
        if self._fxpipe_dp not in SHARDING:
            raise ValueError(f"{checkpoint} holds optimizer shards (FxpipeTrainer("
                             "data_parallel='device' or 'zero3')): resume it with one of them")
        self._fxpipe_resume = os.path.join(checkpoint, SHARDS)
        self.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, "scheduler.pt"),
                                                     weights_only=True))

    def _fxpipe_skip_next_step(self) -> None:
        """The pipe stepped the optimizer: the Trainer's ``optimizer.step()`` that follows
        this accumulation step does nothing (once); its clipping measures the gradients."""
        opt = self.optimizer
        self._fxpipe_stepped = True
        before = opt.__dict__.get("step")   # an LR scheduler's step-counting wrapper

        def stepped_already(*args: Any, **kwargs: Any) -> None:
            if before is None:
                opt.__dict__.pop("step", None)
            else:
                opt.step = before
            opt._opt_called = True   # what the scheduler's wrapper records: it did step
            self._fxpipe_stepped = False

        stepped_already._wrapped_by_lr_sched = True
        opt.step = stepped_already

    def _clip_grad_norm(self, model: nn.Module) -> Any:
        if self._fxpipe_stepped:   # clipped (if needed) and stepped in the pipe
            step = self._fxpipe_inner().__dict__.get("_fxpipe_trainer_step")
            if step is not None and step.grad_norm is not None:
                return step.grad_norm   # measured before clipping, as the Trainer logs it
            return self.accelerator.clip_grad_norm_(model.parameters(), float("inf"))
        return super()._clip_grad_norm(model)


class FxpipeTrainer(FxpipeMixin, transformers.Trainer):
    """A ``transformers.Trainer`` training through an fxpipe pipeline (see the module
    docstring). Extra keyword arguments: ``fxpipe_config`` (an ``fxpipe.RunConfig``:
    microbatches, recompute grain, ...), ``devices`` (as ``fxpipe.compile``'s: None =
    every GPU, else two virtual CPU devices), ``plan`` (an ``fxpipe.ExecutePlan``),
    ``param_dtype`` (default ``torch.bfloat16`` under ``args.bf16``), ``stream_optimizer``,
    ``data_parallel`` (under torchrun: ``True``, ``"host"``, ``"device"`` or ``"zero3"``)."""


def fxpipe_trainer(trainer_cls: type) -> type:
    """``trainer_cls`` (a ``transformers.Trainer`` subclass, e.g. ``trl.SFTTrainer``)
    training through fxpipe: ``FxpipeMixin`` in front of it.

    >>> import transformers
    >>> fxpipe_trainer(transformers.Trainer).__mro__[1].__name__
    'FxpipeMixin'
    """
    if not (isinstance(trainer_cls, type) and issubclass(trainer_cls, transformers.Trainer)):
        raise TypeError(f"fxpipe_trainer expects a transformers.Trainer subclass, got "
                        f"{trainer_cls!r}")
    return type(f"Fxpipe{trainer_cls.__name__}", (FxpipeMixin, trainer_cls),
                {"__module__": __name__, "__doc__": f"{trainer_cls.__name__} training through "
                 "fxpipe (fxpipe.integrations.transformers.FxpipeMixin)."})


_STREAMABLE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad,
               torch.optim.RMSprop, torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam)


def _why_not_streamed(trainer: Any, inner: Any) -> str | None:
    """Why the Trainer's optimizer cannot be stepped inside the pipeline (None: it can)."""
    if not isinstance(inner, _STREAMABLE):
        return (f"{type(inner).__name__} is not a torch.optim optimizer with a per-parameter "
                f"update ({', '.join(c.__name__ for c in _STREAMABLE)})")
    if trainer.optimizer is not inner and type(trainer.optimizer).__name__ != \
            "AcceleratedOptimizer":
        return f"the optimizer is wrapped in {type(trainer.optimizer).__name__}"
    return None


def _checkpointing_off(model: nn.Module) -> None:
    """Turn off HF activation (gradient) checkpointing in ``model``: fxpipe cannot capture
    it and recomputes each stage itself."""
    for is_on, off in (("is_activation_checkpointing", "activation_checkpointing_disable"),
                       ("is_gradient_checkpointing", "gradient_checkpointing_disable")):
        if hasattr(type(model), is_on) or hasattr(model, off):
            if getattr(model, is_on, False):
                getattr(model, off)()
            return
