"""Devices: one interface, two backends (:class:`CudaDevice`, and :class:`VirtualDevice` on CPU).

A device has ordered work queues, *streams* (``STREAMS``). ``submit`` puts a callable on
one and returns an :class:`Event`; other work (any stream, any device) can ``wait`` on
it, the host can ``event.result()``. Device memory made by ``to_device`` / ``track`` is
counted by kind (params, activations, gradients), with peaks and an optional limit
(:class:`fxpipe.errors.DeviceMemoryError`).

How copies behave toward the host (``semantics``):

- ``"cuda"`` (every :class:`CudaDevice`, and ``VirtualDevice(semantics="cuda")``): work
  *queues* copies. ``to_host`` returns its destination at once; the data lands when the
  stream reaches the copy (a virtual device fills it with NaN until then), so the host
  may read it only after waiting for the work's event. ``to_device`` reads its source
  when the stream performs the copy, not when it is queued. An event completes when its
  stream has performed everything queued before it. Memory freed while other streams
  may still use it is reused only after they passed that point (``record_stream``).
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

import contextlib
import itertools
import queue
import threading
import time
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from fxpipe.errors import DeviceMemoryError
from fxpipe.live_bytes import new_storages, storage_key
from fxpipe.passes.program import parse_action

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

    __slots__ = ("label", "_done", "_result", "_exc", "_cuda_event")

    def __init__(self, label: str, cuda_event: Any = None):
        self.label = label
        self._done = threading.Event()
        self._result: Any = None
        self._exc: BaseException | None = None
        self._cuda_event = cuda_event  # torch.cuda.Event recorded after the work (CUDA only)

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
    """

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

    @abstractmethod
    def submit(self, stream: str, fn: Callable[..., Any], *args: Any,
               wait: Sequence[Event] = (), label: str | None = None) -> Event:
        """Run ``fn(*args)`` on ``stream`` after earlier work on it and after ``wait``."""

    @abstractmethod
    def to_device(self, host_tensor: torch.Tensor, kind: str, owner: str) -> torch.Tensor:
        """Copy a host tensor into counted device memory; ``owner`` (a stage) names it in errors."""

    @abstractmethod
    def to_host(self, dev_tensor: torch.Tensor, pin: bool = True) -> torch.Tensor:
        """Copy a device tensor into a new host tensor (pinned if ``pin`` and supported)."""

    def copy_to_host(self, dev_tensor: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Copy a device tensor into existing host memory ``out`` (e.g. a parameter's
        place in the flat gradient buffer); returns ``out``. Like ``to_host``, the data
        is there once the work that queued the copy has completed."""
        dev_tensor.record_stream(torch.cuda.current_stream(dev_tensor.device))
        return out.copy_(dev_tensor.detach(), non_blocking=out.is_pinned())

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

    def free(self, tensor: torch.Tensor) -> None:
        """Stop counting the allocation ``tensor`` belongs to (its whole storage)."""
        if not tensor.untyped_storage().nbytes():
            return
        with self._mem_lock:
            entry = self._live.pop(tensor.untyped_storage().data_ptr(), None)
            if entry is None:
                raise ValueError(f"{self.name}: free() got a tensor whose memory is not counted here: "
                                 "it was already freed, or not made by to_device()/track() on this device")
            self._resident[entry[1]] -= entry[2]

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
    copies: list[Callable[[], Any]] | None = None
    owner: str = "work"
    kind: str = "workspace"
    paused: bool = False
    made: list[int]     # storages this thread's work counted since the last ``keep``

    def __init__(self) -> None:
        self.made = []


_work = _Work()


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


class _Counting(TorchDispatchMode):
    """Active in a VirtualDevice's stream threads while they run its work: every storage an
    op makes (not an input's: views and in-place results are not new) is counted on the
    device (``Device._count_made``) until Python frees it."""

    def __init__(self, device: weakref.ref):
        super().__init__()
        self._device = device

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        device = self._device()
        if _work.paused or device is None:
            return out
        made = new_storages(args, kwargs, out)
        if made:
            device._count_made(made, _work.kind, _work.owner)
        return out


def _run_one(stream: str, fn: Callable[..., Any], args: tuple, wait: tuple[Event, ...],
             event: Event, token: object, counting: weakref.ref | None,
             records: list[Record] | None) -> None:
    for e in wait:
        exc = e.exception()
        if exc is not None:  # do not compute on the output of failed work
            event._finish(exc=exc)
            return
    result, exc, start = None, None, time.perf_counter()
    _work.token, _work.copies, _work.owner, _work.made = token, [], event.label, []
    try:
        # a mode per item: a mode object is not entered by two threads at once
        with _Counting(counting) if counting is not None else contextlib.nullcontext():
            result = fn(*args)
    except BaseException as e:  # noqa: BLE001 - every failure must reach the event
        exc = e
    finally:
        copies, _work.token, _work.copies = _work.copies, None, None
    copies.reverse()
    while copies:  # what the work queued runs in order, as on a GPU stream
        try:
            copies.pop()()   # (no variable keeps a copy's tensors once it has run)
        except BaseException as e:  # noqa: BLE001
            exc = exc if exc is not None else e
    copies = None
    if records is not None:
        records.append((stream, event.label, start, time.perf_counter()))
    event._finish(result, exc)


def _stop_workers(queues: dict[str, queue.SimpleQueue]) -> None:
    for work in queues.values():
        work.put(None)


# How many holders a storage has (tensors, Python handles): private torch API, so optional;
# without it, memory that might still be shared is never reused or replaced.
storage_use_count = getattr(torch._C, "_storage_Use_Count", None)

class _StorageCache:
    """A VirtualDevice's freed ``to_device`` memory, by size, for the next transfer of that
    size, as a GPU's caching allocator keeps it. That makes reuse bugs visible: memory
    still read after its ``free`` is overwritten by the next copy.

    A freed storage is reused only once nothing else holds it (a view, an autograd
    graph, a value handed on: its use count is then the cache's own reference alone) and,
    with ``semantics="cuda"``, once every stream of the device has passed the point where
    it was freed (the events given to ``put``), as ``record_stream`` makes a GPU wait.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._made: set[int] = set()  # data_ptr of storages alloc made and not yet put back
        # by nbytes: (storage, events that must complete before it is reused)
        self._free: dict[int, list[tuple[torch.UntypedStorage, tuple[Event, ...]]]] = {}
        self._bytes = 0

    def alloc(self, host: torch.Tensor) -> torch.Tensor:
        """New contiguous memory shaped like ``host`` (uninitialized), reused when some is
        free."""
        nbytes = host.numel() * host.element_size()
        storage = self._take(nbytes) if nbytes and storage_use_count is not None else None
        if storage is None:
            out = torch.empty(host.shape, dtype=host.dtype)
        else:
            out = torch.empty(0, dtype=host.dtype).set_(storage, 0, host.shape)
        if nbytes and storage_use_count is not None:
            with self._lock:
                self._made.add(out.untyped_storage().data_ptr())
        return out

    def put(self, tensor: torch.Tensor, after: tuple[Event, ...] = ()) -> None:
        storage = tensor.untyped_storage()
        with self._lock:
            if storage.data_ptr() not in self._made:
                return  # not ours (made by compute and tracked): left to Python
            self._made.discard(storage.data_ptr())
            self._free.setdefault(storage.nbytes(), []).append((storage, after))
            self._bytes += storage.nbytes()

    def _take(self, nbytes: int) -> torch.UntypedStorage | None:
        with self._lock:
            free = self._free.get(nbytes, [])
            for i, (storage, after) in enumerate(free):
                if storage_use_count(storage._cdata) == 1 and all(e.done() for e in after):
                    self._bytes -= nbytes
                    return free.pop(i)[0]
        return None

    def nbytes(self) -> int:
        return self._bytes

    def clear(self) -> None:
        with self._lock:
            self._free.clear()
            self._bytes = 0
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
    ``semantics="cuda"`` makes copies behave as a GPU's do toward the host (module
    docstring); the default is ``fxpipe.runtime.devices.default_semantics`` (``"sync"``).

    >>> with VirtualDevice(memory_limit=1024, record=True) as d:
    ...     w = d.to_device(torch.zeros(8), kind="params", owner="stage 0")
    ...     d.submit("compute", torch.add, w, 1, label="F s0 m0").result().sum()
    tensor(8.)
    >>> d = VirtualDevice(semantics="cuda")
    >>> x = d.to_device(torch.ones(2), kind="activations", owner="stage 0")
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
                 record: bool = False, semantics: str | None = None, count_work: bool = True):
        super().__init__(name if name is not None else f"vcpu:{next(_virtual_ids)}", memory_limit)
        semantics = default_semantics if semantics is None else semantics
        if semantics not in SEMANTICS:
            raise ValueError(f"{self.name}: semantics must be one of {SEMANTICS}, got {semantics!r}")
        self.semantics = semantics
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

    def submit(self, stream: str, fn: Callable[..., Any], *args: Any,
               wait: Sequence[Event] = (), label: str | None = None) -> Event:
        """Queue ``fn(*args)`` on ``stream``'s worker; it runs after ``wait`` complete.

        >>> d = VirtualDevice()
        >>> a = d.submit("h2d", lambda: 3)
        >>> d.submit("compute", lambda: a.value() * 2, wait=[a]).result()
        6
        """
        event = Event(label if label is not None else getattr(fn, "__name__", "work"))
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

    def _queued(self) -> list[Callable[[], Any]] | None:
        """Where a copy made now is queued (``semantics="cuda"``, inside this device's
        work), or None: done at once."""
        return _work.copies if self.semantics == "cuda" and _work.token is self._token else None

    def to_device(self, host_tensor: torch.Tensor, kind: str, owner: str) -> torch.Tensor:
        """A separate contiguous copy, counted as ``kind`` (raises DeviceMemoryError)."""
        if host_tensor.device.type != "cpu":
            raise ValueError(f"{self.name}: to_device() for {owner} takes a host (cpu) tensor, "
                             f"got one on {host_tensor.device}")
        nbytes = host_tensor.numel() * host_tensor.element_size()
        source = host_tensor.detach()
        return self._allocate(nbytes, kind, owner,
                              lambda: self._copy_into(source, self._cache.alloc(source)))

    def free(self, tensor: torch.Tensor) -> None:
        """Stop counting ``tensor``'s allocation; memory ``to_device`` made is kept for reuse
        (as a GPU's caching allocator does; ``empty_cache()`` gives it back), with
        ``semantics="cuda"`` once the streams have passed this point."""
        super().free(tensor)
        if self.semantics == "cuda":
            with self._lock:
                after = tuple(self._last.values())
        else:
            after = ()
        self._cache.put(tensor, after)

    def cached_bytes(self) -> int:
        """Freed device memory kept for reuse (not counted as resident)."""
        return self._cache.nbytes()

    def _reserved(self) -> int:
        return sum(self._resident.values()) + self._cache.nbytes()

    def empty_cache(self) -> None:
        """Give the freed memory kept for reuse back (``stop_workers``/``close`` do too)."""
        self._cache.clear()

    def to_host(self, dev_tensor: torch.Tensor, pin: bool = True) -> torch.Tensor:
        """A separate contiguous host copy (``pin`` is ignored: no pinned memory on CPU).
        With ``semantics="cuda"`` inside this device's work: filled when the stream
        reaches the copy (NaN until then)."""
        with host_allocations():   # host memory, not the device's
            out = torch.empty(dev_tensor.shape, dtype=dev_tensor.dtype)
        return self._copy_into(dev_tensor.detach(), out)

    def copy_to_host(self, dev_tensor: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Copy into existing host memory ``out``; with ``semantics="cuda"`` inside this
        device's work it lands when the stream reaches it (NaN until then)."""
        return self._copy_into(dev_tensor.detach(), out)

    def _copy_into(self, src: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out.copy_(src)`` now, or with ``semantics="cuda"`` inside this device's work
        when the stream reaches it: ``out`` reads as unwritten until then, and ``src`` is
        read then (a copy in either direction)."""
        queued = self._queued()
        if queued is None:
            return out.copy_(src)
        out.fill_(_unwritten_fill(out.dtype))
        queued.append(lambda: out.copy_(src))
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

    def _stop_and_join(self, close: bool) -> None:
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
                thread.join()
        with self._lock:
            for stream, thread in list(self._stopped.items()):
                if not thread.is_alive():
                    del self._stopped[stream]

    def __repr__(self) -> str:
        return (f"VirtualDevice({self.name!r}, memory_limit={self.memory_limit}, "
                f"semantics={self.semantics!r})")


class CudaDevice(Device):
    """One GPU: ``torch.cuda.Stream`` per stream, ``torch.cuda.Event`` between them.

    ``submit`` runs ``fn`` on the calling thread (the runtime calls it from this device's
    issue thread) inside ``torch.cuda.stream(s)``, after ``s.wait_event(...)`` for each
    CUDA event waited on (a VirtualDevice event is waited on by the host). The host only
    *queues* kernels; the returned event completes on the GPU when they finish.
    ``to_device`` copies from pinned memory without blocking, ``to_host`` copies into
    pinned memory without blocking (read it after the event completes). Tensors are
    ``record_stream``-ed on every stream that may use them. ``peak_bytes()`` is
    ``torch.cuda.max_memory_allocated`` (everything, not only tracked tensors). While
    recording (``pipe.trace()``), each work item is bracketed by timing events, read when
    ``records`` is (never inside a call). Needs a CUDA build and a visible GPU.
    """

    def __init__(self, index: int | None = None, memory_limit: int | None = None):
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
        super().__init__(f"cuda:{index}", memory_limit)
        self.semantics = "cuda"
        self.streams = {name: torch.cuda.Stream(self.device) for name in STREAMS}
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
        event = Event(label, torch.cuda.Event(enable_timing=self._recording))
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

    def to_device(self, host_tensor: torch.Tensor, kind: str, owner: str) -> torch.Tensor:
        """Copy on the current stream (non-blocking from pinned memory), counted as ``kind``."""
        def copy() -> torch.Tensor:
            out = torch.empty(host_tensor.shape, dtype=host_tensor.dtype, device=self.device)
            out.copy_(host_tensor.detach(), non_blocking=host_tensor.is_pinned())
            self._record_streams(out)
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
        """Copy on the current stream into a new (pinned: non-blocking) host tensor."""
        out = torch.empty(dev_tensor.shape, dtype=dev_tensor.dtype, pin_memory=pin)
        dev_tensor.record_stream(torch.cuda.current_stream(dev_tensor.device))
        out.copy_(dev_tensor.detach(), non_blocking=pin)
        return out

    def track(self, tensor: torch.Tensor, kind: str, owner: str) -> torch.Tensor:
        self._record_streams(tensor)
        return super().track(tensor, kind, owner)

    def _record_streams(self, tensor: torch.Tensor) -> None:
        for s in self.streams.values():  # freed memory is reused only after every stream's use
            tensor.record_stream(s)

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
        torch.cuda.synchronize(self.device)

    def close(self) -> None:
        """Wait for queued kernels; later submits raise. Idempotent."""
        if not self._closed:
            self._closed = True
            self.synchronize()


def resolve_devices(devices: Sequence[str | torch.device | Device] | str | torch.device | Device
                    | None = None) -> list[Device]:
    """Turn the ``devices=`` argument of ``fxpipe.compile`` into Device objects.

    ``None``: every visible GPU, or two VirtualDevices without one. ``"cpu"``: one
    VirtualDevice (per entry). ``"cuda:1"`` / ``torch.device``: a CudaDevice. Device
    instances pass through.

    >>> [d.name for d in resolve_devices(["cpu", "cpu"])]
    ['vcpu:0', 'vcpu:1']
    """
    if devices is None:
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count:
            return [CudaDevice(i) for i in range(count)]
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
