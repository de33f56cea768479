"""Autocast around a call: captured on the calling thread, re-entered in the workers.

``torch.autocast`` state is thread-local, and stages run on device worker threads. A
call records the state it was made under (``captured()``); each forward, recompute and
loss runs under it again (``reentered(state)``), so ``with torch.autocast("cpu",
dtype=torch.bfloat16): pipe.forward_backward(...)`` computes like eager autocast. The
backward runs outside autocast, as eager's ``loss.backward()`` after the ``with`` does.
The graph a call runs was captured under the same state (``LayerGraph.autocast``; a call
under another one is captured again): export records the dtypes autocast gives.

>>> with torch.autocast("cpu", dtype=torch.bfloat16):
...     state = captured()
>>> state
(('cpu', torch.bfloat16, True),)
>>> with reentered(state):
...     (torch.ones(2, 2) @ torch.ones(2, 2)).dtype
torch.bfloat16
"""

from __future__ import annotations

import contextlib
import torch

AutocastState = tuple[tuple[str, torch.dtype, bool], ...]  # (device type, dtype, cache)


def captured() -> AutocastState:
    """The autocast regions enabled on this thread, per device type."""
    return tuple((d, torch.get_autocast_dtype(d), torch.is_autocast_cache_enabled())
                 for d in ("cpu", "cuda") if torch.is_autocast_enabled(d))


_NONE = contextlib.nullcontext()


def reentered(state: AutocastState) -> contextlib.AbstractContextManager:
    """Run the block under the autocast regions ``state`` recorded (nothing if empty: a
    shared null context, since every stage run of a call without autocast enters it)."""
    return _Reentered(state) if state else _NONE


class _Reentered:
    __slots__ = ("state", "stack")

    def __init__(self, state: AutocastState):
        self.state = state

    def __enter__(self) -> None:
        with contextlib.ExitStack() as stack:
            for device_type, dtype, cache in self.state:
                stack.enter_context(torch.autocast(device_type, dtype=dtype, cache_enabled=cache))
            self.stack = stack.pop_all()

    def __exit__(self, *exc: object) -> None:
        self.stack.close()


def describe(state: AutocastState) -> str:
    """``state`` in words: ``torch.autocast('cpu', dtype=torch.bfloat16)`` or ``no autocast``.

    >>> describe((("cpu", torch.bfloat16, True),))
    "torch.autocast('cpu', dtype=torch.bfloat16)"
    """
    if not state:
        return "no autocast"
    return " and ".join(f"torch.autocast({d!r}, dtype={dtype})" for d, dtype, _ in state)
