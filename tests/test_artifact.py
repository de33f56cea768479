"""One compiled artifact: what ``pipe.code()`` and ``pipe.program()`` show is everything the
runtime runs, and the runtime imports no pass.

- every action a call executes is an action of the Program ``pipe.program(...)`` returns
  for that kind of call, and every action of it runs (as a multiset), for each run type,
  optimizer mode, grain and device count;
- every GraphModule the interpreter runs is one of those ``pipe.code()`` prints (by
  identity), and ``pipe.code()`` has one ``# stage`` header per stage of the plan.
"""

from __future__ import annotations

import collections
import copy

import pytest
import torch
import torch.nn.functional as F

import fxpipe
from fxpipe.demo import TinyLlama
from fxpipe.runtime import executor
from tests import models

# 6 layers (prefix, 4 blocks, suffix); an asymmetric plan with a fused tail
PLAN = fxpipe.ExecutePlan(fwd_plan=[range(0, 3), range(3, 5)],
                          bwd_plan=[range(5, 6), range(3, 5), range(1, 3), range(0, 1)])


def ce(out, label):
    return F.cross_entropy(out.flatten(0, 1), label.flatten())


def gpt_pipe(num_devices: int, grain: str = "stage"):
    torch.manual_seed(0)
    model = models.GPT(depth=4).eval()
    pipe = fxpipe.compile(model, example_inputs=(torch.randint(0, 64, (6, 8)),),
                          devices=[fxpipe.VirtualDevice() for _ in range(num_devices)], plan=PLAN,
                          config=fxpipe.RunConfig(num_microbatch=3, recompute_grain=grain))
    return model, pipe


def run_call(pipe, model, kind: str) -> None:
    ids, y = torch.randint(0, 64, (6, 8)), torch.randint(0, 64, (6, 8))
    if kind == "fused":
        pipe.forward_backward((ids,), label=y, loss_fn=ce)
    elif kind in ("exact", "async"):
        opt = fxpipe.optim.overlapped(torch.optim.SGD(model.parameters(), lr=0.1), mode=kind)
        pipe.forward_backward((ids,), label=y, loss_fn=ce, optimizer=opt)
        opt.synchronize()
    elif kind == "eager":
        ce(pipe(ids), y).backward()
    else:
        assert kind == "infer", kind
        with torch.no_grad():
            pipe(ids)


PROGRAM_ARGS = {"fused": ("fused", False), "exact": ("fused", "exact"),
                "async": ("fused", "async"), "eager": ("train", False), "infer": ("infer", False)}


@pytest.mark.parametrize("num_devices", [1, 2, 3])
@pytest.mark.parametrize("kind", ["fused", "exact", "async", "eager", "infer"])
@pytest.mark.parametrize("grain", ["stage", "layer"])
def test_executed_actions_are_the_programs(num_devices, kind, grain):
    if grain == "layer" and kind == "infer":
        pytest.skip("inference recomputes nothing: one grain")
    model, pipe = gpt_pipe(num_devices, grain)
    with pipe.trace() as rec:
        run_call(pipe, model, kind)
    run_type, optimizer = PROGRAM_ARGS[kind]
    program = pipe.program(run_type, num_microbatch=3, optimizer=optimizer, grain=grain)
    assert collections.Counter(rec.actions) == collections.Counter(program.action_strings())
    # ... and each device ran its actions in an order the Program allows: a stream's
    # actions complete in the order they are listed
    for lane, acts in program.lanes():
        listed = [str(a) for a in acts]
        ran = [s for d, s in rec.actions if d == lane]
        for stream in {executor.stream_of(a) for a in acts}:
            of_stream = [str(a) for a in acts if executor.stream_of(a) == stream]
            assert [s for s in ran if s in of_stream] == of_stream, (lane, stream)
        assert sorted(ran) == sorted(listed)


def test_programs_list_optimizer_steps_and_the_commit():
    _, pipe = gpt_pipe(2)
    exact = pipe.program("fused", num_microbatch=3, optimizer=True)
    assert [str(a) for a in exact.host] == ["S5:6", "S3:5", "S1:3", "S0:1", "C"]
    assert [str(a) for a in pipe.program("fused", 3, optimizer="async").host] == ["A", "C"]
    assert [str(a) for a in pipe.program("fused", 3).host] == ["C"]
    layer = pipe.program("fused", 3, grain="layer")
    acts = [str(a) for a in layer.actions[0] + layer.actions[1]]
    # the backward stage of layers 3-4 runs as a checkpoint, then one backward per layer
    assert {"3K0", "3B0.4", "3B0.3"} <= set(acts) and "3B0" not in acts
    for bad in ("stages", "Layer"):
        with pytest.raises(ValueError, match="grain"):
            pipe.program("fused", grain=bad)
    with pytest.raises(ValueError, match="run_type"):
        pipe.program("backward")
    with pytest.raises(ValueError, match="optimizer"):
        pipe.program("fused", optimizer="sometimes")


@pytest.mark.parametrize("kind,grain", [("fused", "stage"), ("fused", "layer"),
                                        ("eager", "stage"), ("eager", "layer"),
                                        ("infer", "stage")])
def test_interpreter_runs_exactly_the_printed_graph_modules(monkeypatch, kind, grain):
    model, pipe = gpt_pipe(2, grain)
    ran: set[int] = set()
    run_stage = executor.run_stage

    def spy(stage, *args, **kwargs):
        ran.add(id(stage.gm))
        return run_stage(stage, *args, **kwargs)

    monkeypatch.setattr(executor, "run_stage", spy)
    run_call(pipe, model, kind)
    run_type = PROGRAM_ARGS[kind][0]
    exe = pipe._executable(run_type, 3, grain=grain)
    printed = {id(st.gm) for st in exe.graph_modules()}
    assert ran == printed
    code = pipe.code(run_type, grain=grain)
    for st in exe.graph_modules():
        assert st.gm.code.strip("\n") in code


def test_code_has_one_header_per_stage_of_the_demo_plan():
    torch.manual_seed(0)
    model = TinyLlama(depth=4)
    pipe = fxpipe.compile(model, example_inputs=(torch.randint(0, 64, (4, 16)),))
    plan = pipe.plan
    headers = [line.strip() for line in pipe.code("fused").splitlines()
               if line.strip().startswith("# stage ")]
    assert len(headers) == len(plan.fwd_plan) + len(plan.bwd_plan)
    kinds = [h.split("|")[0].split()[3] for h in headers]
    assert kinds == ["fwd"] * len(plan.fwd_plan) + ["fused"] + ["bwd"] * (len(plan.bwd_plan) - 1)
    # inference runs the forward stages and the tail's layers forward
    infer = [line for line in pipe.code("infer").splitlines() if line.strip().startswith("# stage ")]
    assert len(infer) == len(plan.fwd_plan) + 1 and all(" fwd |" in h for h in infer)
    # print(pipe): the summary and the top-level graph of the forward stages
    text = str(pipe)
    assert text.startswith("# PipelineModule: ") and "def forward(self, ids)" in text
    with pytest.raises(ValueError, match="run_type"):
        pipe.code("backward")


def test_compiled_artifacts_are_built_once_and_cached():
    model, pipe = gpt_pipe(2)
    ids, y = torch.randint(0, 64, (6, 8)), torch.randint(0, 64, (6, 8))
    pipe.forward_backward((ids,), label=y, loss_fn=ce)
    exe = pipe._executable("fused", 3)
    assert pipe._executable("fused", 3) is exe
    pipe.forward_backward((ids,), label=y, loss_fn=ce)
    assert pipe._executable("fused", 3) is exe
    assert pipe.program("fused", 3) is exe.program
    # the layer chain an earlier pass made is not written by running
    before = [copy.copy(layer.cost) for layer in pipe.layers]
    assert [layer.cost for layer in pipe.layers] == before
