"""Host parameter store: the model's own tensors stay the master copy; stages upload flat.

Per stage, :class:`ParamStore` keeps one contiguous host buffer per dtype (pinned when
CUDA is available) holding a copy of that stage's parameters and buffers, so a stage
goes to a device in one transfer per dtype. ``refresh`` copies the master values in
(the user's optimizer changes them between calls). Gradients come back flat too, and
:class:`GradAccumulator` adds them into the parameters' ``.grad`` only when the whole
call succeeded.

>>> import torch.nn as nn
>>> from fxpipe.runtime.devices import VirtualDevice
>>> lin = nn.Linear(2, 2)
>>> store = ParamStore({0: dict(lin.named_parameters())})
>>> store.refresh(0)  # before each call: the optimizer may have changed the weights
>>> dev = VirtualDevice()
>>> w = store.upload(0, dev, requires_grad=True)
>>> loss = (w["weight"] @ torch.ones(2) + w["bias"]).sum()
>>> grads = dict(zip(w, torch.autograd.grad(loss, list(w.values()))))
>>> acc = GradAccumulator(store)
>>> acc.add(0, store.download_grads(0, dev, grads))
>>> acc.commit()
>>> lin.bias.grad
tensor([1., 1.])
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Mapping
from dataclasses import dataclass

import torch

from fxpipe.runtime.devices import Device

_ALIGN_BYTES = 64  # each tensor starts on a 64-byte boundary inside a flat buffer


@dataclass(frozen=True)
class _Slot:
    """Where one master tensor lives in its stage's flat buffer of its dtype."""

    names: tuple[str, ...]  # every fqn of this tensor in the stage (tied names share a slot)
    master: torch.Tensor
    offset: int  # in elements of dtype
    is_buffer: bool
    dtype: torch.dtype  # of the flat copy: master's, or the store's param_dtype

    @property
    def numel(self) -> int:
        return self.master.numel()


class _StageParams:
    def __init__(self, stage: int, params: Mapping[str, torch.Tensor],
                 buffers: Mapping[str, torch.Tensor], pin: bool,
                 param_dtype: torch.dtype | None = None):
        self.slots: dict[str, _Slot] = {}  # fqn -> slot (aliases map to the same slot)
        by_tensor: dict[int, list] = {}  # id(master) -> [names, master, is_buffer]
        for is_buffer, named in ((False, params), (True, buffers)):
            for fqn, t in named.items():
                _check_master(stage, fqn, t)
                entry = by_tensor.setdefault(id(t), [[], t, is_buffer])
                if entry[2] != is_buffer:
                    raise ValueError(f"stage {stage}: {fqn!r} is the same tensor as {entry[0][0]!r} "
                                     "but is given both as a parameter and as a buffer")
                entry[0].append(fqn)
        sizes: dict[torch.dtype, int] = {}
        for names, t, is_buffer in by_tensor.values():
            dtype = param_dtype if param_dtype is not None and t.is_floating_point() else t.dtype
            align = max(1, _ALIGN_BYTES // dtype.itemsize)
            offset = -(-sizes.get(dtype, 0) // align) * align
            sizes[dtype] = offset + t.numel()
            slot = _Slot(tuple(names), t, offset, is_buffer, dtype)
            self.slots.update(dict.fromkeys(names, slot))
        self.flat = {dtype: torch.zeros(n, dtype=dtype, pin_memory=pin) for dtype, n in sizes.items()}
        self.versions: dict[int, tuple[int, int]] = {}  # id(master) -> (version, data_ptr) copied

    def distinct(self) -> list[_Slot]:
        return list({id(s): s for s in self.slots.values()}.values())


def _check_master(stage: int, fqn: str, t: object) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"stage {stage}: {fqn!r} must be a tensor, got {type(t).__name__}")
    if t.device.type != "cpu" or t.layout != torch.strided:
        raise ValueError(f"stage {stage}: {fqn!r} is a {t.layout} tensor on {t.device}; fxpipe keeps "
                         "parameters in host memory as dense tensors: load the model on the CPU "
                         "(with real weights, not meta) before compiling")


class ParamStore:
    """Per-stage flat host copies of the model's parameters and buffers.

    ``params`` / ``buffers`` map a stage index to ``{fqn: tensor}`` (the model's own
    tensors; the same tensor may appear in several stages, or under several names in
    one stage: it is stored once per stage). ``pin`` defaults to ``torch.cuda.is_available()``.

    >>> lin = torch.nn.Linear(3, 1)
    >>> store = ParamStore({0: dict(lin.named_parameters())}, pin=False)
    >>> [(d, t.numel()) for d, t in store.flat(0).items()]  # bias starts 64 bytes in
    [(torch.float32, 17)]

    ``param_dtype`` (mixed precision): floating-point tensors are copied into the flat
    buffers cast to it (the masters keep their dtype), and their gradients come back in
    it; ``GradAccumulator`` adds them into ``.grad`` in the master's dtype.
    """

    def __init__(self, params: Mapping[int, Mapping[str, torch.Tensor]],
                 buffers: Mapping[int, Mapping[str, torch.Tensor]] | None = None, *,
                 pin: bool | None = None, param_dtype: torch.dtype | None = None):
        buffers = buffers or {}
        pin = torch.cuda.is_available() if pin is None else pin
        self._stages = {s: _StageParams(s, params.get(s, {}), buffers.get(s, {}), pin, param_dtype)
                        for s in sorted(set(params) | set(buffers))}
        self.refresh()

    @property
    def stages(self) -> list[int]:
        """The stage indices, ascending."""
        return list(self._stages)

    def flat(self, stage: int) -> dict[torch.dtype, torch.Tensor]:
        """The stage's flat host buffers, one per dtype (read-only use)."""
        return dict(self._stage(stage).flat)

    def nbytes(self, stage: int) -> int:
        """Bytes one upload of ``stage`` moves (all dtypes, with alignment padding)."""
        return sum(t.numel() * t.element_size() for t in self._stage(stage).flat.values())

    def refresh(self, stage: int | None = None) -> None:
        """Copy the current master values into the flat buffers (one stage, or all).

        Do not refresh a stage while an upload from it may still be reading (CUDA
        non-blocking copies): wait for that upload's event first.
        """
        for s in self.stages if stage is None else [stage]:
            st = self._stage(s)
            with torch.no_grad():
                for slot in st.distinct():
                    # in-place updates (optimizer steps, load_state_dict) bump _version and
                    # `p.data = t` moves the storage: an unchanged master needs no copy
                    version = (slot.master._version, slot.master.data_ptr())
                    if st.versions.get(id(slot.master)) != version:
                        _view(st.flat[slot.dtype], slot).copy_(slot.master)
                        st.versions[id(slot.master)] = version

    def upload(self, stage: int, device: Device, *, requires_grad: bool = False) -> dict[str, torch.Tensor]:
        """Copy the stage's flat buffers to ``device`` (counted as ``"params"``).

        Returns ``{fqn: device view}`` for every name, tied names sharing one tensor. With
        ``requires_grad``, parameter views are leaves that require grad like their master.
        Release with :meth:`release`.
        """
        st = self._stage(stage)
        on_device: dict[torch.dtype, torch.Tensor] = {}
        try:
            for dtype, flat in st.flat.items():
                on_device[dtype] = device.to_device(flat, kind="params", owner=f"stage {stage}")
        except BaseException:  # e.g. DeviceMemoryError on the second dtype: undo the first
            for t in on_device.values():
                device.free(t)
            raise
        out: dict[str, torch.Tensor] = {}
        for slot in st.distinct():
            view = _view(on_device[slot.dtype], slot)
            if requires_grad and not slot.is_buffer and slot.master.requires_grad:
                view = view.detach().requires_grad_()
            out.update(dict.fromkeys(slot.names, view))
        return out

    def release(self, device: Device, uploaded: Mapping[str, torch.Tensor]) -> None:
        """Stop counting what :meth:`upload` put on ``device`` (each flat buffer once)."""
        seen: dict[int, torch.Tensor] = {}
        for t in uploaded.values():
            seen.setdefault(t.untyped_storage().data_ptr(), t)
        for t in seen.values():
            device.free(t)

    def download_grads(self, stage: int, device: Device,
                       device_grads: Mapping[str, torch.Tensor | None]) -> dict[str, torch.Tensor]:
        """Bring ``{fqn: device gradient}`` to the host in one transfer per dtype.

        Give a tied parameter's gradient once, under any of its names. Returns
        ``{fqn: host gradient}`` (new host tensors, from ``Device.to_host_each``). Call it
        inside work on one of the device's streams: the values are there when that
        work's event has completed (a GPU's copies are queued).
        """
        groups: dict[torch.dtype, list[tuple[str, torch.Tensor]]] = {}
        seen: dict[int, str] = {}
        for fqn, g in device_grads.items():
            if g is None:
                continue
            slot = self._slot(stage, fqn)
            what = f"stage {stage}: gradient of {fqn!r}"
            if slot.is_buffer or not slot.master.requires_grad:
                raise ValueError(f"{what}: it is a {'buffer' if slot.is_buffer else 'frozen parameter'}, "
                                 "which gets no gradient; leave it out")
            if id(slot) in seen:
                raise ValueError(f"{what}: {seen[id(slot)]!r} is the same (tied) parameter and already "
                                 "has a gradient; give each tied parameter's gradient once")
            if g.shape != slot.master.shape or g.dtype != slot.dtype:
                raise ValueError(f"{what} has shape {tuple(g.shape)} {g.dtype}, the parameter "
                                 f"{tuple(slot.master.shape)} {slot.dtype}")
            seen[id(slot)] = fqn
            groups.setdefault(g.dtype, []).append((fqn, g))
        out: dict[str, torch.Tensor] = {}
        for items in groups.values():
            if items[0][1].is_cuda:  # the packing below reads them on this (d2h) stream
                for _, g in items:
                    g.record_stream(torch.cuda.current_stream(g.device))
            out.update(zip([fqn for fqn, _ in items], device.to_host_each([g for _, g in items])))
        return out

    def write_back_buffers(self, stage: int, device_buffers: Mapping[str, torch.Tensor]) -> None:
        """Copy buffer values updated on the device (e.g. BatchNorm running stats) into the model.

        Checks every name and shape first, so the model is never half-written.
        """
        pairs = []
        for fqn, t in device_buffers.items():
            slot = self._slot(stage, fqn)
            if not slot.is_buffer:
                raise ValueError(f"stage {stage}: {fqn!r} is a parameter, not a buffer; parameters "
                                 "change only through the optimizer")
            if t.shape != slot.master.shape:
                raise ValueError(f"stage {stage}: buffer {fqn!r} came back with shape {tuple(t.shape)}, "
                                 f"the model's is {tuple(slot.master.shape)}")
            pairs.append((slot.master, t))
        with torch.no_grad():
            for master, t in pairs:
                master.copy_(t)

    def _stage(self, stage: int) -> _StageParams:
        try:
            return self._stages[stage]
        except KeyError:
            raise KeyError(f"no stage {stage} in the parameter store (stages {self.stages})") from None

    def _slot(self, stage: int, fqn: str) -> _Slot:
        slots = self._stage(stage).slots
        if fqn not in slots:
            raise KeyError(f"stage {stage} has no parameter or buffer {fqn!r} "
                           f"(it has {sorted(slots)[:8]}{' ...' if len(slots) > 8 else ''})")
        return slots[fqn]


def _view(flat: torch.Tensor, slot: _Slot) -> torch.Tensor:
    return flat[slot.offset:slot.offset + slot.numel].view(slot.master.shape)


class GradAccumulator:
    """Sums host gradients over one call, then adds them to ``.grad`` all at once.

    Tied parameters (one tensor in several stages) sum. ``commit`` adds into an existing
    ``.grad`` (or sets it), as autograd does; ``discard`` drops everything (a failed call).
    Thread-safe. Reusable after commit/discard. Give it gradients only once their copies
    have landed (after the event of the work that downloaded them).

    >>> p = torch.nn.Parameter(torch.zeros(2))
    >>> store = ParamStore({0: {"p": p}, 1: {"p": p}}, pin=False)
    >>> acc = GradAccumulator(store)
    >>> acc.add(0, {"p": torch.ones(2)}); acc.add(1, {"p": torch.ones(2)})
    >>> acc.commit(); p.grad
    tensor([2., 2.])
    """

    def __init__(self, store: ParamStore):
        self._store = store
        self._lock = threading.Lock()
        self._sums: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(master) -> (master, sum)

    def add(self, stage: int, host_grads: Mapping[str, torch.Tensor], *, own: bool = False) -> None:
        """Add ``{fqn: host gradient}`` of ``stage`` (e.g. from ``download_grads``).

        ``own``: the tensors are the accumulator's to keep (fresh from ``download_grads``):
        one laid out like its parameter, in its grad dtype and aligned, becomes the sum
        itself instead of being copied (it may end up as ``.grad``).
        """
        with self._lock, torch.no_grad():
            for fqn, g in host_grads.items():
                master = self._store._slot(stage, fqn).master
                if g.shape != master.shape:
                    raise ValueError(f"stage {stage}: gradient of {fqn!r} has shape {tuple(g.shape)}, "
                                     f"the parameter {tuple(master.shape)}")
                if id(master) in self._sums:
                    self._sums[id(master)][1].add_(g)
                    continue
                # laid out like the parameter, in its grad_dtype (as autograd)
                dtype = (master.grad_dtype if master.is_leaf else None) or master.dtype
                if not (own and g.dtype == dtype and g.stride() == master.stride()
                        and g.data_ptr() % _ALIGN_BYTES == 0):
                    g = torch.empty_like(master, dtype=dtype).copy_(g)
                self._sums[id(master)] = (master, g)  # the accumulator's own tensor now

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
                else:
                    master.grad.add_(total)

    def totals(self) -> dict[int, torch.Tensor]:
        """The sums so far, by ``id`` of the parameter (to hand them to autograd instead)."""
        with self._lock:
            return {key: total for key, (_, total) in self._sums.items()}

    def discard(self) -> None:
        """Drop the sums; no ``.grad`` changes."""
        with self._lock:
            self._sums.clear()

    def __len__(self) -> int:
        return len(self._sums)
