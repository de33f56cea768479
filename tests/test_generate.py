"""``pipe.generate``: token for token what ``transformers``' ``model.generate`` returns,
for the causal LMs of the matrix (left padding, prompts of different lengths, each
sequence stopping at its EOS), after a training step on the same weights, on 1-3 devices
and on cuda-sim; sampling as transformers samples; bad input refused, nothing changed."""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn.functional as F

import fxpipe
from fxpipe.runtime.host.params import HostParams

T = pytest.importorskip("transformers")

from tests import hf_zoo  # noqa: E402

CAUSAL = ["llama", "qwen2", "qwen3", "mistral", "gemma2", "gpt2", "opt", "mixtral", "qwen3_moe"]


def causal_lm(name: str):
    torch.manual_seed(0)
    model = hf_zoo.build(name)
    return model.eval()


def prompts(model, batch: int = 3, length: int = 6):
    """Left-padded prompts of different lengths (3 tokens of padding, 2, none)."""
    torch.manual_seed(1)
    pad = model.generation_config.pad_token_id
    pad = 1 if pad is None else pad
    ids = torch.randint(3, model.config.vocab_size, (batch, length))
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[0, :3] = 0
    if batch > 2:
        mask[2, :2] = 0
    ids[mask == 0] = pad
    return ids, mask, pad


def small_llama(hidden: int = 128, intermediate: int = 256, layers: int = 4,
                positions: int = 512):
    """A small Llama (vocabulary 256, 4 heads, 2 key-value heads), seeded, in eval mode."""
    torch.manual_seed(0)
    return T.LlamaForCausalLM(T.LlamaConfig(
        vocab_size=256, hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=positions)).eval()


def hf_generate(model, ids, mask, **kw):
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, do_sample=kw.pop("do_sample", False), **kw)


def compiled(model, ids, devices=("cpu", "cpu"), **kw):
    return fxpipe.compile(model, example_inputs=(ids,), devices=list(devices), **kw)


@pytest.mark.parametrize("name", CAUSAL)
def test_greedy_equals_transformers(name):
    model = causal_lm(name)
    ids, mask, pad = prompts(model)
    ref = hf_generate(model, ids, mask, max_new_tokens=8, pad_token_id=pad)
    pipe = compiled(model, ids)
    out = pipe.generate(ids, mask, max_new_tokens=8, pad_token_id=pad)
    assert out.dtype == torch.long and torch.equal(out, ref)
    # each sequence stops at its EOS: a token the first sequence makes midway is the EOS
    eos = int(ref[0, ids.shape[1] + 2])
    ref = hf_generate(model, ids, mask, max_new_tokens=8, pad_token_id=pad, eos_token_id=eos)
    out = pipe.generate(ids, mask, max_new_tokens=8, pad_token_id=pad, eos_token_id=eos)
    assert torch.equal(out, ref)
    assert (out[0, ids.shape[1] + 3:] == pad).all()
    assert len(pipe._generation) == 1          # both calls ran one step module


@pytest.mark.parametrize("devices", [["cpu"], ["cpu"] * 3, "cuda-sim"])
def test_greedy_on_one_to_three_devices_and_cuda_sim(devices):
    model = causal_lm("llama")
    ids, mask, pad = prompts(model)
    if devices == "cuda-sim":
        devices = [fxpipe.VirtualDevice(semantics="cuda") for _ in range(2)]
    pipe = compiled(model, ids, devices)
    ref = hf_generate(model, ids, mask, max_new_tokens=6, pad_token_id=pad)
    assert torch.equal(pipe.generate(ids, mask, max_new_tokens=6, pad_token_id=pad), ref)
    if devices and isinstance(devices[0], fxpipe.VirtualDevice):
        assert pipe._generation[0].pipe.stats()["host_stalls"] == 0   # pinned, as on a GPU


def test_after_a_training_step_the_new_weights_and_one_host_copy():
    model = causal_lm("llama")
    ids, mask, pad = prompts(model)
    pipe = compiled(model, ids)
    before = pipe.generate(ids, mask, max_new_tokens=6, pad_token_id=pad)
    steps = pipe._generation[0]
    graphs = len(steps.pipe._cache)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    labels = torch.randint(0, model.config.vocab_size, ids.shape)
    pipe.forward_backward((ids,), label=labels, optimizer=opt,
                          loss_fn=lambda out, y: F.cross_entropy(out.logits.flatten(0, 1), y.flatten()))
    model.eval()
    after = pipe.generate(ids, mask, max_new_tokens=6, pad_token_id=pad)
    ref = hf_generate(model, ids, mask, max_new_tokens=6, pad_token_id=pad)
    assert torch.equal(after, ref) and not torch.equal(after, before)
    # no re-compile, and the step module uploads from the model's own host buffers
    assert len(pipe._generation) == 1 and len(steps.pipe._cache) == graphs
    host = HostParams.of(model)
    assert HostParams.of(steps.module) is host
    assert all(host.view(host.slot(p)).data_ptr() == p.data_ptr() for p in model.parameters())


def test_sampling_follows_transformers_and_the_generator():
    model = causal_lm("llama")
    ids, mask, pad = prompts(model)
    pipe = compiled(model, ids)
    kw = dict(max_new_tokens=8, pad_token_id=pad, do_sample=True, temperature=0.7, top_k=20,
              top_p=0.9)
    torch.manual_seed(5)
    ref = hf_generate(model, ids, mask, **kw)
    torch.manual_seed(5)
    assert torch.equal(pipe.generate(ids, mask, **kw), ref)   # the same draws
    a = pipe.generate(ids, mask, generator=torch.Generator().manual_seed(3), **kw)
    b = pipe.generate(ids, mask, generator=torch.Generator().manual_seed(3), **kw)
    assert torch.equal(a, b)
    greedy = pipe.generate(ids, mask, max_new_tokens=8, pad_token_id=pad)
    top1 = pipe.generate(ids, mask, max_new_tokens=8, pad_token_id=pad, do_sample=True, top_k=1)
    assert torch.equal(top1, greedy)


def test_streamer_gets_the_prompt_then_each_token():
    class Recorder:
        def __init__(self):
            self.put_shapes, self.ended = [], False

        def put(self, tokens):
            self.put_shapes.append(tuple(tokens.shape))

        def end(self):
            self.ended = True

    model = causal_lm("gpt2")
    ids, mask, pad = prompts(model, batch=1)
    rec = Recorder()
    out = compiled(model, ids).generate(ids, mask, max_new_tokens=4, streamer=rec, pad_token_id=pad)
    assert rec.put_shapes == [(1, 6)] + [(1,)] * 4 and rec.ended and out.shape == (1, 10)


def test_program_and_code_show_prefill_decode_and_the_cache():
    model = causal_lm("llama")
    ids, mask, pad = prompts(model)
    pipe = compiled(model, ids)
    program = pipe.program("generate")
    text = str(program)
    assert text.startswith("# prefill") and "# each decode step" in text
    assert text.count("microbatches=1") == 2         # the whole batch at once (the default)
    cached = sorted(s for s, st in pipe._generation[-1].executables()[1].stages.items()
                    if any(".kv." in f".{f}" for f in st.params))
    assert f"# KV cache (kv_cache='host'): stages {cached} stream theirs in" in text
    code = pipe.code("generate")
    for i in range(model.config.num_hidden_layers):   # each layer's cache: read, written, back
        # the call's rows of it (a microbatch is served its own rows), written in place
        assert f"host_kv_{i}_k = " in code and f"narrow.default(kv_{i}_k, 0, 0, " in code
        assert f"writeback.default(host_kv_{i}_k, kv_{i}_k)" in code
    pipe.generate(ids, mask, max_new_tokens=2, pad_token_id=pad, kv_cache="device",
                  num_microbatch=2)
    text = str(pipe.program("generate"))             # the last call's: 2 microbatches
    assert f"# KV cache (kv_cache='device'): stages {cached} keep theirs on their device" in text
    assert text.count("microbatches=2") == 2 and "in 2 microbatches" in text
    pipe.generate(ids, mask, max_new_tokens=2, pad_token_id=pad)  # the same step module
    assert len(pipe._generation) == 1


def test_predicted_kv_and_decode_memory_match_the_devices():
    model = small_llama(128, 256, 4)
    ids = torch.randint(3, 256, (4, 100))
    pipe = compiled(model, ids)
    pred = fxpipe.plan.predict_memory(pipe, run_type="generate", batch=4, max_length=256)
    steps = pipe._generation_steps(4, 256)
    pipe.generate(ids, max_new_tokens=1)               # the prefill
    for d in pipe.devices:
        d.reset_peak()
    mask = torch.ones(4, steps.module.length, dtype=torch.long)
    steps(ids[:, -1:], mask, torch.full((4, 1), 100), torch.tensor([100]))  # a decode step
    kv = sum(b.numel() * b.element_size() for n, b in steps.module.named_buffers() if ".kv." in f".{n}")
    assert kv == 4 * 2 * 4 * 2 * 256 * 32 * 4           # layers, k/v, batch, heads, length, dim, fp32
    # the plan is the planner's for profiled times, so any split; a stage's predicted peak
    # counts the weights of the stage its device prefetches meanwhile, reached if that
    # prefetch lands while the stage still holds its own weights and workspace (a copy
    # as fast as a GPU's), else less, by up to the prefetched weights
    weights = fxpipe.plan.chain_memory(steps.compiled()[1].layers).params
    for dev in range(len(pipe.devices)):
        mine = [s for s in pred.stages if s.device == dev]
        for kind, measured in (("params", pipe.devices[dev].peak_bytes("params")),
                               (None, pipe.devices[dev].peak_bytes())):
            high = [s.bytes[kind] if kind else s.total for s in mine]
            low = [h - sum(weights[i] for i in s.prefetch or ()) for h, s in zip(high, mine)]
            assert max(low) <= measured <= max(high), (dev, kind, mine, measured)


def test_bad_input_is_refused_and_changes_nothing():
    model = causal_lm("llama")
    ids, mask, pad = prompts(model)
    pipe = compiled(model, ids)
    state = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match="max_new_tokens must be an int >= 1"):
        pipe.generate(ids, mask, max_new_tokens=0)
    with pytest.raises(ValueError, match="more than the model's 64"):
        pipe.generate(ids, mask, max_new_tokens=60)
    with pytest.raises(ValueError, match="no attention_mask was given"):
        pipe.generate(ids, max_new_tokens=2, pad_token_id=pad)
    right = torch.ones_like(mask)
    right[0, -2:] = 0
    with pytest.raises(ValueError, match="left padding"):
        pipe.generate(ids, right, max_new_tokens=2)
    with pytest.raises(ValueError, match="integer tensor"):
        pipe.generate(ids.float(), mask, max_new_tokens=2)
    with pytest.raises(ValueError, match="kv_cache must be one of"):
        pipe.generate(ids, mask, max_new_tokens=2, kv_cache="gpu")
    with pytest.raises(ValueError, match=r"num_microbatch must be an int in \[1, 3\]"):
        pipe.generate(ids, mask, max_new_tokens=2, num_microbatch=4)
    assert pipe._generation == []
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k]), k


@pytest.mark.parametrize("what", ["base", "sequential"])
def test_a_model_without_a_causal_lm_head_says_what_is_needed(what):
    if what == "base":
        model = causal_lm("llama").model      # LlamaModel: hidden states, no logits
        ids = torch.randint(3, 64, (2, 5))
        match = "causal LM head"
    else:
        model = torch.nn.Sequential(torch.nn.Embedding(64, 8), torch.nn.Linear(8, 64))
        ids = torch.randint(3, 64, (2, 5))
        match = "Hugging Face config"
    pipe = compiled(model, ids)
    with pytest.raises(TypeError, match=match):
        pipe.generate(ids, max_new_tokens=2)
    with pytest.raises(TypeError, match=match):
        pipe.program("generate")


def test_generation_config_settings_fxpipe_does_not_apply_raise():
    model = causal_lm("llama")
    ids, mask, pad = prompts(model)
    model.generation_config.repetition_penalty = 1.3
    with pytest.raises(NotImplementedError, match="repetition_penalty=1.3"):
        compiled(model, ids).generate(ids, mask, max_new_tokens=2)


@pytest.mark.parametrize("name", ["gemma2", "mistral"])
def test_sliding_window_layers_past_their_window(name):
    common = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  sliding_window=4, pad_token_id=0)
    torch.manual_seed(0)
    model = (T.Gemma2ForCausalLM(T.Gemma2Config(**common, head_dim=8)) if name == "gemma2"
             else T.MistralForCausalLM(T.MistralConfig(**common))).eval()
    ids, mask, pad = prompts(model)
    ref = hf_generate(model, ids, mask, max_new_tokens=12, pad_token_id=pad)   # 18 > 4 positions
    assert torch.equal(compiled(model, ids).generate(ids, mask, max_new_tokens=12), ref)


def test_after_bf16_training_generates_what_the_bf16_model_predicts():
    """``param_dtype=torch.bfloat16``: a streamed AdamW step on the fp32 masters, then
    ``generate`` on the same pipe, in bf16 (its KV cache too). Each new token is the
    argmax of the bf16 reference model's logits (the trained masters' bf16 copy, buffers
    as they are) up to bf16's rounding: teacher-forced on the generated sequence, the
    chosen token's logit is within 0.05 of the largest."""
    model = causal_lm("llama")
    ids, mask, pad = prompts(model)
    pipe = compiled(model, ids, param_dtype=torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    labels = torch.randint(0, model.config.vocab_size, ids.shape)
    pipe.forward_backward((ids,), label=labels, optimizer=opt,
                          loss_fn=lambda out, y: F.cross_entropy(out.logits.flatten(0, 1).float(),
                                                                 y.flatten()))
    assert all(p.dtype == torch.float32 for p in model.parameters())
    model.eval()
    out = pipe.generate(ids, mask, max_new_tokens=6, pad_token_id=pad)
    assert pipe._generation[0].module.kv[0].k.dtype == torch.bfloat16   # the KV cache
    low = copy.deepcopy(model)
    for p in low.parameters():
        p.data = p.data.to(torch.bfloat16)
    full = torch.cat([mask, torch.ones(mask.shape[0], 6, dtype=mask.dtype)], 1)
    with torch.no_grad():
        logits = low(out, attention_mask=full,
                     position_ids=(full.cumsum(-1) - 1).clamp(min=0)).logits.float()
    for t in range(ids.shape[1], out.shape[1]):
        step = logits[:, t - 1]
        chosen = step.gather(1, out[:, t:t + 1]).squeeze(1)
        assert (chosen >= step.max(-1).values - 0.05).all(), (t, chosen, step.max(-1).values)
    pipe.close()


# --------------------------------------------------------------------------- the KV cache

def cuda_sim(n: int = 2, memory_limit=None):
    return [fxpipe.VirtualDevice(semantics="cuda", memory_limit=memory_limit) for _ in range(n)]


def kv_bytes(steps) -> int:
    return sum(b.numel() * b.element_size() for n, b in steps.module.named_buffers()
               if ".kv." in f".{n}")


# CI runs one model of each kind (GQA and rotary, GPT-2's fused projections and absolute
# positions, a mixture of experts); FXPIPE_HF_MATRIX=all runs the whole list
ON_DEVICE = CAUSAL if os.environ.get("FXPIPE_HF_MATRIX") == "all" else ["llama", "gpt2", "qwen3_moe"]


@pytest.mark.parametrize("name", ON_DEVICE)
def test_the_cache_on_the_device_equals_transformers_on_cuda_sim(name):
    """``kv_cache="device"``, the batch in microbatches, on strict cuda-sim (a compute
    reading a tensor not on its device raises): token for token HF's greedy output."""
    model = causal_lm(name)
    ids, mask, pad = prompts(model)
    ref = hf_generate(model, ids, mask, max_new_tokens=6, pad_token_id=pad)
    pipe = compiled(model, ids, cuda_sim())
    out = pipe.generate(ids, mask, max_new_tokens=6, pad_token_id=pad, kv_cache="device",
                        num_microbatch=2)
    assert torch.equal(out, ref)
    steps = pipe._generation[0]
    assert steps.placement.resident == {
        s for s, st in steps.executables()[1].stages.items() if any(".kv." in f".{f}" for f in st.params)}
    for d in pipe.devices:                      # the call's end freed the resident caches
        assert d.resident_bytes("cache") == 0
    # the same pipe, the cache on the host: the same tokens
    assert torch.equal(pipe.generate(ids, mask, max_new_tokens=6, pad_token_id=pad), ref)


def test_device_cache_moves_fewer_bytes_and_host_writes_back_only_new_positions():
    model = causal_lm("llama")
    ids, mask, pad = prompts(model)
    pipe = compiled(model, ids, cuda_sim())
    moved = {}
    for kv in ("host", "device"):
        pipe.generate(ids, mask, max_new_tokens=4, pad_token_id=pad, kv_cache=kv)
        st = pipe._generation[0].pipe.stats()        # the last decode step
        moved[kv] = (st["h2d_bytes_params"], st["d2h_bytes_cache"])
    steps = pipe._generation[0]
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    one_position = cfg.num_hidden_layers * 2 * ids.shape[0] * cfg.num_key_value_heads * head_dim * 4
    assert moved["host"][1] == one_position           # not the whole cache: the new position
    assert moved["device"][1] == 0                    # nothing written back
    assert moved["host"][0] - moved["device"][0] == kv_bytes(steps)   # the cache stays up
    assert sum(moved["device"]) < sum(moved["host"])


def test_microbatched_decode_uploads_each_stage_once_per_step():
    model = causal_lm("llama")
    ids, mask, pad = prompts(model)
    pipe = compiled(model, ids, ["cpu"] * 3)
    ref = hf_generate(model, ids, mask, max_new_tokens=5, pad_token_id=pad)
    uploads = {}
    for m in (1, 3):
        assert torch.equal(pipe.generate(ids, mask, max_new_tokens=5, pad_token_id=pad,
                                         num_microbatch=m), ref)
        steps = pipe._generation[0]
        st = steps.pipe.stats()
        uploads[m] = st["h2d_bytes_params"]
        assert steps.executables()[1].program.num_microbatches == m
    assert uploads[1] == uploads[3]                   # weights once per step for all rows


def test_predicted_resident_cache_matches_the_devices():
    """``predict_memory(run_type="generate", kv_cache="device")``: each device's resident
    cache exactly, and its decode step's peak within 2 % of what the devices count (the
    prefill, which runs with the cache streamed, is left out: peaks reset after it)."""
    from fxpipe.generation import _row_ranges
    from fxpipe.kv_placement import place_cache
    from fxpipe.runtime.host.scratch import ResidentBuffers, ScratchUse
    model = small_llama(128, 256, 4)
    ids = torch.randint(3, 256, (4, 100))
    pipe = compiled(model, ids, cuda_sim())
    pred = fxpipe.plan.predict_memory(pipe, run_type="generate", batch=4, max_length=128,
                                      kv_cache="device", num_microbatch=2)
    assert "cache" in str(pred)
    steps = pipe._generation_steps(4, 128)
    rows = _row_ranges(4, 2)
    resident = ResidentBuffers(place_cache(steps, "device", 2).kept)
    mask = torch.ones(4, 128, dtype=torch.long)
    steps(ids, mask, torch.arange(100).expand(4, 100), torch.arange(100),
          use=ScratchUse(rows, written=(0, 100)))                         # the prefill
    for d in pipe.devices:
        d.reset_peak()
    token = ids[:, -1:]
    for t in range(100, 103):                                             # decode steps
        steps(token, mask, torch.full((4, 1), t), torch.tensor([t]),
              use=ScratchUse(rows, written=(t, t + 1), resident=resident))
    assert sum(resident.device_bytes().values()) == kv_bytes(steps)
    for dev, device in enumerate(pipe.devices):
        mine = [s for s in pred.stages if s.device == dev]
        assert max(s.bytes["cache"] for s in mine) == device.peak_bytes("cache")
        predicted, measured = max(s.total for s in mine), device.peak_bytes()
        assert abs(predicted - measured) <= 0.02 * measured, (dev, predicted, measured)
    resident.close()
    assert all(d.resident_bytes() == 0 for d in pipe.devices)


def test_the_decode_is_re_cut_so_the_caches_fit(monkeypatch):
    """One 12 MB device, 24 sequences: the step pipe's plan (stages of 2-3 layers, cut for
    weights streamed with their caches) peaks over the limit with every cache resident,
    so ``"device"`` runs the decode re-cut for the caches (``kv_placement.cache_plan``):
    smaller stages, two of them in the weight slots beside all the caches. It equals HF,
    stays under the limit, and ``pipe.program("generate")`` prints the re-cut. (Issuing
    is priced high so the plans depend on memory alone, not on this CPU's layer times.)"""
    from fxpipe.generation import cache_tensors
    from fxpipe.kv_placement import _decode, _with_cache
    monkeypatch.setattr("fxpipe.passes.chain_costs.HOST_MS_PER_ACTION", 1000.0)
    model = small_llama(128, 512, 8)
    ids = torch.randint(3, 256, (24, 20))
    mask = torch.ones_like(ids)
    ref = hf_generate(model, ids, mask, max_new_tokens=4)
    limit = 12_000_000
    pipe = compiled(model, ids, cuda_sim(1, memory_limit=limit))
    out = pipe.generate(ids, mask, max_new_tokens=4, kv_cache="device")
    assert torch.equal(out, ref)
    steps = pipe._generation[0]
    placement = steps.placement
    exe, base, caches = _decode(steps, 1, None)                       # the step pipe's plan
    every = {s for s in caches if caches[s]}
    assert _with_cache(base, exe, caches, every).peak > limit         # would not hold them
    recut = steps.executables()[1]
    assert placement.plan is not None and len(recut.stages) > len(exe.stages)
    assert placement.resident == {s for s, st in recut.stages.items() if cache_tensors(steps, st)}
    assert placement.prediction.peak <= limit
    assert pipe.devices[0].peak_bytes() <= limit
    text = str(pipe.program("generate"))
    assert "the decode re-cut for its resident caches (" in text


def test_a_long_prompt_is_prefilled_in_chunks_that_fit(monkeypatch):
    """Four 600-token prompts on two 4 MB devices: the whole prefill would not fit (its
    attention and MLP activations grow with the prompt; it ran out of memory before), so
    ``kv_placement.prefill_chunk`` splits it into the largest chunks predicted to fit,
    each a prefill call at its cache positions. Tokens equal HF's, the devices stay under
    their limit, and the printed program says so."""
    model = small_llama(64, 128, 4, 1024)
    ids = torch.randint(3, 256, (4, 600))
    mask = torch.ones_like(ids)
    ref = hf_generate(model, ids, mask, max_new_tokens=4)
    limit = 4_000_000
    pipe = compiled(model, ids[:, :8], cuda_sim(memory_limit=limit))
    assert torch.equal(pipe.generate(ids, mask, max_new_tokens=4), ref)
    steps = pipe._generation[0]
    assert steps.chunk is not None and 1 < steps.chunk < 600
    assert max(d.peak_bytes() for d in pipe.devices) <= limit
    assert f"# prefill: the prompts through every stage, in chunks of at most {steps.chunk} " \
        "tokens" in str(pipe.program("generate"))
    # in microbatches (the cache positions whole, the rows split) with the cache resident
    assert torch.equal(pipe.generate(ids, mask, max_new_tokens=4, kv_cache="device",
                                     num_microbatch=2), ref)
    assert max(d.peak_bytes() for d in pipe.devices) <= limit
    # the whole prompt in one prefill call does not fit
    monkeypatch.setattr(type(pipe), "_prefill_chunk", lambda self, steps, prompt, m: prompt)
    with pytest.raises(fxpipe.DeviceMemoryError, match="exceeds the memory limit"):
        pipe.generate(ids, mask, max_new_tokens=4)


def test_a_cache_that_cannot_fit_is_refused_and_auto_keeps_what_fits():
    """16 sequences whose caches outweigh the layers' weights, two devices of 1.6 MB:
    every stage's cache on its device does not fit (refused with the numbers, before
    anything runs); ``"auto"`` keeps some, streams the others and equals HF."""
    model = small_llama(64, 128, 6)
    ids = torch.randint(3, 256, (16, 20))
    mask = torch.ones_like(ids)
    ref = hf_generate(model, ids, mask, max_new_tokens=8)
    pipe = compiled(model, ids, cuda_sim(memory_limit=1_600_000))
    state = copy.deepcopy(model.state_dict())
    with pytest.raises(fxpipe.DeviceMemoryError,
                       match=r"kv_cache='device'.*would hold the KV cache of stages \[2, 4, 6\]"
                             r".* > memory_limit 1.60 MB\. Nothing ran"):
        pipe.generate(ids, mask, max_new_tokens=8, kv_cache="device")
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k]), k
    assert all(d.resident_bytes() == 0 for d in pipe.devices)
    out = pipe.generate(ids, mask, max_new_tokens=8, kv_cache="auto")
    assert torch.equal(out, ref)
    placement = pipe._generation[0].placement
    stages = pipe._generation[0].executables()[1].stages
    with_cache = {s for s, st in stages.items() if any(".kv." in f".{f}" for f in st.params)}
    assert placement.resident and placement.resident < with_cache   # some, not all
    assert placement.prediction.peak <= 0.9 * 1_600_000
    assert max(d.peak_bytes() for d in pipe.devices) <= 1_600_000
