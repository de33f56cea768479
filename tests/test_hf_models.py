"""A matrix of Hugging Face architectures beyond ``test_hf_matrix.py``: mixtures of experts
(including experts that loop over the tokens routed to them, captured at block
granularity), encoder-decoders (both stacks pipelined), vision and speech encoders,
state-space hybrids and others. Each is built from a tiny config in code (nothing is
downloaded), compiled with plain ``fxpipe.compile`` and trained one fused step on 2
virtual devices with the model's own loss and a padded attention mask where it takes one:
loss and every gradient equal eager (fp32). What still cannot be captured raises a
``CaptureError`` naming the line, the layer and what to do (README, Limitations)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import fxpipe
from tests.models import init_like_training

T = pytest.importorskip("transformers")
V = 64
DENSE = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
             use_cache=False)
MOE = dict(DENSE, num_experts_per_tok=2)
T5 = dict(vocab_size=V, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
          num_heads=4, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)
BART = dict(vocab_size=V, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
            max_position_embeddings=64, dropout=0.0, attention_dropout=0.0,
            activation_dropout=0.0, use_cache=False, pad_token_id=1, bos_token_id=0,
            eos_token_id=2, decoder_start_token_id=2)
BERT = dict(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0)
MAMBA = dict(mamba_d_state=4, mamba_d_conv=4, mamba_expand=2, use_mamba_kernels=False)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def text(labels_len: int | None = None) -> dict:
    """Token ids with a padded row, and labels (the ids, or a target sequence)."""
    ids = torch.randint(2, V, (4, 8), generator=_gen(1))
    mask = torch.ones(4, 8, dtype=torch.long)
    mask[1, 6:] = 0
    labels = ids if labels_len is None else torch.randint(2, V, (4, labels_len), generator=_gen(2))
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def images() -> dict:
    g = _gen(3)
    return {"pixel_values": torch.randn(4, 3, 16, 16, generator=g),
            "labels": torch.randint(0, 5, (4,), generator=g)}


def audio() -> dict:
    g = _gen(3)
    mask = torch.ones(4, 400, dtype=torch.long)
    mask[1, 300:] = 0
    return {"input_values": torch.randn(4, 400, generator=g), "attention_mask": mask}


def dbrx():
    cfg = T.DbrxConfig(vocab_size=V, d_model=32, n_heads=4, n_layers=2, max_seq_len=64, use_cache=False,
                       attn_config={"kv_n_heads": 2, "clip_qkv": 8.0},
                       ffn_config={"ffn_hidden_size": 64, "moe_num_experts": 4, "moe_top_k": 2})
    cfg.attn_config.rope_theta = 10000.0  # DbrxAttention reads it; transformers 5 dropped it
    return T.DbrxForCausalLM(cfg)


def whisper():
    return T.WhisperForConditionalGeneration(T.WhisperConfig(
        vocab_size=V, num_mel_bins=8, d_model=32, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
        decoder_ffn_dim=64, max_source_positions=16, max_target_positions=32, use_cache=False,
        dropout=0.0, pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=0))


def whisper_inputs() -> dict:
    g = _gen(3)
    return {"input_features": torch.randn(4, 8, 32, generator=g),
            "labels": torch.randint(3, V, (4, 6), generator=g)}


def wav2vec2():
    return T.Wav2Vec2ForCTC(T.Wav2Vec2Config(
        vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, conv_dim=(16, 16), conv_stride=(4, 4), conv_kernel=(8, 8),
        num_conv_pos_embeddings=4, num_conv_pos_embedding_groups=2, hidden_dropout=0.0,
        attention_dropout=0.0, activation_dropout=0.0, feat_proj_dropout=0.0, final_dropout=0.0,
        layerdrop=0.0, mask_time_prob=0.0, pad_token_id=0, do_stable_layer_norm=True,
        feat_extract_norm="layer"))


# name -> (build the model, its inputs (with the model's own labels=))
MODELS = {
    # mixtures of experts
    "mixtral": (lambda: T.MixtralForCausalLM(T.MixtralConfig(**MOE, num_local_experts=4)), text),
    "mixtral_eager_experts": (lambda: T.MixtralForCausalLM(T.MixtralConfig(
        **MOE, num_local_experts=4, experts_implementation="eager")), text),
    "qwen2_moe": (lambda: T.Qwen2MoeForCausalLM(T.Qwen2MoeConfig(
        **MOE, num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=32)), text),
    "qwen3_moe": (lambda: T.Qwen3MoeForCausalLM(T.Qwen3MoeConfig(
        **MOE, head_dim=8, num_experts=4, moe_intermediate_size=32)), text),
    "deepseek_v3": (lambda: T.DeepseekV3ForCausalLM(T.DeepseekV3Config(
        **{**MOE, "num_key_value_heads": 4}, n_routed_experts=4, moe_intermediate_size=32,
        n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1, kv_lora_rank=16,
        q_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})), text),
    "gpt_oss": (lambda: T.GptOssForCausalLM(T.GptOssConfig(
        **MOE, head_dim=8, num_local_experts=4, sliding_window=4)), text),
    "llama4": (lambda: T.Llama4ForCausalLM(T.Llama4TextConfig(
        **{**MOE, "num_experts_per_tok": 1}, head_dim=8, num_local_experts=4,
        intermediate_size_mlp=64, interleave_moe_layer_step=1)), text),
    "dbrx": (dbrx, text),
    "jetmoe": (lambda: T.JetMoeForCausalLM(T.JetMoeConfig(
        vocab_size=V, hidden_size=32, num_hidden_layers=2, num_key_value_heads=2, kv_channels=8,
        intermediate_size=64, num_local_experts=4, num_experts_per_tok=2,
        max_position_embeddings=64, use_cache=False)), text),
    "olmoe": (lambda: T.OlmoeForCausalLM(T.OlmoeConfig(**MOE, num_experts=4)), text),
    "phimoe": (lambda: T.PhimoeForCausalLM(T.PhimoeConfig(**MOE, num_local_experts=4)), text),
    "switch_transformers": (lambda: T.SwitchTransformersForConditionalGeneration(  # use_cache=True
        T.SwitchTransformersConfig(**T5, num_experts=4, encoder_sparse_step=1,
                                   decoder_sparse_step=1)), lambda: text(6)),
    # encoder-decoders: both stacks are layers of one chain
    "t5": (lambda: T.T5ForConditionalGeneration(T.T5Config(**T5, use_cache=False)), lambda: text(6)),
    "t5_default_cache": (lambda: T.T5ForConditionalGeneration(T.T5Config(**T5)), lambda: text(6)),
    "longt5": (lambda: T.LongT5ForConditionalGeneration(T.LongT5Config(**T5, use_cache=False)),
               lambda: text(6)),
    "bart": (lambda: T.BartForConditionalGeneration(T.BartConfig(**BART)), lambda: text(6)),
    "mbart": (lambda: T.MBartForConditionalGeneration(T.MBartConfig(**BART)), lambda: text(6)),
    "whisper": (whisper, whisper_inputs),
    # vision and speech encoders
    "vit": (lambda: T.ViTForImageClassification(T.ViTConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        image_size=16, patch_size=4, num_labels=5, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0)), images),
    "swin": (lambda: T.SwinForImageClassification(T.SwinConfig(
        image_size=16, patch_size=2, embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=2,
        num_labels=5, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        drop_path_rate=0.0, mlp_ratio=2.0)), images),
    "wav2vec2": (wav2vec2, audio),  # the CTC loss in loss_fn: see the labels= test below
    # state-space models and hybrids
    "mamba": (lambda: T.MambaForCausalLM(T.MambaConfig(
        vocab_size=V, hidden_size=32, state_size=4, num_hidden_layers=2, expand=2, conv_kernel=4,
        use_cache=False, use_mambapy=False)), text),
    "mamba2": (lambda: T.Mamba2ForCausalLM(T.Mamba2Config(
        vocab_size=V, hidden_size=32, state_size=4, num_hidden_layers=2, expand=2, conv_kernel=4,
        num_heads=8, head_dim=8, n_groups=1, chunk_size=4, use_cache=False)), text),
    "jamba": (lambda: T.JambaForCausalLM(T.JambaConfig(
        **DENSE, **MAMBA, num_experts=2, num_experts_per_tok=1, expert_layer_period=2,
        expert_layer_offset=1, attn_layer_period=2, attn_layer_offset=1, mamba_dt_rank=4)), text),
    "zamba": (lambda: T.ZambaForCausalLM(T.ZambaConfig(
        **{**DENSE, "num_hidden_layers": 3, "num_key_value_heads": 4}, **MAMBA,
        attention_hidden_size=64, attention_head_dim=16, mamba_dt_rank=4, n_mamba_heads=2,
        layers_block_type=["linear_attention", "hybrid", "hybrid"])), text),
    "zamba2": (lambda: T.Zamba2ForCausalLM(T.Zamba2Config(
        **{**DENSE, "num_key_value_heads": 4}, mamba_d_state=4, mamba_d_conv=4, mamba_expand=2,
        mamba_headdim=8, mamba_ngroups=1, n_mamba_heads=8, layers_block_type=["mamba", "hybrid"],
        hybrid_layer_ids=[1], use_mem_rope=False, chunk_size=4)), text),
    "qwen3_next": (lambda: T.Qwen3NextForCausalLM(T.Qwen3NextConfig(
        **MOE, head_dim=8, num_experts=4, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, linear_num_value_heads=4, linear_num_key_heads=2,
        linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
        layer_types=["linear_attention", "full_attention"])), text),
    # other decoders and encoders
    "phi": (lambda: T.PhiForCausalLM(T.PhiConfig(**DENSE, resid_pdrop=0.0, embd_pdrop=0.0)), text),
    "falcon": (lambda: T.FalconForCausalLM(T.FalconConfig(
        vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, use_cache=False,
        hidden_dropout=0.0, attention_dropout=0.0)), text),
    "gpt_neox": (lambda: T.GPTNeoXForCausalLM(T.GPTNeoXConfig(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=64, use_cache=False)), text),
    "gptj": (lambda: T.GPTJForCausalLM(T.GPTJConfig(
        vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=64, rotary_dim=4,
        use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)), text),
    "bloom": (lambda: T.BloomForCausalLM(T.BloomConfig(
        vocab_size=V, hidden_size=32, n_layer=2, n_head=4, use_cache=False)), text),
    "gemma3": (lambda: T.Gemma3ForCausalLM(T.Gemma3TextConfig(**DENSE, head_dim=8, sliding_window=4)),
               text),
    "olmo2": (lambda: T.Olmo2ForCausalLM(T.Olmo2Config(**DENSE)), text),
    "albert": (lambda: T.AlbertForMaskedLM(T.AlbertConfig(**BERT, embedding_size=16)), text),
    "roberta": (lambda: T.RobertaForMaskedLM(T.RobertaConfig(**BERT, pad_token_id=1)), text),
    "distilbert": (lambda: T.DistilBertForMaskedLM(T.DistilBertConfig(
        vocab_size=V, dim=32, n_layers=2, n_heads=4, hidden_dim=64, max_position_embeddings=64,
        dropout=0.0, attention_dropout=0.0)), text),
    "deberta_v2": (lambda: T.DebertaV2ForMaskedLM(T.DebertaV2Config(
        **BERT, relative_attention=True, position_buckets=8, pos_att_type=["p2c", "c2p"])), text),
    "modernbert": (lambda: T.ModernBertForMaskedLM(T.ModernBertConfig(
        vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=64, pad_token_id=0,
        global_attn_every_n_layers=2, local_attention=4)), text),
}
# captured at block granularity: their experts loop over the tokens routed to them, or the
# router reassigns a module in forward, which no whole-graph capture can trace
BLOCKWISE = {"mixtral_eager_experts", "dbrx", "switch_transformers"}
ENCODER_DECODERS = {"switch_transformers", "t5", "t5_default_cache", "longt5", "bart", "mbart",
                    "whisper"}


def ctc(out, batch):
    """wav2vec2's own CTC loss, outside the model (its labels= check is not capturable)."""
    log_probs = F.log_softmax(out.logits, -1).transpose(0, 1)
    lengths = torch.full((out.logits.shape[0],), out.logits.shape[1], dtype=torch.long)
    return F.ctc_loss(log_probs, batch["labels"], lengths, batch["label_lengths"], blank=0,
                      zero_infinity=True)


def setup(name: str):
    torch.manual_seed(0)
    build, inputs = MODELS[name]
    model = init_like_training(build()).eval()
    return model, copy.deepcopy(model), inputs()


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


@pytest.mark.parametrize("name", sorted(MODELS))
def test_fused_step_equals_eager(name):
    model, ref, kw = setup(name)
    label, loss_fn = None, None
    if name == "wav2vec2":
        labels = torch.randint(1, V, (4, 5), generator=_gen(4))
        label, loss_fn = {"labels": labels, "label_lengths": torch.tensor([5, 3, 5, 4])}, ctc
    pipe = fxpipe.compile(model, example_kwargs=kw, devices=[fxpipe.VirtualDevice() for _ in range(2)],
                          config=fxpipe.RunConfig(num_microbatch=2))
    assert pipe.layers.capture == ("blocks" if name in BLOCKWISE else "export")
    blocks = [layer.name for layer in pipe.layers if layer.name not in ("prefix", "suffix")]
    assert len(blocks) >= 2, blocks
    if name in ENCODER_DECODERS:  # both stacks: encoder blocks, then decoder blocks
        assert any("encoder" in b for b in blocks) and any("decoder" in b for b in blocks), blocks
    out = assert_step_equals_eager(name, pipe, model, ref, kw, label, loss_fn)
    if name in ("t5_default_cache", "switch_transformers"):  # a cache cannot be merged: None
        assert out.past_key_values is None
    pipe.close()


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
    from fxpipe.runtime.params import ParamStore
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
