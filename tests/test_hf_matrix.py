"""Hugging Face architectures, built from tiny configs in code (nothing downloaded), each
compiled with plain ``fxpipe.compile`` and trained one fused step on 2 virtual devices."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import fxpipe
from tests.models import init_like_training

T = pytest.importorskip("transformers")
V = 64


def build(name: str):
    common = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  use_cache=False)
    if name == "llama":
        return T.LlamaForCausalLM(T.LlamaConfig(**common))
    if name == "qwen2":
        return T.Qwen2ForCausalLM(T.Qwen2Config(**common))
    if name == "qwen3":
        return T.Qwen3ForCausalLM(T.Qwen3Config(**common, head_dim=8))
    if name == "mistral":
        return T.MistralForCausalLM(T.MistralConfig(**common))
    if name == "gemma2":
        return T.Gemma2ForCausalLM(T.Gemma2Config(**common, head_dim=8))
    if name == "gpt2":
        return T.GPT2LMHeadModel(T.GPT2Config(
            vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=64, use_cache=False,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))
    if name == "opt":
        return T.OPTForCausalLM(T.OPTConfig(
            vocab_size=V, hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=64, word_embed_proj_dim=32, use_cache=False, dropout=0.0,
            attention_dropout=0.0, bos_token_id=0, eos_token_id=0, pad_token_id=1))
    if name == "bert":
        return T.BertForMaskedLM(T.BertConfig(
            vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=64, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0))
    raise ValueError(name)


MODELS = ["llama", "qwen2", "qwen3", "mistral", "gemma2", "gpt2", "opt", "bert"]


def batch():
    torch.manual_seed(1)
    ids = torch.randint(2, V, (4, 8))
    mask = torch.ones(4, 8, dtype=torch.long)
    mask[1, 6:] = 0  # padding, as HF passes it
    return ids, mask


def assert_grads_close(model, ref):
    for (name, p), r in zip(model.named_parameters(), ref.parameters()):
        assert (p.grad is None) == (r.grad is None), name
        if p.grad is not None:
            assert torch.allclose(p.grad, r.grad, atol=1e-6, rtol=1e-5), \
                f"{name}: {(p.grad - r.grad).abs().max()}"


@pytest.mark.parametrize("name", MODELS)
def test_model_loss_through_labels(name):
    torch.manual_seed(0)
    model = init_like_training(build(name)).eval()
    ref = copy.deepcopy(model)
    ids, mask = batch()
    kw = {"input_ids": ids, "attention_mask": mask, "labels": ids}
    pipe = fxpipe.compile(model, example_kwargs=kw, devices=[fxpipe.VirtualDevice() for _ in range(2)],
                          config=fxpipe.RunConfig(num_microbatch=2))
    loss = pipe.forward_backward((), kw, loss_fn=lambda out, _: out.loss)
    ref_loss = ref(**kw).loss
    ref_loss.backward()
    assert torch.allclose(loss, ref_loss.detach(), atol=1e-6), (loss, ref_loss)
    assert_grads_close(model, ref)


@pytest.mark.parametrize("name", ["llama", "bert"])
def test_external_loss_fn(name):
    torch.manual_seed(0)
    model = init_like_training(build(name)).eval()
    ref = copy.deepcopy(model)
    ids, mask = batch()
    kw = {"input_ids": ids, "attention_mask": mask}

    def loss_fn(out, labels):
        return F.cross_entropy(out.logits.flatten(0, 1), labels.flatten())

    pipe = fxpipe.compile(model, example_kwargs=kw, devices=[fxpipe.VirtualDevice() for _ in range(2)],
                          config=fxpipe.RunConfig(num_microbatch=2))
    loss = pipe.forward_backward((), kw, label=ids, loss_fn=loss_fn)
    ref_loss = loss_fn(ref(**kw), ids)
    ref_loss.backward()
    assert torch.allclose(loss, ref_loss.detach(), atol=1e-6)
    assert_grads_close(model, ref)
