"""The issue lock, and host work that blocks inside it.

One issue thread at a time runs an action's Python on a device that runs it when it is
submitted (``Device.runs_at_issue``: a GPU's host part, an ``InlineDevice``). Every torch
op lets go of the GIL; with several threads wanting it, each op would hand it to another
thread and wait to get it back. So the executor takes this lock around each such submit
(:func:`issuing`).

Work inside it that blocks the host — a copy from or to pageable memory, a dtype
conversion on the host, a copy into a page-locked ring block, registering a file map's
window with CUDA, waiting for a host-lane or collective event — would stall every other GPU's issue
for as long. It runs under :func:`blocking`, which lets go of the lock and takes it back
afterwards (docs/design.md, rule 15). Never while holding another lock that an issue
thread may wait for under the issue lock (a pool's, a ring's): taking the issue lock back
would then deadlock.

>>> with issuing(True):
...     held = holding()
...     with blocking():
...         released = not holding()
>>> held, released, holding()
(True, True, False)
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

_ISSUING = threading.Lock()


class _Holding(threading.local):
    on: bool = False


_HOLDING = _Holding()


def holding() -> bool:
    """Whether this thread holds the issue lock now."""
    return _HOLDING.on


class _Issuing:
    """``with``: hold the issue lock (a class, not a generator: it is taken once per
    action, and a generator-based context costs the issue path a few microseconds)."""

    __slots__ = ()

    def __enter__(self) -> None:
        _ISSUING.acquire()
        _HOLDING.on = True

    def __exit__(self, *exc: object) -> None:
        _HOLDING.on = False
        _ISSUING.release()


_TAKE, _LEAVE = _Issuing(), contextlib.nullcontext()


def issuing(take: bool) -> contextlib.AbstractContextManager:
    """Hold the issue lock (when ``take``: the device runs its work at issue)."""
    return _TAKE if take else _LEAVE


@contextlib.contextmanager
def blocking() -> Iterator[None]:
    """Host work that blocks runs here: with the issue lock let go if this thread holds
    it (other devices' issue goes on meanwhile), taken back after."""
    if not _HOLDING.on:
        yield
        return
    _HOLDING.on = False
    _ISSUING.release()
    try:
        yield
    finally:
        _ISSUING.acquire()
        _HOLDING.on = True
