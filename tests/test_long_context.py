"""Long context for Hugging Face models as users bring them (issue 39).

- the loss pass (``fxpipe.passes.loss``): an HF causal LM's head + cross-entropy become the
  chunked ``linear_cross_entropy``; the logits beside the loss are computed only when a
  call returns its outputs or its ``loss_fn`` reads them; equal to eager either way;
- attention stays O(sequence): without a padding mask, HF attention is captured as causal
  SDPA, with no (L, L) tensor anywhere in the graph;
- the tiling pass (``fxpipe.passes.tiling``): an MLP runs over the tokens in tiles where it
  would not fit its share of a device;
- on strict cuda-sim devices with a ``memory_limit``, a Llama scaled down from the 8B's
  ratios trains at a sequence whose full logits and untiled MLP would not fit: equal to
  eager, peak reserved under the limit.

The whole HF matrix (``test_hf_matrix.py``) runs through both passes too.
"""

from __future__ import annotations

import copy
import os
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxpipe
from fxpipe.passes.partition import build_layer_graph, without_loss_free_outputs
from fxpipe.tiling import tiled_mlp, tiled_rms_norm

pytest.importorskip("transformers")
import transformers as T  # noqa: E402

from tests import hf_zoo  # noqa: E402
from tests.test_gpu_semantics import cuda_devices  # noqa: E402


def compiled(model, kw, devices=None, **config):
    return fxpipe.compile(model, example_kwargs=kw,
                          devices=devices or [fxpipe.VirtualDevice() for _ in range(2)],
                          config=fxpipe.RunConfig(num_microbatch=2, **config))


def own_loss(out, _label):
    return out.loss


def assert_grads_close(model, ref, atol=2e-6, rtol=1e-5):
    for (n, p), r in zip(model.named_parameters(), ref.parameters()):
        assert (p.grad is None) == (r.grad is None), n
        if p.grad is not None:
            torch.testing.assert_close(p.grad, r.grad, atol=atol, rtol=rtol, msg=n)


@pytest.mark.parametrize("name, shows", [("llama", ""), ("gemma2", "softcap = 30.0"),
                                         ("phi", "bias = lm_head_bias")])
def test_a_causal_lms_loss_runs_chunked_and_its_logits_only_when_asked(name, shows):
    model, kw, _, _ = hf_zoo.setup(name)
    ref = copy.deepcopy(model)
    pipe = compiled(model, kw)
    fused = pipe.code("fused")
    call = next(line for line in fused.splitlines() if "fxpipe_losses_linear_cross_entropy(" in line)
    # a mean over the targets: their sum, divided by their count (passes.token_means)
    assert "'sum'" in call and "out_dtype = torch.float32" in call and shows in call, call
    assert "linear_cross_entropy_mean = " in fused
    assert "cross_entropy_loss" not in fused   # the (tokens, vocab) loss is gone
    # the default fused call: the tail makes and returns the loss only, no logits
    assert "return (linear_cross_entropy_mean_host,)" in fused
    loss = pipe.forward_backward((), kw, loss_fn=own_loss)
    expected = ref(**kw)
    expected.loss.backward()
    torch.testing.assert_close(loss, expected.loss.detach(), rtol=1e-5, atol=1e-6)
    assert_grads_close(model, ref)
    # asked for, the logits are there and equal eager's
    _, out = pipe.forward_backward((), kw, loss_fn=own_loss, return_outputs=True)
    torch.testing.assert_close(out.logits, expected.logits.detach(), rtol=1e-5, atol=1e-5)
    # a loss_fn reading the logits gets them (the pass cannot drop what it reads)
    labels = kw["labels"]
    read = lambda out, y: F.cross_entropy(out.logits[:, :-1].flatten(0, 1), y[:, 1:].flatten())  # noqa: E731
    model.zero_grad(), ref.zero_grad()
    loss = pipe.forward_backward((), kw, label=labels, loss_fn=read)
    read(ref(**kw), labels).backward()
    torch.testing.assert_close(loss, read(expected, labels).detach(), rtol=1e-5, atol=1e-6)
    assert_grads_close(model, ref)


def test_the_logits_cost_is_predicted_when_asked_for():
    """A device of 16 MiB: the loss's chunks are 32 tokens' fp32 logits (256 KiB), the
    microbatch's logits 64 tokens' (512 KiB)."""
    ids = torch.randint(0, 2048, (2, 64), generator=torch.Generator().manual_seed(1))
    pipe = compiled(scaled_llama(), {"input_ids": ids, "labels": ids},
                    devices=[fxpipe.VirtualDevice(memory_limit=16 * 2**20) for _ in range(2)])
    assert re.search(r"fxpipe_losses_linear_cross_entropy\(flatten_using_ints, lm_head_weight, "
                     r"\w+, 32, -100, 'sum'", pipe.code("fused"))
    without = fxpipe.plan.predict_memory(pipe, run_type="fused", loss_fn=own_loss)
    with_logits = fxpipe.plan.predict_memory(pipe, run_type="fused", loss_fn=own_loss,
                                             return_outputs=True)
    tail = lambda p: next(s for s in p.stages if s.kind == "fused").total  # noqa: E731
    assert tail(with_logits) - tail(without) >= 64 * 2048 * 4 // 2
    assert set(without.host) == {"params", "copies", "grads", "activations", "activation_grads"}
    assert without.host["copies"] == 0 and without.host_total > 0   # no param_dtype
    assert "host " in str(without)


class HeadLoss(nn.Module):
    """A head and a cross-entropy as a user writes them, in the forms the pass matches
    and in some it must leave alone."""

    def __init__(self, form: str):
        super().__init__()
        self.form = form
        self.body = nn.Linear(8, 8)
        self.head = nn.Linear(8, 11, bias=form == "bias")

    def forward(self, x, y, n):
        logits = self.head(torch.tanh(self.body(x))).float()
        flat, target = logits.view(-1, 11), y.view(-1)
        if self.form == "sum":          # HF's num_items_in_batch
            return F.cross_entropy(flat, target, ignore_index=-1, reduction="sum") / n
        if self.form == "smoothing":    # not matched: left as it is
            return F.cross_entropy(flat, target, label_smoothing=0.1)
        if self.form == "weights":      # not matched: class weights
            return F.cross_entropy(flat, target, weight=torch.linspace(0.5, 1.5, 11))
        return F.cross_entropy(flat, target)


@pytest.mark.parametrize("form, fused", [("mean", True), ("bias", True), ("sum", True),
                                         ("smoothing", False), ("weights", False)])
def test_the_pass_matches_what_it_can_and_equals_eager(form, fused):
    torch.manual_seed(0)
    model = HeadLoss(form)
    ref = copy.deepcopy(model)
    x, y = torch.randn(4, 6, 8), torch.randint(0, 11, (4, 6))
    y[0, :2] = -1   # ignored by the "sum" form's ignore_index
    if form != "sum":
        y = y.clamp(min=0)
    n = torch.tensor(float((y != -1).sum()))
    pipe = fxpipe.compile(model, example_inputs=(x, y, n), devices=["cpu"], capture="export",
                          config=fxpipe.RunConfig(num_microbatch=1))
    code = pipe.code("fused")
    assert ("fxpipe_losses_linear_cross_entropy(" in code) is fused, code
    assert ("cross_entropy_loss" in code) is not fused
    loss = pipe.forward_backward((x, y, n))
    expected = ref(x, y, n)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-5, atol=1e-6)
    assert_grads_close(model, ref)


# decoders whose attention transformers runs as SDPA (a sliding window shorter than the
# sequence needs its mask: Gemma 2 and 3's local layers at 40 tokens)
SDPA_DECODERS = ["llama", "qwen2", "qwen3", "mistral", "olmo2", "phi", "gpt_neox", "opt",
                 "qwen3_moe"]


@pytest.mark.parametrize("name", SDPA_DECODERS)
def test_attention_without_a_padding_mask_is_causal_sdpa_never_quadratic(name):
    """A causal LM called without ``attention_mask`` is captured as transformers runs it
    eagerly: SDPA with ``is_causal=True`` and no mask, so no (L, L) value exists anywhere
    (a mask, or scores of an eager attention, would be one). L = 40 is no other dim."""
    model = hf_zoo.build(name).eval()
    ids = torch.randint(2, hf_zoo.V, (2, 40))
    lg = build_layer_graph(model, (), {"input_ids": ids, "labels": ids})
    sdpa = [n for n in lg.source.graph.nodes
            if n.target is torch.ops.aten.scaled_dot_product_attention.default]
    assert sdpa, "attention is not SDPA"
    for n in sdpa:
        mask = n.args[3] if len(n.args) > 3 else n.kwargs.get("attn_mask")
        causal = n.args[5] if len(n.args) > 5 else n.kwargs.get("is_causal")
        assert mask is None and causal is True, n.format_node()
    for n in lg.source.graph.nodes:
        val = n.meta.get("val")
        if isinstance(val, torch.Tensor) and val.dim() >= 2:
            assert tuple(val.shape[-2:]) != (40, 40), f"quadratic value: {n.format_node()}"


def test_tiled_mlp_gradients_equal_the_plain_mlps():
    torch.manual_seed(0)
    for gated in (True, False):
        for act in ("silu", "gelu", "gelu_tanh", "relu"):
            x = torch.randn(3, 7, 8, dtype=torch.float64, requires_grad=True)
            ws = [torch.randn(16, 8, dtype=torch.float64, requires_grad=True),
                  torch.randn(16, dtype=torch.float64, requires_grad=True),
                  torch.randn(16, 8, dtype=torch.float64, requires_grad=True) if gated else None,
                  None, torch.randn(8, 16, dtype=torch.float64, requires_grad=True), None]
            assert torch.autograd.gradcheck(lambda x, *w: tiled_mlp(x, *w, act=act, rows=4),
                                            (x, *ws)), (gated, act)
    with pytest.raises(ValueError, match="act must be one of"):
        tiled_mlp(x, *ws, act="tanh", rows=4)
    with pytest.raises(ValueError, match="rows must be >= 1"):
        tiled_mlp(x, *ws, act="relu", rows=0)


@pytest.mark.bitwise
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiled_rms_norm_equals_the_plain_norm(dtype):
    """Each row's norm is the plain norm's, bit for bit (rows are independent); the
    weight's gradient is summed per tile, then over the tiles in fp32 (a reassociation)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 7, 16, generator=g).to(dtype).requires_grad_()
    w = (1 + torch.randn(16, generator=g) / 4).to(dtype).requires_grad_()
    cast = None if dtype == torch.float32 else dtype
    up = x.float()
    ref = w * (up * torch.rsqrt(up.pow(2).mean(-1, keepdim=True) + 1e-6)).to(cast or dtype)
    grad = torch.randn(ref.shape, generator=g).to(dtype)
    ref_dx, ref_dw = torch.autograd.grad(ref, (x, w), grad)
    out = tiled_rms_norm(x, w, eps=1e-6, dtype=cast, rows=4)
    assert out.dtype == ref.dtype and torch.equal(out, ref)
    dx, dw = torch.autograd.grad(out, (x, w), grad)
    assert torch.equal(dx, ref_dx)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(dw, ref_dw, **tol)
    with pytest.raises(ValueError, match="rows must be >= 1"):
        tiled_rms_norm(x, w, eps=1e-6, dtype=cast, rows=0)


def test_tiled_norms_hold_less_for_backward():
    """In bf16 a ``LlamaRMSNorm`` keeps its fp32 upcast and its bf16 normalized value for
    backward, six bytes per element of the sequence; tiled, it keeps its input. A block's
    bytes held for backward, costed on fake tensors at 512 tokens on devices of 512 KiB
    (MLP and loss tiled in both), drop by at least a third."""
    from fxpipe.memory_prediction import chain_memory
    import fxpipe.passes.partition as partition
    model = T.LlamaForCausalLM(T.LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        use_cache=False))
    ids = torch.randint(2, 64, (1, 512), generator=torch.Generator().manual_seed(0))
    kw = {"input_ids": ids, "labels": ids}

    def held() -> tuple[int, str]:
        lg = build_layer_graph(model, (), kw, device_memory=512 * 2**10,
                               param_dtype=torch.bfloat16)
        return chain_memory(lg).held[1], lg.layers[1].gm.code

    tiled, code = held()
    assert code.count("fxpipe_tiling_tiled_rms_norm(") == 2 and "dtype = torch.bfloat16" in code
    untiled_norms = partition.tile_norms
    try:
        partition.tile_norms = lambda gm, device_memory: 0
        plain, code = held()
    finally:
        partition.tile_norms = untiled_norms
    assert "tiled_rms_norm" not in code
    print(f"a block holds {plain} B untiled, {tiled} B with its norms tiled")
    assert tiled <= 2 / 3 * plain


def scaled_llama() -> T.LlamaForCausalLM:
    """Llama-3.1-8B's ratios at width 64: MLP 3.5x the hidden size, vocabulary 32x,
    grouped-query attention (4 heads, 2 for keys and values), untied head."""
    torch.manual_seed(0)
    return T.LlamaForCausalLM(T.LlamaConfig(
        vocab_size=2048, hidden_size=64, intermediate_size=224, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        tie_word_embeddings=False, use_cache=False)).eval()


def test_a_scaled_llama_trains_past_its_logits_and_mlp_on_strict_cuda_sim():
    """A sequence whose full logits (fp32, 8 MiB) or untiled MLP would not fit the
    devices' limit trains on strict cuda-sim devices, equal to eager, with what each
    device's allocator reserves under the limit."""
    model = scaled_llama()
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 2048, (1, 1024), generator=torch.Generator().manual_seed(1))
    kw = {"input_ids": ids, "labels": ids}
    limit = 6 * 2**20
    devs = cuda_devices(2, memory_limit=limit)
    pipe = fxpipe.compile(model, example_kwargs=kw, devices=devs,
                          config=fxpipe.RunConfig(num_microbatch=1))
    fused = pipe.code("fused")
    assert "fxpipe_losses_linear_cross_entropy(" in fused and "fxpipe_tiling_tiled_mlp(" in fused
    # the same model on devices of unknown size (one chunk of logits, no tiles) would not
    # fit (its own plan: 11.5 MB predicted at its peak, without the logits)
    plain = fxpipe.compile(copy.deepcopy(model), example_kwargs=kw,
                           devices=[fxpipe.VirtualDevice() for _ in range(2)],
                           config=fxpipe.RunConfig(num_microbatch=1))
    assert "fxpipe_tiling_tiled_mlp(" not in plain.code("fused")
    assert fxpipe.plan.predict_memory(plain, run_type="fused", loss_fn=own_loss).peak > limit
    # pipe.plan is what a training step runs, planned without the logits; the full
    # chain's (pipe(x), print(pipe)) holds them in one stage and cannot fit the limit
    # (what the kit's 278K-token LoRA run on an H200 hit reading pipe.plan)
    assert pipe.plan == pipe._current.trimmed(model).plan
    with pytest.raises(fxpipe.PlanError, match="over the per-stage limit"):
        str(pipe)
    loss = pipe.forward_backward((), kw, loss_fn=own_loss)
    expected = ref(**kw).loss
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-5, atol=1e-5)
    assert_grads_close(model, ref, atol=1e-5, rtol=1e-4)
    assert all(d.peak_reserved_bytes() <= limit for d in devs), \
        [d.peak_reserved_bytes() / limit for d in devs]


# the matrix's architectures whose MLP the tiling pass matches (gated or plain, linear
# weights, aten's SiLU/GELU/ReLU); the others' MLPs are experts, GPT-2's Conv1D, or a
# GELU written out in ops (GPT-J, Phi, Falcon, BLOOM)
TILED = {"llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3", "olmo2", "gpt_neox", "opt",
         "bert", "roberta", "vit"}
# the matrix's architectures with a norm of LlamaRMSNorm's form, which the tiling pass
# tiles (T5's in fp32, where its upcast is no cast; in bf16 it scales the un-upcast
# input and is left); Gemma's add one to the weight in fp32, Llama 4's casts with
# type_as, the others are LayerNorms
NORMS_TILED = {"deepseek_v3", "gpt_oss", "jamba", "jetmoe", "llama", "longt5", "mamba",
               "mamba2", "mistral", "mixtral", "mixtral_eager_experts", "olmo2", "olmoe",
               "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "qwen3_next",
               "switch_transformers", "t5", "t5_default_cache", "zamba", "zamba2"}
# for CI's time one of each family (FXPIPE_HF_MATRIX=all: every architecture); the loss
# pass runs on every one in test_hf_matrix.py's pipelines too
PASSES_CI = ["llama", "qwen3", "gemma2", "gemma3", "gpt_neox", "opt", "bert", "vit", "phi",
             "llama4", "t5", "whisper"]


@pytest.mark.parametrize("name", sorted(hf_zoo.MODELS) if os.environ.get("FXPIPE_HF_MATRIX") == "all"
                         else PASSES_CI)
def test_the_passes_keep_every_architecture_equal_to_eager(name):
    """A model of the HF matrix captured for devices of 64 KiB: its loss chunked a few
    tokens at a time, its MLPs tiled 2 tokens at a time (where it has them). The layer
    chain, called as the model is (``LayerGraph.gm``), gives eager's loss and gradients;
    so does the chain without the logits."""
    model, kw, label, loss_fn = hf_zoo.setup(name)
    ref = copy.deepcopy(model)
    lg = build_layer_graph(model, (), kw, device_memory=64 * 2**10)
    code = "\n".join(layer.gm.code for layer in lg)
    expected = loss_fn(ref(**kw), label)
    expected.backward()
    for chain in (lg, without_loss_free_outputs(lg, model)):
        model.zero_grad()
        args, kwargs = torch.utils._pytree.tree_unflatten(lg.example_leaves, lg.in_spec)
        flat = [x for x in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
        out = torch.utils._pytree.tree_unflatten(list(chain.gm(*flat)), chain.out_spec)
        loss = loss_fn(out, label)
        loss.backward()
        torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
        assert_grads_close(model, ref, atol=1e-5, rtol=1e-4)
    if name in TILED:
        assert "fxpipe_tiling_tiled_mlp(" in code and "rows = 2)" in code, name
    assert ("fxpipe_tiling_tiled_rms_norm(" in code) == (name in NORMS_TILED), name
    if lg.loss_free_outputs:
        assert "fxpipe_losses_linear_cross_entropy(" in code, name



def test_the_loss_op_outside_autocast_computes_as_autocast_did():
    """Stage code compiled under autocast runs with its casts in the graph and autocast
    off: the loss op then meets bf16 hidden states and fp32 head weights. It computes in
    the narrower dtype, what autocast gave when the code was traced (its backward's
    ``compute_dtype``), bit for bit the op under autocast; a matmul of two dtypes used
    to fail there (the kit's HF matrix under inductor, autocast: ``mat1 and mat2 must
    have the same dtype``)."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(2, 12, 16, generator=g).to(torch.bfloat16)
    w = torch.randn(40, 16, generator=g)
    y = torch.randint(0, 40, (2, 12), generator=g)
    op = torch.ops.fxpipe.linear_cross_entropy
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = op(h, w, y, None, 5, -100, "sum", None, torch.float32)
    assert torch.equal(op(h, w, y, None, 5, -100, "sum", None, torch.float32), expected)
