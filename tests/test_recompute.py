"""A backward stage's recompute leaves its linear end unfilled (passes.recompute, runtime.stages.unfilled)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

import fxpipe
from fxpipe.passes.recompute import unfilled_nodes
from fxpipe.runtime.stages import unfilled


class Functional(nn.Module):
    """Calls F.linear as captured stage graphs do (a call_function node, not a module)."""

    def __init__(self, body):
        super().__init__()
        self.w1, self.w2 = nn.Parameter(torch.randn(8, 4)), nn.Parameter(torch.randn(4, 8))
        self.b2 = nn.Parameter(torch.randn(4))
        self.body = body

    def forward(self, x):
        return self.body(self, x)


def tail_of(body):
    return unfilled_nodes(fx.symbolic_trace(Functional(body)).graph)


def test_the_residual_tail_is_skipped():
    assert tail_of(lambda m, x: x + F.linear(F.relu(F.linear(x, m.w1)), m.w2, m.b2)) == \
        ("linear_1", "add")


def test_a_value_the_rest_reads_is_computed():
    assert tail_of(lambda m, x: F.linear(F.linear(x, m.w1), m.w2) * 2) == ()
    # a linear of a skipped linear: only the last is skipped (the first is its input)
    assert tail_of(lambda m, x: F.linear(F.linear(x, m.w1), m.w2)) == ("linear_1",)
    # an add of two computed values costs no matmul: computed
    assert tail_of(lambda m, x: x + F.relu(x)) == ()


def grads_of(fn, tensors, g=None, skip=False):
    """Input gradients of ``fn(*tensors)`` for output gradient ``g`` (or a seeded one),
    with the forward run normally or under ``unfilled.Unfilled``."""
    leaves = [t.detach().clone().requires_grad_(t.requires_grad) for t in tensors]
    if skip:
        with unfilled.Unfilled():
            out = fn(*leaves)
        assert unfilled._is_unwritten(out)  # recorded for autograd, not computed
    else:
        out = fn(*leaves)
    if g is None:
        g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
    unfilled.backprop([(out, g)])
    return g, [t.grad for t in leaves]


def strided(*shape):
    return torch.randn(*reversed(shape)).t().requires_grad_()


CASES = {  # (fn, inputs): every way a tail node reaches autograd's kernels
    "3d input, bias": (lambda x, w, b: F.linear(x, w, b), [(2, 5, 4), (3, 4), (3,)]),
    "2d input": (lambda x, w: F.linear(x, w), [(6, 4), (3, 4)]),
    "2d input, bias": (lambda x, w, b: F.linear(x, w, b), [(6, 4), (3, 4), (3,)]),
    "4d input": (lambda x, w: F.linear(x, w), [(2, 3, 5, 4), (3, 4)]),
    "strided input": (lambda x, w: F.linear(x, w), [strided(4, 6), (3, 6)]),
    "strided 3d input, bias": (lambda x, w, b: F.linear(x.transpose(0, 1), w, b),
                               [(5, 2, 4), (3, 4), (3,)]),
    "residual": (lambda x, w: x + F.linear(x, w), [(2, 5, 4), (4, 4)]),
    "broadcast add": (lambda a, b: a + b, [(3, 4), (4,)]),
    "mixed dtypes": (lambda a, b: a + b, [(3, 4), torch.randn(4, dtype=torch.float64).requires_grad_()]),
    "frozen input": (lambda x, w: F.linear(x, w), [torch.randn(6, 4), (3, 4)]),
}


@pytest.mark.bitwise
@pytest.mark.parametrize("case", CASES)
def test_gradients_are_autograds_bit_for_bit(case):
    """The same autograd nodes run the same kernels on the same tensors: bitwise, on any
    CPU, because only the forward's output was left unwritten."""
    fn, inputs = CASES[case]
    torch.manual_seed(0)
    tensors = [x if isinstance(x, torch.Tensor) else torch.randn(x, requires_grad=True)
               for x in inputs]
    g, want = grads_of(fn, tensors)
    _, got = grads_of(fn, tensors, g, skip=True)
    for a, b in zip(got, want):
        assert (a is None) == (b is None)
        assert a is None or torch.equal(a, b)


@pytest.mark.bitwise
def test_under_autocast_the_casts_run_and_the_matmul_does_not():
    torch.manual_seed(0)
    x, w, b = torch.randn(2, 5, 4, requires_grad=True), torch.randn(3, 4, requires_grad=True), \
        torch.randn(3, requires_grad=True)

    def fn(x, w, b):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return F.linear(x, w, b)
    g, want = grads_of(fn, [x, w, b])
    _, got = grads_of(fn, [x, w, b], g, skip=True)
    for a, r in zip(got, want):
        assert a.dtype == torch.float32 and torch.equal(a, r)


def test_an_op_reading_a_skipped_value_raises():
    x, w = torch.randn(3, 4), torch.randn(2, 4, requires_grad=True)
    with unfilled.Unfilled():
        y = F.linear(x, w)
        assert unfilled._is_unwritten(y.view(6))  # views of it are fine, and unwritten too
        with pytest.raises(RuntimeError, match="reads a value the recompute for backward skipped"):
            torch.relu(y)


def test_backprop_skips_what_has_no_gradient_and_sums_repeats():
    w = torch.randn(3, requires_grad=True)
    y = w * 2
    unfilled.backprop([(y, None), (torch.ones(3), torch.ones(3))])
    assert w.grad is None
    unfilled.backprop([(y, torch.ones(3)), (y, torch.ones(3))])
    assert torch.equal(w.grad, torch.full((3,), 4.0))


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.up, self.down = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(x)))


@pytest.mark.parametrize("grain", ["stage", "layer"])
def test_pipelines_skip_the_tail_and_match_eager(grain):
    torch.manual_seed(0)
    model = nn.Sequential(*[Block(16) for _ in range(4)])
    ref = copy.deepcopy(model)
    x, y = torch.randn(4, 6, 16), torch.randn(4, 6, 16)
    pipe = fxpipe.compile(model, example_inputs=(x,), devices=[fxpipe.VirtualDevice()],
                          plan=fxpipe.ExecutePlan(fwd_plan=[range(0, 4)],
                                                  bwd_plan=[range(3, 4), range(1, 3), range(0, 1)]),
                          config=fxpipe.RunConfig(num_microbatch=2, recompute_grain=grain))
    exe = pipe._executable("fused", grain=grain)
    tails = {(st.index, st.layers.start): st.unfilled for st in exe.graph_modules()}
    # forward and fused stages are never recomputed: only backward stages skip a tail
    assert tails[(0, 0)] == tails[(1, 3)] == ()
    if grain == "stage":
        assert tails[(2, 1)] == ("linear_5", "add_2", "add_2_host")
    else:  # stage 2 runs as two layer pieces, each recomputed separately
        assert tails[(2, 1)] == ("linear_3", "add_1", "add_1_host")
        assert tails[(2, 2)] == ("linear_5", "add_2", "add_2_host")
    assert tails[(3, 0)] == ("linear_1", "add", "add_host")
    code = pipe.code("fused", grain=grain)
    assert code.count("# a recompute for backward skips") == (2 if grain == "stage" else 3)
    assert "# a recompute for backward skips linear_5, add_2, add_2_host" in code
    skipped = []
    dispatch = unfilled.Unfilled.__torch_dispatch__

    def counting(self, func, types, args=(), kwargs=None):
        skipped.append(func) if func in unfilled.SKIPPED else None
        return dispatch(self, func, types, args, kwargs)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(unfilled.Unfilled, "__torch_dispatch__", counting)
        loss = pipe.forward_backward((x,), label=y, loss_fn=F.mse_loss)
    # per microbatch, the recompute skips the last matmul and add of every recomputed
    # stage (1:3, 0:1) or, at layer grain, of every recomputed layer (1, 2, 0)
    assert len(skipped) == 2 * 2 * (2 if grain == "stage" else 3)
    ref_loss = sum(F.mse_loss(ref(xm), ym) for xm, ym in zip(x.chunk(2), y.chunk(2))) / 2
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach())
    for (n, p), r in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, r.grad, msg=n)


def test_the_tail_keeps_what_fits_recomputes_the_rest_and_matches_eager():
    """``recompute="auto"``: the fused tail takes the layers whose activations fit the
    device (forward and backward in one stage, nothing recomputed); the tighter the
    device, the more is recomputed; the step equals eager's either way."""
    from fxpipe.demo import TinyLlama
    torch.manual_seed(0)
    model = TinyLlama(vocab=256, dim=64, depth=6)
    ref = copy.deepcopy(model)
    x, y = torch.randint(0, 256, (4, 512)), torch.randint(0, 256, (4, 512))
    pipe = fxpipe.compile(model, example_inputs=(x,), devices=[fxpipe.VirtualDevice()],
                          config=fxpipe.RunConfig(num_microbatch=2))

    def plan(mib, recompute="auto"):   # issuing free: the layers are tiny
        return fxpipe.ExecutePlan.auto("fused", pipe, num_microbatch=2, host_ms_per_action=0,
                                       model_memory_limit=mib / 1024, recompute=recompute)
    recomputed = {mib: len(plan(mib).recomputed("fused")) for mib in (64, 32, 16, 12)}
    full = len(plan(64, "full").recomputed("fused"))
    assert recomputed[64] < full and recomputed[12] == full   # 8 layers: 7 recomputed
    assert list(recomputed.values()) == sorted(recomputed.values())
    kept = plan(32)
    assert kept.bwd_plan[0] != plan(32, "full").bwd_plan[0]
    assert fxpipe.plan.predict_memory(pipe, kept, run_type="fused", num_microbatch=2).peak \
        <= 32 * 2**20
    run = fxpipe.compile(model, example_inputs=(x,), plan=kept,
                         devices=[fxpipe.VirtualDevice(memory_limit=40 * 2**20)],
                         config=fxpipe.RunConfig(num_microbatch=2))
    tail = kept.bwd_plan[0]    # the Program prints the choice: the kept layers' fused stage
    assert f" fused {tail.start}:{tail.stop} " in str(run.program("fused"))
    loss_fn = lambda out, t: F.cross_entropy(out.flatten(0, 1), t.flatten())  # noqa: E731
    loss = run.forward_backward((x,), label=y, loss_fn=loss_fn)
    ref_loss = loss_fn(ref(x), y)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach())
    for (n, p), r in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, r.grad, msg=n)
