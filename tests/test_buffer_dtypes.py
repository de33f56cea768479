"""Floating buffers under ``param_dtype``: a device holds each in the dtype the model
loaded in bf16 holds it (``fxpipe.passes.buffer_dtypes``): for a Hugging Face model what
``from_pretrained(..., dtype=torch.bfloat16)`` gives it (bf16, except what the model's
code makes in fp32, like rotary ``inv_freq``), for any other module what
``module.to(torch.bfloat16)`` does. The host keeps the model's own fp32 tensors.

Before, every buffer kept its dtype on the devices: XGLM's fp32 sinusoidal table met bf16
activations ("mixed dtype (CPU)") and so did ResNet's BatchNorm statistics ("expected
scalar type BFloat16 but found Float"), where the bf16-loaded models train.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxpipe
from fxpipe.passes.buffer_dtypes import buffers_in_param_dtype
from fxpipe.passes.layer_graph import mark_in_param_dtype
from fxpipe.runtime.devices.emulator import VirtualDevice
from fxpipe.runtime.host.param_store import ParamStore
from fxpipe.runtime.host.params import HostParams, mark_scratch
from tests import models

T = pytest.importorskip("transformers")
from tests import hf_zoo  # noqa: E402
from tests.hf_zoo import Eager, own_loss  # noqa: E402
from tests.models import init_like_training  # noqa: E402

BF16 = torch.bfloat16


def xglm():
    return T.XGLMForCausalLM(T.XGLMConfig(
        vocab_size=hf_zoo.V, d_model=32, num_layers=2, attention_heads=4, ffn_dim=64,
        max_position_embeddings=64, dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0, layerdrop=0.0))


def resnet():
    return T.ResNetForImageClassification(T.ResNetConfig(
        embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=5))


MODELS = {"xglm": (xglm, hf_zoo.text), "resnet": (resnet, hf_zoo.images)}


def compiled(model, kw, num_microbatch=2):
    return fxpipe.compile(model, example_kwargs=kw, devices=[VirtualDevice(), VirtualDevice()],
                          param_dtype=BF16, config=fxpipe.RunConfig(num_microbatch=num_microbatch))


def test_the_buffers_follow_what_the_bf16_loaded_model_holds():
    llama = T.LlamaForCausalLM(T.LlamaConfig(**hf_zoo.DENSE))
    assert buffers_in_param_dtype(llama, BF16) == {}          # inv_freq: fp32 on purpose
    assert list(buffers_in_param_dtype(xglm(), BF16)) == ["model.embed_positions.weights"]
    found = buffers_in_param_dtype(resnet(), BF16)
    assert found and all(n.endswith(("running_mean", "running_var")) for n in found)
    # the twin's dtype is read from a copy of the config: the model's is left alone
    assert llama.config.dtype in (None, torch.float32)
    # other modules: as module.to(bf16) holds them, a KV cache (scratch) as it is made
    net = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    net.register_buffer("cache", torch.zeros(2))
    mark_scratch(net.cache)
    assert sorted(buffers_in_param_dtype(net, BF16)) == ["1.running_mean", "1.running_var"]
    assert buffers_in_param_dtype(net, None) == {}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_bf16_step_equals_the_bf16_loaded_models(name):
    """Failed before (module docstring). Eval mode, the model's own loss, 2 microbatches:
    within bf16's precision of the reference (``hf_zoo.Eager``), the gradients too."""
    torch.manual_seed(0)
    build, inputs = MODELS[name]
    model, kw = init_like_training(build()).eval(), inputs()
    ref = Eager(copy.deepcopy(model), "param_dtype")
    pipe = compiled(model, kw)
    loss = pipe.forward_backward((), kw, loss_fn=own_loss)
    ref_loss = ref.step(kw, None, own_loss)
    torch.testing.assert_close(loss, ref_loss, rtol=3e-2, atol=0)
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    ref_grads = torch.cat([p.grad.flatten() for p in ref.master.parameters()])
    assert (grads @ ref_grads / (grads.norm() * ref_grads.norm())).item() > 0.99
    # the host keeps fp32; the devices' bytes count the bf16 copies
    assert all(b.dtype in (torch.float32, torch.int64) for b in model.buffers())
    lg = pipe.layers
    assert {lg.device_dtype(b) for b in lg.buffers.values() if b.is_floating_point()} == {BF16}
    if name == "xglm":   # the prefix's sinusoidal table, counted as the devices hold it
        assert lg[0].cost.buffer_bytes == model.model.embed_positions.weights.numel() * 2
    pipe.close()


def test_rotary_inv_freq_stays_fp32_on_the_devices():
    torch.manual_seed(0)
    model = T.LlamaForCausalLM(T.LlamaConfig(**hf_zoo.DENSE)).eval()
    pipe = compiled(model, hf_zoo.text())
    inv_freq = model.model.rotary_emb.inv_freq
    assert pipe.layers.device_dtype(inv_freq) == torch.float32
    assert pipe.layers.device_dtype(model.lm_head.weight) == BF16
    pipe.close()


@pytest.mark.parametrize("name", ["convnet", "resnet"])
def test_batchnorm_statistics_after_bf16_steps_equal_the_references(name):
    """Training mode, one microbatch: the statistics the devices update in bf16 are
    written back into the host's fp32 buffers, equal to the bf16 reference's, step after
    step (the next upload casts them back exactly)."""
    torch.manual_seed(0)
    if name == "convnet":   # not Hugging Face: the reference is model.to(bf16)
        model = models.ConvNet(depth=2).train()
        ref = copy.deepcopy(model).to(BF16)
        kw, label = {"x": torch.randn(4, 3, 8, 8)}, torch.randint(0, 10, (4,))
        loss_fn = lambda out, y: F.cross_entropy(out.float(), y)  # noqa: E731
    else:
        model = resnet().train()
        ref = hf_zoo.low_precision_copy(model)
        kw, label, loss_fn = hf_zoo.images(), None, own_loss
    pipe = compiled(model, kw, num_microbatch=1)
    low_kw = {k: v.to(BF16) if v.is_floating_point() else v for k, v in kw.items()}
    for _ in range(2):
        pipe.forward_backward((), kw, label=label, loss_fn=loss_fn)
        loss_fn(ref(**low_kw), label).backward()
        for (fqn, b), r in zip(model.named_buffers(), ref.buffers()):
            counter = fqn.endswith("num_batches_tracked")
            assert b.dtype == (torch.int64 if counter else torch.float32)   # the host's own
            assert torch.equal(b, r.to(b.dtype)), fqn
    pipe.close()


def test_a_buffer_marked_after_the_host_adopted_it_uploads_in_param_dtype():
    """One host copy serves every pipe of a model: buffers adopted by an fp32 pipe, then
    marked by a bf16 one, go to the devices each in its own dtype (one run per dtype)."""
    bn = nn.BatchNorm1d(3)
    bn.register_buffer("table", torch.arange(3.0))
    host = HostParams.of(bn, pin=False)
    params, buffers = {0: dict(bn.named_parameters())}, {0: dict(bn.named_buffers())}
    ParamStore(host, params, buffers)
    mark_in_param_dtype(bn.running_mean, bn.running_var)
    store = ParamStore(host, params, buffers, param_dtype=BF16)
    store.refresh()
    dev = VirtualDevice()
    up = store.upload(0, dev)
    assert {k: v.dtype for k, v in up.items()} == {
        "weight": BF16, "bias": BF16, "running_mean": BF16, "running_var": BF16,
        "num_batches_tracked": torch.int64, "table": torch.float32}
    assert torch.equal(up["table"], bn.table)
    assert torch.equal(up["running_var"], bn.running_var.to(BF16))
    assert store.nbytes(0) == sum(r.numel() * r.element_size() for r in up.runs)
    store.release(dev, up)


class FloatGate(nn.Module):
    """Computes its gate on an fp32 value it makes itself (as Inkling2's router does): its
    bf16 copy fails eagerly."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(2)])
        self.gate = nn.Linear(8, 2)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.gate(x.float())


def test_a_product_the_model_mixes_dtypes_in_is_refused_at_compile_naming_it():
    """Before, it failed in the first call's stage 0 ("mat1 and mat2 must have the same
    dtype"), as eager does."""
    model, x = FloatGate(), torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="same dtype"):
        copy.deepcopy(model).to(BF16)(x.to(BF16))
    with pytest.raises(fxpipe.CaptureError, match=(
            r"(?s)fx: MixedDtypeError: linear \(linear_2\) in gate multiplies a torch.float32 "
            r"tensor by a torch.bfloat16 one.*What to do: the model's own code computes that "
            r"operation in two dtypes")):
        fxpipe.compile(model, (x,), devices=[VirtualDevice()], param_dtype=BF16, capture="fx")
    pipe = fxpipe.compile(model, (x,), devices=[VirtualDevice()], capture="fx")   # fp32: one
    torch.testing.assert_close(pipe(x), model(x))
