"""Build an ``Executable``: every GraphModule one kind of call runs, and its Program.

``build_executable(lg, plan, spec, names)`` lowers the plan's stages for that run type
(forward stages with the values backward stages restart from, backward stages, the
fused tail, and at ``grain="layer"`` the single-layer pieces a backward stage of several
layers runs), reads off what each stage reads and makes, and builds the Program over
them (``passes.schedule``). ``fxpipe.compile`` caches one per plan and ``CallSpec``
(run type, microbatch count, grain, optimizer, outputs, input gradients, collectives);
the runtime interprets it and lowers nothing.

>>> import torch, torch.nn as nn
>>> from fxpipe.passes.partition import build_layer_graph
>>> from fxpipe.stage_plan import StagePlan
>>> lg = build_layer_graph(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)),
...                        (torch.randn(3, 4),))
>>> plan = StagePlan([range(0, 2)], [range(2, 3), range(0, 2)])
>>> exe = build_executable(lg, plan, CallSpec("fused", 1), ["vcpu:0", "vcpu:1"])
>>> for line in exe.code().splitlines():
...     if line.strip().startswith("# stage"):
...         print(line.strip())
# stage 0 fwd | layers 0-1 (0, 1) | vcpu:0
# stage 1 fused | layer 2 (2) | vcpu:1
# stage 2 bwd | layers 0-1 (0, 1) | vcpu:0
"""

from __future__ import annotations

from collections.abc import Sequence

from fxpipe.errors import PlanError
from fxpipe.passes import gc_paused
from fxpipe.passes.layer_graph import LayerGraph
from fxpipe.passes.lower import lower, lower_stage
from fxpipe.passes.schedule import LABEL, CallSpec, Values, build_program
from fxpipe.passes.stage import Executable, Stage
from fxpipe.stage_plan import RunType, StagePlan


def stage_ranges(plan: StagePlan, run_type: RunType, num_layers: int) -> tuple[list[range], list[range]]:
    """(forward ranges, backward ranges) a ``run_type`` call runs under ``plan``: a
    ``"fused"`` call's forward stops where its tail stage starts; ``"infer"`` and
    ``"train"`` run a fused plan's tail forward too."""
    fwd, bwd = list(plan.fwd_plan), list(plan.bwd_plan)
    tail = bwd[0] if bwd else None
    if run_type != "infer" and tail is None:
        raise PlanError(f"this ExecutePlan has no bwd_plan, so it can only run inference; "
                        f"a {'fused step' if run_type == 'fused' else 'backward'} needs "
                        "backward stages (bwd_plan=[...]), or use torch.no_grad()")
    if run_type == "fused":
        return [range(r.start, min(r.stop, tail.start)) for r in fwd if r.start < tail.start], bwd
    covered = fwd[-1].stop if fwd else 0
    if covered < num_layers:   # a fused-style plan: the tail runs forward too
        fwd.append(range(covered, num_layers))
    return fwd, (bwd if run_type == "train" else [])


def build_executable(lg: LayerGraph, plan: StagePlan, spec: CallSpec,
                     device_names: Sequence[str]) -> Executable:
    """Lower ``plan`` for the call ``spec`` describes and build its Program (module
    docstring; ``CallSpec`` has the fields: run type, microbatches, grain, the
    optimizer's host actions, outputs, input gradients, collectives)."""
    run_type, grain = spec.run_type, spec.grain
    names = list(device_names)
    G = len(names)
    fwd, bwd = stage_ranges(plan, run_type, len(lg))
    with gc_paused():
        fstages = lower(lg, fwd, names, save_cuts=[r.start for r in bwd]) if fwd else []
        stages: dict[int, Stage] = {st.index: st for st in fstages}
        pieces: dict[tuple[int, int], Stage] = {}
        for k, r in enumerate(bwd):
            i = len(fwd) + k
            kind = "fused" if run_type == "fused" and k == 0 else "bwd"
            stages[i] = lower_stage(lg, r, i, i % G, names, kind=kind)
            if grain == "layer" and kind == "bwd" and len(r) > 1:
                for layer in r:
                    pieces[(i, layer)] = lower_stage(lg, range(layer, layer + 1), i, i % G, names,
                                                     kind="bwd", piece=True)
    reads, makes = [], []
    for i in sorted(stages):
        st = stages[i]
        loss_reads = [o for o in lg.output_names if o not in st.outputs and o not in st.inputs] \
            if st.kind == "fused" else []
        label = (LABEL,) if st.kind == "fused" else ()
        reads.append(tuple(st.inputs) + tuple(loss_reads) + label)
        makes.append(tuple(st.outputs))
    owns, shared = ownership(lg, [stages[i] for i in sorted(stages)])
    values = Values(tuple(reads), tuple(makes),
                    tuple(lg.input_names) + ((LABEL,) if run_type == "fused" else ()),
                    tuple(lg.output_names) if spec.outputs else (),
                    tuple(n for n in lg.input_names if n in set(spec.input_grads)), shared,
                    owns)
    program = build_program(fwd, bwd, run_type, G, spec.num_microbatch, "stage",
                            optimizer=spec.optimizer, grain=grain, values=values,
                            data_parallel=spec.data_parallel,
                            broadcast_buffers=spec.broadcast_buffers, chunks=spec.chunks,
                            gather_params=spec.gather_params)
    return Executable(run_type, grain, program, stages, pieces)


def ownership(lg: LayerGraph, stages: Sequence[Stage]
              ) -> tuple[tuple[tuple[str, ...], ...], tuple[tuple[int, ...], ...]]:
    """Which backward stage owns which trainable parameter, computed once per Program:
    ``(owns, shared)``. ``owns[i]``: the names (a tied parameter under its first name in
    ``lg.params``) of the parameters stage ``i`` (execution order) is the last backward
    stage to use, in the order backward stages first use them; empty for a forward
    stage. ``shared``: the groups of backward stages that use one parameter."""
    first: dict[int, str] = {}
    for fqn, p in lg.params.items():
        first.setdefault(id(p), fqn)
    holders: dict[int, list[int]] = {}   # id(parameter) -> backward stages using it
    for st in stages:
        if st.kind == "fwd":
            continue
        for fqn in st.params:
            p = lg.params.get(fqn)
            if p is not None and p.requires_grad and st.index not in holders.get(id(p), ()):
                holders.setdefault(id(p), []).append(st.index)
    owns: list[list[str]] = [[] for _ in stages]
    for key, held in holders.items():
        owns[max(held)].append(first[key])
    shared = tuple(sorted({tuple(sorted(h)) for h in holders.values() if len(h) > 1}))
    return tuple(tuple(o) for o in owns), shared
