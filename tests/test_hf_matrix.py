"""Every Hugging Face architecture of ``tests/hf_zoo.py`` (decoders, mixtures of experts,
state-space models and hybrids, encoder-decoders, vision, speech and masked-LM encoders),
trained through plain ``fxpipe.compile`` in each precision a user trains in:

- ``fp32``;
- ``param_dtype=torch.bfloat16`` (bf16 device copies, fp32 masters);
- ``torch.autocast("cpu", dtype=torch.bfloat16)`` around the call.

(In CI, fp32 and one bf16 path per architecture, both on Llama and T5, fp32 alone on T5's
variants and Zamba: ``CASES``; every architecture in every precision with
``FXPIPE_HF_MATRIX=all``.) Three fused steps with a streamed AdamW on 2 virtual devices, 2 microbatches, against the
eager reference of each precision (``hf_zoo.Eager``, written out in docs/optimizer.md):
the losses agree (fp32: to 1e-5; bf16: within bf16's precision), the masters stay fp32
and move as the reference's do. In fp32 the first step's gradients equal eager's too.

A subset runs again with ``stage_backend="inductor"`` (the stage code compiled; its fp32
results agree with eager to 1e-4, not bit for bit; ``FXPIPE_HF_INDUCTOR=all`` runs every
architecture so) and with ``"cudagraphs"`` (``FXPIPE_HF_CUDAGRAPHS=all``). And in bf16
under both compiled backends with the long-context passes active, on strict cuda-sim
devices just big enough for the plan (a language model's batch at 64 tokens, its loss in
several chunks per microbatch, its MLPs tiled where the pass matches them): an encoder
(BERT) under inductor and an MoE under cudagraphs in CI (``LONG_CONTEXT_CI``), every
architecture with ``FXPIPE_HF_COMPILED=all`` (T5 under cudagraphs overflows its devices
there: an expected failure until the plan counts a device graph's working set).

A decoder, an encoder-decoder and an MoE captured at block granularity run again on
virtual devices with a GPU's semantics (``CUDA_SIM``: strict cuda-sim, copies land when
their stream reaches them, unwritten memory reads as NaN); under
``FXPIPE_TEST_DEVICE=cuda-sim`` only those architectures run, in every CI precision. The
matrix is about what each architecture computes, which the devices' semantics do not
change; those cases check that the runtime reads nothing early on real HF graphs.
"""

from __future__ import annotations

import copy
import os
import re

import pytest
import torch
import torch.nn.functional as F

import fxpipe
from fxpipe.runtime.devices import emulator

pytest.importorskip("transformers")
from tests import hf_zoo  # noqa: E402
from tests.hf_zoo import BLOCKWISE, ENCODER_DECODERS, PRECISIONS, Eager  # noqa: E402
from tests.test_long_context import TILED  # noqa: E402

STEPS, LR = 3, 1e-2
# bf16 keeps 8 bits of mantissa: one rounding is 2**-9 relative; a loss over a few layers
# of bf16 matmuls, summed over microbatches in another order than the reference, differs
# by a few of those (seen on an AMD EPYC: 1.1e-2 at most, Qwen3-Next; other CPUs round
# bf16 matmuls otherwise, hence the margin)
LOSS_RTOL = {"fp32": 1e-5, "param_dtype": 3e-2, "autocast": 3e-2}
# the masters' updates after 3 AdamW steps, as one vector, against the reference's: Adam
# normalizes each update, so where a gradient is tiny the two differ elementwise by up to
# an update; their directions agree (seen: 0.988 at least, Qwen3-Next)
MIN_COSINE = {"fp32": 0.9999, "param_dtype": 0.9, "autocast": 0.9}
# eager autocast itself fails on these (a model's own code mixes dtypes under autocast)
EAGER_AUTOCAST_FAILS = {"dbrx": "index_add_(): self (Float) and source (BFloat16)"}

NAMES = sorted(hf_zoo.MODELS)
if os.environ.get("FXPIPE_TEST_DEVICE") == "cuda-sim":
    NAMES = ["llama", "t5", "dbrx"]


# Under stage_backend="inductor" (``runtime.stages.compiled``) a subset runs in CI (inductor
# compiles each distinct layer graph with the C++ compiler: seconds each; an HF case
# 15-30 s on CI's 2 cores with inductor's cache warm, some 60 s cold): an encoder in
# fp32, its gradients checked; FXPIPE_HF_INDUCTOR=all runs the whole matrix so. (In CI a
# decoder's stage code under inductor is tests/test_stage_backend.py's HF Llama, loss and
# gradients against eager, tests/test_finetune_kit.py's LoRA Llama in bf16 and
# tests/test_quant.py's; autocast under inductor the long-context BERT below.) Inductor
# reassociates fp32 sums: its fp32 losses and gradients agree with eager's to 1e-4 (seen:
# 5e-7 on the gradients)
INDUCTOR = [(n, p) for n in NAMES for p in ("fp32", "autocast")] \
    if os.environ.get("FXPIPE_HF_INDUCTOR") == "all" else [("bert", "fp32")]
if os.environ.get("FXPIPE_TEST_DEVICE") == "cuda-sim":   # test_stage_backend runs it there
    INDUCTOR = []
INDUCTOR_FP32_TOL = 1e-4
# and under stage_backend="cudagraphs" (``runtime.stages.graphs``: the same compiled code as
# device graphs, the parameters in fixed slots): an encoder-decoder in fp32 in CI;
# FXPIPE_HF_CUDAGRAPHS=all runs the whole matrix so. (A decoder in bf16 (param_dtype)
# under cudagraphs is the long-context Qwen3-MoE below in CI, three AdamW steps replaying
# graphs, and tests/test_cudagraphs.py's test_a_hf_llama_under_cudagraphs_equals_eager.)
CUDAGRAPHS = [(n, p) for n in NAMES for p in ("fp32", "param_dtype")] \
    if os.environ.get("FXPIPE_HF_CUDAGRAPHS") == "all" else [("t5", "fp32")]
if os.environ.get("FXPIPE_TEST_DEVICE") == "cuda-sim":   # test_cudagraphs runs it there
    CUDAGRAPHS = []


# bf16 under the compiled backends with the long-context passes active: each step on two
# strict cuda-sim devices just big enough for the plan (the first of LIMITS it fits), so
# the loss runs in chunks (several per microbatch: a causal LM's batch is 4 x 64 tokens,
# long_batch) and the MLPs the tiling pass matches in tiles; against the written bf16
# reference as above. In CI (for its time: 30-60 s each there, minutes with inductor's
# cache cold) an encoder under inductor in autocast and an MoE decoder under cudagraphs
# in param_dtype, each with the limit it fits (LONG_CONTEXT_CI; in the full run T5 under
# inductor, 55 s: encoder-decoders under a compiled backend are
# test_three_adamw_steps_under_cudagraphs' T5 in CI; and Llama under inductor in
# param_dtype, 25-50 s: the same path as BERT's, the chunked loss and tiled MLPs of an
# HF Llama under inductor are tests/test_stage_backend.py's in CI, and param_dtype under
# inductor with those passes tests/test_finetune_kit.py's LoRA run);
# FXPIPE_HF_COMPILED=all: every architecture, both bf16 precisions, both backends, each
# finding its limit
LIMITS = [k * 2**10 for k in (128, 160, 192, 256, 384, 512, 768, 1024, 2048, 4096, 8192, 16384)]
LONG_CONTEXT_CI = {("qwen3_moe", "param_dtype", "cudagraphs"): 1024 * 2**10,
                   ("bert", "autocast", "inductor"): 512 * 2**10}
LONG_CONTEXT = {(n, p, b): None for n in NAMES for p in ("param_dtype", "autocast")
                for b in ("inductor", "cudagraphs")} \
    if os.environ.get("FXPIPE_HF_COMPILED") == "all" else LONG_CONTEXT_CI
if os.environ.get("FXPIPE_TEST_DEVICE") == "virtual":   # strict cuda-sim by design
    LONG_CONTEXT = {}
def compiled(model, kw, precision, backend=None, devices=None):
    devices = devices if devices is not None else [fxpipe.VirtualDevice() for _ in range(2)]
    return fxpipe.compile(model, example_kwargs=kw, devices=devices,
                          config=fxpipe.RunConfig(num_microbatch=2, stage_backend=backend),
                          param_dtype=torch.bfloat16 if precision == "param_dtype" else None)


def long_batch(kw: dict, seq: int = 64) -> dict:
    """A language model's batch (``input_ids``, ``attention_mask``, ``labels``: causal,
    masked or sequence-to-sequence) at ``seq`` tokens per row, its labels the inputs; any
    other batch as it is."""
    ids = kw.get("input_ids")
    if ids is None or set(kw) != {"input_ids", "attention_mask", "labels"}:
        return kw
    ids = torch.randint(1, hf_zoo.V, (ids.shape[0], seq), generator=torch.Generator().manual_seed(7))
    return {k: ids if k in ("input_ids", "labels") else torch.ones_like(ids) for k in kw}


def fitted(model, kw, precision, backend, limit):
    """The pipe on two strict cuda-sim devices of ``limit`` bytes (None: the first of
    ``LIMITS`` its plan fits)."""
    for bytes_ in LIMITS if limit is None else [limit]:
        devices = [fxpipe.VirtualDevice(semantics="cuda", strict=True, memory_limit=bytes_)
                   for _ in range(2)]
        pipe = None
        try:   # planned: a PlanError when the devices are too small
            pipe = compiled(model, kw, precision, backend, devices)
            pipe.code("fused")
            return pipe
        except fxpipe.PlanError:
            if pipe is not None:
                pipe.close()
            if limit is not None:
                raise
    raise AssertionError(f"no plan fits devices of {LIMITS[-1]} bytes")


def call(pipe, precision, *args, **kwargs):
    """``pipe.forward_backward`` in ``precision`` (under autocast for ``"autocast"``)."""
    if precision == "autocast":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return pipe.forward_backward(*args, **kwargs)
    return pipe.forward_backward(*args, **kwargs)


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a @ b / (a.norm() * b.norm()).clamp_min(1e-30)).item()


# For CI's time (a case costs 4-6 s on its 2 cores, most of it the capture) every
# architecture runs fp32, one architecture of each family bf16 (param_dtype), and autocast
# (the Trainer's bf16=True) runs on a decoder and an encoder-decoder, and on DBRX, whose
# eager autocast fails and is refused; FXPIPE_HF_MATRIX=all runs every architecture in
# every precision. (Qwen3-Next in bf16, 20 s, its export the slowest of the zoo, is in the
# full run: its architecture is its fp32 case in CI, the state-space hybrids in bf16
# Mamba-2's and Jamba's.)
PARAM_DTYPE_CI = {"llama", "gemma2", "gpt2", "qwen3_moe", "deepseek_v3", "dbrx",
                  "mamba2", "jamba", "t5", "bart", "whisper", "bert", "vit", "wav2vec2"}
AUTOCAST_CI = {"llama", "t5", "dbrx"}


def in_ci(name: str, precision: str) -> bool:
    return precision == "fp32" or name in {"param_dtype": PARAM_DTYPE_CI,
                                           "autocast": AUTOCAST_CI}[precision]


CASES = [(n, p) for n in NAMES for p in PRECISIONS
         if os.environ.get("FXPIPE_HF_MATRIX") == "all" or in_ci(n, p)]


@pytest.mark.parametrize("name, precision", CASES)
def test_three_adamw_steps_against_the_eager_reference(name, precision):
    three_steps(name, precision)


# on GPU semantics as well (docstring); FXPIPE_TEST_DEVICE runs every case on one kind
CUDA_SIM = [] if os.environ.get("FXPIPE_TEST_DEVICE") else \
    [("llama", "fp32"), ("llama", "param_dtype"), ("t5", "autocast"), ("dbrx", "fp32")]


@pytest.mark.parametrize("name, precision", CUDA_SIM)
def test_three_adamw_steps_on_cuda_semantics(name, precision, monkeypatch):
    monkeypatch.setattr(emulator, "default_semantics", "cuda")
    three_steps(name, precision)


@pytest.mark.parametrize("name, precision", INDUCTOR)
def test_three_adamw_steps_under_inductor(name, precision):
    """The same steps with every stage's layer segments compiled by inductor."""
    three_steps(name, precision, "inductor")


@pytest.mark.parametrize("name, precision", CUDAGRAPHS)
def test_three_adamw_steps_under_cudagraphs(name, precision):
    """The same steps with the stage jobs replayed as device graphs (the first step
    captures them; the two after replay them)."""
    three_steps(name, precision, "cudagraphs")


@pytest.mark.parametrize("name, precision, backend", list(LONG_CONTEXT))
def test_bf16_under_a_compiled_backend_with_the_long_context_passes(name, precision, backend):
    """The same steps in bf16 with the stage code compiled (inductor, or replayed as
    device graphs), the loss chunked and the MLPs tiled for small strict cuda-sim devices
    (the kit's first inductor run on a GPU summed two chunks of a loss's many)."""
    three_steps(name, precision, backend, limit=LONG_CONTEXT[(name, precision, backend)],
                long_context=True)


def three_steps(name, precision, backend=None, *, limit=None, long_context=False):
    model, kw, label, loss_fn = hf_zoo.setup(name)
    if long_context:
        kw = long_batch(kw)
    ref = Eager(copy.deepcopy(model), precision)
    if not long_context:
        pipe = compiled(model, kw, precision, backend)
    elif precision == "autocast" and name in EAGER_AUTOCAST_FAILS:
        pipe = compiled(model, kw, precision, backend)   # refused below, as without them
    else:   # captured and planned in the precision the calls run in
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "autocast"):
            pipe = fitted(model, kw, precision, backend, limit)
            code = pipe.code("fused")
        if pipe.layers.loss_free_outputs and "labels" in kw:   # the logits: only the loss reads them
            chunks = re.findall(r"linear_cross_entropy\([^,]*, [^,]*, [^,]*, (\d+)", code)
            rows = kw["labels"].numel() // 2   # per microbatch
            assert chunks, name
            # several chunks per microbatch at CI's limits; the sweep's smallest devices
            # may hold a microbatch's logits whole (LongT5 fits 8 MiB, one chunk of 128)
            assert limit is None or int(chunks[0]) < rows, (name, chunks, rows)
        if name in TILED:
            assert "fxpipe_tiling_tiled_mlp(" in code, name
    tol = INDUCTOR_FP32_TOL if backend is not None and precision == "fp32" else None
    if precision == "autocast" and name in EAGER_AUTOCAST_FAILS:
        with pytest.raises(RuntimeError, match=re.escape(EAGER_AUTOCAST_FAILS[name])):
            ref.step(kw, label, loss_fn)
        with pytest.raises(fxpipe.CaptureError, match="fails on this example without fxpipe too"):
            call(pipe, precision, (), kw, label=label, loss_fn=loss_fn)
        return
    if precision == "fp32":   # the structure the pipe was cut into
        assert pipe.layers.capture == ("blocks" if name in BLOCKWISE else "export")
        blocks = [layer.name for layer in pipe.layers if layer.name not in ("prefix", "suffix")]
        assert len(blocks) >= 2, blocks
        if name in ENCODER_DECODERS:  # both stacks: encoder blocks, then decoder blocks
            assert any("encoder" in b for b in blocks) and any("decoder" in b for b in blocks)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    ref_opt = torch.optim.AdamW(ref.master.parameters(), lr=LR, fused=True)
    before = [p.detach().clone() for p in model.parameters()]
    worst = 0.0   # the largest relative loss difference, printed with -s
    for step in range(STEPS):
        loss, out = call(pipe, precision, (), kw, label=label, loss_fn=loss_fn, optimizer=opt,
                         return_outputs=True)
        ref_loss = ref.step(kw, label, loss_fn)
        assert loss.dtype == torch.float32, loss.dtype     # as eager autocast and HF return it
        worst = max(worst, ((loss - ref_loss).abs() / ref_loss.abs()).item())
        torch.testing.assert_close(loss, ref_loss, rtol=tol or LOSS_RTOL[precision], atol=0,
                                   msg=f"{name} {precision}: loss of step {step}")
        if name in ("t5_default_cache", "switch_transformers"):   # use_cache=True
            assert out.past_key_values is None   # a cache cannot be merged: None
        if step == 0 and precision == "fp32":   # the gradients, as eager's
            for (pname, p), r in zip(model.named_parameters(), ref.master.parameters()):
                assert (p.grad is None) == (r.grad is None), f"{name}: .grad of {pname}"
                if p.grad is not None:
                    torch.testing.assert_close(p.grad, r.grad, atol=tol or 1e-5,
                                               rtol=tol or 1e-5, msg=f"{name}: {pname}")
        ref_opt.step()
        opt.zero_grad(set_to_none=True)
        ref_opt.zero_grad(set_to_none=True)
    params, refs = list(model.parameters()), list(ref.master.parameters())
    assert all(p.dtype == torch.float32 for p in params)   # the masters stay fp32
    moved = [(p - b).flatten() for p, b in zip(params, before)]
    ref_moved = [(r - b).flatten() for r, b in zip(refs, before)]
    assert [bool(m.any()) for m in moved] == [bool(m.any()) for m in ref_moved]
    c = cosine(torch.cat(moved), torch.cat(ref_moved))
    print(f"\n{name} {precision} {backend or 'eager'}: loss relative difference {worst:.2e}, "
          f"updates' cosine {c:.5f}")
    assert c >= MIN_COSINE[precision], f"{name} {precision}: updates' cosine {c:.4f}"
    if backend == "cudagraphs":   # the last step replayed graphs, capturing none
        stats = pipe.stats()
        assert stats["graph_replays"] > 0 and stats["graph_captures"] == 0, stats
    pipe.close()


@pytest.mark.parametrize("name", ["llama", "bert"])
def test_external_loss_fn(name):
    model, kw, _, _ = hf_zoo.setup(name)
    ref = copy.deepcopy(model)
    kw = {k: v for k, v in kw.items() if k != "labels"}
    ids = kw["input_ids"]

    def loss_fn(out, labels):
        return F.cross_entropy(out.logits.flatten(0, 1), labels.flatten())

    pipe = compiled(model, kw, "fp32")
    loss = pipe.forward_backward((), kw, label=ids, loss_fn=loss_fn)
    ref_loss = loss_fn(ref(**kw), ids)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach(), atol=1e-6, rtol=1e-6)
    for (pname, p), r in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, r.grad, atol=1e-6, rtol=1e-5, msg=pname)
