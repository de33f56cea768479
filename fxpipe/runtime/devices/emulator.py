"""Devices on the CPU: :class:`VirtualDevice`, a GPU emulated with a worker thread per
stream, and :class:`InlineDevice`, whose work runs at submit.

A VirtualDevice makes real, separate tensor copies and counts what its work allocates
(``fxpipe.runtime.devices.emulator_threads``). With ``semantics="cuda"`` its work behaves toward
the host as a GPU's does (``fxpipe.runtime.devices.device``): a copy stream's Python runs at
issue and the copies it queues when the stream gets there, freed memory is reused per
stream as a caching allocator does (``fxpipe.runtime.devices.emulator_alloc``), and a
``strict`` device holds its work to CUDA's device rule. ``default_semantics`` is what
``VirtualDevice()`` uses when not told.
"""

from __future__ import annotations

import contextlib
import itertools
import queue
import threading
import time
import weakref
from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree

from fxpipe.errors import DeviceMemoryError
from fxpipe.runtime.devices import pinned
from fxpipe.runtime.devices.device import (
    WORKER_STREAMS, Device, WorkingSet, _check_kind, _check_submit, _describe, _work,
    host_allocations,
)
from fxpipe.runtime.devices.device_graph import EmulatedGraph
from fxpipe.runtime.devices.emulator_alloc import _StorageCache
from fxpipe.runtime.devices.emulator_threads import (
    _HOST_INDICES, _host_part, _live_devices, _run_copies, _run_copies_of, _run_stream,
    _start_worker, _stop_workers,
)
from fxpipe.runtime.devices.events import _FINISHED, Event

SEMANTICS = ("sync", "cuda")
default_semantics = "sync"
"""What ``VirtualDevice()`` uses when ``semantics`` is not given (the test suite's
``FXPIPE_TEST_DEVICE=cuda-sim`` sets ``"cuda"``)."""

_virtual_ids = itertools.count()


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


_virtual_devices: weakref.WeakSet = weakref.WeakSet()   # every VirtualDevice, for messages


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
    ``semantics="cuda"`` makes work behave as a GPU's does toward the host
    (``fxpipe.runtime.devices.device``): the Python of copy-stream work runs when it is submitted, what it queues
    when its stream gets there; compute runs when its stream gets there. The default is
    ``fxpipe.runtime.devices.emulator.default_semantics`` (``"sync"``). ``strict`` (default: on
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
        self._pool: list[tuple[weakref.ref, int]] = []   # live graphs and their working sets
        self._pool_bytes = 0   # what the graph pool holds (counted as workspace)
        self._capturing: WorkingSet | None = None   # a capture in progress: what it made
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
        if self.semantics == "cuda" and stream not in WORKER_STREAMS:
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
            # a GPU's capture drains its device: what a capture in this item waits for
            before = tuple(e for s, e in self._last.items() if s != stream) \
                if self.strict and self.semantics == "cuda" and stream in WORKER_STREAMS else ()
            self._queues[stream].put((fn, args, wait, event, self._token, self._counting,
                                      before))
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

    def in_order(self) -> None:
        queued = self._queued()
        if queued and _work.stream in WORKER_STREAMS:   # (issue-time Python: not ordered)
            exc = _run_copies(queued)
            if exc is not None:
                raise exc

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

    def copy_into(self, host_tensor: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Into existing device memory; with ``semantics="cuda"`` it lands when the
        stream reaches it (NaN until then), as :meth:`to_device`'s copies do."""
        self._device_op("copy_into", "an upload into a parameter or input slot")
        source = host_tensor.detach()
        self._host_stall(source)
        return self._copy_into(source, out)

    def capture(self, fn: Callable[..., Sequence[Any]], inputs: Sequence[torch.Tensor],
                name: str = "a device graph") -> EmulatedGraph:
        """An :class:`EmulatedGraph`. A ``strict`` device (cuda-sim) raises
        ``GraphReplayError`` on a replay reading device memory freed since the capture,
        and holds memory as a GPU's graph pool does: a graph keeps what its capture's run
        allocated at its peak beyond what it left (its intermediates; its outputs stay
        counted as the tensors they are) for its life, counted as ``workspace``. The
        device's graphs share one pool, captured one after another on one stream, so the
        largest live graph's working set is held, once (``CudaDevice.capture``). A
        replay allocates nothing new: its run's temporaries are in that pool. A capture
        allocates in the pool first: while it runs, the device holds the larger of the
        pool and what the capture has allocated, not both. It starts once the device's
        other streams ran what was submitted before it (:meth:`drain_for_capture`)."""
        if not self.strict:
            return EmulatedGraph(fn, inputs, name)
        self.drain_for_capture()
        with WorkingSet() as used:
            self._capturing = used
            try:
                graph = EmulatedGraph(fn, inputs, name, self.holds, pooled=host_allocations)
            finally:
                self._capturing = None
        self._pool_hold(graph, used.peak - used.live(), name)
        return graph

    def drain_for_capture(self) -> None:
        """A GPU's capture starts by synchronizing its device: on a strict device
        (cuda-sim), inside a work item of its own, wait until each other stream has run
        the work submitted before that item (its own stream's has: streams run in order).
        What was submitted after it is not waited for, as on a GPU, where it would not
        have been issued yet."""
        if self.strict and self.semantics == "cuda" and _work.token is self._token:
            for event in _work.before:
                event.exception()   # ran, failed or not

    def _pool_hold(self, graph: EmulatedGraph, nbytes: int, name: str) -> None:
        """``graph``'s working set joins the device's graph pool (module docstring of
        ``device_graph``); over the memory limit, a GPU's capture would fail."""
        with self._mem_lock:
            self._pool.append((weakref.ref(graph), nbytes))
            self._sweep()
            total = sum(self._resident.values())
            self._peak["workspace"] = max(self._peak["workspace"], self._resident["workspace"])
            self._peak_total = max(self._peak_total, total)
            self._peak_reserved = max(self._peak_reserved, self._reserved())
            if self.memory_limit is not None and total > self.memory_limit:
                raise DeviceMemoryError(
                    f"{self.name}: {name} holds a working set of {nbytes} B in the device's "
                    f"graph pool, which exceeds the memory limit: {total} B resident > limit "
                    f"{self.memory_limit} B. Give the stage fewer layers or use smaller "
                    "microbatches, or stage_backend='inductor' (no graphs)")

    def _sweep(self) -> None:
        super()._sweep()
        self._held_beside()

    def _held_beside(self) -> None:
        """The graph pool holds the largest working set of the graphs still alive, less
        what a capture in progress has allocated (in it)."""
        if not (self._pool or self._pool_bytes):
            return
        self._pool = [(g, n) for g, n in self._pool if g() is not None]
        held = max((n for _, n in self._pool), default=0)
        capturing = self._capturing
        if capturing is not None:
            held = max(0, held - capturing.live())
        self._resident["workspace"] += held - self._pool_bytes
        self._pool_bytes = held

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
        if _work.token is not self._token or _work.stream not in WORKER_STREAMS:
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
        exc = result = None
        for e in _check_submit(self, stream, wait):
            # (an event of work that ran here: read at once, no call per wait)
            exc = e._exc if (e._done is _FINISHED and e._stream is None
                             and e._cuda_event is None) else e.exception()
            if exc is not None:
                break
        if exc is None:
            try:
                result = fn(*args)
            except BaseException as e:  # noqa: BLE001 - every failure must reach the event
                exc = e
        return Event.finished(label if label is not None else getattr(fn, "__name__", "work"),
                              result, exc)

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
