"""``RunConfig(stage_backend=...)``: stage code compiled by inductor (``runtime.stages.compiled``).

A compiled step equals eager within a stated tolerance (inductor fuses and reorders
floating-point work: no bitwise claim, docs/guarantees.md), repeated blocks share one
compiled artifact, what cannot be compiled is refused or (``"auto"``) left eager with the
reason, and the printed runnable code shows which backend runs each layer. Inductor
compiles here with the machine's C++ compiler (seconds per graph): the tests that run
compiled code are few and small; the Hugging Face matrix runs a subset under inductor
(``tests/test_hf_matrix.py``).
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from expecttest import assert_expected_inline

import fxpipe
from fxpipe.runtime.stages import compiled as compiled_mod
from fxpipe.runtime.stages.compiled import CompiledLayer, StageCompileError
from fxpipe.runtime.stages.stage_code import runnable

# inductor reassociates reductions and fuses elementwise work: fp32 results agree with
# eager to rounding (seen: 4e-7 relative on the gradients here), not bit for bit
ATOL = RTOL = 1e-5


class Block(nn.Module):
    def __init__(self, d: int, p: float = 0.0):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 2 * d)
        self.down = nn.Linear(2 * d, d)
        self.p = p

    def forward(self, x):
        h = F.gelu(self.up(self.norm(x)))
        return x + self.down(F.dropout(h, self.p, self.training))


def blocks(n: int, d: int, p: float = 0.0, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(*[Block(d, p) for _ in range(n)], nn.Linear(d, 4))


def mse(out, label):
    return ((out - label) ** 2).mean()


def assert_step_equals_eager(loss, model, ref, x, y) -> None:
    """``loss`` and ``model``'s gradients, from a pipe's fused step, are eager ``ref``'s
    on ``(x, y)`` within the inductor tolerance (``ref`` runs its backward here)."""
    ref_loss = mse(ref(x), y)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach(), atol=ATOL, rtol=RTOL)
    for (name, p), r in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, r.grad, atol=ATOL, rtol=RTOL, msg=name)


def compiled_layers(pipe, run_type: str = "fused") -> dict[int, list[CompiledLayer]]:
    """Layer -> the compiled calls of its segments, in every stage code ``run_type`` runs
    (recomputes included)."""
    exe = pipe._executable(run_type)
    out: dict[int, list[CompiledLayer]] = {}
    for st in exe.graph_modules():
        for recompute in (False, True):
            gm = runnable(st, recompute, None, pipe.stage_backend)
            for n in gm.graph.nodes:
                if isinstance(n.target, CompiledLayer):
                    out.setdefault(n.meta["layer"], []).append(n.target)
    return out


def gpu_like(n: int) -> list[fxpipe.VirtualDevice]:
    """CPU virtual devices that take ``stage_backend="auto"`` (the default) as a GPU does:
    compiled stage code (``Device.compiles_by_default``)."""
    devices = [fxpipe.VirtualDevice(name=f"vgpu:{i}") for i in range(n)]
    for d in devices:
        d.compiles_by_default = True
    return devices


def test_the_default_backend_compiles_on_gpus_and_runs_eagerly_on_cpu_devices():
    """``stage_backend`` unset is ``"auto"``: eager stage code on CPU devices, compiled
    where every device is a GPU (here CPU devices that say they compile, as a
    ``CudaDevice`` does), equal to eager; ``"eager"`` pins eager code on a GPU."""
    model = blocks(2, 8, seed=4)
    ref = copy.deepcopy(model)
    x, y = torch.randn(3, 3, 8), torch.randn(3, 3, 4)
    cpu = fxpipe.compile(model, example_inputs=(x,), devices=["cpu", "cpu"])
    assert cpu.stage_backend == "eager" and not compiled_layers(cpu)
    assert "stage_backend" not in cpu.code("fused", runnable=True)
    gpu = fxpipe.compile(model, example_inputs=(x,), devices=gpu_like(2))
    assert gpu.stage_backend == "auto" and compiled_layers(gpu)
    assert "stage_backend=auto: " in gpu.code("fused", runnable=True)
    assert_step_equals_eager(gpu.forward_backward((x,), label=y, loss_fn=mse), model, ref, x, y)
    pinned = fxpipe.compile(model, example_inputs=(x,), devices=gpu_like(1),
                            config=fxpipe.RunConfig(stage_backend="eager"))
    assert pinned.stage_backend == "eager" and not compiled_layers(pinned)
    for pipe in (cpu, gpu, pinned):
        pipe.close()


def test_stage_backend_values():
    assert fxpipe.RunConfig(stage_backend="inductor").stage_backend == "inductor"
    assert fxpipe.RunConfig.merge(fxpipe.RunConfig(stage_backend="inductor"),
                                  fxpipe.RunConfig(stage_backend="eager")).stage_backend == "eager"
    assert fxpipe.RunConfig(stage_backend="cudagraphs").stage_backend == "cudagraphs"
    with pytest.raises(ValueError, match="stage_backend must be None, 'eager', 'inductor', "
                                         "'auto' or 'cudagraphs'"):
        fxpipe.RunConfig(stage_backend="tensorrt")


def test_inductor_step_equals_eager_on_strict_cuda_sim():
    """A fused step (forward stages, recomputed backward stages, the fused tail) and an
    inference call under inductor on two strict cuda-sim devices: the loss, every
    parameter's gradient and the output equal eager's within ATOL/RTOL; the compiled
    code's buffers are counted on the devices (peaks as eager stage code's, and within
    ``predict_memory``'s); the four identical blocks run one artifact."""
    model = blocks(4, 16)
    ref = copy.deepcopy(model)
    x, y = torch.randn(4, 8, 16), torch.randn(4, 8, 4)

    def run(model, backend):
        devices = [fxpipe.VirtualDevice(semantics="cuda", strict=True) for _ in range(2)]
        pipe = fxpipe.compile(model, example_inputs=(x,), devices=devices,
                              config=fxpipe.RunConfig(stage_backend=backend, num_microbatch=2))
        return pipe, pipe.forward_backward((x,), label=y, loss_fn=mse), devices

    eager_pipe, _, eager_devices = run(copy.deepcopy(model), None)
    assert eager_pipe.stats()["stage_compiles"] == eager_pipe.stats()["stage_compile_us"] == 0
    compiles = sum(a.compiles for a in compiled_mod.artifacts())
    pipe, loss, devices = run(model, "inductor")
    # what the call compiled (none where an earlier test compiled the same segments)
    assert pipe.stats()["stage_compiles"] == sum(a.compiles for a in compiled_mod.artifacts()) \
        - compiles
    # inductor's buffers are allocated where the devices count them: the peaks are eager's
    # within what fusion saves or costs
    for d, e in zip(devices, eager_devices):
        assert 0.8 <= d.peak_bytes() / e.peak_bytes() <= 1.25, (d.peak_bytes(), e.peak_bytes())
    # and the prediction (eager stage code's memory model) holds for the compiled code
    pred = fxpipe.plan.predict_memory(pipe, run_type="fused", num_microbatch=2, loss_fn=mse, label=y)
    for d, p in zip(devices, pred.devices):
        assert 0.9 <= p.total / d.peak_bytes() <= 1.25, (p.total, d.peak_bytes())
    assert_step_equals_eager(loss, model, ref, x, y)
    with torch.no_grad():
        torch.testing.assert_close(pipe(x), ref(x), atol=ATOL, rtol=RTOL)
    by_layer = compiled_layers(pipe)
    whole = {id(c.artifact) for i in range(4) for c in by_layer[i]
             if not c.artifact.gm.code.count("unfilled")}
    # the blocks' full segments: one artifact; at most one more for a stage's last block
    # in its recompute (its unfilled nodes stay out of the segment), and the head's
    assert len({id(c.artifact) for i in range(4) for c in by_layer[i]}) <= 2, by_layer
    assert len(whole) <= 2
    pipe.close()


def test_printed_code_says_which_backend_runs_each_layer():
    """The runnable code names the compiled calls (by their artifact), keeps the
    transfers and layer marks as Python, and its header says what it compiled."""
    model = blocks(2, 8, seed=1)
    pipe = fxpipe.compile(model, example_inputs=(torch.randn(2, 3, 8),), devices=["cpu"],
                          config=fxpipe.RunConfig(stage_backend="inductor"))
    code = pipe.code("infer", runnable=True)
    code = re.sub(r"inductor_[0-9a-f]{8}", "inductor_<digest>", code)
    code = re.sub(r"\| params .*", "| ...", code)
    assert_expected_inline(code, """\
def forward(self, input_1):
    # runnable [stage_backend=inductor: 2 layer segment(s) compiled, 1 distinct]: stage 0 fwd | layers 0-1 (0, 1) | vcpu:0 | ...
    params = fxpipe_runtime_stages_stage_code_resident(0)
    _0_norm_weight = params[0]
    _0_norm_bias = params[1]
    _0_up_weight = params[2]
    _0_up_bias = params[3]
    _0_down_weight = params[4]
    _0_down_bias = params[5]
    _1_norm_weight = params[6]
    _1_norm_bias = params[7]
    _1_up_weight = params[8]
    _1_up_bias = params[9]
    _1_down_weight = params[10]
    _1_down_bias = params[11];  params = None
    input_1_dev = fxpipe_runtime_stages_stage_code_uploaded(input_1, 0);  input_1 = None
    layer_0_starts = fxpipe_runtime_stages_stage_code_layer(0);  layer_0_starts = None
    layer_0 = fxpipe_runtime_stages_compiled_inductor_<digest>(input_1_dev, _0_norm_weight, _0_norm_bias, _0_up_weight, _0_up_bias, _0_down_weight, _0_down_bias);  input_1_dev = _0_norm_weight = _0_norm_bias = _0_up_weight = _0_up_bias = _0_down_weight = _0_down_bias = None
    add = layer_0[0];  layer_0 = None
    layer_1_starts = fxpipe_runtime_stages_stage_code_layer(1);  layer_1_starts = None
    layer_1 = fxpipe_runtime_stages_compiled_inductor_<digest>(add, _1_norm_weight, _1_norm_bias, _1_up_weight, _1_up_bias, _1_down_weight, _1_down_bias);  add = _1_norm_weight = _1_norm_bias = _1_up_weight = _1_up_bias = _1_down_weight = _1_down_bias = None
    add_1 = layer_1[0];  layer_1 = None
    add_1_host = fxpipe_runtime_stages_stage_code_offloaded(add_1);  add_1 = None
    release = fxpipe_runtime_stages_stage_code_released(0);  release = None
    return (add_1_host,)
    

def forward(self, add_1):
    # runnable [stage_backend=inductor: 1 layer segment(s) compiled, 1 distinct]: stage 1 fwd | layer 2 (2) | vcpu:0 | ...
    params = fxpipe_runtime_stages_stage_code_resident(1)
    _2_weight = params[0]
    _2_bias = params[1];  params = None
    add_1_dev = fxpipe_runtime_stages_stage_code_uploaded(add_1, 0);  add_1 = None
    layer_2_starts = fxpipe_runtime_stages_stage_code_layer(2);  layer_2_starts = None
    layer_2 = fxpipe_runtime_stages_compiled_inductor_<digest>(add_1_dev, _2_weight, _2_bias);  add_1_dev = _2_weight = _2_bias = None
    linear_4 = layer_2[0];  layer_2 = None
    linear_4_host = fxpipe_runtime_stages_stage_code_offloaded(linear_4);  linear_4 = None
    release = fxpipe_runtime_stages_stage_code_released(1);  release = None
    return (linear_4_host,)
    
""")
    assert pipe.code("infer").count("# run by stage_backend='inductor'") == 2   # each stage
    by_layer = compiled_layers(pipe, "infer")
    assert by_layer[0][0].artifact is by_layer[1][0].artifact   # the two blocks: one artifact
    assert by_layer[2][0].artifact is not by_layer[0][0].artifact
    assert "stage_backend" not in fxpipe.compile(
        model, example_inputs=(torch.randn(2, 3, 8),), devices=["cpu"]).code("infer", runnable=True)


def test_a_random_layer_is_refused_or_left_eager():
    """A layer that draws random numbers (an active dropout) would not replay its masks in
    the recompute if compiled: ``"inductor"`` refuses it, naming the layer; ``"auto"``
    leaves it eager (its dropout in the printed code) and compiles the others."""
    model = blocks(2, 8, p=0.1, seed=2)
    x = torch.randn(2, 3, 8)
    pipe = fxpipe.compile(model, example_inputs=(x,), devices=["cpu"],
                          config=fxpipe.RunConfig(stage_backend="inductor"))
    with pytest.raises(NotImplementedError, match=r"layer 0 of stage \d+ draws random numbers"):
        pipe.code("fused", runnable=True)
    with pytest.raises(NotImplementedError, match="stage_backend='auto'"):
        pipe.forward_backward((x,), label=torch.randn(2, 3, 4), loss_fn=mse)
    auto = fxpipe.compile(model, example_inputs=(x,), devices=gpu_like(1),
                          config=fxpipe.RunConfig(stage_backend="auto"))
    code = auto.code("fused", runnable=True)
    assert "dropout" in code and "stage_backend=auto: 1 layer segment(s) compiled" in code, code
    assert set(compiled_layers(auto)) == {2}   # the head only: both blocks drop out


def test_a_segment_inductor_cannot_compile(monkeypatch):
    """Inductor failing on a segment (planted): ``"inductor"`` raises naming the layer
    and stage and what to do, with nothing half-done to the model; ``"auto"`` warns once
    and runs it eagerly: the step equals eager."""
    def fails(gm, inputs):
        raise RuntimeError("planted: no kernel for this op")
    monkeypatch.setattr(torch._inductor, "compile", fails)
    model = blocks(2, 12, seed=3)   # a width no other test compiles: artifacts are shared
    ref = copy.deepcopy(model)
    x, y = torch.randn(3, 5, 12), torch.randn(3, 5, 4)
    pipe = fxpipe.compile(model, example_inputs=(x,), devices=["cpu", "cpu"],
                          config=fxpipe.RunConfig(stage_backend="inductor"))
    with pytest.raises(fxpipe.StageError, match=r"inductor could not compile layers 0, 1 of "
                       r"stage \d+ \(RuntimeError: planted: no kernel.*stage_backend='auto'") as e:
        pipe.forward_backward((x,), label=y, loss_fn=mse)
    assert isinstance(e.value.__cause__, StageCompileError)
    assert all(p.grad is None for p in model.parameters())
    auto = fxpipe.compile(model, example_inputs=(x,), devices=gpu_like(2),
                          config=fxpipe.RunConfig(stage_backend="auto"))
    with pytest.warns(UserWarning, match="runs eagerly: inductor could not compile it"):
        loss = auto.forward_backward((x,), label=y, loss_fn=mse)
    assert_step_equals_eager(loss, model, ref, x, y)
    failed = {id(c.artifact): c.artifact.failed for cs in compiled_layers(auto).values() for c in cs}
    assert failed and all("planted" in why for why in failed.values()), failed
    assert compiled_mod.artifacts()


def test_a_segment_compiled_again_is_read_from_inductors_caches():
    """Inductor's FX graph cache and AOTAutograd's cache look a graph up through the
    tracing context's shape environment; compiled without one, every process compiled
    every segment again ("No shape env": 5-7 s a segment on these CPUs). Compiled twice,
    a segment bypasses neither cache and the second compile is a hit in both."""
    from torch._dynamo.utils import counters
    class Segment(nn.Module):   # a layer's segment: its parameters are its inputs
        def forward(self, x, w, b):
            return (x + F.gelu(F.linear(x, w, b)),)
    gm = torch.fx.symbolic_trace(Segment())
    args = (torch.randn(2, 3, 10), torch.randn(10, 10, requires_grad=True),   # a width no
            torch.randn(10, requires_grad=True))                             # other test has
    counters.clear()
    first, _ = compiled_mod._compile_segment(gm, args)
    after_first = {k: dict(counters[k]) for k in ("inductor", "aot_autograd")}
    second, _ = compiled_mod._compile_segment(gm, args)
    inductor, aot = counters["inductor"], counters["aot_autograd"]
    assert inductor["fxgraph_cache_bypass"] == aot["autograd_cache_bypass"] == 0, dict(counters)
    assert aot["autograd_cache_hit"] > after_first["aot_autograd"].get("autograd_cache_hit", 0)
    torch.testing.assert_close(first(*args), second(*args))


@pytest.mark.parametrize("frozen_head", [False, True], ids=["trained-head", "frozen-head"])
def test_a_hf_models_chunked_loss_and_tiled_mlp_under_inductor_equal_eager(frozen_head):
    """Where the device memory is known the loss runs in chunks and the MLPs in tiles
    (``passes.loss``, ``passes.tiling``): under inductor the loss op and its backward stay
    opaque calls running every chunk (traced by AOTAutograd, a fake-tensor shortcut of
    the costing once summed two chunks of eight: the first H200 run's loss 2.9 for 12.6,
    then NaN). Loss and every gradient equal eager's, with the head trained or frozen (a
    LoRA's: the backward op returns no weight gradient)."""
    pytest.importorskip("transformers")
    from tests.test_long_context import scaled_llama
    model = scaled_llama().train()
    model.lm_head.weight.requires_grad_(not frozen_head)
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 2048, (2, 128), generator=torch.Generator().manual_seed(1))
    kw = {"input_ids": ids, "labels": ids}
    devices = [fxpipe.VirtualDevice(semantics="cuda", memory_limit=8 * 2**20) for _ in range(2)]
    pipe = fxpipe.compile(model, example_kwargs=kw, devices=devices,
                          config=fxpipe.RunConfig(num_microbatch=2, stage_backend="inductor"))
    code = pipe.code("fused")
    assert re.search(r"linear_cross_entropy\(.*, 16, -100, 'sum'", code)   # 8 chunks of 16
    assert "linear_cross_entropy_mean = " in code   # the sum over the count of targets
    assert "fxpipe_tiling_tiled_mlp(" in code
    assert "stage_backend=inductor" in pipe.code("fused", runnable=True)
    loss = pipe.forward_backward((), kw, loss_fn=lambda out, _: out.loss)
    expected = ref(**kw).loss
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), atol=ATOL, rtol=RTOL)
    for (name, p), r in zip(model.named_parameters(), ref.parameters()):
        assert (p.grad is None) == (r.grad is None), name
        if p.grad is not None:
            torch.testing.assert_close(p.grad, r.grad, atol=ATOL, rtol=RTOL, msg=name)
    pipe.close()
