"""Models that are not one graph: blocks with data-dependent control flow (captured at
block granularity and run as modules), one block object at several places, both stacks
of an encoder-decoder, non-tensor inputs that change and outputs fxpipe cannot merge.
Each compared with eager PyTorch on the same inputs."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

import fxpipe
from fxpipe.passes.costs import compute_costs
from fxpipe.passes.partition import build_layer_graph, find_block_lists
from tests import models
from tests.test_runtime import assert_grads_equal, devices


class Routed(nn.Module):
    """An MoE block whose experts run only on the rows routed to them: a Python loop over
    ``.tolist()`` of the chosen experts, which no graph capture can trace."""

    def __init__(self, dim: int = 8, experts: int = 3):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.router = nn.Linear(dim, experts, bias=False)
        self.experts = nn.ModuleList([nn.Linear(dim, dim) for _ in range(experts)])

    def forward(self, x, scale):
        h = self.norm(x)
        choice = self.router(h).argmax(-1)
        out = torch.zeros_like(h)
        for e in choice.unique().tolist():
            rows = (choice == e).nonzero().squeeze(-1)
            out = out.index_add(0, rows, self.experts[e](h[rows]))
        return x + out * scale


class MoE(nn.Module):
    def __init__(self, depth: int = 3, dim: int = 8):
        super().__init__()
        self.embed = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList([Routed(dim) for _ in range(depth)])
        self.head = nn.Linear(dim, 4)

    def forward(self, x, scale):
        h = self.embed(x)
        for block in self.blocks:
            h = block(h, scale)
        return self.head(h)


def _moe():
    torch.manual_seed(0)
    return MoE(), torch.randn(8, 8), torch.tensor(0.5)


def test_data_dependent_blocks_run_as_modules_and_equal_eager():
    model, x, scale = _moe()
    ref = copy.deepcopy(model)
    pipe = fxpipe.compile(model, (x, scale), devices=devices(2),
                          config=fxpipe.RunConfig(num_microbatch=2))
    assert pipe.layers.capture == "blocks"
    assert [(layer.name, layer.opaque) for layer in pipe.layers] == [
        ("prefix", False), ("blocks.0", True), ("blocks.1", True), ("blocks.2", True),
        ("suffix", False)]
    code = pipe.code("fused")
    assert "run as modules, all parameters uploaded: blocks.0" in code
    assert "fxpipe_passes_blocks_run_block(opaque_blocks_0" in code
    for stage in pipe.stages:  # every expert's parameters are prefetched with its block
        for i in stage.layers:
            if pipe.layers[i].opaque:
                block = pipe.layers[i].name
                assert {f"{block}.experts.{e}.weight" for e in range(3)} <= set(stage.params)

    y = torch.randint(0, 4, (8,))
    loss = pipe.forward_backward((x, scale), label=y, loss_fn=F.cross_entropy)
    ref_loss = F.cross_entropy(ref(x, scale), y)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach())
    assert_grads_equal(model, ref, atol=1e-6)
    with torch.no_grad():  # another batch size: 5 rows in 2 microbatches, other routing
        x5 = torch.randn(5, 8)
        torch.testing.assert_close(pipe(x5, scale), ref(x5, scale))


def _peak_saved_tensors(depth: int) -> int:
    """The most tensors autograd held saved at once while block capture ran the example."""
    from fxpipe.passes.blocks import _run_once
    torch.manual_seed(0)
    model, x = MoE(depth), torch.randn(8, 8)
    live = peak = 0

    class Held:
        def __init__(self, t):
            nonlocal live, peak
            self.t, live = t, live + 1
            peak = max(peak, live)

        def __del__(self):
            nonlocal live
            live -= 1

    with torch.autograd.graph.saved_tensors_hooks(Held, lambda held: held.t):
        _run_once(model, list(model.blocks), lambda: model(x, torch.tensor(0.5)))
    return peak


def test_block_capture_holds_one_blocks_activations_at_a_time():
    """Capture at block granularity runs the example once with grad (to check each block
    returns a gradient): each block's outputs go on detached, so what autograd saves does
    not add up over the blocks (a Llama-8B's 16 x 4,096-token example held 130 GB)."""
    assert _peak_saved_tensors(6) == _peak_saved_tensors(2) > 0


def test_costs_of_a_data_dependent_layer_are_measured_and_said(capsys):
    model, x, scale = _moe()
    lg = build_layer_graph(model, (x, scale))
    fxpipe.set_verbose(True)
    try:
        costs = compute_costs(lg, [x, scale])
    finally:
        fxpipe.set_verbose(None)
    err = capsys.readouterr().err
    assert "layer 1 (blocks.0) cannot run on fake tensors" in err
    assert "measured on the example's real tensors" in err
    h = model.embed(x)
    with FlopCounterMode(display=False) as counter:  # the example's own routing
        model.blocks[0](h, scale)
    assert costs[1].fwd_flops == counter.get_total_flops() > 0
    assert costs[1].bwd_flops > 0 and costs[1].saved_bytes > 0
    assert all(p.grad is None for p in model.parameters())  # measuring touched no .grad


def test_costs_of_a_data_dependent_layer_are_bounded_without_weights():
    model, x, scale = _moe()
    lg = build_layer_graph(model, (x, scale))
    costs = compute_costs(lg, [x.to("meta"), scale.to("meta")])
    block = sum(p.numel() for p in model.blocks[0].parameters())
    assert costs[1].fwd_flops == 2 * block * 8  # every expert on every row
    assert costs[1].bwd_flops == 2 * costs[1].fwd_flops


class NormedRouted(Routed):
    """A data-dependent block with BatchNorm: in training mode it updates its statistics."""

    def __init__(self, dim: int = 8):
        super().__init__(dim)
        self.bn = nn.BatchNorm1d(dim)

    def forward(self, x, scale):
        return super().forward(self.bn(x), scale)


def test_buffers_a_block_run_as_a_module_updates_are_written_back():
    torch.manual_seed(0)
    model = MoE()
    model.blocks = nn.ModuleList([NormedRouted() for _ in range(2)])
    model.train()
    ref = copy.deepcopy(model)
    x, scale = torch.randn(8, 8), torch.tensor(0.5)
    pipe = fxpipe.compile(model, (x, scale), devices=devices(2),
                          config=fxpipe.RunConfig(num_microbatch=1))
    assert pipe.layers.capture == "blocks"
    assert all(b.running_mean.abs().sum() == 0 for b in (m.bn for m in model.blocks))  # untouched
    pipe.forward_backward((x, scale), loss_fn=lambda out, _: out.square().mean())
    ref(x, scale).square().mean().backward()
    assert_grads_equal(model, ref, atol=1e-6)
    for (name, b), r in zip(model.named_buffers(), ref.buffers()):
        torch.testing.assert_close(b, r, msg=name)


class NoGradInside(nn.Module):
    """Leaves its gradients to a custom autograd.Function around it (like Reformer's
    reversible layers): run as a module, it would silently get none."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        with torch.no_grad():
            y = self.lin(x)
        return y if bool(y.sum() > 0) else -y


def test_a_block_that_turns_grad_off_inside_is_refused():
    model = nn.Sequential(NoGradInside(), NoGradInside())
    with pytest.raises(fxpipe.CaptureError, match=r"(?s)blocks: .*block 0 returns no gradient"):
        fxpipe.compile(model, (torch.randn(4, 8),))


class Settings:
    """An object handed to every block: frozen into the graph, it would go stale."""

    factor = 2.0


class TakesSettings(Routed):
    def forward(self, x, settings):
        return super().forward(x, settings.factor)


def test_an_object_argument_of_a_block_run_as_a_module_is_refused():
    model = MoE(depth=2)
    model.blocks = nn.ModuleList([TakesSettings() for _ in range(2)])
    with pytest.raises(fxpipe.CaptureError,
                       match=r"blocks: BlockCallError: block blocks.0 is called with a value of "
                             r"type Settings, which would be frozen into the graph"):
        fxpipe.compile(model, (torch.randn(4, 8), Settings()))


# -- one block object at several places ---------------------------------------------------

class Block(nn.Module):
    def __init__(self, dim: int = 8):
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, x):
        return x + torch.tanh(self.lin(x))


class SharedBlocks(nn.Module):
    """``blocks[0]`` and ``blocks[2]`` are the same object (hand-written weight sharing)."""

    def __init__(self):
        super().__init__()
        b0, b1 = Block(), Block()
        self.blocks = nn.ModuleList([b0, b1, b0])
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_one_block_object_at_two_places_is_one_layer_run_twice(capture):
    torch.manual_seed(0)
    model = SharedBlocks()
    ref = copy.deepcopy(model)
    x, y = torch.randn(6, 8), torch.randint(0, 3, (6,))
    plan = fxpipe.ExecutePlan([range(0, 2)], [range(2, 4), range(1, 2), range(0, 1)])
    pipe = fxpipe.compile(model, (x,), devices=devices(2), capture=capture, plan=plan,
                          config=fxpipe.RunConfig(num_microbatch=2))
    assert [layer.name for layer in pipe.layers] == ["blocks.0", "blocks.1", "blocks.2", "suffix"]
    assert pipe.layers.shared_params == {"blocks.0.lin.weight": [0, 2], "blocks.0.lin.bias": [0, 2]}
    loss = pipe.forward_backward((x,), label=y, loss_fn=F.cross_entropy)
    ref_loss = F.cross_entropy(ref(x), y)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach())
    assert_grads_equal(model, ref)  # the two uses' gradients summed, as eager sums them


class Looped(nn.Module):
    """Each block applied twice (ALBERT shares one layer group this way)."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])

    def forward(self, x):
        for _ in range(2):
            for block in self.blocks:
                x = block(x)
        return x


def test_a_block_applied_twice_is_a_layer_per_call():
    torch.manual_seed(0)
    model = Looped()
    ref = copy.deepcopy(model)
    x = torch.randn(6, 8)
    pipe = fxpipe.compile(model, (x,), devices=devices(2))
    assert [layer.name for layer in pipe.layers] == ["blocks.0", "blocks.1", "blocks.0@1", "blocks.1@1"]
    pipe(x).square().mean().backward()
    ref(x).square().mean().backward()
    assert_grads_equal(model, ref)


class SharedSubmodule(nn.Module):
    """Block 2 calls block 0's Linear (its first registered name is inside block 0)."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block(), Block()])
        self.blocks[2].lin = self.blocks[0].lin

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_a_submodule_shared_by_two_blocks_goes_with_the_block_calling_it(capture):
    torch.manual_seed(0)
    model = SharedSubmodule()
    ref = copy.deepcopy(model)
    x = torch.randn(6, 8)
    pipe = fxpipe.compile(model, (x,), devices=devices(2), capture=capture)
    assert [layer.name for layer in pipe.layers] == ["blocks.0", "blocks.1", "blocks.2"]
    pipe(x).square().mean().backward()
    ref(x).square().mean().backward()
    assert_grads_equal(model, ref)


# -- both stacks of an encoder-decoder ----------------------------------------------------

class DecoderBlock(nn.Module):
    def __init__(self, dim: int = 8):
        super().__init__()
        self.lin = nn.Linear(2 * dim, dim)

    def forward(self, tgt, memory):
        return tgt + torch.tanh(self.lin(torch.cat([tgt, memory], -1)))


class EncoderDecoder(nn.Module):
    def __init__(self, dim: int = 8):
        super().__init__()
        self.encoder = nn.ModuleList([Block(dim) for _ in range(2)])
        self.decoder = nn.ModuleList([DecoderBlock(dim) for _ in range(2)])

    def forward(self, src, tgt):
        for block in self.encoder:
            src = block(src)
        memory = F.layer_norm(src, src.shape[-1:])
        for block in self.decoder:
            tgt = block(tgt, memory)
        return tgt


def test_encoder_and_decoder_blocks_are_one_chain_carrying_the_encoder_output():
    torch.manual_seed(0)
    model = EncoderDecoder()
    ref = copy.deepcopy(model)
    src, tgt = torch.randn(6, 8), torch.randn(6, 8)
    assert find_block_lists(model) == ["decoder", "encoder"]
    plan = fxpipe.ExecutePlan([range(0, 1), range(1, 3)], [range(3, 4), range(1, 3), range(0, 1)])
    pipe = fxpipe.compile(model, (src, tgt), devices=devices(2), plan=plan)
    layers = pipe.layers
    assert [layer.name for layer in layers] == ["encoder.0", "encoder.1", "decoder.0", "decoder.1"]
    memory = layers[1].outputs[-1]  # the encoder's final norm goes with its last block
    assert all(memory in layers[i].inputs for i in (2, 3))
    pipe(src, tgt).square().mean().backward()
    ref(src, tgt).square().mean().backward()
    assert_grads_equal(model, ref)


# -- non-tensor inputs that change, outputs that cannot be merged -------------------------

def test_a_changed_scalar_is_captured_again_once_per_value(capsys):
    torch.manual_seed(0)
    model = models.KwargsModel()
    ref = copy.deepcopy(model)
    x, mask = torch.randn(4, 16), torch.ones(4, 16)
    pipe = fxpipe.compile(model, (x,), {"mask": mask, "scale": 1.0}, devices=devices(2))
    fxpipe.set_verbose(True)
    try:
        for scale in (1.0, 3.0, 3.0, 1.0):
            torch.testing.assert_close(pipe(x, mask=mask, scale=scale)["logits"],
                                       ref(x, mask=mask, scale=scale)["logits"])
    finally:
        fxpipe.set_verbose(None)
    assert len(pipe._cache) == 2
    err = capsys.readouterr().err
    assert err.count("capturing the model again") == 1
    assert "input 'scale' is 3.0, the captured graph has the constant 1.0" in err
    loss = pipe.forward_backward((x,), {"mask": mask, "scale": 3.0},
                                 loss_fn=lambda out, _: out["logits"].square().mean())
    ref_loss = ref(x, mask=mask, scale=3.0)["logits"].square().mean()
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach())
    assert_grads_equal(model, ref)


def test_past_the_bound_a_changed_scalar_says_to_pass_a_tensor():
    model = models.KwargsModel()
    x, mask = torch.randn(4, 16), torch.ones(4, 16)
    pipe = fxpipe.compile(model, (x,), {"mask": mask, "scale": 0.0}, devices=devices(2))
    with torch.no_grad():
        for k in range(1, fxpipe.graph_cache.MAX_CONSTANT_VARIANTS):
            pipe(x, mask=mask, scale=float(k))
        pipe(x, mask=mask, scale=0.0)  # a value already captured is fine
        with pytest.raises(ValueError, match=r"input 'scale' is 9.0: .* captured the model for 8 "
                                             r".*Pass 'scale' as a tensor \(e.g. torch.tensor\(9.0\)\)"):
            pipe(x, mask=mask, scale=9.0)
    assert len(pipe._cache) == fxpipe.graph_cache.MAX_CONSTANT_VARIANTS


def test_export_specializes_sizes_microbatches_do_not_split_then_generalizes_once(capsys):
    torch.manual_seed(0)
    model = models.GPT(depth=2)
    ids = torch.randint(0, 64, (4, 8))
    pipe = fxpipe.compile(model, (ids,), devices=devices(2), capture="export")
    assert pipe.layers.static_dims["ids"] == {1: 8}  # the batch dim stays symbolic
    fxpipe.set_verbose(True)
    try:
        for shape in [(6, 8), (4, 12), (3, 5), (3, 16)]:
            x = torch.randint(0, 64, shape)
            with torch.no_grad():
                torch.testing.assert_close(pipe(x), model(x))
    finally:
        fxpipe.set_verbose(None)
    assert len(pipe._cache) == 2  # the second capture keeps the sequence dim symbolic too
    assert capsys.readouterr().err.count("capturing the model again") == 1
    assert pipe._cache[1].layers.static_dims["ids"] == {}


class CacheObject:
    """Not a tensor nor a registered pytree: what a Hugging Face cache looks like to fxpipe."""

    def __init__(self, t):
        self.t = t


class ReturnsCache(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return {"out": x, "cache": CacheObject(x)}


@pytest.mark.parametrize("capture", ["auto", "export"])
def test_an_output_that_cannot_be_merged_is_returned_as_none_and_said(capture, capsys):
    torch.manual_seed(0)
    model = ReturnsCache()
    ref = copy.deepcopy(model)
    x = torch.randn(6, 8)
    fxpipe.set_verbose(True)
    try:
        pipe = fxpipe.compile(model, (x,), devices=devices(2), capture=capture)
    finally:
        fxpipe.set_verbose(None)
    assert "returns ['cache'] (CacheObject)" in capsys.readouterr().err
    out = pipe(x)
    assert out["cache"] is None
    out["out"].square().mean().backward()
    ref(x)["out"].square().mean().backward()
    assert_grads_equal(model, ref)


class Branchy(nn.Module):
    """A block whose Python branches on a value of the whole batch."""

    def __init__(self, dim: int = 8):
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, x):
        if x.mean() > 0:
            return self.lin(x)
        return x - self.lin(x)


def test_a_block_branching_on_tensor_values_warns_naming_the_line(capfd):
    """Captured at block granularity, the branch is taken per microbatch: a warning names
    the line. The partial export graphs the failed whole-graph traces print go to stderr
    in verbose mode only."""
    model = nn.Sequential(*[Branchy() for _ in range(3)])
    with pytest.warns(UserWarning, match=r"a block's Python branches on tensor values, at "
                                         r"test_capture_blocks.py:\d+ in forward `if x.mean\(\) "
                                         r"> 0:`.*taken per microbatch"):
        pipe = fxpipe.compile(model, (torch.randn(6, 8),), devices=devices(2))
    assert pipe.layers.capture == "blocks"
    assert "def forward" not in capfd.readouterr().err   # no partial graph dumped
    fxpipe.set_verbose(True)
    try:
        with pytest.warns(UserWarning):
            fxpipe.compile(nn.Sequential(*[Branchy() for _ in range(3)]), (torch.randn(6, 8),),
                           devices=devices(2))
    finally:
        fxpipe.set_verbose(False)
    assert "def forward" in capfd.readouterr().err       # verbose: as torch prints it
