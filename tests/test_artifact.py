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
from fxpipe.passes.program import stream_of
from fxpipe.runtime.issue import compute
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


def run_call(pipe, model, kind: str):
    """One call of ``kind``; returns what ``pipe.program(optimizer=...)`` describes it
    with (the call's optimizer, or False)."""
    ids, y = torch.randint(0, 64, (6, 8)), torch.randint(0, 64, (6, 8))
    if kind == "fused":
        pipe.forward_backward((ids,), label=y, loss_fn=ce)
    elif kind in OPTIMIZERS:
        opt = OPTIMIZERS[kind](model)
        pipe.forward_backward((ids,), label=y, loss_fn=ce, optimizer=opt)
        opt.synchronize()
        return opt
    elif kind == "eager":
        ce(pipe(ids), y).backward()
    else:
        assert kind == "infer", kind
        with torch.no_grad():
            pipe(ids)
    return False


def _sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1)


OPTIMIZERS = {
    "exact": lambda m: fxpipe.optim.overlapped(_sgd(m)),
    "async": lambda m: fxpipe.optim.overlapped(_sgd(m), mode="async"),
    # a small max_grad_norm: the speculative steps are undone, clipped and redone
    "clip": lambda m: fxpipe.optim.overlapped(_sgd(m), max_grad_norm=1e-3),
    "clip-end": lambda m: fxpipe.optim.overlapped(_sgd(m), max_grad_norm=1e-3,
                                                   speculate=False),
    "scaler": lambda m: fxpipe.optim.overlapped(
        _sgd(m), scaler=torch.amp.GradScaler("cpu", init_scale=8.0), max_grad_norm=1.0),
    "async-clip": lambda m: fxpipe.optim.overlapped(_sgd(m), mode="async", max_grad_norm=1.0),
}
RUN_TYPE = {"eager": "train", "infer": "infer"}


def assert_ran_the_program(rec, program) -> None:
    """``rec`` (a ``pipe.trace()``) executed exactly ``program``'s actions, and each lane's
    streams ran theirs in the order they are listed."""
    assert collections.Counter(rec.actions) == collections.Counter(program.action_strings())
    for lane, acts in program.lanes():
        listed = [str(a) for a in acts]
        ran = [s for d, s in rec.actions if d == lane]
        for stream in {stream_of(a) for a in acts}:
            of_stream = [str(a) for a in acts if stream_of(a) == stream]
            assert [s for s in ran if s in of_stream] == of_stream, (lane, stream)
        assert sorted(ran) == sorted(listed)


@pytest.mark.parametrize("num_devices", [1, 2, 3])
@pytest.mark.parametrize("kind", ["fused", "exact", "async", "eager", "infer"])
@pytest.mark.parametrize("grain", ["stage", "layer"])
def test_executed_actions_are_the_programs(num_devices, kind, grain):
    if grain == "layer" and kind == "infer":
        pytest.skip("inference recomputes nothing: one grain")
    model, pipe = gpt_pipe(num_devices, grain)
    with pipe.trace() as rec:
        optimizer = run_call(pipe, model, kind)
    program = pipe.program(RUN_TYPE.get(kind, "fused"), num_microbatch=3, optimizer=optimizer,
                           grain=grain)
    assert_ran_the_program(rec, program)


@pytest.mark.parametrize("kind,host", [
    ("clip", ["RF", "S5:6", "S3:5", "S1:3", "S0:1", "C", "N"]),
    ("clip-end", ["RF", "M5:6", "M3:5", "M1:3", "M0:1", "C", "N", "S5:6", "S3:5", "S1:3",
                  "S0:1"]),
    ("scaler", ["RF", "M5:6", "M3:5", "M1:3", "M0:1", "C", "N", "SS"]),
    ("async-clip", ["RF", "A", "M5:6", "M3:5", "M1:3", "M0:1", "C", "N", "Q"]),
])
def test_every_optimizer_mode_runs_its_printed_host_actions(kind, host):
    """Clipping (speculative or at the end), a GradScaler step and the asynchronous
    update are actions of the Program, executed as printed; the parameters equal eager's."""
    model, pipe = gpt_pipe(2)
    ref = copy.deepcopy(model)
    torch.manual_seed(1)
    with pipe.trace() as rec:
        optimizer = run_call(pipe, model, kind)
    program = pipe.program("fused", 3, optimizer=optimizer)
    assert [str(a) for a in program.host] == host
    assert_ran_the_program(rec, program)
    # the same step, eagerly
    torch.manual_seed(1)
    ids, y = torch.randint(0, 64, (6, 8)), torch.randint(0, 64, (6, 8))
    opt = OPTIMIZERS[kind](ref)
    ce(ref(ids), y).backward()
    if opt.max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(ref.parameters(), opt.max_grad_norm)
    opt.optimizer.step()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, msg=name)


def test_bf16_and_input_gradients_run_their_printed_programs():
    """``param_dtype=bf16`` (the Refresh casts the masters) and inputs that require grad
    (their gradients offloaded to the host: ``pipe.program(input_grads=True)``)."""
    torch.manual_seed(0)
    model = models.mlp(width=16, depth=4)
    x = torch.randn(6, 16)
    pipe = fxpipe.compile(model, example_inputs=(x,), devices=["cpu", "cpu"],
                          param_dtype=torch.bfloat16)
    with pipe.trace() as rec:
        pipe.forward_backward((x.clone().requires_grad_(),), loss_fn=lambda o, _: o.sum(),
                              optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    program = pipe.program("fused", optimizer=True, input_grads=True)
    assert program.input_grads == ("input_1",)
    assert_ran_the_program(rec, program)
    assert str(program.host[0]) == "RF"


def test_programs_list_optimizer_steps_and_the_commit():
    _, pipe = gpt_pipe(2)
    exact = pipe.program("fused", num_microbatch=3, optimizer=True)
    assert [str(a) for a in exact.host] == ["RF", "S5:6", "S3:5", "S1:3", "S0:1", "C"]
    assert [str(a) for a in pipe.program("fused", 3, optimizer="async").host] == \
        ["RF", "A", "M5:6", "M3:5", "M1:3", "M0:1", "C", "Q"]
    assert [str(a) for a in pipe.program("fused", 3).host] == \
        ["RF", "M5:6", "M3:5", "M1:3", "M0:1", "C"]
    assert [str(a) for a in pipe.program("train", 3).host] == \
        ["RF", "C", "M5:6", "M3:5", "M1:3", "M0:1"]
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
    run_stage = compute.run_stage

    def spy(stage, *args, **kwargs):
        ran.add(id(stage.gm))
        return run_stage(stage, *args, **kwargs)

    monkeypatch.setattr(compute, "run_stage", spy)
    run_call(pipe, model, kind)
    run_type = RUN_TYPE.get(kind, "fused")
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
    # print(pipe): the summary and what pipe(x) runs: every action of its Program, once,
    # each after the actions it depends on (the comment names it and where it runs)
    text = str(pipe)
    assert text.startswith("# PipelineModule: ") and "def forward(self, ids" in text
    program = pipe.program("infer")
    listed = [line.rsplit("# ", 1)[1].split() for line in text.splitlines()
              if "  # " in line and not line.strip().startswith("#")
              and "microbatches" not in line]
    by_name = {d.name: i for i, d in enumerate(pipe.devices)}
    shown = [(by_name.get(where, -1), a) for a, where in listed]
    assert collections.Counter(shown) == collections.Counter(program.action_strings())
    at = {x: k for k, x in enumerate(shown)}
    deps = program.dependencies()
    for lane, acts in program.lanes():
        for i, a in enumerate(acts):
            for dep in deps[lane][i]:
                assert at[(dep.device, str(program.lane(dep.device)[dep.step]))] < \
                    at[(lane, str(a))], (a, dep)
    assert "prefetch(self.stage_0" in text and "upload(" in text and "offload(" in text
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
