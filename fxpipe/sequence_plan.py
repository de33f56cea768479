"""The memory of a step that runs one sequence as token chunks (``RunConfig.sequence_chunks``),
for ``fxpipe.plan.max_sequence_length``.

A chunked step of ``L`` tokens in ``K`` chunks is a step of ``K`` microbatches of
``L / K`` tokens each (the layers' costs at the chunk's length), plus the keys and
values the chunk attention keeps (``fxpipe.sequence_kv``). Per attention layer, with
``kv`` the bytes of one token's keys (or values) in the device dtype and ``L`` the
tokens of every row of the call (rows x length), a stage's job holds on its device, for
the whole job:

- the layer's keys and values of the whole sequence, ``2 * L * kv`` (forward and
  backward jobs: :func:`with_kv` adds them to the layer's ``kept``, which a stage sums
  over its layers with its parameters, and which no prefetch reserves room for);
- in a backward job, their fp32 gradient buffers, ``2 * L * kv * 4 / itemsize`` (added
  to ``grads``, which only backward stages hold);
- while the layer's backward runs, the gradients of the keys and values it read,
  ``2 * L * kv`` (added to its ``bwd_peak``).

The host holds every attention layer's keys and values between the forward and the
backward, ``2 * L * kv`` each (:func:`host_kv_bytes`).

>>> kv = KVLayout(layers=(1, 2), elements=8, itemsize=2)
>>> host_kv_bytes(kv, 1024)
65536
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn as nn

from fxpipe.passes.stage_memory import ChainMemory

__all__ = ["KVLayout", "kv_layout", "with_kv", "host_kv_bytes", "chunk_counts"]


@dataclass(frozen=True)
class KVLayout:
    """Which layers of a chain run attention (``layers``), and one attention layer's
    keys per token: ``elements`` (kv heads x head dim) of ``itemsize`` bytes."""

    layers: tuple[int, ...]
    elements: int
    itemsize: int

    @property
    def bytes_per_token(self) -> int:
        return self.elements * self.itemsize


def kv_layout(model: nn.Module, lg: Any, dtype: torch.dtype | None) -> KVLayout | None:
    """The chain's attention layers and their key size, for a Hugging Face model whose
    attention a chunked call can run (its config's key/value heads and head dim; an
    attention layer is one whose block has an ``...Attention`` module with a
    ``layer_idx``); ``None`` for any other model."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "_attn_implementation"):
        return None
    config = getattr(config, "get_text_config", lambda: config)()
    heads = getattr(config, "num_attention_heads", None)
    if not heads:
        return None
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    layers = []
    for layer in lg.layers:
        try:
            block = model.get_submodule(layer.name)
        except AttributeError:
            continue
        if any(type(m).__name__.endswith("Attention") and hasattr(m, "layer_idx")
               for m in block.modules()):
            layers.append(layer.index)
    if not layers:
        return None
    itemsize = (dtype or next((p.dtype for p in model.parameters() if p.is_floating_point()),
                              torch.float32)).itemsize
    return KVLayout(tuple(layers), int(kv_heads) * int(head_dim), itemsize)


def with_kv(memory: ChainMemory, kv: KVLayout, tokens: int) -> ChainMemory:
    """``memory`` (one chunk's) with what the attention layers keep on a device for a
    call of ``tokens`` tokens (its rows x its length; module docstring)."""
    one = tokens * kv.bytes_per_token
    fp32 = tokens * kv.elements * 4
    layers = set(kv.layers)

    def plus(vector: tuple[int, ...], n: int) -> tuple[int, ...]:
        return tuple(v + n if i in layers else v for i, v in enumerate(vector))

    kept = memory.kept or (0,) * len(memory)
    return replace(memory, kept=plus(kept, 2 * one), grads=plus(memory.grads, 2 * fp32),
                   bwd_peak=plus(memory.bwd_peak, 2 * one))


def host_kv_bytes(kv: KVLayout, tokens: int) -> int:
    """Host bytes of a chunked step's keys and values for ``tokens`` tokens (its rows x
    its length): every attention layer's, between its forward job and its backward job."""
    return 2 * tokens * kv.bytes_per_token * len(kv.layers)


def chunk_counts(length: int, step: int) -> list[int]:
    """The chunk counts ``max_sequence_length`` tries for ``length`` tokens, fewest first:
    1, then the counts that cut it into chunks of ``step * 2**j`` tokens (from the
    longest down to ``step``), so the layers are costed at a few chunk lengths for every
    length tried.

    >>> chunk_counts(12288, 1024)
    [1, 3, 6, 12]
    """
    out = [1]
    chunk = step
    while chunk * 2 < length:
        chunk *= 2
    while chunk >= step:
        if length % chunk == 0 and length // chunk > 1:
            out.append(length // chunk)
        chunk //= 2
    return out
