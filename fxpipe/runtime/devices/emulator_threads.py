"""How a :class:`~fxpipe.runtime.devices.emulator.VirtualDevice` runs its work: one worker thread
per stream, and each work item's Python run under the dispatch mode that counts what it
allocates on the device (``_Counting``), then the copies it queued.

A worker runs its stream's items in order, each after the events it waits for, with one
intra-op thread (``_start_worker`` leaves everyone else's count). At interpreter exit the
workers still alive are stopped and joined (``_join_workers_at_exit``).
"""

from __future__ import annotations

import atexit
import contextlib
import queue
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fxpipe import sequence_kv
from fxpipe.live_bytes import new_storages
from fxpipe.runtime.devices.device import Record, _work
from fxpipe.runtime.devices.events import Event

_thread_setup = threading.Lock()


def _start_worker(thread: threading.Thread, ready: threading.Event) -> None:
    """Start a worker that runs with one intra-op thread, leaving everyone else's count.

    ``torch.set_num_threads`` sets the calling thread's OpenMP/MKL count, and also the
    process-wide value threads adopt on their first parallel op: the caller's thread,
    or any other, could silently drop to one thread. So the caller settles its own count
    first, and puts the process-wide value back once the worker has set its own.
    """
    with _thread_setup:
        count = torch.get_num_threads()  # also fixes this thread's own count
        thread.start()
        ready.wait()
        torch.set_num_threads(count)


def _run_stream(stream: str, work: queue.SimpleQueue, sink: list,
                after: threading.Thread | None, ready: threading.Event) -> None:
    """A VirtualDevice stream: run queued work in order until the ``None`` sentinel.
    ``sink[0]`` is the list records go to, or None while not recording. ``after`` is the
    stream's previous worker, stopped but maybe still running its queue: wait for it, so
    the stream keeps its order across a restart. Started by ``_start_worker``."""
    torch.get_num_threads()  # settle this thread's count first: set_num_threads keeps it
    torch.set_num_threads(1)
    ready.set()
    if after is not None:
        after.join()
        after = None
    while (item := work.get()) is not None:
        _run_one(stream, *item, sink[0])
        item = None  # hold no tensors while idle


_aten = torch.ops.aten
# ops that move data between memories (any two devices, as on CUDA)
_TRANSFERS = frozenset({_aten.copy_.default, _aten._to_copy.default, _aten._copy_from.default,
                        _aten._copy_from_and_resize.default, _aten.lift_fresh.default,
                        _aten.lift_fresh_copy.default})
# CUDA indexing takes host index tensors: the argument position that may be on the host
_HOST_INDICES = {_aten.index.Tensor: 1, _aten.index_put.default: 1,
                 _aten.index_put_.default: 1, _aten._index_put_impl_.default: 1}


class _Counting(TorchDispatchMode):
    """Active in a VirtualDevice's stream threads while they run its work: every storage an
    op makes (not an input's: views and in-place results are not new) is counted on the
    device (``Device._count_made``) until Python frees it.

    On a ``strict`` device it also holds the work to CUDA's device rule
    (``VirtualDevice._placed``): an op mixing tensors resident on the device with others
    raises as CUDA does, and an op reading host tensors only runs on the host, as it would
    on a GPU: what it makes is host memory, not counted."""

    def __init__(self, device: weakref.ref):
        super().__init__()
        self._device = device

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        device = self._device()
        if _work.paused or device is None:
            return func(*args, **(kwargs or {}))
        if device.strict and not getattr(func, "is_view", False) and func not in _TRANSFERS \
                and not device._placed(func, args, kwargs):
            return func(*args, **(kwargs or {}))   # a host op: it makes host memory
        out = func(*args, **(kwargs or {}))
        made = new_storages(args, kwargs, out)
        if made:
            device._count_made(made, _work.kind, _work.owner)
        return out


def _host_part(stream: str, fn: Callable[..., Any], args: tuple, label: str, token: object,
               counting: weakref.ref | None, before: tuple = ()
               ) -> tuple[Any, BaseException | None, list]:
    """Run a work item's Python on this thread: ``(result, exception, queued copies)``.
    ``before``: the other streams' last events when it was submitted (``_Work.before``)."""
    saved = (_work.token, _work.stream, _work.copies, _work.owner, _work.made, _work.counting,
             _work.before)
    _work.token, _work.stream, _work.copies, _work.owner, _work.made = token, stream, [], label, []
    _work.counting, _work.before = counting, before
    result, exc = None, None
    try:
        # a mode per item: a mode object is not entered by two threads at once
        with _Counting(counting) if counting is not None else contextlib.nullcontext():
            result = fn(*args)
    except BaseException as e:  # noqa: BLE001 - every failure must reach the event
        exc = e
    finally:
        copies = _work.copies
        (_work.token, _work.stream, _work.copies, _work.owner, _work.made,
         _work.counting, _work.before) = saved
    return result, exc, copies


def _count_in_running_work(tensors: list[torch.Tensor]) -> None:
    """Count ``tensors``, made by an op of the running work where the dispatch mode does
    not see (inside a custom op: ``fxpipe.sequence_kv``), as its device's."""
    device = _work.counting() if getattr(_work, "counting", None) is not None else None
    if device is not None and not _work.paused:
        device._count_made(tensors, _work.kind, _work.owner)


sequence_kv.count_on_device(_count_in_running_work)


def _run_copies(copies: list[Callable[[], Any]]) -> BaseException | None:
    """Perform queued copies (kernels) in order, as a GPU stream does; the first failure."""
    exc = None
    copies.reverse()
    while copies:
        try:
            copies.pop()()   # (no variable keeps a copy's tensors once it has run)
        except BaseException as e:  # noqa: BLE001
            exc = exc if exc is not None else e
    return exc


def _run_one(stream: str, fn: Callable[..., Any], args: tuple, wait: tuple[Event, ...],
             event: Event, token: object, counting: weakref.ref | None, before: tuple,
             records: list[Record] | None) -> None:
    for e in wait:
        exc = e.exception()
        if exc is not None:  # do not compute on the output of failed work
            event._finish(exc=exc)
            return
    start = time.perf_counter()
    result, exc, copies = _host_part(stream, fn, args, event.label, token, counting, before)
    failed = _run_copies(copies)   # what the work queued runs before its event completes
    if records is not None:
        records.append((stream, event.label, start, time.perf_counter()))
    event._finish(result, exc if exc is not None else failed)


def _run_copies_of(copies: list[Callable[[], Any]]) -> None:
    """The stream part of work issued at once (``VirtualDevice._issue_now``)."""
    exc = _run_copies(copies)
    if exc is not None:
        raise exc


def _stop_workers(queues: dict[str, queue.SimpleQueue]) -> None:
    for work in queues.values():
        work.put(None)


_live_devices: weakref.WeakSet = weakref.WeakSet()   # VirtualDevices not collected
EXIT_JOIN_S = 30.0
"""How long the exit hook waits for each worker thread still running queued work."""


@atexit.register
def _join_workers_at_exit() -> None:
    """At interpreter exit (``atexit`` runs before the teardown), stop every VirtualDevice's
    workers and join them, each within ``EXIT_JOIN_S``: a daemon worker still inside torch's
    C++ code when the interpreter finalizes is unwound by ``pthread_exit``, which aborts the
    process (``terminate called without an active exception``) after the job's own work
    succeeded."""
    for device in list(_live_devices):
        device._stop_and_join(close=False, timeout=EXIT_JOIN_S)
