"""``RunConfig(stage_backend="cudagraphs")``: stage jobs replayed as device graphs.

A CUDA graph cannot run on these machines. What runs here is everything above
``Device.capture``: the Program's ``GraphForward`` / ``GraphRecomputeBackward`` actions,
the parameter slots every upload lands in (and a backward's gradients accumulate in),
the job keys, static inputs and cloned outputs, the static-address checks; a virtual
device's graph (``device_graph.EmulatedGraph``) runs the captured function again per
replay over the captured buffers, and on strict cuda-sim raises where a GPU would
compute garbage or refuse the capture. Results equal eager within the inductor
tolerance (the graphs run inductor's code: no bitwise claim, docs/guarantees.md). The
``torch.cuda.CUDAGraph`` path itself runs in the CUDA-only test at the end.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn as nn
from expecttest import assert_expected_inline

import fxpipe
from fxpipe.errors import StageError
from fxpipe.passes import chain_costs
from fxpipe.runtime.devices.device_graph import EmulatedGraph, GraphCaptureError, GraphReplayError
from fxpipe.runtime.stages.graphs import INPUT_SHAPES, StageGraphs, not_capturable
from fxpipe.runtime.host.param_store import ParamStore
from tests.test_stage_backend import ATOL, RTOL, blocks, mse


def graph_counts(pipe) -> tuple[int, int, int]:
    s = pipe.stats()
    return s["graph_captures"], s["graph_replays"], s["graph_fallbacks"]


def graph_jobs(program) -> list:
    """The program's graph jobs (``GraphForward``, ``GraphRecomputeBackward``)."""
    return [a for acts in program.actions for a in acts if isinstance(a, (
        fxpipe.passes.program.GraphForward, fxpipe.passes.program.GraphRecomputeBackward))]


def strict_devices(n: int = 2, **kw) -> list[fxpipe.VirtualDevice]:
    return [fxpipe.VirtualDevice(semantics="cuda", strict=True, **kw) for _ in range(n)]


GRAPHED_PLAN = fxpipe.ExecutePlan([range(0, 2)], [range(2, 5), range(0, 2)])
"""The plan compile makes for :func:`graphed_blocks` on an idle machine, fixed: the
planner times the layers, so under load it may cut another, and the reserved bytes'
margin under the prediction is the plan's (the emulated allocator's cached blocks follow
the streams' timing: in 2 of 45 plans of these blocks a device reserves up to 896 B,
1.1%, over its prediction, in 3 before #55's input slots; CI's loaded planner once
picked such a plan)."""


def graphed_blocks(num_microbatch: int, batch: int) -> tuple:
    """Four blocks of width 16 compiled under cudagraphs on two strict cuda-sim devices
    with ``GRAPHED_PLAN``: ``(model, a copy for eager, inputs, labels, devices, pipe)``,
    ``batch`` rows."""
    model = blocks(4, 16)
    ref = copy.deepcopy(model)
    x, y = torch.randn(batch, 8, 16), torch.randn(batch, 8, 4)
    devices = strict_devices()
    pipe = fxpipe.compile(model, example_inputs=(x,), devices=devices, plan=GRAPHED_PLAN,
                          config=fxpipe.RunConfig(stage_backend="cudagraphs",
                                                  num_microbatch=num_microbatch))
    return model, ref, x, y, devices, pipe


def checked_step(pipe, model, ref, devices, x, y, ref_loss, num_microbatch: int, *,
                 replaying: bool) -> None:
    """One fused step on strict cuda-sim ``devices``: the loss and every gradient equal
    ``ref``'s (stepped once, ``ref_loss``) within the inductor tolerance, and each device's
    reserved peak is within the prediction, which counts the slots, the graphs' own
    buffers and their pool: within 25% at a ``replaying`` step; a capturing step
    reserves less (a stage computed before a later graph's capture does not hold its
    pool)."""
    model.zero_grad()
    for d in devices:
        d.reset_peak()
    loss = pipe.forward_backward((x,), label=y, loss_fn=mse)
    pred = fxpipe.plan.predict_memory(pipe, run_type="fused", num_microbatch=num_microbatch,
                                      loss_fn=mse, label=y)
    for d, p in zip(devices, pred.devices):
        reserved = d.peak_reserved_bytes()
        assert reserved <= p.total <= (1.25 if replaying else 2) * reserved, \
            (replaying, p.total, reserved)
    torch.testing.assert_close(loss, ref_loss.detach(), atol=ATOL, rtol=RTOL)
    for (name, p), r in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, r.grad, atol=ATOL, rtol=RTOL, msg=name)


def test_a_step_and_inference_under_cudagraphs_equal_eager_on_strict_cuda_sim():
    """Two fused steps and two inference calls on two strict cuda-sim devices: the
    forward and backward stages' jobs are captured at the first call (one graph per
    stage, device, parameter slot, input slot and input shapes) and replayed after;
    loss, every gradient and the output equal eager's within the inductor tolerance;
    ``predict_memory`` holds for the peaks; the slots and graphs stay on the devices
    until ``close()``."""
    model, ref, x, y, devices, pipe = graphed_blocks(num_microbatch=2, batch=4)
    ref_loss = mse(ref(x), y)
    ref_loss.backward()
    for step in range(2):
        checked_step(pipe, model, ref, devices, x, y, ref_loss, 2, replaying=step > 0)
        jobs = graph_jobs(pipe.program("fused"))
        captures, replays, fallbacks = graph_counts(pipe)
        assert captures + replays == len(jobs) > 0 and fallbacks == 0
        # the first step captures each stage's job on its device once per input slot
        # (each microbatch uploads into its parity's: one graph each, their shapes the
        # same; the capture's own run is the microbatch's); the second replays them
        assert captures == (len({(a.stage, a.mb % 2) for a in jobs}) if step == 0 else 0)
    with torch.no_grad():
        expected = ref(x)
        for call in range(2):
            torch.testing.assert_close(pipe(x), expected, atol=ATOL, rtol=RTOL)
            # inference plans its own stages: captured at its first call (a graph per
            # stage and input slot: each of the two microbatches), replayed after
            assert graph_counts(pipe)[:2] == ((2 * len(pipe.stages), 0) if call == 0
                                              else (0, 2 * len(pipe.stages)))
    assert all(d.resident_bytes("params") > 0 for d in devices)   # the slots stay
    pipe.close()
    assert [d.resident_bytes() for d in devices] == [0, 0]


def test_replays_read_their_inputs_where_the_upload_put_them():
    """#55 item 3: a graph job's ``Upload`` is a ``GraphUpload`` (``3U2g``) into the job's
    input slot of its microbatch's parity, and the graph captured that slot as its
    input: a replay copies none of its uploaded inputs in. Four microbatches, so each
    slot takes a second one once the job before has read it (the Program's ``slot``
    dependency). Two steps and an inference call equal eager's on strict cuda-sim (a
    graph reading a slot that was dropped would raise there); ``predict_memory`` counts
    the slots (reserved <= predicted <= 1.25 x reserved at the replaying step); they
    stay on the devices between calls and ``close()`` frees them."""
    from fxpipe.passes.program import GraphUpload
    model, ref, x, y, devices, pipe = graphed_blocks(num_microbatch=4, batch=8)
    program = pipe.program("fused")
    deps = program.dependencies()
    jobs = {(a.stage, a.mb): (d, i) for d, acts in enumerate(program.actions)
            for i, a in enumerate(acts) if a in graph_jobs(program)}
    uploads = [(d, i, a) for d, acts in enumerate(program.actions) for i, a in enumerate(acts)
               if isinstance(a, GraphUpload)]
    assert {(a.stage, a.mb) for _, _, a in uploads} == {k for k in jobs if program.flow.upload.get(k)}
    for d, i, a in uploads:   # its slot's last reader, on its device, has ended first
        if a.mb >= 2:
            assert fxpipe.passes.program.Dep(d, jobs[(a.stage, a.mb - 2)][1], "end", "slot") \
                in deps[d][i], a
    ref_loss = mse(ref(x), y)
    ref_loss.backward()
    for step in range(2):
        checked_step(pipe, model, ref, devices, x, y, ref_loss, 4, replaying=step > 0)
    # one graph per job and input slot (each read by two microbatches), each reading
    # its slot itself: a static input is an input slot exactly where the key says so
    graphs = pipe._graphs
    assert graph_counts(pipe)[:2] == (0, len(jobs))
    assert graphs.captured() == len({(a.stage, a.mb % 2) for a in graph_jobs(program)})
    for key, job in graphs._jobs.items():
        slotted = [graphs.holds(t) for t in job.statics]
        assert slotted == [k is not None for k in key[-1]] and any(slotted), key
    del job   # (it holds its graph)
    with torch.no_grad():
        for _ in range(2):
            torch.testing.assert_close(pipe(x), ref(x), atol=ATOL, rtol=RTOL)
    assert all(d.resident_bytes("workspace") > 0 for d in devices)   # slots and graphs stay
    pipe.close()
    assert [d.resident_bytes() for d in devices] == [0, 0]


def test_a_failed_call_leaves_the_input_slots_to_the_next(monkeypatch):
    """A call that fails after a ``GraphUpload`` wrote its slot (its graph job raises)
    frees what the call made but not the input slots: the graphs captured on them replay
    in the next call, which equals eager's, and ``close()`` frees them once (a slot freed
    by the cleanup too would be a double free here, and a replay over freed memory on
    strict cuda-sim)."""
    from fxpipe.runtime.issue import executor
    model, ref, x, y, devices, pipe = graphed_blocks(num_microbatch=4, batch=8)
    pipe.forward_backward((x,), label=y, loss_fn=mse)   # captures
    act = executor.Execution._act

    def failing(self, d, a):
        if str(a) == "0F3g":
            raise RuntimeError("injected")
        return act(self, d, a)

    monkeypatch.setattr(executor.Execution, "_act", failing)
    with pytest.raises(StageError, match="injected"):
        pipe.forward_backward((x,), label=y, loss_fn=mse)
    monkeypatch.undo()
    graphs = pipe._graphs
    slots = [t for kept in graphs._inputs.values() for t in kept.values()]
    assert slots and all(graphs._on[id(t)].counts(t) for t in slots)   # still allocated
    del slots
    model.zero_grad()
    loss = pipe.forward_backward((x,), label=y, loss_fn=mse)
    expected = mse(ref(x), y)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), atol=ATOL, rtol=RTOL)
    for (name, p), r in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, r.grad, atol=ATOL, rtol=RTOL, msg=name)
    assert graph_counts(pipe)[0] == 0   # replayed over the same slots
    pipe.close()
    assert [d.resident_bytes() for d in devices] == [0, 0]


def test_an_upload_into_an_input_slot_waits_for_the_slots_last_reader():
    """A ``GraphUpload(s, m)`` writes the slot job ``(s, m - 2)`` read. In the builders'
    order it comes after job ``(s, m - 1)`` started, so that job's end is implied; an
    upload hoisted one step earlier (after job ``(s, m - 2)`` started, not ended: rule 2
    alone would let it overwrite what that job reads) waits for that job's end; one
    hoisted before that job is not made a ``GraphUpload`` (its inputs go to a fresh
    buffer and are copied in), and a hand-written one there is refused."""
    from fxpipe.passes.program import GraphUpload, Upload
    from fxpipe.passes.dependencies import graph_program
    from fxpipe.passes.schedule import build_program
    plain = build_program([range(0, 1)], [range(1, 2), range(0, 1)], "fused", 1, 4, "stage")

    def hoisted(before: str) -> tuple:   # 0U2 moved to just before ``before``
        acts = [a for a in plain.actions[0] if str(a) != "0U2"]
        at = [str(a) for a in acts].index(before)
        return (*acts[:at], Upload(0, 2), *acts[at:])

    p = graph_program(dataclasses.replace(plain, actions=(hoisted("0F1"),)))
    lane = [str(a) for a in p.actions[0]]
    i = lane.index("0U2g")
    assert lane[i - 1:i + 2] == ["0U1g", "0U2g", "0F1g"]
    deps = p.dependencies()[0][i]
    f0 = lane.index("0F0g")
    assert fxpipe.passes.program.Dep(0, f0, "start", "issue") in deps   # rule 2: its start
    assert fxpipe.passes.program.Dep(0, f0, "end", "slot") in deps      # the slot: its end
    early = graph_program(dataclasses.replace(plain, actions=(hoisted("0F0"),)))
    assert "0U2" in [str(a) for a in early.actions[0]]   # a plain Upload
    acts = list(early.actions[0])
    acts[acts.index(Upload(0, 2))] = GraphUpload(0, 2)
    with pytest.raises(ValueError, match=r"0U2g writes the input slot job \(0, 0\) reads"):
        dataclasses.replace(early, actions=(tuple(acts),)).dependencies()


def test_the_plan_leaves_room_for_the_graphs(monkeypatch):
    """A device keeps its parameter slots, its graphs' inputs and outputs and their pool
    past every job; compile's plan leaves room for them (``plan._room_for_graphs``). At
    1.5 MiB strict cuda-sim devices, the plan made as without graphs (a long fused tail)
    predicts 1.80 MB with them, over the 1.42 MB budget, and runs out of memory by its
    second step; the plan made now fits its prediction, the devices reserve no more, and
    its steps equal eager's."""
    monkeypatch.setattr(chain_costs, "HOST_MS_PER_ACTION", 0.05)   # the planner's default
    model = blocks(8, 64)
    x, y = torch.randn(4, 32, 64), torch.randn(4, 32, 4)
    limit = 1536 * 2**10
    budget = fxpipe.plan.MEMORY_FRACTION * limit

    def compiled(net):   # planned at compile
        devices = strict_devices(memory_limit=limit)
        return fxpipe.compile(net, example_inputs=(x,), devices=devices, config=fxpipe.RunConfig(
            stage_backend="cudagraphs", num_microbatch=2)), devices

    def predicted(pipe):
        return fxpipe.plan.predict_memory(pipe, run_type="fused", num_microbatch=2, loss_fn=mse,
                                          label=y)

    with monkeypatch.context() as m:   # the planner blind to the graphs, as before
        m.setattr(fxpipe.plan, "_graphed", lambda pipe: False)
        old, _ = compiled(copy.deepcopy(model))
    assert predicted(old).peak > budget
    with pytest.raises(fxpipe.DeviceMemoryError):
        for _ in range(2):   # the first step captures (a capture holds less than a replay)
            old.forward_backward((x,), label=y, loss_fn=mse)
    old.close()

    ref = copy.deepcopy(model)
    ref_loss = mse(ref(x), y)
    ref_loss.backward()
    pipe, devices = compiled(model)
    assert pipe.plan != old.plan
    pred = predicted(pipe)
    assert pred.peak <= budget
    for _ in range(2):
        model.zero_grad()
        loss = pipe.forward_backward((x,), label=y, loss_fn=mse)
        torch.testing.assert_close(loss, ref_loss.detach(), atol=ATOL, rtol=RTOL)
        for (name, p), r in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, r.grad, atol=ATOL, rtol=RTOL, msg=name)
    assert graph_counts(pipe)[1] > 0   # replayed
    for d, p in zip(devices, pred.devices):
        assert d.peak_reserved_bytes() <= p.total
    pipe.close()


def test_no_plan_leaving_room_for_the_graphs_is_a_plan_error(monkeypatch):
    """Where no plan fits with its graphs, compile says so, and what to do, before
    anything runs (at 640 KiB the plan made as without graphs runs out of memory in its
    steps)."""
    monkeypatch.setattr(chain_costs, "HOST_MS_PER_ACTION", 0.05)
    x = torch.randn(4, 32, 64)
    devices = strict_devices(memory_limit=640 * 2**10)
    with pytest.raises(fxpipe.PlanError, match="stage_backend='cudagraphs'.*stage_backend='inductor'"):
        fxpipe.compile(blocks(8, 64), example_inputs=(x,), devices=devices,
                       config=fxpipe.RunConfig(stage_backend="cudagraphs", num_microbatch=2))
    assert [d.resident_bytes() for d in devices] == [0, 0]


def test_a_frozen_stage_replays_its_backward_graph_without_gradient_buffers():
    """A backward stage with no trainable parameter (LoRA's frozen embedding, alone in its
    stage) still has a parameter slot: its graph job has no gradient buffers to zero or
    add into and gives its inputs' gradients only; the trainable layers' gradients equal
    eager's (the H200 kit's LoRA run failed here: ``_foreach_zero_`` of no buffers)."""
    model = blocks(3, 16)
    for p in model[0].parameters():
        p.requires_grad_(False)
    ref = copy.deepcopy(model)
    x, y = torch.randn(4, 8, 16), torch.randn(4, 8, 4)
    plan = fxpipe.ExecutePlan([range(0, 4)], [range(2, 4), range(1, 2), range(0, 1)])
    pipe = fxpipe.compile(model, example_inputs=(x,), devices=strict_devices(),
                          config=fxpipe.RunConfig(stage_backend="cudagraphs", num_microbatch=2,
                                                  execute_plan=plan))
    mse(ref(x), y).backward()
    for _ in range(2):   # the capture, then the replay
        model.zero_grad()
        pipe.forward_backward((x,), label=y, loss_fn=mse)
        for (name, p), r in zip(model.named_parameters(), ref.parameters()):
            if p.requires_grad:
                torch.testing.assert_close(p.grad, r.grad, atol=ATOL, rtol=RTOL, msg=name)
            else:
                assert p.grad is None, name
    assert any(str(a) == "2B0g" or str(a).endswith("B0g") for acts in
               pipe.program("fused").actions for a in acts)
    captures, replays, fallbacks = graph_counts(pipe)
    assert replays > 0 and fallbacks == 0
    pipe.close()


def test_the_program_and_the_code_say_which_jobs_replay_a_graph():
    model = blocks(2, 8)
    x = torch.randn(2, 8)
    plan = fxpipe.ExecutePlan([range(0, 1), range(1, 3)], [range(1, 3), range(0, 1)])
    pipe = fxpipe.compile(model, example_inputs=(x,), devices=["cpu"] * 2,
                          config=fxpipe.RunConfig(stage_backend="cudagraphs", num_microbatch=2,
                                                  execute_plan=plan))
    assert_expected_inline(str(pipe.program("infer")), """\
program devices=2 microbatches=2
inputs input_1
outputs linear_4
stage 0 fwd 0:1 reads=input_1 makes=add
stage 1 fwd 1:3 reads=add makes=linear_4
step d0   d1   host
0    0P   1P   RF
1    0U0g 1U0g C
2    0F0g 1F0g .
3    0O0  1O0  .
4    0X0  1X0  .
5    0U1g 1U1g .
6    0F1g 1F1g .
7    0O1  1O1  .
8    0X1  1X1  .
9    0R   1R   .""")
    heads = [line for line in pipe.code("fused").splitlines() if line.startswith("# its")]
    assert_expected_inline("\n".join(heads), """\
# its forward job is a device graph (GraphForward): captured once per device, parameter slot, input slot and input shapes, then replayed
# its job runs the compiled code, not a device graph: the loss_fn between its forward and backward is the caller's Python
# its recompute and backward are one device graph (GraphRecomputeBackward): captured once per device, parameter slot, input slot and input shapes, then replayed""")
    assert fxpipe.passes.program.parse_action("0F1g") == fxpipe.passes.program.GraphForward(0, 1)
    listing = str(pipe)
    for i, d in enumerate(pipe.devices):   # (virtual devices are numbered per process)
        listing = listing.replace(repr(d.name), f"'device {i}'")
    uploads = [line.split("#")[0].strip() for line in listing.splitlines() if "upload(" in line]
    assert_expected_inline("\n".join(uploads), """\
input_1_0_d0 = upload(input_1_0, 'device 0', slot=0)
add_0_d1 = upload(add_0, 'device 1', slot=0)
input_1_1_d0 = upload(input_1_1, 'device 0', slot=1)
add_1_d1 = upload(add_1, 'device 1', slot=1)""")
    pipe.close()


def test_a_stage_that_writes_buffers_back_is_not_captured():
    """BatchNorm in training mode updates its running statistics (a writeback to the
    host per run): its stage's forward runs the compiled code, says why, and the step
    equals eager's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 8), nn.Linear(8, 2))
    ref = copy.deepcopy(model)
    x, y = torch.randn(6, 8), torch.randn(6, 2)
    pipe = fxpipe.compile(model, example_inputs=(x,), devices=["cpu"] * 2,
                          config=fxpipe.RunConfig(stage_backend="cudagraphs", num_microbatch=1,
                                                  execute_plan=fxpipe.ExecutePlan(
                                                      [range(0, 2), range(2, 3), range(3, 4)],
                                                      [range(3, 4), range(2, 3), range(0, 2)])))
    exe = pipe._executable("fused")
    assert not_capturable(exe.stages[0]).startswith("it writes buffers back")
    assert "writes buffers back" in pipe.code("fused")
    program = str(exe.program)
    assert "0F0g" not in program and "1F0g" in program
    loss = pipe.forward_backward((x,), label=y, loss_fn=mse)
    ref_loss = mse(ref(x), y)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach(), atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(model[1].running_mean, ref[1].running_mean, atol=ATOL, rtol=RTOL)
    for (name, p), r in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, r.grad, atol=ATOL, rtol=RTOL, msg=name)
    # stage 1's forward and the backward of its layers: one graph each; the BatchNorm
    # stage's backward (its recompute drops the writeback) is not captured either
    assert graph_counts(pipe)[:2] == (2, 0)   # one microbatch: captured, not replayed
    pipe.close()


def test_a_replay_over_parameters_that_moved_raises(monkeypatch):
    """The static-address rule at every replay: planted, an upload that ignores its
    parameter slot (the parameters land elsewhere) makes the next replay raise, naming
    the graph, where a GPU would read the captured (stale) buffer."""
    model = blocks(2, 8)
    x = torch.randn(4, 8)
    pipe = fxpipe.compile(model, example_inputs=(x,), devices=strict_devices(),
                          config=fxpipe.RunConfig(stage_backend="cudagraphs", num_microbatch=2))
    with torch.no_grad():
        pipe(x)
        assert graph_counts(pipe)[0] == 4   # two stages, each microbatch its input slot
        upload = ParamStore.upload
        monkeypatch.setattr(ParamStore, "upload",
                            lambda self, *a, into=None, **kw: upload(self, *a, **kw))
        with pytest.raises(StageError) as e:
            pipe(x)
    assert isinstance(e.value.__cause__, GraphReplayError)
    assert "is at another address than when the graph was captured" in str(e.value.__cause__)
    monkeypatch.undo()
    with torch.no_grad():
        torch.testing.assert_close(pipe(x), model(x), atol=ATOL, rtol=RTOL)
    pipe.close()


def test_cuda_sim_raises_on_a_replay_over_freed_memory():
    """A strict cuda-sim device's graph checks at each replay that the device memory
    its capture read is still allocated (a GPU would read whatever is there now)."""
    d = fxpipe.VirtualDevice(semantics="cuda", strict=True)
    w = d.submit("h2d", d.to_device, torch.ones(4), "params", "a test").result()
    x = d.submit("h2d", d.to_device, torch.ones(4), "activations", "a test").result()
    g = d.submit("compute", d.capture, lambda w, x: (w * x,), (w, x), "a test graph").result()
    assert isinstance(g, EmulatedGraph)
    torch.testing.assert_close(d.submit("compute", g.replay).result()[0], torch.ones(4))
    d.free(w)
    with pytest.raises(GraphReplayError, match="a test graph: a replay reads a \\(4,\\) "
                                               "torch.float32 buffer .* freed since"):
        d.submit("compute", g.replay).result()
    d.close()


def test_cuda_sim_keeps_a_graphs_working_set_for_its_life():
    """#55 item 3: a GPU graph keeps the memory its capture computed in (its pool) until
    it is dropped, and a replay allocates nothing. Strict cuda-sim holds it as such: the
    largest live graph's intermediates stay counted as ``workspace`` beside its outputs
    (one pool per device: a second, smaller graph reuses it; a capture allocates in it
    first); replays leave the peak where it is; dropping the graphs gives it back."""
    d = fxpipe.VirtualDevice(semantics="cuda", strict=True)
    x = d.submit("h2d", d.to_device, torch.ones(1024), "activations", "a test").result()
    n = 1024 * 4   # bytes of one (1024,) float32 value

    def big(x):   # intermediates: 3 values at once at its peak; its output: one
        a = x * 2
        b = a + 1
        c = b * a
        return (c.sum(0, keepdim=True),)

    def small(x):
        return ((x + 1).sum(0, keepdim=True),)

    before = d.resident_bytes()
    g1 = d.submit("compute", d.capture, big, (x,), "big").result()
    held = d.resident_bytes() - before
    assert held >= 3 * n, held                   # the working set stays held, not freed
    peak = d.peak_bytes()
    for _ in range(3):
        d.submit("compute", g1.replay).result()
    assert d.peak_bytes() == peak                # a replay allocates nothing new
    g2 = d.submit("compute", d.capture, small, (x,), "small").result()
    assert d.resident_bytes() - before <= held + 8   # in the same pool (plus its output)
    assert d.peak_bytes() <= peak + 8
    del g1, g2
    d.submit("compute", lambda: None).result()   # (the stream's last event held g2)
    assert d.resident_bytes() == before          # dropped: the pool is given back
    d.close()


def test_cuda_sim_starts_a_capture_once_its_device_ran_what_was_submitted_before():
    """#55 item 3: ``torch.cuda.graph`` starts by synchronizing its device, so a capture
    on a GPU begins only once the copies queued before it have run (its issuing thread
    waits). Strict cuda-sim waits as well: a capture on the compute stream runs after the
    slow upload queued before it on another stream, and does not wait for work queued
    after it. Before, the emulated capture ran at once, beside the upload."""
    import threading
    import time

    d = fxpipe.VirtualDevice(semantics="cuda", strict=True)
    x = d.submit("h2d", d.to_device, torch.ones(4), "activations", "a test").result()
    landed, later = threading.Event(), threading.Event()

    def slow_copy():   # a copy kernel the h2d stream runs after the issue
        time.sleep(0.3)
        landed.set()

    d.submit("h2d", lambda: d.kernel(slow_copy))
    seen = {}

    def job(x):
        seen["upload landed"] = landed.is_set()
        return (x * 2,)

    g = d.submit("compute", d.capture, job, (x,), "a test graph")
    d.submit("d2h", lambda: d.kernel(lambda: (later.wait(5), None)))   # queued after it
    g = g.result(timeout=3)   # does not wait for the d2h kernel queued after the capture
    later.set()
    assert seen == {"upload landed": True}
    torch.testing.assert_close(g.first[0], torch.full((4,), 2.0))
    d.close()


def test_cuda_sim_refuses_a_capture_that_reads_device_values_on_the_host():
    """A GPU's capture fails on an op whose result the host reads (``.item()``, a
    data-dependent shape), and a replay would not redo that Python: strict cuda-sim
    raises ``GraphCaptureError`` there (its emulated replay reruns the Python, so it
    would otherwise compute what a GPU cannot); a device without the rule captures it."""
    def routed(x):
        return (x * x.sum().item(), x[x > 0])

    strict = fxpipe.VirtualDevice(semantics="cuda", strict=True)
    x = strict.submit("h2d", strict.to_device, torch.ones(4), "activations", "a test").result()
    with pytest.raises(GraphCaptureError, match=r"a test graph: aten._local_scalar_dense"):
        strict.submit("compute", strict.capture, routed, (x,), "a test graph").result()
    strict.close()
    lax = fxpipe.VirtualDevice()
    g = lax.submit("compute", lax.capture, routed, (torch.ones(4),), "a test graph").result()
    assert g.first[0].tolist() == [4.0] * 4
    lax.close()


def test_a_block_run_as_its_module_is_not_captured():
    """An MoE block captured at block granularity runs as its module, its routing Python
    branching on tensor values: its stage is not a graph (a replay would keep the
    capture's routing), the others are, and the outputs equal eager's for two batches
    routed differently. (In training mode such a block may draw random numbers, which
    refuses it first.)"""
    from tests.test_capture_blocks import _moe
    model, x, scale = _moe()
    model.eval()
    pipe = fxpipe.compile(model, (x, scale), devices=strict_devices(),
                          config=fxpipe.RunConfig(stage_backend="cudagraphs", num_microbatch=2))
    assert "runs a block as its module" in pipe.code("infer")
    exe = pipe._executable("infer")
    graphed = {a.stage for acts in exe.program.actions for a in acts if str(a).endswith("g")}
    opaque = {s for s, st in exe.stages.items() if any(pipe.layers[i].opaque for i in st.layers)}
    assert opaque and not graphed & opaque
    with torch.no_grad():
        for batch in (x, torch.randn(8, 8)):
            torch.testing.assert_close(pipe(batch, scale), model(batch, scale), atol=ATOL, rtol=RTOL)
    pipe.close()


def test_parameter_slots_are_taken_and_given_in_program_order():
    """Two slots per device: a third stage finds none (it uploads as usual and its jobs
    run the compiled code); a released slot is taken again; slots too small for a stage
    are made again once none is held, and the device's graphs are dropped with them."""
    d = fxpipe.VirtualDevice()
    graphs = StageGraphs()
    (a, gen), mem_a = graphs.take(0, d, stage=0, nbytes=100, size=512)
    (b, _), _ = graphs.take(0, d, stage=1, nbytes=100, size=512)
    assert (a, b) == (0, 1) and mem_a.numel() == 512
    assert graphs.take(0, d, stage=2, nbytes=100, size=512) is None
    graphs.give(0, (a, gen))
    assert graphs.take(0, d, stage=2, nbytes=100, size=512)[0] == (0, gen)
    assert graphs.take(0, d, stage=3, nbytes=4096, size=512) is None   # held: not remade
    graphs.give(0, (0, gen))
    graphs.give(0, (1, gen))
    (slot, gen2), mem = graphs.take(0, d, stage=3, nbytes=4096, size=512)
    assert gen2 != gen and mem.numel() == 4096 and d.resident_bytes("params") == 2 * 4096
    graphs.close()
    assert d.resident_bytes() == 0
    d.close()


def test_a_stage_takes_the_slot_it_had_when_both_are_free():
    """A Prefetch runs on the prefetch stream, the Releases before it on the control
    stream: whether one or both of the slots are free when it takes one depends on the
    streams' timing. With both free, the stage takes the slot it had before, so its
    graphs (keyed by the slot) replay. Taking the first free slot, stage 2 would get
    slot 0 here and capture again (seen once in CI: T5 under cudagraphs captured 4
    graphs in its third step)."""
    d = fxpipe.VirtualDevice()
    graphs = StageGraphs()
    first = graphs.take(0, d, stage=0, nbytes=100, size=512)[0]
    second = graphs.take(0, d, stage=1, nbytes=100, size=512)[0]
    graphs.give(0, first)
    third = graphs.take(0, d, stage=2, nbytes=100, size=512)[0]   # stage 0's slot
    graphs.give(0, second)
    graphs.give(0, third)
    # the next step: stage 0 finds both free (its own, slot 0, and stage 1's), then
    # stage 1 and stage 2 find their own
    assert graphs.take(0, d, stage=1, nbytes=100, size=512)[0] == second
    assert graphs.take(0, d, stage=0, nbytes=100, size=512)[0] == first
    graphs.give(0, second)
    graphs.give(0, first)
    assert graphs.take(0, d, stage=2, nbytes=100, size=512)[0] == third == first
    graphs.close()
    d.close()


def test_a_hf_llama_under_cudagraphs_equals_eager():
    """A Hugging Face Llama (rotary, RMSNorm, SwiGLU, tied head) under cudagraphs in bf16
    mixed precision: the loss and every gradient of a fused step are those of the same
    pipe under inductor, and its logits are eager's within bf16's tolerance."""
    pytest.importorskip("transformers")
    from tests.models import init_like_training, tiny_llama
    model = init_like_training(tiny_llama(layers=3))
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0))
    kw = {"input_ids": ids, "labels": ids}

    def step(backend):
        m = copy.deepcopy(model)
        pipe = fxpipe.compile(m, example_kwargs=kw, devices=strict_devices(),
                              param_dtype=torch.bfloat16,
                              config=fxpipe.RunConfig(num_microbatch=2, stage_backend=backend))
        loss = pipe.forward_backward((), kw, loss_fn=lambda out, _: out.loss)
        with torch.no_grad():
            logits = pipe(**kw).logits
        counts = graph_counts(pipe)
        pipe.close()
        return m, loss, logits, counts

    graphed, loss, logits, counts = step("cudagraphs")
    assert counts[0] > 0 and counts[2] == 0
    compiled, expected, _, _ = step("inductor")
    torch.testing.assert_close(loss, expected, atol=ATOL, rtol=RTOL)
    for (name, p), r in zip(graphed.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(p.grad, r.grad, atol=ATOL, rtol=RTOL, msg=name)
    with torch.no_grad():
        torch.testing.assert_close(logits.float(), model(**kw).logits,
                                   atol=0.05, rtol=0.05)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graphs_on_a_gpu_equal_inductors_code():
    """On a GPU (two logical devices of GPU 0): the jobs are ``torch.cuda.CUDAGraph``s,
    captured at the first step and replayed at the second; loss and every gradient are
    those of inductor's code without graphs, and the output is eager's."""
    from fxpipe.runtime.devices.cuda import CudaGraph
    model = blocks(4, 64)
    x, y = torch.randn(8, 32, 64), torch.randn(8, 32, 4)

    def steps(backend):
        m = copy.deepcopy(model)
        devices = [fxpipe.CudaDevice(0, name=f"cuda:0/{i}") for i in range(2)]
        pipe = fxpipe.compile(m, example_inputs=(x,), devices=devices,
                              config=fxpipe.RunConfig(stage_backend=backend, num_microbatch=2))
        for _ in range(2):
            m.zero_grad()
            loss = pipe.forward_backward((x,), label=y, loss_fn=mse)
        with torch.no_grad():
            out = pipe(x)
        counts = graph_counts(pipe)
        jobs = list(pipe._graphs._jobs.values())
        pipe.close()
        return m, loss, out, counts, jobs

    graphed, loss, out, counts, jobs = steps("cudagraphs")
    assert jobs and all(isinstance(j.graph, CudaGraph) for j in jobs)
    assert counts[1] > 0 and counts[2] == 0   # the last call replayed
    compiled, expected, _, _, _ = steps("inductor")
    torch.testing.assert_close(loss, expected, atol=ATOL, rtol=RTOL)
    for (name, p), r in zip(graphed.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(p.grad, r.grad, atol=ATOL, rtol=RTOL, msg=name)
    with torch.no_grad():
        torch.testing.assert_close(out, model(x), atol=ATOL, rtol=RTOL)


def test_each_job_keeps_a_bounded_number_of_graphs_and_cycling_lengths_only_replay(monkeypatch):
    """Lengths that alternate are captured once each (per slot), then only replayed; ever
    new lengths do not grow the graphs without bound: each job (device, stage, forward
    or backward) keeps its ``GRAPHS_PER_JOB`` most recently used (4 here, for the test's
    time), and the step still equals eager's. What is checked is which graphs are kept
    and replayed: each segment's own graph stands in for inductor's code (the kit's dry
    run's ``stand_in_compiler``; inductor compiled every segment at each of the five
    lengths, most of the test's time), which the tests above run as graphs."""
    from fxpipe.check.many_devices import stand_in_compiler
    from fxpipe.runtime.stages import graphs as stage_graphs
    monkeypatch.setattr(stage_graphs, "GRAPHS_PER_JOB", 4)   # two input slots x two lengths
    with stand_in_compiler(True):
        _bounded_graphs_and_cycling_lengths()


def _bounded_graphs_and_cycling_lengths() -> None:
    model = blocks(2, 8)
    ref = copy.deepcopy(model)
    pipe = fxpipe.compile(model, example_inputs=(torch.randn(4, 8, 8),), devices=strict_devices(),
                          config=fxpipe.RunConfig(stage_backend="cudagraphs", num_microbatch=2))

    def step(length: int) -> int:
        x, y = torch.randn(4, length, 8), torch.randn(4, length, 4)
        model.zero_grad()
        ref.zero_grad()
        loss = pipe.forward_backward((x,), label=y, loss_fn=mse)
        expected = mse(ref(x), y)
        expected.backward()
        torch.testing.assert_close(loss, expected.detach(), rtol=RTOL, atol=ATOL)
        return pipe.stats()["graph_captures"]

    captures = [step(length) for length in (8, 12) * 3]
    assert captures[0] > 0 and captures[-2:] == [0, 0], captures
    for length in (5, 6, 7):
        step(length)
    graphs = pipe._graphs
    jobs = {key[:3] for key in graphs._jobs}   # (device, stage, forward or backward)
    assert graphs.captured() <= 4 * len(jobs), (graphs.captured(), len(jobs))
    assert max(len(graphs._recent[job]) for job in jobs) == 4
    # each input slot keeps INPUT_SHAPES (4) lengths: the fifth dropped the least recent
    # (8), and the graphs reading it with it (a replay over it would raise on cuda-sim)
    assert {len(kept) for kept in graphs._inputs.values()} == {INPUT_SHAPES} == {4}
    assert all(8 not in {shape[1] for shape, _ in kept} for kept in graphs._inputs.values())
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=RTOL, atol=ATOL, msg=name)
    pipe.close()
