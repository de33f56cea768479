"""One GPU as a device: :class:`CudaDevice`, a ``torch.cuda.Stream`` per stream and
``torch.cuda.Event`` between them, and the CUDA events the host may wait on without
spinning (``_host_waitable``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from fxpipe.errors import DeviceMemoryError
from fxpipe.runtime.devices import pinned
from fxpipe.runtime.devices.device import STREAMS, Device, Record, _check_submit, host_copy
from fxpipe.runtime.devices.device_graph import DeviceGraph
from fxpipe.runtime.devices.events import _FINISHED, Event
from fxpipe.runtime.devices.issue_lock import blocking


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
        self._graph_pool: Any = None   # what this device's graphs allocate in (``capture``)
        self._capture_stream: Any = None   # the stream they are captured on

    compiles_by_default = True   # stage_backend="auto" compiles what runs on a GPU

    def submit(self, stream: str, fn: Callable[..., Any], *args: Any,
               wait: Sequence[Event] = (), label: str | None = None) -> Event:
        """Queue ``fn(*args)``'s kernels on ``stream`` after ``wait``; returns their event."""
        wait = _check_submit(self, stream, wait)
        s = self.streams[stream]
        label = label if label is not None else getattr(fn, "__name__", "work")
        done = _host_waitable(enable_timing=self._recording)   # after the kernels fn queues
        result, exc = None, None
        with torch.cuda.device(self.device), torch.cuda.stream(s):
            for e in wait:
                if e._cuda_event is not None and (e._done is _FINISHED or e.done()):
                    s.wait_event(e._cuda_event)  # the GPU waits; its host part is already done
                    failed = e._exc
                else:  # a host-lane or collective event: the host waits, lock let go
                    with blocking():
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
            done.record(s)
            if start is not None:
                self._timed.append((stream, label, start, done))
        # its Python has run: nothing can wait for it on the host before it exists
        return Event.finished(label, result, exc, cuda_event=done)

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
            host_copy(out, host_tensor.detach(), stalls and host_tensor.device.type == "cpu")
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
        host_copy(out, dev_tensor.detach(), self._host_stall(out))
        if pin:   # a block dropped unread is not reused while the copy may still write it
            pinned.hold(out, current.record_event())
        return out

    def copy_into(self, host_tensor: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """On the current stream, non-blocking from pinned memory (as :meth:`to_device`)."""
        host_copy(out, host_tensor.detach(), self._host_stall(host_tensor))
        if pinned.pooled(host_tensor):   # its block is not reused before the copy is done
            pinned.hold(host_tensor, torch.cuda.current_stream(self.device).record_event())
        return out

    def drain_for_capture(self) -> None:
        """The synchronize ``torch.cuda.graph`` starts with, done first, with no capture
        lock held: another device's capture does not wait for this device's queue."""
        torch.cuda.synchronize(self.device)

    def capture(self, fn: Callable[..., Sequence[Any]], inputs: Sequence[torch.Tensor],
                name: str = "a device graph") -> CudaGraph:
        """A ``torch.cuda.CUDAGraph`` of ``fn(*inputs)``, captured on this device's one
        capture stream into its one graph pool: each capture reuses the memory the
        graphs before it let go (the caching allocator reuses a block only on the stream
        that freed it: a new side stream per capture would keep every graph's working set
        apart). torch hands streams out of a per-device pool, round robin (32 per
        priority): one capture stream per device, not one per capture, and of the high
        priority pool, so it cannot come round again as one of the device's own streams
        (default priority) or another logical device's on the same GPU."""
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
            self._capture_stream = torch.cuda.Stream(self.device, priority=-1)
        return CudaGraph(self.device, fn, inputs, name, self._graph_pool, self._capture_stream)

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


class CudaGraph(DeviceGraph):
    """``fn(*inputs)`` as a ``torch.cuda.CUDAGraph``: run once on the ``side`` stream (lazy
    initialization, cuBLAS workspaces and the first run of compiled code stay out of the
    graph; its outputs are ``first``, the capturing call's result: the capture itself
    computes nothing), then captured there in ``pool`` (shared by the device's graphs: they replay
    one at a time on its compute stream, and their outputs are cloned right after each
    replay). Capture errors are thread-local: the device's other streams go on."""

    def __init__(self, device: torch.device, fn: Callable[..., Sequence[Any]],
                 inputs: Sequence[torch.Tensor], name: str, pool: Any, side: Any):
        self.name = name
        self.inputs = tuple(inputs)
        current = torch.cuda.current_stream(device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            self.first = tuple(fn(*self.inputs))   # the warm-up: this call's result
        current.wait_stream(side)
        for t in self.first:   # made on the side stream, read on this one: not reused before
            if isinstance(t, torch.Tensor):
                t.record_stream(current)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool, stream=side,
                              capture_error_mode="thread_local"):
            self.outputs = tuple(fn(*self.inputs))
        current.wait_stream(side)

    def replay(self) -> tuple[torch.Tensor, ...]:
        self.graph.replay()
        return self.outputs


def _host_waitable(enable_timing: bool = False) -> Any:
    """A CUDA event the host may wait on: ``blocking`` (``cudaEventBlockingSync``), so
    the waiting thread sleeps; a default event's ``synchronize`` spins a core, and G issue
    threads spinning starve the one issuing."""
    return torch.cuda.Event(enable_timing=enable_timing, blocking=True)
