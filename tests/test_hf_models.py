"""Hugging Face models beyond the precision matrix (``test_hf_matrix.py``, over every
architecture of ``hf_zoo``): encoder-decoders cut between encoder blocks, peft LoRA
adapters on a frozen base (only the adapters' gradients exist and travel), and what still
cannot be captured, which raises a ``CaptureError`` naming the line, the layer and what to
do (README, Limitations). fp32: loss and every gradient equal eager."""

from __future__ import annotations

import copy

import pytest
import torch

import fxpipe
from tests import hf_zoo
from tests.models import init_like_training

T = pytest.importorskip("transformers")
from tests.hf_zoo import DENSE, MOE, V, _gen, text  # noqa: E402


def setup(name: str):
    model, kw, _, _ = hf_zoo.setup(name)
    return model, copy.deepcopy(model), kw


def assert_step_equals_eager(name, pipe, model, ref, kw, label=None, loss_fn=None):
    loss_fn = loss_fn or (lambda out, _: out.loss)
    loss, out = pipe.forward_backward((), kw, label=label, loss_fn=loss_fn, return_outputs=True)
    ref_loss = loss_fn(ref(**kw), label)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach(), atol=1e-5, rtol=1e-5, msg=f"{name}: loss")
    refs = dict(ref.named_parameters())
    for pname, p in model.named_parameters():
        r = refs[pname]
        assert (p.grad is None) == (r.grad is None), f"{name}: .grad presence of {pname}"
        if p.grad is not None:
            torch.testing.assert_close(p.grad, r.grad, atol=1e-5, rtol=1e-5, msg=f"{name}: {pname}")
    return out


@pytest.mark.parametrize("name", ["t5", "whisper"])
def test_encoder_blocks_in_different_stages(name):
    """Plans cut anywhere in the chain: here between the two encoder blocks."""
    model, ref, kw = setup(name)
    names = ["prefix", "encoder.0", "encoder.1", "decoder.0", "decoder.1", "suffix"]
    plan = fxpipe.ExecutePlan([range(0, 2), range(2, 4)], [range(4, 6), range(2, 4), range(0, 2)])
    pipe = fxpipe.compile(model, example_kwargs=kw, devices=[fxpipe.VirtualDevice() for _ in range(2)],
                          plan=plan, config=fxpipe.RunConfig(num_microbatch=2))
    layers = pipe.layers
    short = [layer.name.replace("model.", "").replace(".block", "").replace(".layers", "")
             for layer in layers]
    assert short == names
    stage_of = {i: s for s, r in enumerate(pipe.plan.fwd_plan) for i in r}
    assert stage_of[1] != stage_of[2]  # encoder block 0 and 1 in different forward stages
    carried = set(layers.boundary(2))  # the encoder output reaches every decoder layer
    assert any(v in layers[3].inputs and v in layers[4].inputs for v in carried)
    assert_step_equals_eager(name, pipe, model, ref, kw)


def test_wav2vec2_with_labels_says_which_line_and_what_to_do():
    model, _, kw = setup("wav2vec2")
    kw["labels"] = torch.randint(1, V, (4, 5), generator=_gen(4))
    with pytest.raises(fxpipe.CaptureError) as info:
        fxpipe.compile(model, example_kwargs=kw)
    msg = str(info.value)
    assert ("blocks: OutsideBlocksError: the model's own forward, outside its blocks, in the "
            "prefix layer, before block wav2vec2.encoder.layers.0, at modeling_wav2vec2.py") in msg
    assert "`if labels is not None and labels.max() >= self.config.vocab_size:`" in msg
    assert "compute the loss in loss_fn rather than passing labels=" in msg


def test_reformer_says_its_reversible_layers_cannot_be_split():
    cfg = T.ReformerConfig(vocab_size=V, hidden_size=32, num_attention_heads=2,
                           attention_head_size=16, attn_layers=["local", "lsh"],
                           axial_pos_embds=False, max_position_embeddings=64, feed_forward_size=64,
                           is_decoder=True, local_attn_chunk_length=4, lsh_attn_chunk_length=4,
                           num_buckets=2, num_hashes=1, use_cache=False, pad_token_id=0,
                           eos_token_id=2, hidden_dropout_prob=0.0,
                           local_attention_probs_dropout_prob=0.0,
                           lsh_attention_probs_dropout_prob=0.0)
    model = T.ReformerModelWithLMHead(cfg).train()  # Reformer trains in train mode only
    with pytest.raises(fxpipe.CaptureError,
                       match=r"blocks: RuntimeError: block reformer.encoder.layers.0 returns no "
                             r"gradient .* custom autograd.Function"):
        fxpipe.compile(model, example_kwargs=text())


peft = pytest.importorskip("peft")


def lora_model(name: str):
    torch.manual_seed(0)
    base = T.LlamaForCausalLM(T.LlamaConfig(**DENSE)) if name == "llama" else \
        T.MixtralForCausalLM(T.MixtralConfig(**MOE, num_local_experts=4))
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                           init_lora_weights=False, lora_dropout=0.0)
    return peft.get_peft_model(init_like_training(base), lora).eval()


@pytest.mark.parametrize("name", ["llama", "mixtral"])
def test_peft_lora_adapters_train_and_base_weights_stay_frozen(name, monkeypatch):
    """Only the adapters' gradients exist and travel: on the devices only adapters are
    leaves that require grad (so only they get gradient buffers), only their gradient
    bytes come back, the base weights' .grad stay None, and an optimizer over every
    parameter keeps state for the adapters alone; gradients and steps equal eager."""
    from fxpipe.runtime.host.param_store import ParamStore
    model = lora_model(name)
    ref = copy.deepcopy(model)
    kw = text()
    leaves: set[str] = set()   # parameters the runtime made leaves that require grad
    upload = ParamStore.upload

    def recording_upload(self, *args, **kwargs):
        out = upload(self, *args, **kwargs)
        leaves.update(f for f, t in out.items() if t.requires_grad)
        return out
    monkeypatch.setattr(ParamStore, "upload", recording_upload)
    pipe = fxpipe.compile(model, example_kwargs=kw, devices=[fxpipe.VirtualDevice() for _ in range(2)],
                          config=fxpipe.RunConfig(num_microbatch=2))
    adapters = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert adapters and all("lora_" in n for n in adapters)
    adapter_bytes = sum(p.numel() * p.element_size() for p in adapters.values())
    assert adapter_bytes * 10 < sum(p.numel() * p.element_size() for p in model.parameters())

    assert_step_equals_eager(name, pipe, model, ref, kw)
    assert all(p.grad is not None for p in adapters.values())
    assert all(p.grad is None for n, p in model.named_parameters() if n not in adapters)
    assert leaves == set(adapters)
    assert pipe.stats()["d2h_bytes_grads"] == adapter_bytes

    model.zero_grad(set_to_none=True)
    ref.zero_grad(set_to_none=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)      # frozen weights included
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    for _ in range(2):
        loss = pipe.forward_backward((), kw, loss_fn=lambda out, _: out.loss, optimizer=opt)
        assert pipe.stats()["d2h_bytes_grads"] == adapter_bytes
        ref_loss = ref(**kw).loss
        ref_loss.backward()
        ref_opt.step()
        torch.testing.assert_close(loss, ref_loss.detach(), atol=1e-5, rtol=1e-5)
        opt.zero_grad(set_to_none=True)
        ref_opt.zero_grad(set_to_none=True)
    assert {id(p) for p in opt.state} == {id(p) for p in adapters.values()}
    assert all(int(s["step"]) == 2 for s in opt.state.values())
    refs = dict(ref.named_parameters())
    for n, p in model.named_parameters():
        torch.testing.assert_close(p, refs[n], atol=1e-5, rtol=1e-4, msg=n)
    pipe.close()


def test_stage_code_on_a_gpu_names_the_gpu_not_the_capture_host():
    """A graph captured on the host pins the host in its constants (``arange(device=cpu)``,
    ``_assert_tensor_metadata(device=cpu)`` before the rotary tables): the code a stage
    runs on another device names that device instead (on an H200, every HF model failed
    with "Tensor device mismatch! Expected: cpu, Got: cuda:0" without this)."""
    from fxpipe.runtime.stages.stage_code import runnable
    model, _, kw = setup("llama")
    pipe = fxpipe.compile(model, example_kwargs=kw, devices=["cpu"], param_dtype=torch.bfloat16)
    exe = pipe._executable("fused")

    def code(device=None):   # the stage code and the bodies it calls (autocast regions)
        return "\n".join(m.code for st in exe.graph_modules()
                         for m in runnable(st, device=device).modules()
                         if isinstance(m, torch.fx.GraphModule))
    on_host = code()
    assert "device(type='cpu')" in on_host
    gpu = torch.device("meta")      # any device but the host: this machine has no GPU
    moved = code(gpu)
    assert "device(type='cpu')" not in moved
    assert moved.count("device(type='meta')") == on_host.count("device(type='cpu')")
    assert code() == on_host        # the host's code is untouched
    assert runnable(exe.graph_modules()[0], device=torch.device("cpu")) is \
        runnable(exe.graph_modules()[0])
