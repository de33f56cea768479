"""Per-layer, per-microbatch random states.

Each layer that draws random numbers (dropout) runs microbatch ``m`` under a generator
seeded from ``(call seed, layer, m)``; the call seed is drawn once per call from the
global generator, so ``torch.manual_seed`` controls it. The recompute re-derives the
same seed, so backward sees exactly the forward's masks, and results do not depend on
the plan or the number of devices.

Virtual devices share the process's CPU generator, so their random stages run under one
lock and restore the generator state afterwards; each GPU has its own generator, and
its own lock (``lock_of``).

>>> layer_seed(1234, layer=3, microbatch=0) == layer_seed(1234, 3, 0)
True
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

LOCK = threading.RLock()   # the CPU generator's
_GPU_LOCKS: dict[int, threading.RLock] = {}
_GPU_LOCKS_LOCK = threading.Lock()


def lock_of(device: torch.device) -> threading.RLock:
    """The lock of the generator random ops on ``device`` use."""
    if device.type != "cuda":
        return LOCK
    with _GPU_LOCKS_LOCK:
        return _GPU_LOCKS.setdefault(device.index or 0, threading.RLock())
_MASK = (1 << 64) - 1


def _mix(x: int) -> int:
    """splitmix64 finalizer: a well-spread 64-bit hash of ``x``."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def layer_seed(call_seed: int, layer: int, microbatch: int) -> int:
    """The seed layer ``layer`` uses for ``microbatch`` in a call seeded ``call_seed``."""
    return _mix(_mix(_mix(call_seed) ^ layer) ^ microbatch) >> 1  # manual_seed takes < 2**63


def draw_call_seed() -> int:
    """A call seed from the global CPU generator (advances it once)."""
    return int(torch.randint(0, 2**62, (), dtype=torch.int64).item())


def seed_layer(device: torch.device, seed: int) -> None:
    """Seed the generator that random ops on ``device`` use."""
    if device.type == "cuda":
        torch.cuda.default_generators[device.index or 0].manual_seed(seed)
    else:
        torch.default_generator.manual_seed(seed)


@contextlib.contextmanager
def isolated(device: torch.device) -> Iterator[None]:
    """Hold ``device``'s generator lock and restore its state afterwards."""
    with lock_of(device):
        gen = torch.cuda.default_generators[device.index or 0] if device.type == "cuda" \
            else torch.default_generator
        state = gen.get_state()
        try:
            yield
        finally:
            gen.set_state(state)
