"""Host parameters: the model holds them once, in one flat buffer per dtype.

:class:`HostParams` (one per model) moves the storage of every parameter and buffer a
pipeline uses into one contiguous host buffer per dtype (parameters and buffers apart,
and the buffers ``param_dtype`` converts apart from those it does not), laid out in layer
order (the tensors several layers use first), and makes the model's tensors views of it,
as FSDP's flat parameter does: ``model.parameters()``, ``state_dict()``,
``load_state_dict()`` and any ``torch.optim`` optimizer see the same tensors as before,
and every stage of every plan is one or a few contiguous slices of that buffer, uploaded
without a copy on the host. ``p.data = t`` by the user breaks the alias; ``refresh``
(before each call) copies the new values in and re-aliases. Gradients have one flat
buffer too (per dtype, the trainable parameters only), made with the store of a training
call (:meth:`HostParams.make_grads`, on the caller's thread): a gradient download writes
into it directly, and the parameters' ``.grad`` become views of it at the commit.

Pinning (``pin=True``; ``HostParams.of`` defaults to it when CUDA is available): every
buffer here is page-locked at its exact size, rounded up to a page
(``fxpipe.runtime.devices.pinned``; not torch's caching host allocator, which rounds each
request up to a power of two): the flat buffers, their upload copies, the flat gradient
buffers, and a staged copy of each tensor that could not move into a flat buffer, so
every upload and gradient download is asynchronous on a GPU. ``emulate=True`` records
the memory as page-locked without CUDA (virtual devices with ``semantics="cuda"``).
``pinned_bytes``: what that reserves.

File-backed tensors (frozen parameters ``compile(..., weights=PATH)`` bound to read-only
memory maps of a checkpoint, ``fxpipe.runtime.host.weights``) stay where they are: no flat
buffer, no page-locked copy. An upload reads the map (the page cache), converting to
``param_dtype`` on the way; when pinning, from the map itself where the window of it an
upload reads could be registered for DMA (``pinned.register_window``: within
``pinned.file_pin_budget()``, counted in ``host_pinned_bytes``), else through a bounded
page-locked ``pinned.Ring`` (at most twice the largest stage's file-backed upload bytes).

Two things keep one more copy, in the same layout: ``param_dtype`` (mixed precision,
devices compute in bf16: the bf16 copy of the floating parameters they upload, and of
the buffers the model loaded in bf16 holds in bf16, ``passes.buffer_dtypes``) and an
asynchronous optimizer (``fxpipe.optim`` ``mode="async"``: its update changes the
parameters while the devices still read the previous ones).
``fxpipe.runtime.host.param_store.ParamStore`` is one Executable's view of it: per stage, the
slices it uploads.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import torch

from fxpipe.passes.layer_graph import in_param_dtype
from fxpipe.runtime.devices import pinned
from fxpipe.runtime.devices.device import host_allocations
from fxpipe.runtime.devices.issue_lock import blocking
from fxpipe.runtime.host.weights import file_backed

_ALIGN_BYTES = 64  # each tensor starts on a 64-byte boundary inside a flat buffer
_BY_MODEL: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

# Buffers whose contents a failed call may leave changed (a generation's KV cache, which
# the next generate resets): the call's Refresh does not save them, and a stage's
# writeback of one copies it to the host as the stage runs (nothing kept for the Commit).
_SCRATCH: dict[int, weakref.ref] = {}   # id -> the tensor (a WeakSet would compare values)


def mark_scratch(*tensors: torch.Tensor) -> None:
    """Mark buffers as scratch (see ``_SCRATCH``)."""
    for t in tensors:
        _SCRATCH[id(t)] = weakref.ref(t, lambda _, key=id(t): _SCRATCH.pop(key, None))


def is_scratch(t: torch.Tensor) -> bool:
    ref = _SCRATCH.get(id(t))
    return ref is not None and ref() is t


def _align(n: int, dtype: torch.dtype) -> int:
    a = max(1, _ALIGN_BYTES // dtype.itemsize)
    return -(-n // a) * a


@dataclass(eq=False)
class _Slot:
    """Where one of the model's tensors lives: ``flat[offset:offset + numel]`` of its dtype's
    buffer ``region`` (``region is None``: not moved, its own storage; see ``_adoptable``)."""

    tensor: torch.Tensor
    names: list[str]
    is_buffer: bool
    shape: torch.Size = torch.Size()      # as adopted (the model's tensor may be replaced)
    region: int | None = None
    offset: int = 0
    grad: tuple[int, int] | None = None   # (grad region, offset) once it has a grad slot

    @property
    def numel(self) -> int:
        return self.shape.numel()


class HostParams:
    """One model's parameters and buffers in flat host buffers (module docstring). Get
    it with :meth:`of`: one per model, shared by every pipe compiled from it."""

    def __init__(self, *, pin: bool, emulate: bool = False):
        self.pin = pin
        self.emulate = emulate             # pinned without CUDA (``pinned.empty``)
        self.account = pinned.Account()    # the page-locked bytes of the buffers below
        self.lock = threading.RLock()
        self.slots: dict[int, _Slot] = {}              # id(tensor) -> slot
        self.flats: list[torch.Tensor] = []            # regions (each one dtype)
        self.grad_flats: list[torch.Tensor] = []
        self._copies: dict[tuple[int, torch.dtype], torch.Tensor] = {}  # (region, dtype)
        self._copied: dict[tuple[int, torch.dtype], tuple[int, int]] = {}  # (slot, dtype) -> stamp
        # id(param) -> its .grad view handed out: under self.lock (the commit on the host
        # thread writes it, downloads on the devices' threads read it)
        self._exposed: dict[int, weakref.ref] = {}
        # (id(slot), upload dtype) -> (stamp, page-locked copy) of a tensor not moved
        self._staged: dict[tuple[int, torch.dtype], tuple[tuple, torch.Tensor]] = {}
        self.ring: pinned.Ring | None = None   # file-backed uploads when pinning (``file_source``)
        # data_parallel="zero3": the ranks' shared parameter regions, region -> file path,
        # and whether this process fills a new region (else it maps what another filled)
        self.shared: Callable[[int], str] | None = None
        self.fill_shared = True
        self.shared_regions: set[int] = set()   # the regions in such files
        # shard_optimizer with param_dtype: (rank, world, masters, ...) of the first pipe
        # that sharded the fp32 masters (``runtime.host.masters``), which its later pipes keep
        self.masters: tuple | None = None

    @classmethod
    def of(cls, model: torch.nn.Module, *, pin: bool | None = None,
           emulate: bool = False) -> HostParams:
        """The model's HostParams (made on first use, which decides ``pin`` and
        ``emulate``; ``pin`` defaults to ``torch.cuda.is_available()``)."""
        host = _BY_MODEL.get(model)
        if host is None:
            host = cls(pin=torch.cuda.is_available() if pin is None else pin, emulate=emulate)
            _BY_MODEL[model] = host
        return host

    @classmethod
    def share(cls, module: torch.nn.Module, owner: torch.nn.Module) -> HostParams:
        """Give ``module`` (built around ``owner``'s tensors, e.g. generation's step
        module) ``owner``'s HostParams, which must exist: one host copy of the shared
        tensors, whichever pipe uploads them."""
        host = _BY_MODEL[owner]
        _BY_MODEL[module] = host
        return host

    @property
    def pinned_bytes(self) -> int:
        """Page-locked bytes reserved for these buffers (each rounded up to a page)."""
        return self.account.nbytes

    def _empty(self, numel: int, dtype: torch.dtype, path: str | None = None) -> torch.Tensor:
        """A new host buffer: page-locked at its exact size if pinning; ``path``: in that
        file, which the other ranks map too (:attr:`shared`)."""
        if self.pin:
            return pinned.empty(numel, dtype, emulate=self.emulate, account=self.account,
                                path=path)
        return torch.empty(numel, dtype=dtype) if path is None else \
            pinned.shared(path, numel, dtype)

    # -- adopting tensors -----------------------------------------------------------------
    def adopt(self, groups: Sequence[Sequence[tuple[str, torch.Tensor, bool]]]) -> None:
        """Move the tensors of ``groups`` (per layer, in layer order: ``(fqn, tensor,
        is_buffer)``) into new flat buffers, the tensors used by several layers first;
        tensors already adopted are left where they are."""
        with self.lock, torch.no_grad():
            uses: dict[int, int] = {}
            for group in groups:
                for key in {id(t) for _, t, _ in group}:
                    uses[key] = uses.get(key, 0) + 1
            order: list[tuple[str, torch.Tensor, bool]] = []
            seen: set[int] = set()
            for shared_first in (True, False):
                for group in groups:
                    for fqn, t, is_buffer in group:
                        if (uses[id(t)] > 1) == shared_first and id(t) not in seen:
                            seen.add(id(t))
                            order.append((fqn, t, is_buffer))
            for group in groups:  # every name of a tensor (tied names, other layers)
                for fqn, t, is_buffer in group:
                    slot = self.slots.get(id(t))
                    if slot is not None and fqn not in slot.names:
                        slot.names.append(fqn)
            # one region per kind: dtype, parameters or buffers, converted by param_dtype
            new: dict[tuple[torch.dtype, bool, bool], list[_Slot]] = {}
            for fqn, t, is_buffer in order:
                if id(t) in self.slots:
                    continue
                _check_master(fqn, t)
                if file_backed(t) is not None:
                    _check_frozen_tensor(t, fqn)
                slot = _Slot(t, [fqn], is_buffer, t.shape)
                self.slots[id(t)] = slot
                if _adoptable(t, self.slots.values()):
                    new.setdefault((t.dtype, is_buffer, _cast(slot)), []).append(slot)
            for (dtype, is_buffer, _), slots in new.items():
                size = 0
                for slot in slots:
                    slot.offset = _align(size, dtype)
                    size = slot.offset + slot.numel
                region = len(self.flats)
                shared = self.shared is not None and not is_buffer
                flat = self._empty(size, dtype, self.shared(region) if shared else None)
                self.flats.append(flat)
                if shared:
                    self.shared_regions.add(region)
                for slot in slots:
                    view = flat[slot.offset:slot.offset + slot.numel].view(slot.tensor.shape)
                    if self.fill_shared or not shared:
                        view.copy_(slot.tensor)
                    slot.region = region
                    slot.tensor.data = view

    def slot(self, t: torch.Tensor) -> _Slot:
        return self.slots[id(t)]

    def address(self, slot: _Slot) -> int:
        """Where ``slot``'s memory starts in its flat buffer (``view(slot).data_ptr()``
        without making the view)."""
        flat = self.flats[slot.region]
        return flat.data_ptr() + slot.offset * flat.element_size()

    def view(self, slot: _Slot) -> torch.Tensor:
        """The flat-buffer memory of ``slot`` (its own tensor when not moved)."""
        if slot.region is None:
            return slot.tensor.detach()
        flat = self.flats[slot.region]
        return flat[slot.offset:slot.offset + slot.shape.numel()].view(slot.shape)

    # -- before each call -----------------------------------------------------------------
    def refresh(self, upload_dtype: torch.dtype | None = None, snapshot: bool = False,
                only: Collection[torch.Tensor] | None = None) -> None:
        """Before a call: re-alias tensors whose ``.data`` someone replaced (their new
        values copied in), and bring the upload copies up to date (``upload_dtype``: the
        mixed-precision copy; ``snapshot``: a copy in the masters' own dtype, for an
        asynchronous optimizer). ``only``: those tensors' copies (buffers a collective
        wrote during the call, while an asynchronous update may be writing parameters
        whose snapshot the call's uploads read)."""
        keep = None if only is None else {id(t) for t in only}
        with self.lock, torch.no_grad():
            slots = [slot for slot in self.slots.values()
                     if keep is None or id(slot.tensor) in keep]
            for slot in slots:
                if slot.region is None:
                    continue
                view = self.view(slot)
                t = slot.tensor
                if t.data_ptr() != view.data_ptr() or t.stride() != view.stride():
                    if t.shape != view.shape or t.dtype != view.dtype:
                        raise ValueError(
                            f"{slot.names[0]!r} was replaced by a tensor of {tuple(t.shape)} "
                            f"{t.dtype}; the pipeline was compiled for {tuple(view.shape)} "
                            f"{view.dtype}: compile again for the new model")
                    view.copy_(t.data)
                    t.data = view
            for slot in slots:
                if slot.region is None:
                    if file_backed(slot.tensor) is not None:
                        _check_frozen_tensor(slot.tensor, slot.names[0])
                    elif self.pin:
                        self._stage(slot, _upload_dtype(slot, upload_dtype))
                    continue
                flat = self.flats[slot.region]
                dtype = _upload_dtype(slot, upload_dtype)
                if dtype == flat.dtype and not snapshot:
                    continue
                key = (slot.region, dtype)
                if key not in self._copies:
                    self._copies[key] = self._empty(flat.numel(), dtype)
                # an in-place update (optimizer step, load_state_dict, a buffer written
                # back) bumps the tensor's version; an unchanged one needs no copy
                stamp = (slot.tensor._version, slot.tensor.data_ptr())
                if self._copied.get((id(slot), dtype)) != stamp:
                    copy = self._copies[key][slot.offset:slot.offset + slot.numel]
                    copy.copy_(self.view(slot).reshape(-1))
                    self._copied[(id(slot), dtype)] = stamp

    def _stage(self, slot: _Slot, dtype: torch.dtype) -> None:
        """Bring the page-locked copy of ``slot`` (a tensor not moved into a flat buffer),
        in ``dtype``, up to date: made once, copied again when the tensor changed."""
        t = slot.tensor
        if t.numel() == 0:
            return
        key = (id(slot), dtype)
        stamp = _stamp(t)
        old = self._staged.get(key)
        if old is not None and old[0] == stamp:
            return
        copy = old[1] if old is not None and old[1].numel() == t.numel() else \
            self._empty(t.numel(), dtype)
        copy.copy_(t.detach().reshape(-1))
        self._staged[key] = (stamp, copy)

    def staged(self, slot: _Slot, dtype: torch.dtype, snapshot: bool) -> torch.Tensor | None:
        """The page-locked copy of ``slot`` (not moved into a flat buffer) an upload reads:
        made by the last :meth:`refresh`, and still the tensor's values unless
        ``snapshot`` (then it is the call's snapshot); else None."""
        old = self._staged.get((id(slot), dtype))
        if old is None or (not snapshot and old[0] != _stamp(slot.tensor)):
            return None
        return old[1]

    def file_source(self, slot: _Slot, dtype: torch.dtype,
                    part: tuple[int, int] | None = None) -> torch.Tensor:
        """What an upload of the file-backed ``slot`` reads, in ``dtype`` (flat): the map
        itself (pageable when not pinning; registered for DMA where allowed), else a
        block of the ring (held until the copy out of it completes: ``ParamStore.upload``),
        else, the ring being full, the map (a pageable copy). ``part``: elements
        ``[lo, hi)`` only (``data_parallel="zero3"``: this rank's part)."""
        t = slot.tensor.detach().reshape(-1)
        if part is not None:
            t = t[part[0]:part[1]]
        if not self.pin:
            return converted(t, dtype)
        fmap = file_backed(slot.tensor)
        if dtype == t.dtype and pinned.register_window(
                fmap.base, fmap.size, t.data_ptr(), t.numel() * t.element_size(),
                emulate=self.emulate, account=self.account):
            return t
        staged = self.ring.stage(t, dtype) if self.ring is not None else None
        return staged if staged is not None else converted(t, dtype)

    def size_ring(self, nbytes: int) -> None:
        """The ring holds at least ``nbytes`` (twice a stage's file-backed upload bytes)."""
        with self.lock:
            if self.ring is None:
                self.ring = pinned.Ring(capacity=nbytes, emulate=self.emulate,
                                        account=self.account)
            self.ring.capacity = max(self.ring.capacity, nbytes)

    def make_grads(self) -> None:
        """Give every trainable parameter its place in a flat gradient buffer now (a
        training call's store, on the caller's thread), not when a download first needs
        one (inside a device's work)."""
        with self.lock:
            while (want := next((s for s in self.slots.values() if s.grad is None
                                 and not s.is_buffer and s.tensor.requires_grad), None)):
                self._grad_slots(want)

    def source(self, slot: _Slot, upload_dtype: torch.dtype | None, snapshot: bool) -> torch.Tensor:
        """What an upload of ``slot``'s region reads: the flat buffer or its copy."""
        flat = self.flats[slot.region]
        dtype = _upload_dtype(slot, upload_dtype)
        if dtype == flat.dtype and not snapshot:
            return flat
        return self._copies[(slot.region, dtype)]

    # -- gradients ------------------------------------------------------------------------
    def grad_view(self, slot: _Slot) -> torch.Tensor:
        """``slot``'s memory in the flat gradient buffer (given a slot when first asked,
        with every other trainable parameter of its region still lacking one)."""
        with self.lock:
            if slot.grad is None:
                self._grad_slots(slot)
            region, offset = slot.grad
            flat = self.grad_flats[region]
            return flat[offset:offset + slot.numel].view(slot.shape)

    def _grad_slots(self, want: _Slot) -> None:
        dtype = grad_dtype(want.tensor)
        todo = [s for s in self.slots.values() if s.grad is None and not s.is_buffer
                and s.tensor.requires_grad and grad_dtype(s.tensor) == dtype]
        todo.sort(key=lambda s: (s.region is None, s.region or 0, s.offset))
        if want not in todo:
            todo.append(want)
        size, offsets = 0, []
        for s in todo:
            offsets.append(_align(size, dtype))
            size = offsets[-1] + s.numel
        region = len(self.grad_flats)
        with host_allocations():   # possibly from a device's download work: host memory
            self.grad_flats.append(self._empty(size, dtype))
        for s, off in zip(todo, offsets):
            s.grad = (region, off)

    def claim_grad(self, slot: _Slot) -> torch.Tensor | None:
        """Where a download may write ``slot``'s gradient directly: its flat gradient view,
        when its ``.grad`` is None and no earlier ``.grad`` view of that memory is still
        held by someone (else None: download to a new tensor and add it at the commit)."""
        t = slot.tensor
        if slot.is_buffer or t.grad is not None or not t.requires_grad:
            return None
        with self.lock:
            old = self._exposed.get(id(t))
        if old is not None and old() is not None:
            return None
        return self.grad_view(slot)

    def exposed(self, t: torch.Tensor, grad: torch.Tensor) -> None:
        """``grad`` (a view of the flat gradient buffer) became ``t.grad``."""
        with self.lock:
            self._exposed[id(t)] = weakref.ref(grad)


def converted(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` in ``dtype``: a conversion on the host (an upload's source not staged) blocks
    the thread, so it runs with the issue lock let go (``issue_lock.blocking``)."""
    if t.dtype == dtype:
        return t
    with blocking():
        return t.to(dtype)


def _stamp(t: torch.Tensor) -> tuple:
    """Changes when ``t``'s values may have: an in-place update bumps its version,
    ``p.data = x`` changes its memory."""
    return t._version, t.data_ptr(), t.shape


def _upload_dtype(slot: _Slot, param_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype ``slot``'s tensor has on a device: ``param_dtype`` for a floating
    parameter and a buffer marked so (mixed precision: :func:`in_param_dtype`), its own
    for the rest."""
    if param_dtype is not None and _cast(slot):
        return param_dtype
    return slot.tensor.dtype


def _cast(slot: _Slot) -> bool:
    """Whether ``param_dtype`` converts ``slot``'s tensor on its way to a device."""
    t = slot.tensor
    return t.is_floating_point() and (not slot.is_buffer or in_param_dtype(t))


def widens_exactly(src: torch.dtype, dst: torch.dtype) -> bool:
    """Whether every value of ``src`` is a value of ``dst`` (a cast from ``src`` to
    ``dst`` rounds nothing: bf16 or fp16 to fp32).

    >>> widens_exactly(torch.bfloat16, torch.float32), widens_exactly(torch.float32, torch.bfloat16)
    (True, False)
    >>> widens_exactly(torch.float16, torch.bfloat16)
    False
    """
    return src == dst or (src.is_floating_point and dst.is_floating_point
                          and torch.promote_types(src, dst) == dst)


def grad_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype of ``t``'s ``.grad`` (its ``grad_dtype`` where set)."""
    return (t.grad_dtype if t.is_leaf else None) or t.dtype


def _adoptable(t: torch.Tensor, slots: Collection[_Slot]) -> bool:
    """Whether ``t`` may move into a flat buffer: a dense contiguous tensor that owns its
    whole storage (not a view, not sharing memory with another of the model's tensors),
    and not a read-only file map (``weights.file_backed``)."""
    if not t.is_contiguous() or t.storage_offset() != 0 or t.numel() == 0:
        return False
    if file_backed(t) is not None:
        return False
    if t.untyped_storage().nbytes() != t.numel() * t.element_size():
        return False
    ptr = t.untyped_storage().data_ptr()
    return not any(s.tensor is not t and s.tensor.untyped_storage().data_ptr() == ptr
                   for s in slots)


def _check_frozen_tensor(t: torch.Tensor, fqn: str) -> None:
    if t.requires_grad:
        raise ValueError(
            f"{fqn!r} is a read-only memory map of {file_backed(t).path} (it "
            "was frozen when compiled with weights=) and now requires grad: an optimizer "
            "cannot update it in place. Set requires_grad before fxpipe.compile(..., weights=)")


def _check_master(fqn: str, t: object) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{fqn!r} must be a tensor, got {type(t).__name__}")
    if t.device.type != "cpu" or t.layout != torch.strided:
        raise ValueError(f"{fqn!r} is a {t.layout} tensor on {t.device}; fxpipe keeps parameters "
                         "in host memory as dense tensors: load the model on the CPU (with real "
                         "weights, not meta) before compiling")
