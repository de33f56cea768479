"""Bad input gets a clear exception: what was wrong, where, and what to do."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import fxpipe
from tests import models


class DataDependent(nn.Module):
    """Python control flow on a tensor's value and an untraceable side effect."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(2)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
            if x.sum().item() > 0:  # value-dependent branch
                x = -x
            print(x.tolist(), file=open("/dev/null", "w"))
        return x


def test_uncapturable_model_lists_every_method():
    with pytest.raises(fxpipe.CaptureError) as info:
        fxpipe.compile(DataDependent(), example_inputs=(torch.randn(2, 4),))
    msg = str(info.value)
    assert "DataDependent" in msg
    for method in ("fx", "export", "dynamo", "blocks"):
        assert f"- {method}:" in msg
    assert "layers=" in msg and "capture=" in msg
    assert set(info.value.attempts) == {"fx", "export", "dynamo", "blocks"}
    # the block-granular capture says which line of forward, outside the blocks, hit what
    assert ("outside its blocks, after block layers.0, in its layer, at test_errors.py:23 in "
            "forward `if x.sum().item() > 0:") in msg
    assert "GuardOnDataDependentSymNode" in msg


def test_single_method_failure_names_only_that_method():
    with pytest.raises(fxpipe.CaptureError) as info:
        fxpipe.compile(DataDependent(), example_inputs=(torch.randn(2, 4),), capture="fx")
    assert set(info.value.attempts) == {"fx"}


def test_layers_naming_no_module_suggests_close_names():
    with pytest.raises(ValueError, match=r"layers='blocks\.x' names no submodule.*'blocks'"):
        fxpipe.compile(models.GPT(depth=2), example_inputs=(torch.randint(0, 64, (2, 8)),),
                       layers="blocks.x")


def test_layers_naming_a_leaf_module():
    with pytest.raises(ValueError, match="no child modules"):
        fxpipe.compile(models.GPT(depth=2), example_inputs=(torch.randint(0, 64, (2, 8)),),
                       layers="embed")


def test_explicit_layers_is_used():
    pipe = fxpipe.compile(models.GPT(depth=2).eval(), example_inputs=(torch.randint(0, 64, (2, 8)),),
                          layers="blocks")
    assert [layer.name for layer in pipe.layers][1:3] == ["blocks.0", "blocks.1"]


def test_missing_example_inputs():
    with pytest.raises(ValueError, match="needs example inputs"):
        fxpipe.compile(models.mlp())


def test_example_inputs_not_a_tuple():
    with pytest.raises(TypeError, match=r"example_inputs=\(x,\)"):
        fxpipe.compile(models.mlp(), example_inputs=[torch.randn(2, 16)])


def test_not_a_module():
    with pytest.raises(TypeError, match="expects an nn.Module"):
        fxpipe.compile(lambda x: x, example_inputs=(torch.randn(2),))


def test_unknown_capture_method():
    with pytest.raises(ValueError, match="capture='jit'"):
        fxpipe.compile(models.mlp(), example_inputs=(torch.randn(2, 16),), capture="jit")


def test_call_with_different_structure_names_the_arguments():
    pipe = fxpipe.compile(models.KwargsModel(), example_inputs=(torch.randn(2, 16),),
                          example_kwargs={"mask": torch.ones(2, 16)})
    with pytest.raises(TypeError, match=r"this call is missing keyword argument\(s\) 'mask'"):
        pipe(torch.randn(2, 16))


def test_call_with_wrong_rank_names_the_argument():
    pipe = fxpipe.compile(models.mlp(), example_inputs=(torch.randn(2, 16),))
    with pytest.raises(ValueError, match="input 'input' has 3 dims, compiled with 2"):
        pipe(torch.randn(2, 3, 16))


def test_bad_plan_is_rejected_before_running():
    with pytest.raises(fxpipe.PlanError):
        fxpipe.compile(models.mlp(depth=1), example_inputs=(torch.randn(2, 16),),
                       plan=fxpipe.ExecutePlan(fwd_plan=[range(0, 1)], bwd_plan=[range(0, 1)]))


def test_packed_outputs_feed_another_pipe_but_refuse_to_lose_gradients():
    torch.manual_seed(0)
    enc, dec = models.mlp(width=4, depth=2), models.mlp(width=4, depth=2)
    x = torch.randn(6, 4)
    epipe = fxpipe.compile(enc, (x,), config=fxpipe.RunConfig(merge_output=False))
    dpipe = fxpipe.compile(dec, (x,))
    with torch.no_grad():
        packed = epipe(x)
        assert isinstance(packed, fxpipe.PackedData) and len(packed) == 3
        torch.testing.assert_close(dpipe(packed), dec(enc(x)))
    with pytest.raises(NotImplementedError, match="merge_output=False .* not differentiable"):
        epipe(x)  # grad enabled: the encoder's gradients would be lost
    leaky = fxpipe.PackedData([t.requires_grad_() for t in packed])
    with pytest.raises(NotImplementedError, match="PackedData input requires grad"):
        dpipe(leaky)


def test_an_inference_only_plan_compiles_and_refuses_training():
    model, x = nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)]), torch.randn(6, 4)
    pipe = fxpipe.compile(model, (x,), plan=fxpipe.ExecutePlan([range(0, 2), range(2, 4)]))
    with torch.no_grad():
        torch.testing.assert_close(pipe(x), model(x))
    with pytest.raises(fxpipe.PlanError, match="no bwd_plan, so it can only run inference"):
        pipe(x).sum().backward()
    with pytest.raises(fxpipe.PlanError, match="a fused step needs backward stages"):
        pipe.forward_backward((x,), loss_fn=lambda out, _: out.sum())
    assert all(p.grad is None for p in model.parameters())


def test_an_optimizer_holding_none_of_the_pipes_parameters_is_refused():
    """Built on a copy of the model, it would step nothing while ``.grad`` accumulates."""
    import copy
    import torch.nn.functional as F
    torch.manual_seed(0)
    model = models.mlp(width=8, depth=3)
    x, y = torch.randn(6, 8), torch.randn(6, 4)
    pipe = fxpipe.compile(model, example_inputs=(x,), devices=["cpu", "cpu"])
    wrong = torch.optim.AdamW(copy.deepcopy(model).parameters())
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"optimizer= \(AdamW\) holds none of the trainable "
                                         r"parameters of the compiled Sequential .* \(not on a copy"):
        pipe.forward_backward((x,), label=y, loss_fn=F.mse_loss, optimizer=wrong)
    assert all(torch.equal(p, b) and p.grad is None for p, b in zip(model.parameters(), before))
    right = torch.optim.AdamW(list(model.parameters())[:2])   # some of them: fine
    pipe.forward_backward((x,), label=y, loss_fn=F.mse_loss, optimizer=right)
    assert not torch.equal(next(model.parameters()), before[0])


def test_label_rows_are_checked_against_the_inputs_with_the_callers_shapes():
    """Not one microbatch's shapes (``Expected input batch_size (24) to match target
    batch_size (23)``): the caller's, before anything runs."""
    import torch.nn.functional as F
    model = models.mlp(width=8, depth=3)
    x = torch.randn(96, 8)
    pipe = fxpipe.compile(model, example_inputs=(x,), devices=["cpu", "cpu"],
                          config=fxpipe.RunConfig(num_microbatch=4))
    with pytest.raises(ValueError, match=r"label has 93 rows \(shape \(93,\)\) and the inputs "
                                         r"96 \(args\[0\], shape \(96, 8\)\): both are split "
                                         r"into 4 microbatches"):
        pipe.forward_backward((x,), label=torch.randint(0, 4, (93,)), loss_fn=F.cross_entropy)
    assert all(p.grad is None for p in model.parameters())
    # one label per token of each row is split alike: fine
    seq = fxpipe.compile(models.GPT(depth=2), example_inputs=(torch.zeros(8, 4, dtype=torch.long),),
                         devices=["cpu", "cpu"], config=fxpipe.RunConfig(num_microbatch=4))
    ids = torch.randint(0, 64, (8, 4))
    seq.forward_backward((ids,), label=ids.flatten(),
                         loss_fn=lambda out, y: F.cross_entropy(out.flatten(0, 1), y))
