"""The multi-device runtime: equivalence with eager, RNG, overlap, residency, failures."""

from __future__ import annotations

import contextlib
import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxpipe
from fxpipe.api import plan_key
from fxpipe.runtime.stages import rng
from tests import models


def devices(n, **kw):
    return [fxpipe.VirtualDevice(**kw) for _ in range(n)]


def ce(out, label):
    logits = out.logits if hasattr(out, "logits") else out
    return F.cross_entropy(logits.flatten(0, 1), label.flatten())


def train_step(pipe, style, ids, target, loss_fn=ce):
    """One training step, ``"fused"`` (``forward_backward``) or eager-style
    (``loss_fn(pipe(ids), target).backward()``); returns the loss."""
    if style == "fused":
        return pipe.forward_backward((ids,), label=target, loss_fn=loss_fn)
    loss = loss_fn(pipe(ids), target)
    loss.backward()
    return loss


def grads_of(model):
    return {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


def assert_close(a, b, what, atol=2e-6, rtol=1e-5):
    assert torch.allclose(a, b, atol=atol, rtol=rtol), f"{what}: max diff {(a - b).abs().max()}"


def assert_grads_equal(model, ref, atol=2e-6):
    refs = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        r = refs[name]
        assert (p.grad is None) == (r.grad is None), name
        if p.grad is not None:
            assert_close(p.grad, r.grad, f"grad of {name}", atol=atol)


# 6 layers (prefix, 4 blocks, suffix); an asymmetric plan with a fused tail
GPT_PLAN = fxpipe.ExecutePlan(fwd_plan=[range(0, 3), range(3, 5)],
                              bwd_plan=[range(5, 6), range(3, 5), range(1, 3), range(0, 1)])


@pytest.mark.parametrize("num_devices", [1, 2, 3])
@pytest.mark.parametrize("style", ["eager", "fused"])
@pytest.mark.parametrize("grain", ["stage", "layer"])
def test_gpt_matches_eager(num_devices, style, grain):
    torch.manual_seed(0)
    model = models.GPT(depth=4).eval()
    ref = copy.deepcopy(model)
    ids, target = torch.randint(0, 64, (6, 8)), torch.randint(0, 64, (6, 8))
    pipe = fxpipe.compile(model, example_inputs=(ids,), devices=devices(num_devices),
                          plan=GPT_PLAN,
                          config=fxpipe.RunConfig(num_microbatch=3, recompute_grain=grain))
    if style == "eager":
        out = pipe(ids)
        loss = ce(out, target)
        loss.backward()
        assert_close(out, ref(ids), "output")
    else:
        loss = pipe.forward_backward((ids,), label=target, loss_fn=ce)
        assert not loss.requires_grad
    ref_loss = ce(ref(ids), target)
    ref_loss.backward()
    assert_close(loss.detach(), ref_loss.detach(), "loss")
    assert_grads_equal(model, ref)


@pytest.mark.bitwise
def test_one_microbatch_is_bitwise_eager():
    torch.manual_seed(0)
    model = models.GPT(depth=4).eval()
    ref = copy.deepcopy(model)
    ids, target = torch.randint(0, 64, (4, 8)), torch.randint(0, 64, (4, 8))
    pipe = fxpipe.compile(model, example_inputs=(ids,), devices=devices(3), plan=GPT_PLAN,
                          config=fxpipe.RunConfig(num_microbatch=1))
    loss = pipe.forward_backward((ids,), label=target, loss_fn=ce)
    ref_loss = ce(ref(ids), target)
    ref_loss.backward()
    assert torch.equal(loss, ref_loss.detach())
    for (n, p), r in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p.grad, r.grad), n


@pytest.mark.parametrize("style", ["eager", "fused"])
def test_input_gradients_and_kwargs(style):
    torch.manual_seed(0)
    model = models.KwargsModel()
    ref = copy.deepcopy(model)
    x = torch.randn(6, 16, requires_grad=True)
    xr = x.detach().clone().requires_grad_()
    mask = (torch.rand(6, 16) > 0.3).float()
    pipe = fxpipe.compile(model, example_inputs=(x,), example_kwargs={"mask": mask},
                          devices=devices(2), config=fxpipe.RunConfig(num_microbatch=3))

    def loss_fn(out, label):  # not through out["norm"]: 0-dim outputs are averaged over microbatches
        return out["logits"].square().mean() + out["hidden"].mean() * label

    if style == "eager":
        out = pipe(x, mask=mask)
        loss_fn(out, 0.5).backward()
    else:
        pipe.forward_backward((x,), {"mask": mask}, label=0.5, loss_fn=loss_fn,
                              run_config=fxpipe.RunConfig(num_microbatch=1))
    ref_out = ref(xr, mask=mask)
    loss_fn(ref_out, 0.5).backward()
    assert_grads_equal(model, ref)
    if style == "eager":  # input gradients flow back through the pipeline
        assert_close(x.grad, xr.grad, "input grad")


def test_batchnorm_running_stats_match_eager_per_microbatch():
    torch.manual_seed(0)
    model = models.ConvNet(c=4, depth=2).train()
    ref = copy.deepcopy(model)
    x, y = torch.randn(6, 3, 8, 8), torch.randint(0, 10, (6,))
    pipe = fxpipe.compile(model, example_inputs=(x,), devices=devices(2),
                          config=fxpipe.RunConfig(num_microbatch=2))
    loss = pipe.forward_backward((x,), label=y, loss_fn=F.cross_entropy)
    # eager reference: BatchNorm sees each microbatch on its own, in order
    ref_loss = sum(0.5 * F.cross_entropy(ref(xm), ym) for xm, ym in zip(x.chunk(2), y.chunk(2)))
    ref_loss.backward()
    assert_close(loss, ref_loss.detach(), "loss")
    assert_grads_equal(model, ref)
    for (name, b), rb in zip(model.named_buffers(), ref.buffers()):
        assert torch.equal(b, rb) if b.dtype == torch.long else torch.allclose(b, rb, atol=1e-6), name


@pytest.mark.parametrize("which", ["llama", "gpt2"])
def test_hf_models_train(which):
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = models.init_like_training(
        models.tiny_llama(layers=3) if which == "llama" else models.tiny_gpt2(layers=3)).eval()
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 64, (4, 8))
    pipe = fxpipe.compile(model, example_inputs=(), example_kwargs={"input_ids": ids},
                          devices=devices(2), config=fxpipe.RunConfig(num_microbatch=2))
    loss = pipe.forward_backward((), {"input_ids": ids}, label=ids, loss_fn=ce)
    ref_loss = ce(ref(input_ids=ids), ids)
    ref_loss.backward()
    assert_close(loss, ref_loss.detach(), "loss", atol=1e-5)
    assert_grads_equal(model, ref, atol=1e-5)


def test_gradient_accumulation_and_no_grad():
    torch.manual_seed(0)
    model = models.GPT(depth=2).eval()
    ref = copy.deepcopy(model)
    ids, t = torch.randint(0, 64, (4, 8)), torch.randint(0, 64, (4, 8))
    pipe = fxpipe.compile(model, example_inputs=(ids,), devices=devices(2))
    for _ in range(2):
        pipe.forward_backward((ids,), label=t, loss_fn=ce, run_config=fxpipe.RunConfig(num_microbatch=2))
        ce(ref(ids), t).backward()
    assert_grads_equal(model, ref)
    before = grads_of(model)
    with torch.no_grad():
        out = pipe(ids)
    assert not out.requires_grad
    assert all(torch.equal(before[n], p.grad) for n, p in model.named_parameters())



def test_accumulating_calls_add_into_existing_grads():
    """forward_backward onto existing .grads equals eager, and adds into them in place, as
    autograd does (a .grad the caller holds sees the sum)."""
    torch.manual_seed(0)
    model = models.GPT(depth=2).eval()
    ref = copy.deepcopy(model)
    ids, t = torch.randint(0, 64, (4, 8)), torch.randint(0, 64, (4, 8))
    pipe = fxpipe.compile(model, example_inputs=(ids,), devices=devices(2),
                          config=fxpipe.RunConfig(num_microbatch=2))
    pipe.forward_backward((ids,), label=t, loss_fn=ce)
    ce(ref(ids), t).backward()
    params = dict(model.named_parameters())
    held = {n: p.grad for n, p in params.items()}
    pipe.forward_backward((ids,), label=t, loss_fn=ce)
    ce(ref(ids), t).backward()
    assert_grads_equal(model, ref)
    assert all(params[n].grad is g for n, g in held.items())


# -- random ops ----------------------------------------------------------------------------

def _dropout_step(plan, n_devices, seed=7):
    torch.manual_seed(0)
    model = models.GPT(depth=4, dropout=0.3).train()
    ids, t = torch.randint(0, 64, (6, 8)), torch.randint(0, 64, (6, 8))
    pipe = fxpipe.compile(model, example_inputs=(ids,), devices=devices(n_devices), plan=plan,
                          config=fxpipe.RunConfig(num_microbatch=3))
    torch.manual_seed(seed)
    loss = pipe.forward_backward((ids,), label=t, loss_fn=ce)
    return loss, grads_of(model), pipe


@pytest.mark.bitwise
def test_dropout_is_independent_of_plan_and_devices():
    other = fxpipe.ExecutePlan(fwd_plan=[range(0, 2), range(2, 3), range(3, 4)],
                               bwd_plan=[range(4, 6), range(2, 4), range(0, 2)])
    loss_a, grads_a, _ = _dropout_step(GPT_PLAN, 1)
    loss_b, grads_b, _ = _dropout_step(other, 3)
    assert torch.equal(loss_a, loss_b)
    for n in grads_a:
        assert torch.equal(grads_a[n], grads_b[n]), n
    loss_c, _, _ = _dropout_step(GPT_PLAN, 1, seed=8)
    assert not torch.equal(loss_a, loss_c)  # the masks do follow the seed


def test_dropout_gradients_are_those_of_the_forward_that_ran():
    loss, grads, pipe = _dropout_step(GPT_PLAN, 2)
    # eager reference: the same layers, run per microbatch, each random layer seeded from
    # (call seed, layer, microbatch) in the same order
    torch.manual_seed(0)
    ref = models.GPT(depth=4, dropout=0.3).train()
    ids, t = torch.randint(0, 64, (6, 8)), torch.randint(0, 64, (6, 8))
    ref_pipe = fxpipe.compile(ref, example_inputs=(ids,), devices=devices(1))
    torch.manual_seed(7)
    seed = rng.draw_call_seed()
    lg = ref_pipe.layers
    total = 0.0
    for m, (ids_m, t_m) in enumerate(zip(ids.chunk(3), t.chunk(3))):
        env = dict(zip(lg.input_names, [ids_m]))
        for layer in lg:
            if layer.random:
                torch.manual_seed(rng.layer_seed(seed, layer.index, m))
            outs = layer.gm(*[env[n] for n in layer.inputs])
            env.update(zip(layer.outputs, outs))
        out = env[lg.output_names[0]]
        total = total + ce(out, t_m) / 3
    total.backward()
    assert_close(loss, total.detach(), "loss")
    for n, p in ref.named_parameters():
        assert_close(grads[n], p.grad, f"grad of {n}")


@contextlib.contextmanager
def gpu_like_attention():
    """aten's attention replaced, process-wide, by one that picks its kernel as a GPU's
    does: with grad (grad mode on, an input requiring it) another kernel, whose dropout
    draws its masks otherwise (here: after one more random number; flash and math differ
    so on a GPU). On CPU both picks are math, which draws the same masks either way."""
    lib = torch.library.Library("aten", "IMPL")

    def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None,
             enable_gqa=False):
        if dropout_p and torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
            torch.rand(())
        return torch.ops.aten._scaled_dot_product_attention_math(
            q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)[0]

    with warnings.catch_warnings():   # "Overriding a previously registered kernel"
        warnings.simplefilter("ignore")
        lib.impl("scaled_dot_product_attention", sdpa, "CompositeImplicitAutograd")
    try:
        yield
    finally:
        lib._destroy()


class _Attention(nn.Module):
    def __init__(self, frozen: bool = False):
        super().__init__()
        self.qkv = nn.Linear(16, 48).requires_grad_(not frozen)
        self.out = nn.Linear(16, 16)

    def forward(self, x):
        q, k, v = self.qkv(x).view(x.shape[0], x.shape[1], 3, 2, 8).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, dropout_p=0.3, is_causal=True)
        return x + self.out(a.transpose(1, 2).flatten(2))


@pytest.mark.parametrize("capture", ["fx", "export", "blocks"])
def test_attention_dropout_masks_do_not_depend_on_the_grad_mode(capture):
    """#41 item 7: a stage's forward runs without grad and its recompute with; where a
    kernel is picked by grad (SDPA on a GPU), both must still draw the same masks: the loss
    and the gradients are those of one forward, run with grad, layer by layer."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(32, 16), _Attention(frozen=True), _Attention(),
                          _Attention(), nn.Linear(16, 32)).train()
    ids, t = torch.randint(0, 32, (4, 6)), torch.randint(0, 32, (4, 6))
    pipe = fxpipe.compile(model, example_inputs=(ids,), devices=devices(2), capture=capture,
                          config=fxpipe.RunConfig(num_microbatch=2))
    random = {layer.name: layer.index for layer in pipe.layers if layer.random}
    assert {"1", "2", "3"} <= set(random), random   # blocks: every block in training mode
    with gpu_like_attention():
        torch.manual_seed(7)
        loss = pipe.forward_backward((ids,), label=t, loss_fn=ce)
        grads = grads_of(model)
        ref = copy.deepcopy(model)
        torch.manual_seed(7)
        seed = rng.draw_call_seed()
        total = 0.0
        for m, (ids_m, t_m) in enumerate(zip(ids.chunk(2), t.chunk(2))):
            x = ids_m
            for i, block in enumerate(ref):
                if str(i) in random:
                    torch.manual_seed(rng.layer_seed(seed, random[str(i)], m))
                x = block(x)
            total = total + ce(x, t_m) / 2
        total.backward()
    assert_close(loss, total.detach(), "loss")
    for n, p in ref.named_parameters():
        if p.requires_grad:
            assert_close(grads[n], p.grad, f"grad of {n}")


# -- overlap and residency -------------------------------------------------------------------

def test_overlap_and_residency_on_virtual_devices():
    torch.manual_seed(0)
    model = models.GPT(vocab=64, dim=128, heads=4, depth=6, seq=32).eval()
    ids, t = torch.randint(0, 64, (8, 32)), torch.randint(0, 64, (8, 32))
    devs = devices(2, record=True)
    pipe = fxpipe.compile(model, example_inputs=(ids,), devices=devs,
                          config=fxpipe.RunConfig(num_microbatch=4))
    pipe.forward_backward((ids,), label=t, loss_fn=ce)
    computes = [[(t0, t1) for stream, _, t0, t1 in d.records if stream == "compute"] for d in devs]
    assert all(computes)
    overlap = sum(max(0.0, min(a1, b1) - max(a0, b0))
                  for a0, a1 in computes[0] for b0, b1 in computes[1])
    assert overlap > 0, "stage jobs on different devices never ran at the same time"
    exe = pipe._executable("fused", 4)
    store = pipe._current.runners[plan_key(pipe.plan)].store(exe)
    sizes = sorted((store.nbytes(s) for s in exe.stages), reverse=True)
    for d in devs:
        assert d.peak_bytes("params") <= sizes[0] + sizes[1], d.name
        assert d.resident_bytes() == 0, f"{d.name} holds memory after the call"


def test_at_most_two_stages_resident_per_device():
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(32, 32) for _ in range(8)])  # equal stages: 1 layer each
    x = torch.randn(8, 32)
    devs = devices(2)
    plan = fxpipe.ExecutePlan([range(i, i + 1) for i in range(7)],
                              [range(i, i + 1) for i in range(7, -1, -1)])
    pipe = fxpipe.compile(model, example_inputs=(x,), devices=devs, plan=plan,
                          config=fxpipe.RunConfig(num_microbatch=4))
    pipe.forward_backward((x,), label=None, loss_fn=lambda out, _: out.square().mean())
    store = pipe._current.runners[plan_key(plan)].store(pipe._executable("fused", 4))
    assert len({store.nbytes(s) for s in range(len(plan.fwd_plan) + len(plan.bwd_plan))}) == 1
    for d in devs:  # three resident stages would need 3x
        assert store.nbytes(0) <= d.peak_bytes("params") <= 2 * store.nbytes(0)


class ConstantOut(nn.Module):
    """Each block adds a plain tensor attribute (export lifts it as a constant the stage
    uploads with its parameters); ``.to(x.dtype)`` of it returns the uploaded tensor
    itself, a value the next layer reads."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.shift = torch.linspace(-1, 1, 8)

    def forward(self, x):
        for block in self.blocks:
            x = block(x) + self.shift.to(x.dtype)
        return x


def test_a_value_that_is_a_resident_parameter_is_freed_once_by_release():
    torch.manual_seed(0)
    model, x = ConstantOut(), torch.randn(6, 8)
    ref = copy.deepcopy(model)
    devs = [fxpipe.VirtualDevice(semantics="cuda", strict=True) for _ in range(2)]
    with fxpipe.compile(model, example_inputs=(x,), capture="export", devices=devs) as pipe:
        loss = pipe.forward_backward((x,), label=None, loss_fn=lambda out, _: out.square().mean(),
                                     run_config=fxpipe.RunConfig(num_microbatch=3))
    expected = ref(x).square().mean()
    expected.backward()
    torch.testing.assert_close(loss, expected.detach())
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=n)
    assert all(d.resident_bytes() == 0 for d in devs)


# -- failures --------------------------------------------------------------------------------

def _state(model):
    return ({n: p.detach().clone() for n, p in model.named_parameters()}, grads_of(model),
            {n: b.clone() for n, b in model.named_buffers()})


def _assert_state(model, state):
    params, grads, buffers = state
    for n, p in model.named_parameters():
        assert torch.equal(p, params[n]), n
        assert (p.grad is None and grads[n] is None) or torch.equal(p.grad, grads[n]), n
    for n, b in model.named_buffers():
        assert torch.equal(b, buffers[n]), n


def test_tiny_memory_limit_fails_cleanly():
    torch.manual_seed(0)
    model = models.ConvNet(c=4, depth=2).train()
    x, y = torch.randn(4, 3, 8, 8), torch.randint(0, 10, (4,))
    plan = fxpipe.ExecutePlan([range(0, 2), range(2, 3)], [range(3, 4), range(2, 3), range(0, 2)])
    pipe = fxpipe.compile(model, example_inputs=(x,), devices=devices(2, memory_limit=256),
                          plan=plan)  # a user plan: the planner would refuse this device
    state = _state(model)
    with pytest.raises(fxpipe.DeviceMemoryError, match=r"stage \d+"):
        pipe.forward_backward((x,), label=y, loss_fn=F.cross_entropy,
                              run_config=fxpipe.RunConfig(num_microbatch=2))
    _assert_state(model, state)
    for d in pipe.devices:
        assert d.resident_bytes() == 0


ARMED = {"on": False}


@torch.library.custom_op("fxpipe_test::fail_if_marked", mutates_args=())
def fail_if_marked(h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Raises when armed and a row of ``x`` carries the marker (first feature > 1000)."""
    if ARMED["on"] and bool((x[:, 0] > 1000).any()):
        raise RuntimeError("boom: marked row")
    return h.clone()


fail_if_marked.register_fake(lambda h, x: torch.empty_like(h))
fail_if_marked.register_autograd(lambda ctx, g: (g, None),
                                 setup_context=lambda ctx, inputs, output: None)


def test_planner_refuses_a_layer_over_the_device_memory():
    model = models.ConvNet(c=4, depth=2).train()
    with pytest.raises(fxpipe.PlanError, match=r"layer \d+ needs \d+ bytes .* per-stage limit"):
        fxpipe.compile(model, example_inputs=(torch.randn(4, 3, 8, 8),),
                       devices=devices(2, memory_limit=256))


class Flaky(nn.Module):
    """Three blocks; the op after block 1 (so in block 1's layer) fails on marked rows."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(3)])

    def forward(self, x):
        h = x
        for i, b in enumerate(self.blocks):
            h = torch.tanh(b(h))
            if i == 1:
                h = torch.ops.fxpipe_test.fail_if_marked(h, x)
        return h


@pytest.mark.parametrize("style", ["eager", "fused"])
def test_failing_layer_names_stage_and_microbatch_and_pipe_recovers(style):
    torch.manual_seed(0)
    model = Flaky()
    x = torch.randn(6, 8)
    pipe = fxpipe.compile(model, example_inputs=(x,), devices=devices(2),
                          config=fxpipe.RunConfig(num_microbatch=3))
    # the tanh after the last block runs at the model's level: the suffix layer
    assert [layer.name for layer in pipe.layers] == ["blocks.0", "blocks.1", "blocks.2", "suffix"]

    def step(inp):
        if style == "eager":
            pipe(inp).sum().backward()
        else:
            pipe.forward_backward((inp,), label=None, loss_fn=lambda out, _: out.sum())

    step(x)  # a good step, so there are .grads to protect
    state = _state(model)
    bad = x.clone()
    bad[4:, 0] = 1e4  # rows 4-5: microbatch 2 of 3
    ARMED["on"] = True
    try:
        with pytest.raises(fxpipe.StageError) as info:
            step(bad)
    finally:
        ARMED["on"] = False
    err = info.value
    assert err.microbatch == 2
    assert err.layers is not None and 1 in err.layers
    assert "blocks.1" in str(err) and "microbatch 2" in str(err)
    assert err.device in {d.name for d in pipe.devices}
    assert isinstance(err.__cause__, RuntimeError) and "boom" in str(err.__cause__)
    _assert_state(model, state)
    for d in pipe.devices:
        assert d.resident_bytes() == 0
    step(x)  # the pipeline still works, and accumulates as before
    ref = copy.deepcopy(model)
    for p, r in zip(model.parameters(), ref.parameters()):
        assert p.grad is not None and torch.isfinite(p.grad).all()


def test_cuda_device_skips_cleanly_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("CUDA present: covered by the CUDA tests")
    from fxpipe.runtime.devices.cuda import CudaDevice
    with pytest.raises(RuntimeError, match="CUDA"):
        CudaDevice(0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_eager():
    torch.manual_seed(0)
    model = models.GPT(depth=4).eval()
    ref = copy.deepcopy(model)
    ids, target = torch.randint(0, 64, (6, 8)), torch.randint(0, 64, (6, 8))
    pipe = fxpipe.compile(model, example_inputs=(ids,), devices=["cuda:0"],
                          config=fxpipe.RunConfig(num_microbatch=3))
    loss = pipe.forward_backward((ids,), label=target, loss_fn=ce)
    ref_loss = ce(ref(ids), target)
    ref_loss.backward()
    assert_close(loss, ref_loss.detach(), "loss", atol=1e-5)
    assert_grads_equal(model, ref, atol=1e-5)


def test_trace_records_a_real_run_as_a_timeline(tmp_path):
    import json
    torch.manual_seed(0)
    model = models.GPT(depth=4).eval()
    ids, t = torch.randint(0, 64, (6, 8)), torch.randint(0, 64, (6, 8))
    pipe = fxpipe.compile(model, example_inputs=(ids,), devices=devices(2), plan=GPT_PLAN,
                          config=fxpipe.RunConfig(num_microbatch=3))
    with pipe.trace(tmp_path / "run.json") as rec:
        pipe.forward_backward((ids,), label=t, loss_fn=ce)
    tl = rec.timeline
    kinds = {iv.kind for iv in tl.intervals}
    assert {"forward", "backward", "transfer"} <= kinds
    computes = [iv for iv in tl.intervals if iv.kind != "transfer"]
    program = pipe.program("fused", 3)
    expected = sum(1 for acts in program.actions for a in acts
                   if type(a).__name__ in ("Forward", "FusedBackward", "RecomputeBackward"))
    assert len(computes) == expected
    assert {iv.device for iv in computes} == {0, 1}
    assert 0 < tl.makespan and 0 <= tl.bubble_ratio < 100
    events = json.loads((tmp_path / "run.json").read_text())
    assert len(events["traceEvents"] if isinstance(events, dict) else events) >= len(tl.intervals)
    with pipe.trace() as rec2:  # nothing ran: an empty timeline, recording off again after
        pass
    assert rec2.timeline.intervals == []
    assert not any(d.is_recording() for d in pipe.devices)


def test_a_batch_with_fewer_rows_than_microbatches_runs_one_per_row_and_warns_once():
    """A DataLoader's last batch: 2 rows and num_microbatch=3 run as 2 microbatches (today
    a split error), equal to eager, with one warning per pipe."""
    import warnings
    torch.manual_seed(0)
    model = models.GPT(depth=2).eval()
    ref = copy.deepcopy(model)
    pipe = fxpipe.compile(model, example_inputs=(torch.randint(0, 64, (6, 8)),),
                          devices=devices(2), config=fxpipe.RunConfig(num_microbatch=3))
    ids, t = torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 8))
    with pytest.warns(UserWarning, match=r"a batch of 2 row\(s\) runs as 2 microbatch\(es\), "
                                         r"not num_microbatch=3"):
        loss = pipe.forward_backward((ids,), label=t, loss_fn=ce)
    ref_loss = ce(ref(ids), t)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach(), atol=1e-6, rtol=1e-6)
    assert_grads_equal(model, ref)
    with warnings.catch_warnings():
        warnings.simplefilter("error")                        # said once per pipe
        with torch.no_grad():
            torch.testing.assert_close(pipe(ids[:1]), ref(ids[:1]), atol=1e-6, rtol=1e-6)
