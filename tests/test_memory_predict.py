"""Predicted device memory: against a measurement, in the planner, in the simulator, and
the longest sequence; the chunked linear + cross-entropy that raises it."""

from __future__ import annotations

import contextlib
import copy
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode

import fxpipe
from fxpipe.demo import TinyLlama, rotary_tables
from fxpipe.errors import PlanError
from fxpipe.passes.costs import compute_costs
from fxpipe.live_bytes import LiveBytes
from fxpipe.passes.stage_memory import ChainMemory, Residency, program_peaks, stage_peak
from fxpipe.passes.partition import build_layer_graph
from fxpipe.passes.chain_costs import ChainCosts
from fxpipe.passes.planner import check_memory, plan_chains
from fxpipe.passes.schedule import build_program
from fxpipe.plan import (
    MEMORY_FRACTION,
    ExecutePlan,
    max_sequence_length,
    predict_memory,
)
from fxpipe.runtime.issue.microbatch import split_input, split_label
from tests import test_fuzz
from tests.memory_harness import chain_values, measure_stage
from tests.models import MLPBlock

R = range


# --- LiveBytes --------------------------------------------------------------------------

def test_live_bytes_counts_new_storages_until_freed():
    x = torch.ones(64)                        # made before: not counted
    with LiveBytes() as live:
        v = x.view(8, 8)                      # a view: no new storage
        y = x * 2                             # 256 B
        x.add_(1)                             # in place: nothing new
        z = y.clone()                         # 256 B
        live.retag(z, "saved")
        del y
    assert (live.bytes, live.peak) == (256, 512)
    assert live.by_kind() == {"saved": 256} and live.counts(z) and not live.counts(v)
    with FakeTensorMode(), LiveBytes() as fake:   # fake tensors: sizes without data
        a = torch.empty(1000, 1000)
        b = a @ a
        del b
    assert fake.peak == 2 * 4 * 10**6 and fake.bytes == 4 * 10**6


# --- predicted vs measured ----------------------------------------------------------------

def ce(out, label):
    return F.cross_entropy(out.flatten(0, 1), label.flatten())


def model_case(name: str):
    """(model, whole-batch inputs, run type, plan, loss_fn, label); small versions of
    benchmarks/bench_memory.py's part (b)."""
    torch.manual_seed(0)
    if name == "mlp":
        x = torch.randn(4, 512, 32)
        return (nn.Sequential(*[MLPBlock(32) for _ in range(6)]), (x,), "fused",
                ExecutePlan([R(0, 2), R(2, 4)], [R(4, 6), R(2, 4), R(0, 2)]),
                lambda o, y: F.mse_loss(o, y), torch.randn(4, 512, 32))
    if name == "llama":
        ids = torch.randint(0, 128, (2, 1024))
        return (TinyLlama(vocab=128, dim=64, depth=4), (ids,), "fused",
                ExecutePlan([R(0, 3)], [R(3, 6), R(1, 3), R(0, 1)]), ce, ids)
    from examples.encoder_decoder import Decoder
    tgt = torch.randint(0, 64, (2, 512))
    memory = torch.randn(2, 256, 32, requires_grad=True)
    return (Decoder(vocab=64, dim=32, heads=4, depth=4, max_len=512), (tgt, memory), "fused",
            ExecutePlan([R(0, 3)], [R(3, 6), R(1, 3), R(0, 1)]), ce, tgt)


@pytest.mark.parametrize("grain", ["stage", "layer"])
@pytest.mark.parametrize("name", ["mlp", "llama", "encoder-decoder"])
def test_prediction_within_15_percent_of_measured(name, grain):
    model, inputs, run_type, plan, loss_fn, label = model_case(name)
    M = 2
    lg = build_layer_graph(model, inputs, {})
    compute_costs(lg, list(inputs))
    pred = predict_memory(lg, plan, run_type=run_type, num_microbatch=M, grain=grain,
                          num_devices=2, loss_fn=loss_fn, label=label)
    flat = list(split_input(inputs, {}, M, None)[0][0])
    env = chain_values(lg, flat)
    loss = loss_fn, split_label(label, M)[0]
    assert any(len(p.layers) > 1 and p.kind == "bwd" for p in pred.stages)   # grain matters
    for p in pred.stages:
        nxt = [t for i in (p.prefetch or ()) for t in lg.layers[i].gm.state_dict(keep_vars=True).values()]
        measured = measure_stage(lg, p.kind, p.layers, flat, grain=p.grain, residency=p.residency,
                                 prefetched=list({id(t): t for t in nxt}.values()), loss=loss, env=env)
        error = abs(p.total - measured["total"]) / measured["total"]
        assert error <= 0.15, (str(p), measured)
        assert p.bytes["params"] == measured["params"] and p.bytes["gradients"] == measured["gradients"]


def test_layer_grain_holds_less_than_stage_grain():
    model, inputs, *_ = model_case("llama")
    lg = build_layer_graph(model, inputs, {})
    memory = ChainMemory.of(compute_costs(lg, list(inputs), store=False))
    stage, layer = (stage_peak(memory, "bwd", R(1, 5), grain=g) for g in ("stage", "layer"))
    assert layer.total < 0.6 * stage.total and layer.bytes["saved"] < stage.bytes["saved"]


# --- the planner keeps every stage within the limit ---------------------------------------

def _program_peak(run_type, plan, G, M, grain, memory):
    program = build_program(*plan, run_type, G, M, "stage", grain=grain)
    return max(p.total for p in program_peaks(program, memory))


@st.composite
def chain_memories(draw):
    n = draw(st.integers(1, 8))
    vec = lambda lo, hi: tuple(draw(st.integers(lo, hi)) for _ in range(n))  # noqa: E731
    params, boundary, out, held = vec(0, 100), vec(0, 40), vec(0, 40), vec(0, 200)
    return ChainMemory(params=params, grads=tuple(draw(st.integers(0, p)) for p in params),
                       boundary=boundary, out=out, fwd_peak=vec(0, 100),
                       carried=tuple(draw(st.integers(0, b)) for b in boundary[:-1]) + (0,),
                       recompute_peak=tuple(h + draw(st.integers(0, 50)) for h in held), held=held,
                       bwd_peak=tuple(h + draw(st.integers(0, 80)) for h in held),
                       input_bytes=draw(st.integers(0, 40)),
                       loss_bytes=draw(st.none() | st.integers(0, 100)))


@test_fuzz.budget(150)
@given(memory=chain_memories(), G=st.integers(1, 4), M=st.integers(1, 4),
       run_type=st.sampled_from(["infer", "train", "fused"]), grain=st.sampled_from(["stage", "layer"]),
       limit=st.integers(50, 3000), threshold=st.sampled_from([1.0, 1.1, 3.0]), seed=st.integers(0, 99))
def test_planner_never_plans_a_stage_over_the_limit(memory, G, M, run_type, grain, limit, threshold, seed):
    g = torch.Generator().manual_seed(seed)
    chains = [ChainCosts.from_times((torch.rand(len(memory), generator=g) + 0.1).tolist())]
    try:
        (plan,) = plan_chains(run_type, chains, num_devices=G, num_microbatch=M, memory=[memory],
                              memory_limit=limit, recompute_grain=grain, upper_threshold=threshold)
    except PlanError:   # then the feasibility check says so too, and a layer alone is over
        with pytest.raises(PlanError, match=r"layer \d+ needs \d+ bytes"):
            check_memory(run_type, [memory], limit, num_devices=G, num_microbatch=M,
                         recompute_grain=grain)
        return
    check_memory(run_type, [memory], limit, num_devices=G, num_microbatch=M, recompute_grain=grain)
    assert _program_peak(run_type, plan, G, M, grain, memory) <= limit


@test_fuzz.budget(12)
@given(net=test_fuzz.net_specs(), G=st.integers(1, 3), M=st.integers(1, 3),
       fraction=st.floats(0.05, 2.0))
def test_auto_plans_of_random_models_fit_their_device_limit(net, G, M, fraction):
    model = test_fuzz.build(net)
    args, kwargs, _ = test_fuzz.make_inputs(net, batch=6, seed=0)
    with fxpipe.compile(model, example_inputs=args, example_kwargs=kwargs,
                        layers="blocks" if net.explicit_layers else None,
                        devices=test_fuzz.devices(G)) as pipe:
        params = sum(p.numel() * p.element_size() for p in model.parameters())
        limit = int(fraction * 4 * params) + 1
        device = SimpleNamespace(memory_limit=limit)
        planned = SimpleNamespace(layers=pipe.layers, devices=[device] * G, config=pipe.config)
        try:
            plan = ExecutePlan.auto("fused", planned, num_microbatch=M)
        except PlanError as e:
            assert "needs" in str(e) and "per-stage limit" in str(e)
            return
        assert predict_memory(planned, plan, num_microbatch=M).peak <= MEMORY_FRACTION * limit


# --- simulator and pipe use the same prediction ---------------------------------------------

def test_simulate_reports_the_predicted_peaks():
    model = TinyLlama(vocab=64, dim=32, depth=4)
    ids = torch.randint(0, 64, (6, 64))
    with fxpipe.compile(model, example_inputs=(ids,), devices=test_fuzz.devices(2)) as pipe:
        t = fxpipe.simulate(pipe, num_microbatch=3)
        pred = predict_memory(pipe, num_microbatch=3)
    assert t.peak_memory == [p.total for p in pred.devices]
    assert t.peak_memory_by_kind == pred.by_device()
    assert pred.devices[0].bytes["params"] > 0 and "device 0" in str(pred)


# --- the longest sequence ---------------------------------------------------------------------

def tiny_meta_llama():
    with torch.device("meta"):
        return TinyLlama(vocab=256, dim=64, depth=2)


def test_max_sequence_length_is_monotone_and_what_the_planner_fits():
    model = tiny_meta_llama()
    common = dict(num_devices=2, step=256, dtype=None)
    small = max_sequence_length(model, device_memory=48 * 2**20, **common)
    large = max_sequence_length(model, device_memory=96 * 2**20, **common)
    assert 256 <= small < large and small % 256 == 0

    def plan_at(n: int):   # a step of 3 microbatches of one sequence
        ids = torch.zeros(3, n, dtype=torch.long, device="meta")
        lg = build_layer_graph(model, (ids,), {})
        compute_costs(lg, [ids])
        pipe = SimpleNamespace(layers=lg, devices=[SimpleNamespace(memory_limit=48 * 2**20)] * 2)
        return ExecutePlan.auto("fused", pipe, num_microbatch=3)

    plan_at(small)   # fits: a plan exists
    with pytest.raises(PlanError, match="per-stage limit"):
        plan_at(small + 256)


def test_max_sequence_length_bounds_and_errors():
    model = tiny_meta_llama()
    assert max_sequence_length(model, device_memory=2**30, num_devices=2, step=1024,
                               max_length=3500, dtype=None) == 3072   # capped, a multiple of step
    with pytest.raises(PlanError, match=r"not even 256 tokens fit 90% of 1.05 MB: layer \d+ needs"):
        max_sequence_length(model, device_memory=2**20, num_devices=2, step=256, dtype=None)
    with pytest.raises(ValueError, match="need 1 <= step <= max_length"):
        max_sequence_length(model, device_memory=2**30, num_devices=2, step=0)
    with pytest.raises(TypeError, match="must return a tuple"):
        max_sequence_length(model, lambda n: torch.zeros(1, n, dtype=torch.long, device="meta"),
                            device_memory=2**30, num_devices=2, dtype=None)


def test_max_sequence_length_holds_the_optimizers_state_to_the_host_limit():
    """With ``optimizer=``, the host limit holds the state it keeps too (AdamW: two fp32
    moments per parameter and a step each): 4 MiB of host fit 768 tokens without it, 512
    with it."""
    model = tiny_meta_llama()
    opt = torch.optim.AdamW(model.parameters())
    state = fxpipe.plan.optimizer_state_bytes(opt)
    assert state == sum(8 * p.numel() + 4 for p in model.parameters())
    without, held = {}, {}
    kw = dict(device_memory=2**30, num_devices=2, step=256, max_length=1 << 16, dtype=None)
    assert max_sequence_length(model, details=without, **kw) == \
        max_sequence_length(model, optimizer=opt, details=held, **kw)
    assert held["host_bytes"] - without["host_bytes"] == state
    assert max_sequence_length(model, host_memory=2**22, **kw) == 768
    assert max_sequence_length(model, host_memory=2**22, optimizer=opt, **kw) == 512
    with pytest.raises(PlanError, match="the optimizer state"):
        max_sequence_length(model, host_memory=state, optimizer=opt, **kw)


def test_chunked_loss_raises_the_longest_sequence():
    class Chunked(TinyLlama):
        def forward(self, ids, labels):
            x = self.embed(ids)
            cos, sin = rotary_tables(ids.shape[1], self.head_dim, ids.device)
            for layer in self.layers:
                x = layer(x, cos, sin)
            return fxpipe.linear_cross_entropy(self.norm(x), self.lm_head.weight, labels)

    with torch.device("meta"):
        plain, chunked = (cls(vocab=8192, dim=64, depth=2) for cls in (TinyLlama, Chunked))
    common = dict(device_memory=64 * 2**20, num_devices=2, step=256, dtype=None)
    ids2 = lambda n: (torch.zeros(1, n, dtype=torch.long, device="meta"),) * 2  # noqa: E731
    assert max_sequence_length(chunked, ids2, **common) > 4 * max_sequence_length(plain, **common)


# --- chunked linear + cross-entropy ---------------------------------------------------------

@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("chunk", [None, 1, 5, 64])
def test_linear_cross_entropy_equals_eager(chunk, reduction):
    torch.manual_seed(0)
    h = torch.randn(3, 7, 16, requires_grad=True)
    w = torch.randn(50, 16, requires_grad=True)
    y = torch.randint(0, 50, (3, 7))
    y[0, 2] = y[2, 6] = -100   # ignored
    loss = fxpipe.linear_cross_entropy(h, w, y, chunk, reduction=reduction)
    grads = torch.autograd.grad(loss, (h, w))
    ref = F.cross_entropy(F.linear(h, w).flatten(0, 1), y.flatten(), reduction=reduction)
    ref_grads = torch.autograd.grad(ref, (h, w))
    torch.testing.assert_close(loss, ref)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r)
    h64, w64 = h.double(), w.double()   # fp32 logits are promoted, not cut: exact in fp64
    torch.testing.assert_close(fxpipe.linear_cross_entropy(h64, w64, y, chunk, reduction=reduction),
                               F.cross_entropy(F.linear(h64, w64).flatten(0, 1), y.flatten(),
                                               reduction=reduction), rtol=1e-12, atol=1e-12)


def test_linear_cross_entropy_holds_one_chunk_and_costs_the_same_on_fakes():
    def run(fake: bool):
        with FakeTensorMode() if fake else contextlib.nullcontext():
            h = torch.randn(1000, 32, requires_grad=True)
            w = torch.randn(300, 32, requires_grad=True)
            y = torch.randint(0, 300, (1000,))
            with FlopCounterMode(display=False) as flops, LiveBytes() as live:
                fxpipe.linear_cross_entropy(h, w, y, chunk_size=64).backward()
        return flops.get_total_flops(), live.peak

    flops, peak = run(fake=False)
    assert flops == 4 * 2 * 1000 * 32 * 300    # the head's matmul: forward, again, dh, dw
    assert peak < 1000 * 32 * 4 + 300 * 32 * 4 + 3 * 64 * 300 * 4   # grads + a few chunks
    assert run(fake=True) == (flops, peak)     # costing runs two chunks, counts them all


def test_linear_cross_entropy_errors():
    h, w = torch.randn(2, 3, 8), torch.randn(10, 8)
    with pytest.raises(ValueError, match=r"weight must be \(vocab, 8\)"):
        fxpipe.linear_cross_entropy(h, torch.randn(10, 4), torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"labels must have shape \(2, 3\)"):
        fxpipe.linear_cross_entropy(h, w, torch.zeros(6, dtype=torch.long))
    with pytest.raises(ValueError, match="reduction must be 'mean' or 'sum'"):
        fxpipe.linear_cross_entropy(h, w, torch.zeros(2, 3, dtype=torch.long), reduction="none")


class ChunkedLM(TinyLlama):
    """TinyLlama whose last layer returns the loss (``chunked``) or the eager one."""

    def __init__(self, chunked: bool):
        super().__init__(vocab=40, dim=32, depth=3)
        self.chunked = chunked

    def forward(self, ids, labels):
        x = self.embed(ids)
        cos, sin = rotary_tables(ids.shape[1], self.head_dim, ids.device)
        for layer in self.layers:
            x = layer(x, cos, sin)
        h = self.norm(x)
        if self.chunked:
            return fxpipe.linear_cross_entropy(h, self.lm_head.weight, labels, chunk_size=5)
        return F.cross_entropy(self.lm_head(h).flatten(0, 1), labels.flatten())


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_linear_cross_entropy_through_a_pipeline_equals_eager(capture):
    torch.manual_seed(0)
    ref = ChunkedLM(chunked=False)
    model = ChunkedLM(chunked=True)
    model.load_state_dict(ref.state_dict())
    ids, labels = torch.randint(0, 40, (6, 9)), torch.randint(0, 40, (6, 9))
    with fxpipe.compile(model, example_inputs=(ids, labels), devices=test_fuzz.devices(2),
                        capture=capture) as pipe:
        assert "fxpipe_losses_linear_cross_entropy(" in pipe.code("fused")  # runs the chunks
        loss = pipe.forward_backward((ids, labels))   # the model's output is the loss
    expected = ref(ids, labels)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach())
    for (name, p), r in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, r.grad, msg=name)


# --- errors -------------------------------------------------------------------------------------

def test_prediction_errors():
    model, inputs, *_ = model_case("mlp")
    lg = build_layer_graph(model, inputs, {})
    compute_costs(lg, list(inputs))
    with pytest.raises(ValueError, match="needs plan=ExecutePlan"):
        predict_memory(lg, num_devices=2)
    with pytest.raises(ValueError, match="no devices; pass num_devices="):
        predict_memory(lg, ExecutePlan.default(len(lg), "fused"))
    with pytest.raises(PlanError, match="bwd_plan: backward ranges must cover layers 0..5"):
        predict_memory(lg, ExecutePlan([R(0, 2)], [R(2, 6)]), num_devices=2, run_type="train")
    with pytest.raises(ValueError, match="needs one ChainMemory per chain and memory_limit"):
        plan_chains("fused", [ChainCosts.from_times([1.0] * len(lg))], num_devices=2,
                    memory=[ChainMemory.of([layer.cost for layer in lg])])
    with pytest.raises(ValueError, match="are not a non-empty range"):
        stage_peak(ChainMemory.of([layer.cost for layer in lg]), "bwd", R(3, 3))
    with pytest.raises(ValueError, match="kind must be 'fwd', 'bwd' or 'fused'"):
        stage_peak(ChainMemory.of([layer.cost for layer in lg]), "tail", R(0, 1))


def test_residency_of_a_stage_job():
    assert Residency.of(1) == Residency(1, 1, 0, 1, 1, 0)   # one microbatch: nothing else waits
    assert Residency.of(4, inputs_handed=True) == Residency(2, 2, 1, 4, 2, 1)  # carried kept
    assert Residency.of(4, inputs_handed=True, one_device=True) == Residency(4, 2, 1, 4, 2, 1)
    assert Residency.worst(4, 2) == Residency(2, 2, 1, 4, 4, 4)
    assert Residency.worst(4, 1) == Residency(4, 4, 4, 4, 4, 4)
    # two microbatches: the first has the next one's uploads, the second the first's offload
    two = Residency.of(2, outputs_handed=True)
    assert two.scenarios() == [Residency(2, 2, 0, 2, 2, 2), Residency(1, 1, 1, 1, 1, 2)]


def test_linear_cross_entropy_as_a_hugging_face_head():
    pytest.importorskip("transformers")
    from tests.models import init_like_training, tiny_llama

    class WithLoss(nn.Module):   # docs/user-guide.md, Memory
        def __init__(self, lm):
            super().__init__()
            self.model, self.lm_head = lm.model, lm.lm_head

        def forward(self, input_ids, labels):
            hidden = self.model(input_ids=input_ids).last_hidden_state
            return fxpipe.linear_cross_entropy(hidden, self.lm_head.weight, labels, 7)

    lm = init_like_training(tiny_llama(layers=2, tie=False))
    ref = copy.deepcopy(lm)
    torch.manual_seed(1)
    ids = torch.randint(2, 64, (4, 12))
    labels = torch.cat([ids[:, 1:], torch.full((4, 1), -100)], dim=1)   # next token
    with fxpipe.compile(WithLoss(lm), example_inputs=(ids, labels), devices=test_fuzz.devices(2)) as pipe:
        loss = pipe.forward_backward((ids, labels))
    expected = ref(input_ids=ids, labels=ids).loss   # transformers shifts the labels itself
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-5, atol=1e-6)
    for (name, p), r in zip(lm.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_under_param_dtype_the_devices_bytes_are_the_bf16_copies():
    """``param_dtype=torch.bfloat16`` on a Hugging Face Llama: predicted device parameter
    and gradient bytes are half the fp32 pipe's (the fp32 masters are the host's bytes,
    ``Cost.host_param_bytes``), and ``ExecutePlan.auto`` plans under a memory limit the
    fp32 parameters do not fit."""
    pytest.importorskip("transformers")
    from tests import hf_zoo
    model, kw, _, _ = hf_zoo.setup("llama")
    devices = ["cpu", "cpu"]
    fp32 = fxpipe.compile(model, example_kwargs=kw, devices=devices)
    bf16 = fxpipe.compile(copy.deepcopy(model), example_kwargs=kw, devices=devices,
                          param_dtype=torch.bfloat16, plan=fp32.plan)
    a, b = predict_memory(fp32), predict_memory(bf16)
    assert len(a.stages) == len(b.stages)
    buffers = sum(t.numel() * t.element_size() for t in model.buffers())  # fp32 in both
    for sa, sb in zip(a.stages, b.stages):
        assert sb.bytes["params"] > 0
        assert 0 <= 2 * sb.bytes["params"] - sa.bytes["params"] <= buffers
        assert sa.bytes["gradients"] == 2 * sb.bytes["gradients"]
    for la, lb in zip(fp32.layers, bf16.layers):
        assert lb.cost.param_bytes * 2 == la.cost.param_bytes == lb.cost.host_param_bytes
        assert lb.cost.host_grad_bytes == la.cost.grad_bytes   # downloaded in fp32
    # a limit under which a block's fp32 parameters (and the next stage's) cannot fit:
    # the bf16 copies do
    with pytest.raises(PlanError, match=r"layer \d needs"):
        fxpipe.ExecutePlan.auto("fused", fp32, model_memory_limit=1.2e-4)
    fxpipe.ExecutePlan.auto("fused", bf16, model_memory_limit=1.2e-4)


@pytest.mark.parametrize("make, param_dtype", [
    (lambda ps: torch.optim.AdamW(ps, lr=1e-3), None),
    (lambda ps: torch.optim.AdamW(ps, lr=1e-3, amsgrad=True), torch.bfloat16),
    (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), None),
    (lambda ps: torch.optim.SGD(ps, lr=0.1), None),
])
def test_predict_memory_counts_the_optimizers_state_on_the_host(make, param_dtype):
    """``predict_memory(optimizer=...)``: ``.host["optimizer"]``, predicted before the first
    step, is the bytes of the state the optimizer holds after the fused steps that stepped
    it (AdamW's two moments and step, with amsgrad three; SGD's momentum; none without),
    in the fp32 masters' dtype under ``param_dtype``, for the trainable parameters only."""
    torch.manual_seed(0)
    model = nn.Sequential(*[MLPBlock(16) for _ in range(3)], nn.Linear(16, 4))
    model[0].requires_grad_(False)
    x, y = torch.randn(6, 16), torch.randn(6, 4)
    pipe = fxpipe.compile(model, example_inputs=(x,), devices=["cpu", "cpu"],
                          param_dtype=param_dtype, config=fxpipe.RunConfig(num_microbatch=2))
    opt = make([p for p in model.parameters() if p.requires_grad])
    mse32 = lambda out, y: F.mse_loss(out.float(), y)   # noqa: E731 (torch 2.11: bf16 vs fp32)
    predicted = predict_memory(pipe, loss_fn=mse32, label=y, optimizer=opt)
    assert predict_memory(pipe, loss_fn=mse32, label=y).host.get("optimizer") is None
    for _ in range(2):
        pipe.forward_backward((x,), label=y, loss_fn=mse32, optimizer=opt)
        opt.zero_grad()
    held = sum(t.numel() * t.element_size() for state in opt.state.values()
               for t in state.values() if isinstance(t, torch.Tensor))
    assert predicted.host["optimizer"] == held
    assert (held > 0) == (opt.defaults.get("momentum", 1) != 0)
    assert not held or f"optimizer {held / 1e3:.3g} kB" in str(predicted)
    assert predict_memory(pipe, loss_fn=mse32, label=y, optimizer=opt).host == predicted.host
    pipe.close()


def test_an_optimizer_whose_constructor_needs_its_settings_is_predicted():
    class Required(torch.optim.SGD):   # lr and momentum without defaults
        def __init__(self, params, lr, momentum):
            super().__init__(params, lr=lr, momentum=momentum)

    w = nn.Parameter(torch.zeros(100))
    assert fxpipe.plan.optimizer_state_bytes(Required([w], 0.1, 0.9)) == 400   # momentum
    assert fxpipe.plan.optimizer_state_bytes(Required([w], 0.1, 0.0)) == 0


def test_an_optimizer_whose_step_cannot_be_predicted_says_so():
    class Reads(torch.optim.SGD):   # reads a value on the host in its step
        def step(self, closure=None):
            for g in self.param_groups:
                for p in g["params"]:
                    float(p.grad.sum())
            return super().step(closure)

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    pipe = fxpipe.compile(model, example_inputs=(torch.randn(2, 4),), devices=["cpu", "cpu"])
    with pytest.raises(NotImplementedError, match="Reads.*meta tensors.*without optimizer="):
        predict_memory(pipe, optimizer=Reads(model.parameters(), lr=0.1))
    pipe.close()
