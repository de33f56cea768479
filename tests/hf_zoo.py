"""The Hugging Face architectures the tests train, each built from a tiny config in code
(nothing is downloaded), with its example inputs, and the eager references fxpipe is held
to in each precision (docs/optimizer.md#mixed-precision-references).

``MODELS``: name -> (build the model, its inputs with the model's own ``labels=``):
decoders, mixtures of experts (including experts that loop over the tokens routed to
them, captured at block granularity), encoder-decoders (both stacks pipelined), vision and
speech encoders, state-space models and hybrids, masked-LM encoders.

``Eager(model, precision)`` is the reference a pipe compiled from ``model`` is compared
with, written as the eager code a user could run:

- ``"fp32"``: the model as it is.
- ``"param_dtype"`` (``fxpipe.compile(..., param_dtype=torch.bfloat16)``): a copy whose
  floating parameters are bf16 and whose floating buffers have the dtypes
  ``from_pretrained(..., dtype=torch.bfloat16)`` gives them (``bf16_buffer_dtypes``:
  bf16, except those the model's code makes in fp32, like rotary ``inv_freq``) runs
  forward and backward on the inputs with their floating tensors in bf16; its gradients,
  cast to fp32, become the masters' ``.grad``; the optimizer steps the fp32 masters.
- ``"autocast"`` (``torch.autocast("cpu", dtype=torch.bfloat16)`` around the call): eager
  autocast around the model and the loss, the backward outside it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
import transformers as T

from tests.models import init_like_training

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
MODELS.update({
    # decoders
    "llama": (lambda: T.LlamaForCausalLM(T.LlamaConfig(**DENSE)), text),
    "qwen2": (lambda: T.Qwen2ForCausalLM(T.Qwen2Config(**DENSE)), text),
    "qwen3": (lambda: T.Qwen3ForCausalLM(T.Qwen3Config(**DENSE, head_dim=8)), text),
    "mistral": (lambda: T.MistralForCausalLM(T.MistralConfig(**DENSE)), text),
    "gemma2": (lambda: T.Gemma2ForCausalLM(T.Gemma2Config(**DENSE, head_dim=8)), text),
    "gpt2": (lambda: T.GPT2LMHeadModel(T.GPT2Config(
        vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=64, use_cache=False,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)), text),
    "opt": (lambda: T.OPTForCausalLM(T.OPTConfig(
        vocab_size=V, hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64, word_embed_proj_dim=32, use_cache=False, dropout=0.0,
        attention_dropout=0.0, bos_token_id=0, eos_token_id=0, pad_token_id=1)), text),
    # encoders
    "bert": (lambda: T.BertForMaskedLM(T.BertConfig(**BERT)), text),
})


# captured at block granularity: their experts loop over the tokens routed to them, or the
# router reassigns a module in forward, which no whole-graph capture can trace
BLOCKWISE = {"mixtral_eager_experts", "dbrx", "switch_transformers"}
ENCODER_DECODERS = {"switch_transformers", "t5", "t5_default_cache", "longt5", "bart", "mbart",
                    "whisper"}


def build(name: str) -> torch.nn.Module:
    """``name``'s model, untrained (HF's own init)."""
    return MODELS[name][0]()


def ctc(out, batch):
    """wav2vec2's own CTC loss, outside the model (its labels= check is not capturable);
    log-probabilities in fp32, as the model's own loss computes them."""
    log_probs = F.log_softmax(out.logits, -1, dtype=torch.float32).transpose(0, 1)
    lengths = torch.full((out.logits.shape[0],), out.logits.shape[1], dtype=torch.long)
    return F.ctc_loss(log_probs, batch["labels"], lengths, batch["label_lengths"], blank=0,
                      zero_infinity=True)


def own_loss(out, _label):
    return out.loss


def setup(name: str) -> tuple[torch.nn.Module, dict, Any, Callable]:
    """``(model, inputs, label, loss_fn)`` for a step of ``name``: non-trivial weights
    (``init_like_training``), eval mode (no dropout), the model's own loss (wav2vec2: CTC
    in ``loss_fn``)."""
    torch.manual_seed(0)
    build_model, inputs = MODELS[name]
    model = init_like_training(build_model()).eval()
    label, loss_fn = None, own_loss
    if name == "wav2vec2":
        labels = torch.randint(1, V, (4, 5), generator=_gen(4))
        label, loss_fn = {"labels": labels, "label_lengths": torch.tensor([5, 3, 5, 4])}, ctc
    return model, inputs(), label, loss_fn


def sft_batch(name: str) -> dict:
    """``name``'s inputs with the labels of a real fine-tuning batch: a masked prompt, a
    row cut short, and a row with no target (a microbatch of it alone has none); for a
    masked LM, targets only where about 30 % of the tokens were masked."""
    _, inputs, _, _ = setup(name)
    labels = inputs["labels"].clone()
    if name in ("bert", "albert", "roberta", "distilbert", "deberta_v2", "modernbert"):
        keep = torch.rand(labels.shape, generator=_gen(5)) < 0.3
        labels[~keep] = -100
    else:
        labels[0, :labels.shape[1] // 2] = -100
        labels[1, -2:] = -100
    labels[3] = -100
    return {**inputs, "labels": labels}


PRECISIONS = ("fp32", "param_dtype", "autocast")


def bf16_buffer_dtypes(model: torch.nn.Module, dtype=torch.bfloat16) -> dict[str, torch.dtype]:
    """``{name: dtype}`` of the buffers of ``model`` loaded with ``from_pretrained(...,
    dtype=dtype)``: its class built from its config under that default dtype, on the meta
    device (as ``from_pretrained`` builds it before loading the weights into it); a peft
    model's by its base model's."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    prefix = next(f"{n}." if n else "" for n, m in model.named_modules() if m is inner)
    with torch.device("meta"):
        twin = type(inner)._from_config(copy.deepcopy(inner.config), dtype=dtype)
    return {prefix + name: b.dtype for name, b in twin.named_buffers()}


def low_precision_copy(model: torch.nn.Module, dtype=torch.bfloat16) -> torch.nn.Module:
    """A copy of ``model`` as ``from_pretrained(..., dtype=dtype)`` would hold it: floating
    parameters in ``dtype``, floating buffers in :func:`bf16_buffer_dtypes`'s dtypes."""
    low = copy.deepcopy(model)
    for p in low.parameters():
        if p.is_floating_point():
            p.data = p.data.to(dtype)
    made = bf16_buffer_dtypes(model, dtype)
    for name, b in low.named_buffers():
        if b.is_floating_point():
            b.data = b.data.to(made.get(name, dtype))
    return low


class Eager:
    """The eager reference of a pipe compiled from ``master`` in ``precision`` (module
    docstring): ``step`` runs forward and backward on the batch into ``master``'s
    ``.grad`` and returns the loss (fp32)."""

    def __init__(self, master: torch.nn.Module, precision: str, dtype=torch.bfloat16):
        if precision not in PRECISIONS:
            raise ValueError(precision)
        self.master, self.precision, self.dtype = master, precision, dtype
        self.low = None
        if precision == "param_dtype":
            self.low = low_precision_copy(master, dtype)

    def step(self, kw: dict, label: Any, loss_fn: Callable) -> torch.Tensor:
        if self.precision == "fp32":
            loss = loss_fn(self.master(**kw), label)
        elif self.precision == "autocast":
            with torch.autocast("cpu", dtype=self.dtype):
                loss = loss_fn(self.master(**kw), label)
        else:
            with torch.no_grad():
                for p, q in zip(self.master.parameters(), self.low.parameters()):
                    q.copy_(p)
                    q.grad = None
            low_kw = pytree.tree_map_only(
                torch.Tensor, lambda t: t.to(self.dtype) if t.is_floating_point() else t, kw)
            loss = loss_fn(self.low(**low_kw), label)
        loss.backward()
        if self.low is not None:
            for p, q in zip(self.master.parameters(), self.low.parameters()):
                if q.grad is not None:
                    g = q.grad.to(p.dtype)
                    p.grad = g if p.grad is None else p.grad + g
        return loss.detach().float()
