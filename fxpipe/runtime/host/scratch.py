"""How a call uses its scratch buffers (a generation's KV cache, ``params.mark_scratch``):
which rows each microbatch owns, which positions the call writes, and which buffers stay
resident on the devices across calls.

A scratch buffer is per-sequence state, batch-major: dim 0 holds the call's rows. The
stage code serves microbatch ``m`` the rows ``rows[m]`` of it (a view: a write through
it lands in the whole buffer), so a batch split into microbatches shares one buffer per
layer, uploaded once with the stage's weights. A scratch buffer's writeback copies to the
host only the positions ``written`` names along ``dim`` of those rows (the tokens this
call wrote), not the whole buffer.

``ResidentBuffers`` keeps chosen scratch buffers on the device that runs their stage,
from the first call that prefetches them to :meth:`ResidentBuffers.close`: the
``Prefetch`` uploads one the first time (counted as ``"cache"`` on the device), serves
the same device tensor every later call, never releases it, and its writeback copies
nothing (the device copy is the cache). ``pipe.generate(kv_cache="device")`` holds one
over its decode steps.

The caller states the use around its calls (:func:`scratch_use`, a context variable read
when a call is made, on the caller's thread); a call made outside one serves whole
buffers, writes them back whole, and keeps nothing resident.

>>> use = ScratchUse(rows=((0, 2), (2, 3)), written=(5, 6))
>>> use.rows_of(1), use.window(2)
((2, 3), (5, 6))
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from fxpipe.runtime.devices.device import Device

__all__ = ["ResidentBuffers", "ScratchUse", "current", "scratch_use"]


class ResidentBuffers:
    """Scratch buffers kept on devices across calls: ``keep`` holds the ids of the host
    tensors chosen (``None``: every scratch buffer a Prefetch meets). Thread-safe (each
    device's issue thread prefetches on its own)."""

    def __init__(self, keep: frozenset[int] | None = None):
        self.keep = keep
        self._held: dict[int, tuple[Device, torch.Tensor]] = {}   # id(host) -> (device, copy)
        self._lock = threading.Lock()

    def wants(self, host: torch.Tensor) -> bool:
        """Whether ``host`` stays resident (it must be a scratch buffer)."""
        return self.keep is None or id(host) in self.keep

    def get(self, host: torch.Tensor, device: Device, owner: str) -> torch.Tensor:
        """The device copy of ``host`` on ``device``: uploaded the first time (a copy on
        the calling stream), the same tensor afterwards. A buffer resident on another
        device is refused: its stage moved between calls."""
        with self._lock:
            held = self._held.get(id(host))
        if held is not None:
            if held[0] is not device:
                raise RuntimeError(
                    f"fxpipe internal error: {owner}'s cache is resident on {held[0].name}, "
                    f"but its stage runs on {device.name} in this call (a resident buffer "
                    "stays with the device that first ran its stage)")
            return held[1]
        copy = device.to_device(host.detach(), kind="cache", owner=owner)
        with self._lock:
            self._held[id(host)] = (device, copy)
        return copy

    def held(self, host: torch.Tensor) -> torch.Tensor | None:
        """The device copy of ``host``, if it is resident."""
        with self._lock:
            held = self._held.get(id(host))
        return None if held is None else held[1]

    def device_bytes(self) -> dict[str, int]:
        """Bytes held, per device name."""
        out: dict[str, int] = {}
        with self._lock:
            for device, t in self._held.values():
                out[device.name] = out.get(device.name, 0) + t.numel() * t.element_size()
        return out

    def close(self) -> None:
        """Free every device copy (after the last call using them has ended)."""
        with self._lock:
            held, self._held = list(self._held.values()), {}
        for device, t in held:
            device.free(t)


@dataclass(frozen=True)
class ScratchUse:
    """A call's use of its scratch buffers.

    ``rows``: per microbatch, the ``[start, stop)`` of dim 0 it owns (``None``: the whole
    buffer, one microbatch). ``written``: the ``[start, stop)`` along ``dim`` the call
    writes (``None``: all of it). ``resident``: buffers kept on the devices."""

    rows: tuple[tuple[int, int], ...] | None = None
    written: tuple[int, int] | None = None
    dim: int = 2
    resident: ResidentBuffers | None = field(default=None, compare=False)

    def rows_of(self, microbatch: int) -> tuple[int, int] | None:
        return None if self.rows is None else self.rows[microbatch]

    def window(self, size: int) -> tuple[int, int]:
        """The written ``[start, stop)`` of a dim of ``size``."""
        return (0, size) if self.written is None else self.written


_current: contextvars.ContextVar[ScratchUse | None] = contextvars.ContextVar(
    "fxpipe_scratch_use", default=None)


def current() -> ScratchUse | None:
    """The use stated around the call being made (``None``: none)."""
    return _current.get()


@contextlib.contextmanager
def scratch_use(use: ScratchUse) -> Iterator[ScratchUse]:
    """Calls made in the block use their scratch buffers as ``use`` says."""
    token = _current.set(use)
    try:
        yield use
    finally:
        _current.reset(token)
