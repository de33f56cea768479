"""Run a lowered stage on a device: the printed program.

The stage's ``torch.ops.fxpipe.*`` nodes mark where data moves; the executor's Program
actions move it (on the device's copy streams), and a stage run serves the nodes from
what those actions left on the device:

=================  ===========================================================
``prefetch``        the parameters the ``Prefetch`` action made resident
``upload``          the input the ``Upload`` action copied (already on device)
``offload``         the value itself; the ``Offload`` action copies it out
``writeback``       buffer updates, kept for the host in forward, dropped in recompute
``release``         nothing: the ``Release`` action frees the parameters
``rng``             seeds the layer from (call seed, layer, microbatch)
=================  ===========================================================

A stage runs as its generated code (``GraphModule.forward``) under :class:`Transfers`, a
``TorchFunctionMode`` that serves those nodes. Two things need the graph node by node,
and use ``StageRun`` (an ``fx.Interpreter``) instead: timing each layer (the timer's
sampled calls), and a recompute for backward that skips the stage's ``tail`` (values
backward does not read: those nodes run under ``tail.Unfilled``: autograd records them,
their matmuls and adds do not run).
"""

from __future__ import annotations

import time
from collections.abc import Collection, Mapping
from typing import Any

import torch
import torch.fx as fx
from torch.overrides import TorchFunctionMode

from fxpipe.passes.stage import Stage
from fxpipe.runtime import rng
from fxpipe.runtime.tail import Unfilled
from fxpipe.runtime.timer import LayerTimer

_op = torch.ops.fxpipe
_TRANSFER_OPS = frozenset({_op.prefetch.default, _op.upload.default, _op.offload.default,
                           _op.release.default, _op.writeback.default, _op.rng.default})


class _Serve:
    """What the fxpipe nodes of one stage run return (shared by both ways of running)."""

    def __init__(self, stage: Stage, resident: Mapping[str, torch.Tensor], *,
                 call_seed: int | None, microbatch: int, device: torch.device,
                 keep_writebacks: bool):
        self.stage = stage
        self.resident = resident
        self.call_seed = call_seed
        self.microbatch = microbatch
        self.torch_device = device
        self.keep_writebacks = keep_writebacks
        self.writebacks: list[tuple[torch.Tensor, torch.Tensor]] = []

    def transfer(self, target: Any, args: tuple) -> Any:
        if target is _op.prefetch.default:
            return [self.resident[fqn] for fqn in self.stage.params]
        if target is _op.upload.default or target is _op.offload.default:
            return args[0]
        if target is _op.release.default:
            return None
        if target is _op.writeback.default:
            if self.keep_writebacks:
                self.writebacks.append((args[0], args[1].detach().clone()))
            return None
        assert target is _op.rng.default, target
        if self.call_seed is not None:
            rng.seed_layer(self.torch_device, rng.layer_seed(self.call_seed, args[0],
                                                             self.microbatch))
        return None


class Transfers(TorchFunctionMode):
    """Serves a stage's fxpipe nodes while its generated code runs (module docstring)."""

    def __init__(self, serve: _Serve):
        super().__init__()
        self.serve = serve

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _TRANSFER_OPS:
            return self.serve.transfer(func, args)
        return func(*args, **(kwargs or {}))


class StageRun(fx.Interpreter):
    """One microbatch through one stage, node by node: per-layer timing (``timed``) and
    a skipped tail (``defer``). ``serve.writebacks`` collects buffer updates."""

    def __init__(self, stage: Stage, serve: _Serve, *, timed: bool = False,
                 defer: Collection[str] = ()):
        super().__init__(stage.gm, garbage_collect_values=True)
        self.serve = serve
        self.defer = defer
        self.unfilled = Unfilled() if defer else None
        self.timed = timed
        self.nodes = 0
        self.layer_seconds: dict[int, float] = {}  # per layer, when ``timed``
        self._layer: int | None = None
        self._since = 0.0
        self._events: list[tuple[int | None, Any]] = []  # CUDA: (layer ending here, event)

    def run_node(self, n: fx.Node) -> Any:
        self.nodes += 1
        if self.timed:
            self._enter(n.meta.get("layer"))
        if n.name in self.defer:
            with self.unfilled:
                return super().run_node(n)
        return super().run_node(n)

    def _enter(self, layer: int | None) -> None:
        """Charge the time since the last layer change to that layer; transfer nodes
        belong to none. On CPU, work is synchronous and wall time is the layer's time; on
        CUDA, events recorded on the stream at each change are read after the call."""
        if layer == self._layer:
            return
        if self.serve.torch_device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._events.append((self._layer, event))
        else:
            now = time.perf_counter()
            if self._layer is not None:
                self.layer_seconds[self._layer] = (self.layer_seconds.get(self._layer, 0.0)
                                                   + now - self._since)
            self._since = now
        self._layer = layer

    def record_times(self, timer: LayerTimer, kind: str) -> None:
        """Record each layer's time as ``kind`` (CUDA: once the call has ended)."""
        self._enter(None)
        for layer, s in self.layer_seconds.items():
            timer.record(layer, kind, s * 1e3)
        if self._events:
            events = self._events

            def read() -> None:
                ms: dict[int, float] = {}
                for (_, start), (layer, end) in zip(events, events[1:]):
                    if layer is not None:
                        ms[layer] = ms.get(layer, 0.0) + start.elapsed_time(end)
                for layer, t in ms.items():
                    timer.record(layer, kind, t)
            timer.later(read)

    def call_function(self, target: Any, args: tuple, kwargs: dict) -> Any:
        if target in _TRANSFER_OPS:
            return self.serve.transfer(target, args)
        return super().call_function(target, args, kwargs)


def run_stage(stage: Stage, inputs: list, resident: Mapping[str, torch.Tensor], *,
              call_seed: int | None, microbatch: int, device: torch.device,
              keep_writebacks: bool, timer: LayerTimer | None = None, kind: str = "fwd",
              stats: Any = None) -> tuple[tuple, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Run ``stage`` on one microbatch; returns (outputs, buffer writebacks). With a
    ``timer``, each layer's time is recorded as ``kind``. A ``"recompute"`` records the
    stage's ``tail`` for autograd without computing it (``runtime.tail``). ``stats``
    (``executor.Stats``) counts interpreted nodes and generated-code runs."""
    serve = _Serve(stage, resident, call_seed=call_seed, microbatch=microbatch, device=device,
                   keep_writebacks=keep_writebacks)
    defer = stage.tail if kind == "recompute" else ()
    runner = (StageRun(stage, serve, timed=timer is not None, defer=defer)
              if timer is not None or defer else None)

    def go():
        if runner is not None:
            return runner.run(*inputs)
        with Transfers(serve):
            return stage.gm(*inputs)

    try:
        if stage.random and call_seed is not None:
            with rng.isolated(device):
                out = go()
        else:
            out = go()
    except BaseException:
        if runner is not None:   # an exception the caller keeps must not keep the values
            runner.env.clear()
        raise
    if runner is not None:
        if timer is not None:
            runner.record_times(timer, kind)
        if stats is not None:
            stats.add("interpreted_nodes", runner.nodes)
    elif stats is not None:
        stats.add("generated_runs")
    return tuple(out), serve.writebacks
