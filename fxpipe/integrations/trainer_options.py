"""What ``FxpipeTrainer`` does with the ``Trainer``'s options before anything runs: those it
cannot honour raise (what, and what to do), those it honours another way are translated
(``torch_compile`` into a stage backend, HF activation checkpointing off, TRL's
``chunked_nll`` into ``nll``)."""

from __future__ import annotations

from typing import Any

import transformers

import fxpipe


def check_args(args: Any) -> None:
    """Options of ``TrainingArguments`` fxpipe cannot honour: raise before anything runs."""
    if args is None:
        return
    where = "FxpipeTrainer: TrainingArguments"
    if getattr(args, "deepspeed", None):
        raise ValueError(f"{where}(deepspeed=...) cannot be honoured: fxpipe partitions the "
                         "model itself (parameters in host memory, stages streamed to the "
                         "GPUs); drop the DeepSpeed config, or use transformers.Trainer")
    if getattr(args, "fsdp", None):
        raise ValueError(f"{where}(fsdp=...) cannot be honoured: fxpipe pipelines the model "
                         "over the GPUs instead of sharding it; drop fsdp=, or use "
                         "transformers.Trainer")
    if getattr(args, "fp16", False):
        raise NotImplementedError(f"{where}(fp16=True): fp16 needs loss scaling, which the "
                                  "fused step does not route yet; use bf16=True "
                                  "(param_dtype=torch.bfloat16) or fp32")
    for name in ("activation_checkpointing", "gradient_checkpointing"):   # new name, old
        if name in getattr(args, "__dict__", {}) and args.__dict__[name]:
            # what it asks for (activations recomputed in backward, not kept) fxpipe does
            # already, per stage (RunConfig.recompute_grain); HF's own checkpointing inside
            # the captured model would only recompute twice
            args.__dict__[name] = False
    if getattr(args, "loss_type", None) == "chunked_nll":
        # TRL's default: "nll"'s math, its loss computed in a data-dependent loop over token
        # chunks that no capture can trace; the pipe's tail holds one microbatch's logits
        args.loss_type = "nll"
    if getattr(args, "activation_offloading", False):
        raise ValueError(f"{where}(activation_offloading=True) cannot be honoured: fxpipe "
                         "already keeps activations on the host between stages; set it False")
    optim = str(getattr(args, "optim", ""))
    if "lomo" in optim.lower():
        raise NotImplementedError(f"{where}(optim={optim!r}): LOMO steps inside backward "
                                  "hooks, which the pipeline's backward does not run; use "
                                  "another optimizer")


def torch_compile_config(args: Any, config: fxpipe.RunConfig | None) -> fxpipe.RunConfig | None:
    """``TrainingArguments(torch_compile=True)``: fxpipe compiles its stage code with
    inductor (``RunConfig(stage_backend="inductor")``; with
    ``torch_compile_mode="reduce-overhead"``, torch.compile's CUDA graphs, its stage jobs
    as device graphs: ``stage_backend="cudagraphs"``; a ``stage_backend`` in the
    trainer's ``fxpipe_config`` wins) instead of transformers wrapping the whole model in
    ``torch.compile`` (which the pipeline's capture would then have to see through)."""
    if args is None or not getattr(args, "torch_compile", False):
        return config
    where = "FxpipeTrainer: TrainingArguments"
    backend = getattr(args, "torch_compile_backend", None) or "inductor"
    if backend != "inductor":
        raise ValueError(f"{where}(torch_compile_backend={backend!r}) cannot be honoured: "
                         "fxpipe compiles its stage code with inductor "
                         "(RunConfig(stage_backend='inductor')); use 'inductor' or drop it")
    mode = getattr(args, "torch_compile_mode", None)
    stage_backend = {None: "inductor", "default": "inductor",
                     "reduce-overhead": "cudagraphs"}.get(mode)
    if stage_backend is None:
        raise NotImplementedError(f"{where}(torch_compile_mode={mode!r}): fxpipe compiles its "
                                  "stage code with inductor's default mode, or with "
                                  "'reduce-overhead' as CUDA graphs of its stage jobs "
                                  "(RunConfig(stage_backend='cudagraphs')); autotuning modes "
                                  "are not built: use one of those or drop torch_compile_mode")
    args.torch_compile, args.torch_compile_backend, args.torch_compile_mode = False, None, None
    return fxpipe.RunConfig.merge(fxpipe.RunConfig(stage_backend=stage_backend), config)


def check_chunks(trainer: Any) -> None:
    """``fxpipe_config=RunConfig(sequence_chunks=...)``: the step runs the model's own
    ``labels=`` loss over token chunks, so what would compute another loss on whole
    logits is refused here, before training starts."""
    config = trainer._fxpipe_config
    if config is None or config.sequence_chunks is None:
        return
    where = "FxpipeTrainer(fxpipe_config=RunConfig(sequence_chunks=...))"
    if getattr(trainer, "label_smoother", None) is not None or \
            getattr(trainer, "compute_loss_func", None) is not None:
        raise NotImplementedError(
            f"{where} runs the model's own labels= loss chunk by chunk; label smoothing and "
            "compute_loss_func need the whole logits: drop them, or drop sequence_chunks")
    own = type(trainer).compute_loss
    if own is not transformers.Trainer.compute_loss:
        raise NotImplementedError(
            f"{where}: {type(trainer).__name__}.compute_loss overrides Trainer.compute_loss "
            f"({own.__qualname__}), and a chunked step runs the model's own labels= loss "
            "without calling it; use FxpipeTrainer, or drop sequence_chunks")
    if config.stage_backend == "cudagraphs":
        raise NotImplementedError(
            f"{where} with stage_backend='cudagraphs' (TrainingArguments(torch_compile_mode="
            "'reduce-overhead') asks for it): a chunk's attention moves its keys from Python, "
            "which a device graph's replay does not run; use torch_compile_mode='default' "
            "(inductor) or drop one")


def check_trainer(trainer: Any) -> None:
    """What the accelerator decided (an ``accelerate launch`` config may ask for it)."""
    if getattr(trainer, "is_deepspeed_enabled", False):
        raise ValueError("FxpipeTrainer: the accelerate config enables DeepSpeed, which fxpipe "
                         "cannot honour (it partitions the model itself); launch without it")
    if getattr(trainer, "is_fsdp_enabled", False) or getattr(trainer, "is_fsdp_xla_enabled", False):
        raise ValueError("FxpipeTrainer: the accelerate config enables FSDP, which fxpipe cannot "
                         "honour (it pipelines the model instead of sharding it); launch "
                         "without it")
