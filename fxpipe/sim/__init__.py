"""Discrete-event simulator over the same Program the executor runs.

    >>> from fxpipe.passes.schedule import build_program
    >>> from fxpipe.sim import Hardware, LayerCost, simulate
    >>> p = build_program([range(0, 2)], [range(2, 4), range(0, 2)], "fused", 2, 4, "stage")
    >>> t = simulate(p, [LayerCost(1.0, 2.0, param_bytes=10**9)] * 4, Hardware.rtx4090_pcie4())
    >>> t.makespan > 32.0           # 2 GB of parameters per stage are not free to prefetch
    True

``simulate`` times a Program; ``roundpipe_program`` builds RoundPipe's timing-dependent
dispatch with it; ``optimizer_modes`` times a step with the host optimizer synchronous,
streamed (exact) or one-step stale; ``Hardware`` and ``LayerCost`` describe the inputs
and ``Timeline`` the result (see ``fxpipe.sim.timeline`` for the bubble definitions);
``fxpipe.sim.collectives`` how a data-parallel Program's collectives are priced on the
host or, MODELLED, on the devices (``Hardware.collectives``).
"""

from fxpipe.sim.hardware import Hardware, LayerCost
from fxpipe.sim.optimizer import OptimizerModes, optimizer_modes, with_optimizer_steps
from fxpipe.sim.simulate import roundpipe_program, simulate
from fxpipe.sim.timeline import Interval, Timeline

__all__ = ["Hardware", "Interval", "LayerCost", "OptimizerModes", "Timeline", "optimizer_modes",
           "roundpipe_program", "simulate", "with_optimizer_steps"]
