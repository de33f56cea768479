"""Events: the completion of one piece of work submitted to a device (:class:`Event`).

``Device.submit`` returns one; other work (any stream, any device) waits on it, the host
reads its result or exception. Every backend's events are this class: a
:class:`~fxpipe.runtime.devices.cuda.CudaDevice` event also carries the CUDA event recorded after
the work's kernels, an event of a ``VirtualDevice(semantics="cuda")`` copy stream the
event of what the work queued.
"""

from __future__ import annotations

import threading
from typing import Any

_FINISHED = threading.Event()   # the done flag of every Event.finished(): always set
_FINISHED.set()


class Event:
    """Completion of one submitted piece of work: its result, or the exception it raised.

    Thread-safe. Work whose ``wait`` list holds a failed event does not run: its event
    fails with that same exception. Later work on the same stream still runs.
    """

    __slots__ = ("label", "_done", "_result", "_exc", "_cuda_event", "_stream")

    def __init__(self, label: str, cuda_event: Any = None):
        self.label = label
        self._done = threading.Event()
        self._result: Any = None
        self._exc: BaseException | None = None
        self._cuda_event = cuda_event  # torch.cuda.Event recorded after the work (CUDA only)
        # work issued on the host at once (``VirtualDevice``, ``semantics="cuda"``): the
        # event of what it queued, done when its stream has run it
        self._stream: Event | None = None

    @classmethod
    def finished(cls, label: str, result: Any = None, exc: BaseException | None = None,
                 cuda_event: Any = None) -> Event:
        """An event for work whose Python already ran (an ``InlineDevice``'s; a
        ``CudaDevice``'s, with the CUDA event recorded after the kernels it queued): no
        wait primitive of its own, as nothing can wait for it before it exists."""
        event = cls.__new__(cls)
        event.label, event._done, event._result, event._exc = label, _FINISHED, result, exc
        event._cuda_event, event._stream = cuda_event, None
        return event

    def done(self) -> bool:
        """True once the work ran on the host (CUDA kernels it queued may still run)."""
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> None:
        """Block until the work is complete; re-raise its exception if it failed."""
        self.result(timeout)

    def result(self, timeout: float | None = None) -> Any:
        """Block until complete and return what the work returned (or raise its exception)."""
        if (exc := self.exception(timeout)) is not None:
            raise exc
        return self._result

    def value(self, timeout: float | None = None) -> Any:
        """What the work returned, without waiting for the GPU to finish it.

        For use inside work submitted with ``wait=[this event]``: that stream already waits
        for the GPU side, so a host sync (``result()``) would only stall the queueing.
        Same as ``result()`` on a VirtualDevice.
        """
        self._host_wait(timeout)
        if self._exc is not None:
            raise self._exc
        return self._result

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """Block until complete and return the exception it raised, or None."""
        if self._done is not _FINISHED and not self._done.is_set():
            self._host_wait(timeout)
        if self._cuda_event is not None:
            self._cuda_event.synchronize()
        if self._stream is not None:
            exc = self._stream.exception(timeout)
            return self._exc if self._exc is not None else exc
        return self._exc

    def value_exception(self) -> BaseException | None:
        """The exception the work's Python raised, once it ran (without waiting for what
        it queued on the GPU)."""
        self._host_wait(None)
        return self._exc

    def _host_wait(self, timeout: float | None) -> None:
        if not self._done.wait(timeout):
            raise TimeoutError(
                f"event {self.label!r} is not complete after {timeout}s: the work it runs after "
                "may be blocked (a wait on an event that is never submitted, or a closed device)")

    def _finish(self, result: Any = None, exc: BaseException | None = None) -> None:
        self._result, self._exc = result, exc
        self._done.set()

    def __repr__(self) -> str:
        state = "pending" if not self.done() else ("failed" if self._exc is not None else "done")
        return f"Event({self.label!r}, {state})"


def _complete(event: Event) -> bool:
    """Whether ``event``'s work has completed, GPU part included (without waiting)."""
    if event._cuda_event is not None and not event._cuda_event.query():
        return False
    return event._stream is None or _complete(event._stream)
