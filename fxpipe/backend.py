"""``torch.compile(model, backend=fxpipe.backend())``: fxpipe for torch.compile users.

TorchDynamo captures the model as usual and hands each graph to the backend, which
turns it into a ``PipelineModule`` (the same passes and runtime as ``fxpipe.compile``;
see ``fxpipe.passes.from_dynamo``) and returns a function running it. The model's own
parameters are the pipeline's parameters, so ``loss.backward()`` fills their ``.grad``
and any optimizer works on them.

>>> import fxpipe
>>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
>>> x = torch.randn(6, 4)
>>> be = fxpipe.backend(devices=["cpu", "cpu"])
>>> compiled = torch.compile(model, backend=be, dynamic=True)
>>> compiled(x).sum().backward()
>>> print(be.pipe)          # the last graph compiled, rewritten  # doctest: +ELLIPSIS
# PipelineModule: 2 layers on vcpu:0, vcpu:1; plan fwd [0:1] bwd [1:2, 0:1]
...
def forward(self, args_0):
    args_0_0, args_0_1, args_0_2 = split(args_0, 3)           # the caller's inputs, 3 microbatches
    refresh()                                                 # RF host
    # stage 0 fwd | layer 0 (prefix) | vcpu:0 | params 0 B | saved 0 B | out 96 B | ...
    params_0 = prefetch(self.stage_0, 'vcpu:0')               # 0P vcpu:0
    # stage 1 fwd | layer 1 (fn) | vcpu:1 | params 232 B | saved 288 B | out 48 B | ...
    params_1 = prefetch(self.stage_1, 'vcpu:1')               # 1P vcpu:1
...

fxpipe needs the whole forward as one graph: a graph break raises
``fxpipe.CaptureError`` naming where dynamo broke the graph and why. Dynamo recompiles
(a new graph, a new pipe) when guards fail — e.g. on ``model.eval()`` or, without
``dynamic=True``, on the first new input size.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx

from fxpipe.config import RunConfig
from fxpipe.errors import CaptureError
from fxpipe.runtime.devices.device import Device
from fxpipe.runtime.devices.resolve import resolve_devices
from fxpipe.stage_plan import StagePlan


class Backend:
    """A ``torch.compile`` backend compiling each graph into a ``PipelineModule``.

    Made by :func:`fxpipe.backend`; ``pipes`` lists every pipe built (one per graph
    dynamo compiled), ``pipe`` is the latest.
    """

    def __init__(self, devices: Sequence[str | torch.device | Device] | None, layers: str | None,
                 config: RunConfig | None, plan: StagePlan | None):
        if config is not None and not isinstance(config, RunConfig):
            raise TypeError(f"config must be an fxpipe.RunConfig, got {type(config).__name__}")
        if plan is not None and not isinstance(plan, StagePlan):
            raise TypeError(f"plan must be an fxpipe.ExecutePlan, got {type(plan).__name__}")
        self.devices = resolve_devices(devices)  # shared by every graph's pipe
        self.layers, self.config, self.plan = layers, config or RunConfig(), plan
        self.pipes: list = []

    @property
    def pipe(self):
        """The ``PipelineModule`` of the last graph compiled."""
        if not self.pipes:
            raise RuntimeError("no graph compiled yet: call the torch.compile'd model once first")
        return self.pipes[-1]

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        from fxpipe.api import PipelineModule
        from fxpipe.passes.from_dynamo import from_dynamo
        _refuse_graph_break(gm)
        root, captured, positions = from_dynamo(gm, example_inputs)
        args = tuple(example_inputs[i] for i in positions)
        once = [captured]

        def capture() -> fx.GraphModule:
            if not once:
                raise CaptureError("a torch.compile backend graph serves one training mode and "
                                   "input signature; torch.compile recompiles for others", {})
            return once.pop()

        pipe = PipelineModule(root, args, {}, devices=self.devices, capture=capture,
                              layers=self.layers, config=self.config, plan=self.plan)
        self.pipes.append(pipe)

        def run(*flat: Any) -> Any:
            return pipe(*(flat[i] for i in positions))

        return run

    def __repr__(self) -> str:
        return f"fxpipe.backend(devices=[{', '.join(d.name for d in self.devices)}])"


def backend(*, devices: Sequence[str | torch.device | Device] | None = None,
            layers: str | None = None, config: RunConfig | None = None,
            plan: StagePlan | None = None) -> Backend:
    """A ``torch.compile`` backend running the model as an fxpipe pipeline.

    ``devices``, ``layers``, ``config`` and ``plan`` mean what they mean for
    ``fxpipe.compile`` (``layers`` is the dotted path of the repeated blocks in the
    model). Use ``torch.compile(model, backend=fxpipe.backend(...), dynamic=True)`` so one
    graph serves every batch size.
    """
    return Backend(devices, layers, config, plan)


def _refuse_graph_break(gm: fx.GraphModule) -> None:
    reason = getattr(gm, "compile_subgraph_reason", None)
    if reason is None or not getattr(reason, "graph_break", False):
        return
    where = "; ".join(f"{f.filename}:{f.lineno} in {f.name}" for f in (reason.user_stack or [])[-2:])
    why = (str(reason.reason).strip().splitlines() or ["unknown"])[0]
    raise CaptureError(
        f"torch.compile broke the model's graph at {where or 'an unknown place'} ({why}): "
        "fxpipe's backend needs the whole forward as one graph. Remove the break (see "
        "torch._dynamo.explain(model)(*inputs) for every break and its cause) or use "
        "fxpipe.compile(model, example_inputs=...), which can also capture with torch.fx or "
        "torch.export.", {"torch.compile": RuntimeError(str(reason.reason))})
