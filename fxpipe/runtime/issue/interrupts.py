"""Sections a ``KeyboardInterrupt`` must not split.

A call ends by writing its results into the model (gradients into ``.grad``, buffer
updates): stopping half-way would leave some parameters updated and others not. Inside
``deferred_interrupt()`` a Ctrl-C (SIGINT) is held and raised as ``KeyboardInterrupt``
when the section ends, after everything was written.

>>> with deferred_interrupt():
...     pass  # writes that must happen all together
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator


@contextlib.contextmanager
def deferred_interrupt() -> Iterator[None]:
    """Hold SIGINT for the duration of the block, then deliver it (main thread only:
    signals reach no other thread, so elsewhere this does nothing)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []
    try:
        previous = signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    except ValueError:  # e.g. not the main interpreter: signals cannot be handled here
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous if previous is not None else signal.SIG_DFL)
        if received:
            if callable(previous):
                previous(signal.SIGINT, None)  # the default handler raises KeyboardInterrupt
            elif previous != signal.SIG_IGN:
                raise KeyboardInterrupt
