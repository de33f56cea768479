"""Which carried values get a gradient (``passes.grad_flow``), and that backward stages
make leaves of those only, with gradients still equal to eager."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import fxpipe
from fxpipe.passes.grad_flow import grad_values, layer_sources
from fxpipe.passes.partition import build_layer_graph
from fxpipe.runtime.issue import compute
from tests import models
from tests.test_runtime import assert_grads_equal, ce, devices, train_step


class Mixed(nn.Module):
    """Carried values of every kind: a float table from a size, an integer index, a
    detached value, a value from a frozen or trainable block, the input itself."""

    def __init__(self, dim=8):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(dim, dim) for _ in range(3)])

    def forward(self, x):
        pos = torch.arange(x.shape[1], dtype=x.dtype)          # no gradient
        idx = (x.sum(-1) > 0).long()                            # integer: no gradient
        h = self.blocks[0](x)
        stale = h.detach() * 2                                  # detached: no gradient
        h = self.blocks[1](h + pos)
        h = self.blocks[2](h + stale) + idx.unsqueeze(-1)
        return h + x


def _sources(lg):
    return {name: (sorted(lg.layers[k].inputs[i] for i in ins), sorted(attrs))
            for k in range(len(lg.layers))
            for name, (ins, attrs) in zip(lg.layers[k].outputs, layer_sources(lg.layers[k]))}


def test_sources_skip_sizes_integers_and_detach():
    lg = build_layer_graph(Mixed(), (torch.randn(4, 8),))
    assert [(layer.name, layer.inputs, layer.outputs) for layer in lg] == [
        ("prefix", ["x"], ["arange", "long"]),
        ("blocks.0", ["x", "arange"], ["mul", "add"]),   # mul: the detached value
        ("blocks.1", ["mul", "add"], ["add_1"]),
        ("blocks.2", ["add_1"], ["linear_2"]),
        ("suffix", ["x", "long", "linear_2"], ["add_3"])]
    assert _sources(lg) == {
        "arange": ([], []), "long": ([], []), "mul": ([], []),
        "add": (["arange", "x"], ["blocks.0.bias", "blocks.0.weight"]),
        "add_1": (["add", "mul"], ["blocks.1.bias", "blocks.1.weight"]),
        "linear_2": (["add_1"], ["blocks.2.bias", "blocks.2.weight"]),
        "add_3": (["linear_2", "x"], [])}
    assert grad_values(lg, inputs=()) == {"add", "add_1", "linear_2", "add_3"}
    assert grad_values(lg, inputs=["x"]) == {"x", "add", "add_1", "linear_2", "add_3"}


def test_frozen_parameters_and_inputs_decide_per_call():
    model = Mixed()
    lg = build_layer_graph(model, (torch.randn(4, 8),))
    for p in model.blocks[0].parameters():
        p.requires_grad_(False)
    assert grad_values(lg, inputs=()) == {"add_1", "linear_2", "add_3"}
    assert grad_values(lg, inputs=["x"]) == {"x", "add", "add_1", "linear_2", "add_3"}
    for p in model.parameters():
        p.requires_grad_(False)
    assert grad_values(lg, inputs=()) == set()


def test_unknown_values_count_as_dependencies():
    """No recorded values: sizes and ``detach`` still carry nothing, the integer mask
    (its dtype unknown now) counts as depending on ``x``."""
    lg = build_layer_graph(Mixed(), (torch.randn(4, 8),))
    for layer in lg:
        layer.gm.meta.pop("fxpipe_grad_sources", None)
        for node in layer.gm.graph.nodes:
            node.meta.pop("val", None)
    src = _sources(lg)
    assert src["arange"] == ([], []) and src["mul"] == ([], [])
    assert src["long"] == (["x"], [])
    assert grad_values(lg, inputs=["x"]) == {"x", "long", "add", "add_1", "linear_2", "add_3"}


def test_mixed_model_matches_eager():
    torch.manual_seed(0)
    model = Mixed()
    ref = copy.deepcopy(model)
    x = torch.randn(4, 8, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    pipe = fxpipe.compile(model, example_inputs=(x,), devices=devices(2),
                          config=fxpipe.RunConfig(num_microbatch=2))
    pipe(x).square().sum().backward()
    ref(x_ref).square().sum().backward()
    assert torch.allclose(x.grad, x_ref.grad, atol=1e-6)
    for (name, p), r in zip(model.named_parameters(), ref.parameters()):
        assert torch.allclose(p.grad, r.grad, atol=1e-6), name


def _input_grads_taken(monkeypatch):
    """Names of the values whose gradient a backward stage handed back, per call."""
    taken: set[str] = set()
    give = compute.StageCompute._give_grads

    def spy(self, d, s, m, grads):
        taken.update(n for n, g in grads.items() if g is not None)
        return give(self, d, s, m, grads)

    monkeypatch.setattr(compute.StageCompute, "_give_grads", spy)
    return taken


@pytest.mark.parametrize("style", ["fused", "eager"])
@pytest.mark.parametrize("grain", ["stage", "layer"])
def test_rotary_tables_get_no_gradient_and_grads_match_eager(monkeypatch, style, grain):
    torch.manual_seed(0)
    model = models.GPT(depth=3).eval()
    ref = copy.deepcopy(model)
    ids, y = torch.randint(0, 64, (4, 8)), torch.randint(0, 64, (4, 8))
    pipe = fxpipe.compile(model, example_inputs=(ids,),
                          devices=devices(2),
                          plan=fxpipe.ExecutePlan(fwd_plan=[range(0, 2), range(2, 4)],
                                                  bwd_plan=[range(4, 5), range(2, 4), range(0, 2)]),
                          config=fxpipe.RunConfig(num_microbatch=2, recompute_grain=grain))
    taken = _input_grads_taken(monkeypatch)
    loss = train_step(pipe, style, ids, y)
    ref_loss = ce(ref(ids), y)
    ref_loss.backward()
    assert torch.allclose(loss, ref_loss.detach(), atol=1e-6)
    assert_grads_equal(model, ref)
    prefix = pipe.layers[0]
    tables = set(prefix.outputs) - {"embedding"}  # cos and sin, from the sequence length
    assert prefix.outputs == ["embedding", *sorted(tables)] and len(tables) == 2
    assert taken and not (taken & tables), taken  # block outputs do get gradients


def test_frozen_prefix_sends_no_gradient_to_it(monkeypatch):
    """Fine-tuning the top: no gradient goes back to a frozen prefix's outputs."""
    torch.manual_seed(0)
    model = models.GPT(depth=3).eval()
    ref = copy.deepcopy(model)
    for m in (model, ref):
        m.head.weight = nn.Parameter(m.embed.weight.detach().clone())  # untie, then freeze
        m.embed.weight.requires_grad_(False)
        for p in m.blocks[0].parameters():
            p.requires_grad_(False)
    ids, y = torch.randint(0, 64, (4, 8)), torch.randint(0, 64, (4, 8))
    pipe = fxpipe.compile(model, example_inputs=(ids,), devices=devices(1),
                          config=fxpipe.RunConfig(num_microbatch=2))
    taken = _input_grads_taken(monkeypatch)
    pipe.forward_backward((ids,), label=y, loss_fn=ce)
    ce(ref(ids), y).backward()
    assert_grads_equal(model, ref)
    first_block_in = set(pipe.layers[1].inputs)
    assert not (taken & first_block_in), taken & first_block_in
