"""``fxpipe.roundpipe``: RoundPipe's API on fxpipe. Every example of RoundPipe's documents
(``shared/reference/roundpipe-run-config.txt``, ``roundpipe-execution-plans.txt``,
``roundpipe-api-facts.md``) runs here with only its import changed, against eager PyTorch:
outputs, the returned loss (the sum of the microbatch losses) and every gradient."""

from __future__ import annotations

import collections
import copy

import pytest
import torch
import torch.nn as nn
from torch.distributed.pipelining.microbatch import TensorChunkSpec, _CustomReducer, _Replicate

import fxpipe
from fxpipe.roundpipe import (GradScaler, ModelExecutePlan, OptimizerCtx, RoundPipe,
                              RoundPipeRunConfig, doing_recompute, get_recompute_data,
                              save_for_recompute, wrap_model_to_roundpipe)

D = 8
DEV = ["cpu", "cpu"]
TOL = dict(atol=1e-6, rtol=1e-5)


def seq(n: int = 4, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(D, D), nn.Tanh()) for _ in range(n)])


def assert_grads(model: nn.Module, ref: nn.Module) -> None:
    for (name, p), r in zip(model.named_parameters(), ref.parameters()):
        assert p.grad is not None and r.grad is not None, name
        torch.testing.assert_close(p.grad, r.grad, **TOL, msg=name)


def mse_sum(out, label):
    return ((out - label) ** 2).sum()


class Scaled(nn.Module):
    """A model of two positional inputs: ``body(x * s)``."""

    def __init__(self):
        super().__init__()
        self.body = seq(3)

    def forward(self, x, s):
        return self.body(x * s)


# -- roundpipe-run-config.txt ------------------------------------------------------------------
def test_split_input_spec():
    # "First positional arg split along batch dim, second replicated"
    config = RoundPipeRunConfig(
        split_input=(
            (TensorChunkSpec(0), _Replicate),  # args spec
            None,                               # kwargs spec (auto-infer)
        ),
        num_microbatch=3,
    )
    model = Scaled()
    ref = copy.deepcopy(model)
    rp = RoundPipe(model, devices=DEV)
    x, y = torch.randn(6, D), torch.randn(6, D)
    s = torch.randn(6, D)[0]   # one scale row every microbatch gets whole (replicated)
    loss = rp.forward_backward(input_args=(x, s), label=y, loss_fn=mse_sum, run_config=config)
    ref_loss = mse_sum(ref(x, s), y)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach(), **TOL)
    assert_grads(model, ref)
    with torch.no_grad():
        torch.testing.assert_close(rp.forward(input_args=(x, s), run_config=config),
                                   ref(x, s), **TOL)


class Masked(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = seq(3)

    def forward(self, images, masks):
        return self.body(images * masks)


def test_custom_split_input():
    def custom_split(args, kwargs, num_microbatch):
        images, masks = args
        chunks_images = images.chunk(num_microbatch)
        chunks_masks = masks.chunk(num_microbatch)
        args_list = [(img, mask) for img, mask in zip(chunks_images, chunks_masks)]
        kwargs_list = [kwargs] * num_microbatch  # replicate kwargs
        return args_list, kwargs_list

    config = RoundPipeRunConfig(split_input=custom_split, num_microbatch=2)
    model = Masked()
    ref = copy.deepcopy(model)
    rp = RoundPipe(model, devices=DEV)
    images, masks, y = torch.randn(6, D), (torch.rand(6, D) > 0.3).float(), torch.randn(6, D)
    loss = rp.forward_backward(input_args=(images, masks), label=y, loss_fn=mse_sum,
                               run_config=config)
    ref_loss = mse_sum(ref(images, masks), y)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach(), **TOL)
    assert_grads(model, ref)


def test_split_label_spec():
    # "Label is (scalar tensor, tensor of shape (3, 12, 4), integer)
    #  The second tensor needs to be split along dimension 1"
    config = RoundPipeRunConfig(
        split_label=(_Replicate, TensorChunkSpec(1), _Replicate),
        num_microbatch=3,
    )
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, D), nn.Tanh(), nn.Linear(D, 4))
    ref = copy.deepcopy(model)
    rp = RoundPipe(model, devices=DEV)
    x = torch.randn(12, D)
    label = (torch.tensor(0.5), torch.randn(3, 12, 4), 3)

    def loss_fn(out, label):
        scale, targets, k = label
        return scale * k * ((out - targets.mean(0)) ** 2).sum()

    loss = rp.forward_backward(input_args=(x,), label=label, loss_fn=loss_fn, run_config=config)
    ref_loss = loss_fn(ref(x), label)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach(), **TOL)
    assert_grads(model, ref)


def test_custom_split_label():
    def custom_split_label(label, num_microbatch):
        targets, weights = label
        chunks_targets = targets.chunk(num_microbatch)
        chunks_weights = weights.chunk(num_microbatch)
        return [(t, w) for t, w in zip(chunks_targets, chunks_weights)]

    config = RoundPipeRunConfig(split_label=custom_split_label, num_microbatch=3)
    model = seq(3)
    ref = copy.deepcopy(model)
    rp = RoundPipe(model, devices=DEV)
    x, targets, weights = torch.randn(9, D), torch.randn(9, D), torch.rand(9, 1)

    def loss_fn(out, label):
        t, w = label
        return (w * (out - t) ** 2).sum()

    loss = rp.forward_backward(input_args=(x,), label=(targets, weights), loss_fn=loss_fn,
                               run_config=config)
    ref_loss = loss_fn(ref(x), (targets, weights))
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach(), **TOL)
    assert_grads(model, ref)


class WithAux(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = seq(3)

    def forward(self, x):
        h = self.body(x)
        return h, h.pow(2).sum()


def test_merge_output_custom_reducer():
    sum_reducer = _CustomReducer(torch.tensor(0.0), lambda x, y: x + y)
    model = WithAux()
    rp = RoundPipe(model, devices=DEV)
    x = torch.randn(6, D)
    config = RoundPipeRunConfig(merge_output=(TensorChunkSpec(0), sum_reducer), num_microbatch=3)
    with torch.no_grad():
        h, total = rp.forward(input_args=(x,), run_config=config)
        ref_h, ref_total = model(x)
    torch.testing.assert_close(h, ref_h, **TOL)
    torch.testing.assert_close(total, ref_total, **TOL)   # summed over microbatches


Out = collections.namedtuple("Out", ["logits", "hidden"])


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = seq(2)
        self.lm_head = nn.Linear(D, 5)

    def forward(self, x):
        h = self.body(x)
        return Out(self.lm_head(h), h)


def test_custom_merge():
    def custom_merge(outputs):
        # outputs is a list where each element is one microbatch's model output
        logits = torch.cat([out.logits for out in outputs], dim=0)
        return logits

    config = RoundPipeRunConfig(merge_output=custom_merge)
    model = Head()
    rp = RoundPipe(model, devices=DEV)
    x = torch.randn(6, D)
    with torch.no_grad():
        logits = rp.forward(input_args=(x,), run_config=config)
        torch.testing.assert_close(logits, model(x).logits, **TOL)


def test_no_merging_packed_data_inference():
    m1, m2 = seq(3, seed=1), seq(2, seed=2)
    rp1, rp2 = RoundPipe(m1, devices=DEV), RoundPipe(m2, devices=DEV)
    x = torch.randn(6, D)
    with torch.no_grad():
        packed = rp1.forward(input_args=(x,), run_config=RoundPipeRunConfig(merge_output=False))
        assert isinstance(packed, fxpipe.PackedData) and len(packed) == 3   # 2 devices + 1
        packed.synchronize()
        torch.testing.assert_close(torch.cat(list(packed)), m1(x), **TOL)
        out = rp2.forward(input_args=(packed,))
        torch.testing.assert_close(out, m2(m1(x)), **TOL)


def test_auto_plan_and_chaining_two_models():
    # "Multi-model co-optimized planning" (run-config document), training through both
    model1, model2 = seq(4, seed=1), seq(3, seed=2)
    ref1, ref2 = copy.deepcopy(model1), copy.deepcopy(model2)
    model1, model2 = RoundPipe(model1, devices=DEV), RoundPipe(model2, devices=DEV)
    data1, labels = torch.randn(6, D), torch.randn(6, D)

    def loss_fn(outputs, labels):
        return ((outputs - labels) ** 2).sum()

    plan1, plan2 = ModelExecutePlan.auto("fused", model1, model2)
    output1 = model1.forward(
        input_args=(data1,),
        run_config=RoundPipeRunConfig(execute_plan=plan1, merge_output=False),
    )
    loss = model2.forward_backward(
        input_args=(output1,),
        label=labels,
        loss_fn=loss_fn,
        run_config=RoundPipeRunConfig(execute_plan=plan2),
    )
    ref_loss = loss_fn(ref2(ref1(data1)), labels)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach(), **TOL)
    assert_grads(model1.module, ref1)
    assert_grads(model2.module, ref2)
    # once both have run, auto plans them together from their layers
    p1, p2 = ModelExecutePlan.auto("fused", model1, model2)
    p1.validate(4, "fused")
    p2.validate(3, "fused")


# -- roundpipe-execution-plans.txt ----------------------------------------------------------
def test_forward_plan_four_layers():
    plan = ModelExecutePlan()
    # Execution plan when using forward()
    plan.fwd_plan = [range(0, 2), range(2, 4)]  # Forward: 2 stages, 2 layers each
    plan.bwd_plan = [range(3, 4), range(2, 3),  # Backward: 4 stages, 1 layer each
                     range(1, 2), range(0, 1)]
    model = seq(4)
    ref = copy.deepcopy(model)
    rp = RoundPipe(model, devices=DEV)
    x = torch.randn(6, D)
    out = rp.forward(input_args=(x,), run_config=RoundPipeRunConfig(execute_plan=plan))
    assert rp.num_layers == 4    # an nn.Sequential: one layer per child, as RoundPipe
    ref_out = ref(x)
    torch.testing.assert_close(out, ref_out, **TOL)
    out.pow(2).sum().backward()
    ref_out.pow(2).sum().backward()
    assert_grads(model, ref)


def test_forward_backward_plan_four_layers():
    # Execution plan when using forward_backward()
    plan = ModelExecutePlan()
    plan.fwd_plan = [range(0, 3)]              # Forward covers only the first 3 layers
    plan.bwd_plan = [range(3, 4), range(2, 3), # First backward stage starts at layer 4
                     range(1, 2), range(0, 1)]
    model = seq(4)
    ref = copy.deepcopy(model)
    rp = RoundPipe(model, devices=DEV)
    x, y = torch.randn(6, D), torch.randn(6, D)
    loss, out = rp.forward_backward(input_args=(x,), label=y, loss_fn=mse_sum,
                                    return_outputs=True,
                                    run_config=RoundPipeRunConfig(execute_plan=plan))
    ref_out = ref(x)
    ref_loss = mse_sum(ref_out, y)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach(), **TOL)
    torch.testing.assert_close(out, ref_out.detach(), **TOL)
    assert_grads(model, ref)


def test_auto_tuning_single_model():
    model = seq(4)
    ref = copy.deepcopy(model)
    model = RoundPipe(model, devices=DEV)
    data, labels = torch.randn(6, D), torch.randn(6, D)

    def loss_fn(outputs, labels):   # a full-batch mean: divide by the microbatch count
        return ((outputs - labels) ** 2).mean() / 3

    # Auto-generate the plan (before any run: made on the first call)
    plan = ModelExecutePlan.auto("fused", model)
    # Use the generated plan
    loss = model.forward_backward(
        input_args=(data,),
        label=labels,
        loss_fn=loss_fn,
        run_config=RoundPipeRunConfig(execute_plan=plan),
    )
    plan.validate(4, "fused")   # filled in on the first call
    ref_loss = ((ref(data) - labels) ** 2).mean()
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach(), **TOL)
    assert_grads(model.module, ref)


def test_manual_plan_24_layers_and_lm_head():
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(D, D), nn.Tanh()) for _ in range(24)] + [nn.Linear(D, 5)]
    model = nn.Sequential(*layers)
    ref = copy.deepcopy(model)
    plan = ModelExecutePlan()
    plan.fwd_plan = [
        range(0, 7),    # layers 0-6: 7×2 = 14 ms
        range(7, 14),   # layers 7-13: 7×2 = 14 ms
        range(14, 21),  # layers 14-20: 7×2 = 14 ms
        range(21, 24),  # layers 21-24: 3×2 + 6 = 12 ms (includes lm_head)
    ]
    plan.bwd_plan = [
        range(24, 25),  # lm_head backward
        range(22, 24),
        range(20, 22),
        # ... (the document elides the rest)
        *[range(i, i + 2) for i in range(18, -1, -2)],
    ]
    rp = RoundPipe(model, devices=DEV)
    x, y = torch.randn(4, D), torch.randint(0, 5, (4,))

    def loss_fn(out, y):
        return nn.functional.cross_entropy(out, y, reduction="sum")

    loss = rp.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn,
                               run_config=RoundPipeRunConfig(execute_plan=plan, num_microbatch=2))
    ref_loss = loss_fn(ref(x), y)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach(), **TOL)
    assert_grads(model, ref)


def test_verbose_timer(capsys):
    from fxpipe.roundpipe.timer import ModelTimer
    ModelTimer.VERBOSE = True
    try:
        rp = RoundPipe(seq(2), devices=DEV)
        rp.forward_backward(input_args=(torch.randn(6, D),), label=torch.randn(6, D),
                            loss_fn=mse_sum)
    finally:
        ModelTimer.VERBOSE = False
    assert capsys.readouterr().err.strip()   # per-layer timings printed to stderr


@pytest.mark.parametrize("plan,message", [
    (ModelExecutePlan([range(0, 2)], [range(3, 4), range(2, 3), range(1, 2), range(0, 1)]),
     "layer 2 not covered"),
    (ModelExecutePlan([range(0, 3)], [range(3, 4), range(1, 2), range(2, 3), range(0, 1)]),
     "descending"),
    (ModelExecutePlan([range(0, 4)], [range(3, 4), range(2, 3), range(1, 2), range(0, 1)]),
     "fwd_plan"),
])
def test_validation_rules(plan, message):
    rp = RoundPipe(seq(4), devices=DEV)
    with pytest.raises(ValueError, match=message):
        rp.forward_backward(input_args=(torch.randn(6, D),), label=torch.randn(6, D),
                            loss_fn=mse_sum, run_config=RoundPipeRunConfig(execute_plan=plan))


# -- roundpipe-api-facts.md -----------------------------------------------------------------------
def test_forward_forms_and_eval():
    model = seq(3)
    rp = RoundPipe(model, model_run_config=RoundPipeRunConfig(num_microbatch=2), devices=DEV)
    x = torch.randn(6, D)
    with torch.no_grad():
        a = rp.forward(x, roundpipe_run_config=RoundPipeRunConfig(num_microbatch=3))
        b = rp.forward(input_args=(x,), run_config=RoundPipeRunConfig(num_microbatch=3))
        rp.eval()
        c = rp(x)
        torch.testing.assert_close(a, model(x), **TOL)
        torch.testing.assert_close(b, model(x), **TOL)
        torch.testing.assert_close(c, model(x), **TOL)


def test_forward_backward_sums_microbatch_losses_once_each():
    model = seq(3)
    ref = copy.deepcopy(model)
    rp = RoundPipe(model, devices=DEV)
    x, y = torch.randn(6, D), torch.randn(6, D)
    calls = []

    def loss_fn(out, label):   # a per-microbatch mean: the result is their sum
        calls.append(out.shape[0])
        return ((out - label) ** 2).mean()

    loss = rp.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn,
                               run_config=RoundPipeRunConfig(num_microbatch=3))
    assert sorted(calls) == [2, 2, 2]
    ref_loss = sum(((ref(xm) - ym) ** 2).mean() for xm, ym in zip(x.chunk(3), y.chunk(3)))
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach(), **TOL)
    assert_grads(model, ref)
    with torch.no_grad(), pytest.raises(AssertionError, match="requires grad enabled"):
        rp.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)


def test_loss_fn_returning_a_sequence():
    model = seq(3)
    ref = copy.deepcopy(model)
    rp = RoundPipe(model, devices=DEV)
    x, y = torch.randn(6, D), torch.randn(6, D)

    def loss_fn(out, label):
        return ((out - label) ** 2).sum(), out.abs().sum()

    a, b = rp.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
    ra, rb = loss_fn(ref(x), y)
    (ra + rb).backward()
    torch.testing.assert_close(a, ra.detach(), **TOL)
    torch.testing.assert_close(b, rb.detach(), **TOL)
    assert_grads(model, ref)


@pytest.mark.parametrize("is_async", [True, False])
def test_step_and_synchronize(is_async):
    model = seq(3)
    ref = copy.deepcopy(model)
    rp = RoundPipe(model, devices=DEV)
    opt = torch.optim.SGD(rp.optim_parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)

    def step_fn():
        torch.nn.utils.clip_grad_norm_(rp.parameters(), 1.0)
        opt.step()
        opt.zero_grad()

    for i in range(3):
        x, y = torch.randn(6, D), torch.randn(6, D)
        rp.forward_backward(input_args=(x,), label=y, loss_fn=mse_sum)
        rp.step(step_fn, is_async=is_async)
        mse_sum(ref(x), y).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        ref_opt.step()
        ref_opt.zero_grad()
    rp.synchronize()
    for p, r in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, r, **TOL)
    rp.close()


def test_optim_dtype_masters():
    """bf16 weights with fp32 optimizer copies: the step updates the masters, the weights
    get them rounded (RoundPipe's optim_dtype)."""
    model = seq(3).to(torch.bfloat16)
    rp = RoundPipe(model, optim_dtype=torch.float32, devices=DEV)
    masters = list(rp.optim_parameters())
    assert all(m.dtype == torch.float32 for m in masters)
    before = [m.detach().clone() for m in masters]
    opt = torch.optim.SGD(masters, lr=0.1)
    x, y = torch.randn(6, D, dtype=torch.bfloat16), torch.randn(6, D, dtype=torch.bfloat16)
    rp.forward_backward(input_args=(x,), label=y,
                        loss_fn=lambda o, lab: mse_sum(o.float(), lab.float()))
    grads = [p.grad.float().clone() for p in model.parameters()]
    rp.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)
    rp.synchronize()
    for p, m, b, g in zip(model.parameters(), masters, before, grads):
        torch.testing.assert_close(m, b - 0.1 * g)
        assert torch.equal(p, m.to(torch.bfloat16))


def test_a_bf16_hugging_face_model_with_fp32_masters():
    """RoundPipe's own mixed precision on an HF Llama: the model in bf16 (``.to()``, as
    RoundPipe users convert it), fp32 optimizer copies (``optim_dtype``); three AdamW
    steps equal the same steps eagerly on the bf16 model with fp32 masters."""
    T = pytest.importorskip("transformers")
    from tests import hf_zoo
    kw = hf_zoo.text()
    model = hf_zoo.setup("llama")[0].to(torch.bfloat16)
    ref = copy.deepcopy(model)
    rp = RoundPipe(model, optim_dtype=torch.float32, devices=DEV,
                   model_run_config=RoundPipeRunConfig(num_microbatch=1))
    opt = torch.optim.AdamW(rp.optim_parameters(), lr=1e-2)
    masters = [p.detach().float().requires_grad_() for p in ref.parameters()]
    ref_opt = torch.optim.AdamW(masters, lr=1e-2)
    assert isinstance(ref, T.LlamaForCausalLM)
    for _ in range(3):
        loss = rp.forward_backward(input_kwargs=kw, loss_fn=lambda out, _: out.loss)
        rp.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)
        ref_loss = ref(**kw).loss
        ref_loss.backward()
        for m, p in zip(masters, ref.parameters()):
            m.grad = p.grad.float()
            p.grad = None
        ref_opt.step()
        with torch.no_grad():
            for m, p in zip(masters, ref.parameters()):
                p.copy_(m)
        assert loss.dtype == torch.float32   # the loss of a bf16 model, returned in fp32
        torch.testing.assert_close(loss, ref_loss.detach().float(), atol=0, rtol=2e-2)
    rp.synchronize()
    assert all(m.dtype == torch.float32 for m in rp.optim_parameters())
    for p, r in zip(model.parameters(), ref.parameters()):
        assert p.dtype == torch.bfloat16
        torch.testing.assert_close(p.float(), r.float(), atol=2e-2, rtol=0)
    rp.close()


def test_wrap_model_to_roundpipe_keeps_attributes():
    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.vocab_size = 11
            self.config = {"hidden": D}
            self.layers = seq(3)
            self.head = nn.Linear(D, 11)

        def forward(self, x):
            return self.head(self.layers(x))

    model = LM()
    rp = wrap_model_to_roundpipe(model, use_sequential_preset=False,
                                 model_run_config=RoundPipeRunConfig(num_microbatch=2),
                                 devices=DEV)
    assert rp.vocab_size == 11 and rp.config == {"hidden": D}
    x = torch.randn(4, D)
    with torch.no_grad():
        torch.testing.assert_close(rp(x), model(x), **TOL)
    assert list(rp.state_dict()) == list(model.state_dict())


def test_unsupported_raise_naming_the_option():
    with pytest.raises(NotImplementedError, match="skip_modules"):
        wrap_model_to_roundpipe(seq(2), skip_modules=[nn.Linear])
    with pytest.raises(NotImplementedError, match="override_config"):
        wrap_model_to_roundpipe(seq(2), override_config={"0": RoundPipeRunConfig()})
    for fn, name in ((GradScaler, "GradScaler"), (OptimizerCtx, "OptimizerCtx"),
                     (save_for_recompute, "save_for_recompute"),
                     (get_recompute_data, "get_recompute_data"),
                     (doing_recompute, "doing_recompute")):
        with pytest.raises(NotImplementedError, match=name):
            fn()
    with pytest.raises(ValueError, match="pin_model"):
        RoundPipe(seq(2), pin_model="pinned")


def test_auto_plan_at_model_level():
    model = seq(4)
    ref = copy.deepcopy(model)
    rp = RoundPipe(model, devices=DEV)
    rp.model_run_config = RoundPipeRunConfig(execute_plan=ModelExecutePlan.auto("fused", rp))
    x, y = torch.randn(6, D), torch.randn(6, D)
    loss = rp.forward_backward(input_args=(x,), label=y, loss_fn=mse_sum)
    rp.pipe.config.execute_plan.validate(4, "fused")
    ref_loss = mse_sum(ref(x), y)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach(), **TOL)
    assert_grads(model, ref)
