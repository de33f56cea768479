"""The device interface: :class:`Device`, its streams and its memory accounting.

A device has ordered work queues, *streams* (``STREAMS``). ``submit`` puts a callable on
one and returns an :class:`~fxpipe.runtime.devices.events.Event`; other work (any stream, any
device) can ``wait`` on it, the host can ``event.result()``. Device memory made by
``to_device`` / ``track`` is counted by kind (``KINDS``: params, activations, gradients,
...), with peaks and an optional limit (:class:`fxpipe.errors.DeviceMemoryError`).

The backends: :class:`~fxpipe.runtime.devices.cuda.CudaDevice` (a GPU),
:class:`~fxpipe.runtime.devices.emulator.VirtualDevice` (a GPU emulated on the CPU) and
:class:`~fxpipe.runtime.devices.emulator.InlineDevice` (work run at submit, to measure what
issuing costs the host); ``fxpipe.runtime.devices.resolve.resolve_devices`` makes them from
``devices=``.

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

>>> from fxpipe.runtime.devices.emulator import VirtualDevice
>>> d = VirtualDevice(name="vcpu:0")
>>> x = d.to_device(torch.ones(4), kind="activations", owner="stage 0")
>>> y = d.submit("compute", torch.mul, x, 2)
>>> d.submit("d2h", lambda: d.to_host(y.value()), wait=[y]).result()
tensor([2., 2., 2., 2.])
>>> d.close()
"""

from __future__ import annotations

import contextlib
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.multiprocessing.reductions import StorageWeakRef

from fxpipe.errors import DeviceMemoryError
from fxpipe.live_bytes import storage_key
from fxpipe.passes.program import parse_action
from fxpipe.runtime.devices import pinned
from fxpipe.runtime.devices.device_graph import DeviceGraph, EmulatedGraph
from fxpipe.runtime.devices.events import Event, _complete
from fxpipe.runtime.devices.issue_lock import blocking

# compute; activations in and out; parameters in; gradients out; dropping a microbatch's
# values (Free); bookkeeping (Release).
# Each is its own FIFO: a stage-sized parameter copy never queues in front of a
# microbatch's activations, and a Program's streams map one to one (no merged FIFOs,
# which can wait on each other in a cycle across devices).
STREAMS = ("compute", "h2d", "d2h", "prefetch", "grads", "free", "control", "collective")
# the streams whose work reads what earlier device work made (a copy stream's work only
# queues copies): a virtual device with a GPU's semantics runs their Python when the
# stream gets there, not at issue. "collective": data parallel's reduce-scatters
# (``DeviceReduceScatter``), which also wait for the other ranks
WORKER_STREAMS = ("compute", "collective")
KINDS = ("params", "activations", "saved", "gradients", "workspace", "cache")
Record = tuple[str, str, float, float]  # (stream, label, t_start, t_end) from time.perf_counter()



def host_copy(out: torch.Tensor, src: torch.Tensor, stalls: bool) -> torch.Tensor:
    """``out.copy_(src)`` between a GPU and host memory: queued without blocking, unless
    it ``stalls`` (pageable host memory, ``Device._host_stall``). Then the issuing thread
    waits for it, with the issue lock let go (``issue_lock.blocking``: other GPUs' issue
    goes on)."""
    if not stalls:
        return out.copy_(src, non_blocking=True)
    with blocking():
        return out.copy_(src)

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

    compiles_by_default = False
    """Whether ``RunConfig(stage_backend="auto")``, the default, compiles the stage code
    that runs here (a GPU: :class:`CudaDevice`); on CPU workers it runs eagerly (a
    compile costs more than it saves there). A pipe compiles only when every device says
    so."""

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

    def empty(self, nbytes: int, kind: str, owner: str) -> torch.Tensor:
        """``nbytes`` of counted device memory (``uint8``, not written): a parameter slot
        of ``runtime.stages.graphs``, which uploads write into (:meth:`copy_into`)."""
        where = getattr(self, "device", torch.device("cpu"))
        return self._allocate(nbytes, kind, owner,
                              lambda: torch.empty(nbytes, dtype=torch.uint8, device=where))

    def copy_into(self, host_tensor: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Copy a host tensor into device memory ``out`` holds already (a view of
        :meth:`empty`), on the stream of the work calling it; returns ``out``."""
        return out.copy_(host_tensor.detach())

    def capture(self, fn: Callable[..., Sequence[Any]], inputs: Sequence[torch.Tensor],
                name: str = "a device graph") -> DeviceGraph:
        """``fn(*inputs)``'s kernels as a device graph (``runtime.devices.device_graph``), inside
        this device's work: replayed over the same ``inputs``, writing the same outputs.
        This device has no graphs: an :class:`EmulatedGraph` runs ``fn`` again per replay."""
        return EmulatedGraph(fn, inputs, name)

    def drain_for_capture(self) -> None:
        """What a capture does first on a GPU (``torch.cuda.graph`` synchronizes the
        device): block until the work submitted to this device before has run. Called
        before a capture is serialized with other devices' (``runtime.stages.graphs``), so
        none waits for another's drain. Here: nothing (work ran when it was submitted)."""

    def in_order(self) -> None:
        """Inside work on a worker stream (``compute``, ``collective``: its Python runs
        when the stream gets there): what the work queued so far (copies, kernels) has run
        once this returns, so the Python after it reads their results, as the ops after
        them on a GPU stream do. A GPU's stream orders them itself: nothing to do."""

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
        return host_copy(out, dev_tensor.detach(), self._host_stall(out))

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

    def counts(self, tensor: torch.Tensor) -> bool:
        """Whether this device counts ``tensor``'s allocation (``free`` would stop it):
        one ``to_device`` / ``track`` made, not yet freed."""
        if not tensor.untyped_storage().nbytes():
            return False
        with self._mem_lock:
            return tensor.untyped_storage().data_ptr() in self._live

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
            scope = _work.scope
            for t in tensors:
                storage = t.untyped_storage()
                nbytes = storage.nbytes()
                key = storage._cdata
                if not nbytes or storage.data_ptr() in self._live or key in self._made:
                    continue
                ref = StorageWeakRef(storage)
                self._made[key] = (ref, nbytes, kind)
                self._resident[kind] += nbytes
                _work.made.append(key)
                added += nbytes
                if scope is not None:
                    scope.made.append((ref, nbytes))
            if not added:
                return
            if scope is not None:
                scope.peak = max(scope.peak, scope.live())
            self._held_beside()
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

    def _held_beside(self) -> None:
        """Recount what the device holds beside its tensors (hold ``_mem_lock``): a
        strict virtual device's graph pool (``VirtualDevice.capture``). None here."""

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
        if not self._made:   # nothing made by work is counted (a GPU, an InlineDevice)
            return
        with self._mem_lock:
            for t in pytree.tree_leaves(values):
                if isinstance(t, torch.Tensor):
                    self._recount(storage_key(t), "activations", only="workspace")
            for key in made if saved else ():
                self._recount(key, "saved", only="workspace")

    def _allocate(self, nbytes: int, kind: str, owner: str,
                  make: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Reserve ``nbytes`` (or raise DeviceMemoryError, changing nothing), then ``make()``."""
        if kind not in KINDS:   # (``_check_kind``, inline: a transfer's path)
            _check_kind(kind)
        with self._mem_lock:
            if self._made:
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
            # counted here, as ``kind``, not as what the work made (``host_allocations``)
            was, _work.paused = _work.paused, True
            try:
                tensor = make()
            finally:
                _work.paused = was
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


class _Work(threading.local):
    """The work item a VirtualDevice stream thread is running: its device's ``token``,
    and the copies it queued (``semantics="cuda"``), performed when the item's own code
    has returned, before its event completes: where the stream reaches them. ``kind``
    and ``paused`` steer the counting of what it allocates (``_Counting`` in
    ``fxpipe.runtime.devices.emulator_threads``); ``made`` is what :meth:`Device.keep` recounts."""

    token: object | None = None
    stream: str | None = None
    copies: list[Callable[[], Any]] | None = None
    owner: str = "work"
    kind: str = "workspace"
    paused: bool = False
    made: list[int]     # storages this thread's work counted since the last ``keep``
    counting: Any = None   # a weakref to the VirtualDevice counting its work, if any
    scope: WorkingSet | None = None   # a capture measuring what its run allocates
    # on a strict cuda-sim device: the last work of each other stream when this item was
    # submitted (what a capture inside it waits for: ``VirtualDevice.drain_for_capture``)
    before: tuple = ()

    def __init__(self) -> None:
        self.made = []


class WorkingSet:
    """What the work of one thread allocates in a block (a device graph's capture on a
    strict virtual device): the storages it made, and the most of them alive at once."""

    __slots__ = ("made", "peak", "_was")

    def __init__(self) -> None:
        self.made: list[tuple[StorageWeakRef, int]] = []
        self.peak = 0

    def live(self) -> int:
        """Bytes of the storages made in the block and still alive."""
        return sum(n for ref, n in self.made if not ref.expired())

    def __enter__(self) -> WorkingSet:
        self._was, _work.scope = _work.scope, self
        return self

    def __exit__(self, *exc: object) -> None:
        _work.scope = self._was


_work = _Work()


class host_allocations:   # noqa: N801 — a context used as a function
    """Allocations made in the block are host memory, not the device's whose work runs
    them (host copies, the flat gradient buffer made on first use, counted transfers).
    A class, not a generator: every counted transfer enters it."""

    __slots__ = ("was",)

    def __enter__(self) -> None:
        self.was, _work.paused = _work.paused, True

    def __exit__(self, *exc: object) -> None:
        _work.paused = self.was
