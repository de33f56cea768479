"""``PipelineModule.generate`` and the compiled step modules behind it: a base class of
``PipelineModule`` (as ``fxpipe.inspecting``'s and ``fxpipe.checkpointing``'s are).

A pipe generates through step pipes of its own (``fxpipe.generation``: a ``StepModule``
per batch size and cache length, compiled on the pipe's devices with the pipe's host copy
of the weights), whose KV cache placement and prefill chunk are decided once per shape
(``fxpipe.kv_placement``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch

from fxpipe.config import RunConfig
from fxpipe.runtime.host.params import HostParams


class Generating:
    """``generate`` and what it compiles (a ``PipelineModule`` base)."""

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                 max_new_tokens: int | None = None, do_sample: bool | None = None,
                 temperature: float | None = None, top_k: int | None = None,
                 top_p: float | None = None, eos_token_id: int | Sequence[int] | None = None,
                 pad_token_id: int | None = None, generator: torch.Generator | None = None,
                 streamer: Any = None, kv_cache: Literal["host", "device", "auto"] = "host",
                 num_microbatch: int | None = None) -> torch.Tensor:
        """Generate continuations of ``input_ids`` (``[batch, prompt]``, left-padded, with
        ``attention_mask``) with a KV cache, as ``transformers``' ``model.generate``
        does for a decoder-only causal LM: returns ``[batch, prompt + new]`` token ids,
        each sequence padded with ``pad_token_id`` after its EOS; greedy unless
        ``do_sample`` (then temperature, top-k, top-p, drawn from ``generator``);
        defaults from ``model.generation_config``. ``streamer`` gets ``put(tokens)`` and
        ``end()`` as transformers' streamers do.

        The prompt runs through the stages once (prefill), then each new token of the
        whole batch, split into ``num_microbatch`` microbatches (default one; at most one
        per sequence) that flow round-robin so several devices compute at once, each
        stage's weights uploaded once per token for all of them. ``kv_cache``: ``"host"``, each layer's cache lives
        in host memory, streams in with its layer's weights and only the positions a
        call wrote go back; ``"device"``, every stage's cache stays on the device that
        runs it for the whole call (uploaded at the first decode step, never written
        back; refused with the numbers before anything runs if a device cannot hold
        its caches, two stages' weights and the activations); ``"auto"``, per stage,
        the caches that fit stay (``fxpipe.kv_placement``). The weights are the ones
        training uses (one host copy): after ``forward_backward(..., optimizer=...)`` the
        next ``generate`` sees the update, with no re-compile. See
        ``fxpipe.generation`` and docs/generate.md."""
        from fxpipe.generation import generate
        self._check_open()
        return generate(self, input_ids, attention_mask, max_new_tokens=max_new_tokens,
                        do_sample=do_sample, temperature=temperature, top_k=top_k,
                        top_p=top_p, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
                        generator=generator, streamer=streamer, kv_cache=kv_cache,
                        num_microbatch=num_microbatch)

    def _place_cache(self, steps: Any, kv_cache: str, num_microbatch: int):
        """Where ``steps``' decode keeps each stage's KV cache (``kv_placement.place_cache``;
        decided once per step module, placement and microbatch count)."""
        from fxpipe.kv_placement import place_cache
        key = (kv_cache, num_microbatch)
        if key not in steps.placements:
            steps.placements[key] = place_cache(steps, kv_cache, num_microbatch)
        return steps.placements[key]

    def _prefill_chunk(self, steps: Any, prompt: int, num_microbatch: int) -> int:
        """The most prompt tokens one prefill call of ``steps`` takes
        (``kv_placement.prefill_chunk``; decided once per prompt length rounded up to
        ``generation.BUCKET`` and microbatch count)."""
        from fxpipe.generation import BUCKET
        from fxpipe.kv_placement import prefill_chunk
        if prompt <= 1:   # one token: the decode step's graph, planned for it
            return prompt
        # decided for the prompt rounded up to BUCKET (a chunk that fits it fits the prompt)
        key = (min(-(-prompt // BUCKET) * BUCKET, steps.module.length), num_microbatch)
        if key not in steps.chunks:
            steps.chunks[key] = prefill_chunk(steps, *key)
        return min(steps.chunks[key], prompt)

    def _generation_steps(self, batch: int, length: int):
        """The compiled step module for ``batch`` sequences of up to ``length`` tokens:
        one made for this batch size whose cache is long enough, else a new one (its
        length rounded up to ``generation.BUCKET``), compiled on the pipe's devices with
        the pipe's host copy of the weights."""
        from fxpipe.generation import BUCKET, StepModule, Steps
        fits = [s for s in self._generation if s.module.batch == batch and s.module.length >= length]
        if fits:
            steps = min(fits, key=lambda s: s.module.length)
        else:
            dtype = self.param_dtype or next(
                (t.dtype for t in self.module.parameters() if t.is_floating_point()), torch.float32)
            step = StepModule(self.module, batch, -(-length // BUCKET) * BUCKET, dtype)
            step.train(self.module.training)
            self._host_params()                      # made now if no call made them yet
            HostParams.share(step, self.module)      # one host copy of the weights
            with torch.no_grad():
                # captured on examples with padding: a model may take a branch on the mask's
                # values (no padding: no mask), which the capture would bake in
                pipe = type(self)(
                    step, step.example(1), {}, devices=self.devices, capture=self._capture,
                    layers=None, config=RunConfig.merge(self.config, RunConfig(num_microbatch=1)),
                    plan=None, param_dtype=self.param_dtype, pin_memory=self.pin_memory,
                    infer_only=True)
                pipe._compiled_for(step.example(3), {})   # prefill: every prompt length > 1
            steps = Steps(step, pipe)
            self._generation.append(steps)
        steps.module.train(self.module.training)
        return steps
