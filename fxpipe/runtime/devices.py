"""Devices: one interface, two backends (:class:`CudaDevice`, and :class:`VirtualDevice` on CPU),
and :class:`InlineDevice`, which measures what issuing costs the host.

A device has ordered work queues, *streams* (``STREAMS``). ``submit`` puts a callable on
one and returns an :class:`Event`; other work (any stream, any device) can ``wait`` on
it, the host can ``event.result()``. Device memory made by ``to_device`` / ``track`` is
counted by kind (params, activations, gradients), with peaks and an optional limit
(:class:`fxpipe.errors.DeviceMemoryError`).

How work behaves toward the host (``semantics``):

- ``"cuda"`` (every :class:`CudaDevice`, and ``VirtualDevice(semantics="cuda")``): work
  *queues* copies. ``to_host`` returns its destination at once; the data lands when the
  stream reaches the copy (a virtual device fills it with NaN until then), so the host
  may read it only after waiting for the work's event. ``to_device`` reads its source
  when the stream performs the copy, not when it is queued. An event completes when its
  stream has performed everything queued before it. Memory is allocated and freed when
  the host issues the work (a virtual device runs a copy stream's Python at once, on the
  issuing thread); freed memory goes back to the stream that allocated it and is reused
  by another stream's work only after each stream recorded as using it passed the free
  (``record_stream``); ``memory_limit`` bounds what the allocator reserves. A virtual
  device is also ``strict``: an op mixing its tensors with host memory or another
  device's raises as CUDA does (``Expected all tensors to be on the same device``).
- ``"sync"`` (a plain ``VirtualDevice``): a copy is done when it returns.

The runtime issues the same work, the same way, on both; ``semantics="cuda"`` makes a
CPU-only test see what a GPU would do with it (a host read of data still in flight).

>>> d = VirtualDevice(name="vcpu:0")
>>> x = d.to_device(torch.ones(4), kind="activations", owner="stage 0")
>>> y = d.submit("compute", torch.mul, x, 2)
>>> d.submit("d2h", lambda: d.to_host(y.value()), wait=[y]).result()
tensor([2., 2., 2., 2.])
>>> d.close()
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import os
import queue
import threading
import time
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from fxpipe.errors import DeviceMemoryError
from fxpipe.live_bytes import new_storages, storage_key
from fxpipe.passes.program import parse_action
from fxpipe.runtime import pinned

# compute; activations in and out; parameters in; gradients out; dropping a microbatch's
# values (Free); bookkeeping (Release).
# Each is its own FIFO: a stage-sized parameter copy never queues in front of a
# microbatch's activations, and a Program's streams map one to one (no merged FIFOs,
# which can wait on each other in a cycle across devices).
STREAMS = ("compute", "h2d", "d2h", "prefetch", "grads", "free", "control")
KINDS = ("params", "activations", "saved", "gradients", "workspace")
SEMANTICS = ("sync", "cuda")
default_semantics = "sync"
"""What ``VirtualDevice()`` uses when ``semantics`` is not given (the test suite's
``FXPIPE_TEST_DEVICE=cuda-sim`` sets ``"cuda"``)."""
Record = tuple[str, str, float, float]  # (stream, label, t_start, t_end) from time.perf_counter()

_virtual_ids = itertools.count()


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


class Device(ABC):
    """A GPU-like worker: streams, events, and byte-accounted device memory.

    Backends: :class:`VirtualDevice` (CPU worker threads) and :class:`CudaDevice`.
    Memory is counted per storage, by kind (``KINDS``): the allocations of ``to_device``
    and ``track`` until ``free``; and on a VirtualDevice every storage its work allocates
    (``_count_made``: intermediates, saved tensors, gradients, workspace) until Python
    frees it. ``memory_limit`` holds for the total.

    ``host_stalls`` counts the copies between the device and host memory that is not
    page-locked (``pinned.is_pinned``) on a device with a GPU's semantics (a
    :class:`CudaDevice`, ``VirtualDevice(semantics="cuda")``): on a GPU each blocks the
    thread issuing it until the data has moved (``pipe.stats()["host_stalls"]``).
    """

    runs_at_issue = False
    """Whether ``submit`` runs the work's Python on the submitting thread (a GPU's host
    part; the executor lets one issue thread at a time do so)."""

    def __init__(self, name: str, memory_limit: int | float | None):
        if memory_limit is not None:
            if not isinstance(memory_limit, (int, float)) or memory_limit < 0:
                raise ValueError(f"{name}: memory_limit must be a number of bytes >= 0 or None, "
                                 f"got {memory_limit!r}")
            memory_limit = int(memory_limit)
        self.name = name
        self.memory_limit = memory_limit
        self.records: list[Record] = []
        self._mem_lock = threading.Lock()
        self._live: dict[int, tuple[Any, str, int]] = {}  # storage data_ptr -> (storage, kind, nbytes)
        # what work allocated: storage id -> (weak reference, nbytes, kind), until freed
        self._made: dict[int, tuple[StorageWeakRef, int, str]] = {}
        self._resident = dict.fromkeys(KINDS, 0)
        self._peak = dict.fromkeys(KINDS, 0)
        self._peak_total = 0
        self._peak_reserved = 0
        self._releases: list[Event] = []   # what freed parameter memory waits for
        self.host_stalls = 0   # copies from or to pageable host memory (``_host_stall``)
        self.allocator_flushes = 0   # times the allocator gave its cache back at the limit
        self._stall_lock = threading.Lock()

    @abstractmethod
    def submit(self, stream: str, fn: Callable[..., Any], *args: Any,
               wait: Sequence[Event] = (), label: str | None = None) -> Event:
        """Run ``fn(*args)`` on ``stream`` after earlier work on it and after ``wait``."""

    @abstractmethod
    def to_device(self, host_tensor: torch.Tensor, kind: str, owner: str,
                  use: Sequence[str] = ("compute",)) -> torch.Tensor:
        """Copy a host tensor into counted device memory, on the stream of the work
        calling it; ``owner`` (a stage) names it in errors; ``use``: the other streams
        that read it (``record_stream``: its memory is reused only after they passed its
        ``free``)."""

    def record_stream(self, tensor: torch.Tensor) -> None:
        """``tensor``, made on another of this device's streams, is read by the work being
        issued now (its stream): its memory must not be reused before this stream is past
        this point (``Tensor.record_stream``)."""

    @abstractmethod
    def to_host(self, dev_tensor: torch.Tensor, pin: bool = True) -> torch.Tensor:
        """Copy a device tensor into a new host tensor (pinned if ``pin`` and supported)."""

    def copy_to_host(self, dev_tensor: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Copy a device tensor into existing host memory ``out`` (e.g. a parameter's
        place in the flat gradient buffer); returns ``out``. Like ``to_host``, the data
        is there once the work that queued the copy has completed."""
        dev_tensor.record_stream(torch.cuda.current_stream(dev_tensor.device))
        return out.copy_(dev_tensor.detach(), non_blocking=not self._host_stall(out))

    def _host_stall(self, host: torch.Tensor) -> bool:
        """Whether a copy between this device and ``host`` blocks the issuing thread (host
        memory that is not page-locked, on a device with a GPU's semantics); such a copy
        is counted in ``host_stalls``."""
        if getattr(self, "semantics", "sync") != "cuda" or host.device.type != "cpu" \
                or not host.numel() or pinned.is_pinned(host):
            return False
        with self._stall_lock:
            self.host_stalls += 1
        return True

    @abstractmethod
    def synchronize(self) -> None:
        """Block until all submitted work is complete (errors stay in their events)."""

    @abstractmethod
    def close(self) -> None:
        """Finish submitted work and stop the device's workers; later submits raise. Idempotent."""

    def stop_workers(self) -> None:
        """Finish submitted work and stop the device's worker threads, if it has any.

        Unlike :meth:`close`, the device stays usable: the next ``submit`` starts new
        workers. ``PipelineModule.close()`` calls this, so devices shared between pipes
        survive one pipe being closed or collected.
        """
        self.synchronize()

    def recording(self, flag: bool = True) -> None:
        """Start (or stop) appending ``(stream, label, t_start, t_end)`` to ``records``
        for each work item (``pipe.trace()``)."""
        raise NotImplementedError(f"{type(self).__name__} does not record a timeline")

    def is_recording(self) -> bool:
        return False

    def track(self, tensor: torch.Tensor, kind: str, owner: str) -> torch.Tensor:
        """Count a tensor made on the device (e.g. accumulated gradients); returns it."""
        storage = tensor.untyped_storage()
        if storage.nbytes() and storage.data_ptr() in self._live:
            raise ValueError(f"{self.name}: the memory of this tensor ({owner}) is already counted; "
                             "track each allocation once")
        return self._allocate(storage.nbytes(), kind, owner, lambda: tensor)

    def free(self, tensor: torch.Tensor) -> str | None:
        """Stop counting the allocation ``tensor`` belongs to (its whole storage); returns
        its kind (None for an empty tensor)."""
        if not tensor.untyped_storage().nbytes():
            return None
        with self._mem_lock:
            entry = self._live.pop(tensor.untyped_storage().data_ptr(), None)
            if entry is None:
                raise ValueError(f"{self.name}: free() got a tensor whose memory is not counted here: "
                                 "it was already freed, or not made by to_device()/track() on this device")
            self._resident[entry[1]] -= entry[2]
        return entry[1]

    def _released(self, events: Sequence[Event]) -> None:
        """Parameter memory was freed: reusable once ``events`` complete."""
        with self._mem_lock:
            self._releases.extend(events)

    def wait_released(self) -> bool:
        """Block the host until the parameter memory freed so far (``Release``) may be
        reused: each stream that read it has passed its free. The issue thread calls it
        before a ``Prefetch`` allocates, so the host is never more than the two resident
        stages ahead of the device's memory (FSDP's ``limit_all_gathers``); returns
        whether anything was still pending."""
        with self._mem_lock:
            events, self._releases = self._releases, []
        pending = [e for e in events if not e.done() or not _complete(e)]
        for e in pending:
            e.exception()
        return bool(pending)

    def resident_bytes(self, kind: str | None = None) -> int:
        """Counted bytes resident now (of one kind, or all)."""
        with self._mem_lock:
            self._sweep()
            return sum(self._resident.values()) if kind is None else self._resident[_check_kind(kind)]

    def peak_bytes(self, kind: str | None = None) -> int:
        """Highest counted resident bytes since creation or :meth:`reset_peak` (of one
        kind: its own highest, reached at any time)."""
        with self._mem_lock:
            return self._peak_total if kind is None else self._peak[_check_kind(kind)]

    def reset_peak(self) -> None:
        """Set the peaks to what is resident now."""
        with self._mem_lock:
            self._sweep()
            self._peak = dict(self._resident)
            self._peak_total = sum(self._resident.values())
            self._peak_reserved = self._reserved()

    def peak_reserved_bytes(self) -> int:
        """Highest memory the device held: counted bytes plus freed memory its allocator
        keeps for reuse (a GPU's ``max_memory_reserved``)."""
        with self._mem_lock:
            return self._peak_reserved

    def _reserved(self) -> int:
        """Counted bytes plus what the allocator keeps (hold ``_mem_lock``)."""
        return sum(self._resident.values())

    def _count_made(self, tensors: Sequence[torch.Tensor], kind: str, owner: str) -> None:
        """Count the storages of ``tensors``, just made by work on this device, as
        ``kind`` until they are freed; raise DeviceMemoryError once the total is over the
        limit (on a GPU the allocation would have failed)."""
        with self._mem_lock:
            self._sweep()
            added = 0
            for t in tensors:
                storage = t.untyped_storage()
                nbytes = storage.nbytes()
                key = storage._cdata
                if not nbytes or storage.data_ptr() in self._live or key in self._made:
                    continue
                self._made[key] = (StorageWeakRef(storage), nbytes, kind)
                self._resident[kind] += nbytes
                _work.made.append(key)
                added += nbytes
            if not added:
                return
            total = sum(self._resident.values())
            self._peak[kind] = max(self._peak[kind], self._resident[kind])
            self._peak_total = max(self._peak_total, total)
            self._peak_reserved = max(self._peak_reserved, self._reserved())
            if self.memory_limit is not None and total > self.memory_limit:
                parts = ", ".join(f"{k} {v} B" for k, v in self._resident.items() if v)
                raise DeviceMemoryError(
                    f"{self.name}: {_describe(owner)} allocated {added} B of {kind}, which exceeds the "
                    f"memory limit: {total} B resident ({parts}) > limit {self.memory_limit} B. "
                    "Give the stage fewer layers (a smaller ExecutePlan range), use smaller "
                    "microbatches or recompute_grain='layer', or raise memory_limit.")

    def _recount(self, key: int, kind: str, only: str) -> None:
        """Count storage ``key`` as ``kind`` from now on, if work made it as ``only``
        (hold ``_mem_lock``)."""
        entry = self._made.get(key)
        if entry is not None and entry[2] == only and not entry[0].expired():
            self._made[key] = (entry[0], entry[1], kind)
            self._resident[only] -= entry[1]
            self._resident[kind] += entry[1]
            self._peak[kind] = max(self._peak[kind], self._resident[kind])

    def _sweep(self) -> None:
        """Stop counting what work made and Python has freed (hold ``_mem_lock``)."""
        for key in [k for k, (ref, _, _) in self._made.items() if ref.expired()]:
            _, nbytes, kind = self._made.pop(key)
            self._resident[kind] -= nbytes

    def allocating(self, kind: str) -> contextlib.AbstractContextManager:
        """Within the block, what this thread's work on the device allocates is counted as
        ``kind`` (a VirtualDevice; a GPU's allocator does not tell kinds apart)."""
        return contextlib.nullcontext()

    def keep(self, values: Any, *, saved: bool = False) -> None:
        """After a forward in this thread's work: the tensors in ``values`` (made as
        ``workspace``) outlive the work, count them as ``activations``; with ``saved``
        (a forward with grad), what else it made and is still alive is held by the
        autograd graph for backward: ``saved``. (A saved-tensors hook would tell the same,
        but holding a tensor from its own graph makes a cycle no collector sees.)"""
        made, _work.made = _work.made, []
        with self._mem_lock:
            for t in pytree.tree_leaves(values):
                if isinstance(t, torch.Tensor):
                    self._recount(storage_key(t), "activations", only="workspace")
            for key in made if saved else ():
                self._recount(key, "saved", only="workspace")

    def _allocate(self, nbytes: int, kind: str, owner: str,
                  make: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Reserve ``nbytes`` (or raise DeviceMemoryError, changing nothing), then ``make()``."""
        _check_kind(kind)
        with self._mem_lock:
            self._sweep()
            total = sum(self._resident.values())
            if self.memory_limit is not None and total + nbytes > self.memory_limit:
                parts = ", ".join(f"{k} {v} B" for k, v in self._resident.items() if v) or "nothing"
                raise DeviceMemoryError(
                    f"{self.name}: allocating {nbytes} B of {kind} for {owner} would exceed the "
                    f"memory limit: {total} B resident ({parts}) + {nbytes} B requested > limit "
                    f"{self.memory_limit} B. Give the stage fewer layers (a smaller ExecutePlan "
                    "range), use smaller microbatches, or raise memory_limit.")
            self._resident[kind] += nbytes
        try:
            with host_allocations():   # counted here, as ``kind``, not as what the work made
                tensor = make()
            storage = tensor.untyped_storage()
            with self._mem_lock:
                if nbytes and storage.data_ptr() in self._live:
                    raise ValueError(f"{self.name}: the memory of this tensor ({owner}) is already "
                                     "counted; track each allocation once")
                if nbytes:
                    self._live[storage.data_ptr()] = (storage, kind, nbytes)
                self._peak[kind] = max(self._peak[kind], self._resident[kind])
                self._peak_total = max(self._peak_total, sum(self._resident.values()))
                self._peak_reserved = max(self._peak_reserved, self._reserved())
        except BaseException:
            with self._mem_lock:
                self._resident[kind] -= nbytes
            raise
        return tensor

    def __enter__(self) -> Device:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, memory_limit={self.memory_limit})"


def _complete(event: Event) -> bool:
    """Whether ``event``'s work has completed, GPU part included (without waiting)."""
    if event._cuda_event is not None and not event._cuda_event.query():
        return False
    return event._stream is None or _complete(event._stream)


def _describe(label: str) -> str:
    """``"2B1 (stage 2, microbatch 1)"`` for a Program action's label, else the label."""
    try:
        action = parse_action(label)
    except ValueError:
        return label
    parts = [f"stage {action.stage}"] if hasattr(action, "stage") else []
    if getattr(action, "mb", None) is not None:
        parts.append(f"microbatch {action.mb}")
    return f"{label} ({', '.join(parts)})" if parts else label


def _check_kind(kind: str) -> str:
    if kind not in KINDS:
        raise ValueError(f"memory kind must be one of {KINDS}, got {kind!r}")
    return kind


def _check_submit(device: Device, stream: str, wait: Sequence[Event]) -> tuple[Event, ...]:
    if stream not in STREAMS:
        raise ValueError(f"{device.name}: stream must be one of {STREAMS}, got {stream!r}")
    if getattr(device, "_closed", False):
        raise RuntimeError(f"{device.name} is closed: submit work before close(), or make a new device")
    for e in wait:
        if not isinstance(e, Event):
            raise TypeError(f"{device.name}: wait= takes Events returned by submit(), "
                            f"got {type(e).__name__}")
    return tuple(wait)


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


class _Work(threading.local):
    """The work item a VirtualDevice stream thread is running: its device's ``token``,
    and the copies it queued (``semantics="cuda"``), performed when the item's own code
    has returned, before its event completes: where the stream reaches them. ``kind``
    and ``paused`` steer the counting of what it allocates (``_Counting``)."""

    token: object | None = None
    stream: str | None = None
    copies: list[Callable[[], Any]] | None = None
    owner: str = "work"
    kind: str = "workspace"
    paused: bool = False
    made: list[int]     # storages this thread's work counted since the last ``keep``

    def __init__(self) -> None:
        self.made = []


_work = _Work()


class _Emulated(threading.local):
    waited = 0.0   # seconds this thread waited in ``_issue_now`` for a compute's Python


_emulated = _Emulated()


def emulated_wait() -> float:
    """Seconds this thread spent, since the last call, waiting for work whose Python a
    GPU would have run at issue (``VirtualDevice._issue_now`` waiting for a compute):
    not host issue cost on a GPU, so ``host_issue_us`` leaves it out."""
    waited, _emulated.waited = _emulated.waited, 0.0
    return waited


@contextlib.contextmanager
def _counted_as(kind: str):
    was, _work.kind = _work.kind, kind
    try:
        yield
    finally:
        _work.kind = was


@contextlib.contextmanager
def host_allocations():
    """Allocations made in the block are host memory, not the device's whose work runs
    them (host copies, the flat gradient buffer made on first use, counted transfers)."""
    was, _work.paused = _work.paused, True
    try:
        yield
    finally:
        _work.paused = was


_aten = torch.ops.aten
# ops that move data between memories (any two devices, as on CUDA)
_TRANSFERS = frozenset({_aten.copy_.default, _aten._to_copy.default, _aten._copy_from.default,
                        _aten._copy_from_and_resize.default, _aten.lift_fresh.default,
                        _aten.lift_fresh_copy.default})
# CUDA indexing takes host index tensors: the argument position that may be on the host
_HOST_INDICES = {_aten.index.Tensor: 1, _aten.index_put.default: 1,
                 _aten.index_put_.default: 1, _aten._index_put_impl_.default: 1}
_virtual_devices: weakref.WeakSet = weakref.WeakSet()   # every VirtualDevice, for messages


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
               counting: weakref.ref | None) -> tuple[Any, BaseException | None, list]:
    """Run a work item's Python on this thread: ``(result, exception, queued copies)``."""
    saved = _work.token, _work.stream, _work.copies, _work.owner, _work.made
    _work.token, _work.stream, _work.copies, _work.owner, _work.made = token, stream, [], label, []
    result, exc = None, None
    try:
        # a mode per item: a mode object is not entered by two threads at once
        with _Counting(counting) if counting is not None else contextlib.nullcontext():
            result = fn(*args)
    except BaseException as e:  # noqa: BLE001 - every failure must reach the event
        exc = e
    finally:
        copies = _work.copies
        _work.token, _work.stream, _work.copies, _work.owner, _work.made = saved
    return result, exc, copies


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
             event: Event, token: object, counting: weakref.ref | None,
             records: list[Record] | None) -> None:
    for e in wait:
        exc = e.exception()
        if exc is not None:  # do not compute on the output of failed work
            event._finish(exc=exc)
            return
    start = time.perf_counter()
    result, exc, copies = _host_part(stream, fn, args, event.label, token, counting)
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


# How many holders a storage has (tensors, Python handles): private torch API, so optional;
# without it, memory that might still be shared is never reused or replaced.
storage_use_count = getattr(torch._C, "_storage_Use_Count", None)

class _StorageCache:
    """A VirtualDevice's freed ``to_device`` memory, kept for reuse as torch's CUDA caching
    allocator keeps it. That makes reuse bugs visible: memory still read after its
    ``free`` is overwritten by the next copy.

    As on CUDA, a block belongs to the stream that allocated it (``pool``): only later
    allocations on that stream reuse it, which that stream's own order makes safe. Its use
    by other streams (``use``, ``record``: what ``record_stream`` tells the allocator)
    holds it back: it is reused only once each of them has passed the point where it was
    freed (the events ``put`` gets). A block is also reused only once nothing else holds
    it (a view, an autograd graph, a value handed on: its use count is then the cache's
    own reference alone). A smaller request reuses a larger block (best fit); torch's
    allocator would split it, using what was asked and keeping the rest free for other
    requests. So a block in use counts what was asked of it, as the device's resident
    bytes do, and reserved memory is what is in use plus what is kept, which the device's
    limit bounds (``VirtualDevice._room``). Counting a reused block's unused rest as
    reserved too (memory a GPU would have used for the next request) put a strict
    device's reserved bytes past its limit.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # data_ptr of storages alloc made and not yet put back -> (pool, streams using it)
        self._made: dict[int, tuple[str | None, set[str]]] = {}
        # (pool, nbytes) -> [(storage, events that must complete before it is reused)]
        self._free: dict[tuple[str | None, int], list[tuple[torch.UntypedStorage,
                                                            tuple[Event, ...]]]] = {}
        self._bytes = 0
        self._held: dict[int, int] = {}   # data_ptr -> handles queued kernels hold

    def alloc(self, host: torch.Tensor, pool: str | None = None, use: Sequence[str] = (),
              room: Callable[[int], None] | None = None) -> torch.Tensor:
        """New contiguous memory shaped like ``host`` (uninitialized) for stream ``pool``,
        reused when a block is free; ``room(nbytes)`` is called before new memory is
        taken (the device's limit)."""
        nbytes = host.numel() * host.element_size()
        tracked = bool(nbytes) and storage_use_count is not None
        storage = self._take(pool, nbytes) if tracked else None
        if storage is None:
            if room is not None:
                room(nbytes)
            out = torch.empty(host.shape, dtype=host.dtype)
        else:
            out = torch.empty(0, dtype=host.dtype).set_(storage, 0, host.shape)
        if tracked:
            with self._lock:
                self._made[out.untyped_storage().data_ptr()] = (pool, set(use) - {pool})
        return out

    def record(self, tensor: torch.Tensor, stream: str) -> None:
        """``stream`` uses ``tensor``'s block too (``record_stream``)."""
        with self._lock:
            entry = self._made.get(tensor.untyped_storage().data_ptr())
            if entry is not None and stream != entry[0]:
                entry[1].add(stream)

    def put(self, tensor: torch.Tensor, after: Callable[[Collection[str]], tuple[Event, ...]]
            = lambda streams: ()) -> tuple[Event, ...]:
        """Keep ``tensor``'s block for reuse once ``after(streams using it)`` complete;
        returns those events."""
        storage = tensor.untyped_storage()
        with self._lock:
            entry = self._made.pop(storage.data_ptr(), None)
            if entry is None:
                return ()  # not ours (made by compute and tracked): left to Python
            events = after(entry[1])
            self._free.setdefault((entry[0], storage.nbytes()), []).append((storage, events))
            self._bytes += storage.nbytes()
        return events

    def _take(self, pool: str | None, nbytes: int) -> torch.UntypedStorage | None:
        """The smallest reusable block of ``pool`` of at least ``nbytes`` (best fit), or
        None. A larger block is not counted beyond ``nbytes`` while in use (class
        docstring)."""
        with self._lock:
            for size in sorted(size for p, size in self._free if p == pool and size >= nbytes):
                free = self._free[(pool, size)]
                for i, (storage, after) in enumerate(free):
                    holders = 1 + self._held.get(storage.data_ptr(), 0)   # the cache, kernels
                    if storage_use_count(storage._cdata) <= holders and \
                            all(e.done() for e in after):
                        self._bytes -= size
                        return free.pop(i)[0]
        return None

    def hold(self, keys: Sequence[int], n: int) -> None:
        """Queued kernels take (``n=1``) or drop (``-1``) a handle on these blocks: not a
        holder that keeps a freed block from reuse (a GPU's kernel is not)."""
        with self._lock:
            for k in keys:
                self._held[k] = self._held.get(k, 0) + n
                if not self._held[k]:
                    del self._held[k]

    def nbytes(self) -> int:
        """Bytes kept for reuse."""
        return self._bytes

    def pending(self) -> list[Event]:
        """The events the kept blocks wait for."""
        with self._lock:
            return [e for blocks in self._free.values() for _, after in blocks for e in after]

    def release(self) -> int:
        """Give every kept block back (``empty_cache``); returns the bytes."""
        with self._lock:
            freed, self._bytes = self._bytes, 0
            self._free.clear()
        return freed

    def clear(self) -> None:
        self.release()
        with self._lock:
            self._made.clear()  # still-live copies are then left to Python when freed


def _unwritten_fill(dtype: torch.dtype) -> Any:
    """What memory a copy has not written yet holds, so a read shows it: NaN (floating),
    the lowest value (integers), True (bool)."""
    if dtype.is_floating_point or dtype.is_complex:
        return float("nan")
    if dtype == torch.bool:
        return True
    return torch.iinfo(dtype).min


class VirtualDevice(Device):
    """A CPU stand-in for a GPU: one worker thread per stream, real separate tensor copies.

    Threads start on the first submit (daemon, one intra-op thread each). ``records``
    collects ``(stream, label, t_start, t_end)`` per work item when ``record=True``.
    ``semantics="cuda"`` makes work behave as a GPU's does toward the host (module
    docstring): the Python of copy-stream work runs when it is submitted, what it queues
    when its stream gets there; compute runs when its stream gets there. The default is
    ``fxpipe.runtime.devices.default_semantics`` (``"sync"``). ``strict`` (default: on
    with ``semantics="cuda"``) holds its work to CUDA's device rule (``_placed``).

    >>> with VirtualDevice(memory_limit=1024, record=True) as d:
    ...     w = d.to_device(torch.zeros(8), kind="params", owner="stage 0")
    ...     d.submit("compute", torch.add, w, 1, label="F s0 m0").result().sum()
    tensor(8.)
    >>> d = VirtualDevice(semantics="cuda")   # device ops inside its work, as on a GPU
    >>> x = d.submit("h2d", d.to_device, torch.ones(2), "activations", "stage 0").result()
    >>> seen = []
    >>> def offload():
    ...     host = d.to_host(x)
    ...     seen.append(host.clone())        # a host read before the copy landed: NaN
    ...     return host
    >>> d.submit("d2h", offload).result(), seen[0]
    (tensor([1., 1.]), tensor([nan, nan]))
    >>> d.close()
    """

    def __init__(self, memory_limit: int | None = None, name: str | None = None, *,
                 record: bool = False, semantics: str | None = None, count_work: bool = True,
                 strict: bool | None = None):
        super().__init__(name if name is not None else f"vcpu:{next(_virtual_ids)}", memory_limit)
        semantics = default_semantics if semantics is None else semantics
        if semantics not in SEMANTICS:
            raise ValueError(f"{self.name}: semantics must be one of {SEMANTICS}, got {semantics!r}")
        self.semantics = semantics
        self.strict = semantics == "cuda" if strict is None else bool(strict)
        _virtual_devices.add(self)
        self._sink: list = [self.records if record else None]  # shared with the workers
        self._lock = threading.Lock()
        self._closed = False
        self._queues: dict[str, queue.SimpleQueue] = {}
        self._threads: dict[str, threading.Thread] = {}
        self._stopped: dict[str, threading.Thread] = {}  # by stream: stopped, maybe still draining
        self._last: dict[str, Event] = {}
        self._cache = _StorageCache()
        self._token = object()  # marks this device's work items (``_work.token``)
        # count what its work allocates (off for a host worker: its memory is the host's)
        self._counting = weakref.ref(self) if count_work else None
        # Stop the workers if the device is dropped without close(); they hold no reference to it.
        self._stop = weakref.finalize(self, _stop_workers, self._queues)
        _live_devices.add(self)   # and join them before the interpreter's teardown

    def submit(self, stream: str, fn: Callable[..., Any], *args: Any,
               wait: Sequence[Event] = (), label: str | None = None) -> Event:
        """Queue ``fn(*args)`` on ``stream``'s worker; it runs after ``wait`` complete.

        >>> d = VirtualDevice()
        >>> a = d.submit("h2d", lambda: 3)
        >>> d.submit("compute", lambda: a.value() * 2, wait=[a]).result()
        6
        """
        event = Event(label if label is not None else getattr(fn, "__name__", "work"))
        if self.semantics == "cuda" and stream != "compute":
            return self._issue_now(stream, fn, args, wait, event)
        return self._enqueue(stream, fn, args, wait, event)

    def _issue_now(self, stream: str, fn: Callable[..., Any], args: tuple,
                   wait: Sequence[Event], event: Event) -> Event:
        """A copy stream's work with a GPU's semantics: its Python runs now, on the
        issuing thread (what it allocates or frees, it does at issue), and the copies it
        queues run when the stream gets there, after ``wait``. Like ``CudaDevice``, the
        host waits for the Python of waited-on work that has not run yet (compute, which
        this emulator runs when its stream gets there)."""
        wait = _check_submit(self, stream, wait)
        failed, start = None, time.perf_counter()
        for e in wait:   # a worker's event: wait for all of it; else its Python ran at issue
            exc = e.exception() if e._stream is None else e.value_exception()
            failed = exc if failed is None else failed
        _emulated.waited += time.perf_counter() - start
        if failed is not None:
            result, exc, copies = None, failed, []
        else:
            result, exc, copies = _host_part(stream, fn, args, event.label, self._token,
                                             self._counting)
        event._stream = self._enqueue(stream, _run_copies_of, (copies,), wait,
                                      Event(event.label))
        event._finish(result, exc)
        return event

    def _enqueue(self, stream: str, fn: Callable[..., Any], args: tuple,
                 wait: Sequence[Event], event: Event) -> Event:
        with self._lock:
            wait = _check_submit(self, stream, wait)
            if stream not in self._queues:
                work: queue.SimpleQueue = queue.SimpleQueue()
                previous = self._stopped.pop(stream, None)
                ready = threading.Event()
                thread = threading.Thread(
                    target=_run_stream, args=(stream, work, self._sink, previous, ready),
                    name=f"fxpipe-{self.name}-{stream}", daemon=True)
                self._queues[stream], self._threads[stream] = work, thread
                _start_worker(thread, ready)
            self._queues[stream].put((fn, args, wait, event, self._token, self._counting))
            self._last[stream] = event
        return event

    def recording(self, flag: bool = True) -> None:
        """Start (or stop) appending ``(stream, label, t_start, t_end)`` to ``records``."""
        self._sink[0] = self.records if flag else None

    def is_recording(self) -> bool:
        return self._sink[0] is not None

    def allocating(self, kind: str) -> contextlib.AbstractContextManager:
        _check_kind(kind)
        return _counted_as(kind)

    def holds(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is in this device's memory: made by ``to_device``/``track``, or
        by its work (and alive)."""
        storage = t.untyped_storage()
        return storage.data_ptr() in self._live or storage._cdata in self._made

    def _placed(self, func: Any, args: tuple, kwargs: dict | None) -> bool:
        """CUDA's device rule for one op of this device's work (``strict``): True if it
        runs on the device (it reads a tensor resident here, or none: a factory);
        False if it reads host tensors only (it runs on the host). Reading a tensor
        resident here with one that is not (another device's, or host memory other
        than a 0-dim scalar) raises ``RuntimeError`` worded as CUDA's."""
        leaves = pytree.tree_leaves((args, kwargs))
        tensors = [(k, t) for k, t in enumerate(leaves) if isinstance(t, torch.Tensor)
                   and t.untyped_storage().nbytes()]
        if not tensors:
            return True
        indices = _HOST_INDICES.get(func)
        skip = ({id(t) for t in pytree.tree_leaves(args[indices]) if isinstance(t, torch.Tensor)}
                if indices is not None and len(args) > indices else set())
        here = [t for _, t in tensors if self.holds(t)]
        if not here:
            return False
        for k, t in tensors:
            if id(t) in skip or self.holds(t):
                continue
            other = next((d for d in list(_virtual_devices) if d is not self and d.holds(t)), None)
            if other is None and t.dim() == 0:
                continue   # a host scalar, as CUDA takes
            where = other.name if other is not None else "cpu"
            raise RuntimeError(
                f"Expected all tensors to be on the same device, but found at least two "
                f"devices, {self.name} and {where}! {_describe(_work.owner)} ran {func} on a "
                f"{tuple(here[0].shape)} tensor of {self.name} and argument {k}, a "
                f"{tuple(t.shape)} {t.dtype} tensor in {where} memory. What device work reads "
                "must be on the device: fxpipe uploads the parameters, the model's inputs and "
                "the label; a tensor the model or loss_fn takes from elsewhere (a global, a "
                "closure, a tensor made without device=) stays where it is.")
        return True

    def kernel(self, fn: Callable[..., Any], *tensors: torch.Tensor) -> None:
        """Inside this device's work: run ``fn(*tensors)`` when the work's stream gets
        there, as a GPU runs a kernel the host queued (``semantics="cuda"``); at once
        otherwise. As on a GPU, the queued kernel does not keep ``tensors``' memory from
        being reused once freed: only ``record_stream`` (``use``) does.

        >>> d = VirtualDevice(semantics="cuda")
        >>> order = []
        >>> ev = d.submit("h2d", lambda: (d.kernel(lambda: order.append("kernel")),
        ...                               order.append("issued")))
        >>> ev.result() and None; order
        ['issued', 'kernel']
        >>> d.close()
        """
        queued = self._queued()
        if queued is None:
            fn(*tensors)
            return
        box = [fn, [t.detach() for t in tensors]]   # the kernel's own handles
        keys = [t.untyped_storage().data_ptr() for t in box[1]]
        self._cache.hold(keys, 1)

        def run() -> None:
            try:
                f, args = box
                box.clear()
                f(*args)
            finally:
                f = args = None
                self._cache.hold(keys, -1)

        queued.append(run)

    def _device_op(self, op: str, owner: str) -> None:
        """A strict GPU-semantics device refuses a device op outside its work: on CUDA
        only ``submit`` makes this device and its stream current (issue threads move
        between devices), so the op would run on another GPU's or the default stream."""
        if self.strict and self.semantics == "cuda" and _work.token is not self._token:
            raise RuntimeError(
                f"{self.name}: {op}() for {owner} outside this device's work: on a GPU only "
                "submit() makes the device and its stream current, so it would run on the "
                "calling thread's current device and stream. Call it inside "
                "submit(stream, fn) (fxpipe's rule: every device op inside submit)")

    def _queued(self) -> list[Callable[[], Any]] | None:
        """Where a copy made now is queued (``semantics="cuda"``, inside this device's
        work), or None: done at once."""
        return _work.copies if self.semantics == "cuda" and _work.token is self._token else None

    def to_device(self, host_tensor: torch.Tensor, kind: str, owner: str,
                  use: Sequence[str] = ("compute",)) -> torch.Tensor:
        """A separate contiguous copy, counted as ``kind`` (raises DeviceMemoryError).
        With ``semantics="cuda"`` its memory comes from the calling work's stream's pool
        and is held back for the streams in ``use`` (``_StorageCache``)."""
        if host_tensor.device.type != "cpu":
            raise ValueError(f"{self.name}: to_device() for {owner} takes a host (cpu) tensor, "
                             f"got one on {host_tensor.device}")
        self._device_op("to_device", owner)
        nbytes = host_tensor.numel() * host_tensor.element_size()
        source = host_tensor.detach()
        self._host_stall(source)
        pool = _work.stream if _work.token is self._token else None
        return self._allocate(nbytes, kind, owner, lambda: self._copy_into(
            source, self._cache.alloc(source, pool, use, lambda _: self._room())))

    def record_stream(self, tensor: torch.Tensor) -> None:
        if _work.token is self._token and _work.stream is not None:
            self._cache.record(tensor, _work.stream)

    def free(self, tensor: torch.Tensor) -> str | None:
        """Stop counting ``tensor``'s allocation; memory ``to_device`` made is kept for reuse
        (as a GPU's caching allocator does; ``empty_cache()`` gives it back), with
        ``semantics="cuda"`` once the streams using it have passed this point."""
        kind = super().free(tensor)
        after = self._cache.put(tensor, self._tails if self.semantics == "cuda"
                                else (lambda _: ()))
        if kind == "params":
            self._released(after)
        return kind

    def _tails(self, streams: Collection[str]) -> tuple[Event, ...]:
        """The last work issued on each of ``streams``."""
        with self._lock:
            return tuple(self._last[s] for s in streams if s in self._last)

    def _room(self, extra: int = 0) -> None:
        """Before the allocator takes new memory (counted as resident, plus ``extra``
        bytes not yet counted): if what it reserves would be over ``memory_limit``, it
        gives its kept blocks back, as torch's caching allocator does (on the issuing
        thread: after waiting for the streams they wait for; counted in
        ``allocator_flushes``)."""
        if self.memory_limit is None or not self._cache.nbytes():
            return
        with self._mem_lock:
            over = self._reserved() + extra > self.memory_limit
        if not over:
            return
        if _work.token is not self._token or _work.stream != "compute":
            for event in self._cache.pending():   # issued work: it completes
                event.exception()
        self._cache.release()
        with self._stall_lock:
            self.allocator_flushes += 1

    def _count_made(self, tensors: Sequence[torch.Tensor], kind: str, owner: str) -> None:
        # memory its work makes: the allocator's cache gives way at the limit
        self._room(sum(t.untyped_storage().nbytes() for t in tensors))
        super()._count_made(tensors, kind, owner)

    def cached_bytes(self) -> int:
        """Freed device memory kept for reuse (not counted as resident)."""
        return self._cache.nbytes()

    def _reserved(self) -> int:
        return sum(self._resident.values()) + self._cache.nbytes()

    def empty_cache(self) -> None:
        """Give the freed memory kept for reuse back (``stop_workers``/``close`` do too)."""
        self._cache.release()

    def to_host(self, dev_tensor: torch.Tensor, pin: bool = True) -> torch.Tensor:
        """A separate contiguous host copy. With ``semantics="cuda"``: page-locked
        (emulated, ``pinned.host_pool``) if ``pin``, as a GPU's is (else a host stall), and
        inside this device's work filled when the stream reaches the copy (NaN until
        then)."""
        self._device_op("to_host", "a download")
        with host_allocations():   # host memory, not the device's
            if pin and self.semantics == "cuda":
                out = pinned.host_pool(emulate=True).empty(dev_tensor.shape, dev_tensor.dtype)
            else:
                out = torch.empty(dev_tensor.shape, dtype=dev_tensor.dtype)
        self._host_stall(out)
        return self._copy_into(dev_tensor.detach(), out)

    def copy_to_host(self, dev_tensor: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Copy into existing host memory ``out``; with ``semantics="cuda"`` inside this
        device's work it lands when the stream reaches it (NaN until then); a host stall
        unless ``out`` is page-locked."""
        self._device_op("copy_to_host", "a download")
        self._host_stall(out)
        return self._copy_into(dev_tensor.detach(), out)

    def _copy_into(self, src: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out.copy_(src)`` now, or with ``semantics="cuda"`` inside this device's work
        when the stream reaches it: ``out`` reads as unwritten until then, and ``src`` is
        read then (a copy in either direction)."""
        if self._queued() is None:
            return out.copy_(src)
        out.fill_(_unwritten_fill(out.dtype))
        self.kernel(torch.Tensor.copy_, out, src)   # its handles count as a kernel's
        return out

    def synchronize(self) -> None:
        """Block until every stream has run all work submitted so far."""
        with self._lock:
            last = list(self._last.values())
        for event in last:
            event.exception()

    def stop_workers(self) -> None:
        """Run the work already queued, then stop and join the worker threads; the next
        ``submit`` starts new ones (after the old ones finished, so streams keep order)."""
        self._stop_and_join(close=False)

    def close(self) -> None:
        """Run the work already queued, then stop and join the worker threads; later
        submits raise. Idempotent."""
        self._stop_and_join(close=True)

    def _stop_and_join(self, close: bool, timeout: float | None = None) -> None:
        """Stop the workers once their queued work has run, and join each (within
        ``timeout`` seconds, if given)."""
        self._cache.clear()
        with self._lock:
            if self._closed:
                return
            self._closed = close
            _stop_workers(self._queues)
            self._queues.clear()  # the same dict the finalizer holds
            self._stopped.update(self._threads)
            self._threads.clear()
            stopped = list(self._stopped.values())
        for thread in stopped:
            if thread is not threading.current_thread():
                thread.join(timeout)
        with self._lock:
            for stream, thread in list(self._stopped.items()):
                if not thread.is_alive():
                    del self._stopped[stream]

    def __repr__(self) -> str:
        return (f"VirtualDevice({self.name!r}, memory_limit={self.memory_limit}, "
                f"semantics={self.semantics!r})")


class InlineDevice(Device):
    """A device whose work runs when it is submitted, on the submitting thread, every
    stream alike: what a :class:`CudaDevice`'s host does (it runs a work item's Python
    at issue and queues its kernels), with the kernels run at once on the host. With a
    model of tiny widths its kernels cost next to nothing, and a call's time is the host's
    own issue work: threads, actions, stage code and op dispatch, events
    (``benchmarks/bench_issue.py``). Memory is counted as on any device (``to_device``,
    ``track``); what its work allocates is not (no dispatch mode on its ops).

    >>> d = InlineDevice()
    >>> x = d.to_device(torch.ones(2), kind="activations", owner="stage 0")
    >>> d.submit("compute", torch.mul, x, 3).result()
    tensor([3., 3.])
    """

    runs_at_issue = True

    def __init__(self, memory_limit: int | None = None, name: str | None = None):
        super().__init__(name if name is not None else f"inline:{next(_virtual_ids)}",
                         memory_limit)
        self.semantics = "sync"
        self._closed = False

    def submit(self, stream: str, fn: Callable[..., Any], *args: Any,
               wait: Sequence[Event] = (), label: str | None = None) -> Event:
        wait = _check_submit(self, stream, wait)
        event = Event(label if label is not None else getattr(fn, "__name__", "work"))
        exc = next((e for e in map(Event.exception, wait) if e is not None), None)
        result = None
        if exc is None:
            try:
                result = fn(*args)
            except BaseException as e:  # noqa: BLE001 - every failure must reach the event
                exc = e
        event._finish(result, exc)
        return event

    def to_device(self, host_tensor: torch.Tensor, kind: str, owner: str,
                  use: Sequence[str] = ("compute",)) -> torch.Tensor:
        nbytes = host_tensor.numel() * host_tensor.element_size()
        copy = lambda: host_tensor.detach().clone(memory_format=torch.contiguous_format)  # noqa: E731
        return self._allocate(nbytes, kind, owner, copy)

    def to_host(self, dev_tensor: torch.Tensor, pin: bool = True) -> torch.Tensor:
        return dev_tensor.detach().clone()

    def copy_to_host(self, dev_tensor: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return out.copy_(dev_tensor.detach())

    def synchronize(self) -> None:
        pass

    def close(self) -> None:
        self._closed = True


class CudaDevice(Device):
    """One GPU: ``torch.cuda.Stream`` per stream, ``torch.cuda.Event`` between them.

    ``submit`` runs ``fn`` on the calling thread (the runtime calls it from this device's
    issue thread) inside ``torch.cuda.stream(s)``, after ``s.wait_event(...)`` for each
    CUDA event waited on (a VirtualDevice event is waited on by the host). The host only
    *queues* kernels; the returned event completes on the GPU when they finish.
    ``to_device`` copies from pinned memory (``pinned.is_pinned``: fxpipe's registered
    memory or torch's) without blocking, ``to_host`` copies into pinned memory without
    blocking (read it after the event completes); a copy from or to pageable memory
    blocks the issuing thread and is counted in ``host_stalls``. A tensor is
    ``record_stream``-ed on each other stream that reads it, and only those (``use``,
    :meth:`record_stream`). ``peak_bytes()`` is
    ``torch.cuda.max_memory_allocated`` (everything, not only tracked tensors). While
    recording (``pipe.trace()``), each work item is bracketed by timing events, read when
    ``records`` is (never inside a call). Needs a CUDA build and a visible GPU.

    ``name`` (default ``cuda:N``): two CudaDevices of one GPU under two names are two
    logical devices, each with its own streams, events and copies, sharing the GPU's
    memory (give each its ``memory_limit``): how the cross-device ordering code runs on
    a machine with one GPU (``fxpipe.check``'s ``scaling``).
    """

    runs_at_issue = True

    def __init__(self, index: int | None = None, memory_limit: int | None = None, *,
                 name: str | None = None):
        if not torch.cuda.is_available():
            raise RuntimeError(
                f"CudaDevice({index}): CUDA is not available (torch {torch.__version__}, "
                f"torch.version.cuda={torch.version.cuda}): install a CUDA build of torch on a "
                "machine with a GPU, or use fxpipe.VirtualDevice() / devices=['cpu']")
        count = torch.cuda.device_count()
        index = torch.cuda.current_device() if index is None else index
        if not 0 <= index < count:
            raise ValueError(f"CudaDevice({index}): no such GPU, {count} visible (cuda:0..cuda:{count - 1})")
        self.device = torch.device("cuda", index)
        if memory_limit is None:
            memory_limit = torch.cuda.get_device_properties(index).total_memory
        super().__init__(name if name is not None else f"cuda:{index}", memory_limit)
        self.semantics = "cuda"
        self.streams = {name: torch.cuda.Stream(self.device) for name in STREAMS}
        self._uses: dict[int, tuple[str, ...]] = {}   # block -> the streams to_device said use it
        self._closed = False
        self._recording = False
        self._timed: list[tuple[str, str, Any, Any]] = []  # (stream, label, start, end) events
        self._origin: tuple[Any, float] | None = None     # (event, perf_counter) at start

    def submit(self, stream: str, fn: Callable[..., Any], *args: Any,
               wait: Sequence[Event] = (), label: str | None = None) -> Event:
        """Queue ``fn(*args)``'s kernels on ``stream`` after ``wait``; returns their event."""
        wait = _check_submit(self, stream, wait)
        s = self.streams[stream]
        label = label if label is not None else getattr(fn, "__name__", "work")
        event = Event(label, _host_waitable(enable_timing=self._recording))
        result, exc = None, None
        with torch.cuda.device(self.device), torch.cuda.stream(s):
            for e in wait:
                if e._cuda_event is not None and e.done():
                    s.wait_event(e._cuda_event)  # the GPU waits; its host part is already done
                    failed = e._exc
                else:  # a VirtualDevice event: the host waits for it
                    failed = e.exception()
                exc = failed if exc is None else exc
            start = None
            if self._recording:
                start = torch.cuda.Event(enable_timing=True)
                start.record(s)
            if exc is None:
                try:
                    result = fn(*args)
                except BaseException as e:  # noqa: BLE001 - every failure must reach the event
                    exc = e
            event._cuda_event.record(s)
            if start is not None:
                self._timed.append((stream, label, start, event._cuda_event))
        event._finish(result, exc)
        return event

    def recording(self, flag: bool = True) -> None:
        if flag and self._origin is None:
            torch.cuda.synchronize(self.device)
            origin = torch.cuda.Event(enable_timing=True)
            origin.record(torch.cuda.current_stream(self.device))
            origin.synchronize()
            self._origin = (origin, time.perf_counter())
        self._recording = flag

    def is_recording(self) -> bool:
        return self._recording

    @property
    def records(self) -> list[Record]:
        """``(stream, label, t_start, t_end)`` per recorded work item, in
        ``time.perf_counter()`` seconds (waits for the GPU to finish what was recorded)."""
        if self._timed:
            self._timed[-1][3].synchronize()
            torch.cuda.synchronize(self.device)
            origin, t0 = self._origin
            for stream, label, start, end in self._timed:
                self._records.append((stream, label, t0 + origin.elapsed_time(start) / 1e3,
                                      t0 + origin.elapsed_time(end) / 1e3))
            self._timed.clear()
        return self._records

    @records.setter
    def records(self, value: list[Record]) -> None:
        self._records = value

    def to_device(self, host_tensor: torch.Tensor, kind: str, owner: str,
                  use: Sequence[str] = ("compute",)) -> torch.Tensor:
        """Copy on the current stream (non-blocking from pinned memory), counted as
        ``kind``; ``record_stream``-ed on the streams in ``use`` (only those). A source on
        this GPU (a caller's CUDA input, :meth:`after_caller` ordered this device's streams
        after its writes) is copied device to device and marked as read by this stream
        (its memory is not reused before the copy). A source on another GPU is refused:
        that copy would run on the source's current stream, fenced both ways against
        this one (the pipeline stages such inputs through the host)."""
        if host_tensor.device.type != "cpu" and host_tensor.device != self.device:
            raise ValueError(
                f"{self.name}: to_device() for {owner} takes a host tensor or one on "
                f"{self.device}, got one on {host_tensor.device}: copy it to the host first "
                "(a call's inputs on another GPU are, through its staging)")
        stalls = self._host_stall(host_tensor)

        def copy() -> torch.Tensor:
            out = torch.empty(host_tensor.shape, dtype=host_tensor.dtype, device=self.device)
            current = torch.cuda.current_stream(self.device)
            if host_tensor.is_cuda:
                host_tensor.record_stream(current)
            out.copy_(host_tensor.detach(),
                      non_blocking=host_tensor.device.type != "cpu" or not stalls)
            if pinned.pooled(host_tensor):   # its block is not reused before the copy is done
                pinned.hold(host_tensor, current.record_event())
            for name in use:
                if self.streams[name] != current:
                    out.record_stream(self.streams[name])
            self._uses[out.untyped_storage().data_ptr()] = tuple(use)
            return out

        nbytes = host_tensor.numel() * host_tensor.element_size()
        try:
            return self._allocate(nbytes, kind, owner, copy)
        except torch.OutOfMemoryError as e:
            if isinstance(e, DeviceMemoryError):
                raise
            raise DeviceMemoryError(f"{self.name}: out of memory allocating {nbytes} B of {kind} "
                                    f"for {owner} ({self.resident_bytes()} B counted): {e}") from e

    def to_host(self, dev_tensor: torch.Tensor, pin: bool = True) -> torch.Tensor:
        """Copy on the current stream into a new host tensor; ``pin``: page-locked at its
        size (``pinned.host_pool``, not torch's power-of-two host allocator), non-blocking."""
        out = (pinned.host_pool(emulate=False).empty(dev_tensor.shape, dev_tensor.dtype) if pin
               else torch.empty(dev_tensor.shape, dtype=dev_tensor.dtype))
        current = torch.cuda.current_stream(dev_tensor.device)
        dev_tensor.record_stream(current)
        out.copy_(dev_tensor.detach(), non_blocking=not self._host_stall(out))
        if pin:   # a block dropped unread is not reused while the copy may still write it
            pinned.hold(out, current.record_event())
        return out

    def record_stream(self, tensor: torch.Tensor) -> None:
        tensor.record_stream(torch.cuda.current_stream(self.device))

    def after_caller(self, event: torch.cuda.Event) -> None:
        """Order every stream of this device after ``event``, recorded on the caller's
        stream after the kernels writing a call's CUDA inputs (which the call then uploads
        device to device, no host copy): the GPU waits, the host does not."""
        with torch.cuda.device(self.device):
            for s in self.streams.values():
                s.wait_event(event)

    def free(self, tensor: torch.Tensor) -> str | None:
        """Stop counting ``tensor``; for parameters, an event on each stream that read it
        marks where its memory becomes reusable (:meth:`wait_released`)."""
        uses = self._uses.pop(tensor.untyped_storage().data_ptr(), ())
        kind = super().free(tensor)
        if kind == "params":
            events = []
            for name in uses:
                event = Event(f"free on {name}", _host_waitable())
                event._cuda_event.record(self.streams[name])
                event._finish()
                events.append(event)
            self._released(events)
        return kind

    def peak_bytes(self, kind: str | None = None) -> int:
        if kind is None:
            return max(super().peak_bytes(), torch.cuda.max_memory_allocated(self.device))
        return super().peak_bytes(kind)

    def reset_peak(self) -> None:
        super().reset_peak()
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak_reserved_bytes(self) -> int:
        return torch.cuda.max_memory_reserved(self.device)

    def synchronize(self) -> None:
        """Wait for what this device's streams queued (sleeping, not spinning)."""
        for s in self.streams.values():
            event = _host_waitable()
            event.record(s)
            event.synchronize()

    def close(self) -> None:
        """Wait for queued kernels; later submits raise. Idempotent."""
        if not self._closed:
            self._closed = True
            self.synchronize()


def _host_waitable(enable_timing: bool = False) -> Any:
    """A CUDA event the host may wait on: ``blocking`` (``cudaEventBlockingSync``), so
    the waiting thread sleeps; a default event's ``synchronize`` spins a core, and G issue
    threads spinning starve the one issuing."""
    return torch.cuda.Event(enable_timing=enable_timing, blocking=True)


def resolve_devices(devices: Sequence[str | torch.device | Device] | str | torch.device | Device
                    | None = None) -> list[Device]:
    """Turn the ``devices=`` argument of ``fxpipe.compile`` into Device objects.

    ``None``: the visible GPUs (under torchrun with several ranks on the node, this rank's
    share: :func:`local_gpus`), or two VirtualDevices without one. ``"cpu"``: one
    VirtualDevice (per entry). ``"cuda:1"`` / ``torch.device``: a CudaDevice. Device
    instances pass through.

    >>> [d.name for d in resolve_devices(["cpu", "cpu"])]
    ['vcpu:0', 'vcpu:1']
    """
    if devices is None:
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count:
            return [CudaDevice(i) for i in local_gpus(count)]
        return [VirtualDevice(name="vcpu:0"), VirtualDevice(name="vcpu:1")]
    if isinstance(devices, (str, torch.device, Device)):
        devices = [devices]
    out: list[Device] = []
    for i, entry in enumerate(devices):
        where = f"devices[{i}]={entry!r}"
        if isinstance(entry, Device):
            device = entry
        elif isinstance(entry, (str, torch.device)):
            try:
                spec = torch.device(entry)
            except RuntimeError as e:
                raise ValueError(f"{where} is not a device string: use 'cpu' or 'cuda:N' ({e})") from None
            if spec.type == "cpu":
                device = VirtualDevice(name=f"vcpu:{sum(isinstance(d, VirtualDevice) for d in out)}")
            elif spec.type == "cuda":
                device = CudaDevice(spec.index)
            else:
                raise ValueError(f"{where}: fxpipe runs on 'cpu' (virtual devices) or 'cuda:N', "
                                 f"not {spec.type!r}")
        else:
            raise ValueError(f"{where}: expected 'cpu', 'cuda:N', a torch.device or an "
                             f"fxpipe.Device, got {type(entry).__name__}")
        if any(d is device or (isinstance(d, CudaDevice) and d.name == device.name) for d in out):
            raise ValueError(f"{where}: {device.name} is listed twice; list each device once")
        out.append(device)
    if not out:
        raise ValueError("devices is empty: pass None (auto), ['cpu'], or a list of 'cuda:N'")
    return out


def local_gpus(count: int, env: Mapping[str, str] | None = None) -> list[int]:
    """The GPU indices ``devices=None`` takes of ``count`` visible ones: all of them, or
    under torchrun with ``LOCAL_WORLD_SIZE`` ranks on this node (``env``: the process's
    environment) rank ``LOCAL_RANK``'s contiguous share, ``count // LOCAL_WORLD_SIZE``
    each (DDP's habit ``--nproc-per-node=8`` on 8 GPUs: one each, not eight ranks on
    every GPU with eight host copies of the model).

    >>> local_gpus(8, {}), local_gpus(8, {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"})
    ([0, 1, 2, 3, 4, 5, 6, 7], [4, 5, 6, 7])
    """
    env = os.environ if env is None else env
    ranks = int(env.get("LOCAL_WORLD_SIZE", "1") or 1)
    if ranks <= 1 or "LOCAL_RANK" not in env:
        return list(range(count))
    rank = int(env["LOCAL_RANK"])
    if count < ranks:
        raise ValueError(
            f"{ranks} ranks on this node (LOCAL_WORLD_SIZE) share {count} visible GPU(s): "
            f"devices=None gives each rank GPUs of its own. Start at most {count} rank(s) per "
            "node (torchrun --nproc-per-node), or pass devices= explicitly (each rank its own)")
    per = count // ranks
    return list(range(rank * per, (rank + 1) * per))
