"""``RunConfig(sequence_chunks=K)``: one long sequence through the stages as ``K`` token
chunks (a ``PipelineModule`` base, as ``fxpipe.generating`` is).

With one sequence per step, a step has one microbatch, so one device computes while the
others wait, and the longest sequence is bounded by one microbatch's activations. Run as
token chunks, the chunks are the microbatches: they flow round-robin through the stages
as any microbatches do, and a stage holds one chunk's activations at a time
(TeraPipe, Li et al. 2021). What makes it exact is the attention: chunk ``i``'s queries
read the keys and values of chunks ``0..i`` (``fxpipe.sequence_kv``).

A call with ``sequence_chunks`` runs a *chunk step module* of the pipe's model
(:class:`ChunkedLM`, compiled on the pipe's devices with the pipe's host copy of the
weights, once per chunk shape), whose attention layers are ``fxpipe::chunk_attention``
ops: the model's attention called through transformers' attention interface. Each
chunk gets its positions (``position_ids``) and its part of the labels shifted over the
whole sequence (``shift_labels``), so the token at a chunk's end predicts the next chunk's
first; the loss is the model's own, each chunk's mean weighted by its share of the
sequence's target tokens (``fxpipe.passes.token_means``), ``-100`` included.

The Program of a chunked call (``pipe.program(sequence_chunks=K)``; its code:
``pipe.code(sequence_chunks=K)``) differs from a plain one in two ways:

- every backward stage runs its microbatches last chunk first (a chunk's keys receive
  gradients from every later chunk before they flow into its projections);
- the fused tail (forward, loss and backward in one go per microbatch) holds no attention
  layer: the layers up to the last attention are planned as forward and backward
  stages (:func:`chunked_plan`).

Where the devices have a memory limit, the chunk step is planned with each attention
layer's keys and values for the whole sequence counted (``fxpipe.sequence_plan``);
``pipe.stats()`` after the call holds the chunk step's counters and the keys' and
values' bytes moved (``h2d_bytes_kv``, ``d2h_bytes_kv``).

Supported: Hugging Face causal LMs whose attention goes through
``ALL_ATTENTION_FUNCTIONS`` (Llama, Qwen2/3, Mistral, Gemma 2, ...), called with
``input_ids`` and optionally ``labels``, ``num_items_in_batch`` (each chunk's loss is
then its tokens' sum over it, and the chunks' losses add: ``loss_reduction="sum"``, as
``FxpipeTrainer`` calls it) and an all-ones ``attention_mask`` (with ``data_parallel=True``
the chunk step runs the pipe's collectives: the ranks' gradients averaged), in
``forward_backward`` and in ``pipe(...)`` without grad, with the eager stage backend or
inductor's (the chunk attention then runs between its layer's compiled segments:
``runtime.stages.stage_code.runnable``).
Anything else is refused before it runs. ``sequence_chunks="auto"``: the fewest chunks
whose step has a plan that fits the devices (:meth:`SequenceChunking._auto_chunks`).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn
import torch.utils._pytree as pytree

from fxpipe.config import RunConfig
from fxpipe.errors import PlanError
from fxpipe.memory_prediction import tensor_bytes
from fxpipe.passes import chain_costs, planner
from fxpipe.passes.costs import compute_costs
from fxpipe.passes.stage_memory import ChainMemory
from fxpipe.plan import MEMORY_FRACTION, ExecutePlan, layer_costs
from fxpipe.runtime.host.params import HostParams
from fxpipe.runtime.issue.microbatch import PackedData
from fxpipe.sequence_kv import (SequenceKV, chunk_bounds, new_slot, opened, register_flops,
                                running_chunk)
from fxpipe.sequence_plan import chunk_counts, kv_layout, with_kv

__all__ = ["ChunkedLM", "chunked_plan", "SequenceChunking"]

ATTENTION = "fxpipe_sequence_chunks"
"""The name fxpipe's chunk attention is registered under in transformers'
``AttentionInterface``."""
_ACCEPTED = ("input_ids", "labels", "attention_mask", "num_items_in_batch")
_active = threading.local()   # the slot a ChunkedLM's forward runs with (read when traced)


def _hf_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                  value: torch.Tensor, attention_mask: Any, scaling: float | None = None,
                  dropout: float = 0.0, sliding_window: int | None = None,
                  softcap: float | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature, answered by ``fxpipe::chunk_attention``."""
    if dropout:
        raise NotImplementedError(
            f"sequence_chunks: attention dropout ({dropout}) is not supported in chunks (the "
            "chunk's masks would not be the unchunked step's); set the config's "
            "attention_dropout to 0 or run the model in eval mode")
    layer = getattr(module, "layer_idx", None)
    if layer is None:
        raise NotImplementedError(f"sequence_chunks: attention module {type(module).__name__} "
                                  "has no layer_idx to key its keys and values by")
    scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
    out = torch.ops.fxpipe.chunk_attention(query, key, value, _active.slot, int(layer), scale,
                                           int(sliding_window or 0), float(softcap or 0.0))
    return out.transpose(1, 2).contiguous(), None


@functools.cache
def _register() -> None:
    """Register the chunk attention with transformers, and its FLOPs with the cost pass's
    counter (once)."""
    from transformers import AttentionInterface
    AttentionInterface.register(ATTENTION, _hf_attention)
    register_flops()


class ChunkedLM(nn.Module):
    """A causal LM run one token chunk at a time: ``forward(input_ids, position_ids,
    shift_labels=None)`` calls the model on the chunk with its positions and, given
    them, its labels already shifted over the whole sequence (``shift_labels``). Its
    attention is the chunk attention of ``slot`` inside :func:`serving`."""

    def __init__(self, model: nn.Module, slot: int):
        super().__init__()
        self.model = model
        self.slot = slot   # baked into its captured graph: part of the capture cache's key

    @property
    def config(self) -> Any:
        return self.model.config

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                shift_labels: torch.Tensor | None = None,
                num_items_in_batch: torch.Tensor | None = None) -> Any:
        if shift_labels is None:
            return self.model(input_ids=input_ids, position_ids=position_ids, use_cache=False)
        extra = {} if num_items_in_batch is None else {"num_items_in_batch": num_items_in_batch}
        return self.model(input_ids=input_ids, position_ids=position_ids, labels=shift_labels,
                          shift_labels=shift_labels, use_cache=False, **extra)


@contextlib.contextmanager
def serving(model: nn.Module, slot: int, store: SequenceKV) -> Iterator[None]:
    """Inside: ``model``'s attention is the chunk attention (what a capture of a
    :class:`ChunkedLM` records), reading and writing ``store`` under ``slot``, and ops
    run outside a stage run (a capture's) run chunk 0."""
    _register()
    config = model.config
    saved, saved_slot = config._attn_implementation, getattr(_active, "slot", None)
    config._attn_implementation = ATTENTION
    _active.slot = slot
    try:
        with opened(store, slot), running_chunk(0):
            yield
    finally:
        config._attn_implementation = saved
        _active.slot = saved_slot


def attention_layers(lg: Any) -> list[int]:
    """The layers of a captured chunk step whose code runs a chunk attention."""
    op = torch.ops.fxpipe.chunk_attention
    return [layer.index for layer in lg.layers
            if any(n.op == "call_function" and n.target in (op, op.default)
                   for n in layer.gm.graph.nodes)]


def chunked_plan(plan: ExecutePlan, attention: list[int], num_layers: int) -> ExecutePlan:
    """``plan`` with a fused tail that holds no attention layer: the tail's layers up to
    the last attention layer become a forward and a backward stage of their own (a
    chunk's fused forward-and-backward would run before the later chunks' forwards wrote
    the keys its backward reads)."""
    if not plan.bwd_plan or not attention:
        return plan
    tail = plan.bwd_plan[0]
    if tail.stop != num_layers:   # not a fused plan
        return plan
    cut = max(attention) + 1
    if cut <= tail.start:
        return plan
    if cut >= num_layers:
        raise NotImplementedError(
            "sequence_chunks: the model's last layer runs attention, so the fused loss tail "
            "would hold it; a chunked step needs the head after the last attention layer")
    return ExecutePlan(plan.fwd_plan + [range(tail.start, cut)],
                       [range(cut, num_layers), range(tail.start, cut)] + plan.bwd_plan[1:])


def _ids(kwargs: dict) -> torch.Tensor:
    ids = kwargs.get("input_ids")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        raise ValueError("sequence_chunks: pass input_ids=, a [batch, length] tensor of token ids")
    return ids


def chunk_inputs(kwargs: dict, chunks: int) -> tuple[dict, list[tuple[int, int]]]:
    """The chunk step's keyword arguments, each a ``PackedData`` of the chunks, and the
    chunks' bounds. Refuses what a chunked call cannot run, saying what to do."""
    extra = sorted(set(kwargs) - set(_ACCEPTED))
    if extra:
        raise NotImplementedError(
            f"sequence_chunks: the call passes {', '.join(map(repr, extra))}; a chunked call "
            f"takes {', '.join(_ACCEPTED)} only")
    ids = _ids(kwargs)
    mask = kwargs.get("attention_mask")
    if mask is not None and not bool((mask == 1).all()):
        raise NotImplementedError(
            "sequence_chunks: an attention_mask with padding is not supported in chunks; mark "
            "padded targets -100 in labels and pass no attention_mask (with right padding the "
            "loss and gradients are the same)")
    rows, length = ids.shape
    if isinstance(chunks, bool) or not isinstance(chunks, int):
        raise TypeError(f"RunConfig.sequence_chunks must be an int here, got {chunks!r}")
    if length % chunks:
        fits = [k for k in range(2, min(length, 64) + 1) if length % k == 0]
        raise ValueError(f"sequence_chunks={chunks} does not divide the sequence of {length} "
                         f"tokens into equal chunks; counts that do: {fits[:8]}")
    bounds = chunk_bounds(length, chunks)
    positions = torch.arange(length, device=ids.device).expand(rows, length)
    out = {"input_ids": PackedData(ids[:, a:b] for a, b in bounds),
           "position_ids": PackedData(positions[:, a:b].contiguous() for a, b in bounds)}
    labels = kwargs.get("labels")
    if labels is not None:
        if labels.shape != ids.shape:
            raise ValueError(f"sequence_chunks: labels {tuple(labels.shape)} must have the "
                             f"shape of input_ids {tuple(ids.shape)}")
        shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]
        out["shift_labels"] = PackedData(shifted[:, a:b].contiguous() for a, b in bounds)
    count = kwargs.get("num_items_in_batch")
    if count is not None:
        if labels is None:
            raise ValueError("sequence_chunks: num_items_in_batch= divides the model's labels= "
                             "loss; the call passes no labels")
        if isinstance(count, int) and not isinstance(count, bool):
            count = torch.tensor(count)
        if not (isinstance(count, torch.Tensor) and count.numel() == 1):
            raise TypeError(f"sequence_chunks: num_items_in_batch must be an int or a "
                            f"one-element tensor, got {count!r}")
        # every chunk's loss is its tokens' sum over the same count: the chunks' losses add
        out["num_items_in_batch"] = PackedData(count.reshape(()) for _ in bounds)
    return out, bounds


class SequenceChunking:
    """What a ``PipelineModule`` runs for a call with ``RunConfig(sequence_chunks=K)``."""

    def _chunked_call(self, cfg: RunConfig) -> bool:
        """Whether a call of ``cfg`` is a chunked call this pipe splits (the chunk step
        pipe's own calls are the chunks)."""
        return cfg.sequence_chunks is not None and not isinstance(self.module, ChunkedLM)

    def _chunked(self, args: tuple, kwargs: dict, cfg: RunConfig,
                 fused: dict | None = None) -> Any:
        """A call with ``cfg.sequence_chunks``: ``forward_backward``'s (``fused``: its
        keyword arguments) or ``pipe(...)``'s without grad; returns what that call
        returns (``pipe(...)``: the model's output, its tensors whole along the tokens and
        its loss the sequence's mean). ``pipe.stats()`` then holds the chunk step's
        counters, and ``h2d_bytes_kv`` / ``d2h_bytes_kv``, the keys and values (and their
        gradients) the chunk attention moved."""
        if args:
            raise NotImplementedError("sequence_chunks: pass the model's inputs by keyword "
                                      "(input_ids=..., labels=...)")
        if fused is None and cfg.requires_grad is not False and torch.is_grad_enabled() \
                and any(p.requires_grad for p in self.module.parameters()):
            raise NotImplementedError(
                "sequence_chunks runs in forward_backward (training) or without grad "
                "(torch.no_grad()); pipe(...) with grad then loss.backward() is not supported")
        if fused is not None and fused.get("label") is not None:
            raise NotImplementedError("sequence_chunks: pass labels= in the model's inputs "
                                      "(its own loss), not label= and a loss_fn")
        chunk_kwargs, bounds = self._chunk_inputs(kwargs, cfg)
        if fused is not None and fused["sync_gradients"] is None and not self._sync:
            fused = {**fused, "sync_gradients": False}   # inside this pipe's no_sync()
        counted = "num_items_in_batch" in chunk_kwargs
        if fused is not None and (fused["loss_reduction"] == "sum") != counted:
            raise ValueError(
                "sequence_chunks: with num_items_in_batch= each chunk's loss is its tokens' sum "
                "divided by it, so the chunks' losses add: pass loss_reduction='sum'"
                if counted else
                "sequence_chunks: loss_reduction='sum' adds microbatch losses, and the chunks "
                "are not the call's microbatches (each chunk's loss is its tokens' mean); pass "
                "num_items_in_batch= to the model (the loss: the tokens' sum divided by it), "
                "or leave loss_reduction='mean' (the sequence's mean)")
        store = SequenceKV(bounds, training=fused is not None)
        with serving(self.module, self._chunk_slot, store):
            pipe, compiled, plan = self._chunk_setup(
                chunk_kwargs, bounds, "fused" if fused is not None else "infer",
                fused.get("return_outputs", False) if fused is not None else True)
            if cfg.execute_plan is not None:   # the caller's, for the chunk step's layers
                plan = chunked_plan(cfg.execute_plan, attention_layers(compiled.layers),
                                    len(compiled.layers))
            run = RunConfig.merge(cfg, RunConfig(num_microbatch=len(bounds), execute_plan=plan,
                                                 merge_output=False))
            try:
                if fused is not None:
                    return pipe.forward_backward((), chunk_kwargs, run_config=run, **fused)
                with torch.no_grad():
                    out = pipe(run_config=run, **chunk_kwargs)
                return _joined(out, chunk_kwargs.get("shift_labels"), counted)
            finally:
                self._log.stats = {**pipe.stats(), "h2d_bytes_kv": store.h2d_bytes,
                                   "d2h_bytes_kv": store.d2h_bytes}

    def _chunked_executable(self, run_type: str, chunks: int, **kw: Any) -> Any:
        """The Executable a chunked call of ``run_type`` in ``chunks`` chunks runs on the
        pipe's example (``pipe.program(..., sequence_chunks=K)``, ``pipe.code``)."""
        chunk_kwargs, bounds = self._example_chunks(run_type, chunks)
        with serving(self.module, self._chunk_slot, SequenceKV(bounds)):
            pipe, compiled, plan = self._chunk_setup(chunk_kwargs, bounds, run_type,
                                                     kw.get("return_outputs", False))
            return pipe._executable(run_type, len(bounds), compiled=compiled, plan=plan,
                                    chunks=len(bounds), **kw)

    def _chunk_prediction(self, run_type: str, chunks: int | str,
                          length: int | None) -> tuple:
        """For ``predict_memory(pipe, sequence_chunks=K, max_length=L)``: the chunk step's
        layers and plan for a call of ``run_type`` on the example's rows at ``length``
        tokens (None: the example's), one chunk's memory, the attention layers' keys
        (``fxpipe.sequence_plan.KVLayout``, None where unknown), the call's tokens (rows x
        length) and the chunk count."""
        chunk_kwargs, bounds = self._example_chunks(run_type, chunks, length)
        with serving(self.module, self._chunk_slot, SequenceKV(bounds)):
            _, compiled, plan = self._chunk_setup(chunk_kwargs, bounds, run_type, False)
            example = {k: v[0] for k, v in chunk_kwargs.items()}
            memory = chunk_memory(compiled, example)
        kv = kv_layout(self._chunk_steps[0], compiled.layers, self.param_dtype)
        return (compiled.layers, plan, memory, kv, _ids(example).shape[0] * bounds[-1][1],
                len(bounds))

    def _example_chunks(self, run_type: str, chunks: int | str,
                        length: int | None = None) -> tuple[dict, list]:
        """``_chunk_inputs`` of the pipe's example (its rows at ``length`` tokens: token 0
        throughout; None: as it is) for a chunked call of ``run_type``."""
        if run_type == "train":
            raise NotImplementedError("sequence_chunks runs as 'fused' (forward_backward) or "
                                      "'infer' calls")
        lg = self._current.layers
        _, kwargs = pytree.tree_unflatten(lg.example_leaves, lg.in_spec)
        kwargs = {k: v for k, v in kwargs.items() if k in _ACCEPTED}
        if length is not None:
            rows = _ids(kwargs).shape[0]
            kwargs = {k: torch.zeros(rows, length, dtype=v.dtype) if k != "num_items_in_batch"
                      else v for k, v in kwargs.items()}
            if "attention_mask" in kwargs:
                kwargs["attention_mask"] += 1
        cfg = RunConfig.merge(self.config, RunConfig(sequence_chunks=chunks))
        return self._chunk_inputs(kwargs, cfg)

    def _chunk_inputs(self, kwargs: dict, cfg: RunConfig) -> tuple[dict, list]:
        """``chunk_inputs`` for this pipe's model, after the checks of what a chunked
        call supports."""
        if cfg.stage_backend == "cudagraphs":
            raise NotImplementedError(
                "sequence_chunks with stage_backend='cudagraphs': the chunk attention reads "
                "and writes its keys between the host and the device from Python, which a "
                "device graph's replay does not run; use stage_backend='inductor' (its "
                "compiled code around the attention) or 'eager'")
        if not hasattr(getattr(self.module, "config", None), "_attn_implementation"):
            raise NotImplementedError(
                "sequence_chunks runs Hugging Face causal LMs whose attention goes through "
                f"transformers' attention interface; {type(self.module).__name__} has no "
                "transformers config")
        if getattr(self, "_chunk_slot", None) is None:
            self._chunk_slot = new_slot()
        chunks = cfg.sequence_chunks
        if chunks == "auto":
            chunks = self._auto_chunks(kwargs)
        return chunk_inputs(kwargs, chunks)

    def _auto_chunks(self, kwargs: dict) -> int:
        """``sequence_chunks="auto"``: the fewest chunks (1, then counts that cut the
        sequence into chunks of a power of two tokens) for which the chunk step has a plan
        that fits the devices, keys and values counted (one capture per chunk length
        tried, remembered per length)."""
        length = _ids(kwargs).shape[1]
        known = getattr(self, "_auto_chunk_counts", None)
        if known is None:
            known = self._auto_chunk_counts = {}
        if length in known:
            return known[length]
        failure = None
        for chunks in chunk_counts(length, 1):
            chunk_kwargs, bounds = chunk_inputs(kwargs, chunks)
            try:
                with serving(self.module, self._chunk_slot, SequenceKV(bounds)):
                    self._chunk_setup(chunk_kwargs, bounds, "fused", False)
            except PlanError as e:
                failure = e
                continue
            known[length] = chunks
            return chunks
        raise PlanError(f"sequence_chunks='auto': no chunk count fits {length} tokens on these "
                        f"devices; the fewest tokens a chunk can have failed with: {failure}")

    def _chunk_setup(self, chunk_kwargs: dict, bounds: list, run_type: str,
                     outputs: bool) -> tuple:
        """Inside ``serving``: the chunk step pipe (made at the first chunked call, with
        the pipe's host copy of the weights), its graph for these chunks (captured once
        per chunk shape) and the plan a call of ``run_type`` runs (:func:`chunked_plan`
        of :meth:`_chunk_plan`'s, else the chunk step's own)."""
        example = {k: v[0] for k, v in chunk_kwargs.items()}
        steps = getattr(self, "_chunk_steps", None)
        if steps is None:
            step = ChunkedLM(self.module, self._chunk_slot)
            self._host_params()
            HostParams.share(step, self.module)   # one host copy of the weights
            # data parallel: the chunk step's backward averages the ranks' gradients with
            # this pipe's collectives (every rank makes it at its first chunked call)
            pipe = type(self)(step, (), example, devices=self.devices, capture=self._capture,
                              layers=None, config=self.config, plan=None,
                              param_dtype=self.param_dtype, pin_memory=self.pin_memory,
                              dp=self._dp)
            if not attention_layers(pipe._current.layers):
                raise NotImplementedError(
                    f"sequence_chunks: {type(self.module).__name__}'s attention does not go "
                    "through transformers' attention interface (no chunk attention was "
                    "captured), so its chunks could not read the earlier chunks' keys")
            steps = self._chunk_steps = (step, pipe)
        step, pipe = steps
        step.train(self.module.training)
        compiled = pipe._compiled_for((), example)
        if run_type == "fused" and not outputs:
            compiled = compiled.fused(step)   # what forward_backward runs
        attention = attention_layers(compiled.layers)
        plan = self._chunk_plan(compiled, run_type, example, len(bounds),
                                _ids(example).shape[0] * bounds[-1][1])
        return pipe, compiled, chunked_plan(plan or compiled.plan, attention,
                                            len(compiled.layers))

    def _chunk_plan(self, compiled: Any, run_type: str, example: dict, chunks: int,
                    tokens: int) -> Any:
        """Where the devices have a memory limit: the plan of the chunk step with each
        attention layer's keys and values for ``tokens`` tokens (rows x length) counted
        (``fxpipe.sequence_plan.with_kv``), which the chunk's own costs do not hold;
        ``None`` without a limit."""
        limits = [d.memory_limit for d in self.devices if d.memory_limit is not None]
        kv = kv_layout(self._chunk_steps[0], compiled.layers, self.param_dtype)
        if not limits or kv is None:
            return None
        chains = chain_costs.chain_costs([layer_costs(compiled)], chain_costs.NOMINAL_DEVICE,
                                         need_backward=run_type != "infer")
        (fwd, bwd), = planner.plan_chains(
            run_type, chains, num_devices=len(self.devices), num_microbatch=chunks,
            memory=[with_kv(chunk_memory(compiled, example), kv, tokens)],
            memory_limit=MEMORY_FRACTION * min(limits),
            recompute_grain=self.config.recompute_grain or "stage",
            host_ms_per_action=chain_costs.HOST_MS_PER_ACTION)
        return ExecutePlan(fwd, bwd)


def chunk_memory(compiled: Any, example: dict) -> ChainMemory:
    """One chunk's memory through ``compiled``'s layers, costed at ``example``'s length
    (one chunk's inputs) inside ``serving``: a capture serves chunks of several lengths,
    and its own costs are those of the chunk it was first captured for."""
    flat = pytree.tree_leaves(((), example))
    return ChainMemory.of(compute_costs(compiled.layers, flat, store=False), tensor_bytes(flat))


def _joined(out: Any, shift_labels: PackedData | None, counted: bool) -> Any:
    """A chunked inference call's output: each tensor's chunks joined along the tokens
    (dim 1), a 0-dim loss the mean of the chunks' means weighted by their target tokens
    (``counted``: with ``num_items_in_batch``, the chunks' losses added)."""
    def join(x: Any) -> Any:
        if not isinstance(x, PackedData) or not x or not isinstance(x[0], torch.Tensor):
            return x
        if x[0].dim() >= 2:
            return torch.cat(list(x), dim=1)
        if x[0].dim() == 0 and counted:   # each chunk's sum over the batch's count
            return sum(x)
        if x[0].dim() == 0 and shift_labels is not None:   # the model's mean loss
            counts = [float((t != -100).sum()) for t in shift_labels]
            return sum(v * c for v, c in zip(x, counts)) / max(sum(counts), 1.0)
        return x
    return pytree.tree_map(join, out, is_leaf=lambda x: isinstance(x, PackedData))
