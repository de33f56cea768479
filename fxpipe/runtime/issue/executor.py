"""The executor: interprets one ``Executable`` (``fxpipe.passes.stage``) for one call.

It is deliberately dumb. Each device's actions are issued, in Program order, by that
device's own host thread (the host lane's by one more): an action is submitted to the
stream of its device the Program names, with the events of its dependencies
(``Program.dependencies()``) as waits, once those were issued. Issuing waits for device
work in one place only: before a ``Prefetch`` allocates, until the parameters released
so far are past every stream that read them (``Device.wait_released``; ``issue_waits``).
The host lane's actions run when its issue thread reaches them, after exactly the
events they read (the collectives on their own worker). The caller waits for the end of
the call, then runs the ``Commit`` and the host actions after it on its thread, in lane
order. Each action kind has one handler (``Execution._act``), and what a handler moves
or drops is what ``Program.flow`` says: the executor decides nothing the Program does
not show. Stages run through ``runtime.stages.stage_code``: the printed stage code.

The host never reads data a copy may still be writing: values and gradient parts that
come through the host go back to a device as they are (the device sums gradient parts),
and downloaded parameter gradients are read by host actions only (an ``Accumulate`` or
``OptimizerStep`` after its downloads' events).

Who owns what: each device's values, gradients and resident parameters live in its
``_OnDevice`` (its lock orders its streams); the host's per-microbatch values live in
``_OnHost`` (one lock). Values are keyed by the compute that made or received them,
``(stage, microbatch, name)``, so two actions never write the same entry.

Parameter gradients accumulate on the device over a stage job, go to the host once per
job (``DownloadGrads``; first averaged across ranks by a ``DeviceAllReduce``, or
reduce-scattered), are added to the call's sums by ``Accumulate`` and reach ``.grad`` at
the ``Commit`` (or at a streamed ``OptimizerStep``). Any failure is raised as
``StageError`` naming stage, layers, device and microbatch, after every submitted action
has finished and device memory is freed. ``Execution.stats`` counts what the call did.
"""

from __future__ import annotations

import itertools
import threading
import time
import traceback
from typing import Any

import torch
import torch.utils._pytree as pytree

from fxpipe.errors import DeviceMemoryError, DistributedError, StageError
from fxpipe.passes.program import (
    HOST, LABEL, Accumulate, AllGather, AllReduce, AsyncUpdate, Barrier, BroadcastBuffers,
    Checkpoint, ClipGradNorm, Collective, Commit, DeviceAllGather, DeviceAllReduce,
    DeviceReduceScatter, DownloadGrads, Forward, Free, FusedBackward, GraphForward,
    GraphRecomputeBackward, GraphUpload, Offload, OptimizerStep, Prefetch, QueueUpdate,
    RecomputeBackward, ReduceScatter, Refresh, Release, ScalerStep, Upload, UploadGrad,
)
from fxpipe.runtime.issue.compute import StageCompute
from fxpipe.runtime.devices.device import Device
from fxpipe.runtime.devices.emulator import emulated_wait
from fxpipe.runtime.devices.events import Event
from fxpipe.runtime.host.grad_accum import GradAccumulator
from fxpipe.runtime.issue.device_collectives import Pieces, shards_from_pieces
from fxpipe.runtime.issue.interrupts import deferred_interrupt
from fxpipe.runtime.issue.threads import (
    _ISSUED, _ON_HOST, WHERE, Cancelled, _acting, _issue_thread, _Step, issue_plan, issue_slots,
    wait_all,
)
from fxpipe.runtime.devices.issue_lock import Kept, waited
from fxpipe.runtime.host.params import is_scratch
from fxpipe.runtime.issue.values import Call, Stats, _OnDevice, _OnHost


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
        self.compute = StageCompute(call, self.on, self.on_host, self.stats)
        self.downloads: dict[int, list[dict[str, torch.Tensor]]] = {}  # stage -> host grads
        self.downloads_lock = threading.Lock()
        # layers -> ReduceScatter's shards: under shards_lock (ReduceScatter writes them on
        # the collective worker, OptimizerStep and AllGather read them on the host thread)
        self.shards: dict[tuple[int, int], list] = {}
        self.shards_lock = threading.Lock()
        # gradients reduce-scattered on the devices: their downloaded pieces,
        # id(parameter) -> this rank's piece summed (the host lane's thread only)
        self.reduce_on_devices = call.dp is not None and call.dp.on_devices and any(
            isinstance(a, DeviceReduceScatter) for acts in self.program.actions for a in acts)
        self.pieces: dict[int, torch.Tensor] = {}
        self.cancelled = False   # (a flag: read per action, an Event's is_set is a call)
        self.counted = itertools.count()   # actions that ran (``_do``)
        self.record_lock = threading.Lock()
        self.slot_size: dict[int, int] = {}   # device -> its parameter slots' bytes (graphs)
        # stages whose jobs are device graphs (only looked for under "cudagraphs")
        self.graphed = {a.stage for acts in self.program.actions for a in acts
                        if isinstance(a, (GraphForward, GraphRecomputeBackward))} \
            if call.graphs is not None else set()

    # -- issuing -------------------------------------------------------------------------
    def run(self) -> None:
        """Issue every action of the call's phase, one issue thread per lane; wait for the
        end of the call; then run its ``Commit``. Raise the first failure (after everything
        submitted ended and device memory is freed)."""
        try:
            self._run()
        finally:   # every action has ended by now
            self.stats.add("actions", next(self.counted))

    def _run(self) -> None:
        p = self.program
        plan = issue_plan(p, self.call.phase)
        keep = plan.keep
        if self.call.dp is not None:
            self.call.dp.begin(self.call.dp.plan_ops(
                [a for a, k in zip(p.host, keep[HOST]) if k],
                self.call.exe, self.call.layers, self.call.store),
                self.call.dp.plan_device_ops(p, keep, self.call.store), self.stats)
        # the Commit and what follows it in the host lane run once the call has ended
        at = plan.commit_at
        slots = issue_slots(plan)
        issuing: list[threading.Event] = []
        interrupt: BaseException | None = None
        try:
            # every lane gets its issue thread (others may wait on its lane); a Ctrl-C held
            # until then is raised here, and stops them as one arriving later does
            with deferred_interrupt():
                for lane, steps in plan.lanes:
                    issuing.append(_issue_thread(
                        f"fxpipe-issue-{'host' if lane == HOST else lane}",
                        lambda lane=lane, steps=steps: self._issue(lane, steps, slots)))
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
        self.stats.add("host_waits")
        failure = wait_all(slots, self._cancel)
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
            if not keep[HOST][i]:
                continue
            if isinstance(p.host[i], Commit):   # the caller's merge raises as it is
                with _acting(str(p.host[i])):
                    self._act(HOST, p.host[i])
                next(self.counted)
                if self.call.record is not None:
                    self.call.record.append((HOST, str(p.host[i])))
            else:
                self._do(HOST, p.host[i], p.labels[HOST][i])

    def _issue(self, lane: int, steps: tuple[_Step, ...], slots) -> None:
        """Issue ``lane``'s actions in Program order: each once its dependencies were
        issued, with their events as the stream's waits."""
        device = self.call.devices[lane] if lane != HOST else None
        at_issue = device is not None and device.runs_at_issue
        issued: dict[str, float] = {}   # seconds issuing, by kind: counted once at the end
        done = 0
        perf_counter = time.perf_counter
        lock = Kept()   # the issue lock, kept from one action to the next; waits counted
        try:
            for step in steps:
                waits: list[Event] = []
                for key, end in step.deps:
                    src = slots[key]
                    if src.ready is not _ISSUED and not src.ready.is_set():
                        lock.drop()   # that lane's issue may need it
                        src.ready.wait()   # another lane's action, not issued yet
                    if end:
                        waits.append(src.event)
                    else:
                        waits.extend(src.gate)
                if not step.distinct and len(waits) > 1:
                    waits = list(dict.fromkeys(waits))
                if step.prefetch:
                    lock.drop()   # the wait may block the host
                    if device.wait_released():
                        self.stats.add("issue_waits")   # the memory it needs is not free yet
                slot = slots[(lane, step.i)]
                slot.gate = waits
                if device is None:   # host work: run now; collectives on their own thread
                    if waits:
                        self.stats.add("host_waits")  # it reads what those events made
                    worker = self.call.dp.worker if step.stream == "collective" else _ON_HOST
                    slot.event = worker.submit("compute", self._do, lane, step.action, step.label,
                                               wait=waits, label=step.label)
                elif at_issue:   # its Python runs now, under the issue lock
                    lock.take(step.i)   # queued at this step, unless kept
                    start = perf_counter()
                    slot.event = device.submit(step.stream, self._do, lane, step.action,
                                               step.label, wait=waits, label=step.label)
                    issued[step.kind] = issued.get(step.kind, 0.0) + perf_counter() - start
                else:   # a virtual device: what it emulates a GPU running is not issue time
                    start, _ = perf_counter(), emulated_wait()
                    slot.event = device.submit(step.stream, self._do, lane, step.action,
                                               step.label, wait=waits, label=step.label)
                    issued[step.kind] = issued.get(step.kind, 0.0) + (
                        perf_counter() - start - emulated_wait())
                if slot.ready is not _ISSUED:   # (else no other lane waits for it)
                    slot.ready.set()
                done += 1
        except BaseException as e:  # noqa: BLE001 — whatever stops issuing fails the rest
            lock.drop()
            self._cancel(e)
            for step in steps[done:]:
                failed = Event(str(step.action))
                failed._finish(exc=e)
                slots[(lane, step.i)].event = failed
                slots[(lane, step.i)].ready.set()
        finally:
            lock.drop()
            self.stats.issued(issued, waited() if at_issue else None)

    def _do(self, lane: int, a, label: str) -> None:
        """Action ``a``'s work, as its stream runs it."""
        # the previous call's update is owed whatever happens to this call
        if self.cancelled and not isinstance(a, AsyncUpdate):
            raise Cancelled(f"{a}: the call was interrupted")
        try:
            was, WHERE.action = WHERE.action, label   # (``_acting``, inline: per action)
            try:
                self._act(lane, a)
            finally:
                WHERE.action = was
        except DistributedError as e:
            if self.cancelled:  # this rank's own failure aborted the collective
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
        next(self.counted)   # (atomic: no lock per action; ``run`` adds them to the stats)
        if self.call.record is not None:
            with self.record_lock:
                self.call.record.append((lane, str(a)))

    def _cancel(self, exc: BaseException) -> None:
        """Stop the call: actions that have not started raise ``Cancelled``; with data
        parallel, every other rank's collectives fail too (``DataParallel.fail``)."""
        first, self.cancelled = not self.cancelled, True
        if first and self.call.dp is not None and not isinstance(exc, Cancelled):
            self.call.dp.fail(exc)

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
        # the actions a stage runs once per microbatch: by their class, at once
        handler = _TRANSFERS.get(a.__class__)
        if handler is not None:
            handler(self, lane, a.stage, a.mb)
            return
        handler = _JOBS.get(a.__class__)
        if handler is not None:
            handler(self.compute, lane, a.stage, a.mb)
            return
        match a:
            case RecomputeBackward(stage=s, mb=m, layer=None):
                self.compute.recompute_backward(lane, s, m)
            case RecomputeBackward(stage=s, mb=m, layer=layer):   # recompute_grain="layer"
                self.compute.layer_backward(lane, s, m, layer)
            case Prefetch(stage=s):
                self._prefetch(lane, s)
            case DeviceReduceScatter() | DeviceAllReduce():
                self._reduce_on_device(lane, a)
            case DeviceAllGather(stage=s):
                with self.on[lane].lock:
                    params = self.on[lane].params[s]
                self.call.dp.device_gather(lane, self.call.devices[lane], s, params)
            case DownloadGrads(stage=s):
                self._download_grads(lane, s)
            case Release(stage=s):
                with self.on[lane].lock:
                    params = self.on[lane].params.pop(s)
                self._release(lane, params)
            case Refresh():
                self._refresh()
            case Accumulate(layers=r):
                self._take_downloads([self.program.backward_stage_of[(r.start, r.stop)]])
            case AsyncUpdate():
                self.call.optimizer.apply_pending()
            case OptimizerStep(layers=layers):
                self._take_downloads(self.program.step_stages(a))  # their events have ended
                shards = self._shards(layers)
                self.call.optimizer.step(layers, self.call.accumulator, shards)
                if self.call.dp is not None and self.call.dp.zero3:   # (no AllGather)
                    self.call.dp.publish(shards)
            case BroadcastBuffers():
                self.call.dp.broadcast_buffers(self.call.store, self.call.layers.buffers)
            case AllReduce(layers=layers):
                self._take_downloads(self.program.step_stages(a))
                self.call.dp.all_reduce(self._buckets(layers), self.call.accumulator)
            case ReduceScatter(layers=layers):
                self._take_downloads(self.program.step_stages(a))
                shards = self.call.dp.reduce_scatter(self._buckets(layers), self.call.accumulator)
                with self.shards_lock:
                    self.shards[(layers.start, layers.stop)] = shards
            case AllGather(layers=layers):
                with self.shards_lock:
                    shards = self.shards.pop((layers.start, layers.stop))
                self.call.dp.all_gather(shards)
            case Barrier():
                self.call.dp.barrier()
            case Commit():
                if self.call.commit is not None:
                    self.call.commit()
            case ClipGradNorm():   # (sharded, steps after it: every stage's shards)
                self.call.optimizer.clip(self.call.dp, [
                    sh for b in self.program.host[self.program.host.index(a):]
                    if isinstance(b, OptimizerStep) for sh in self._shards(b.layers) or ()])
            case ScalerStep():
                self.call.optimizer.scaler_step()
            case QueueUpdate():
                self.call.optimizer.queue_update()
            case _:
                raise TypeError(f"the executor has no handler for {type(a).__name__} ({a})")

    def _prefetch(self, d: int, s: int) -> None:
        """The stage's parameters to device ``d``: for a stage whose jobs are device
        graphs (``"cudagraphs"``), into a free parameter slot (``runtime.stages.graphs``: the
        same place every round); else anywhere."""
        call, dev = self.call, self.call.devices[d]
        slot = into = None
        if call.graphs is not None and s in self.graphed:
            need = lambda t: call.store.slot_nbytes(   # noqa: E731 — its gradients too
                t, grads=self.program.stages[t].kind != "fwd")
            if d not in self.slot_size:
                self.slot_size[d] = max(need(a.stage) for a in self.program.actions[d]
                                        if isinstance(a, Prefetch) and a.stage in self.graphed)
            taken = call.graphs.take(d, dev, s, need(s), self.slot_size[d])
            if taken is None:
                self.stats.add("graph_fallbacks")
            else:
                slot, into = taken
        use = call.scratch
        params = call.store.upload(s, dev, requires_grad=self.program.stages[s].kind != "fwd",
                                   resident=use.resident if use else None, into=into)
        params.slot, params.memory = slot, into
        self.stats.add("h2d_bytes_params", params.nbytes)
        with self.on[d].lock:
            self.on[d].params[s] = params

    def _release(self, d: int, params) -> None:
        self.call.store.release(self.call.devices[d], params)
        if params.slot is not None:
            self.call.graphs.give(d, params.slot)

    def _refresh(self) -> None:
        """``Refresh``: the copies uploads read made current (``ParamStore.refresh``), and
        the buffers saved, which a call failing before its ``Commit`` puts back."""
        self.call.store.refresh()
        self.call.snapshot = {k: v.detach().clone() for k, v in self.call.layers.buffers.items()
                              if not is_scratch(v)}

    def _shards(self, layers: range) -> list | None:
        """This rank's shards for ``OptimizerStep(layers)``: the host ``ReduceScatter``'s,
        or made (once) from the pieces the devices reduced; None if the call does not shard."""
        key = (layers.start, layers.stop)
        with self.shards_lock:
            if self.reduce_on_devices and key not in self.shards:
                self.shards[key] = shards_from_pieces(self._buckets(layers), self.pieces)
            return self.shards.get(key)

    def _buckets(self, layers: range) -> list:
        """The gradient buckets of the parameters ``OptimizerStep(layers)`` steps."""
        call = self.call
        buckets = call.dp.buckets(call.exe, call.layers, call.store)
        return buckets.get((layers.start, layers.stop), [])

    def _upload(self, d: int, s: int, m: int, slots: bool = False) -> None:
        """Copy the host values ``(s, m)`` reads to the device: each tensor of them (a
        label may be a structure of tensors); other values are read as they are. With
        ``slots`` (``GraphUpload``), a host tensor into its input slot of the graph job."""
        dev, on = self.call.devices[d], self.on[d]
        for name in self.flow.upload.get((s, m), ()):
            owner = f"{'the label' if name == LABEL else repr(name)} for stage {s}, microbatch {m}"
            value = self.on_host.value(m, name)
            if slots and isinstance(value, torch.Tensor) and value.device.type == "cpu":
                key = (id(self.call.exe.stages[s].gm), m % 2, name)
                value = self.call.graphs.upload(d, dev, key, value, f"the input slot of {owner}")
                moved = value.numel() * value.element_size()
            elif isinstance(value, torch.Tensor):
                value = dev.to_device(value, "activations", owner)
                moved = value.numel() * value.element_size()
            else:   # a label may be a structure of tensors
                value = pytree.tree_map_only(
                    torch.Tensor, lambda t: dev.to_device(t, "activations", owner), value)
                moved = sum(map(_nbytes, pytree.tree_leaves(value)))
            self.stats.add("h2d_bytes_activations", moved)
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

    def _offload(self, d: int, s: int, m: int) -> None:
        """The values ``(s, m)`` made that the host needs, and the gradients it made
        that go through the host (copies: they land when the stream gets to them)."""
        dev, on, key = self.call.devices[d], self.on[d], (s, m)
        for name in self.flow.offload.get(key, ()):
            with on.lock:
                value = on.made[(s, m, name)]
            if isinstance(value, torch.Tensor):
                self.stats.add("d2h_bytes_activations", value.numel() * value.element_size())
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
        on, key, flow, dev = self.on[d], (s, m), self.flow, self.call.devices[d]
        dropped = []
        with on.lock:   # (loops, not comprehensions: each of those is a call, per action)
            for n in flow.upload.get(key, ()):
                dropped.append(on.uploaded.pop((s, m, n)))
            for n in flow.free.get(key, ()):
                dropped.append(on.made.pop((flow.maker[n], m, n)))
            for n in flow.offload_grads.get(key, ()):
                dropped.append(on.parts.pop((s, m, n), None))
            dropped += on.consumed.pop(key, ())
        for t in dropped:
            if isinstance(t, torch.Tensor):
                self._free_quietly(dev, t)
            elif t is not None:   # a label's structure
                for leaf in pytree.tree_leaves(t):
                    self._free_quietly(dev, leaf)

    def _reduce_on_device(self, d: int, a) -> None:
        """``DeviceReduceScatter``, ``DeviceAllReduce`` (``DataParallel.device_reduce``;
        ``accumulated``: with the host's ``.grad`` of what the stage owns)."""
        call, on, s = self.call, self.on[d], a.stage
        with on.lock:
            params = on.params[s]
        owned = [call.layers.params[f] for f in self.program.stages[s].owns if a.accumulated]
        scatter = isinstance(a, DeviceReduceScatter)
        shards = call.dp.device_reduce(d, call.devices[d], call.store, s, params, scatter,
                                       {id(p) for p in owned}, self.stats)
        if not scatter:   # the averages are the .grad its download reads
            call.accumulator.final(owned)
            return
        for t in params.values():
            t.grad = None
        with on.lock:
            on.reduced[s] = shards

    def _download_grads(self, d: int, s: int) -> None:
        """The stage's parameter gradients (after a ``DeviceReduceScatter``: this rank's
        shards) to the host, their device buffers dropped; host actions read them
        (``_take_downloads``) once this action's event has ended (the copies landed)."""
        dev = self.call.devices[d]
        with self.on[d].lock:
            params = self.on[d].params[s]
            reduced = self.on[d].reduced.pop(s, None)
        if reduced is not None:
            pieces = Pieces([])
            for bucket, shard in reduced:
                pieces.shards.append((bucket, dev.to_host(shard)))
                self.stats.add("d2h_bytes_grads", _nbytes(shard))
                dev.record_stream(shard)   # read by this stream's copy: then its memory goes
                self._free_quietly(dev, shard)
            with self.downloads_lock:
                self.downloads.setdefault(s, []).append(pieces)
            return
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
            if isinstance(host, Pieces):   # after a device reduce-scatter
                host.add_to(self.pieces)
            else:
                self.call.accumulator.add(s, host, own=True)

    # -- end of call -----------------------------------------------------------------------
    def _check_empty(self) -> None:
        """A complete Program leaves nothing on a device: say so loudly if one did."""
        if self.downloads:
            raise RuntimeError(f"fxpipe internal error: the Program took no downloaded "
                               f"gradients of stages {sorted(self.downloads)} (no Accumulate, "
                               "OptimizerStep or collective)")
        for d, on in enumerate(self.on):
            left = [k for table in (on.uploaded, on.made, on.parts, on.host_grads, on.reduced)
                    for k in table] + list(on.params) + list(on.checkpoints)
            if left:
                self._cleanup()
                raise RuntimeError(f"fxpipe internal error: the Program left {left[:4]} on "
                                   f"{self.call.devices[d].name}")

    def _free_quietly(self, device: Device, t: Any) -> None:
        """Free ``t`` if the device counts it (compute's own outputs it does not count),
        unless it is an input slot (``GraphUpload``: its graphs read it again)."""
        if isinstance(t, torch.Tensor) and device.counts(t) and not (
                self.graphed and self.call.graphs.holds(t)):
            try:
                device.free(t)
            except ValueError:  # freed meanwhile
                pass

    def _cleanup(self) -> None:
        """Free what a failed call left on devices."""
        for d, on in enumerate(self.on):
            dev = self.call.devices[d]
            for params in on.params.values():
                try:
                    self._release(d, params)
                except ValueError:
                    pass
            for t in on.tensors():
                self._free_quietly(dev, t)
            self.on[d] = _OnDevice()


# ``Execution._act``'s handlers of the actions a stage runs once per microbatch, by their
# exact class (its subclasses have their own): (device, stage, microbatch) each
_TRANSFERS = {Upload: Execution._upload, UploadGrad: Execution._upload_grads,
              GraphUpload: lambda self, d, s, m: self._upload(d, s, m, slots=True),
              Offload: Execution._offload, Free: Execution._free}
_JOBS = {Forward: StageCompute.forward, GraphForward: StageCompute.graph_forward,
         FusedBackward: StageCompute.fused, Checkpoint: StageCompute.checkpoint,
         GraphRecomputeBackward: StageCompute.graph_recompute_backward}


def _nbytes(x: Any) -> int:
    return x.numel() * x.element_size() if isinstance(x, torch.Tensor) else 0

