"""Stage jobs as device graphs: ``RunConfig(stage_backend="cudagraphs")``.

:func:`graph_jobs` turns each ``Forward`` of a stage that can be captured into a
``GraphForward`` (``3F1g`` in the Program) and each stage ``RecomputeBackward`` into a
``GraphRecomputeBackward`` (``3B1g``). Such a job runs as a device graph
(``runtime.devices.device_graph``) of the stage's compiled code (``runtime.stages.compiled``, as under
``"inductor"``), captured once per *job key*, then replayed: one launch for the host to
issue instead of one per kernel, no Python per op (``runtime.issue.compute`` builds the job:
a forward; a recompute, ``autograd.grad`` and the parameter gradients added into the
slot's gradient buffers).

- **Parameters in fixed places.** A graph reads the buffers its capture saw, so a
  stage's parameters must be uploaded to the same device memory every round. Each device
  keeps two *parameter slots* (:class:`ParamSlots`: the stage it computes and the one it
  prefetches, as the planner's memory model has them), each as large as the largest
  graphed stage the device runs (with its gradients, for a backward). A graphed stage's
  ``Prefetch`` uploads into a free slot (``ParamStore.upload(into=)``) and its
  ``Release`` gives the slot back, freeing nothing. The Program orders a ``Prefetch``
  after the ``Release``s before it, and a ``Release`` after its stage's job and download:
  a slot is written only once the stage before it is done with it.
- **Inputs in fixed places too.** A graph job's ``Upload`` is a ``GraphUpload``
  (``3U1g``, ``passes.dependencies.graph_program``): it copies the host values into the
  job's *input slot* of its microbatch's parity (``StageGraphs.upload``: per device,
  stage, parity and input, a buffer per shape), and the graph captured on that slot
  reads it where it is: a replay copies none of its uploaded inputs in. Two slots, so
  the upload of microbatch ``m + 1`` overlaps job ``m``; the Program orders the upload of
  ``m`` after job ``m - 2``, the slot's last reader (an upload listed before that job
  stays an ``Upload`` into a fresh buffer). ``Free`` leaves the slots. Each keeps
  ``INPUT_SHAPES`` shapes, the least recently used dropped with the graphs reading it.
- **The job key.** (device, stage, forward or backward, slot, the slots' generation, the
  inputs' signature: grad mode, autocast, each input's shape, strides and dtype,
  non-tensor inputs by value; the input slots it reads). A new key is captured
  (``graph_captures`` in ``pipe.stats()``; the capture's own run is that call's
  result), a known one replayed (``graph_replays``). Each job (device, stage, forward or
  backward) keeps at most ``GRAPHS_PER_JOB`` graphs, the least recently replayed
  dropped: data whose lengths cycle through a few values captures each once (per
  parameter slot and input slot) and then only replays, and data of ever new lengths
  does not grow the devices' graph memory without bound.
- **Other inputs, outputs.** The capture copies an input that is not in an input slot
  (a value made on the device, a gradient coming in) into a *static* buffer it keeps;
  each replay copies the microbatch's into it first. A replay overwrites the graph's
  outputs: they are cloned at once (activations or input gradients, as an eager job's
  are).
- **The static-address rule** is checked at every replay: the slot's tensors the job
  reads and writes now must be the ones the capture saw, else :class:`GraphReplayError`
  (on a GPU the replay would compute garbage silently). On a strict virtual device
  (cuda-sim) a replay reading device memory freed since its capture raises too
  (``device_graph.EmulatedGraph``).
- **What is not captured** (:func:`not_capturable`): stages that write buffers back to
  the host (BatchNorm statistics, a KV cache), draw random numbers, read a scratch
  buffer, or run a block as its module (an MoE block captured at block granularity:
  its routing is Python a replay would not run); the fused tail (the caller's ``loss_fn`` runs between its forward and
  backward); ``recompute_grain="layer"`` pieces. They run the compiled code. A graphed
  stage's ``Prefetch`` that finds no free slot (a Program holding three stages on a
  device) uploads as usual and its jobs run the compiled code (``graph_fallbacks``).
- **Memory.** The parameter slots (``"params"``), the input slots and the graphs' static
  inputs and outputs (``"workspace"``) stay on the devices between calls, until
  ``pipe.close()`` (``predict_memory`` counts them: ``passes.stage_memory.with_graphs``).

Not to be confused with ``runtime.devices.device_graph`` (one captured function on one device)
or ``runtime.stages.compiled`` (the inductor code a graph captures).
"""

from __future__ import annotations

import dataclasses
import itertools
import operator
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from fxpipe import ops  # noqa: F401 — registers torch.ops.fxpipe.*, which stages call
from fxpipe.passes.dependencies import graph_program
from fxpipe.passes.stage import Executable, Stage
from fxpipe.runtime.stages.compiled import _signature
from fxpipe.runtime.devices.device import Device
from fxpipe.runtime.devices.device_graph import DeviceGraph, GraphReplayError
from fxpipe.runtime.devices.issue_lock import blocking
from fxpipe.runtime.host.params import is_scratch

SLOTS = 2
_CAPTURING = threading.Lock()   # taken after the issue lock is let go, never before it


def not_capturable(stage: Stage) -> str | None:
    """Why ``stage``'s jobs cannot be device graphs, or None if they can."""
    if stage.random:
        return "it draws random numbers (a replay would repeat the capture's)"
    if any("random" in n.meta for n in stage.gm.graph.nodes):   # passes.blocks.call_blocks
        return ("it runs a block as its module (captured at block granularity: its Python "
                "may branch on tensor values, which a replay would not redo)")
    if any(n.target is torch.ops.fxpipe.writeback.default for n in stage.gm.graph.nodes):
        return "it writes buffers back to the host (a host copy per run)"
    if any(is_scratch(operator.attrgetter(f)(stage.gm)) for f in stage.params):
        return "it reads a scratch buffer (a KV cache: rows and positions change per call)"
    return None


def graph_jobs(exe: Executable) -> Executable:
    """``exe`` with each job of a stage that can be captured as its graph action: a
    ``Forward`` as a ``GraphForward`` (``3F1g``), a stage's ``RecomputeBackward`` as a
    ``GraphRecomputeBackward`` (``3B1g``; at ``recompute_grain="layer"`` the per-layer
    backward stays as it is), and their uploads into the jobs' input slots
    (``GraphUpload``, ``3U1g``; ``passes.dependencies.graph_program``): what a call under
    ``stage_backend="cudagraphs"`` runs and ``pipe.program()`` prints."""
    graphed = {i for i, st in exe.stages.items() if not_capturable(st) is None}
    return dataclasses.replace(exe, program=graph_program(exe.program, graphed))


class ParamSlots:
    """One device's parameter slots: ``SLOTS`` blocks of ``nbytes`` (counted as
    ``"params"``), and which stage holds each."""

    def __init__(self, device: Device, nbytes: int, generation: int):
        self.device = device
        self.nbytes = nbytes
        self.generation = generation
        self.memory = [device.empty(nbytes, "params", f"parameter slot {i} of the stage graphs")
                       for i in range(SLOTS)]
        self.holder: list[int | None] = [None] * SLOTS

    def free(self) -> None:
        for t in self.memory:
            self.device.free(t)
        self.memory = []


GRAPHS_PER_JOB = 16
"""Graphs kept per job (device, stage, forward or backward): two parameter slots times
two input slots (microbatch parities) times four input signatures (sequence lengths, say)."""

INPUT_SHAPES = 4
"""Input slot buffers kept per device, stage, microbatch parity and input: four shapes
(sequence lengths, say), as ``GRAPHS_PER_JOB`` keeps graphs for four signatures."""


class GraphJob:
    """A stage job captured as a device graph: its static inputs (tensors the capture
    copied each input into), the addresses of the slot's tensors it read and wrote (the
    stage's parameters, a backward's gradient buffers), and the graph."""

    def __init__(self, graph: DeviceGraph, statics: Sequence[torch.Tensor],
                 params: Sequence[torch.Tensor], name: str):
        self.graph = graph
        self.statics = tuple(statics)   # an input slot itself, where the upload wrote it
        self.addresses = tuple(p.data_ptr() for p in params)
        self.name = name
        self._checked: Sequence[torch.Tensor] | None = None   # the tensors last checked

    def replay(self, tensors: Sequence[torch.Tensor], params: Sequence[torch.Tensor]) -> tuple:
        """The job on new inputs (``tensors``: the job's tensor inputs, in order) with
        the stage's parameters as uploaded now: the outputs, cloned (the next replay
        overwrites the graph's own)."""
        if params is not self._checked:   # once per upload (its microbatches share the list)
            self._check(params)
        with torch.no_grad():
            for static, x in zip(self.statics, tensors):
                if static is not x:   # (an input slot: the GraphUpload wrote it there)
                    static.copy_(x)
            outs = self.graph.replay()
            return tuple(o.clone() if isinstance(o, torch.Tensor) else o for o in outs)

    def _check(self, params: Sequence[torch.Tensor]) -> None:
        for i, (p, at) in enumerate(zip(params, self.addresses)):
            if p.data_ptr() != at:
                raise GraphReplayError(
                    f"{self.name}: parameter {i} ({tuple(p.shape)} {p.dtype}) is at another "
                    "address than when the graph was captured: a replay would read the old "
                    "buffer (garbage on a GPU). Under stage_backend='cudagraphs' every upload "
                    "of a stage goes into the same parameter slot (runtime.stages.graphs)")
        self._checked = params


class StageGraphs:
    """A pipe's parameter slots (per device index) and captured jobs (per job key).
    Thread-safe: each device's issue and stream threads use their own entries."""

    def __init__(self) -> None:
        self._slots: dict[int, ParamSlots] = {}
        self._jobs: dict[tuple, GraphJob] = {}
        # per job (device, stage, kind): its keys, least recently used first
        self._recent: dict[tuple, dict[tuple, None]] = {}
        # (device, stage) -> the slot it last took: taken again while free, so its jobs'
        # keys (the slot is part of them) do not depend on which Release ran first
        self._last: dict[tuple[int, int], int] = {}
        self._lock = threading.Lock()
        self._generations = itertools.count()
        # input slots: (device, stage job, parity, input) -> {(shape, dtype): buffer},
        # least recently used first; and id(buffer) -> its full key (graph keys name it)
        self._inputs: dict[tuple, dict[tuple, torch.Tensor]] = {}
        self._slotted: dict[int, tuple] = {}
        self._on: dict[int, Device] = {}   # id(buffer) -> its device

    # -- parameter slots (Prefetch, Release) ---------------------------------------------
    def take(self, lane: int, device: Device, stage: int, nbytes: int, size: int
             ) -> tuple[tuple[int, int], torch.Tensor] | None:
        """A free slot of ``lane``'s device for ``stage`` (``nbytes`` of parameters):
        ``((slot, generation), memory)``, or None (none free, or too small while held).
        The slot the stage took last, if free: two free slots are taken by the stage that
        held each before, not by which of their Releases (on another stream than the
        Prefetch) ran first, so a step's graphs keep their keys and replay.
        Slots too small, or of another device, are made again at ``size`` bytes once
        none is held (the device's graphs then are dropped: they read the old slots; a
        GPU first finishes what it queued, which may still read them)."""
        with self._lock:   # (only this lane's issue thread takes and drops its slots)
            slots = self._slots.get(lane)
            regrow = slots is None or slots.device is not device or slots.nbytes < nbytes
            if regrow and slots is not None and any(h is not None for h in slots.holder):
                return None
        if regrow:
            if slots is not None:
                if slots.device.runs_at_issue:   # a GPU: queued work may still read them;
                    with blocking():             # waited for with the issue lock let go
                        slots.device.synchronize()
                with self._lock:
                    self._drop(lane)
            made = ParamSlots(device, max(size, nbytes), next(self._generations))
            with self._lock:
                slots = self._slots[lane] = made
        with self._lock:
            last = self._last.get((lane, stage))
            free = [i for i, holder in enumerate(slots.holder) if holder is None]
            if not free:
                return None
            i = last if last in free else free[0]
            slots.holder[i] = stage
            self._last[(lane, stage)] = i
            return (i, slots.generation), slots.memory[i]

    def give(self, lane: int, slot: tuple[int, int]) -> None:
        """``Release``: the stage in ``slot`` is done with it."""
        with self._lock:
            slots = self._slots.get(lane)
            if slots is not None and slots.generation == slot[1]:
                slots.holder[slot[0]] = None

    def _drop(self, lane: int) -> None:
        self._slots.pop(lane).free()
        for key in [k for k in self._jobs if k[0] == lane]:
            self._forget(key)

    def _forget(self, key: tuple) -> None:
        """Drop the graph of ``key`` (hold ``_lock``): its memory is freed once no
        replay holds it."""
        del self._jobs[key]
        recent = self._recent[key[:3]]
        del recent[key]
        if not recent:
            del self._recent[key[:3]]

    def _used(self, key: tuple) -> None:
        """``key`` was just replayed or captured (hold ``_lock``): the job's most recent,
        and its least recent dropped beyond ``GRAPHS_PER_JOB``."""
        recent = self._recent.setdefault(key[:3], {})
        recent.pop(key, None)
        recent[key] = None
        while len(recent) > GRAPHS_PER_JOB:
            self._forget(next(iter(recent)))

    # -- input slots (GraphUpload) -------------------------------------------------------
    def upload(self, lane: int, device: Device, key: tuple, host: torch.Tensor,
               owner: str) -> torch.Tensor:
        """``GraphUpload``: ``host`` copied into input slot ``key`` (stage job, microbatch
        parity, input) of its shape and dtype on ``lane``'s device, made at its first use
        (``"workspace"``, kept until :meth:`close`). A graph captured on it reads it in
        place: its replays copy nothing in. The Program orders the upload after the
        slot's last reader (``GraphUpload``). A shape unused for ``INPUT_SHAPES`` others
        is dropped, with the graphs reading it (a GPU first finishes what it queued)."""
        shape = (tuple(host.shape), host.dtype)
        with self._lock:
            kept = self._inputs.setdefault((lane, *key), {})
            buf = kept.pop(shape, None)
            if buf is not None:
                kept[shape] = buf
        if buf is not None and self._on[id(buf)] is not device:   # the pipe's devices changed
            self._drop_input(kept, shape)
            buf = None
        if buf is None:
            if len(kept) >= INPUT_SHAPES:
                self._drop_input(kept, next(iter(kept)))
            nbytes = host.numel() * host.element_size()
            buf = device.empty(nbytes, "workspace", owner).view(host.dtype).view(host.shape)
            with self._lock:
                kept[shape] = buf
                self._slotted[id(buf)] = (lane, *key, shape)
                self._on[id(buf)] = device
        return device.copy_into(host, buf)

    def _drop_input(self, kept: dict[tuple, torch.Tensor], shape: tuple) -> None:
        """Free the input slot ``kept[shape]`` and forget the graphs that read it."""
        device = self._on[id(kept[shape])]
        if device.runs_at_issue:   # a GPU: queued replays may still read it
            with blocking():
                device.synchronize()
        with self._lock:
            buf = kept.pop(shape)
            full = self._slotted.pop(id(buf))
            del self._on[id(buf)]
            for k in [k for k in self._jobs if full in k[-1]]:
                self._forget(k)
        device.free(buf)

    def holds(self, t: Any) -> bool:
        """Whether ``t`` is an input slot (``Free`` leaves it: its graphs read it again)."""
        return id(t) in self._slotted

    # -- jobs ------------------------------------------------------------------------------
    def run(self, lane: int, key: tuple, inputs: Sequence[Any], params: Sequence[torch.Tensor],
            device: Device, job: Callable[[list, tuple], Sequence[Any]], name: str,
            stats: Any = None) -> tuple:
        """The job ``key`` on device ``lane`` on ``inputs`` (tensors and constants, as the
        job reads them) with ``params`` (the tensors in its parameter slot it reads or
        writes): replayed if captured, else captured first (``job(inputs, params)`` runs
        it, on the graph's own copies of the tensor inputs; the inputs' signature is
        part of the key)."""
        tensors = [x for x in inputs if isinstance(x, torch.Tensor)]
        slotted = self._slotted
        # the input slots it reads in place are part of the key (the graph reads them)
        key = (lane, *key, _signature(inputs), tuple(slotted.get(id(x)) for x in tensors))
        with self._lock:
            captured = self._jobs.get(key)
            if captured is not None:
                self._used(key)
        if captured is not None:
            if stats is not None:
                stats.add("graph_replays")
            return captured.replay(tensors, params)
        where = [i for i, x in enumerate(inputs) if isinstance(x, torch.Tensor)]
        constants = [None if isinstance(x, torch.Tensor) else x for x in inputs]

        def fn(*given: torch.Tensor) -> Sequence[Any]:   # (its closure holds no input)
            xs = list(constants)
            for i, t in zip(where, given):
                xs[i] = t
            return job(xs, given[len(where):])

        with device.allocating("workspace"):
            statics = [x if id(x) in slotted else x.detach().clone() for x in tensors]
            # a capture drains its device: other devices issue meanwhile, with the issue
            # lock let go; captures one at a time in the process (two threads capturing at
            # once, each draining and emptying the caching allocator, is untested ground),
            # each after its drain (no capture waits for another device's queue)
            with blocking():
                device.drain_for_capture()
                with _CAPTURING:
                    graph = device.capture(fn, [*statics, *params], name)
        with self._lock:
            self._jobs[key] = GraphJob(graph, statics, params, name)
            self._used(key)
        if stats is not None:
            stats.add("graph_captures")
        # the capture's own run is this call's (its writes into ``params`` happened once)
        return tuple(o.clone() if isinstance(o, torch.Tensor) else o for o in graph.first)

    def captured(self) -> int:
        """How many jobs are captured."""
        with self._lock:
            return len(self._jobs)

    def close(self) -> None:
        """Drop every graph and free the slots (``pipe.close()``)."""
        with self._lock:
            for lane in list(self._slots):
                self._drop(lane)
            self._jobs.clear()
            self._recent.clear()
            kept = [buf for bufs in self._inputs.values() for buf in bufs.values()]
            on, self._on = self._on, {}
            self._inputs.clear()
            self._slotted.clear()
        for buf in kept:
            on[id(buf)].free(buf)
