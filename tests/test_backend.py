"""``torch.compile(model, backend=fxpipe.backend(...))``: same results as eager, graph
breaks refused with a clear message."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxpipe
from tests import models
from tests.test_runtime import assert_grads_equal, ce, devices


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_compiled_gpt_trains_like_eager_and_serves_other_sizes():
    torch.manual_seed(0)
    model = models.GPT(depth=3)
    ref = copy.deepcopy(model)
    be = fxpipe.backend(devices=devices(2), config=fxpipe.RunConfig(num_microbatch=3))
    compiled = torch.compile(model, backend=be, dynamic=True)
    for shape in [(6, 8), (3, 12)]:
        ids, labels = torch.randint(0, 64, shape), torch.randint(0, 64, shape)
        loss = ce(compiled(ids), labels)
        loss.backward()
        ref_loss = ce(ref(ids), labels)
        ref_loss.backward()
        torch.testing.assert_close(loss, ref_loss)
        assert_grads_equal(model, ref)
    assert len(be.pipes) == 1  # dynamic shapes: one graph, one pipe
    pipe = be.pipe
    assert [layer.name for layer in pipe.layers] == ["prefix", "blocks.0", "blocks.1", "blocks.2",
                                                     "suffix"]
    assert "torch.ops.fxpipe.prefetch" in pipe.code() and len(pipe.stages) >= 2
    # the pipe's parameters are the model's own (tied embedding/head included)
    assert {id(p) for p in pipe.parameters()} == {id(p) for p in model.parameters()}


def test_eval_mode_recompiles_into_a_second_pipe():
    torch.manual_seed(0)
    model = models.GPT(depth=2, dropout=0.3)
    be = fxpipe.backend(devices=devices(2))
    compiled = torch.compile(model, backend=be, dynamic=True)
    ids = torch.randint(0, 64, (6, 8))
    compiled(ids)
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(compiled(ids), model(ids))
    assert len(be.pipes) == 2


def test_hf_llama_through_torch_compile():
    torch.manual_seed(0)
    model = models.init_like_training(models.tiny_llama(layers=2))
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 64, (4, 8))
    mask = torch.ones(4, 8, dtype=torch.long)
    mask[0, :2] = 0
    # 2 even microbatches: the model's 0-dim loss is averaged over them, as a batch mean
    be = fxpipe.backend(devices=devices(2), config=fxpipe.RunConfig(num_microbatch=2))
    compiled = torch.compile(model, backend=be, dynamic=True)
    out = compiled(input_ids=ids, attention_mask=mask, labels=ids)
    out.loss.backward()
    ref_out = ref(input_ids=ids, attention_mask=mask, labels=ids)
    ref_out.loss.backward()
    torch.testing.assert_close(out.loss, ref_out.loss)
    assert_grads_equal(model, ref, atol=1e-5)


class Breaks(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(2)])

    def forward(self, x):
        x = self.blocks[0](x)
        torch._dynamo.graph_break()
        return F.relu(self.blocks[1](x))


def test_a_graph_break_is_refused_naming_where():
    be = fxpipe.backend(devices=devices(2))
    compiled = torch.compile(Breaks(), backend=be)
    with pytest.raises(Exception, match=r"broke the model's graph .*test_backend.py:\d+") as info:
        compiled(torch.randn(4, 8))
    assert "torch._dynamo.explain" in str(info.value)
    assert not be.pipes


def test_backend_arguments_are_checked():
    with pytest.raises(TypeError, match="config must be an fxpipe.RunConfig"):
        fxpipe.backend(config={"num_microbatch": 2})
    with pytest.raises(RuntimeError, match="no graph compiled yet"):
        fxpipe.backend(devices=devices(1)).pipe


def test_a_static_graph_says_how_to_microbatch():
    torch.manual_seed(0)
    model = models.GPT(depth=2)
    be = fxpipe.backend(devices=devices(2), config=fxpipe.RunConfig(num_microbatch=2))
    compiled = torch.compile(model, backend=be, dynamic=False)
    with pytest.raises(Exception, match="dim 0 is 3, but the captured graph is specific to 6"):
        compiled(torch.randint(0, 64, (6, 8)))
    single = fxpipe.backend(devices=devices(2), config=fxpipe.RunConfig(num_microbatch=1))
    torch._dynamo.reset()
    ids = torch.randint(0, 64, (6, 8))
    torch.testing.assert_close(torch.compile(model, backend=single, dynamic=False)(ids), model(ids))
