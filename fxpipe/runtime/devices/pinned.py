"""Page-locked (pinned) host memory at its exact size.

A GPU copies to and from page-locked host memory without the issuing thread waiting
(``copy_(..., non_blocking=True)`` queues a DMA); from pageable memory the driver stages
the data through a buffer of its own first, so the issuing thread blocks until the copy
is done. torch's caching host allocator (``torch.empty(..., pin_memory=True)``) rounds
each request up to a power of two and keeps its blocks: an 8B-parameter fp32 flat buffer
(32.1 GB) would pin 64 GiB. fxpipe pins its own long-lived host memory here instead, at
its size rounded up to a page only:

- on CUDA (``emulate=False``): page-aligned memory registered with
  ``cudaHostRegister`` (portable: every GPU copies from it asynchronously), unregistered
  when its storage is freed;
- emulated (``emulate=True``: no CUDA call, for ``VirtualDevice(semantics="cuda")`` on a
  CPU-only host): the same allocation, recorded as page-locked, so the emulator can tell
  which copies a GPU would have made without blocking (``Device.host_stalls``).

:func:`is_pinned` is True for memory from :func:`empty` (real or emulated) and for
memory torch pinned. An :class:`Account` sums the bytes pinned for one owner (a model's
host parameters, a pipe's staging), as reserved: each allocation rounded up to a page.
:class:`Staging` is a pipe's reusable page-locked block for each call's inputs, labels
and output gradients.

File-backed tensors (read-only memory maps of a checkpoint, ``fxpipe.runtime.host.weights``)
are not copied into page-locked memory: :func:`register_window` registers the window of a
map an upload reads for DMA where the platform allows (``cudaHostRegister`` with the
read-only flag), up to :func:`file_pin_budget` in all; else their uploads go through a
:class:`Ring`, a bounded set of page-locked blocks reused once the copies out of them have
completed.

>>> import torch
>>> from fxpipe.runtime.devices import pinned
>>> account = pinned.Account()
>>> t = pinned.empty(1000, torch.float32, emulate=True, account=account)  # 4000 B
>>> t.shape, t.dtype, pinned.is_pinned(t), pinned.is_pinned(torch.empty(1000))
(torch.Size([1000]), torch.float32, True, False)
>>> account.nbytes == pinned.PAGE    # rounded up to one page, not to a power of two
True
>>> pinned.is_pinned(t[10:20])       # a view of it too
True
>>> del t                            # freed with its storage (and unregistered on CUDA)
>>> account.nbytes
0
"""

from __future__ import annotations

import math
import mmap
import os
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from fxpipe.runtime.devices.issue_lock import blocking

PAGE = mmap.PAGESIZE
"""The host's page size: what every allocation is rounded up to (and aligned at)."""
_ALIGN = 64          # each tensor of a staging block starts on a 64-byte boundary
_HOST_REGISTER_PORTABLE = 1   # cudaHostRegisterPortable: pinned for every CUDA context

# start (its storage's data_ptr) -> nbytes of each allocation: the page-locked memory
# fxpipe made and has not freed (dict operations are atomic: a finalizer may run at
# any allocation, on any thread)
_registry: dict[int, int] = {}

# How many holders a storage has (private torch API, as in ``devices``): without it a
# staging block is never reused.
_storage_use_count = getattr(torch._C, "_storage_Use_Count", None)


class Account:
    """The page-locked bytes fxpipe reserved for one owner (live allocations of
    :func:`empty` given this account, each rounded up to a page). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._nbytes = 0

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def _add(self, n: int) -> None:
        with self._lock:
            self._nbytes += n

    def __repr__(self) -> str:
        return f"Account({self._nbytes} B pinned)"


def reserved(nbytes: int) -> int:
    """What :func:`empty` pins for ``nbytes``: rounded up to a whole page."""
    return -(-nbytes // PAGE) * PAGE


def empty(numel: int, dtype: torch.dtype, *, emulate: bool,
          account: Account | None = None, path: str | None = None) -> torch.Tensor:
    """A new 1-D host tensor of ``numel`` elements in page-locked memory of exactly its
    size rounded up to a page (uninitialized). ``emulate``: record it as page-locked
    without any CUDA call; else register it with CUDA (needs a CUDA build and a GPU;
    raises ``RuntimeError`` when registration fails, e.g. over the locked-memory limit).
    ``account``: counts the reserved bytes until the memory is freed. ``path``: that
    file's memory, which other processes map too (:func:`shared`)."""
    if not isinstance(numel, int) or numel < 0:
        raise ValueError(f"numel must be an int >= 0, got {numel!r}")
    nbytes = numel * dtype.itemsize
    if nbytes == 0:
        return torch.empty(numel, dtype=dtype)
    if not emulate and not torch.cuda.is_available():
        raise RuntimeError(
            "pinned.empty(emulate=False) registers host memory with CUDA, which is not "
            f"available (torch {torch.__version__}); pass emulate=True (no GPU copies it) or "
            "compile with pin_memory=False")
    size = reserved(nbytes)
    # page-aligned, and the tensor's storage is exactly the registered pages (torch's
    # ``Tensor.is_pinned`` asks CUDA about the storage's first byte)
    pages = _map(size, path)
    block = torch.frombuffer(pages, dtype=torch.uint8)
    start = block.data_ptr()
    if not emulate:
        _cuda_register(start, size)
    storage = block.untyped_storage()
    _registry[start] = size
    if account is not None:
        account._add(size)
    # runs when the storage is freed (its last tensor gone); it holds the map, so the
    # pages are unregistered before they are unmapped. Not at interpreter exit (the
    # process's memory goes with it)
    weakref.finalize(storage, _release, start, size, not emulate, account, pages).atexit = False
    del storage, pages
    return block[:nbytes].view(dtype)


def _map(size: int, path: str | None) -> mmap.mmap:
    """``size`` bytes of anonymous memory, or of the file ``path`` (made or grown if
    need be: the memory of every process that maps it)."""
    if path is None:
        return mmap.mmap(-1, size)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.ftruncate(fd, max(size, os.fstat(fd).st_size))
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


def shared(path: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A 1-D pageable host tensor of ``numel`` elements in the file ``path`` (``_map``)."""
    nbytes = numel * dtype.itemsize
    if nbytes == 0:
        return torch.empty(numel, dtype=dtype)
    pages = _map(reserved(nbytes), path)
    block = torch.frombuffer(pages, dtype=torch.uint8)
    # the map is held until the storage goes (then unmapped once nothing else holds it)
    weakref.finalize(block.untyped_storage(), _release, -1, 0, False, None, pages).atexit = False
    return block[:nbytes].view(dtype)


def is_pinned(t: torch.Tensor) -> bool:
    """Whether a GPU copies to or from ``t``'s memory without blocking the issuing thread:
    memory from :func:`empty` (registered or emulated), or memory torch pinned."""
    if t.device.type != "cpu" or t.layout != torch.strided or t.numel() == 0:
        return False
    if t.untyped_storage().data_ptr() in _registry:   # as torch asks: the storage's start
        return True
    ptr = t.data_ptr()
    if any(start <= ptr < start + size for start, (size, _, _) in list(_files.items())):
        return True
    return _cuda_available() and t.is_pinned()


# windows of file maps registered for DMA (``register_window``):
# start -> (size, account, whether CUDA registered it: not when emulated)
_files: dict[int, tuple[int, "Account | None", bool]] = {}
_files_lock = threading.Lock()
_HOST_REGISTER_READ_ONLY = 8  # cudaHostRegisterReadOnly
FILE_WINDOW = 1 << 30
"""A file map is registered for DMA in windows of this many bytes (from the map's start),
each when an upload first reads it: only what a run reads is page-locked, never a whole
shard at once."""


def file_pin_budget() -> int:
    """The most bytes of file maps registered at once, in the process:
    ``FXPIPE_FILE_PIN_BYTES`` if set, else a quarter of the host's physical memory (the
    rest stays the page cache's, which holds a frozen base between steps)."""
    env = os.environ.get("FXPIPE_FILE_PIN_BYTES")
    if env:
        return int(env)
    return os.sysconf("SC_PHYS_PAGES") * PAGE // 4


def register_window(base: int, size: int, ptr: int, nbytes: int, *, emulate: bool,
                    account: Account | None = None) -> bool:
    """Register for DMA the window (:data:`FILE_WINDOW`) of the read-only file map at
    ``base`` (``size`` bytes) that holds ``[ptr, ptr + nbytes)``, so an upload reads its
    pages (the page cache's) without a copy into page-locked memory. Returns whether that
    range is registered; not when it crosses a window's end, when the windows registered
    would pass :func:`file_pin_budget`, nor where CUDA refuses (a driver without
    read-only registration): the caller then goes through a :class:`Ring`. Emulated
    (``emulate``: no CUDA call) it is recorded alike, so the emulator sees which uploads
    a GPU makes without blocking. A window's bytes count in ``account`` (the pipe's
    ``host_pinned_bytes``) until the map is gone (:func:`forget_file`)."""
    start = base + (ptr - base) // FILE_WINDOW * FILE_WINDOW
    wsize = min(FILE_WINDOW, base + size - start)
    if ptr + nbytes > start + wsize:
        return False
    with _files_lock:
        if start in _files:
            return True
    with blocking(), _files_lock:   # pinning the pages takes a while: not under the issue lock
        if start in _files:
            return True
        if sum(n for n, _, _ in _files.values()) + wsize > file_pin_budget():
            return False
        if not emulate:
            if not _cuda_available():
                return False
            torch.cuda.init()
            rc = torch.cuda.cudart().cudaHostRegister(
                start, wsize, _HOST_REGISTER_PORTABLE | _HOST_REGISTER_READ_ONLY)
            if _error_code(rc):
                return False
        _files[start] = (wsize, account, not emulate)
    if account is not None:
        account._add(reserved(wsize))
    return True


def forget_file(base: int, size: int) -> None:
    """The file map at ``base`` is going: unregister its windows and uncount them (a
    ``weakref.finalize`` of the map, ``fxpipe.runtime.host.weights``)."""
    with _files_lock:
        gone = [(s, _files.pop(s)) for s in list(_files) if base <= s < base + size]
    for start, (wsize, account, registered) in gone:
        if account is not None:
            account._add(-reserved(wsize))
        if registered:
            try:
                torch.cuda.cudart().cudaHostUnregister(start)
            except Exception:  # noqa: BLE001 — freeing must not raise (CUDA may be shutting down)
                pass


def _release(start: int, size: int, registered: bool, account: Account | None,
             pages: mmap.mmap) -> None:
    _registry.pop(start, None)
    if account is not None:
        account._add(-size)
    if registered:
        try:
            torch.cuda.cudart().cudaHostUnregister(start)
        except Exception:  # noqa: BLE001 — freeing must not raise (CUDA may be shutting down)
            pass
    del pages   # unmapped once nothing else holds the map: after the unregister


def _cuda_register(start: int, size: int) -> None:
    # not under ``blocking()`` here: the callers let go of the issue lock where they may
    # (a pool or ring makes its blocks outside its own lock, ``_Blocks._new``)
    torch.cuda.init()
    rc = torch.cuda.cudart().cudaHostRegister(start, size, _HOST_REGISTER_PORTABLE)
    if _error_code(rc):
        raise RuntimeError(
            f"cudaHostRegister of {size} B of host memory failed (cudaError {_error_code(rc)}): "
            "the host may be out of memory or over its locked-memory limit (ulimit -l); "
            "compile with pin_memory=False to keep the host buffers pageable")


def _error_code(rc: Any) -> int:
    try:
        return int(rc)
    except (TypeError, ValueError):
        return 0 if str(rc).endswith("success") else -1


_cuda: list[bool] = []


def _cuda_available() -> bool:
    if not _cuda:
        _cuda.append(torch.cuda.is_available())
    return _cuda[0]


class Staging:
    """A pipe's page-locked staging: each call copies its tensors (user inputs, labels,
    output gradients) into one block (:meth:`stage`), so their uploads are asynchronous.

    A block is reused by a later call once nothing holds its tensors any more (the call
    that used them has ended and dropped them; a block still held, e.g. by an
    eager-style forward awaiting its backward, is left alone); at most ``keep`` blocks are
    kept. ``account`` counts the blocks alive (a block in use counts until freed).

    >>> staging = Staging(emulate=True)
    >>> x, y = staging.stage([torch.arange(6).view(2, 3), torch.ones(2)], [None, torch.float16])
    >>> x, y, is_pinned(x) and is_pinned(y)
    (tensor([[0, 1, 2],
            [3, 4, 5]]), tensor([1., 1.], dtype=torch.float16), True)
    """

    def __init__(self, *, emulate: bool, account: Account | None = None, keep: int = 2):
        self.emulate = emulate
        self.account = account if account is not None else Account()
        self.keep = keep
        self._lock = threading.Lock()
        self._blocks: list[tuple[torch.UntypedStorage, int, int]] = []  # (storage, start, nbytes)

    def stage(self, tensors: Sequence[torch.Tensor],
              dtypes: Sequence[torch.dtype | None] | None = None) -> list[torch.Tensor]:
        """Page-locked contiguous copies of ``tensors`` (in ``dtypes[i]`` where given),
        all in one block; a copy requires grad where its tensor does. A tensor on a GPU is
        copied synchronously: on its device's current stream, after the caller's kernels
        that write it, and complete when this returns."""
        dtypes = list(dtypes) if dtypes is not None else [None] * len(tensors)
        plan, total = [], 0
        for t, dtype in zip(tensors, dtypes):
            dtype = dtype or t.dtype
            total = -(-total // _ALIGN) * _ALIGN
            plan.append((t, dtype, total))
            total += t.numel() * dtype.itemsize
        if total == 0:
            return [t.detach().to(dtype, copy=True) for t, dtype, _ in plan]
        storage, start = self._take(total)
        out = []
        with torch.no_grad():
            for t, dtype, offset in plan:
                view = torch.empty(0, dtype=dtype).set_(
                    storage, (start + offset) // dtype.itemsize, t.shape)
                view.copy_(t)
                out.append(view.requires_grad_() if t.requires_grad else view)
        return out

    def _take(self, nbytes: int) -> tuple[torch.UntypedStorage, int]:
        with self._lock:
            free = [b for b in self._blocks if _unused(b[0])]
            fits = [b for b in free if b[2] >= nbytes]
            if fits:
                storage, start, _ = min(fits, key=lambda b: b[2])
                return storage, start
            gone = {id(b) for b in free}
            self._blocks = [b for b in self._blocks if id(b) not in gone]  # too small: let go
        t = empty(reserved(nbytes), torch.uint8, emulate=self.emulate, account=self.account)
        storage = t.untyped_storage()
        block = (storage, t.data_ptr() - storage.data_ptr(), t.numel())
        del t
        with self._lock:
            self._blocks.append(block)
            del self._blocks[:-self.keep]
        return block[0], block[1]

    def clear(self) -> None:
        """Let the blocks go (each is freed once nothing holds it)."""
        with self._lock:
            self._blocks.clear()


def _unused(storage: torch.UntypedStorage) -> bool:
    return _storage_use_count is not None and _storage_use_count(storage._cdata) == 1


class _Blocks:
    """Page-locked blocks, each reused once nothing holds it (a view of it taken by
    :meth:`_view` holds it) and the CUDA event given to :meth:`hold`, if any, has
    completed. Thread-safe under ``_lock``."""

    def __init__(self, *, emulate: bool, account: Account | None = None):
        self.emulate = emulate
        self.account = account if account is not None else Account()
        self._lock = threading.Lock()
        # storage's data_ptr -> [storage, start offset, nbytes, event or None], the blocks
        # taken last at the end
        self._blocks: dict[int, list] = {}

    @property
    def nbytes(self) -> int:
        """Page-locked bytes held now, in use or free."""
        return sum(b[2] for b in list(self._blocks.values()))

    def owns(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s memory is one of these blocks."""
        return t.untyped_storage().data_ptr() in self._blocks

    def hold(self, view: torch.Tensor, event: Any) -> None:
        """The block holding ``view`` is read by a copy that completes with ``event`` (a
        CUDA event): it is not reused before."""
        with self._lock:
            block = self._blocks.get(view.untyped_storage().data_ptr())
            if block is not None:
                block[3] = event

    def clear(self) -> None:
        """Let the blocks go (each is freed once nothing holds it)."""
        with self._lock:
            self._blocks.clear()

    @staticmethod
    def _is_free(b: list) -> bool:
        return _unused(b[0]) and (b[3] is None or b[3].query())

    def _free(self) -> list[list]:
        return [b for b in self._blocks.values() if self._is_free(b)]

    def _drop(self, block: list) -> None:
        del self._blocks[block[0].data_ptr()]

    def _new(self, nbytes: int) -> list:
        """A new block of ``nbytes``, not in the set yet: made outside ``_lock`` and with
        the issue lock let go (registering pages with CUDA takes about a millisecond per
        few MB: no other device's issue waits for it). :meth:`_add` puts it in."""
        with blocking():
            t = empty(nbytes, torch.uint8, emulate=self.emulate, account=self.account)
        storage = t.untyped_storage()
        return [storage, t.data_ptr() - storage.data_ptr(), nbytes, None]

    def _add(self, block: list) -> None:
        """Put a block :meth:`_new` made in the set (hold ``_lock``)."""
        self._blocks[block[0].data_ptr()] = block

    def _view(self, block: list, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
        """A view of ``block`` (taken: it holds the block) of ``shape`` ``dtype``s; the
        block moves to the end, so the free ones are found first."""
        block[3] = None
        ptr = block[0].data_ptr()
        self._blocks[ptr] = self._blocks.pop(ptr)
        return torch.empty(0, dtype=dtype).set_(block[0], block[1] // dtype.itemsize, tuple(shape))


class Ring(_Blocks):
    """A bounded set of page-locked blocks that uploads of file-backed tensors go through
    when their pages cannot be registered (:func:`register_window`): :meth:`stage` copies a
    tensor (converting its dtype) into a free block; a block is free again once nothing
    holds it (the copy out of it has taken its source) and the CUDA event given to
    :meth:`hold`, if any, has completed. At most ``capacity`` bytes (each block rounded
    up to a page); :meth:`stage` returns None when the tensor does not fit (the caller
    uploads from the map itself: pageable, a host stall on a GPU), never waits.

    >>> ring = Ring(capacity=2 * PAGE, emulate=True)
    >>> a = ring.stage(torch.ones(10), torch.float16)
    >>> a, is_pinned(a)
    (tensor([1., 1., 1., 1., 1., 1., 1., 1., 1., 1.], dtype=torch.float16), True)
    >>> ring.stage(torch.ones(3 * PAGE), torch.float32) is None   # over the capacity
    True
    """

    def __init__(self, *, capacity: int, emulate: bool, account: Account | None = None):
        super().__init__(emulate=emulate, account=account)
        self.capacity = capacity
        self._making = 0   # bytes of blocks being made (outside the lock)

    def stage(self, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
        """A page-locked copy of ``t`` in ``dtype`` (flat), or None (class docstring)."""
        nbytes = reserved(t.numel() * dtype.itemsize)
        if nbytes == 0 or nbytes > self.capacity:
            return None
        view = self._take(nbytes, dtype, t.numel())
        if view is None:
            return None
        with torch.no_grad(), blocking():   # a host copy: not under the issue lock
            view.copy_(t.reshape(-1))
        return view

    def _take(self, nbytes: int, dtype: torch.dtype, numel: int) -> torch.Tensor | None:
        with self._lock:
            free = self._free()
            fits = [b for b in free if b[2] >= nbytes]
            if fits:
                return self._view(min(fits, key=lambda b: b[2]), dtype, (numel,))
            used = self.nbytes + self._making
            while free and used + nbytes > self.capacity:   # too small: let one go
                gone = free.pop()
                self._drop(gone)
                used -= gone[2]
            if used + nbytes > self.capacity:
                return None
            self._making += nbytes   # counted against the capacity while it is made
        try:
            block = self._new(nbytes)
        finally:
            with self._lock:
                self._making -= nbytes
        with self._lock:
            self._add(block)
            return self._view(block, dtype, (numel,))


def size_class(nbytes: int) -> int:
    """The bytes of the :class:`Pool` block a request of ``nbytes`` takes: whole pages up
    to 8, then four classes per power of two (1, 1.25, 1.5 and 1.75 x 2**k pages), so at
    most a quarter over the request (torch's host allocator: up to twice), and requests
    of nearby sizes share one class and so reuse each other's blocks.

    >>> [size_class(n * PAGE) // PAGE for n in (1, 8, 9, 11, 16, 17, 3001)]
    [1, 8, 10, 12, 16, 20, 3072]
    """
    pages = -(-nbytes // PAGE)
    if pages <= 8:
        return pages * PAGE
    step = 1 << (pages.bit_length() - 3)
    return -(-pages // step) * step * PAGE


class Pool(_Blocks):
    """Page-locked host tensors in blocks of their size class (:func:`size_class`: at most
    a quarter over a page's rounding), reused: what a GPU offloads activations into
    (``Device.to_host``). torch's caching host allocator would round each up to a power
    of two and keep it: 2.3 GB of a 278K-token Llama-8B boundary activation pinned 4 GiB,
    33 of them more than a 128 GiB host.

    :meth:`empty` takes the smallest free block that holds the request; only when none
    does, it registers a new one (with the issue lock let go: ``cudaHostRegister`` takes
    about a millisecond per few MB), first letting the least recently used free blocks go
    until what the pool holds, the new block included, is at most its high-water mark
    (the most its tensors ever held at once). So a run repeating its steps reuses every
    block from its second step on, and one whose lengths vary (each step's activations
    larger or smaller) registers nothing once its longest step has run: a shorter step's
    tensors take the longer one's blocks. A pool that reused only blocks within a quarter
    of a request's size let them go and registered anew at every change of length. A
    block read by an asynchronous copy is reused only once the copy's event completed
    (:meth:`hold`, :func:`hold`).

    >>> pool = Pool(emulate=True)
    >>> a = pool.empty((4, 1000), torch.float32)     # 16000 B: four pages
    >>> a.shape, is_pinned(a), pool.nbytes == 4 * PAGE
    (torch.Size([4, 1000]), True, True)
    >>> ptr = a.data_ptr(); del a
    >>> pool.empty((16000,), torch.uint8).data_ptr() == ptr    # the same block, reused
    True
    """

    def __init__(self, *, emulate: bool, account: Account | None = None):
        super().__init__(emulate=emulate, account=account)
        self.high_water = 0     # the most bytes its tensors held at once
        self.registered = 0     # blocks made (each a registration on CUDA)

    def empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialized page-locked host tensor of ``shape`` and ``dtype``."""
        numel = math.prod(shape)
        if numel == 0:
            return torch.empty(tuple(shape), dtype=dtype)
        nbytes = size_class(numel * dtype.itemsize)
        with self._lock:
            free = self._free()   # least recently taken first
            fits = [b for b in free if b[2] >= nbytes]
            if fits:
                return self._view(min(fits, key=lambda b: b[2]), dtype, shape)
            held = self.nbytes
            self.high_water = max(self.high_water, held - sum(b[2] for b in free) + nbytes)
            while free and held + nbytes > self.high_water:
                gone = free.pop(0)
                self._drop(gone)
                held -= gone[2]
        block = self._new(nbytes)
        with self._lock:
            self._add(block)
            self.registered += 1
            return self._view(block, dtype, shape)

    def trim(self) -> None:
        """Let the free blocks go; the high-water mark restarts at what is in use."""
        with self._lock:
            for block in self._free():
                self._drop(block)
            self.high_water = self.nbytes


_pools: dict[bool, Pool] = {}
_pools_lock = threading.Lock()


def host_pool(*, emulate: bool) -> Pool:
    """The process's :class:`Pool` (one emulated, one registered with CUDA): every
    device offloads into it, and another device may upload from it."""
    with _pools_lock:
        if emulate not in _pools:
            _pools[emulate] = Pool(emulate=emulate)
        return _pools[emulate]


def pooled(t: torch.Tensor) -> bool:
    """Whether ``t``'s memory is a :class:`Pool`'s block."""
    return t.device.type == "cpu" and any(pool.owns(t) for pool in list(_pools.values()))


def trim() -> None:
    """Let every pool's free blocks go (``PipelineModule.close``): what the pipes still
    hold stays."""
    for pool in list(_pools.values()):
        pool.trim()


def hold(t: torch.Tensor, event: Any) -> None:
    """``t`` is read by a copy completing with ``event`` (a CUDA event): if its memory is
    a :class:`Pool`'s block, the block is not reused before."""
    for pool in list(_pools.values()):
        pool.hold(t, event)
