"""Mixed precision: ``fxpipe.compile(..., param_dtype=...)`` against an eager reference
that computes in the low dtype and keeps fp32 master weights (what fxpipe does).

Tolerances: with one microbatch and untied weights the gradients are bitwise the
reference's (also under ``torch.autocast`` around the call, against eager autocast).
A tied weight's two gradient contributions are summed in fp32 by fxpipe (in
bf16 by the reference's autograd): relative 5e-3. Microbatches accumulate their
gradients on the device in the low dtype (as the reference would across accumulation
steps): relative 3e-2 of the largest gradient entry.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxpipe
from fxpipe.optim import overlapped
from tests import models


def gpt(tie: bool = True, **kw) -> models.GPT:
    """tests.models.GPT, its head tied to the embedding or not."""
    model = models.GPT(**kw)
    if not tie:
        model.head.weight = nn.Parameter(model.embed.weight.detach().clone())
    return model


def ce(out, label):
    return F.cross_entropy(out.flatten(0, 1).float(), label.flatten())


def batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 64, (6, 8), generator=g), torch.randint(0, 64, (6, 8), generator=g))
            for _ in range(n)]


class Reference:
    """Eager mixed precision: fp32 master model + a low-precision copy that computes;
    gradients cast into the masters' ``.grad``."""

    def __init__(self, master: nn.Module, dtype: torch.dtype):
        self.master, self.low = master, copy.deepcopy(master).to(dtype)

    def backward(self, ids, y, scale=None):
        with torch.no_grad():
            for p, q in zip(self.master.parameters(), self.low.parameters()):
                q.copy_(p)
                q.grad = None
        loss = ce(self.low(ids), y)
        (loss if scale is None else scale(loss)).backward()
        for p, q in zip(self.master.parameters(), self.low.parameters()):
            g = q.grad.to(p.dtype)
            p.grad = g if p.grad is None else p.grad + g
        return loss.detach()


def compiled(model, num_microbatch, dtype=torch.bfloat16):
    return fxpipe.compile(model, example_inputs=(torch.zeros(6, 8, dtype=torch.long),),
                          devices=["cpu", "cpu"], param_dtype=dtype,
                          config=fxpipe.RunConfig(num_microbatch=num_microbatch))


def rel_diff(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


@pytest.mark.parametrize("tie,num_microbatch,tol", [(False, 1, 0.0), (True, 1, 5e-3),
                                                     (True, 3, 3e-2)])
@pytest.mark.bitwise
def test_bf16_gradients_are_fp32_and_match_the_reference(tie, num_microbatch, tol):
    torch.manual_seed(0)
    model = gpt(tie=tie, depth=4).eval()
    ref = Reference(copy.deepcopy(model), torch.bfloat16)
    pipe = compiled(model, num_microbatch)
    ids, y = batches(1)[0]
    loss = pipe.forward_backward((ids,), label=y, loss_fn=ce)
    ref_loss = ref.backward(ids, y)
    assert abs(loss.item() - ref_loss.item()) <= 2e-2 * abs(ref_loss.item())
    for (name, p), r in zip(model.named_parameters(), ref.master.parameters()):
        assert p.dtype == p.grad.dtype == torch.float32, name
        assert rel_diff(p.grad, r.grad) <= tol, (name, rel_diff(p.grad, r.grad))
    # the masters are untouched fp32; device copies were bf16
    assert all(p.dtype == torch.float32 for p in model.parameters())
    # the devices got bf16 copies: the uploads read the bf16 copy of the one flat buffer
    store = pipe._runner(pipe._current, pipe._config(None)).store(pipe._executable("fused",
                                                                              num_microbatch))
    assert {store._source(run).dtype for s in store.stages for run in store._runs_of(s)} \
        == {torch.bfloat16}
    assert {t.dtype for t in store.host.flats} == {torch.float32}


@pytest.mark.bitwise
@pytest.mark.parametrize("name", ["sgd_momentum", "adam", "adamw"])
def test_bf16_training_with_streamed_step_matches_the_reference(name):
    """N steps with clipping: with one microbatch, bitwise the reference. (With several,
    the gradients differ within the tolerances above, and Adam's normalized updates
    turn that into element-wise differences up to the size of an update.)"""
    make = {"sgd_momentum": lambda ps, **kw: torch.optim.SGD(ps, lr=0.05, momentum=0.9, **kw),
            "adam": lambda ps, **kw: torch.optim.Adam(ps, lr=1e-2, **kw),
            "adamw": lambda ps, **kw: torch.optim.AdamW(ps, lr=1e-2, **kw)}[name]
    torch.manual_seed(0)
    model = gpt(tie=False, depth=4).eval()
    ref = Reference(copy.deepcopy(model), torch.bfloat16)
    pipe = compiled(model, 1)
    # built with torch's defaults, stepped by fxpipe with fused kernels: the reference too
    opt, ref_opt = make(model.parameters()), make(ref.master.parameters(), fused=True)
    step = overlapped(opt, max_grad_norm=1.0)
    for ids, y in batches(4):
        loss = pipe.forward_backward((ids,), label=y, loss_fn=ce, optimizer=step)
        ref_loss = ref.backward(ids, y)
        torch.nn.utils.clip_grad_norm_(ref.master.parameters(), 1.0)
        ref_opt.step()
        assert torch.equal(loss, ref_loss)
        opt.zero_grad()
        ref_opt.zero_grad()
    for (n, p), r in zip(model.named_parameters(), ref.master.parameters()):
        assert torch.equal(p, r), n   # 1 microbatch, untied: bitwise the reference


@pytest.mark.bitwise
def test_float_inputs_are_cast_and_input_grads_come_back_fp32():
    torch.manual_seed(0)
    model = models.mlp(width=16, depth=4)
    ref = Reference(copy.deepcopy(model), torch.bfloat16)
    x = torch.randn(6, 16, requires_grad=True)
    pipe = fxpipe.compile(model, example_inputs=(x,), devices=["cpu", "cpu"],
                          param_dtype=torch.bfloat16, config=fxpipe.RunConfig(num_microbatch=1))
    out = pipe(x)
    assert out.dtype == torch.bfloat16   # what the bf16 model returns
    out.float().square().mean().backward()
    assert x.grad.dtype == torch.float32
    xr = x.detach().to(torch.bfloat16).requires_grad_()
    ref.low(xr).float().square().mean().backward()
    assert torch.equal(x.grad, xr.grad.float())


@pytest.mark.bitwise
def test_fp16_with_grad_scaler_matches_eager_amp():
    """fp16 compute, fp32 masters, GradScaler: scaled loss inside the pipeline, eager's
    scaler.step at the end, inf steps skipped, scaler.update() by the user."""
    torch.manual_seed(0)
    model = models.mlp(width=16, depth=4)
    ref = Reference(copy.deepcopy(model), torch.float16)
    pipe = fxpipe.compile(model, example_inputs=(torch.randn(6, 16),), devices=["cpu", "cpu"],
                          param_dtype=torch.float16, config=fxpipe.RunConfig(num_microbatch=1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.master.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 40)   # overflows at first
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 40)
    step = overlapped(opt, scaler=scaler, max_grad_norm=10.0)
    mse = lambda out, y: F.mse_loss(out.float(), y)  # noqa: E731
    g = torch.Generator().manual_seed(3)
    scales = []
    for _ in range(6):
        x, y = torch.randn(6, 16, generator=g), torch.randn(6, 4, generator=g)
        loss = pipe.forward_backward((x,), label=y, loss_fn=mse, optimizer=step)
        with torch.no_grad():
            for p, q in zip(ref.master.parameters(), ref.low.parameters()):
                q.copy_(p)
                q.grad = None
        ref_loss = mse(ref.low(x.half()), y)
        ref_scaler.scale(ref_loss).backward()
        for p, q in zip(ref.master.parameters(), ref.low.parameters()):
            p.grad = q.grad.float()
        ref_scaler.unscale_(ref_opt)
        torch.nn.utils.clip_grad_norm_(ref.master.parameters(), 10.0)
        ref_scaler.step(ref_opt)
        assert torch.equal(loss, ref_loss.detach())
        scaler.update()
        ref_scaler.update()
        scales.append(scaler.get_scale())
        assert scaler.get_scale() == ref_scaler.get_scale()
        opt.zero_grad()
        ref_opt.zero_grad()
    assert scales[0] < 2.0 ** 40          # the first steps overflowed and were skipped
    for p, r in zip(model.parameters(), ref.master.parameters()):
        assert torch.equal(p, r)


def test_param_dtype_is_checked():
    with pytest.raises(TypeError, match="param_dtype"):
        fxpipe.compile(models.mlp(), example_inputs=(torch.randn(2, 16),), param_dtype=torch.int8)


class AutocastBlock(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = self.lin(x)
        return x + torch.tanh(h.float())


class AutocastStack(nn.Module):
    def __init__(self, width=16, depth=4):
        super().__init__()
        self.blocks = nn.ModuleList([AutocastBlock(width) for _ in range(depth)])
        self.head = nn.Linear(width, 4)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


@pytest.mark.bitwise
def test_autocast_region_in_the_model_is_kept():
    """fx would drop the region (it runs at trace time): capture falls back to export."""
    torch.manual_seed(0)
    model = AutocastStack()
    ref = copy.deepcopy(model)
    x, y = torch.randn(6, 16), torch.randn(6, 4)
    pipe = fxpipe.compile(model, example_inputs=(x,), devices=["cpu", "cpu"],
                          config=fxpipe.RunConfig(num_microbatch=1))
    assert pipe.layers.capture != "fx"
    assert "wrap_with_autocast" in pipe.code()
    loss = pipe.forward_backward((x,), label=y, loss_fn=F.mse_loss)
    ref_loss = F.mse_loss(ref(x), y)
    ref_loss.backward()
    assert torch.equal(loss, ref_loss.detach())
    for p, r in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p.grad, r.grad)
    with pytest.raises(fxpipe.CaptureError, match="autocast"):
        fxpipe.compile(AutocastStack(), example_inputs=(x,), devices=["cpu"], capture="fx")


@pytest.mark.bitwise
@pytest.mark.parametrize("style", ["fused", "eager"])
@pytest.mark.parametrize("num_microbatch,tol", [(1, 0.0), (3, 1e-2)])
def test_autocast_around_the_call_is_reentered_in_the_workers(style, num_microbatch, tol):
    torch.manual_seed(0)
    model = gpt(depth=4).eval()
    ref = copy.deepcopy(model)
    ids, y = batches(1)[0]
    pipe = compiled(model, num_microbatch, dtype=None)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        if style == "fused":
            loss = pipe.forward_backward((ids,), label=y, loss_fn=ce)
        else:
            out = pipe(ids)
            assert out.dtype == torch.bfloat16
            loss = ce(out, y)
        ref_loss = ce(ref(ids), y)
    if style == "eager":
        loss.backward()
    ref_loss.backward()
    assert abs(loss.item() - ref_loss.item()) <= 1e-2 * abs(ref_loss.item())
    for (n, p), r in zip(model.named_parameters(), ref.parameters()):
        assert p.grad.dtype == torch.float32
        assert rel_diff(p.grad, r.grad) <= tol, (n, rel_diff(p.grad, r.grad))
    # without autocast the same pipe computes in fp32 again
    plain = pipe.forward_backward((ids,), label=y, loss_fn=ce)
    assert abs(plain.item() - ce(ref(ids), y).item()) < 1e-4



@pytest.mark.bitwise
@pytest.mark.parametrize("tie,tol", [(False, 0.0), (True, 5e-3)])
def test_bf16_gradients_cross_the_link_in_bf16_and_are_widened_on_the_host(tie, tol):
    """Under ``param_dtype=bf16`` each stage downloads its gradients as the device made
    them (bf16: half the bytes of fp32) and the host widens them into the fp32 sums, in
    the flat gradient buffer: a widening rounds nothing, so the gradients are the ones a
    cast on the device gives (bitwise the reference's, untied, one microbatch; a tied
    weight's two widened gradients summed in fp32, as before)."""
    torch.manual_seed(0)
    model = gpt(tie=tie, depth=4).eval()
    fp32_model, ref = copy.deepcopy(model), Reference(copy.deepcopy(model), torch.bfloat16)
    ids, y = batches(1)[0]
    pipe, fp32 = compiled(model, 1), compiled(fp32_model, 1, dtype=None)
    pipe.forward_backward((ids,), label=y, loss_fn=ce)
    fp32.forward_backward((ids,), label=y, loss_fn=ce)
    ref.backward(ids, y)
    # the same downloads (a tied weight from each stage holding it), in half the bytes
    assert pipe.stats()["d2h_bytes_grads"] * 2 == fp32.stats()["d2h_bytes_grads"] > 0
    store = pipe._runner(pipe._current, pipe._config(None)).store(pipe._executable("fused", 1))
    assert {t.dtype for t in store.host.grad_flats} == {torch.float32}
    flats = {t.untyped_storage().data_ptr() for t in store.host.grad_flats}
    for (name, p), r in zip(model.named_parameters(), ref.master.parameters()):
        assert p.grad.dtype == torch.float32, name
        assert p.grad.untyped_storage().data_ptr() in flats, name   # widened in place
        assert rel_diff(p.grad, r.grad) <= tol, (name, rel_diff(p.grad, r.grad))


def test_a_gradient_wider_than_its_masters_is_narrowed_on_the_device():
    """The download moves the narrower dtype: an fp32 gradient of a bf16 master is cast
    on the device (what crosses is bf16), a bf16 gradient of an fp32 master crosses as
    bf16 and is widened by the accumulator."""
    from fxpipe.runtime.devices.emulator import VirtualDevice
    from fxpipe.runtime.host.grad_accum import GradAccumulator
    from fxpipe.runtime.host.param_store import ParamStore
    from fxpipe.runtime.host.params import HostParams
    lin = nn.Linear(4, 4)
    lin.bias.data = lin.bias.data.to(torch.bfloat16)   # a bf16 master
    store = ParamStore(HostParams.of(lin, pin=False), {0: dict(lin.named_parameters())})
    store.refresh()
    dev, acc = VirtualDevice(semantics="sync"), GradAccumulator(store)
    w = torch.randn(4, 4).to(torch.bfloat16)
    b = torch.randn(4)                                  # fp32 for the bf16 bias
    up = lambda t: dev.to_device(t, "activations", "a gradient")   # noqa: E731
    host = store.download_grads(0, dev, {"weight": up(w), "bias": up(b)}, acc)
    assert host["weight"].dtype == host["bias"].dtype == torch.bfloat16
    acc.add(0, host, own=True)
    acc.commit()
    assert lin.weight.grad.dtype == torch.float32 and torch.equal(lin.weight.grad, w.float())
    assert lin.bias.grad.dtype == torch.bfloat16 and torch.equal(lin.bias.grad, b.bfloat16())
