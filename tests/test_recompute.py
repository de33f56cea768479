"""A backward stage's recompute skips its linear tail (passes.recompute, runtime.tail)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

import fxpipe
from fxpipe.passes.recompute import skippable_tail
from fxpipe.runtime import tail
from fxpipe.runtime.tail import Deferred, backprop


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
    return skippable_tail(fx.symbolic_trace(Functional(body)).graph)


def test_the_residual_tail_is_skipped():
    assert tail_of(lambda m, x: x + F.linear(F.relu(F.linear(x, m.w1)), m.w2, m.b2)) == \
        ("linear_1", "add")


def test_a_value_the_rest_reads_is_computed():
    assert tail_of(lambda m, x: F.linear(F.linear(x, m.w1), m.w2) * 2) == ()
    # a linear of a skipped linear: only the last is skipped (the first is its input)
    assert tail_of(lambda m, x: F.linear(F.linear(x, m.w1), m.w2)) == ("linear_1",)
    # an add of two computed values costs no matmul: computed
    assert tail_of(lambda m, x: x + F.relu(x)) == ()


def eager_grads(fn, *tensors):
    leaves = [t.detach().clone().requires_grad_(t.requires_grad) for t in tensors]
    out = fn(*leaves)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
    out.backward(g)
    return g, [t.grad for t in leaves]


def deferred_grads(build, g, *tensors):
    leaves = [t.detach().clone().requires_grad_(t.requires_grad) for t in tensors]
    backprop([(build(*leaves), g)])
    return [t.grad for t in leaves]


LIN = torch._C._nn.linear
CASES = {
    "3d input, bias": ((lambda x, w, b: F.linear(x, w, b)), (lambda x, w, b: Deferred(LIN, (x, w, b))),
                       [(2, 5, 4), (3, 4), (3,)]),
    "2d input": ((lambda x, w: F.linear(x, w)), (lambda x, w: Deferred(LIN, (x, w))), [(6, 4), (3, 4)]),
    "residual": ((lambda x, w: x + F.linear(x, w)),
                 (lambda x, w: Deferred(torch.add, (x, Deferred(LIN, (x, w))))), [(2, 5, 4), (4, 4)]),
    "broadcast add": ((lambda a, b: a + b), (lambda a, b: Deferred(torch.add, (a, b))), [(3, 4), (4,)]),
}


@pytest.mark.parametrize("case", CASES)
def test_gradients_are_autograds_bit_for_bit(case):
    eager, build, shapes = CASES[case]
    torch.manual_seed(0)
    tensors = [torch.randn(s, requires_grad=True) for s in shapes]
    g, ref = eager_grads(eager, *tensors)
    got = deferred_grads(build, g, *tensors)
    for a, b in zip(got, ref):
        assert torch.equal(a, b)


def test_no_gradient_is_computed_for_what_needs_none():
    x, w = torch.randn(3, 4), torch.randn(2, 4, requires_grad=True)
    backprop([(Deferred(LIN, (x, w)), torch.ones(3, 2))])
    assert x.grad is None and torch.equal(w.grad, torch.ones(3, 2).t().mm(x))
    backprop([(Deferred(LIN, (x, w)), None)])  # no gradient: nothing happens
    assert torch.equal(w.grad, torch.ones(3, 2).t().mm(x))


@pytest.mark.parametrize("why", ["strided input", "mixed dtypes"])
def test_where_the_rule_does_not_apply_the_node_is_computed(why):
    torch.manual_seed(0)
    x, w = torch.randn(4, 6, requires_grad=True), torch.randn(3, 6, requires_grad=True)
    if why == "strided input":
        x = torch.randn(6, 4).t().requires_grad_()
        eager, build = (lambda x, w: F.linear(x, w)), (lambda x, w: Deferred(LIN, (x, w)))
    elif why == "mixed dtypes":
        w = torch.randn(6, dtype=torch.float64, requires_grad=True)
        eager, build = (lambda x, w: x + w), (lambda x, w: Deferred(torch.add, (x, w)))
    g, ref = eager_grads(eager, x, w)
    got = deferred_grads(build, g, x, w)
    for a, b in zip(got, ref):
        assert torch.equal(a, b)


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
    (stage,) = pipe.stages
    assert stage.tail == ("linear_7", "add_3", "add_3_host")
    assert "# a recompute for backward skips linear_7, add_3, add_3_host" in stage.code
    start = next(tail._order)
    loss = pipe.forward_backward((x,), label=y, loss_fn=F.mse_loss)
    assert next(tail._order) - start - 1 > 0  # deferred values were made
    ref_loss = sum(F.mse_loss(ref(xm), ym) for xm, ym in zip(x.chunk(2), y.chunk(2))) / 2
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach())
    for (n, p), r in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, r.grad, msg=n)
