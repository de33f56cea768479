"""``pipe.generate``: autoregressive generation with a KV cache, through the pipe's stages.

Generation runs a Hugging Face causal LM as two kinds of pipe call on the same host copy
of the weights the training calls use (``HostParams`` of the model, shared):

- **prefill**: the whole (left-padded) prompt through every stage once;
- **decode step**: the batch's newest token through every stage, each stage's weights
  uploaded once per step for the whole batch (one microbatch: FlexGen's block order).

Both are calls of a *step module* (:class:`StepModule`) that wraps the model with a static
KV cache: one key and one value tensor per layer, ``[batch, kv_heads, max_len,
head_dim]``, registered as the step module's buffers. The capture sees each layer write
its new keys and values into them (``index_copy_`` at the step's positions), so the
partitioner gives every layer's cache to the stage that holds that layer, and the
lowering shows the reads (the buffers prefetched with the stage's weights) and writes
(``writeback`` of the mutated buffers) as explicit nodes: ``pipe.code("generate")``. The
cache lives in host memory (pinned where the pipe pins) and streams in with its layer,
the whole cache of a layer written back after each call (``kv_cache="host"``); keeping
it resident on the devices (``"device"``, ``"auto"`` choosing from bytes) is not
implemented yet and raises ``NotImplementedError``.

The loop follows ``transformers``' ``GenerationMixin.generate`` for decoder-only models:
left padding through ``attention_mask`` and ``position_ids = cumsum(mask) - 1``, each
sequence padded with ``pad_token_id`` after its EOS, the loop ending when every sequence
has finished or after ``max_new_tokens``, defaults from ``model.generation_config``;
sampling applies temperature, top-k then top-p, and draws from ``generator``.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn


from fxpipe.config import RunConfig
from fxpipe.runtime.host.params import is_scratch, mark_scratch
from fxpipe.runtime.host.scratch import ResidentBuffers, ScratchUse, scratch_use

__all__ = ["StepModule", "generate", "sample_next"]

def split_spec() -> tuple:
    """How a step call splits into microbatches: the ids, the mask and the positions by row,
    the cache positions (the same for every row) whole. (Its spec types are imported here:
    torch.distributed.pipelining takes 1.5 s to import.)"""
    from torch.distributed.pipelining.microbatch import TensorChunkSpec, _Replicate
    return ((TensorChunkSpec(0), TensorChunkSpec(0), TensorChunkSpec(0), _Replicate), None)
KV_CACHE = ("host", "device", "auto")

BUCKET = 64
"""The cache length is the prompt plus ``max_new_tokens`` rounded up to a multiple of
this: calls of nearby lengths share one step module (and its compiled graphs)."""


# --------------------------------------------------------------------------- the cache

def _cache_classes():
    try:
        from transformers.cache_utils import StaticCache, StaticLayer
    except ImportError as e:   # pragma: no cover - the [hf] extra is missing
        raise ImportError("pipe.generate runs Hugging Face causal LMs: pip install "
                          "'fxpipe[hf]' (transformers)") from e
    return StaticCache, StaticLayer


def _kv_shapes(config: Any, num_layers: int) -> list[tuple[int, int]]:
    """(kv heads, head dim) of each layer, from the model's config."""
    per_layer = getattr(config, "per_layer_config", None) or [config] * num_layers
    out = []
    for c in per_layer:
        heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        out.append((int(heads), int(head_dim)))
    return out


def _make_cache(config: Any, keys: list[torch.Tensor], values: list[torch.Tensor]):
    """A ``transformers`` StaticCache whose layers write at the positions the step
    module sets (``cache.positions``) into ``keys``/``values``, with no state of their
    own to update (HF's ``StaticLayer`` counts written tokens in a tensor, in place)."""
    StaticCache, StaticLayer = _cache_classes()

    class PositionedLayer(StaticLayer):
        def __init__(self, cache, k: torch.Tensor, v: torch.Tensor):
            super().__init__(max_cache_len=k.shape[2])
            self._cache = cache
            self.keys, self.values = k, v
            self.device = k.device
            self.batch_size, self.num_heads = k.shape[:2]
            self.k_head_dim, self.v_head_dim = k.shape[-1], v.shape[-1]
            self.is_initialized = True

        def get_seq_length(self):
            # the tokens before this call's: where its queries start (transformers 5
            # reads the query offset of the mask from here)
            return self._cache.positions[0]

        def update(self, key_states, value_states, *args, **kwargs):
            # the call's rows: the runtime serves a microbatch its own rows of the cache
            # (``runtime.host.scratch``), and the graph stays generic in the batch
            rows = key_states.shape[0]
            keys, values = self.keys.narrow(0, 0, rows), self.values.narrow(0, 0, rows)
            positions = self._cache.positions
            keys.index_copy_(2, positions, key_states.to(keys.dtype))
            values.index_copy_(2, positions, value_states.to(values.dtype))
            return keys, values

    # every layer keeps every position, sliding-window ones too: their masks (absolute
    # positions, from get_mask_sizes) drop what is out of the window
    cache = StaticCache(config=config, max_cache_len=keys[0].shape[2])
    cache.layers = [PositionedLayer(cache, k, v) for k, v in zip(keys, values)]
    cache.positions = None
    return cache


class StepModule(nn.Module):
    """The model with a static KV cache of ``batch`` sequences of up to ``length``
    tokens: ``forward(input_ids, attention_mask, position_ids, cache_position)`` runs the
    new tokens (the prompt, or one per sequence), writes their keys and values at
    ``cache_position`` and returns the last position's logits ``[batch, vocab]``.
    ``attention_mask`` covers the whole cache (``[batch, length]``); positions not yet
    written are masked by causality. The cache tensors are its buffers ``kv.<i>.k`` and
    ``kv.<i>.v``."""

    def __init__(self, model: nn.Module, batch: int, length: int, dtype: torch.dtype):
        super().__init__()
        self.model = model
        config = model.config
        layers = int(config.num_hidden_layers)
        self.kv = nn.ModuleList()
        keys, values = [], []
        for heads, head_dim in _kv_shapes(config, layers):
            holder = nn.Module()
            holder.register_buffer("k", torch.zeros(batch, heads, length, head_dim, dtype=dtype),
                                   persistent=False)
            holder.register_buffer("v", torch.zeros(batch, heads, length, head_dim, dtype=dtype),
                                   persistent=False)
            self.kv.append(holder)
            keys.append(holder.k)
            values.append(holder.v)
        mark_scratch(*keys, *values)    # the next generate resets them: no failure copies
        self.cache = _make_cache(config, keys, values)
        params = inspect.signature(model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        self.batch, self.length = batch, length

    def forward(self, input_ids, attention_mask, position_ids, cache_position):
        self.cache.positions = cache_position
        out = self.model(input_ids=input_ids, attention_mask=attention_mask,
                         position_ids=position_ids, cache_position=cache_position,
                         use_cache=True, **{self._cache_arg: self.cache})
        return out.logits[:, -1]

    def example(self, tokens: int) -> tuple[torch.Tensor, ...]:
        """Inputs of a call of ``tokens`` new tokens per sequence whose mask has padding."""
        mask = torch.ones(self.batch, self.length, dtype=torch.long)
        mask[:, 0] = 0
        return (torch.ones(self.batch, tokens, dtype=torch.long), mask,
                torch.arange(tokens).expand(self.batch, tokens).contiguous(), torch.arange(tokens))

    def reset(self) -> None:
        """Zero the cache (a new generation; stale entries are masked anyway)."""
        with torch.no_grad():
            for holder in self.kv:
                holder.k.zero_()
                holder.v.zero_()


# --------------------------------------------------------------------------- sampling

def sample_next(logits: torch.Tensor, *, do_sample: bool, temperature: float,
                top_k: int | None, top_p: float | None,
                generator: torch.Generator | None) -> torch.Tensor:
    """The next token of each row of ``logits`` ``[batch, vocab]``: the argmax, or a
    draw after temperature, top-k and top-p (``transformers``' warpers, in that order)."""
    if not do_sample:
        return logits.argmax(-1)
    scores = logits.float()
    if temperature != 1.0:
        scores = scores / temperature
    if top_k is not None and top_k > 0:
        k = min(top_k, scores.shape[-1])
        kth = torch.topk(scores, k).values[..., -1, None]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=False)
        cumulative = sorted_scores.softmax(-1).cumsum(-1)
        remove = cumulative <= (1 - top_p)
        remove[..., -1:] = False          # keep at least one token
        scores = scores.masked_fill(remove.scatter(-1, order, remove), float("-inf"))
    probs = scores.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


# --------------------------------------------------------------------------- the loop

@dataclass(frozen=True)
class Options:
    max_new_tokens: int
    do_sample: bool
    temperature: float
    top_k: int | None
    top_p: float | None
    eos: tuple[int, ...]
    pad: int | None


_UNSUPPORTED = (("num_beams", 1), ("repetition_penalty", 1.0), ("no_repeat_ngram_size", 0),
                ("bad_words_ids", None), ("min_length", 0), ("min_new_tokens", None),
                ("forced_bos_token_id", None), ("forced_eos_token_id", None),
                ("suppress_tokens", None), ("begin_suppress_tokens", None))


def _options(model: nn.Module, max_new_tokens, do_sample, temperature, top_k, top_p,
             eos_token_id, pad_token_id) -> Options:
    gc = getattr(model, "generation_config", None)
    for name, neutral in _UNSUPPORTED:
        value = getattr(gc, name, neutral) if gc is not None else neutral
        if value is not None and value != neutral:
            raise NotImplementedError(
                f"pipe.generate: the model's generation_config sets {name}={value!r}, which "
                f"fxpipe does not apply yet (it supports greedy and sampled decoding with "
                f"temperature, top_k and top_p); set model.generation_config.{name} = {neutral!r}")
    if max_new_tokens is None:
        max_new_tokens = getattr(gc, "max_new_tokens", None)
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise ValueError(f"pipe.generate: max_new_tokens must be an int >= 1, got "
                         f"{max_new_tokens!r} (pass max_new_tokens=N)")
    if do_sample is None:
        do_sample = bool(getattr(gc, "do_sample", False))
    if top_k is None and do_sample:
        top_k = getattr(gc, "top_k", None)
    if top_p is None and do_sample:
        top_p = getattr(gc, "top_p", None)
    if temperature is None:
        temperature = getattr(gc, "temperature", None) or 1.0
    if not (isinstance(temperature, (int, float)) and temperature > 0):
        raise ValueError(f"pipe.generate: temperature must be > 0, got {temperature!r}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"pipe.generate: top_p must be in (0, 1], got {top_p!r}")
    if top_k is not None and (not isinstance(top_k, int) or top_k < 0):
        raise ValueError(f"pipe.generate: top_k must be an int >= 0, got {top_k!r}")
    if eos_token_id is None:
        eos_token_id = getattr(gc, "eos_token_id", None)
    eos = () if eos_token_id is None else tuple(
        [eos_token_id] if isinstance(eos_token_id, int) else eos_token_id)
    if pad_token_id is None:
        pad_token_id = getattr(gc, "pad_token_id", None)
    if pad_token_id is None and eos:
        pad_token_id = eos[0]      # as transformers does (with a warning)
    return Options(max_new_tokens, bool(do_sample), float(temperature), top_k, top_p, eos,
                   pad_token_id)


def _check_model(model: nn.Module) -> None:
    config = getattr(model, "config", None)
    missing = [what for what, ok in (
        ("a Hugging Face config (model.config)", config is not None),
        ("a causal LM head returning .logits (e.g. LlamaForCausalLM, not LlamaModel)",
         type(model).__name__.endswith(("ForCausalLM", "LMHeadModel"))),
        ("a KV cache (config.use_cache and num_hidden_layers)",
         config is not None and getattr(config, "num_hidden_layers", None) is not None),
    ) if not ok]
    if missing:
        raise TypeError(f"pipe.generate runs a Hugging Face decoder-only causal LM with a KV "
                        f"cache; {type(model).__name__} lacks {'; '.join(missing)}")
    if getattr(config, "is_encoder_decoder", False):
        raise NotImplementedError(f"pipe.generate: {type(model).__name__} is an encoder-decoder "
                                  "model; only decoder-only causal LMs generate through fxpipe yet")


def _check_inputs(model: nn.Module, input_ids, attention_mask, length: int,
                  pad: int | None) -> torch.Tensor:
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or \
            input_ids.dtype not in (torch.int64, torch.int32):
        raise ValueError("pipe.generate: input_ids must be an integer tensor [batch, prompt], "
                         f"got {getattr(input_ids, 'shape', type(input_ids).__name__)}")
    if input_ids.shape[1] < 1 or input_ids.shape[0] < 1:
        raise ValueError(f"pipe.generate: input_ids is empty: {tuple(input_ids.shape)}")
    limit = getattr(model.config, "max_position_embeddings", None) or \
        getattr(model.config, "n_positions", None)
    if limit is not None and length > limit:
        raise ValueError(
            f"pipe.generate: the prompt ({input_ids.shape[1]} tokens) and max_new_tokens make "
            f"{length} positions, more than the model's {limit} (max_position_embeddings)")
    if attention_mask is None:
        if pad is not None and bool((input_ids[:, 0] == pad).any()):
            raise ValueError(
                f"pipe.generate: a prompt starts with the pad token ({pad}), as a left-padded "
                "one does, but no attention_mask was given: pass the tokenizer's "
                "attention_mask")
        return torch.ones_like(input_ids, dtype=torch.long)
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != input_ids.shape:
        raise ValueError(f"pipe.generate: attention_mask must have input_ids' shape "
                         f"{tuple(input_ids.shape)}, got {getattr(attention_mask, 'shape', None)}")
    mask = attention_mask.long()
    if bool((mask[:, -1] == 0).any()):
        raise ValueError("pipe.generate: a prompt ends in padding: decoder-only generation "
                         "needs left padding (tokenizer.padding_side = 'left')")
    return mask


def _check_kv_cache(kv_cache: Any) -> None:
    if kv_cache not in KV_CACHE:
        raise ValueError(f"pipe.generate: kv_cache must be one of {KV_CACHE}, got {kv_cache!r}")


def _microbatches(num_microbatch: int | None, batch: int) -> int:
    """The decode's microbatches: as given (at most one per sequence), else one. A decode
    step streams every stage's weights and computes little: more microbatches let the
    devices compute at once, but each adds its actions' host time (measured on 2 virtual
    CPU devices: 2 microbatches at 0.65x the speed of one, the same bytes moved;
    simulated on 8 H100s: 8 microbatches 4 % faster, docs/generate.md)."""
    if num_microbatch is None:
        return 1
    if isinstance(num_microbatch, bool) or not isinstance(num_microbatch, int) or \
            not 1 <= num_microbatch <= batch:
        raise ValueError(f"pipe.generate: num_microbatch must be an int in [1, {batch}] (the "
                         f"batch's sequences), got {num_microbatch!r}")
    return num_microbatch


def _row_ranges(batch: int, n: int) -> tuple[tuple[int, int], ...]:
    """The ``[start, stop)`` rows of each of the ``n`` microbatches ``torch.tensor_split``
    cuts ``batch`` rows into."""
    out, start = [], 0
    for i in range(n):
        stop = start + batch // n + (1 if i < batch % n else 0)
        out.append((start, stop))
        start = stop
    return tuple(out)


def cache_tensors(steps: Steps, stage: Any) -> list[torch.Tensor]:
    """The KV cache tensors (host) a decode stage reads."""
    buffers = steps.compiled()[1].layers.buffers
    return list({id(t): t for f in stage.params if f in buffers
                 for t in [buffers[f]] if is_scratch(t)}.values())


def generate(pipe, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
             max_new_tokens: int | None = None, do_sample: bool | None = None,
             temperature: float | None = None, top_k: int | None = None,
             top_p: float | None = None, eos_token_id: int | list[int] | None = None,
             pad_token_id: int | None = None, generator: torch.Generator | None = None,
             streamer: Any = None, kv_cache: str = "host",
             num_microbatch: int | None = None) -> torch.Tensor:
    """See ``PipelineModule.generate``."""
    _check_kv_cache(kv_cache)
    model = pipe.module
    _check_model(model)
    opts = _options(model, max_new_tokens, do_sample, temperature, top_k, top_p,
                    eos_token_id, pad_token_id)
    prompt = input_ids.shape[1] if isinstance(input_ids, torch.Tensor) and input_ids.dim() == 2 else 0
    mask = _check_inputs(model, input_ids, attention_mask, prompt + opts.max_new_tokens,
                         opts.pad).cpu()
    input_ids = input_ids.long().cpu()     # the pipe uploads what its stages need
    batch = input_ids.shape[0]
    microbatches = _microbatches(num_microbatch, batch)
    steps = pipe._generation_steps(batch, prompt + opts.max_new_tokens)
    length = steps.module.length
    placement = pipe._place_cache(steps, kv_cache, microbatches)   # may refuse: nothing ran yet
    chunk = pipe._prefill_chunk(steps, prompt, microbatches)
    steps.microbatches, steps.placement = microbatches, placement
    steps.chunk = chunk if chunk < prompt else None
    steps.module.reset()
    resident = ResidentBuffers(placement.kept) if placement.kept else None
    steps.reset_totals()
    try:
        return _loop(steps, input_ids, mask, prompt, length, opts, generator, streamer,
                     _row_ranges(batch, microbatches), resident, chunk)
    finally:
        if resident is not None:
            resident.close()
        # pipe.stats(): the whole generation's counters (its step calls', added up)
        pipe._log.stats = dict(steps.totals)


def _loop(steps: Steps, input_ids: torch.Tensor, mask: torch.Tensor, prompt: int,
          length: int, opts: Options, generator, streamer,
          rows: tuple[tuple[int, int], ...], resident: ResidentBuffers | None,
          chunk: int) -> torch.Tensor:
    """The prefill (``chunk`` prompt tokens per call, ``kv_placement.prefill_chunk``),
    then a decode step per new token (``generate``'s loop). The prefill writes the
    prompt's positions back to the host cache; the decode steps keep the caches
    ``resident`` holds on their devices (the first step uploads them)."""
    batch = input_ids.shape[0]

    full = torch.ones(batch, length, dtype=torch.long)
    full[:, :prompt] = mask
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    sequences = input_ids
    unfinished = torch.ones(batch, dtype=torch.bool)
    if streamer is not None:
        streamer.put(input_ids)
    for start in range(0, prompt, chunk):   # later chunks attend to the cache before them
        stop = min(start + chunk, prompt)
        logits = steps(input_ids[:, start:stop], full, positions[:, start:stop],
                       torch.arange(start, stop), use=ScratchUse(rows=rows, written=(start, stop)))
    for t in range(opts.max_new_tokens):
        token = sample_next(logits, do_sample=opts.do_sample, temperature=opts.temperature,
                            top_k=opts.top_k, top_p=opts.top_p, generator=generator)
        if opts.pad is not None:
            token = torch.where(unfinished, token, torch.full_like(token, opts.pad))
        sequences = torch.cat([sequences, token[:, None]], dim=1)
        if streamer is not None:
            streamer.put(token)
        if opts.eos:
            unfinished &= ~torch.isin(token, torch.tensor(opts.eos))
        if not bool(unfinished.any()) or t == opts.max_new_tokens - 1:
            break
        here = prompt + t
        logits = steps(token[:, None], full, positions[:, -1:] + t + 1, torch.tensor([here]),
                       use=ScratchUse(rows=rows, written=(here, here + 1), resident=resident),
                       plan=steps.placement.plan)
    if streamer is not None:
        streamer.end()
    return sequences


class Steps:
    """The compiled calls of one :class:`StepModule`: a pipe over it whose host copy of
    the weights is the training pipe's, with two captured graphs, the decode step (one
    token per sequence) and the prefill (any prompt length above one)."""

    def __init__(self, module: StepModule, pipe):
        self.module = module
        self.pipe = pipe
        self.microbatches = _microbatches(None, module.batch)
        self.placement: Any = None   # the last generate's (kv_placement.CachePlacement)
        self.placements: dict[tuple[str, int], Any] = {}   # by (kv_cache, microbatches)
        self.chunk: int | None = None   # the last generate's prompt tokens per prefill call,
        # where the prompt did not fit one (kv_placement.prefill_chunk)
        self.chunks: dict[tuple[int, int], int] = {}   # by (prompt length bucket, microbatches)
        self.totals: dict[str, int] = {}   # the counters of the calls since ``reset_totals``

    def reset_totals(self) -> None:
        self.totals = {}

    def _add_totals(self, stats: dict[str, int]) -> None:
        """Add a call's counters (``pipe.stats()``) to the generation's: counts and bytes
        add up; ``host_pinned_bytes``, what is reserved at the end, is the last call's."""
        for k, v in stats.items():
            self.totals[k] = v if k == "host_pinned_bytes" else self.totals.get(k, 0) + v

    def __call__(self, input_ids, attention_mask, position_ids, cache_position,
                 use: ScratchUse | None = None, plan: Any = None):
        """One call: ``use`` says which rows each microbatch is (the batch split into
        ``len(use.rows)``), which cache positions it writes and which caches stay on the
        devices (``runtime.host.scratch``); without it, one microbatch and whole caches.
        ``plan``: a decode step's plan cut for its resident caches
        (``kv_placement.cache_plan``), else the step pipe's."""
        use = use or ScratchUse()
        cfg = RunConfig(num_microbatch=len(use.rows) if use.rows else 1, split_input=split_spec(),
                        execute_plan=plan)
        with torch.no_grad(), scratch_use(use):
            try:
                return self.pipe(input_ids, attention_mask, position_ids, cache_position,
                                 run_config=cfg)
            finally:
                self._add_totals(self.pipe.stats())

    def compiled(self):
        """The (prefill, decode step) graphs (``graph_cache.CompiledGraph``), in the
        module's mode."""
        last = {}
        for compiled in self.pipe._cache:
            if compiled.layers.training == self.module.training:
                last[compiled.layers.example_leaves[0].shape[1] == 1] = compiled
        return last[False], last[True]

    def executables(self):
        """The (prefill, decode step) Executables: what the last ``generate``'s calls ran
        (else the default's: one microbatch)."""
        plan = self.placement.plan if self.placement is not None else None
        prefill, decode = self.compiled()
        return (self.pipe._executable("infer", self.microbatches, compiled=prefill),
                self.pipe._executable("infer", self.microbatches, compiled=decode, plan=plan))

    def cache_line(self) -> str:
        """Where the last ``generate`` kept each decode stage's KV cache."""
        placement = self.placement
        stages = sorted(s for s, st in self.executables()[1].stages.items()
                        if cache_tensors(self, st))
        resident = sorted(placement.resident) if placement is not None else []
        streamed = [s for s in stages if s not in resident]
        kind = placement.kv_cache if placement is not None else "host"
        parts = []
        if placement is not None and placement.plan is not None:
            parts.append(f"the decode re-cut for its resident caches "
                         f"({', '.join(f'{r.start}:{r.stop}' for r in placement.plan.fwd_plan)})")
        if resident:
            parts.append(f"stages {resident} keep theirs on their device for the whole call "
                         "(the first decode step's Prefetch uploads it; no writeback)")
        if streamed:
            parts.append(f"stages {streamed} stream theirs in with their weights and write "
                         "back the new position")
        return f"# KV cache (kv_cache={kind!r}): " + "; ".join(parts)


@dataclass(frozen=True)
class GenerationProgram:
    """What ``pipe.generate`` runs: the prefill call's Program, then each decode step's
    (``pipe.program("generate")``)."""

    prefill: Any
    decode: Any
    cache: str = ""      # where the decode keeps each stage's KV cache (Steps.cache_line)
    chunk: int | None = None   # prompt tokens per prefill call (None: the whole prompt)

    def __str__(self) -> str:
        m = self.decode.num_microbatches
        how = "the batch as one microbatch" if m == 1 else f"the batch in {m} microbatches"
        once = "once" if self.chunk is None else \
            f"in chunks of at most {self.chunk} tokens, a call each (kv_placement.prefill_chunk)"
        return (f"# prefill: the prompts through every stage, {once}\n" + str(self.prefill).rstrip()
                + f"\n# each decode step: one new token of every sequence, {how}\n"
                + (self.cache + "\n" if self.cache else "") + str(self.decode).rstrip() + "\n")


def inspected_steps(pipe) -> Steps:
    """The step module ``pipe.program("generate")`` and ``pipe.code("generate")`` show:
    the last ``generate`` call's, else one for the example's batch and ``BUCKET`` tokens."""
    if pipe._generation:
        return pipe._generation[-1]
    _check_model(pipe.module)
    example = next(x for x in pipe.layers.example_leaves if isinstance(x, torch.Tensor))
    return pipe._generation_steps(example.shape[0], BUCKET)
