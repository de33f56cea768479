"""fxpipe: train and run models larger than one GPU's memory on a few GPUs.

``pipe = fxpipe.compile(model, example_inputs=(x,))`` captures the model, cuts it into a
chain of layers with costs, plans stages, and lowers them into stage graphs whose code
shows the transfers. See README.md and docs/.

Importing fxpipe starts no threads and queries no device. It loads the compiler (capture,
partition, costs, lowering, the planner) only when a name that needs it is first used:
``compile``, ``PipelineModule`` and ``ExecutePlan`` are looked up on first use (PEP 562),
and so is a submodule such as ``fxpipe.plan`` or ``fxpipe.sim``. The runtime
(``fxpipe.runtime``) imports without the compiler.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

from fxpipe import optim
from fxpipe.backend import backend
from fxpipe.config import RunConfig
from fxpipe.errors import (CaptureError, DeviceMemoryError, DistributedError, PlanError,
                           StageError)
from fxpipe.losses import linear_cross_entropy
from fxpipe.runtime.devices.cuda import CudaDevice
from fxpipe.runtime.devices.device import Device
from fxpipe.runtime.devices.emulator import VirtualDevice
from fxpipe.runtime.issue.microbatch import PackedData
from fxpipe.verbose import set_verbose

if TYPE_CHECKING:
    from fxpipe import plan, sim
    from fxpipe.api import PipelineModule, compile
    from fxpipe.plan import ExecutePlan

# public names whose modules load the compiler: imported on first use
_ON_FIRST_USE = {"compile": "fxpipe.api", "PipelineModule": "fxpipe.api",
                 "ExecutePlan": "fxpipe.plan"}


def __getattr__(name: str) -> Any:
    """``fxpipe.compile``, ``fxpipe.PipelineModule``, ``fxpipe.ExecutePlan`` and the
    submodules (``fxpipe.plan``, ``fxpipe.sim``, ...), imported when first asked for."""
    if name in _ON_FIRST_USE:
        value = getattr(importlib.import_module(_ON_FIRST_USE[name]), name)
        globals()[name] = value
        return value
    if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__) | {"plan"})


def simulate(pipe_or_program, hardware=None, *, costs=None, run_type: str = "fused",
             num_microbatch: int | None = None, **kwargs):
    """Simulate a pipeline's schedule on a hardware model; returns a ``fxpipe.sim.Timeline``
    (``makespan``, ``bubble_ratio``, per-device ``busy``, ``to_chrome_trace``, ``plot``,
    and the predicted peak bytes per device: ``peak_memory``, by kind in
    ``peak_memory_by_kind``, as ``fxpipe.plan.predict_memory`` gives them).

    ``pipe_or_program``: a ``PipelineModule`` (its Program for ``run_type`` and its layers'
    costs: measured times where known, else FLOPs on ``hardware``; its memory for one
    microbatch, costed on fake tensors; the host's issue time for its ``stage_backend``,
    ``"auto"`` priced as ``"inductor"``) or a ``Program`` with ``costs`` (a
    ``fxpipe.sim.LayerCost`` per layer). ``kwargs`` go to ``fxpipe.sim.simulate``.

    >>> import torch, fxpipe
    >>> model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)])
    >>> pipe = fxpipe.compile(model, example_inputs=(torch.randn(512, 1024),), devices=["cpu"] * 2)
    >>> t = fxpipe.simulate(pipe, fxpipe.sim.Hardware.rtx4090_pcie4())
    >>> round(t.bubble_ratio, 1)    # percent of the devices' time spent idle
    93.1
    >>> t.peak_memory_by_kind[0]["params"]   # the stage's and the prefetched one's
    8396800
    """
    from fxpipe.api import PipelineModule
    from fxpipe.plan import chain_memory, layer_costs
    from fxpipe.sim import Hardware, LayerCost
    from fxpipe.sim import simulate as _simulate
    hardware = hardware or Hardware()
    if isinstance(pipe_or_program, PipelineModule):
        program = pipe_or_program.program(run_type, num_microbatch)
        if costs is None:
            costs = [LayerCost.of(c, hardware) for c in layer_costs(pipe_or_program)]
        kwargs.setdefault("memory", chain_memory(pipe_or_program, program.num_microbatches))
        backend = pipe_or_program.stage_backend
        kwargs.setdefault("stage_backend", "inductor" if backend == "auto" else backend)
    else:
        program = pipe_or_program
        if costs is None:
            raise TypeError("fxpipe.simulate(program, ...) needs costs=[LayerCost per layer]; "
                            "pass a PipelineModule to use its own costs")
    return _simulate(program, costs, hardware, **kwargs)


__all__ = [
    "CaptureError", "CudaDevice", "Device", "DeviceMemoryError", "DistributedError", "ExecutePlan",
    "PackedData", "PipelineModule", "PlanError", "RunConfig", "StageError", "VirtualDevice",
    "backend", "compile", "linear_cross_entropy",
    "optim", "set_verbose", "sim", "simulate",
]
