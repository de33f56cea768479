"""The executor: runs a ``Program`` (``fxpipe.passes.schedule``) on devices.

It is deliberately dumb: every action of every device is submitted, in one global
order consistent with ``Program.dependencies()``, to a stream of its device with the
events of its dependencies as waits; the devices' streams do the rest. The Program's
streams are the device's streams, one to one (``Release`` markers run on ``control``);
a stream runs its actions in Program order.

Values move by name. Each microbatch has a host environment (the model inputs, every
stage output offloaded, and gradients of values); each device has a cache of values and
gradients it holds. A compute takes its inputs from its device's cache, or copies them
from the host if no ``Upload`` put them there (a Program may hand values over on the
device). Stages run through ``StageRun`` (``runtime.interpret``): the printed stage code.

Parameter gradients accumulate on the device across a stage job's microbatches
(``Prefetch`` makes leaf copies for backward stages), go to the host once per job
(``DownloadGrads``) into a ``GradAccumulator``, and reach ``.grad`` only when the whole
call succeeded — except with a streamed optimizer step (``job.optimizer``, see
``fxpipe.optim``): each ``OptimizerStep`` commits its stage's gradients and steps its
parameters on the optimizer's host worker. Buffer updates (BatchNorm) are written back
once per forward, never in recompute. Any failure is raised as ``StageError`` naming stage, layers, device and
microbatch, after every submitted action has finished and device memory is freed.
"""

from __future__ import annotations

import contextlib
import heapq
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree

from fxpipe.errors import DeviceMemoryError, StageError
from fxpipe.passes.layer_graph import LayerGraph
from fxpipe.passes.lower import Stage
from fxpipe.passes.schedule import (
    DownloadGrads, Forward, FusedBackward, Offload, OptimizerStep, Prefetch, Program,
    RecomputeBackward, Release, Upload, UploadGrad, stream_of,
)
from fxpipe.runtime import tail
from fxpipe.runtime.amp import AutocastState, reentered
from fxpipe.runtime.devices import Device, Event
from fxpipe.runtime.interpret import run_stage
from fxpipe.runtime.params import GradAccumulator, ParamStore
from fxpipe.runtime.timer import LayerTimer

_STREAM = {"prefetch": "prefetch", "h2d": "h2d", "compute": "compute", "d2h": "d2h",
           "grads": "grads", None: "control"}


class Cancelled(RuntimeError):
    """Raised inside actions once a call has been interrupted."""


@dataclass
class Job:
    """What one call of a Program needs and produces."""

    program: Program
    stages: dict[int, Stage]                 # program stage index -> lowered stage
    layers: LayerGraph
    store: ParamStore
    devices: list[Device]
    inputs: list[dict[str, Any]]             # per microbatch: input name -> host value
    call_seed: int | None = None
    labels: list[Any] | None = None          # fused: per microbatch label
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None
    loss_weights: list[float] | None = None
    out_grads: list[dict[str, torch.Tensor]] | None = None   # train: grads of outputs
    parts: frozenset[str] = frozenset({"fwd", "bwd", "fused"})  # stage kinds to run
    keep_outputs: bool = False               # fused: keep the model outputs the tail made
    grain: str = "stage"                     # recompute_grain
    timer: LayerTimer | None = None          # per-layer times (virtual devices)
    layer_stages: dict[int, Stage] = field(default_factory=dict)  # grain "layer": by layer
    optimizer: Any = None                    # fxpipe.optim's part of the call (OptimizerStep)
    autocast: AutocastState = ()             # the caller's autocast regions (runtime.amp)
    differentiable: frozenset[str] | None = None  # values that may have a gradient (None: all)
    commit_grads: bool = False               # parameter grads go to .grad when the call succeeds
    # results
    host: list[dict[str, Any]] = field(default_factory=list)
    grads: list[dict[str, torch.Tensor]] = field(default_factory=list)
    losses: dict[int, torch.Tensor] = field(default_factory=dict)
    writebacks: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    accumulator: GradAccumulator | None = None


class Execution:
    """One run of a Job's Program (create, ``run()``, read the Job's results)."""

    def __init__(self, job: Job):
        self.job = job
        p = job.program
        self.M = p.num_microbatches
        job.host = [dict(x) for x in job.inputs]
        job.grads = [dict(g) for g in (job.out_grads or [{} for _ in range(self.M)])]
        # a call that commits at its end folds each existing .grad in as its stage's
        # gradients arrive; a streamed optimizer commits stage by stage itself
        job.accumulator = GradAccumulator(job.store,
                                          fold=job.commit_grads and job.optimizer is None)
        self.dev_vals: dict[tuple[int, int, str], torch.Tensor] = {}
        self.dev_grads: dict[tuple[int, int, str], torch.Tensor] = {}
        self.resident: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        self.input_grads: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        self.uploaded: set[tuple[int, int, str]] = set()  # dev_vals entries copied from host
        self.consumed: dict[int, list[torch.Tensor]] = {}  # per device: grads its compute took
        self.cancelled = threading.Event()
        self.lock = threading.Lock()
        self.values_lock = threading.Lock()  # dev_vals / uploaded: an Upload and a compute race

    # -- submission ----------------------------------------------------------------------
    def run(self) -> None:
        p, job = self.job.program, self.job
        deps = p.dependencies()
        keep = [[self._wanted(a) for a in acts] for acts in p.actions]
        ended: dict[tuple[int, int], Event] = {}
        # "may start" of an action = the events it waits for. A dependency on another
        # action's start waits for those (an action skipped because its own wait failed
        # never starts, but its gate completes, so nothing waits forever).
        gate: dict[tuple[int, int], list[Event]] = {}
        order = _topological(p, deps, keep)
        steps: list[tuple[int, int, OptimizerStep, list[Event]]] = []
        try:
            if job.optimizer is not None and (ev := job.optimizer.begin()) is not None:
                ended[(-1, 0)] = ev  # the previous call's update (async), on the host
            for d, i in order:
                a = p.actions[d][i]
                waits: list[Event] = []
                for dep in deps[d][i]:
                    key = (dep.device, dep.step)
                    if keep[key[0]][key[1]]:
                        waits.extend([ended[key]] if dep.on == "end" else gate[key])
                waits = list({id(e): e for e in waits}.values())
                gate[(d, i)] = waits
                stream = stream_of(a)  # None: a Release, run on the control stream
                if isinstance(a, OptimizerStep):
                    steps.append((d, i, a, waits))
                    continue
                device = job.devices[d]
                ended[(d, i)] = device.submit(_STREAM[stream], self._work(d, a),
                                              wait=waits, label=f"{a}")
            self._submit_steps(steps, ended)
        except BaseException:
            self.cancelled.set()
            raise
        finally:
            failure = self._wait_all(ended)
        if failure is not None:
            self._cleanup()
            raise failure
        self._finish()

    def _submit_steps(self, steps: list, ended: dict) -> None:
        """``OptimizerStep``s go to the one host worker deepest first, the order their
        gradients become final, each also after the gradient downloads of every stage
        sharing a parameter with it (tied weights)."""
        p, opt = self.job.program, self.job.optimizer
        downloads: dict[int, list[Event]] = {}
        for d, acts in enumerate(p.actions):
            for i, a in enumerate(acts):
                if isinstance(a, DownloadGrads) and (d, i) in ended:
                    downloads.setdefault(a.stage, []).append(ended[(d, i)])
        for d, i, a, waits in sorted(steps, key=lambda x: -x[2].layers.start):
            extra = [ev for s in opt.waits(a.layers) for ev in downloads.get(s, [])]
            waits = list({id(e): e for e in waits + extra}.values())
            ended[(d, i)] = opt.worker.submit("compute", self._work(d, a), wait=waits,
                                              label=f"{a}")

    def _wanted(self, a) -> bool:
        if isinstance(a, OptimizerStep):
            return self.job.optimizer is not None
        kind = self.job.program.stages[a.stage].kind if hasattr(a, "stage") else None
        return kind in self.job.parts

    def _wait_all(self, ended: dict) -> BaseException | None:
        """Wait for every submitted action; the failure to raise is the cause, not the
        ``Cancelled`` of actions that started after it (whatever their order)."""
        failures = []
        # latest first: those end last, so the caller wakes once, not once per action
        for ev in reversed(list(ended.values())):
            try:
                exc = ev.exception()
            except BaseException as e:  # noqa: BLE001 — e.g. KeyboardInterrupt while waiting
                self.cancelled.set()
                exc = e
            if exc is not None:
                failures.insert(0, exc)  # in submission order
        if not failures:
            return None
        for ev in ended.values():  # everything submitted has finished; make sure of it
            ev._done.wait()
        return next((e for e in failures if not isinstance(e, Cancelled)), failures[0])

    def _work(self, d: int, a) -> Callable[[], None]:
        def work():
            if self.cancelled.is_set():
                raise Cancelled(f"{a}: the call was interrupted")
            try:
                self._act(d, a)
            except (StageError, Cancelled, DeviceMemoryError, KeyboardInterrupt):
                self.cancelled.set()  # these already say where, or are the user's
                raise
            except BaseException as e:
                self.cancelled.set()
                raise self._stage_error(d, a, e) from e
        return work

    def _stage_error(self, d: int, a, e: BaseException) -> StageError:
        st = self.job.stages.get(getattr(a, "stage", -1))
        mb = getattr(a, "mb", None)
        names = ", ".join(self.job.layers.layers[i].name for i in st.layers) if st else "?"
        span = f"layers {st.layers.start}-{st.layers.stop - 1} ({names})" if st else ""
        where = f"microbatch {mb}" if mb is not None else "the stage job"
        return StageError(
            f"{type(a).__name__} of stage {getattr(a, 'stage', '?')} [{span}] on "
            f"{self.job.devices[d].name}, {where}, failed: {type(e).__name__}: {e}",
            stage=getattr(a, "stage", None), layers=st.layers if st else None,
            device=self.job.devices[d].name, microbatch=mb, action=str(a))

    # -- actions -------------------------------------------------------------------------
    def _act(self, d: int, a) -> None:
        match a:
            case Prefetch(stage=s):
                kind = self.job.program.stages[s].kind
                self.resident[(d, s)] = self.job.store.upload(
                    s, self.job.devices[d], requires_grad=kind != "fwd")
            case Upload(stage=s, mb=m):
                for name in self.job.stages[s].inputs:
                    self._value_on(d, m, name)
            case UploadGrad(stage=s, mb=m):
                for name in self.job.stages[s].outputs:
                    self._grad_on(d, m, name, consume=False)
            case Forward(stage=s, mb=m):
                self._forward(d, s, m)
                self._done_with_inputs(d, s, m, [])
            case FusedBackward(stage=s, mb=m) | RecomputeBackward(stage=s, mb=m):
                self.consumed[d] = []  # one compute at a time per device
                self._backward(d, s, m, fused=isinstance(a, FusedBackward))
                self._done_with_inputs(d, s, m, self.consumed.pop(d))
            case Offload(stage=s, mb=m):
                self._offload(d, s, m)
            case DownloadGrads(stage=s):
                res = self.resident[(d, s)]
                grads = {f: t.grad for f, t in res.items() if t.requires_grad}
                acc = self.job.accumulator
                host = self.job.store.download_grads(s, self.job.devices[d], grads,
                                                     plus=acc.fold_into_download(s, grads))
                if any(g is not None and g.is_cuda for g in grads.values()):
                    torch.cuda.current_stream().synchronize()  # the sums read them now
                acc.add(s, host, own=True)
                for t in res.values():
                    t.grad = None
            case Release(stage=s):
                self.job.store.release(self.job.devices[d], self.resident.pop((d, s)))
            case OptimizerStep(layers=layers):
                self.job.optimizer.step(layers, self.job.accumulator)

    def _value_on(self, d: int, m: int, name: str) -> Any:
        key = (d, m, name)
        with self.values_lock:  # else both may upload it, and one copy is never freed
            if key not in self.dev_vals:
                value = self.job.host[m][name]
                if isinstance(value, torch.Tensor):
                    value = self.job.devices[d].to_device(value, "activations", f"microbatch {m}")
                    self.uploaded.add(key)
                self.dev_vals[key] = value
            return self.dev_vals[key]

    def _done_with_inputs(self, d: int, s: int, m: int, consumed: list) -> None:
        """After a compute: free the copies it was given that the host still has, and the
        gradients it consumed (a later stage here uploads again if it needs them)."""
        dev = self.job.devices[d]
        with self.values_lock:
            for name in self.job.stages[s].inputs:
                key = (d, m, name)
                if key in self.uploaded and name in self.job.host[m]:
                    self.uploaded.discard(key)
                    _free_quietly(dev, self.dev_vals.pop(key))
        for t in consumed:
            _free_quietly(dev, t)

    def _grad_on(self, d: int, m: int, name: str, consume: bool = True) -> torch.Tensor | None:
        """The whole gradient of value ``name`` for microbatch ``m`` on device ``d``; the
        stage that made the value consumes it, an ``UploadGrad`` only stages it."""
        with self.lock:
            host = self.job.grads[m].pop(name, None)
            dev = self.dev_grads.pop((d, m, name), None)
        if host is not None:
            host = self.job.devices[d].to_device(host, "activations", f"microbatch {m}")
            if dev is None:
                dev = host
            else:
                dev = dev + host
                _free_quietly(self.job.devices[d], host)
        if dev is not None and not consume:
            self._add_dev_grad(d, m, name, dev)
        elif dev is not None:
            self.consumed.setdefault(d, []).append(dev)
        return dev

    def _forward(self, d: int, s: int, m: int) -> None:
        st = self.job.stages[s]
        inputs = [self._value_on(d, m, n) for n in st.inputs]
        with torch.no_grad(), reentered(self.job.autocast):
            outs, writebacks = run_stage(st, inputs, self.resident[(d, s)],
                                         call_seed=self.job.call_seed, microbatch=m,
                                         device=_torch_device(self.job.devices[d]),
                                         keep_writebacks=True, timer=self.job.timer)
        self.job.writebacks.extend(writebacks)
        for name, value in zip(st.outputs, outs):
            self.dev_vals[(d, m, name)] = value

    def _backward(self, d: int, s: int, m: int, fused: bool) -> None:
        job, st = self.job, self.job.stages[s]
        lg = job.layers
        if job.grain == "layer" and not fused and len(st.layers) > 1:
            return self._backward_by_layer(d, s, m)
        leaves = {n: self._leaf(n, self._value_on(d, m, n)) for n in st.inputs}
        device = _torch_device(job.devices[d])
        with torch.enable_grad():
            with reentered(job.autocast):
                outs, writebacks = run_stage(st, [leaves[n] for n in st.inputs],
                                             self.resident[(d, s)], call_seed=job.call_seed,
                                             microbatch=m, device=device,
                                             keep_writebacks=fused, timer=job.timer,
                                             kind="fwd" if fused else "recompute")
            job.writebacks.extend(writebacks)  # the fused tail's forward is its only one
            made = dict(zip(st.outputs, outs))
            if fused:
                # outputs made by earlier stages are inputs of the loss too
                for name in lg.output_names:
                    if name not in made and name not in leaves:
                        leaves[name] = self._leaf(name, self._value_on(d, m, name))
                values = {**leaves, **made}
                out = pytree.tree_unflatten(lg.flat_outputs(values), lg.out_spec)
                with reentered(job.autocast):
                    loss = job.loss_fn(out, job.labels[m])
                if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
                    raise ValueError("loss_fn must return a scalar tensor, got "
                                     f"{type(loss).__name__} {tuple(getattr(loss, 'shape', ()))}")
                if job.keep_outputs:  # to the host at the end, like other stages' outputs
                    with self.values_lock:
                        for name in lg.output_names:
                            if name in made:
                                self.dev_vals[(d, m, name)] = _detached(made[name])
                weight = job.loss_weights[m]
                scaled = loss if weight == 1.0 else loss * weight
                job.losses[m] = scaled.detach()
                with self._timed_backward(st.layers, device):
                    if scaled.requires_grad:
                        scaled.backward()
            else:
                grads = {n: self._grad_on(d, m, n) for n in made}
                with self._timed_backward(st.layers, device):
                    _backprop(made, grads)
        grads = {n: x.grad for n, x in leaves.items()
                 if isinstance(x, torch.Tensor) and x.grad is not None}
        for n, g in grads.items():
            self._add_dev_grad(d, m, n, g)
        self.input_grads[(s, m)] = grads

    def _leaf(self, name: str, x: Any) -> Any:
        """A stage input as backward sees it: a leaf that requires grad if the value may
        have a gradient (``passes.grad_flow``), else the value itself (no gradient work)."""
        wanted = self.job.differentiable
        if (wanted is None or name in wanted) and isinstance(x, torch.Tensor) \
                and (x.is_floating_point() or x.is_complex()):
            return x.detach().requires_grad_()
        return x

    def _add_dev_grad(self, d: int, m: int, name: str, g: torch.Tensor) -> None:
        """Add to the gradient of ``name`` held on device ``d``: a value several stages
        read gets a part from each, and an ``Offload`` may be taking it to the host now."""
        with self.lock:
            prev = self.dev_grads.get((d, m, name))
            self.dev_grads[(d, m, name)] = g if prev is None else prev + g

    def _backward_by_layer(self, d: int, s: int, m: int) -> None:
        """``recompute_grain="layer"``: forward the stage without grad keeping each layer's
        inputs, then recompute and back-propagate one layer at a time, deepest first."""
        job, st = self.job, self.job.stages[s]
        device = _torch_device(job.devices[d])
        run = dict(resident=self.resident[(d, s)], call_seed=job.call_seed, microbatch=m,
                   device=device, keep_writebacks=False)
        values = {n: self._value_on(d, m, n) for n in st.inputs}
        saved: list[list] = []
        with torch.no_grad(), reentered(job.autocast):
            for i in st.layers:
                sub = job.layer_stages[i]
                saved.append([values[n] for n in sub.inputs])
                outs, _ = run_stage(sub, saved[-1], **run)
                values.update(zip(sub.outputs, outs))
        del values
        grads: dict[str, torch.Tensor | None] = {n: self._grad_on(d, m, n) for n in st.outputs}
        for i, inputs in zip(reversed(st.layers), reversed(saved)):
            sub = job.layer_stages[i]
            leaves = [self._leaf(n, x) for n, x in zip(sub.inputs, inputs)]
            with torch.enable_grad():
                with reentered(job.autocast):
                    outs, _ = run_stage(sub, leaves, **run, timer=job.timer, kind="recompute")
                with self._timed_backward(range(i, i + 1), device):
                    _backprop(dict(zip(sub.outputs, outs)), grads)
            for n, x in zip(sub.inputs, leaves):
                if isinstance(x, torch.Tensor) and x.grad is not None:
                    grads[n] = x.grad if grads.get(n) is None else grads[n] + x.grad
        input_grads = {n: grads[n] for n in st.inputs if grads.get(n) is not None}
        for n, g in input_grads.items():
            self._add_dev_grad(d, m, n, g)
        self.input_grads[(s, m)] = input_grads

    @contextlib.contextmanager
    def _timed_backward(self, layers: range, device: torch.device) -> Iterator[None]:
        """Record a backward's time over ``layers``, split by their backward FLOPs (one
        autograd call covers the stage; with recompute_grain="layer" it is one layer)."""
        timer = self.job.timer
        if timer is None:
            yield
            return
        if device.type == "cuda":  # device events on the stream the backward ran on
            start_ev, end_ev = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start_ev.record()
            yield
            end_ev.record()
            end_ev.synchronize()
            ms = start_ev.elapsed_time(end_ev)
        else:
            start = time.perf_counter()
            yield
            ms = (time.perf_counter() - start) * 1e3
        costs = [self.job.layers.layers[i].cost for i in layers]
        flops = [max(getattr(c, "bwd_flops", 0) or 0, 0) for c in costs]
        total = sum(flops)
        for i, f in zip(layers, flops):
            timer.record(i, "bwd", ms * (f / total if total else 1 / len(layers)))

    def _offload(self, d: int, s: int, m: int) -> None:
        st, job = self.job.stages[s], self.job
        dev = job.devices[d]
        if job.program.stages[s].kind == "fwd":
            for name in st.outputs:
                value = self.dev_vals.get((d, m, name))
                job.host[m][name] = dev.to_host(value) if isinstance(value, torch.Tensor) else value
        else:  # a backward stage hands the gradients of its inputs to the host
            for name in self.input_grads.get((s, m), {}):
                with self.lock:
                    g = self.dev_grads.pop((d, m, name), None)
                if g is None:
                    continue
                g = dev.to_host(g)
                with self.lock:
                    prev = job.grads[m].get(name)
                    job.grads[m][name] = g if prev is None else prev + g

    # -- end of call -----------------------------------------------------------------------
    def _finish(self) -> None:
        """Everything a compute left only on a device, and the final gradients, to the host."""
        job = self.job
        for (d, m, name), value in list(self.dev_vals.items()):
            if name not in job.host[m]:
                job.host[m][name] = job.devices[d].to_host(value) \
                    if isinstance(value, torch.Tensor) else value
        for (d, m, name), g in list(self.dev_grads.items()):
            g = job.devices[d].to_host(g)
            prev = job.grads[m].get(name)
            job.grads[m][name] = g if prev is None else prev + g
        self._cleanup()

    def _cleanup(self) -> None:
        """Free what the call left on devices (parameters of stages never released)."""
        for (d, s), res in list(self.resident.items()):
            try:
                self.job.store.release(self.job.devices[d], res)
            except ValueError:
                pass
        self.resident.clear()
        for cache in (self.dev_vals, self.dev_grads):
            for (d, _m, _n), t in cache.items():
                _free_quietly(self.job.devices[d], t)
            cache.clear()
        for d, taken in self.consumed.items():  # gradients a failed backward had taken
            for t in taken:
                _free_quietly(self.job.devices[d], t)
        self.consumed.clear()


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


def _topological(p: Program, deps, keep) -> list[tuple[int, int]]:
    """A submission order: dependencies first, each device's actions in list order."""
    indeg: dict[tuple[int, int], int] = {}
    users: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for d, acts in enumerate(p.actions):
        for i in range(len(acts)):
            if not keep[d][i]:
                continue
            preds = {(dep.device, dep.step) for dep in deps[d][i] if keep[dep.device][dep.step]}
            prev = next((j for j in range(i - 1, -1, -1) if keep[d][j]), None)
            if prev is not None:
                preds.add((d, prev))
            for dep in preds:
                if dep[0] == d and dep[1] > i:
                    raise ValueError(f"device {d} step {i} ({acts[i]}) depends on step {dep[1]} "
                                     "listed after it: the Program cannot run in list order")
                users.setdefault(dep, []).append((d, i))
            indeg[(d, i)] = len(preds)
    ready = [k for k, n in indeg.items() if n == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        k = heapq.heappop(ready)
        order.append(k)
        for u in users.get(k, ()):
            indeg[u] -= 1
            if indeg[u] == 0:
                heapq.heappush(ready, u)
    if len(order) != len(indeg):
        raise ValueError("the Program's dependencies have a cycle")
    return order


def refresh_and_snapshot(store: ParamStore, buffers: Mapping[str, torch.Tensor]) -> dict:
    """Refresh the flat parameter copies from the master weights, and snapshot buffers so
    a failed call can put them back."""
    store.refresh()
    return {k: v.detach().clone() for k, v in buffers.items()}


def restore(buffers: Mapping[str, torch.Tensor], snapshot: Mapping[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for k, v in snapshot.items():
            buffers[k].copy_(v)


def apply_writebacks(writebacks: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    with torch.no_grad():
        for host, value in writebacks:
            host.copy_(value)
