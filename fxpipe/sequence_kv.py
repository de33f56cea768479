"""Attention over one sequence run as token chunks: each chunk's queries read the keys and
values of the chunks before it (TeraPipe's split of a causal LM along the tokens).

A call with ``RunConfig(sequence_chunks=K)`` (``fxpipe.sequence_chunks``) runs the
sequence's ``K`` token chunks as the call's microbatches, in token order through every
forward stage. Each attention layer of the captured graph is one op,
``torch.ops.fxpipe.chunk_attention(q, k, v, slot, layer, scaling, window, softcap)``
(``pipe.code()`` prints it), that attends the chunk's queries over the keys and values of
every earlier chunk and its own, causally, at the chunk's offset in the sequence, with the
layer's sliding window and logit soft-capping (Mistral, Gemma 2) if it has them.

Where the keys and values are (:class:`SequenceKV`, per attention layer
``[batch, kv_heads, length, head_dim]``): a stage runs all of a call's chunks in one job
on one device, so

- in a forward job they stay on that device, each chunk writing its own; after the last
  chunk they go to the host once (``d2h_bytes_kv``; not in an inference call);
- the backward job runs the chunks in reverse (the Program of a chunked call lists each
  backward stage's microbatches last first). Its first chunk uploads them once
  (``h2d_bytes_kv``) with zeroed fp32 gradient buffers; chunk ``i``'s backward adds the
  gradients of the earlier chunks' keys and values there, and what the later chunks
  added to its own keys' and values' gradients before they flow into its projections.
  After chunk 0 the layer's buffers are freed.

The result is the unchunked step's, up to the reassociation of attention's sums: each
key's gradient is summed per chunk, then over the chunks (in fp32).

>>> kv = SequenceKV([(0, 2), (2, 4)])
>>> q = torch.randn(1, 2, 2, 4); k = torch.randn(1, 1, 2, 4); v = torch.randn(1, 1, 2, 4)
>>> with opened(kv) as slot, running_chunk(1), torch.no_grad():
...     out = torch.ops.fxpipe.chunk_attention(q, k, v, slot, 0, 0.5, 0, 0.0)
>>> out.shape, kv.host[0][0].shape    # the last chunk: the layer's keys to the host
(torch.Size([1, 2, 2, 4]), torch.Size([1, 1, 4, 4]))
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import _disable_current_modes

__all__ = ["SequenceKV", "opened", "running_chunk", "attend", "chunk_bounds"]


def chunk_bounds(length: int, chunks: int) -> list[tuple[int, int]]:
    """``(start, stop)`` of each of ``chunks`` token chunks of a ``length``-token sequence:
    as ``torch.tensor_split`` cuts (the first ``length % chunks`` one token longer).

    >>> chunk_bounds(10, 3)
    [(0, 4), (4, 7), (7, 10)]
    """
    if not 1 <= chunks <= length:
        raise ValueError(f"sequence_chunks={chunks} does not split a sequence of {length} "
                         f"tokens: it must be between 1 and the length")
    base, extra = divmod(length, chunks)
    stops = list(itertools.accumulate(base + (i < extra) for i in range(chunks)))
    return list(zip([0] + stops[:-1], stops))


class SequenceKV:
    """The keys and values of a chunked call's attention layers (module docstring): the
    chunks' ``bounds``; per layer, the host copy between the forward and the backward
    (``host[layer]``: keys, values) and the device's during a job (``device[layer]``:
    keys, values, and in a backward job their fp32 gradients); ``training``: whether a
    backward follows (else the forward keeps no host copy); the bytes moved."""

    def __init__(self, bounds: Sequence[tuple[int, int]], training: bool = True):
        self.bounds = list(bounds)
        self.length = self.bounds[-1][1]
        self.training = training
        self.host: dict[int, list[Tensor]] = {}
        self.device: dict[int, list[Tensor]] = {}
        self.h2d_bytes = 0
        self.d2h_bytes = 0

    def _full(self, own: Tensor, dtype: torch.dtype | None = None) -> Tensor:
        shape = (own.shape[0], own.shape[1], self.length, own.shape[3])
        return own.new_zeros(shape, dtype=dtype or own.dtype)

    def forward_job(self, layer: int, k: Tensor, v: Tensor) -> list[Tensor]:
        """Layer ``layer``'s keys and values on the forward job's device (made at its
        first chunk)."""
        held = self.device.get(layer)
        if held is None or held[0].device != k.device:
            held = self.device[layer] = _counted([self._full(k), self._full(v)])
        return held

    def backward_job(self, layer: int, k: Tensor, v: Tensor) -> list[Tensor]:
        """Layer ``layer``'s keys, values and their gradient buffers on the backward
        job's device: uploaded from the host at its first chunk."""
        held = self.device.get(layer)
        if held is None or len(held) < 4 or held[0].device != k.device:
            kv = []
            for own, host in zip((k, v), self.host[layer]):
                dev = own.new_empty(host.shape)
                dev.copy_(host, non_blocking=True)
                self.h2d_bytes += host.numel() * host.element_size()
                kv.append(dev)
            held = self.device[layer] = _counted(kv + [self._full(k, torch.float32),
                                                       self._full(v, torch.float32)])
        return held

    def offload(self, layer: int) -> None:
        """The end of a forward job: the layer's keys and values to the host."""
        held = self.device.pop(layer)
        if not self.training:
            return
        out = []
        for dev in held[:2]:
            with _disable_current_modes():   # host memory, not the device's
                host = torch.empty(dev.shape, dtype=dev.dtype, pin_memory=dev.is_cuda)
            host.copy_(dev)
            self.d2h_bytes += host.numel() * host.element_size()
            out.append(host)
        self.host[layer] = out


_on_device: list = [None]   # the runtime's: count tensors as its running device's


def count_on_device(hook: Callable[[list[Tensor]], None]) -> None:
    """Install ``hook(tensors)``, which counts tensors made inside the op on the device
    whose work runs it (the op's own allocations are below the dispatch modes a virtual
    device counts with: ``fxpipe.runtime.devices.emulator_threads`` installs it)."""
    _on_device[0] = hook


def _counted(tensors: list[Tensor]) -> list[Tensor]:
    if _on_device[0] is not None:
        _on_device[0](tensors)
    return tensors


_STORES: dict[int, SequenceKV] = {}
_SLOTS = itertools.count()
_current = threading.local()


@contextlib.contextmanager
def opened(store: SequenceKV, slot: int | None = None) -> Iterator[int]:
    """``store`` served under ``slot`` (a new one by default) while the block runs."""
    slot = next(_SLOTS) if slot is None else slot
    _STORES[slot] = store
    try:
        yield slot
    finally:
        _STORES.pop(slot, None)


def new_slot() -> int:
    """A slot no store uses yet (a chunked step module keeps one for its life)."""
    return next(_SLOTS)


def set_chunk(index: int | None) -> int | None:
    """From now on, ops run in this thread run chunk ``index``; returns the one before
    (the stage code sets the microbatch it runs, and restores it: no context manager on
    the per-action path)."""
    saved = getattr(_current, "chunk", None)
    _current.chunk = index
    return saved


@contextlib.contextmanager
def running_chunk(index: int | None) -> Iterator[None]:
    """Ops run in this thread inside the block run chunk ``index``."""
    saved = set_chunk(index)
    try:
        yield
    finally:
        set_chunk(saved)


def _chunk() -> int:
    chunk = getattr(_current, "chunk", None)
    if chunk is None:
        raise RuntimeError("fxpipe.chunk_attention ran outside a chunked call: it reads which "
                           "chunk it runs from the stage code (sequence_kv.running_chunk)")
    return chunk


def attend(q: Tensor, k: Tensor, v: Tensor, start: int, scaling: float, window: int,
           softcap: float) -> Tensor:
    """Causal attention of the queries at positions ``start ..`` over the keys at ``0 ..``
    (``q`` ``[b, heads, c, d]``; ``k``, ``v`` ``[b, kv_heads, start + c, d]``, each kv
    head serving ``heads / kv_heads`` query heads in turn, as transformers' ``repeat_kv``);
    ``window`` > 0: a query sees only keys less than ``window`` positions back (the keys
    before the chunk's window are not read); ``softcap`` > 0: scores soft-capped
    (``cap * tanh(s / cap)``) before the mask, with the probabilities in fp32 (Gemma 2's
    eager attention). Without either, on a GPU the mask is ``causal_lower_right``, which
    its attention kernels apply without materializing it (elsewhere a ``[c, n]`` mask)."""
    b, heads, c, d = q.shape
    kv_heads = k.shape[1]
    first = max(0, start - window + 1) if window > 0 else 0
    k, v = k[:, :, first:], v[:, :, first:]
    n = k.shape[2]
    if window <= 0 and softcap <= 0 and q.is_cuda:
        # (imported here: ``torch.nn.attention.bias`` imports all of dynamo, 2 s of
        # ``import fxpipe`` otherwise)
        from torch.nn.attention.bias import causal_lower_right
        with _disable_current_modes():   # a tensor subclass, made outside fxpipe's counting
            bias = causal_lower_right(c, n)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scaling,
                                              enable_gqa=heads != kv_heads)
    qpos = torch.arange(start, start + c, device=q.device)[:, None]
    kpos = torch.arange(first, first + n, device=q.device)[None, :]
    allowed = (kpos <= qpos) & ((kpos > qpos - window) if window > 0 else True)
    if softcap <= 0:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scaling,
                                              enable_gqa=heads != kv_heads)
    rep = heads // kv_heads   # each kv head's query heads as one row block: no key copies
    grouped = q.reshape(b, kv_heads, rep * c, d)
    scores = torch.matmul(grouped, k.transpose(2, 3)) * scaling
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~allowed.repeat(rep, 1), float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v).reshape(b, heads, c, d)


@torch.library.custom_op("fxpipe::chunk_attention", mutates_args=())
def chunk_attention(q: Tensor, k: Tensor, v: Tensor, slot: int, layer: int, scaling: float,
                    window: int, softcap: float) -> Tensor:
    """The chunk's attention (see the module), ``[b, heads, c, d]``. A recompute (the
    layer's keys on the host or in a backward job) reads the backward job's keys;
    otherwise, a forward job, it writes the chunk's, and the last chunk sends them to the
    host."""
    store = _STORES[slot]
    chunk = _chunk()
    start, stop = store.bounds[chunk]
    if stop - start != q.shape[2]:
        raise RuntimeError(f"fxpipe.chunk_attention: chunk of {q.shape[2]} tokens where the "
                           f"call's chunk spans positions {start}..{stop - 1}")
    if layer in store.host or len(store.device.get(layer, ())) == 4:   # a recompute
        keys, values = store.backward_job(layer, k, v)[:2]
        return attend(q, keys[:, :, :stop], values[:, :, :stop], start, scaling, window, softcap)
    keys, values = store.forward_job(layer, k, v)
    keys[:, :, start:stop].copy_(k)
    values[:, :, start:stop].copy_(v)
    out = attend(q, keys[:, :, :stop], values[:, :, :stop], start, scaling, window, softcap)
    if chunk == len(store.bounds) - 1:
        store.offload(layer)
    return out


@chunk_attention.register_fake
def _(q, k, v, slot, layer, scaling, window, softcap):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def _keys_read(slot: int, chunk_len: int, window: int) -> int:
    """Keys a chunk of ``chunk_len`` tokens reads on average over the call's chunks (what
    a costing pass counts: the chunks run one graph): half the sequence before it, and
    its own; at most the window."""
    store = _STORES.get(slot)
    before = (store.length - chunk_len) // 2 if store is not None else 0
    keys = before + chunk_len
    return min(keys, window + chunk_len) if window > 0 else keys


def _flops(q, k, v, slot, layer, scaling, window, softcap, *args, out_shape=None, **kw) -> int:
    """``FlopCounterMode``'s count of a chunk attention: two products over the keys read."""
    batch, heads, c, d = q
    return 2 * batch * heads * c * _keys_read(slot, c, window) * (d + v[-1])


def register_flops() -> None:
    """Teach ``FlopCounterMode`` the chunk attention's FLOPs (idempotent; a chunked call's
    ``fxpipe.sequence_chunks.serving`` does, before its chunk step is costed)."""
    from torch.utils import flop_counter
    op = torch.ops.fxpipe.chunk_attention
    if op not in flop_counter.flop_registry:
        flop_counter.register_flop_formula(op)(_flops)



def _setup(ctx, inputs, output) -> None:
    q, k, v, slot, layer, scaling, window, softcap = inputs
    ctx.save_for_backward(q, k, v)
    ctx.chunk = _chunk()
    ctx.args = (slot, layer, scaling, window, softcap)


def _backward(ctx, grad: Tensor):
    q, k, v = ctx.saved_tensors
    slot, layer, scaling, window, softcap = ctx.args
    if isinstance(q, FakeTensor):   # a costing pass: the average chunk's keys, no store
        c = q.shape[2]
        before = _keys_read(slot, c, window) - c
        with torch.enable_grad():
            query = q.detach().requires_grad_()
            seen = [torch.cat([t.new_zeros(t.shape[:2] + (before,) + t.shape[3:]), t.detach()],
                              2).requires_grad_() for t in (k, v)]
            out = attend(query, *seen, before, scaling, window, softcap)
            dq, dk, dv = torch.autograd.grad(out, (query, *seen), grad)
        return dq, dk[:, :, before:], dv[:, :, before:], None, None, None, None, None
    store = _STORES[slot]
    start, stop = store.bounds[ctx.chunk]
    keys, values, dkeys_acc, dvalues_acc = store.backward_job(layer, k, v)
    with torch.enable_grad():
        query = q.detach().requires_grad_()
        seen = [t[:, :, :stop].detach().requires_grad_() for t in (keys, values)]
        out = attend(query, *seen, start, scaling, window, softcap)
        dq, dkeys, dvalues = torch.autograd.grad(out, (query, *seen), grad)
    own = []
    for acc, d in ((dkeys_acc, dkeys), (dvalues_acc, dvalues)):
        if start:   # to the earlier chunks' keys, whose backward runs after this one's
            acc[:, :, :start] += d[:, :, :start]
        own.append((d[:, :, start:].float() + acc[:, :, start:stop]).to(d.dtype))
    if ctx.chunk == 0:   # the layer's last backward: its keys are needed no more
        store.device.pop(layer, None)
        store.host.pop(layer, None)
    return dq, own[0], own[1], None, None, None, None, None


chunk_attention.register_autograd(_backward, setup_context=_setup)
