"""Run a lowered stage's graph on a device: the printed program, node by node.

The stage's ``torch.ops.fxpipe.*`` nodes mark where data moves; the executor's Program
actions move it (on the device's copy streams), and this interpreter serves the nodes
from what those actions left on the device:

=================  ===========================================================
``prefetch``        the parameters the ``Prefetch`` action made resident
``upload``          the input the ``Upload`` action copied (already on device)
``offload``         the value itself; the ``Offload`` action copies it out
``writeback``       buffer updates, kept for the host in forward, dropped in recompute
``release``         nothing: the ``Release`` action frees the parameters
``rng``             seeds the layer from (call seed, layer, microbatch)
=================  ===========================================================

Recomputing for backward, the nodes in ``defer`` (the stage's ``tail``: values backward
does not read) run under ``tail.Unfilled``: autograd records them, their matmuls and adds
do not run.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Mapping
from typing import Any

import torch
import torch.fx as fx

from fxpipe.passes.stage import Stage
from fxpipe.runtime import rng
from fxpipe.runtime.tail import Unfilled
from fxpipe.runtime.timer import LayerTimer

_op = torch.ops.fxpipe


class StageRun(fx.Interpreter):
    """One microbatch through one stage. ``writebacks`` collects buffer updates."""

    def __init__(self, stage: Stage, resident: Mapping[str, torch.Tensor], *,
                 call_seed: int | None, microbatch: int, device: torch.device,
                 keep_writebacks: bool, timed: bool = False, defer: Collection[str] = ()):
        super().__init__(stage.gm, garbage_collect_values=True)
        self.defer = defer
        self.unfilled = Unfilled() if defer else None
        self.timed = timed
        self.layer_seconds: dict[int, float] = {}  # per layer, when ``timed``
        self._layer: int | None = None
        self._since = 0.0
        self._events: list[tuple[int | None, Any]] = []  # CUDA: (layer ending here, event)
        self.stage = stage
        self.resident = resident
        self.call_seed = call_seed
        self.microbatch = microbatch
        self.torch_device = device
        self.keep_writebacks = keep_writebacks
        self.writebacks: list[tuple[torch.Tensor, torch.Tensor]] = []

    def run_node(self, n: fx.Node) -> Any:
        if self.timed:
            self._enter(n.meta.get("layer"))
        if n.name in self.defer:
            with self.unfilled:
                return super().run_node(n)
        return super().run_node(n)

    def _enter(self, layer: int | None) -> None:
        """Charge the time since the last layer change to that layer; transfer nodes
        belong to none. On CPU, work is synchronous and wall time is the layer's time; on
        CUDA, events recorded on the stream at each change are read in ``layer_times``."""
        if layer == self._layer:
            return
        if self.torch_device.type == "cuda":
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

    def layer_times_ms(self) -> dict[int, float]:
        """Milliseconds per layer of this run (waits for the CUDA events, if any)."""
        self._enter(None)
        if self._events:
            self._events[-1][1].synchronize()
            for (_, start), (layer, end) in zip(self._events, self._events[1:]):
                if layer is not None:
                    self.layer_seconds[layer] = (self.layer_seconds.get(layer, 0.0)
                                                 + start.elapsed_time(end) / 1e3)
        return {layer: s * 1e3 for layer, s in self.layer_seconds.items()}

    def call_function(self, target: Any, args: tuple, kwargs: dict) -> Any:
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
        if target is _op.rng.default:
            if self.call_seed is not None:
                rng.seed_layer(self.torch_device, rng.layer_seed(self.call_seed, args[0],
                                                                 self.microbatch))
            return None
        return super().call_function(target, args, kwargs)


def run_stage(stage: Stage, inputs: list, resident: Mapping[str, torch.Tensor], *,
              call_seed: int | None, microbatch: int, device: torch.device,
              keep_writebacks: bool, timer: LayerTimer | None = None,
              kind: str = "fwd") -> tuple[tuple, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Run ``stage`` on one microbatch; returns (outputs, buffer writebacks). With a
    ``timer`` (CPU devices), each layer's time is recorded as ``kind``. A ``"recompute"``
    records the stage's ``tail`` for autograd without computing it (``runtime.tail``)."""
    timed = timer is not None
    runner = StageRun(stage, resident, call_seed=call_seed, microbatch=microbatch,
                      device=device, keep_writebacks=keep_writebacks, timed=timed,
                      defer=stage.tail if kind == "recompute" else ())
    if stage.random and call_seed is not None:
        with rng.isolated(device):
            out = runner.run(*inputs)
    else:
        out = runner.run(*inputs)
    if timed:
        for layer, ms in runner.layer_times_ms().items():
            timer.record(layer, kind, ms)
    return tuple(out), runner.writebacks
