"""``LiveBytes``: the bytes of tensor storages allocated under a dispatch mode, while they live.

The measuring tool under fxpipe's memory figures: the cost pass counts each layer's
bytes with it (``fxpipe.passes.costs``, on fake tensors) and ``VirtualDevice`` its
device's (real tensors); ``fxpipe.passes.stage_memory`` composes layer bytes into stage peaks.

Every op dispatched under the mode is looked at after it ran: each output storage that is
not one of the op's inputs' (a view, an in-place result) and not already counted is a new
allocation, counted until Python frees it (``StorageWeakRef``: the mode keeps no storage
alive). ``bytes`` is what is allocated now, ``peak`` the most at any point, and each
allocation carries the ``kind`` set when it was made (``retag`` moves it to another,
e.g. a tensor autograd saves). It works on real tensors (measuring) and on fake ones
(costing: the storages are meta, their sizes real).

Storages made before the mode was entered are not counted. What a kernel allocates
internally and frees before returning (e.g. a fused attention kernel's scratch memory)
is not visible to a dispatch mode.

``kernels`` counts the ops that launch a kernel on a device (:func:`launches_kernel`: not
a view, not an allocation or metadata op): what an eager stage issues, one dispatch and
one launch each (the host time ``fxpipe.simulate`` prices per kernel).

>>> with LiveBytes() as live:
...     x = torch.ones(256)                  # 1 kB
...     y = x.view(16, 16) * 2               # the view is free, the product 1 kB
...     del x
>>> live.bytes, live.peak, live.kernels  # ones (a fill) and mul launch; view does not
(1024, 2048, 2)
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.utils._pytree as pytree
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode


class LiveBytes(TorchDispatchMode):
    """Count live storage bytes made under the mode (see the module docstring)."""

    def __init__(self, kind: str = "workspace"):
        super().__init__()
        self.kind = kind
        self.kernels = 0   # ops dispatched under the mode that launch one (launches_kernel)
        self._live: dict[int, tuple[StorageWeakRef, int, str]] = {}  # storage -> (ref, bytes, kind)
        self._bytes = 0
        self.peak = 0
        self.at_peak: dict[str, int] = {}   # bytes by kind when the peak was reached

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.kernels += launches_kernel(func)
        made = new_storages(args, kwargs, out)
        if made:   # the dead are swept before the new count toward a peak (only then)
            self._sweep()
            for t in made:
                self.track(t)
        return out

    @property
    def bytes(self) -> int:
        """Bytes allocated under the mode and still alive."""
        self._sweep()
        return self._bytes

    def track(self, t: torch.Tensor) -> None:
        """Count ``t``'s storage (once, after a ``_sweep``) as allocated now, of ``self.kind``."""
        key = storage_key(t)
        if key in self._live:
            return
        storage = t.untyped_storage()
        nbytes = storage.nbytes()
        self._live[key] = (StorageWeakRef(storage), nbytes, self.kind)
        self._bytes += nbytes
        if self._bytes > self.peak:
            self.peak = self._bytes
            self.at_peak = self.by_kind()

    def retag(self, t: torch.Tensor, kind: str, only: str | None = None) -> None:
        """Count ``t``'s storage as ``kind`` from now on, if the mode counts it (and it is
        of kind ``only``, when given)."""
        entry = self._live.get(storage_key(t))
        if entry is not None and not entry[0].expired() and only in (None, entry[2]):
            self._live[storage_key(t)] = (entry[0], entry[1], kind)

    def counts(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s storage was allocated under the mode and is alive."""
        entry = self._live.get(storage_key(t))
        return entry is not None and not entry[0].expired()

    def new_bytes(self, tensors: Iterable[Any]) -> int:
        """Bytes of the distinct storages among ``tensors`` that the mode counts."""
        keys = {storage_key(t) for t in tensors if isinstance(t, torch.Tensor) and self.counts(t)}
        return sum(self._live[k][1] for k in keys)

    def by_kind(self) -> dict[str, int]:
        """Live bytes by kind."""
        out: dict[str, int] = {}
        for _, nbytes, kind in self._live.values():
            out[kind] = out.get(kind, 0) + nbytes
        return out

    def reset_peak(self) -> None:
        """Start a new peak from what is allocated now."""
        self.peak = self.bytes
        self.at_peak = self.by_kind()

    def _sweep(self) -> None:
        dead = [k for k, (ref, _, _) in self._live.items() if ref.expired()]
        for k in dead:
            self._bytes -= self._live.pop(k)[1]


_NO_KERNEL = frozenset((
    "empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "lift_fresh",
    "detach", "detach_", "alias", "set_", "resolve_conj", "resolve_neg", "result_type",
    "is_nonzero", "_local_scalar_dense", "sym_size", "sym_stride", "sym_numel",
    "sym_storage_offset", "_unsafe_view", "_reshape_alias"))


def launches_kernel(func: Any) -> bool:
    """Whether the aten op ``func`` launches a kernel on a device: not a view (aliasing
    its input, ``OpOverload.is_view``), nor an allocation or metadata op (``empty``,
    ``detach``, ``set_``, a size, ``prim.device``).

    >>> launches_kernel(torch.ops.aten.mm.default), launches_kernel(torch.ops.aten.t.default)
    (True, False)
    """
    packet = getattr(func, "overloadpacket", None)
    return (packet is not None and func.namespace != "prim" and not func.is_view
            and packet.__name__ not in _NO_KERNEL)


def storage_key(t: torch.Tensor) -> int:
    """Which storage ``t`` is a view of (the same for every view of it)."""
    return t.untyped_storage()._cdata


def new_storages(args: Any, kwargs: Any, out: Any) -> list[torch.Tensor]:
    """The tensors among an op's outputs ``out`` whose storage is none of its inputs'
    (``args``, ``kwargs``): what it allocated (not a view, not an in-place result)."""
    made = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
    if not made:
        return made
    inputs = {storage_key(t) for t in pytree.tree_leaves((args, kwargs))
              if isinstance(t, torch.Tensor)}
    return [t for t in made if storage_key(t) not in inputs]
