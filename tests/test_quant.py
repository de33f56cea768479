"""Quantized frozen weights (``frozen_dtype=``, ``fxpipe.quant``; issue 57).

- the formats: bytes per weight (scales included), error bounds, NF4 codes and scales
  bitwise bitsandbytes' own where it is installed;
- a peft LoRA step on HF Llama and Qwen3 with an NF4 / int8 / fp8 base equals eager on
  the model whose weights were dequantized once on the host: losses and adapter
  gradients in fp32 and under ``param_dtype=torch.bfloat16``; only the quantized bytes
  are held on the host and uploaded (``h2d_bytes_params``); the stage code dequantizes;
- on strict cuda-sim devices under a memory limit, the peak reserved stays under it and
  the prediction covers it;
- ``weights=``: a checkpoint's frozen weights quantized as read;
- models users bring quantized: bitsandbytes NF4 adopted byte for byte; torchao refused
  with the route that works; bad ``frozen_dtype`` values refused.
"""

from __future__ import annotations

import copy
import dataclasses
import re

import pytest
import torch
import torch.nn as nn

import fxpipe
from fxpipe import quant

T = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
from tests import hf_zoo  # noqa: E402
from tests.models import init_like_training  # noqa: E402
from tests.test_gpu_semantics import cuda_devices  # noqa: E402

SHAPE = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
             use_cache=False, tie_word_embeddings=False)


def base(name: str) -> nn.Module:
    torch.manual_seed(0)
    if name == "llama":
        return init_like_training(T.LlamaForCausalLM(T.LlamaConfig(**SHAPE)))
    return init_like_training(T.Qwen3ForCausalLM(T.Qwen3Config(**SHAPE, head_dim=16)))


def lora(model: nn.Module) -> nn.Module:
    return peft.get_peft_model(model, peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
        init_lora_weights=False, lora_dropout=0.0)).eval()


def batch() -> dict:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (4, 16), generator=g)
    labels = ids.clone()
    labels[:, :5] = -100    # a masked prompt
    return {"input_ids": ids, "labels": labels}


def compiled(model, devices=None, **kw):
    return fxpipe.compile(model, example_kwargs=batch(),
                          devices=devices or [fxpipe.VirtualDevice() for _ in range(2)],
                          config=fxpipe.RunConfig(num_microbatch=2), **kw)


def own_loss(out, _):
    return out.loss


# -- the formats ---------------------------------------------------------------------

@pytest.mark.parametrize("fmt, per_weight, worst", [("nf4", 0.5625, 0.6), ("int8", 1.0625, 0.01),
                                                    ("fp8", 1.0625, 0.07)])
def test_a_format_holds_its_bytes_and_error(fmt, per_weight, worst):
    w = torch.randn(256, 192, generator=torch.Generator().manual_seed(0))
    blob = quant.quantize(w, fmt)
    assert blob.dtype == torch.uint8 and blob.numel() / w.numel() == per_weight
    assert per_weight <= {"nf4": 0.6, "int8": 1.1, "fp8": 1.1}[fmt]   # the bounds
    back = quant.dequantize(blob, fmt, [256, 192], torch.float32)
    # each element within its block's absmax times the format's step
    absmax = w.view(-1, 64).abs().amax(1, keepdim=True)
    assert ((back - w).view(-1, 64).abs() <= worst * absmax).all()
    # one rounding to the output dtype: bf16 is the fp32 result rounded
    assert torch.equal(quant.dequantize(blob, fmt, [256, 192], torch.bfloat16), back.bfloat16())
    zero = quant.quantize(torch.zeros(64), fmt)   # an all-zero block: scale 0 or 1, codes 0
    assert torch.equal(quant.dequantize(zero, fmt, [64], torch.float32), torch.zeros(64))


def test_nf4_is_bitsandbytes_layout():
    bnbf = pytest.importorskip("bitsandbytes.functional")
    w = torch.randn(128, 64, generator=torch.Generator().manual_seed(0))
    codes, state = bnbf.quantize_4bit(w, quant_type="nf4", blocksize=64)
    blob = quant.quantize(w, "nf4")
    assert torch.equal(blob[:w.numel() // 2], codes.view(-1))
    assert torch.equal(blob[w.numel() // 2:].view(torch.float32), state.absmax)
    assert state.code.tolist() == list(quant.NF4_LEVELS)
    assert torch.equal(quant.dequantize(blob, "nf4", [128, 64], torch.float32),
                       bnbf.dequantize_4bit(codes, state))


def test_quantize_frozen_leaves_the_head_trainable_tied_and_odd_weights():
    model = lora(base("llama"))
    names = quant.quantize_frozen(model, "nf4")
    assert len(names) == 14   # 7 linears per block, 2 blocks; the head, embeddings, adapters kept
    assert not any("lm_head" in n or "lora_" in n for n in names)
    head = model.get_output_embeddings()
    assert isinstance(head.weight, nn.Parameter) and head.weight.dtype == torch.float32
    q = model.base_model.model.model.layers[0].self_attn.q_proj.base_layer
    assert "weight" not in q._parameters and q.weight_nf4.dtype == torch.uint8
    assert isinstance(q, nn.Linear) and "weight=nf4" in repr(q)
    assert q.weight.shape == (64, 64) and q.weight.dtype == torch.float32   # eager still works
    assert quant.quantize_frozen(model, "nf4") == []   # once
    with pytest.raises(ValueError, match="already quantized to nf4"):
        quant.quantize_frozen(model, "int8")
    odd = nn.Sequential(nn.Linear(10, 10)).requires_grad_(False)   # 100 elements: not in blocks
    assert quant.quantize_frozen(odd, "nf4") == []


# -- a step equals eager on the dequantized model -------------------------------------

def assert_adapters_equal(model, ref, atol, rtol):
    refs = dict(ref.named_parameters())
    grads = [(n, p) for n, p in model.named_parameters() if p.grad is not None]
    assert grads and all("lora_" in n for n, _ in grads)
    for n, p in grads:
        torch.testing.assert_close(p.grad, refs[n].grad, atol=atol, rtol=rtol, msg=n)


@pytest.mark.parametrize("name, fmt", [("llama", "nf4"), ("qwen3", "nf4"), ("llama", "int8"),
                                       ("llama", "fp8")])
def test_a_lora_step_equals_eager_on_the_dequantized_base_fp32(name, fmt):
    model = lora(base(name))
    plain = compiled(copy.deepcopy(model))
    pipe = compiled(model, frozen_dtype=fmt)
    ref = quant.dequantized_copy(model)
    assert quant.quantized_bytes(model)[0] > 0
    code = pipe.code("fused")
    assert re.search(rf"torch\.ops\.fxpipe\.dequantize\.default\(\w+_weight_{fmt}, '{fmt}', "
                     r"\[64, 64\], torch\.float32\)", code)
    loss = pipe.forward_backward((), batch(), loss_fn=own_loss)
    expected = ref(**batch()).loss
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), atol=1e-5, rtol=1e-5)
    assert_adapters_equal(model, ref, atol=1e-5, rtol=1e-5)
    # only the quantized bytes went up: the blocks' linears at 0.5625 / 1.0625 per weight
    plain.forward_backward((), batch(), loss_fn=own_loss)
    held, orig = quant.quantized_bytes(model)
    assert pipe.stats()["h2d_bytes_params"] == plain.stats()["h2d_bytes_params"] - 2 * (orig - held)



def test_compiled_stage_code_runs_the_dequantize():
    """``stage_backend="inductor"``: the dequantize stays an op of the compiled stage code
    (opaque to inductor), the step equal to eager within inductor's reassociation."""
    model = lora(base("llama"))
    pipe = fxpipe.compile(model, example_kwargs=batch(),
                          devices=[fxpipe.VirtualDevice() for _ in range(2)],
                          config=fxpipe.RunConfig(num_microbatch=2, stage_backend="inductor"),
                          frozen_dtype="nf4")
    ref = quant.dequantized_copy(model)
    loss = pipe.forward_backward((), batch(), loss_fn=own_loss)
    assert pipe.stats()["stage_compiles"] > 0
    expected = ref(**batch()).loss
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), atol=1e-5, rtol=1e-5)
    assert_adapters_equal(model, ref, atol=1e-5, rtol=1e-4)

@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_a_lora_step_equals_eager_on_the_dequantized_base_bf16(name):
    """``param_dtype=torch.bfloat16``: the devices dequantize to bf16, the adapters
    compute in bf16 from their fp32 masters; the reference is the dequantized model as
    ``from_pretrained(..., dtype=torch.bfloat16)`` holds it (``hf_zoo.Eager``)."""
    model = lora(base(name))
    pipe = compiled(model, frozen_dtype="nf4", param_dtype=torch.bfloat16)
    assert "'nf4', [64, 64], torch.bfloat16)" in pipe.code("fused")
    ref = hf_zoo.Eager(quant.dequantized_copy(model), "param_dtype")
    adapters = [n for n, p in model.named_parameters() if p.requires_grad]
    assert all(p.dtype == torch.float32 for p in model.parameters() if p.requires_grad)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ref_opt = torch.optim.AdamW([p for p in ref.master.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(2):
        loss = pipe.forward_backward((), batch(), loss_fn=own_loss, optimizer=opt)
        ref_loss = ref.step(batch(), None, own_loss)
        torch.testing.assert_close(loss, ref_loss, rtol=3e-2, atol=0)
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
    refs = dict(ref.master.named_parameters())
    moved = torch.cat([p.detach().flatten() for n, p in model.named_parameters() if n in adapters])
    ref_moved = torch.cat([refs[n].detach().flatten() for n in adapters])
    assert torch.nn.functional.cosine_similarity(moved, ref_moved, dim=0) > 0.999


def test_the_simulator_and_the_planner_price_the_dequantizes():
    """Each block's cost carries its dequantizes' device memory traffic (``TRAFFIC`` per
    weight plus the fp32 output here), which ``fxpipe.simulate`` adds to the forward and
    recompute at ``Hardware.device_bytes_per_s`` and the planner at its nominal device's."""
    from fxpipe.passes.chain_costs import NOMINAL_DEVICE, chain_costs
    from fxpipe.sim import Hardware, LayerCost
    pipe = compiled(lora(base("llama")), frozen_dtype="nf4")
    costs = [layer.cost for layer in pipe.layers]
    per_block = 36864 * (quant.TRAFFIC["nf4"] + 4)   # 7 linears: 36,864 weights
    assert [c.dequant_bytes for c in costs] == [0, per_block, per_block, 0]
    hw = Hardware(flops=1e12)
    slow = Hardware(flops=1e12, device_bytes_per_s=1e9)
    free, priced = LayerCost.of(costs[1], hw), LayerCost.of(costs[1], slow)
    assert priced.fwd_ms - free.fwd_ms == pytest.approx(per_block / 1e9 * 1e3)
    assert priced.recompute == priced.fwd_ms and priced.bwd_ms == free.bwd_ms
    fwd = chain_costs([costs], NOMINAL_DEVICE)[0].fwd_ms
    plain = chain_costs([[dataclasses.replace(c, dequant_bytes=0) for c in costs]], NOMINAL_DEVICE)[0]
    assert fwd[1] - plain.fwd_ms[1] == pytest.approx(per_block / NOMINAL_DEVICE.bytes_per_s * 1e3)
    t_free = fxpipe.simulate(pipe, hw, num_microbatch=2).makespan
    assert fxpipe.simulate(pipe, slow, num_microbatch=2).makespan > t_free

def test_strict_cuda_sim_under_a_memory_limit():
    """Strict cuda-sim devices of 384 KiB: the NF4 base streams through them, equal to
    eager, each device's peak reserved under the limit and what it allocated under the
    planner's prediction (which counts the dequantized weights a recompute saves)."""
    model = lora(base("llama"))
    quant.quantize_frozen(model, "nf4")
    ref = quant.dequantized_copy(model)
    limit = 384 * 2**10
    devs = cuda_devices(2, memory_limit=limit, strict=True)
    pipe = compiled(model, devices=devs, param_dtype=torch.bfloat16)
    predicted = fxpipe.plan.predict_memory(pipe, run_type="fused", loss_fn=own_loss)
    loss = pipe.forward_backward((), batch(), loss_fn=own_loss)
    ref = hf_zoo.Eager(ref, "param_dtype")
    torch.testing.assert_close(loss, ref.step(batch(), None, own_loss), rtol=3e-2, atol=0)
    peaks = [d.peak_reserved_bytes() for d in devs]
    assert max(peaks) <= limit, peaks
    assert max(d.peak_bytes() for d in devs) <= predicted.peak
    # the host holds the blobs, not the weights: the prediction's params are what is held
    held, orig = quant.quantized_bytes(model)
    params = sum(p.nbytes for p in model.parameters())
    assert params <= predicted.host["params"] <= params + sum(b.nbytes for b in model.buffers())
    assert len(pipe.plan.fwd_plan) >= 3   # streamed: the devices hold a few layers at a time
    assert orig / held > 3.5


def test_weights_quantized_as_read(tmp_path):
    """A model on ``meta`` bound to a safetensors checkpoint: its frozen linears are
    quantized from the file, tensor by tensor; the step equals eager on the checkpoint's
    weights dequantized."""
    real = base("llama")
    real.save_pretrained(tmp_path)
    with torch.device("meta"):
        shell = lora(T.LlamaForCausalLM(T.LlamaConfig(**SHAPE)))
    pipe = fxpipe.compile(shell, example_kwargs=batch(), devices=[fxpipe.VirtualDevice()],
                          config=fxpipe.RunConfig(num_microbatch=2), weights=tmp_path,
                          frozen_dtype="nf4")
    q = shell.base_model.model.model.layers[1].mlp.up_proj
    assert q.weight_nf4.device.type == "cpu"
    assert torch.equal(q.weight_nf4, quant.quantize(real.model.layers[1].mlp.up_proj.weight, "nf4"))
    ref = quant.dequantized_copy(shell)
    loss = pipe.forward_backward((), batch(), loss_fn=own_loss)
    expected = ref(**batch()).loss
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), atol=1e-5, rtol=1e-5)
    assert_adapters_equal(shell, ref, atol=1e-5, rtol=1e-5)


# -- models as users bring them --------------------------------------------------------

def test_a_bitsandbytes_nf4_model_is_adopted_byte_for_byte(tmp_path):
    pytest.importorskip("bitsandbytes")
    base("llama").save_pretrained(tmp_path)
    bnb_model = T.AutoModelForCausalLM.from_pretrained(
        tmp_path, device_map="cpu", quantization_config=T.BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True))
    model = lora(bnb_model)
    w = model.base_model.model.model.layers[0].mlp.up_proj.weight
    codes = w.data.clone()
    with torch.no_grad():   # bitsandbytes' own forward, in train mode (no dropout): in eval
        # mode, on a CPU with AVX512-BF16, it would repack the weights for its bf16 kernel
        bnb_loss = model.train()(**batch()).loss
    model.eval()
    pipe = compiled(model)
    up = model.base_model.model.model.layers[0].mlp.up_proj
    assert type(up).__module__ == "torch.nn.modules.linear" and "weight=nf4" in repr(up)
    assert torch.equal(up.weight_nf4[:codes.numel()], codes.view(-1))   # the same codes
    ref = quant.dequantized_copy(model)
    loss = pipe.forward_backward((), batch(), loss_fn=own_loss)
    expected = ref(**batch()).loss
    expected.backward()
    torch.testing.assert_close(expected.detach(), bnb_loss, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(loss, expected.detach(), atol=1e-5, rtol=1e-5)
    assert_adapters_equal(model, ref, atol=1e-5, rtol=1e-5)


def test_a_bitsandbytes_model_repacked_for_its_cpu_kernel_is_adopted(tmp_path):
    """bitsandbytes repacks an NF4 weight for its AVX512-BF16 CPU kernel on the first eval
    forward without grad, on CPUs that have it (codes interleaved, absmax rounded to bf16
    and transposed, its dtype bf16): done here by hand, so that the check does not depend
    on this machine's CPU. fxpipe reads the codes back in bitsandbytes' own layout, the
    absmax as bitsandbytes now holds it, and dequantizes to the dtype it recorded before."""
    bnbf = pytest.importorskip("bitsandbytes.functional")
    base("llama").save_pretrained(tmp_path)
    model = lora(T.AutoModelForCausalLM.from_pretrained(
        tmp_path, device_map="cpu", quantization_config=T.BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True)))
    up = model.base_model.model.model.layers[0].mlp.up_proj
    qs = up.weight.quant_state
    codes = up.weight.data.clone()
    absmax = (bnbf.dequantize_blockwise(qs.absmax, qs.state2) + qs.offset).float()
    for m in model.modules():
        if type(m).__name__ == "Linear4bit" and m.__module__.startswith("bitsandbytes"):
            m.weight.data, m.weight.quant_state = bnbf._convert_weight_packed_for_cpu(
                m.weight.data, m.weight.quant_state)
    assert up.weight.quant_state.dtype == torch.bfloat16 and not torch.equal(
        up.weight.data.reshape(-1), codes.reshape(-1))
    pipe = compiled(model)
    blob = up.weight_nf4
    assert torch.equal(blob[:codes.numel()], codes.view(-1))   # bitsandbytes' layout again
    assert torch.equal(blob[codes.numel():].view(torch.float32), absmax.bfloat16().float())
    assert quant.quantized_weight(up).dtype == torch.float32
    ref = quant.dequantized_copy(model)
    loss = pipe.forward_backward((), batch(), loss_fn=own_loss)
    expected = ref(**batch()).loss
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), atol=1e-5, rtol=1e-5)
    assert_adapters_equal(model, ref, atol=1e-5, rtol=1e-5)


def test_a_torchao_model_gets_the_route_that_works(tmp_path):
    torchao_q = pytest.importorskip("torchao.quantization")
    base("llama").save_pretrained(tmp_path)
    model = T.AutoModelForCausalLM.from_pretrained(
        tmp_path, device_map="cpu",
        quantization_config=T.TorchAoConfig(torchao_q.Int8WeightOnlyConfig()))
    with pytest.raises(NotImplementedError, match=r"model\.layers\.0\.self_attn\.q_proj\.weight "
                       r"is a torchao .*frozen_dtype='nf4'"):
        compiled(model)


def test_bad_frozen_dtype_values():
    with pytest.raises(ValueError, match=r"frozen_dtype='nf5' is not a quantized format .*'nf4'"):
        compiled(lora(base("llama")), frozen_dtype="nf5")
    trainable = base("llama")   # nothing frozen: nothing to quantize
    with pytest.raises(ValueError, match="found no frozen nn.Linear weight"):
        compiled(trainable, frozen_dtype="nf4")
