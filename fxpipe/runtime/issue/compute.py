"""The compute actions of one call on the devices: ``Forward``, ``FusedBackward``,
``Checkpoint``, ``RecomputeBackward`` (a stage's, or one layer's at
``recompute_grain="layer"``), each running a stage's GraphModule (``runtime.stages.stage_code``)
on the values of ``_OnDevice`` (``runtime.issue.values``) that ``Program.flow`` names, and the
backward timing for ``pipe.timings()``. ``Execution._act`` dispatches to them.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.utils._pytree as pytree

from fxpipe.passes.program import LABEL
from fxpipe.passes.stage import Stage
from fxpipe.runtime.stages import unfilled
from fxpipe.runtime.stages.amp import reentered
from fxpipe.runtime.devices.device import Device
from fxpipe.runtime.stages.stage_code import run_stage
from fxpipe.runtime.issue.values import Call, Stats, _Checkpoint, _OnDevice, _OnHost


class StageCompute:
    """The compute handlers of one call: ``forward``, ``fused``, ``recompute_backward``,
    ``checkpoint`` and ``layer_backward`` of stage ``s``, microbatch ``m`` on device
    ``d``. ``on``: the call's per-device values (the Execution's list: a failed call's
    cleanup replaces its entries)."""

    def __init__(self, call: Call, on: list[_OnDevice], on_host: _OnHost, stats: Stats):
        self.call = call
        self.flow = call.exe.program.flow
        self.on = on
        self.on_host = on_host
        self.stats = stats
        self.torch_devices = [_torch_device(dev) for dev in call.devices]

    def _inputs(self, d: int, s: int, m: int) -> dict[str, Any]:
        """The values compute ``(s, m)`` reads: its uploads, and what it takes over."""
        on, key, out = self.on[d], (s, m), {}
        with on.lock:   # (loops, not comprehensions: each of those is a call, per action)
            for n in self.flow.upload.get(key, ()):
                out[n] = on.uploaded[(s, m, n)]
            for n, p in self.flow.handoff.get(key, ()):
                out[n] = on.made[(p, m, n)]
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
        on = self.on[d]
        with on.lock:
            params = on.params[st.index]
        call = self.call
        return run_stage(st, inputs, params, call_seed=call.call_seed, microbatch=m,
                         device=self.torch_devices[d], timer=call.timer if timed else None,
                         stats=self.stats, backend=call.stage_backend, scratch=call.scratch, **kw)

    def forward(self, d: int, s: int, m: int) -> None:
        st = self.call.exe.stages[s]
        values = self._inputs(d, s, m)
        inputs = [values[n] for n in st.inputs]
        # no grad, as ``torch.no_grad()`` (five Python calls a run: this is per action)
        grad = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)
        try:
            if self.call.autocast:
                with reentered(self.call.autocast):
                    outs, writebacks = self._run(d, st, inputs, m, keep_writebacks=True)
            else:
                outs, writebacks = self._run(d, st, inputs, m, keep_writebacks=True)
        finally:
            torch._C._set_grad_enabled(grad)
        if writebacks:
            with self.on_host.lock:
                self.call.writebacks.extend(writebacks)
        self._made(d, s, m, outs)

    def _made(self, d: int, s: int, m: int, outs: tuple) -> None:
        self.call.devices[d].keep(outs)   # they outlive the compute: activations
        with self.on[d].lock:
            for name, value in zip(self.call.exe.stages[s].outputs, outs):
                self.on[d].made[(s, m, name)] = value

    def graph_forward(self, d: int, s: int, m: int) -> None:
        """``GraphForward``: the forward job as a device graph (``runtime.stages.graphs``),
        captured at its key's first run; a stage whose parameters found no slot runs
        its compiled code instead."""
        call, st = self.call, self.call.exe.stages[s]
        with self.on[d].lock:
            params = self.on[d].params[s]
        if params.slot is None:
            self.forward(d, s, m)
            return
        dev = call.devices[d]
        device = _torch_device(dev)
        inputs = [self._inputs(d, s, m)[n] for n in st.inputs]
        if params.layout is None:   # once per upload: its microbatches share it
            params.layout = [params[f] for f in st.params]
        held = params.layout

        def job(xs: list, views: tuple) -> tuple:
            with torch.no_grad(), reentered(call.autocast):
                outs, _ = run_stage(st, xs, dict(zip(st.params, views)), call_seed=None,
                                    microbatch=m, device=device, keep_writebacks=False,
                                    backend=call.stage_backend)
            return outs

        with torch.no_grad(), reentered(call.autocast):
            outs = call.graphs.run(d, (id(st.gm), "forward", *params.slot), inputs, held, dev,
                                   job, f"the graph of stage {s} on {dev.name}", self.stats)
        self._made(d, s, m, outs)

    def _leaf(self, name: str, x: Any) -> Any:
        """A stage input as backward sees it: a leaf that requires grad if the value may
        have a gradient (``passes.grad_flow``), else the value itself (no gradient work)."""
        return x.detach().requires_grad_() if self._wants_grad(name, x) else x

    def _wants_grad(self, name: str, x: Any) -> bool:
        wanted = self.call.differentiable
        return (wanted is None or name in wanted) and isinstance(x, torch.Tensor) \
            and (x.is_floating_point() or x.is_complex())

    def fused(self, d: int, s: int, m: int) -> None:
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
                flat = lg.flat_outputs({**leaves, **made})
                loss, weight = call.loss_weights.weigh(
                    m, call.loss_fn(pytree.tree_unflatten(flat, lg.out_spec), label), flat)
            if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
                raise ValueError("loss_fn must return a scalar tensor (or a pair (sum, count)), "
                                 f"got {type(loss).__name__} {tuple(getattr(loss, 'shape', ()))}")
            scaled = loss if weight == 1.0 else loss * weight
            with self.on_host.lock:
                call.writebacks.extend(writebacks)   # the tail's forward is its only one
                # the returned loss is at least fp32 (as eager autocast's and HF's are),
                # its microbatches added in it
                call.losses[m] = scaled.detach().to(torch.promote_types(scaled.dtype,
                                                                        torch.float32))
            dev.keep(made, saved=True)
            with self.on[d].lock:
                for name, value in made.items():
                    self.on[d].made[(s, m, name)] = _detached(value)
            with self._timed_backward(st.layers, device), dev.allocating("gradients"):
                if scaled.requires_grad:
                    scaled.backward()
        self._give_grads(d, s, m, _grads_of(leaves))

    def recompute_backward(self, d: int, s: int, m: int) -> None:
        """Recompute the stage from its saved inputs (its unfilled nodes recorded, not computed),
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

    def graph_recompute_backward(self, d: int, s: int, m: int) -> None:
        """``GraphRecomputeBackward``: the recompute and the backward as one device graph
        (``runtime.stages.graphs``). It adds the parameters' gradients into gradient buffers in
        the stage's parameter slot (zeroed by the stage job's first backward; they are
        the parameters' ``.grad``, which ``DownloadGrads`` reads) and returns the inputs'
        gradients (cloned: the next replay overwrites them)."""
        call, st = self.call, self.call.exe.stages[s]
        with self.on[d].lock:
            params = self.on[d].params[s]
        if params.slot is None:
            self.recompute_backward(d, s, m)
            return
        dev = call.devices[d]
        device = _torch_device(dev)
        if params.layout is None:   # the job's first backward: gradients start at zero
            params.layout = _BackwardLayout(st, params, call.store.slot_grads(s, params))
            with torch.no_grad():
                if params.layout.sums:   # none in a frozen stage (LoRA's embedding)
                    torch._foreach_zero_(params.layout.sums)
                for v, g in zip(params.layout.trainable, params.layout.sums):
                    v.grad = g
        layout = params.layout
        at, trained, n_views = layout.at, layout.trained, len(layout.views)
        values = self._inputs(d, s, m)
        inputs = [values[n] for n in st.inputs]
        grads = self._take_grads(d, s, m)
        reads = [*inputs, *(grads.get(n) for n in st.outputs)]
        leaf = tuple(self._wants_grad(n, x) for n, x in zip(st.inputs, inputs))
        n_in = len(inputs)

        def job(xs: list, fixed: tuple) -> tuple:
            views, sums = fixed[:n_views], fixed[n_views:]
            ins = [x.detach().requires_grad_() if want else x for x, want in zip(xs[:n_in], leaf)]
            ps = [p.detach().requires_grad_() if p.requires_grad else p for p in views]
            with torch.enable_grad(), reentered(call.autocast):
                outs, _ = run_stage(st, ins, {f: ps[i] for f, i in at.items()}, call_seed=None,
                                    microbatch=m, device=device, keep_writebacks=False,
                                    backend=call.stage_backend, kind="recompute")
                wrt = [x for x, want in zip(ins, leaf) if want] + [ps[i] for i in trained]
                got = unfilled.grads_of(zip(outs, xs[n_in:]), wrt)
            k = sum(leaf)
            with torch.no_grad():
                pairs = [(acc, g) for acc, g in zip(sums, got[k:]) if g is not None]
                if pairs:   # one call for every parameter's gradient
                    torch._foreach_add_([a for a, _ in pairs], [g for _, g in pairs])
            return got[:k]

        with dev.allocating("gradients"):
            outs = call.graphs.run(d, (id(st.gm), "backward", *params.slot, leaf), reads,
                                   layout.fixed, dev, job,
                                   f"the backward graph of stage {s} on {dev.name}", self.stats)
        given = iter(outs)
        self._give_grads(d, s, m, {n: next(given) for n, want in zip(st.inputs, leaf) if want})

    def checkpoint(self, d: int, s: int, m: int) -> None:
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

    def layer_backward(self, d: int, s: int, m: int, layer: int) -> None:
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


class _BackwardLayout:
    """What a stage's backward graph job reads of its upload, worked out once per upload:
    the views (a tied parameter once), each name's place among them, the trainable ones
    and their places, their gradient buffers in the slot (``sums``), and the slot's
    tensors the job reads and writes (``fixed``: the views, then the buffers)."""

    def __init__(self, st: Any, params: Mapping[str, torch.Tensor], sums: list[torch.Tensor]):
        unique = {id(params[f]): params[f] for f in st.params}
        order = list(unique)
        self.views = list(unique.values())
        self.at = {f: order.index(id(params[f])) for f in st.params}
        self.trainable = [v for v in {id(v): v for v in params.values()}.values()
                          if v.requires_grad]
        self.trained = [order.index(id(v)) for v in self.trainable]
        self.sums = sums
        self.fixed = [*self.views, *sums]


def _grads_of(leaves: Mapping[str, Any]) -> dict[str, torch.Tensor | None]:
    return {n: x.grad if isinstance(x, torch.Tensor) and x.requires_grad else None
            for n, x in leaves.items()}


def _detached(x: Any) -> Any:
    return x.detach() if isinstance(x, torch.Tensor) else x


def _backprop(outputs: Mapping[str, Any], grads: Mapping[str, torch.Tensor | None]) -> None:
    """Back-propagate ``grads`` (by value name) from the ``outputs`` that have one."""
    unfilled.backprop((o, grads.get(n)) for n, o in outputs.items())


_CPU = torch.device("cpu")


def _torch_device(device: Device) -> torch.device:
    return getattr(device, "device", _CPU)
