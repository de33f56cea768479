"""``fxpipe.compile(model, ..., weights=PATH)`` (``fxpipe.runtime.host.weights``): a model on the
meta device bound to a safetensors checkpoint trains equal to the same model loaded
eagerly (``from_pretrained``; loss and every gradient), Hugging Face Llama (tied
embeddings) and Mixtral (experts saved one by one, converted); frozen parameters stay
read-only file maps that no host buffer or page-locked copy duplicates (uploads stream
through a bounded ring on cuda-sim); ``pipe.save_pretrained`` writes sharded safetensors
that load back both ways; a mis-fitting checkpoint raises one error listing every key,
before anything is bound; and a frozen base keeps the process's anonymous memory
(``RssAnon``) far below its size (in a subprocess)."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn

import fxpipe
from fxpipe.runtime.devices import pinned
from fxpipe.runtime.host.params import HostParams
from fxpipe.runtime.host.weights import (WeightsError, file_backed, load, read_checkpoint,
                                    save_pretrained)
from tests.models import init_like_training

T = pytest.importorskip("transformers")
V = 64
DENSE = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
             use_cache=False)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def config(name: str, **kw):
    if name == "llama":
        return T.LlamaConfig(**{**DENSE, "tie_word_embeddings": True, **kw})
    return T.MixtralConfig(**{**DENSE, "num_experts_per_tok": 2, "num_local_experts": 4, **kw})


def build(name: str, cfg=None):
    cls = T.LlamaForCausalLM if name == "llama" else T.MixtralForCausalLM
    return cls(cfg or config(name))


def freeze(model: nn.Module, name: str) -> None:
    """A LoRA-like split: most of the base frozen; trainable: the second block (and the
    tied embedding) for Llama, the routers for Mixtral."""
    for n, p in model.named_parameters():
        train = ("layers.1." in n or "embed_tokens" in n) if name == "llama" else ".mlp.gate." in n
        p.requires_grad_(train)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Per architecture, a tiny random model saved with ``save_pretrained`` (sharded for
    Llama: an index and several files)."""
    out = {}
    for name in ("llama", "mixtral"):
        torch.manual_seed(0)
        d = tmp_path_factory.mktemp(name)
        model = init_like_training(build(name))
        model.save_pretrained(d, max_shard_size="40KB" if name == "llama" else "5GB")
        out[name] = str(d)
    return out


def text():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, V, (4, 8), generator=g)
    mask = torch.ones(4, 8, dtype=torch.long)
    mask[1, 6:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids}


def meta(name: str, cfg=None) -> nn.Module:
    with torch.device("meta"):
        model = build(name, cfg)
    return model.eval()


def eager(name: str, path: str) -> nn.Module:
    cls = T.LlamaForCausalLM if name == "llama" else T.MixtralForCausalLM
    return cls.from_pretrained(path).eval()


def assert_step_equals(pipe, model, ref, kw):
    loss = pipe.forward_backward((), kw, loss_fn=lambda out, _: out.loss)
    ref_loss = ref(**kw).loss
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach(), atol=1e-5, rtol=1e-5)
    refs = dict(ref.named_parameters())
    for n, p in model.named_parameters():
        assert (p.grad is None) == (refs[n].grad is None), n
        if p.grad is not None:
            torch.testing.assert_close(p.grad, refs[n].grad, atol=1e-5, rtol=1e-5, msg=n)


# -- training equals eager -------------------------------------------------------------

@pytest.mark.parametrize("semantics, pin_budget", [("sync", None), ("cuda", None), ("cuda", "0")])
@pytest.mark.parametrize("name", ["llama", "mixtral"])
def test_meta_model_with_weights_trains_equal_to_eager(name, semantics, pin_budget, checkpoints,
                                                       monkeypatch):
    """On cuda-sim the frozen uploads read the file's windows registered for DMA (emulated)
    or, with no budget for that (``FXPIPE_FILE_PIN_BYTES=0``), go through the ring."""
    if pin_budget is not None:
        monkeypatch.setenv("FXPIPE_FILE_PIN_BYTES", pin_budget)
    path = checkpoints[name]
    model, ref = meta(name), eager(name, path)
    freeze(model, name)
    freeze(ref, name)
    kw = text()
    pipe = fxpipe.compile(model, example_kwargs=kw, weights=path,
                          devices=[fxpipe.VirtualDevice(semantics=semantics) for _ in range(2)],
                          config=fxpipe.RunConfig(num_microbatch=2))
    assert not any(t.is_meta for t in model.state_dict().values())
    frozen = {n: p for n, p in model.named_parameters() if not p.requires_grad}
    mapped = {n for n, p in frozen.items() if file_backed(p) is not None}
    if name == "llama":   # every frozen one maps the file; the tied pair stays one tensor
        assert mapped == set(frozen)
        assert model.lm_head.weight is model.model.embed_tokens.weight
        assert model.model.embed_tokens.weight.requires_grad
    else:                 # the experts are converted from the per-expert layout
        assert mapped == {n for n in frozen if ".experts." not in n} and mapped
    assert not any(file_backed(p) for p in model.parameters() if p.requires_grad)
    assert_step_equals(pipe, model, ref, kw)
    host = HostParams.of(model)
    flat = {f.untyped_storage().data_ptr() for f in host.flats}
    for n in mapped:   # still the file map: not moved into a host buffer, not staged
        assert file_backed(frozen[n]) is not None
        assert frozen[n].untyped_storage().data_ptr() not in flat, n
    assert not any(file_backed(host.slots[k].tensor) for k, _ in host._staged), "staged copy"
    windows = {s: n for s, (n, _, _) in pinned._files.items()
               if any(m.base <= s < m.base + m.size for m in maps_of(frozen[n] for n in mapped))}
    if semantics == "cuda" and pin_budget is None:   # registered (emulated): read in place
        assert windows and all(pinned.is_pinned(frozen[n]) for n in mapped)
        assert pipe.stats()["host_pinned_bytes"] >= sum(map(pinned.reserved, windows.values()))
        assert host.ring is None or host.ring.nbytes == 0
    elif semantics == "cuda":   # no budget to register: the frozen uploads go through the ring
        assert not windows
        assert host.ring is not None and 0 < host.ring.nbytes <= host.ring.capacity
        mapped_bytes = sum(frozen[n].numel() * frozen[n].element_size() for n in mapped)
        assert host.ring.capacity <= mapped_bytes + 2 * len(mapped) * pinned.PAGE
    else:
        assert host.ring is None and not windows
    pipe.close()


def maps_of(tensors):
    return {id(m): m for m in map(file_backed, tensors)}.values()


def test_only_the_windows_read_are_registered_within_the_budget(tmp_path, monkeypatch):
    """#41 item 2: a shard is not page-locked whole. Each upload registers the window it
    reads (``pinned.FILE_WINDOW``), never past ``FXPIPE_FILE_PIN_BYTES`` (the rest goes
    through the ring), counted in ``host_pinned_bytes``, unregistered with the map."""
    gc.collect()   # the budget is the process's: earlier tests' maps still alive use some
    earlier = sum(n for n, _, _ in pinned._files.values())
    monkeypatch.setattr(pinned, "FILE_WINDOW", 4 * pinned.PAGE)
    monkeypatch.setenv("FXPIPE_FILE_PIN_BYTES", str(earlier + 8 * pinned.PAGE))   # 2 windows
    torch.manual_seed(0)
    save_pretrained(mlp(width=128), tmp_path)   # 4 x 64 KiB weights + a head, one shard
    with torch.device("meta"):
        model = mlp(width=128)
    model.requires_grad_(False)
    model[-1].requires_grad_(True)
    x = torch.randn(8, 128)
    pipe = fxpipe.compile(model, example_inputs=(x,), weights=str(tmp_path),
                          devices=[fxpipe.VirtualDevice(semantics="cuda") for _ in range(2)])
    pipe.forward_backward((x,), label=torch.randn(8, 4), loss_fn=nn.functional.mse_loss)
    (fmap,) = maps_of(p for p in model.parameters() if not p.requires_grad)
    windows = {s: n for s, (n, _, _) in pinned._files.items() if fmap.base <= s < fmap.base + fmap.size}
    assert len(windows) == 2 and sum(windows.values()) <= 8 * pinned.PAGE < fmap.size
    host = HostParams.of(model)
    assert host.ring is not None and host.ring.nbytes > 0   # what did not fit the budget
    assert pipe.stats()["host_pinned_bytes"] >= 8 * pinned.PAGE + host.ring.nbytes
    base, size = fmap.base, fmap.size
    pipe.close()
    del pipe, model, host, fmap
    gc.collect()
    assert not any(base <= s < base + size for s in pinned._files)   # gone with the map


def mlp(width=32, depth=4):
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(depth)],
                         nn.Linear(width, 4))


@pytest.mark.parametrize("semantics", ["sync", "cuda"])
def test_param_dtype_converts_the_file_at_upload(semantics, tmp_path):
    """Devices compute in bf16 from the fp32 file map (converted as it is uploaded, through
    the ring on cuda-sim): the same loss and gradients, bitwise, as a pipe over the
    eagerly loaded model with the same param_dtype."""
    torch.manual_seed(0)
    src = mlp()
    save_pretrained(src, tmp_path)
    with torch.device("meta"):
        model = mlp()
    for m in (model, src):
        for p in m[:3].parameters():
            p.requires_grad_(False)
    x = torch.randn(8, 32)
    pipes = [fxpipe.compile(m, example_inputs=(x,), param_dtype=torch.bfloat16,
                            devices=[fxpipe.VirtualDevice(semantics=semantics) for _ in range(2)],
                            **extra)
             for m, extra in ((model, {"weights": tmp_path}), (src, {}))]
    losses = [p.forward_backward((x,), loss_fn=lambda out, _: out.square().mean()) for p in pipes]
    torch.testing.assert_close(losses[0], losses[1], atol=0, rtol=0)
    assert file_backed(model[0][0].weight) is not None and model[0][0].weight.dtype == torch.float32
    for (n, p), q in zip(model.named_parameters(), src.parameters()):
        assert (p.grad is None) == (q.grad is None), n
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, atol=0, rtol=0, msg=n)
    for p in pipes:
        p.close()


def test_a_base_model_loads_from_a_checkpoint_with_a_head(checkpoints):
    """Hugging Face's prefix rule: LlamaModel from LlamaForCausalLM's files (``model.``
    dropped, the head's keys ignored)."""
    with torch.device("meta"):
        base = T.LlamaModel(config("llama"))
    for p in base.parameters():
        p.requires_grad_(False)
    loaded = load(base, checkpoints["llama"])
    ref = eager("llama", checkpoints["llama"]).model
    for (n, a), b in zip(base.state_dict().items(), ref.state_dict().values()):
        assert torch.equal(a, b), n
    assert loaded.ignored == [] and not loaded.converted   # the head is the tied embedding
    assert len(loaded.file_backed) == len(list(base.parameters()))


# -- saving --------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["llama", "mixtral"])
def test_save_pretrained_writes_shards_that_load_back_both_ways(name, checkpoints, tmp_path):
    path = checkpoints[name]
    model = meta(name)
    freeze(model, name)
    kw = text()
    pipe = fxpipe.compile(model, example_kwargs=kw, weights=path, devices=["cpu", "cpu"])
    pipe.forward_backward((), kw, loss_fn=lambda out, _: out.loss)
    with torch.no_grad():   # a training step changed the trainable ones
        for p in model.parameters():
            if p.requires_grad:
                p.sub_(0.1 * p.grad)
    files = pipe.save_pretrained(tmp_path, max_shard_size=30_000)
    names = sorted(os.listdir(tmp_path))
    assert "model.safetensors.index.json" in names and "config.json" in names
    shards = [n for n in names if n.endswith(".safetensors")]
    assert len(shards) > 1 and sorted(os.path.basename(f) for f in files) == \
        sorted(shards + ["model.safetensors.index.json"])
    index = json.load(open(tmp_path / "model.safetensors.index.json"))
    entries = read_checkpoint(tmp_path)
    assert set(index["weight_map"]) == set(entries)
    if name == "llama":   # the tied pair is written once
        assert "model.embed_tokens.weight" in entries and "lm_head.weight" not in entries
    want = model.state_dict()
    hf = eager(name, str(tmp_path))
    for k, v in hf.state_dict().items():
        assert torch.equal(v, want[k]), k
    again = meta(name)
    freeze(again, name)
    loaded = load(again, tmp_path)
    assert not loaded.converted   # the model's own layout: every frozen tensor maps the file
    for k, v in again.state_dict().items():
        assert torch.equal(v, want[k]), k
    pipe.close()


# -- errors ------------------------------------------------------------------------

def test_missing_unexpected_and_misshaped_keys_raise_one_error_before_loading(checkpoints, tmp_path):
    from safetensors.torch import save_file
    ref = eager("llama", checkpoints["llama"])
    sd = {k: v.contiguous() for k, v in ref.state_dict().items() if k != "lm_head.weight"}
    del sd["model.layers.0.mlp.up_proj.weight"]
    sd["model.layers.0.extra.weight"] = torch.zeros(2)
    sd["model.norm.weight"] = torch.zeros(5)
    save_file(sd, tmp_path / "model.safetensors")
    model = meta("llama")
    with pytest.raises(WeightsError) as info:
        fxpipe.compile(model, example_kwargs=text(), weights=tmp_path)
    msg = str(info.value)
    assert f"weights={str(tmp_path)!r} does not fit the model (LlamaForCausalLM); " \
           "nothing was loaded:" in msg
    assert "- 1 missing (on the meta device, not in the checkpoint): " \
           "'model.layers.0.mlp.up_proj.weight'" in msg
    assert "- 1 unexpected (in the checkpoint, not in the model): 'model.layers.0.extra.weight'" in msg
    assert "- 1 of another shape: model.norm.weight: the model has (32,), " \
           "'model.norm.weight' in model.safetensors is (5,)" in msg
    assert all(p.is_meta for p in model.parameters())   # nothing was bound


def test_a_wrong_config_lists_every_misshaped_key(checkpoints):
    model = meta("llama", config("llama", intermediate_size=48))
    with pytest.raises(ValueError, match=r"- 6 of another shape: model.layers.0.mlp.gate_proj.weight: "
                                         r"the model has \(48, 32\), 'model.layers.0.mlp.gate_proj"
                                         r".weight' in model-0000\d-of-0000\d.safetensors is \(64, 32\)"):
        load(model, checkpoints["llama"])


def test_paths_without_a_safetensors_checkpoint(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"x")
    (tmp_path / "config.json").write_text("{}")
    model = meta("llama")
    with pytest.raises(FileNotFoundError, match=r"holds no safetensors checkpoint \(model.safetensors"
                                                r".index.json, model.safetensors or \*.safetensors\); "
                                                r"it has: config.json, pytorch_model.bin"):
        fxpipe.compile(model, example_kwargs=text(), weights=tmp_path)
    with pytest.raises(FileNotFoundError, match="no such file or directory"):
        load(model, tmp_path / "nowhere")
    (tmp_path / "model.safetensors").write_bytes(b"\xff" * 16)
    with pytest.raises(ValueError, match="is not a safetensors file"):
        load(model, tmp_path)


def test_a_non_persistent_meta_buffer_outside_hugging_face_is_named(tmp_path):
    from safetensors.torch import save_file

    class Rotary(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)
            self.register_buffer("table", torch.ones(3), persistent=False)
    with torch.device("meta"):
        model = Rotary()
    save_file({"lin.weight": torch.ones(2, 2), "lin.bias": torch.ones(2)},
              tmp_path / "model.safetensors")
    with pytest.raises(WeightsError, match=r"1 non-persistent buffers on the meta device \(no "
                                           r"checkpoint holds them\): 'table'"):
        load(model, tmp_path)


def test_unfreezing_a_file_backed_parameter_after_compile_is_refused(checkpoints):
    model = meta("llama")
    freeze(model, "llama")
    kw = text()
    pipe = fxpipe.compile(model, example_kwargs=kw, weights=checkpoints["llama"],
                          devices=["cpu", "cpu"])
    model.model.layers[0].mlp.up_proj.weight.requires_grad_(True)
    with pytest.raises(ValueError, match=r"'model.layers.0.mlp.up_proj.weight' is a read-only "
                                         r"memory map of .*model-0000\d-of-0000\d.safetensors .* "
                                         r"Set requires_grad before fxpipe.compile"):
        pipe.forward_backward((), kw, loss_fn=lambda out, _: out.loss)
    pipe.close()


# -- anonymous memory --------------------------------------------------------------------

RSS_SCRIPT = """
import os, sys, torch, torch.nn as nn, fxpipe
def anon():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
W, DEPTH, path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
torch.set_num_threads(1)
with torch.device("meta"):
    model = nn.Sequential(*[nn.Linear(W, W) for _ in range(DEPTH)], nn.Linear(W, 8))
for p in model[:DEPTH].parameters():
    p.requires_grad_(False)
x = torch.randn(4, W)
before = anon()
device = fxpipe.VirtualDevice(memory_limit=4 * W * W * 4)
pipe = fxpipe.compile(model, example_inputs=(x,), weights=path, devices=[device])
loss = pipe.forward_backward((x,), loss_fn=lambda out, _: out.square().mean())
device.empty_cache()   # the virtual device's memory (a GPU's, on a GPU) given back
print(anon() - before)
"""


def test_a_frozen_base_stays_out_of_anonymous_memory(tmp_path):
    """A 256 MiB frozen fp32 base compiled from its file on the meta device and trained
    one step: the process's anonymous memory grows by less than 0.35 of it (with the
    virtual device's own memory, a GPU's on a GPU, given back: malloc returns large
    blocks to the system at once under ``MALLOC_MMAP_THRESHOLD_``)."""
    from safetensors.torch import save_file
    width, depth = 2048, 16
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for i in range(depth):
        tensors[f"{i}.weight"] = torch.randn(width, width, generator=g) / width ** 0.5
        tensors[f"{i}.bias"] = torch.zeros(width)
    tensors[f"{depth}.weight"] = torch.zeros(8, width)
    tensors[f"{depth}.bias"] = torch.zeros(8)
    save_file(tensors, tmp_path / "model.safetensors")
    frozen = sum(t.numel() * 4 for k, t in tensors.items() if not k.startswith(f"{depth}."))
    del tensors
    env = dict(os.environ, PYTHONPATH=ROOT, MALLOC_MMAP_THRESHOLD_=str(1 << 17))
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(RSS_SCRIPT), str(width),
                          str(depth), str(tmp_path)], capture_output=True, text=True, env=env,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    growth = int(out.stdout.split()[-1])
    assert growth < 0.35 * frozen, f"RssAnon grew {growth / 2**20:.0f} MiB for a " \
                                   f"{frozen / 2**20:.0f} MiB frozen base"


# -- a LoRA base ----------------------------------------------------------------------

@pytest.mark.parametrize("param_dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_peft_lora_on_a_meta_base_trains_equal_to_eager(checkpoints, param_dtype):
    """PEFT's names map to the base checkpoint's (``base_model.model.``, ``.base_layer``);
    the adapters made on the meta device are initialized as PEFT does; the whole base
    stays file-backed; a step equals eager PEFT over ``from_pretrained`` (same adapter
    values). With ``param_dtype=bf16`` (the base converted as it is uploaded), bitwise
    a pipe over the eagerly loaded PEFT model with the same ``param_dtype``."""
    peft = pytest.importorskip("peft")
    lora = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                init_lora_weights="gaussian")
    torch.manual_seed(0)
    model = peft.get_peft_model(meta("llama"), peft.LoraConfig(**lora)).eval()
    kw = text()
    devices = lambda: [fxpipe.VirtualDevice(semantics="cuda") for _ in range(2)]  # noqa: E731
    pipe = fxpipe.compile(model, example_kwargs=kw, weights=checkpoints["llama"],
                          devices=devices(), param_dtype=param_dtype)
    ref = peft.get_peft_model(eager("llama", checkpoints["llama"]), peft.LoraConfig(**lora)).eval()
    adapters = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert adapters and all("lora_" in n for n in adapters)
    assert all(file_backed(p) for n, p in model.named_parameters() if n not in adapters)
    assert not any(file_backed(p) for p in adapters.values())
    assert all(p.abs().sum() > 0 for n, p in adapters.items() if "lora_A" in n)
    ref.load_state_dict({n: p.detach() for n, p in adapters.items()}, strict=False)
    if param_dtype is None:
        assert_step_equals(pipe, model, ref, kw)
    else:
        ref_pipe = fxpipe.compile(ref, example_kwargs=kw, devices=devices(),
                                  param_dtype=param_dtype)
        own = lambda out, _: out.loss  # noqa: E731
        loss, ref_loss = (p.forward_backward((), kw, loss_fn=own) for p in (pipe, ref_pipe))
        assert loss.dtype == torch.float32
        torch.testing.assert_close(loss, ref_loss, atol=0, rtol=0)
        refs = dict(ref.named_parameters())
        for n, p in adapters.items():
            assert p.dtype == torch.float32 and p.grad.dtype == torch.float32, n
            torch.testing.assert_close(p.grad, refs[n].grad, atol=0, rtol=0, msg=n)
        ref_pipe.close()
    pipe.close()


def test_saving_again_replaces_the_shards_of_an_earlier_save(tmp_path):
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    save_pretrained(model, tmp_path, max_shard_size=10_000)
    assert len([n for n in os.listdir(tmp_path) if n.endswith(".safetensors")]) == 4
    save_pretrained(model, tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["model.safetensors"]
    with torch.device("meta"):
        again = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    load(again, tmp_path)
    for a, b in zip(again.state_dict().values(), model.state_dict().values()):
        assert torch.equal(a, b)


def test_the_ring_is_bounded_and_reuses_a_block_once_its_copy_is_done():
    ring = pinned.Ring(capacity=4 * pinned.PAGE, emulate=True)
    a = ring.stage(torch.arange(1000.0), torch.float32)          # one page
    b = ring.stage(torch.arange(2000.0), torch.bfloat16)         # one page (converted)
    assert pinned.is_pinned(a) and torch.equal(b, torch.arange(2000.0).bfloat16())
    assert ring.stage(torch.ones(3 * pinned.PAGE // 4), torch.float32) is None   # full: no wait
    ptr = a.data_ptr()
    del a                                                        # its copy took it: free again
    c = ring.stage(torch.ones(10), torch.float32)
    assert c.data_ptr() == ptr and ring.nbytes == 2 * pinned.PAGE

    class Pending:                                               # a CUDA event not yet reached
        done = False

        def query(self):
            return self.done
    event = Pending()
    ring.hold(c, event)
    del c
    d = ring.stage(torch.ones(10), torch.float32)
    assert d.data_ptr() != ptr                                   # held back by the event
    event.done = True
    del d
    assert ring.stage(torch.ones(10), torch.float32).data_ptr() == ptr   # its copy is done
    assert ring.nbytes <= ring.capacity


def test_a_model_dtype_other_than_the_files_is_converted_when_binding(tmp_path):
    torch.manual_seed(0)
    src = mlp()
    save_pretrained(src, tmp_path)
    with torch.device("meta"):
        model = mlp().to(torch.bfloat16)
    model.requires_grad_(False)
    loaded = load(model, tmp_path)
    assert len(loaded.converted) == len(src.state_dict()) and not loaded.file_backed
    for a, b in zip(model.state_dict().values(), src.state_dict().values()):
        assert a.dtype == torch.bfloat16 and torch.equal(a, b.bfloat16())
    assert not any(file_backed(p) for p in model.parameters())
