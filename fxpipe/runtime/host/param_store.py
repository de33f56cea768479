"""The device parameter store: :class:`ParamStore`, one Executable's stages as slices of
the model's :class:`~fxpipe.runtime.host.params.HostParams`.

A stage uploads the contiguous runs of the flat host buffers holding its tensors
(:meth:`ParamStore.upload`, counted as ``"params"`` on the device), hands the device
views to its code, frees them (:meth:`ParamStore.release`) and brings its gradients back
(:meth:`ParamStore.download_grads`: in the device's dtype where the masters' gradient dtype
holds it exactly, bf16 for fp32 masters, the host widening them), into the flat gradient
buffer where a :class:`~fxpipe.runtime.host.grad_accum.GradAccumulator` claims the place.

>>> import torch.nn as nn
>>> from fxpipe.runtime.devices.emulator import VirtualDevice
>>> from fxpipe.runtime.host.grad_accum import GradAccumulator
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

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Protocol

import torch

from fxpipe.runtime.devices import pinned
from fxpipe.runtime.devices.cuda import CudaDevice
from fxpipe.runtime.devices.device import Device
from fxpipe.runtime.host.buckets import _chunk, _piece
from fxpipe.runtime.host.params import (
    HostParams, _Slot, _align, _cast, _upload_dtype, converted, grad_dtype, is_scratch,
    widens_exactly,
)
from fxpipe.runtime.host.scratch import ResidentBuffers
from fxpipe.runtime.host.weights import file_backed


class _Claims(Protocol):
    """Where a gradient download may write directly (a ``GradAccumulator``)."""

    def claim(self, slot: _Slot) -> torch.Tensor | None: ...


class Uploaded(dict):
    """What :meth:`ParamStore.upload` returns: ``{fqn: device view}``, ``runs``, the
    device memory it allocated (what :meth:`ParamStore.release` frees), and ``nbytes``,
    the bytes it copied from the host (a resident buffer's first upload included)."""

    def __init__(self, views: Mapping[str, torch.Tensor], runs: list[torch.Tensor],
                 nbytes: int = 0):
        super().__init__(views)
        self.runs = runs
        self.nbytes = nbytes
        self.slot: tuple[int, int] | None = None   # the parameter slot it is in (runtime.stages.graphs)
        self.memory: torch.Tensor | None = None    # that slot's memory
        self.layout: object = None   # what its graph jobs read of it (runtime.issue.compute), once
        # data_parallel="zero3": (run's device memory, c) per parameter run, this rank's
        # [rank*c, (rank+1)*c) uploaded, the rest for the DeviceAllGather to fill
        self.gathers: list[tuple[torch.Tensor, int]] = []


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
    devices in it, from the bf16 copy, and so do the buffers marked so
    (``layer_graph.in_param_dtype``; the others in their own dtype); the gradients come back
    into the masters' dtype.

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
        # data_parallel="zero3": (rank, world); each upload moves this rank's 1/world of
        # each parameter run (:meth:`upload`)
        self.shard: tuple[int, int] | None = None
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
            self._runs[s] = _runs(host, self._unique(s))
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
        """Device bytes one upload of ``stage`` takes (in the upload dtype, with alignment;
        ``data_parallel="zero3"``: each parameter run padded to ``world`` equal parts, of
        which it moves one)."""
        return sum(self._run_nbytes(stage))

    def grad_nbytes(self, stage: int) -> int:
        """Bytes of the gradients ``stage``'s trainable parameters make on a device (in
        the upload dtype; a tied parameter once)."""
        slots = {id(slot): slot for slot in self._names[stage].values()
                 if not slot.is_buffer and slot.tensor.requires_grad}
        return sum(slot.numel * _upload_dtype(slot, self.param_dtype).itemsize
                   for slot in slots.values())

    def refresh(self, only: Collection[torch.Tensor] | None = None) -> None:
        """Before a call (see :meth:`HostParams.refresh`; ``only``: those tensors')."""
        self.host.refresh(self.param_dtype, self.snapshot, only)

    def slot_nbytes(self, stage: int, grads: bool = False) -> int:
        """Bytes an upload of ``stage`` into a parameter slot takes (:meth:`upload`'s
        ``into``): each run at a ``SLOT_ALIGN``-byte boundary; with ``grads``, then its
        trainable parameters' gradients, each at such a boundary (``slot_grads``)."""
        total = sum(_slot_align(n) for n in self._run_nbytes(stage))
        if grads:
            total += sum(_slot_align(slot.numel * _upload_dtype(slot, self.param_dtype).itemsize)
                         for slot in self._unique(stage)
                         if not slot.is_buffer and slot.tensor.requires_grad)
        return total

    def _run_nbytes(self, stage: int) -> list[int]:
        """Device bytes of each run (``data_parallel="zero3"``: a parameter run padded to
        ``world`` equal parts, :meth:`_numel`)."""
        return [self._numel(run) * _upload_dtype(run.slots[0], self.param_dtype).itemsize
                for run in self._runs_of(stage)]

    def _part(self, run: _Run) -> tuple[int, int] | None:
        """``data_parallel="zero3"``: this rank's elements ``[lo, hi)`` of a parameter run,
        cut as the sharded optimizer cuts a parameter (``buckets._piece``); else None."""
        if self.shard is None or run.slots[0].is_buffer:
            return None
        return _piece(run.stop - run.start, self.shard[1], self.shard[0])

    def _numel(self, run: _Run) -> int:
        """Device elements of ``run``: under ``data_parallel="zero3"`` a parameter run's
        ``world`` parts of ``ceil(numel / world)`` each, the last padded."""
        n = run.stop - run.start
        if self.shard is None or run.slots[0].is_buffer:
            return n
        return self.shard[1] * _chunk(n, self.shard[1])

    def upload(self, stage: int, device: Device, *, requires_grad: bool = False,
               resident: ResidentBuffers | None = None, into: torch.Tensor | None = None
               ) -> Uploaded:
        """Copy the stage's runs to ``device`` (counted as ``"params"``).

        Returns ``{fqn: device view}`` for every name, tied names sharing one tensor. With
        ``requires_grad``, parameter views are leaves that require grad like their master.
        ``resident``: the stage's scratch buffers it wants are not in the runs: they are
        served from it (uploaded there the first time, ``runtime.host.scratch``). ``into``: a
        parameter slot (``uint8`` device memory of at least :meth:`slot_nbytes`, kept by
        ``runtime.stages.graphs``): the runs are copied into it, at the same places every time,
        and :meth:`release` frees nothing. Release with :meth:`release`."""
        kept = self._kept(stage, resident)
        runs = self._runs_of(stage) if not kept else _runs(
            self.host, [slot for slot in self._unique(stage) if id(slot) not in kept])
        if into is not None and (kept or into.numel() < self.slot_nbytes(stage)):
            raise ValueError(f"stage {stage}: an upload into a parameter slot takes "
                             f"{self.slot_nbytes(stage)} B of uint8 and no resident buffers; "
                             f"got {into.numel()} B{' and resident buffers' if kept else ''}")
        on_device: list[tuple[_Run, torch.Tensor]] = []
        made: list[torch.Tensor] = []       # device memory allocated here (release frees it)
        gathers: list[torch.Tensor] = []    # zero3: runs of which this rank uploads a part
        moved = at = 0
        try:
            for run in runs:
                n, size = run.stop - run.start, self._numel(run)
                part = self._part(run)   # zero3: this rank's elements
                src = self._source(run, part)
                item = src.element_size()
                if into is not None:
                    dev = into[at:at + size * item].view(src.dtype)
                    at += _slot_align(size * item)
                elif part is not None:
                    dev = device.empty(size * item, "params", f"stage {stage}").view(src.dtype)
                    made.append(dev)
                else:
                    dev = device.to_device(src, kind="params", owner=f"stage {stage}")
                    made.append(dev)
                if part is not None:   # the DeviceAllGather fills in the other ranks' parts
                    device.copy_into(src, dev[part[0]:part[1]])
                    gathers.append(dev)
                    n = part[1] - part[0]
                elif into is not None:
                    device.copy_into(src, dev)
                on_device.append((run, dev))
                moved += n * item
                if self.host.ring is not None and isinstance(device, CudaDevice) \
                        and pinned.is_pinned(src) and file_backed(run.slots[0].tensor) is not None:
                    # a ring block: reused once this copy (queued on this stream) completes
                    self.host.ring.hold(src, torch.cuda.current_stream(device.device).record_event())
        except BaseException:  # e.g. DeviceMemoryError on the second run: undo the first
            for t in made:
                device.free(t)
            raise
        views: dict[int, torch.Tensor] = {}
        for slot in kept.values():
            had = resident.held(slot.tensor) is not None
            views[id(slot)] = resident.get(slot.tensor, device, f"stage {stage}'s {slot.names[0]}")
            moved += 0 if had else slot.numel * slot.tensor.element_size()
        for run, dev in on_device:
            for slot in run.slots:
                start = slot.offset - run.start if run.region is not None else 0
                view = dev[start:start + slot.numel].view(slot.tensor.shape)
                if requires_grad and not slot.is_buffer and slot.tensor.requires_grad:
                    view = view.detach().requires_grad_()
                views[id(slot)] = view
        out = Uploaded({fqn: views[id(slot)] for fqn, slot in self._names[stage].items()},
                       made, moved)
        out.gathers = [(full, full.numel() // self.shard[1]) for full in gathers]
        return out

    def gather_parts(self, stage: int) -> list[tuple[int, torch.dtype]]:
        """``data_parallel="zero3"``: ``(c, dtype)`` of each all-gather the stage's
        ``DeviceAllGather`` posts (one per parameter run: ``c`` elements from each
        rank), in upload order."""
        return [(_chunk(run.stop - run.start, self.shard[1]),
                 _upload_dtype(run.slots[0], self.param_dtype))
                for run in self._runs_of(stage) if not run.slots[0].is_buffer]

    def slot_grads(self, stage: int, uploaded: Uploaded) -> list[torch.Tensor]:
        """Gradient buffers in the parameter slot ``uploaded`` is in (its ``memory``,
        after the stage's parameters, as :meth:`slot_nbytes` lays them out), one per
        trainable view (a tied parameter once), in the views' order: what a device graph
        of the stage's backward adds the gradients into (``runtime.stages.graphs``). Not zeroed."""
        into = uploaded.memory
        at = sum(_slot_align(n) for n in self._run_nbytes(stage))
        out: list[torch.Tensor] = []
        for v in {id(v): v for v in uploaded.values() if v.requires_grad}.values():
            nbytes = v.numel() * v.element_size()
            out.append(into[at:at + nbytes].view(v.dtype).view(v.shape))
            at += _slot_align(nbytes)
        return out

    def trainable(self, stage: int) -> list[tuple[str, torch.Tensor, torch.dtype]]:
        """``(name, parameter, dtype on the device)`` of each parameter of ``stage`` that
        gets a gradient there (a tied one once, under its first name in the stage)."""
        out, seen = [], set()
        for fqn, slot in self._names[stage].items():
            if slot.is_buffer or not slot.tensor.requires_grad or id(slot) in seen:
                continue
            seen.add(id(slot))
            out.append((fqn, slot.tensor, _upload_dtype(slot, self.param_dtype)))
        return out

    def _unique(self, stage: int) -> list[_Slot]:
        return list({id(x): x for x in self._names[stage].values()}.values())

    def _kept(self, stage: int, resident: ResidentBuffers | None) -> dict[int, _Slot]:
        """The stage's slots ``resident`` keeps on the devices: scratch buffers it wants."""
        if resident is None:
            return {}
        return {id(slot): slot for slot in self._unique(stage)
                if slot.is_buffer and is_scratch(slot.tensor) and resident.wants(slot.tensor)}

    def resident_nbytes(self, stage: int, resident: ResidentBuffers | None) -> int:
        """Bytes of the stage's buffers ``resident`` keeps on its device."""
        return sum(slot.numel * slot.tensor.element_size()
                   for slot in self._kept(stage, resident).values())

    def _source(self, run: _Run, part: tuple[int, int] | None = None) -> torch.Tensor:
        """What an upload of ``run`` reads (``part``: its elements ``[lo, hi)`` only)."""
        lo, hi = part if part is not None else (0, run.stop - run.start)
        if run.region is None:   # its page-locked copy, when pinning
            t = run.slots[0].tensor.detach().reshape(-1)
            dtype = _upload_dtype(run.slots[0], self.param_dtype)
            if file_backed(run.slots[0].tensor) is not None:   # (reads the part only)
                return self.host.file_source(run.slots[0], dtype, part)
            staged = self.host.staged(run.slots[0], dtype, self.snapshot)
            return (staged if staged is not None else converted(t, dtype))[lo:hi]
        src = self.host.source(run.slots[0], self.param_dtype, self.snapshot)
        return src[run.start + lo:run.start + hi]

    def release(self, device: Device, uploaded: Uploaded) -> None:
        """Stop counting what :meth:`upload` put on ``device`` (each run once: the memory
        it allocated, whatever the stage's code did to the views, e.g. a module that
        converts its own weights with ``.to()`` in forward, as Switch Transformers' router
        does)."""
        for t in uploaded.runs:
            device.free(t)

    def download_grads(self, stage: int, device: Device,
                       device_grads: Mapping[str, torch.Tensor | None],
                       accumulator: _Claims | None = None) -> dict[str, torch.Tensor]:
        """Bring ``{fqn: device gradient}`` to the host, in the narrower of the device's
        dtype and the masters' gradient dtype.

        Give a tied parameter's gradient once, under any of its names. Returns
        ``{fqn: host gradient}``. A gradient the masters' dtype holds exactly (bf16 under
        ``param_dtype``, fp32 masters) crosses the link as it is, half the bytes: the host
        widens it when it adds it up (``GradAccumulator.add``), which rounds nothing, so
        the result is the one a cast on the device gives. A wider one (an fp32 gradient of
        a weight a module converts in forward, bf16 masters) is cast on the device first.
        With an ``accumulator``, a gradient in the masters' dtype whose parameter has no
        ``.grad`` yet is copied straight into its place in the flat gradient buffer
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
            if g.dtype != dtype and not widens_exactly(g.dtype, dtype):
                # narrowed on the device: the download moves the gradient's own dtype. The
                # cast reads g, made on the compute stream, on this one: its memory must
                # wait for it
                device.record_stream(g)
                g = g.to(dtype)
            dest = accumulator.claim(slot) if accumulator is not None and g.dtype == dtype \
                else None
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


SLOT_ALIGN = 512
"""Where each run of an upload into a parameter slot starts (a multiple of it, as the
CUDA caching allocator aligns its blocks)."""


def _slot_align(nbytes: int) -> int:
    return -(-nbytes // SLOT_ALIGN) * SLOT_ALIGN


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
                and _cast(slot) == _cast(last.slots[0])   # one upload dtype per run
                and slot.offset <= _align(last.stop, dtype)):
            last.stop = max(last.stop, slot.offset + slot.numel)
            last.slots.append(slot)
        else:
            runs.append(_Run(slot.region, slot.offset, slot.offset + slot.numel, [slot]))
    return runs
