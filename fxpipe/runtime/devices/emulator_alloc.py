"""The emulated caching allocator of a :class:`~fxpipe.runtime.devices.emulator.VirtualDevice`
(``_StorageCache``): freed device memory kept for reuse per stream, held back for the
other streams using it, as torch's CUDA caching allocator does.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection, Sequence

import torch

from fxpipe.runtime.devices.events import Event

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
