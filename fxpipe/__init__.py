"""fxpipe: train and run models larger than one GPU's memory on a few GPUs.

``pipe = fxpipe.compile(model, example_inputs=(x,))`` captures the model, cuts it into a
chain of layers with costs, plans stages, and lowers them into stage graphs whose code
shows the transfers. See README.md and docs/.

Importing fxpipe starts no threads and queries no device.
"""

from fxpipe.api import PipelineModule, compile
from fxpipe.config import RunConfig
from fxpipe.errors import CaptureError, DeviceMemoryError, PlanError, StageError
from fxpipe.plan import ExecutePlan
from fxpipe.runtime.devices import Device, VirtualDevice
from fxpipe.runtime.microbatch import PackedData
from fxpipe.verbose import set_verbose


def simulate(pipe_or_program, hardware=None, **kwargs):
    """Simulate a pipeline's schedule on a hardware model (see ``fxpipe.sim``)."""
    from fxpipe.sim import simulate as _simulate
    return _simulate(pipe_or_program, hardware=hardware, **kwargs)


__all__ = [
    "CaptureError", "Device", "DeviceMemoryError", "ExecutePlan", "PackedData", "PipelineModule",
    "PlanError", "RunConfig", "StageError", "VirtualDevice", "compile", "set_verbose", "simulate",
]
