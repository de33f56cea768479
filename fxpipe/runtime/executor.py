"""The executor: interprets one ``Executable`` (``fxpipe.passes.stage``) for one call.

It is deliberately dumb. Each device's actions are issued, in Program order, by that
device's own host thread (the host lane's by one more): an action is submitted to the
stream of its device the Program names, with the events of its dependencies
(``Program.dependencies()``) as waits, once those were issued. Issuing waits for device
work in one place only: before a ``Prefetch`` allocates, until the parameters released
so far are past every stream that read them (``Device.wait_released``: the host stays
at most the two resident stages ahead of a device's memory; ``issue_waits``). Otherwise
it queues kernels and copies after ``wait_event``s. The host lane's actions wait for
exactly the events they read (an optimizer step reading downloaded gradients), and the
caller for the end of the call; ``Commit`` runs on the caller's thread after that. Each
action kind has one handler (``Execution._act``, a ``match`` on the action class), and
what a handler moves or drops is what ``Program.flow`` says: the executor decides
nothing the Program does not show. Stages run through ``runtime.interpret``: the printed
stage code, the Executable's own GraphModules.

The host never reads data a copy may still be writing: values and gradient parts that
come through the host go back to a device as they are (the device sums gradient parts),
and downloaded parameter gradients are read by host actions only (an ``OptimizerStep``
after its downloads' events, the ``Commit`` after the call's end).

Who owns what: each device's values, gradients and resident parameters live in its
``_OnDevice`` (only that device's actions touch them; its lock orders its streams);
the host's per-microbatch values and gradient parts live in ``_OnHost`` (one lock).
Values are keyed by the compute that made or received them, ``(stage, microbatch,
name)``, so two actions never write the same slot.

Parameter gradients accumulate on the device over a stage job, go to the host once per
job (``DownloadGrads``), and reach ``.grad`` at the ``Commit`` (or at a streamed
``OptimizerStep``). Any failure is raised as ``StageError`` naming stage, layers, device
and microbatch, after every submitted action has finished and device memory is freed.
``Execution.stats`` counts what the call did (``pipe.stats()``).
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree

from fxpipe.errors import DeviceMemoryError, DistributedError, StageError
from fxpipe.passes.layer_graph import LayerGraph
from fxpipe.passes.program import (
    HOST, LABEL, Accumulate, AllGather, AllReduce, AsyncUpdate, BroadcastBuffers, Checkpoint,
    ClipGradNorm, Collective, Commit, DownloadGrads, Forward, Free, FusedBackward, Offload,
    OptimizerStep, Prefetch, QueueUpdate, RecomputeBackward, ReduceScatter, Refresh, Release,
    ScalerStep, Upload, UploadGrad, stream_of,
)
from fxpipe.passes.stage import Executable, Stage
from fxpipe.runtime import tail
from fxpipe.runtime.amp import AutocastState, reentered
from fxpipe.runtime.devices import Device, Event, InlineDevice, emulated_wait
from fxpipe.runtime.interpret import run_stage
from fxpipe.runtime.interrupts import deferred_interrupt
from fxpipe.runtime.params import GradAccumulator, ParamStore
from fxpipe.runtime.timer import LayerTimer


# One issue thread at a time runs an action's Python (on a device that runs it when it is
# submitted: a GPU's host part). Every torch op lets go of the GIL; with several threads
# wanting it, each op would hand it to another thread and wait to get it back. Waiting
# for dependencies and for released memory happens outside; inside, a CudaDevice waits
# only for host-lane work, which never takes this lock.
_ISSUING = threading.Lock()
_NO_LOCK = contextlib.nullcontext()


class _IssueThread:
    """A thread that issues one lane's actions per call, kept between calls (starting a
    thread costs the caller about a millisecond)."""

    def __init__(self) -> None:
        self.work: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._loop, daemon=True, name="fxpipe-issue-idle").start()

    def _loop(self) -> None:
        me = threading.current_thread()
        while True:
            name, fn, done, threads = self.work.get()
            me.name = name
            if torch.get_num_threads() != threads:   # as a thread started now would
                torch.set_num_threads(threads)
            try:
                fn()   # catches what stops issuing itself (``Execution._issue``)
            except BaseException:  # noqa: BLE001 — never lose the thread: it is reused
                traceback.print_exc()
            finally:
                fn = None
                me.name = "fxpipe-issue-idle"
                with _idle_lock:
                    _idle.append(self)
                done.set()


_idle: list[_IssueThread] = []
_idle_lock = threading.Lock()


def _issue_thread(name: str, fn: Callable[[], None]) -> threading.Event:
    """Run ``fn`` on an idle issue thread (a new one if none is idle), named ``name``
    while it runs, with the caller's intra-op thread count (what a thread started now
    would take); the event is set once it returned."""
    with _idle_lock:
        worker = _idle.pop() if _idle else None
    if worker is None:
        worker = _IssueThread()
    done = threading.Event()
    worker.work.put((name, fn, done, torch.get_num_threads()))
    return done


def _forget_issue_threads() -> None:
    """In a forked child the issue threads are gone: start afresh."""
    _idle.clear()


os.register_at_fork(after_in_child=_forget_issue_threads)


# The host lane's ``host`` stream: its actions run when they are issued, on the host
# lane's issue thread (a host action is host work: there is nothing to queue).
_ON_HOST = InlineDevice(name="host")


class _Where(threading.local):
    """What this thread is doing for a call: the action whose work it runs, or the
    documented work a call does outside its Program (``outside_program``)."""

    action: str | None = None
    outside: str | None = None


WHERE = _Where()


@contextlib.contextmanager
def _acting(label: str) -> Iterator[None]:
    was, WHERE.action = WHERE.action, label
    try:
        yield
    finally:
        WHERE.action = was


@contextlib.contextmanager
def outside_program(why: str) -> Iterator[None]:
    """Mark tensor work a call does outside its Program's actions, and why. Only two
    kinds exist: splitting the caller's inputs (and labels, output gradients) into
    microbatches before the Program runs, and summing the microbatches' losses (or
    input gradients) for the caller after it ended. Everything else a call does to
    tensors is an action's work (``tests/test_program_only.py`` checks it)."""
    was, WHERE.outside = WHERE.outside, why
    try:
        yield
    finally:
        WHERE.outside = was


class Cancelled(RuntimeError):
    """Raised inside actions once a call has been interrupted."""


@dataclass
class Call:
    """One call of an Executable: what it needs, and (after ``Execution.run``) its results.

    ``phase``: which of the Program's actions this call runs (``Program.phase``): all of
    them, or for a ``"train"`` Executable its ``"forward"`` (``pipe(x)``) or
    ``"backward"`` (``.backward()``) half. ``commit``: what the ``Commit`` action does
    (the caller's: merge results, write gradients and buffers, all or nothing).
    """

    exe: Executable
    layers: LayerGraph
    store: ParamStore
    devices: list[Device]
    inputs: list[dict[str, Any]]             # per microbatch: value name -> host value
    phase: str = "all"
    call_seed: int | None = None
    labels: list[Any] | None = None          # fused: per microbatch label
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None
    loss_weights: list[float] | None = None
    out_grads: list[dict[str, torch.Tensor]] | None = None   # train backward: output grads
    timer: LayerTimer | None = None
    optimizer: Any = None                    # fxpipe.optim's part of the call (host lane)
    dp: Any = None                           # runtime.distributed.DataParallel (collectives)
    autocast: AutocastState = ()             # the caller's autocast regions (runtime.amp)
    differentiable: frozenset[str] | None = None  # values that may have a gradient (None: all)
    commit: Callable[[], None] | None = None
    record: list[tuple[int, str]] | None = None   # executed (lane, action) pairs, if tracing
    # results
    host: list[dict[str, Any]] = field(default_factory=list)
    grads: list[dict[str, torch.Tensor]] = field(default_factory=list)
    losses: dict[int, torch.Tensor] = field(default_factory=dict)
    writebacks: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    accumulator: GradAccumulator | None = None
    stats: Stats | None = None
    snapshot: dict[str, torch.Tensor] | None = None   # the buffers, as the Refresh saved them
    committed: bool = False                           # the Commit has written its results


class _OnHost:
    """The call's host side: per microbatch, values (inputs and what ``Offload`` brought)
    and gradient parts (what ``Offload`` brought, the user's output gradients), kept as
    they came: the host does not add parts a copy may still be writing."""

    def __init__(self, call: Call):
        self.lock = threading.Lock()
        self.values = call.host
        self.grads = call.grads

    def value(self, m: int, name: str) -> Any:
        with self.lock:
            return self.values[m][name]

    def put(self, m: int, name: str, value: Any) -> None:
        with self.lock:
            self.values[m][name] = value

    def add_grad(self, m: int, name: str, g: torch.Tensor) -> None:
        with self.lock:
            self.grads[m].setdefault(name, []).append(g)

    def take_grads(self, m: int, name: str) -> list[torch.Tensor]:
        with self.lock:
            return self.grads[m].pop(name, [])


class _OnDevice:
    """What one device holds for a call. Keys are ``(stage, microbatch, name)`` of the
    compute that made or received the tensor (see the module docstring)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.params: dict[int, dict[str, torch.Tensor]] = {}   # stage -> resident tensors
        self.uploaded: dict[tuple[int, int, str], Any] = {}    # Upload copies for a compute
        self.made: dict[tuple[int, int, str], Any] = {}        # values a compute made
        self.parts: dict[tuple[int, int, str], torch.Tensor] = {}  # input grads a backward made
        self.host_grads: dict[tuple[int, int, str], list[torch.Tensor]] = {}  # UploadGrad copies
        self.consumed: dict[tuple[int, int], list[torch.Tensor]] = {}  # grads a compute took
        self.checkpoints: dict[tuple[int, int], _Checkpoint] = {}

    def tensors(self) -> Iterator[Any]:
        """Everything still held (for cleanup after a failure)."""
        for table in (self.uploaded, self.made, self.parts):
            yield from pytree.tree_leaves(list(table.values()))
        for parts in self.host_grads.values():
            yield from parts
        for taken in self.consumed.values():
            yield from taken
        for ck in self.checkpoints.values():
            yield from pytree.tree_leaves((ck.saved, ck.grads))


@dataclass
class _Checkpoint:
    """``recompute_grain="layer"``: each layer's inputs kept by ``Checkpoint``, and the
    gradients flowing back through the per-layer backwards."""

    saved: dict[int, list[Any]]
    grads: dict[str, torch.Tensor | None] = field(default_factory=dict)


STATS = ("actions", "host_waits", "h2d_bytes_params", "h2d_bytes_activations",
         "d2h_bytes_activations", "d2h_bytes_grads", "generated_runs",
         "host_stalls", "host_pinned_bytes", "issue_waits", "allocator_flushes",
         "host_issue_us")


class Stats:
    """Counters of one call (``pipe.stats()``): actions executed; host waits for device
    work (a host action waiting for the events it reads, the end of the call); bytes
    moved by kind and direction; stage runs (``generated_runs``: each stage's runnable
    code, ``runtime.interpret``); host time spent issuing, in microseconds
    (``host_issue_us``, and per action kind ``host_issue_us.<Kind>``). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(STATS, 0)

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    def issued(self, kind: str, seconds: float) -> None:
        """``seconds`` of host time issuing one action of ``kind``."""
        us = round(seconds * 1e6)
        with self._lock:
            self._counts["host_issue_us"] += us
            key = f"host_issue_us.{kind}"
            self._counts[key] = self._counts.get(key, 0) + us

    def as_dict(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


class _Issued:
    """One action as its issue thread submitted it: the event it completes, and what its
    start waited for (a ``Dep`` on its start waits for the same)."""

    __slots__ = ("ready", "event", "gate")

    def __init__(self) -> None:
        self.ready = threading.Event()
        self.event: Event | None = None
        self.gate: list[Event] = []


class Execution:
    """One run of a Call (create, ``run()``, read the Call's results)."""

    def __init__(self, call: Call):
        self.call = call
        self.program = call.exe.program
        self.flow = self.program.flow
        M = self.program.num_microbatches
        call.host = [dict(x) for x in call.inputs]
        if LABEL in self.program.inputs:   # the fused loss's label: uploaded like an input
            for m, values in enumerate(call.host):
                values[LABEL] = call.labels[m]
        call.grads = [{n: [g] for n, g in gs.items()}
                      for gs in (call.out_grads or [{} for _ in range(M)])]
        call.accumulator = GradAccumulator(call.store)
        self.on_host = _OnHost(call)
        self.on = [_OnDevice() for _ in call.devices]
        self.stats = call.stats = Stats()
        self.downloads: dict[int, list[dict[str, torch.Tensor]]] = {}  # stage -> host grads
        self.downloads_lock = threading.Lock()
        self.shards: dict[tuple[int, int], list] = {}   # layers -> ReduceScatter's shards
        self.cancelled = threading.Event()
        self.record_lock = threading.Lock()

    # -- issuing -------------------------------------------------------------------------
    def run(self) -> None:
        """Issue every action of the call's phase, one issue thread per lane; wait for the
        end of the call; then run its ``Commit``. Raise the first failure (after everything
        submitted ended and device memory is freed)."""
        p = self.program
        deps = p.dependencies()
        phase = self.call.phase
        keep = p.issued(phase)
        if self.call.dp is not None:
            self.call.dp.begin(self.call.dp.plan_ops(
                [a for a, k in zip(p.host, keep[HOST]) if k and isinstance(a, Collective)],
                self.call.exe, self.call.layers, self.call.store))
        slots: dict[tuple[int, int], _Issued] = {}
        lanes: list[tuple[int, list[int]]] = []
        # the Commit and what follows it in the host lane run once the call has ended
        at = next((i for i, a in enumerate(p.host) if keep[HOST][i] and isinstance(a, Commit)),
                  len(p.host))
        for lane, acts in p.lanes():
            idxs = [i for i, a in enumerate(acts) if keep[lane][i]
                    and not (lane == HOST and i >= at)]
            slots.update({(lane, i): _Issued() for i in idxs})
            if idxs:
                lanes.append((lane, idxs))
        issuing: list[threading.Event] = []
        interrupt: BaseException | None = None
        try:
            # every lane gets its issue thread (others may wait on its lane); a Ctrl-C held
            # until then is raised here, and stops them as one arriving later does
            with deferred_interrupt():
                for lane, idxs in lanes:
                    issuing.append(_issue_thread(
                        f"fxpipe-issue-{'host' if lane == HOST else lane}",
                        lambda lane=lane, idxs=idxs: self._issue(lane, idxs, deps, keep, slots)))
            for done in issuing:
                done.wait()   # until everything is issued: no device work is waited for here
        except BaseException as e:  # noqa: BLE001 — e.g. Ctrl-C: stop, clean up, re-raise
            self._cancel(e)
            interrupt = e
        for done in issuing:
            while not done.is_set():
                try:
                    done.wait()
                except BaseException as e:  # noqa: BLE001 — a second Ctrl-C: still clean up
                    self._cancel(e)
                    interrupt = interrupt or e
        failure = self._wait_all(slots)
        if interrupt is not None and not isinstance(failure, KeyboardInterrupt):
            failure = interrupt
        if failure is not None:
            self._cleanup()
            if self.call.dp is not None:
                self.call.dp.drain()   # the collectives the other ranks wait for, with zeros
            raise failure
        self._check_empty()
        # the call has ended: what came to the host has landed, the host may read it
        for i in range(at, len(p.host)):
            if keep[HOST][i]:
                self._work(HOST, p.host[i])()

    def _issue(self, lane: int, idxs: list[int], deps, keep, slots) -> None:
        """Issue ``lane``'s actions in Program order: each once its dependencies were
        issued, with their events as the stream's waits."""
        acts = self.program.lane(lane)
        done = 0
        try:
            for i in idxs:
                a = acts[i]
                waits: list[Event] = []
                for dep in deps[lane][i]:
                    key = (dep.device, dep.step)
                    if not keep[key[0]][key[1]]:
                        continue
                    src = slots[key]
                    src.ready.wait()
                    waits.extend([src.event] if dep.on == "end" else src.gate)
                waits = list({id(e): e for e in waits}.values())
                if isinstance(a, Prefetch) and self.call.devices[lane].wait_released():
                    self.stats.add("issue_waits")   # the memory it needs is not free yet
                slot = slots[(lane, i)]
                slot.gate = waits
                if lane == HOST and waits:
                    self.stats.add("host_waits")  # a host action reads what those events made
                if lane == HOST:   # host work: run now; collectives on their own thread
                    worker = self.call.dp.worker if isinstance(a, Collective) else _ON_HOST
                    slot.event = worker.submit("compute", self._work(lane, a), wait=waits,
                                               label=str(a))
                else:
                    worker = self.call.devices[lane]
                    with _ISSUING if worker.runs_at_issue else _NO_LOCK:
                        start, _ = time.perf_counter(), emulated_wait()
                        slot.event = worker.submit(stream_of(a), self._work(lane, a),
                                                   wait=waits, label=str(a))
                        self.stats.issued(type(a).__name__,
                                          time.perf_counter() - start - emulated_wait())
                slot.ready.set()
                done += 1
        except BaseException as e:  # noqa: BLE001 — whatever stops issuing fails the rest
            self._cancel(e)
            for i in idxs[done:]:
                failed = Event(str(acts[i]))
                failed._finish(exc=e)
                slots[(lane, i)].event = failed
                slots[(lane, i)].ready.set()

    def _wait_all(self, slots: dict[tuple[int, int], _Issued]) -> BaseException | None:
        """The end of the call: wait for every action; the failure to raise is the cause,
        not the ``Cancelled`` of actions that started after it (whatever their order)."""
        self.stats.add("host_waits")
        events = [slot.event for slot in slots.values() if slot.event is not None]
        failures = []
        # latest first: those end last, so the caller wakes once, not once per action
        for ev in reversed(events):
            try:
                exc = ev.exception()
            except BaseException as e:  # noqa: BLE001 — e.g. KeyboardInterrupt while waiting
                self._cancel(e)
                exc = e
            if exc is not None:
                failures.insert(0, exc)  # in issue order
        if not failures:
            return None
        for ev in events:  # everything submitted has finished; make sure of it
            ev._done.wait()
        return next((e for e in failures if not isinstance(e, Cancelled)), failures[0])

    def _work(self, lane: int, a) -> Callable[[], None]:
        def work():
            # the previous call's update is owed whatever happens to this call
            if self.cancelled.is_set() and not isinstance(a, AsyncUpdate):
                raise Cancelled(f"{a}: the call was interrupted")
            try:
                with _acting(str(a)):
                    self._act(lane, a)
            except DistributedError as e:
                if self.cancelled.is_set():  # this rank's own failure aborted the collective
                    raise Cancelled(f"{a}: the call was interrupted") from e
                self._cancel(e)
                raise
            except (StageError, Cancelled, DeviceMemoryError, KeyboardInterrupt) as e:
                self._cancel(e)  # these already say where, or are the user's
                traceback.clear_frames(e.__traceback__)
                raise
            except BaseException as e:
                # the traceback stays readable, but its frames no longer hold the action's
                # tensors: an exception the caller keeps does not keep device memory
                traceback.clear_frames(e.__traceback__)
                error = self._stage_error(lane, a, e)
                self._cancel(error)
                raise error from e
            self._recorded(lane, a)
        return work

    def _cancel(self, exc: BaseException) -> None:
        """Stop the call: actions that have not started raise ``Cancelled``; with data
        parallel, every other rank's collectives fail too (``DataParallel.fail``)."""
        first = not self.cancelled.is_set()
        self.cancelled.set()
        if first and self.call.dp is not None and not isinstance(exc, Cancelled):
            self.call.dp.fail(exc)

    def _recorded(self, lane: int, a) -> None:
        self.stats.add("actions")
        if self.call.record is not None:
            with self.record_lock:
                self.call.record.append((lane, str(a)))

    def _stage_error(self, lane: int, a, e: BaseException) -> StageError:
        s = getattr(a, "stage", None)
        if lane == HOST:   # a host action: name its layers (or what it covers)
            layers = getattr(a, "layers", None)
            what = (f" of layers {layers.start}-{layers.stop - 1}" if layers else
                    " of the buffers" if isinstance(a, Collective) else "")
            return StageError(f"{type(a).__name__} ({a}){what} on the host, failed: "
                              f"{type(e).__name__}: {e}", layers=layers, device="host",
                              action=str(a))
        st = self.call.exe.stages.get(s) if s is not None else None
        mb = getattr(a, "mb", None)
        names = ", ".join(self.call.layers.layers[i].name for i in st.layers) if st else "?"
        span = f"layers {st.layers.start}-{st.layers.stop - 1} ({names})" if st else ""
        where = f"microbatch {mb}" if mb is not None else "the stage job"
        device = "host" if lane == HOST else self.call.devices[lane].name
        return StageError(
            f"{type(a).__name__} of stage {s if s is not None else '?'} [{span}] on "
            f"{device}, {where}, failed: {type(e).__name__}: {e}",
            stage=s, layers=st.layers if st else None, device=device, microbatch=mb,
            action=str(a))

    # -- actions: one handler per kind ----------------------------------------------------
    def _act(self, lane: int, a) -> None:
        match a:
            case Prefetch(stage=s):
                kind = self.program.stages[s].kind
                params = self.call.store.upload(s, self.call.devices[lane],
                                                requires_grad=kind != "fwd")
                self.stats.add("h2d_bytes_params", self.call.store.nbytes(s))
                with self.on[lane].lock:
                    self.on[lane].params[s] = params
            case Upload(stage=s, mb=m):
                self._upload(lane, s, m)
            case UploadGrad(stage=s, mb=m):
                self._upload_grads(lane, s, m)
            case Forward(stage=s, mb=m):
                self._forward(lane, s, m)
            case FusedBackward(stage=s, mb=m):
                self._fused(lane, s, m)
            case Checkpoint(stage=s, mb=m):
                self._checkpoint(lane, s, m)
            case RecomputeBackward(stage=s, mb=m, layer=None):
                self._recompute_backward(lane, s, m)
            case RecomputeBackward(stage=s, mb=m, layer=layer):
                self._layer_backward(lane, s, m, layer)
            case Offload(stage=s, mb=m):
                self._offload(lane, s, m)
            case Free(stage=s, mb=m):
                self._free(lane, s, m)
            case DownloadGrads(stage=s):
                self._download_grads(lane, s)
            case Release(stage=s):
                on = self.on[lane]
                with on.lock:
                    params = on.params.pop(s)
                self.call.store.release(self.call.devices[lane], params)
            case Refresh():
                self._refresh()
            case Accumulate(layers=layers):
                self._take_downloads([self.program.backward_stage_of[(layers.start,
                                                                      layers.stop)]])
            case AsyncUpdate():
                self.call.optimizer.apply_pending()
            case OptimizerStep(layers=layers):
                self._take_downloads(self.program.step_stages(a))  # their events have ended
                self.call.optimizer.step(layers, self.call.accumulator,
                                         self.shards.get((layers.start, layers.stop)))
            case BroadcastBuffers():
                self.call.dp.broadcast_buffers(self.call.store, self.call.layers.buffers)
            case AllReduce(layers=layers):
                self._take_downloads(self.program.step_stages(a))
                self.call.dp.all_reduce(self._buckets(layers), self.call.accumulator)
            case ReduceScatter(layers=layers):
                self._take_downloads(self.program.step_stages(a))
                self.shards[(layers.start, layers.stop)] = self.call.dp.reduce_scatter(
                    self._buckets(layers), self.call.accumulator)
            case AllGather(layers=layers):
                self.call.dp.all_gather(self.shards.pop((layers.start, layers.stop)))
            case Commit():
                if self.call.commit is not None:
                    self.call.commit()
            case ClipGradNorm():
                self.call.optimizer.clip()
            case ScalerStep():
                self.call.optimizer.scaler_step()
            case QueueUpdate():
                self.call.optimizer.queue_update()
            case _:
                raise TypeError(f"the executor has no handler for {type(a).__name__} ({a})")

    def _refresh(self) -> None:
        """``Refresh``: the copies uploads read made current (``ParamStore.refresh``), and
        the buffers saved, which a call failing before its ``Commit`` puts back."""
        self.call.store.refresh()
        self.call.snapshot = {k: v.detach().clone() for k, v in self.call.layers.buffers.items()}

    def _buckets(self, layers: range) -> list:
        """The gradient buckets of the parameters ``OptimizerStep(layers)`` steps."""
        call = self.call
        buckets = call.dp.buckets(call.exe, call.layers, call.store)
        return buckets.get((layers.start, layers.stop), [])

    def _upload(self, d: int, s: int, m: int) -> None:
        """Copy the host values ``(s, m)`` reads to the device: each tensor of them (a
        label may be a structure of tensors); other values are read as they are."""
        dev, on = self.call.devices[d], self.on[d]
        for name in self.flow.upload.get((s, m), ()):
            what = "the label" if name == LABEL else repr(name)

            def up(t: torch.Tensor) -> torch.Tensor:
                t = dev.to_device(t, "activations", f"{what} for stage {s}, microbatch {m}")
                self.stats.add("h2d_bytes_activations", _nbytes(t))
                return t

            value = self.on_host.value(m, name)
            value = up(value) if isinstance(value, torch.Tensor) else \
                pytree.tree_map_only(torch.Tensor, up, value)
            with on.lock:
                on.uploaded[(s, m, name)] = value

    def _upload_grads(self, d: int, s: int, m: int) -> None:
        """Each host gradient part of ``(s, m)``'s values, as it came (the device adds them)."""
        dev, on = self.call.devices[d], self.on[d]
        for name in self.flow.upload_grads.get((s, m), ()):
            parts = [dev.to_device(g, "activations",
                                   f"the gradient of {name!r} for stage {s}, microbatch {m}")
                     for g in self.on_host.take_grads(m, name)]
            self.stats.add("h2d_bytes_activations", sum(_nbytes(g) for g in parts))
            if parts:   # none: a value with no gradient (nothing trainable behind it)
                with on.lock:
                    on.host_grads[(s, m, name)] = parts

    def _inputs(self, d: int, s: int, m: int) -> dict[str, Any]:
        """The values compute ``(s, m)`` reads: its uploads, and what it takes over."""
        on, key = self.on[d], (s, m)
        with on.lock:
            out = {n: on.uploaded[(s, m, n)] for n in self.flow.upload.get(key, ())}
            out.update({n: on.made[(p, m, n)] for n, p in self.flow.handoff.get(key, ())})
        return out

    def _take_grads(self, d: int, s: int, m: int) -> dict[str, torch.Tensor]:
        """The gradients of the values backward stage ``(s, m)`` recomputes: the parts
        backward computes on this device made, plus those ``UploadGrad`` brought, summed."""
        on, key = self.on[d], (s, m)
        taken: list[tuple[str, torch.Tensor]] = []
        with on.lock:
            for name, p in self.flow.grad_parts.get(key, ()):
                g = on.parts.pop((p, m, name), None)
                if g is not None:
                    taken.append((name, g))
            for name in self.flow.upload_grads.get(key, ()):
                taken += [(name, g) for g in on.host_grads.pop((s, m, name), [])]
            on.consumed.setdefault(key, []).extend(g for _, g in taken)
        grads: dict[str, torch.Tensor] = {}
        for name, g in taken:
            grads[name] = g if name not in grads else grads[name] + g
        return grads

    def _give_grads(self, d: int, s: int, m: int, grads: Mapping[str, Any]) -> None:
        """After a backward: the gradients of the values it read, for whoever takes them
        (``Program.flow.sends_grads``: an on-device consumer, or ``Offload``)."""
        on = self.on[d]
        with on.lock:
            for name in self.flow.sends_grads.get((s, m), ()):
                g = grads.get(name)
                if g is not None:
                    on.parts[(s, m, name)] = g

    def _run(self, d: int, st: Stage, inputs: list, m: int, *, timed: bool = True, **kw: Any):
        with self.on[d].lock:
            params = self.on[d].params[st.index]
        return run_stage(st, inputs, params, call_seed=self.call.call_seed, microbatch=m,
                         device=_torch_device(self.call.devices[d]),
                         timer=self.call.timer if timed else None, stats=self.stats, **kw)

    def _forward(self, d: int, s: int, m: int) -> None:
        st = self.call.exe.stages[s]
        values = self._inputs(d, s, m)
        with torch.no_grad(), reentered(self.call.autocast):
            outs, writebacks = self._run(d, st, [values[n] for n in st.inputs], m,
                                         keep_writebacks=True)
        self.call.devices[d].keep(outs)   # they outlive the compute: activations
        with self.on_host.lock:
            self.call.writebacks.extend(writebacks)
        with self.on[d].lock:
            for name, value in zip(st.outputs, outs):
                self.on[d].made[(s, m, name)] = value

    def _leaf(self, name: str, x: Any) -> Any:
        """A stage input as backward sees it: a leaf that requires grad if the value may
        have a gradient (``passes.grad_flow``), else the value itself (no gradient work)."""
        wanted = self.call.differentiable
        if (wanted is None or name in wanted) and isinstance(x, torch.Tensor) \
                and (x.is_floating_point() or x.is_complex()):
            return x.detach().requires_grad_()
        return x

    def _fused(self, d: int, s: int, m: int) -> None:
        """The tail forward, the loss and the backward, no recompute."""
        call, st, lg = self.call, self.call.exe.stages[s], self.call.layers
        values = self._inputs(d, s, m)
        label = values.pop(LABEL, None)   # on the device, as the loss's other inputs
        leaves = {n: self._leaf(n, x) for n, x in values.items()}
        dev = call.devices[d]
        device = _torch_device(dev)
        with torch.enable_grad():
            with reentered(call.autocast):
                outs, writebacks = self._run(d, st, [leaves[n] for n in st.inputs], m,
                                             keep_writebacks=True)
                made = dict(zip(st.outputs, outs))
                out = pytree.tree_unflatten(lg.flat_outputs({**leaves, **made}), lg.out_spec)
                loss = call.loss_fn(out, label)
            if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
                raise ValueError("loss_fn must return a scalar tensor, got "
                                 f"{type(loss).__name__} {tuple(getattr(loss, 'shape', ()))}")
            weight = call.loss_weights[m]
            scaled = loss if weight == 1.0 else loss * weight
            with self.on_host.lock:
                call.writebacks.extend(writebacks)   # the tail's forward is its only one
                call.losses[m] = scaled.detach()
            dev.keep(made, saved=True)
            with self.on[d].lock:
                for name, value in made.items():
                    self.on[d].made[(s, m, name)] = _detached(value)
            with self._timed_backward(st.layers, device), dev.allocating("gradients"):
                if scaled.requires_grad:
                    scaled.backward()
        self._give_grads(d, s, m, _grads_of(leaves))

    def _recompute_backward(self, d: int, s: int, m: int) -> None:
        """Recompute the stage from its saved inputs (its tail recorded, not computed),
        then back-propagate the gradients of what it makes."""
        call, st = self.call, self.call.exe.stages[s]
        dev = call.devices[d]
        leaves = {n: self._leaf(n, x) for n, x in self._inputs(d, s, m).items()}
        with torch.enable_grad():
            with reentered(call.autocast):
                outs, _ = self._run(d, st, [leaves[n] for n in st.inputs], m,
                                    keep_writebacks=False, kind="recompute")
            dev.keep(outs, saved=True)
            grads = self._take_grads(d, s, m)
            with self._timed_backward(st.layers, _torch_device(dev)), dev.allocating("gradients"):
                _backprop(dict(zip(st.outputs, outs)), grads)
        self._give_grads(d, s, m, _grads_of(leaves))

    def _checkpoint(self, d: int, s: int, m: int) -> None:
        """``recompute_grain="layer"``: the stage forward without grad, keeping each
        layer piece's inputs for its backward."""
        call, st = self.call, self.call.exe.stages[s]
        values = self._inputs(d, s, m)
        saved: dict[int, list[Any]] = {}
        with torch.no_grad(), reentered(call.autocast):
            for i in st.layers:
                piece = call.exe.pieces[(s, i)]
                saved[i] = [values[n] for n in piece.inputs]
                outs, _ = self._run(d, piece, saved[i], m, keep_writebacks=False, timed=False)
                values.update(zip(piece.outputs, outs))
        call.devices[d].keep(saved)   # each layer's inputs, kept for its backward
        with self.on[d].lock:
            self.on[d].checkpoints[(s, m)] = _Checkpoint(saved)

    def _layer_backward(self, d: int, s: int, m: int, layer: int) -> None:
        """Recompute one layer piece from its checkpointed inputs, then back-propagate;
        the deepest takes the stage's output gradients, the shallowest gives its input
        gradients."""
        call, st = self.call, self.call.exe.stages[s]
        piece = call.exe.pieces[(s, layer)]
        with self.on[d].lock:
            ck = self.on[d].checkpoints[(s, m)]
        if layer == st.layers.stop - 1:
            ck.grads.update(self._take_grads(d, s, m))
        leaves = [self._leaf(n, x) for n, x in zip(piece.inputs, ck.saved.pop(layer))]
        dev = call.devices[d]
        with torch.enable_grad():
            with reentered(call.autocast):
                outs, _ = self._run(d, piece, leaves, m, keep_writebacks=False, kind="recompute")
            dev.keep(outs, saved=True)
            with self._timed_backward(range(layer, layer + 1), _torch_device(dev)), \
                    dev.allocating("gradients"):
                _backprop(dict(zip(piece.outputs, outs)), ck.grads)
        for n in piece.outputs:   # consumed: a shallower layer needs its inputs' gradients only
            if n not in st.outputs or layer == st.layers.start:
                ck.grads.pop(n, None)
        for n, x in zip(piece.inputs, leaves):
            if isinstance(x, torch.Tensor) and x.grad is not None:
                ck.grads[n] = x.grad if ck.grads.get(n) is None else ck.grads[n] + x.grad
        if layer == st.layers.start:
            with self.on[d].lock:
                del self.on[d].checkpoints[(s, m)]
            self._give_grads(d, s, m, {n: ck.grads.get(n) for n in st.inputs})

    @contextlib.contextmanager
    def _timed_backward(self, layers: range, device: torch.device) -> Iterator[None]:
        """Record a backward's time over ``layers``, split by their backward FLOPs (one
        autograd call covers the stage; with recompute_grain="layer" it is one layer). On
        a GPU, events on the stream, read once the call has ended (no wait here)."""
        timer = self.call.timer
        if timer is None:
            yield
            return
        costs = [self.call.layers.layers[i].cost for i in layers]
        flops = [max(getattr(c, "bwd_flops", 0) or 0, 0) for c in costs]
        total = sum(flops)

        def record(ms: float) -> None:
            for i, f in zip(layers, flops):
                timer.record(i, "bwd", ms * (f / total if total else 1 / len(layers)))

        if device.type == "cuda":
            start_ev, end_ev = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start_ev.record()
            yield
            end_ev.record()
            timer.later(lambda: record(start_ev.elapsed_time(end_ev)))
        else:
            start = time.perf_counter()
            yield
            record((time.perf_counter() - start) * 1e3)

    def _offload(self, d: int, s: int, m: int) -> None:
        """The values ``(s, m)`` made that the host needs, and the gradients it made
        that go through the host (copies: they land when the stream gets to them)."""
        dev, on, key = self.call.devices[d], self.on[d], (s, m)
        for name in self.flow.offload.get(key, ()):
            with on.lock:
                value = on.made[(s, m, name)]
            if isinstance(value, torch.Tensor):
                self.stats.add("d2h_bytes_activations", _nbytes(value))
                value = dev.to_host(value)
            self.on_host.put(m, name, value)
        for name in self.flow.offload_grads.get(key, ()):
            with on.lock:
                g = on.parts.get((s, m, name))
            if g is not None:
                self.stats.add("d2h_bytes_activations", _nbytes(g))
                self.on_host.add_grad(m, name, dev.to_host(g))

    def _free(self, d: int, s: int, m: int) -> None:
        """Drop what ``(s, m)`` was the last to use on the device."""
        on, key, flow = self.on[d], (s, m), self.flow
        with on.lock:
            dropped = [on.uploaded.pop((s, m, n)) for n in flow.upload.get(key, ())]
            dropped += [on.made.pop((flow.maker[n], m, n)) for n in flow.free.get(key, ())]
            dropped += [on.parts.pop((s, m, n), None) for n in flow.offload_grads.get(key, ())]
            dropped += on.consumed.pop(key, [])
        for t in pytree.tree_leaves(dropped):
            _free_quietly(self.call.devices[d], t)

    def _download_grads(self, d: int, s: int) -> None:
        """The stage's accumulated parameter gradients to the host, then their device
        buffers dropped. The copies land when the stream gets to them: host actions read
        them (``_take_downloads``) once this action's event has ended."""
        with self.on[d].lock:
            params = self.on[d].params[s]
        grads = {f: t.grad for f, t in params.items() if t.requires_grad}
        host = self.call.store.download_grads(s, self.call.devices[d], grads,
                                              self.call.accumulator)
        self.stats.add("d2h_bytes_grads", sum(_nbytes(g) for g in host.values()))
        with self.downloads_lock:
            self.downloads.setdefault(s, []).append(host)
        for t in params.values():
            t.grad = None

    def _take_downloads(self, stages) -> None:
        """Add the downloaded gradients of ``stages`` to the call's sums. Only from a host
        action whose waits include those downloads (or after the call's end)."""
        with self.downloads_lock:
            taken = [(s, host) for s in stages for host in self.downloads.pop(s, [])]
        for s, host in taken:
            self.call.accumulator.add(s, host, own=True)

    # -- end of call -----------------------------------------------------------------------
    def _check_empty(self) -> None:
        """A complete Program leaves nothing on a device: say so loudly if one did."""
        if self.downloads:
            raise RuntimeError(f"fxpipe internal error: the Program took no downloaded "
                               f"gradients of stages {sorted(self.downloads)} (no Accumulate, "
                               "OptimizerStep or collective)")
        for d, on in enumerate(self.on):
            left = [k for table in (on.uploaded, on.made, on.parts, on.host_grads)
                    for k in table] + list(on.params) + list(on.checkpoints)
            if left:
                self._cleanup()
                raise RuntimeError(f"fxpipe internal error: the Program left {left[:4]} on "
                                   f"{self.call.devices[d].name}")

    def _cleanup(self) -> None:
        """Free what a failed call left on devices."""
        for d, on in enumerate(self.on):
            dev = self.call.devices[d]
            for params in on.params.values():
                try:
                    self.call.store.release(dev, params)
                except ValueError:
                    pass
            for t in on.tensors():
                _free_quietly(dev, t)
            self.on[d] = _OnDevice()


def _grads_of(leaves: Mapping[str, Any]) -> dict[str, torch.Tensor | None]:
    return {n: x.grad if isinstance(x, torch.Tensor) and x.requires_grad else None
            for n, x in leaves.items()}


def _nbytes(x: Any) -> int:
    return x.numel() * x.element_size() if isinstance(x, torch.Tensor) else 0


def _detached(x: Any) -> Any:
    return x.detach() if isinstance(x, torch.Tensor) else x


def _free_quietly(device: Device, t: Any) -> None:
    if isinstance(t, torch.Tensor):
        try:
            device.free(t)
        except ValueError:  # not an allocation the device counted (made by compute)
            pass


def _backprop(outputs: Mapping[str, Any], grads: Mapping[str, torch.Tensor | None]) -> None:
    """Back-propagate ``grads`` (by value name) from the ``outputs`` that have one."""
    tail.backprop((o, grads.get(n)) for n, o in outputs.items())


def _torch_device(device: Device) -> torch.device:
    return getattr(device, "device", torch.device("cpu"))


def restore(buffers: Mapping[str, torch.Tensor], snapshot: Mapping[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for k, v in snapshot.items():
            buffers[k].copy_(v)


def apply_writebacks(writebacks: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    with torch.no_grad():
        for host, value in writebacks:
            host.copy_(value)
