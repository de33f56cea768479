"""Host parameters: the model holds them once, in one flat buffer per dtype.

:class:`HostParams` (one per model) moves the storage of every parameter and buffer a
pipeline uses into one contiguous host buffer per dtype (parameters and buffers apart:
under ``param_dtype`` only the parameters' upload copy is cast), laid out in layer order
(the tensors several layers use first), and makes the model's tensors views of it, as FSDP's
flat parameter does: ``model.parameters()``, ``state_dict()``, ``load_state_dict()`` and
any ``torch.optim`` optimizer see the same tensors as before, and every stage of every
plan is one or a few contiguous slices of that buffer, uploaded without a copy on the
host. ``p.data = t`` by the user breaks the alias; ``refresh`` (before each call) copies
the new values in and re-aliases. Gradients have one flat buffer too (per dtype, the
trainable parameters only), made with the store of a training call
(:meth:`HostParams.make_grads`, on the caller's thread): a gradient download writes into
it directly, and the parameters' ``.grad`` become views of it at the commit.

Pinning (``pin=True``; ``HostParams.of`` defaults to it when CUDA is available): every
buffer here is page-locked at its exact size, rounded up to a page
(``fxpipe.runtime.pinned``; not torch's caching host allocator, which rounds each
request up to a power of two): the flat buffers, their upload copies, the flat gradient
buffers, and a staged copy of each tensor that could not move into a flat buffer, so
every upload and gradient download is asynchronous on a GPU. ``emulate=True`` records
the memory as page-locked without CUDA (virtual devices with ``semantics="cuda"``).
``pinned_bytes``: what that reserves.

File-backed tensors (frozen parameters ``compile(..., weights=PATH)`` bound to read-only
memory maps of a checkpoint, ``fxpipe.runtime.weights``) stay where they are: no flat
buffer, no page-locked copy. An upload reads the map (the page cache), converting to
``param_dtype`` on the way; when pinning, from the map itself where its pages could be
registered for DMA (``pinned.register_file``), else through a bounded page-locked
``pinned.Ring`` (at most twice the largest stage's file-backed upload bytes).

Two things keep one more copy, in the same layout: ``param_dtype`` (mixed precision,
devices compute in bf16: the bf16 copy of the floating parameters they upload; buffers
keep their dtype, as the model asks) and an asynchronous optimizer
(``fxpipe.optim`` ``mode="async"``: its update changes the parameters while the devices
still read the previous ones). :class:`ParamStore` is one Executable's view of it: per
stage, the slices it uploads.

>>> import torch.nn as nn
>>> from fxpipe.runtime.devices import VirtualDevice
>>> lin = nn.Linear(2, 2)
>>> host = HostParams.of(lin, pin=False)
>>> store = ParamStore(host, {0: dict(lin.named_parameters())})
>>> lin.weight.untyped_storage().data_ptr() == lin.bias.untyped_storage().data_ptr()  # one buffer
True
>>> store.refresh()                     # before each call
>>> dev = VirtualDevice()
>>> w = store.upload(0, dev, requires_grad=True)
>>> loss = (w["weight"] @ torch.ones(2) + w["bias"]).sum()
>>> grads = dict(zip(w, torch.autograd.grad(loss, list(w.values()))))
>>> acc = GradAccumulator(store)
>>> acc.add(0, store.download_grads(0, dev, grads, acc), own=True)
>>> acc.commit()
>>> lin.bias.grad
tensor([1., 1.])
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from fxpipe.runtime import pinned
from fxpipe.runtime.devices import CudaDevice, Device, host_allocations
from fxpipe.runtime.weights import file_backed

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

    def _empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A new host buffer: page-locked at its exact size if pinning."""
        if self.pin:
            return pinned.empty(numel, dtype, emulate=self.emulate, account=self.account)
        return torch.empty(numel, dtype=dtype)

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
            new: dict[tuple[torch.dtype, bool], list[_Slot]] = {}  # one region per kind
            for fqn, t, is_buffer in order:
                if id(t) in self.slots:
                    continue
                _check_master(fqn, t)
                if file_backed(t) is not None:
                    _check_frozen_tensor(t, fqn)
                slot = _Slot(t, [fqn], is_buffer, t.shape)
                self.slots[id(t)] = slot
                if _adoptable(t, self.slots.values()):
                    new.setdefault((t.dtype, is_buffer), []).append(slot)
            for (dtype, _), slots in new.items():
                size = 0
                for slot in slots:
                    slot.offset = _align(size, dtype)
                    size = slot.offset + slot.numel
                flat = self._empty(size, dtype)
                region = len(self.flats)
                self.flats.append(flat)
                for slot in slots:
                    view = flat[slot.offset:slot.offset + slot.numel].view(slot.tensor.shape)
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
    def refresh(self, upload_dtype: torch.dtype | None = None, snapshot: bool = False) -> None:
        """Before a call: re-alias tensors whose ``.data`` someone replaced (their new
        values copied in), and bring the upload copies up to date (``upload_dtype``: the
        mixed-precision copy; ``snapshot``: a copy in the masters' own dtype, for an
        asynchronous optimizer)."""
        with self.lock, torch.no_grad():
            for slot in self.slots.values():
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
            for slot in self.slots.values():
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

    def file_source(self, slot: _Slot, dtype: torch.dtype) -> torch.Tensor:
        """What an upload of the file-backed ``slot`` reads, in ``dtype`` (flat): the map
        itself (pageable when not pinning; registered for DMA where allowed), else a
        block of the ring (held until the copy out of it completes: ``ParamStore.upload``),
        else, the ring being full, the map (a pageable copy)."""
        t = slot.tensor.detach().reshape(-1)
        if not self.pin:
            return t.to(dtype)
        fmap = file_backed(slot.tensor)
        if dtype == t.dtype and pinned.register_file(fmap.base, fmap.size, emulate=self.emulate):
            return t
        staged = self.ring.stage(t, dtype) if self.ring is not None else None
        return staged if staged is not None else t.to(dtype)

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


def _stamp(t: torch.Tensor) -> tuple:
    """Changes when ``t``'s values may have: an in-place update bumps its version,
    ``p.data = x`` changes its memory."""
    return t._version, t.data_ptr(), t.shape


def _upload_dtype(slot: _Slot, param_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype ``slot``'s tensor has on a device: ``param_dtype`` for a floating
    parameter (mixed precision), its own for the rest (buffers keep theirs)."""
    dtype = slot.tensor.dtype
    if param_dtype is not None and dtype.is_floating_point and not slot.is_buffer:
        return param_dtype
    return dtype


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


# ------------------------------------------------------------------------------ stages

class Uploaded(dict):
    """What :meth:`ParamStore.upload` returns: ``{fqn: device view}``, and ``runs``, the
    device memory it allocated (what :meth:`ParamStore.release` frees)."""

    def __init__(self, views: Mapping[str, torch.Tensor], runs: list[torch.Tensor]):
        super().__init__(views)
        self.runs = runs


@dataclass
class _Run:
    """A contiguous piece of one flat buffer a stage uploads: ``[start, stop)``."""

    region: int | None          # None: one tensor that was not moved (``slot``)
    start: int
    stop: int
    slots: list[_Slot] = field(default_factory=list)


class ParamStore:
    """One Executable's stages as slices of the model's :class:`HostParams`.

    ``params`` / ``buffers`` map a stage index to ``{fqn: tensor}`` (the model's own
    tensors; a tensor may appear in several stages, or under several names in one stage).
    A stage uploads the contiguous runs of the flat buffers holding its tensors (usually
    one per dtype). ``param_dtype`` (mixed precision): floating parameters go to the
    devices in it, from the bf16 copy (buffers in their own dtype); their gradients come
    back into the masters' dtype.

    >>> lin = torch.nn.Linear(3, 1)
    >>> store = ParamStore(HostParams.of(lin, pin=False), {0: dict(lin.named_parameters())})
    >>> store.nbytes(0)               # weight 3 floats, then the bias 64 bytes in
    68
    """

    def __init__(self, host: HostParams, params: Mapping[int, Mapping[str, torch.Tensor]],
                 buffers: Mapping[int, Mapping[str, torch.Tensor]] | None = None, *,
                 param_dtype: torch.dtype | None = None):
        buffers = buffers or {}
        self.host = host
        self.param_dtype = param_dtype
        self.snapshot = False   # uploads read a copy (an asynchronous optimizer is stepping)
        stages = sorted(set(params) | set(buffers))
        host.adopt([[(f, t, False) for f, t in params.get(s, {}).items()]
                    + [(f, t, True) for f, t in buffers.get(s, {}).items()] for s in stages])
        self._names: dict[int, dict[str, _Slot]] = {}
        self._runs: dict[int, list[_Run]] = {}
        for s in stages:
            named = {**params.get(s, {}), **buffers.get(s, {})}
            slots = {f: host.slot(t) for f, t in named.items()}
            for f, t in named.items():
                if host.slot(t).is_buffer != (f in buffers.get(s, {})):
                    raise ValueError(f"stage {s}: {f!r} is the same tensor as "
                                     f"{host.slot(t).names[0]!r} but is given both as a "
                                     "parameter and as a buffer")
            self._names[s] = slots
            self._runs[s] = _runs(host, list({id(x): x for x in slots.values()}.values()))
        if host.pin:
            mapped = [self._file_nbytes(s) for s in stages]
            if mapped and max(mapped):
                host.size_ring(2 * max(mapped))

    def _file_nbytes(self, stage: int) -> int:
        """Bytes of ``stage``'s file-backed tensors in their upload dtype, each rounded
        up to a page (as a ring block holds them)."""
        return sum(pinned.reserved(run.slots[0].numel * _upload_dtype(
            run.slots[0], self.param_dtype).itemsize)
            for run in self._runs[stage]
            if run.region is None and file_backed(run.slots[0].tensor) is not None)

    @property
    def stages(self) -> list[int]:
        """The stage indices, ascending."""
        return list(self._names)

    def nbytes(self, stage: int) -> int:
        """Bytes one upload of ``stage`` moves (in the upload dtype, with alignment)."""
        total = 0
        for run in self._runs_of(stage):
            dtype = _upload_dtype(run.slots[0], self.param_dtype)
            total += (run.stop - run.start) * dtype.itemsize
        return total

    def grad_nbytes(self, stage: int) -> int:
        """Bytes of the gradients ``stage``'s trainable parameters make on a device (in
        the upload dtype; a tied parameter once)."""
        slots = {id(slot): slot for slot in self._names[stage].values()
                 if not slot.is_buffer and slot.tensor.requires_grad}
        return sum(slot.numel * _upload_dtype(slot, self.param_dtype).itemsize
                   for slot in slots.values())

    def refresh(self) -> None:
        """Before a call (see :meth:`HostParams.refresh`)."""
        self.host.refresh(self.param_dtype, self.snapshot)

    def upload(self, stage: int, device: Device, *, requires_grad: bool = False) -> dict[str, torch.Tensor]:
        """Copy the stage's runs to ``device`` (counted as ``"params"``).

        Returns ``{fqn: device view}`` for every name, tied names sharing one tensor. With
        ``requires_grad``, parameter views are leaves that require grad like their master.
        Release with :meth:`release`."""
        on_device: list[tuple[_Run, torch.Tensor]] = []
        try:
            for run in self._runs_of(stage):
                src = self._source(run)
                on_device.append((run, device.to_device(src, kind="params", owner=f"stage {stage}")))
                if self.host.ring is not None and isinstance(device, CudaDevice) \
                        and pinned.is_pinned(src) and file_backed(run.slots[0].tensor) is not None:
                    # a ring block: reused once this copy (queued on this stream) completes
                    self.host.ring.hold(src, torch.cuda.current_stream(device.device).record_event())
        except BaseException:  # e.g. DeviceMemoryError on the second run: undo the first
            for _, t in on_device:
                device.free(t)
            raise
        views: dict[int, torch.Tensor] = {}
        for run, dev in on_device:
            for slot in run.slots:
                start = slot.offset - run.start if run.region is not None else 0
                view = dev[start:start + slot.numel].view(slot.tensor.shape)
                if requires_grad and not slot.is_buffer and slot.tensor.requires_grad:
                    view = view.detach().requires_grad_()
                views[id(slot)] = view
        return Uploaded({fqn: views[id(slot)] for fqn, slot in self._names[stage].items()},
                        [t for _, t in on_device])

    def _source(self, run: _Run) -> torch.Tensor:
        if run.region is None:   # its page-locked copy, when pinning
            t = run.slots[0].tensor.detach().reshape(-1)
            dtype = _upload_dtype(run.slots[0], self.param_dtype)
            if file_backed(run.slots[0].tensor) is not None:
                return self.host.file_source(run.slots[0], dtype)
            staged = self.host.staged(run.slots[0], dtype, self.snapshot)
            return staged if staged is not None else t.to(dtype)
        src = self.host.source(run.slots[0], self.param_dtype, self.snapshot)
        return src[run.start:run.stop]

    def release(self, device: Device, uploaded: Uploaded) -> None:
        """Stop counting what :meth:`upload` put on ``device`` (each run once: the memory
        it allocated, whatever the stage's code did to the views, e.g. a module that
        converts its own weights with ``.to()`` in forward, as Switch Transformers' router
        does)."""
        for t in uploaded.runs:
            device.free(t)

    def download_grads(self, stage: int, device: Device,
                       device_grads: Mapping[str, torch.Tensor | None],
                       accumulator: GradAccumulator | None = None) -> dict[str, torch.Tensor]:
        """Bring ``{fqn: device gradient}`` to the host, in the masters' gradient dtype.

        Give a tied parameter's gradient once, under any of its names. Returns
        ``{fqn: host gradient}``. With an ``accumulator``, a gradient whose parameter has
        no ``.grad`` yet is copied straight into its place in the flat gradient buffer
        (``HostParams.claim_grad``), others into new host tensors. Call it inside work on
        one of the device's streams: the values are there when that work's event has
        completed (a GPU's copies are queued)."""
        items: list[tuple[str, _Slot, torch.Tensor]] = []
        seen: dict[int, str] = {}
        for fqn, g in device_grads.items():
            if g is None:
                continue
            slot = self._slot(stage, fqn)
            what = f"stage {stage}: gradient of {fqn!r}"
            if slot.is_buffer or not slot.tensor.requires_grad:
                raise ValueError(f"{what}: it is a {'buffer' if slot.is_buffer else 'frozen parameter'}, "
                                 "which gets no gradient; leave it out")
            if id(slot) in seen:
                raise ValueError(f"{what}: {seen[id(slot)]!r} is the same (tied) parameter and already "
                                 "has a gradient; give each tied parameter's gradient once")
            # a floating gradient in another dtype than uploaded is fine: a module may
            # convert its weights in forward (a router kept in fp32); it is cast below
            if g.shape != slot.tensor.shape or not (g.is_floating_point() or g.is_complex()):
                raise ValueError(f"{what} has shape {tuple(g.shape)} {g.dtype}, the parameter "
                                 f"{tuple(slot.tensor.shape)} {_upload_dtype(slot, self.param_dtype)}")
            seen[id(slot)] = fqn
            items.append((fqn, slot, g))
        out: dict[str, torch.Tensor] = {}
        for fqn, slot, g in items:
            dtype = grad_dtype(slot.tensor)
            if g.dtype != dtype:
                # on the device: the download moves the gradient's own dtype. The cast reads
                # g, made on the compute stream, on this one: its memory must wait for it
                device.record_stream(g)
                g = g.to(dtype)
            dest = accumulator.claim(slot) if accumulator is not None else None
            out[fqn] = device.to_host(g) if dest is None else device.copy_to_host(g, dest)
        return out

    def _runs_of(self, stage: int) -> list[_Run]:
        try:
            return self._runs[stage]
        except KeyError:
            raise KeyError(f"no stage {stage} in the parameter store (stages {self.stages})") from None

    def _slot(self, stage: int, fqn: str) -> _Slot:
        self._runs_of(stage)
        slots = self._names[stage]
        if fqn not in slots:
            raise KeyError(f"stage {stage} has no parameter or buffer {fqn!r} "
                           f"(it has {sorted(slots)[:8]}{' ...' if len(slots) > 8 else ''})")
        return slots[fqn]


def _runs(host: HostParams, slots: list[_Slot]) -> list[_Run]:
    """The contiguous runs of flat memory holding ``slots`` (gaps of alignment padding
    only are bridged; a tensor that was not moved is a run of its own)."""
    runs: list[_Run] = []
    for slot in sorted(slots, key=lambda s: (s.region is None, s.region or 0, s.offset)):
        if slot.region is None:
            runs.append(_Run(None, 0, slot.numel, [slot]))
            continue
        dtype = host.flats[slot.region].dtype
        last = runs[-1] if runs else None
        if (last is not None and last.region == slot.region
                and slot.offset <= _align(last.stop, dtype)):
            last.stop = max(last.stop, slot.offset + slot.numel)
            last.slots.append(slot)
        else:
            runs.append(_Run(slot.region, slot.offset, slot.offset + slot.numel, [slot]))
    return runs


def owned_params(program, lg) -> dict[int, list[torch.Tensor]]:
    """Per backward stage of ``program``, the trainable parameters it owns
    (``StageSpec.owns``, computed once by ``build_executable``): those whose gradients
    are final once its gradients are downloaded, which its ``OptimizerStep`` steps and
    its ``AllReduce`` reduces (a tied parameter goes with the last stage holding it)."""
    return {st.index: [lg.params[f] for f in st.owns] for st in program.stages if st.owns}


class GradAccumulator:
    """Sums host gradients over one call, then adds them to ``.grad`` all at once.

    Tied parameters (one tensor in several stages) sum. ``commit`` sets a ``.grad`` that
    is None (to its view of the flat gradient buffer, where the download put it) or adds
    into an existing one, as autograd does; ``discard`` drops everything (a failed call:
    no ``.grad`` changes). Thread-safe. Give it gradients only once their copies have
    landed (after the event of the work that downloaded them).

    Data parallel: ``replace`` puts in a parameter's final ``.grad`` (its gradients
    averaged across ranks, the ``.grad`` it had included), which ``commit`` writes in place
    of the old one instead of adding to it.

    >>> p = torch.nn.Parameter(torch.zeros(2))
    >>> store = ParamStore(HostParams.of(torch.nn.ParameterList([p]), pin=False),
    ...                    {0: {"p": p}, 1: {"p": p}})
    >>> acc = GradAccumulator(store)
    >>> acc.add(0, {"p": torch.ones(2)}); acc.add(1, {"p": torch.ones(2)})
    >>> acc.commit(); p.grad
    tensor([2., 2.])
    """

    def __init__(self, store: ParamStore):
        self._store = store
        self._lock = threading.Lock()
        self._sums: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(master) -> (master, sum)
        self._claimed: dict[int, torch.Tensor] = {}  # id(master) -> its flat gradient view
        self._replace: set[int] = set()   # id(master): the sum is the final .grad

    def claim(self, slot: _Slot) -> torch.Tensor | None:
        """Where this call's download of ``slot``'s gradient goes directly (once per
        parameter per call), or None (``HostParams.claim_grad``)."""
        with self._lock:
            if id(slot.tensor) in self._claimed:
                return None
            return self._claim(slot)

    def _claim(self, slot: _Slot) -> torch.Tensor | None:
        """``HostParams.claim_grad(slot)``, remembered (hold ``_lock``)."""
        view = self._store.host.claim_grad(slot)
        if view is not None:
            self._claimed[id(slot.tensor)] = view
        return view

    def add(self, stage: int, host_grads: Mapping[str, torch.Tensor], *, own: bool = False) -> None:
        """Add ``{fqn: host gradient}`` of ``stage`` (e.g. from ``download_grads``).

        ``own``: the tensors are the accumulator's to keep (fresh from ``download_grads``):
        a flat-buffer view it claimed, or one laid out like its parameter in its grad
        dtype, becomes the sum itself instead of being copied."""
        with self._lock, torch.no_grad():
            for fqn, g in host_grads.items():
                master = self._store._slot(stage, fqn).tensor
                if g.shape != master.shape:
                    raise ValueError(f"stage {stage}: gradient of {fqn!r} has shape {tuple(g.shape)}, "
                                     f"the parameter {tuple(master.shape)}")
                claimed = self._claimed.get(id(master))
                mine = claimed is not None and g.data_ptr() == claimed.data_ptr()
                if id(master) in self._sums:
                    total = self._sums[id(master)][1]
                    if mine:   # the flat view holds the sum: add what came before into it
                        g.add_(total)
                        self._sums[id(master)] = (master, g)
                    else:
                        total.add_(g)
                    continue
                dtype = grad_dtype(master)
                if not (own and g.dtype == dtype and g.stride() == master.stride()):
                    g = torch.empty_like(master, dtype=dtype).copy_(g)
                self._sums[id(master)] = (master, g)  # the accumulator's own tensor now

    def sums(self, params: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
        """This call's gradient sum of each of ``params`` so far (None: none came)."""
        with self._lock:
            return [self._sums[id(p)][1] if id(p) in self._sums else None for p in params]

    def replace(self, master: torch.Tensor, value: torch.Tensor) -> None:
        """``value`` is ``master``'s final ``.grad`` (what the commit writes instead of adding
        this call's sum). Copied into its flat gradient view when it can have one, else
        kept as it is."""
        with self._lock, torch.no_grad():
            slot = self._store.host.slots.get(id(master))
            claimed = self._claimed.get(id(master))
            if claimed is None and slot is not None:
                claimed = self._claim(slot)
            if claimed is not None:
                value = claimed.copy_(value)
            self._sums[id(master)] = (master, value)
            self._replace.add(id(master))

    def drop(self, params: Sequence[torch.Tensor]) -> None:
        """Forget ``params``' sums (consumed by a sharded optimizer step)."""
        with self._lock:
            for p in params:
                self._sums.pop(id(p), None)

    def commit(self, params: Collection[torch.Tensor] | None = None) -> None:
        """Add the sums into the parameters' ``.grad`` (of ``params`` only, when given: a
        streamed optimizer step commits a stage's as soon as they are final); checks
        everything before writing any."""
        with self._lock, torch.no_grad():
            keys = list(self._sums) if params is None else \
                [id(p) for p in params if id(p) in self._sums]
            for key in keys:
                master, total = self._sums[key]
                grad = master.grad
                if grad is not None and (grad.shape != total.shape
                                         or not torch.can_cast(total.dtype, grad.dtype)):
                    raise RuntimeError(f"a parameter of shape {tuple(master.shape)} has a .grad of "
                                       f"{tuple(grad.shape)} {grad.dtype}; nothing was written")
            for key in keys:
                master, total = self._sums.pop(key)
                if master.grad is None:
                    master.grad = total
                    claimed = self._claimed.get(key)
                    if claimed is not None and total.data_ptr() == claimed.data_ptr():
                        self._store.host.exposed(master, master.grad)
                elif key in self._replace:
                    master.grad.copy_(total)
                else:
                    master.grad.add_(total)

    def totals(self) -> dict[int, torch.Tensor]:
        """The sums so far, by ``id`` of the parameter, handed to autograd instead of
        committed (flat-buffer views among them count as handed out: a later call writes
        there again only once nobody holds them). Autograd adds them to ``.grad``: for a
        ``replace``d one that has a ``.grad``, the difference is handed out."""
        with self._lock, torch.no_grad():
            out = {}
            for key, (master, total) in self._sums.items():
                claimed = self._claimed.get(key)
                if claimed is not None and total.data_ptr() == claimed.data_ptr():
                    self._store.host.exposed(master, total)
                if key in self._replace and master.grad is not None:
                    total = total - master.grad
                out[key] = total
            return out

    def discard(self) -> None:
        """Drop the sums; no ``.grad`` changes."""
        with self._lock:
            self._sums.clear()
            self._claimed.clear()
            self._replace.clear()

    def __len__(self) -> int:
        return len(self._sums)

