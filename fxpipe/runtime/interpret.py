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
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.fx as fx

from fxpipe.passes.lower import Stage
from fxpipe.runtime import rng

_op = torch.ops.fxpipe


class StageRun(fx.Interpreter):
    """One microbatch through one stage. ``writebacks`` collects buffer updates."""

    def __init__(self, stage: Stage, resident: Mapping[str, torch.Tensor], *,
                 call_seed: int | None, microbatch: int, device: torch.device,
                 keep_writebacks: bool):
        super().__init__(stage.gm, garbage_collect_values=True)
        self.stage = stage
        self.resident = resident
        self.call_seed = call_seed
        self.microbatch = microbatch
        self.torch_device = device
        self.keep_writebacks = keep_writebacks
        self.writebacks: list[tuple[torch.Tensor, torch.Tensor]] = []

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
              keep_writebacks: bool) -> tuple[tuple, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Run ``stage`` on one microbatch; returns (outputs, buffer writebacks)."""
    runner = StageRun(stage, resident, call_seed=call_seed, microbatch=microbatch,
                      device=device, keep_writebacks=keep_writebacks)
    if stage.random and call_seed is not None:
        with rng.isolated(device):
            out = runner.run(*inputs)
    else:
        out = runner.run(*inputs)
    return tuple(out), runner.writebacks
