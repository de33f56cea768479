"""Device memory, predicted before running: accuracy, and the longest sequence that trains.

    python benchmarks/bench_memory.py              # every part (a few minutes on 2 cores)
    python benchmarks/bench_memory.py --part a     # host memory only
    python benchmarks/bench_memory.py --part b     # predicted vs measured only
    python benchmarks/bench_memory.py --part c     # longest sequences only

Part (a): host memory. A 24-block MLP-style model (``x + W2 gelu(W1 x)``, d = 1024,
hidden 4096: P = 769 MiB of fp32 parameters) trains three SGD steps on 2 virtual
devices with 2 microbatches; each row runs in a fresh process and reports the peak
resident set size above the process's baseline (after imports, before the model is
built), as a multiple of P: eager PyTorch (parameters + gradients); fxpipe's fused step;
a fused step, an eager-style ``pipe(x).backward()`` step and ``no_grad`` inference in
one process; the fused step with ``param_dtype=torch.bfloat16``. Virtual devices live in
the same process, so their memory (``device``: the sum of the devices' peak reserved
bytes: every byte their work allocated, plus freed memory their caching allocator keeps,
as a GPU's ``max_memory_reserved``) is part of the RSS. Rows run with glibc's
``MALLOC_MMAP_THRESHOLD_=131072`` (``--default-malloc``: without): by default glibc raises
its mmap threshold up to 32 MiB after the first large free, then keeps freed blocks of
up to that size in its heaps, and RSS measures the allocator's reserve rather than the
program's memory. Targets (issue 16): fused <= eager + device + 0.1 P; all three styles
<= that + 0.05 P; bf16 <= eager + 0.5 P + device + 0.1 P.

Part (b): predicted vs measured peak device bytes. Three models (an MLP chain, a
Llama-style decoder at 4096 tokens, the encoder-decoder of examples/encoder_decoder.py as
its decoder pipe with a loss and its encoder pipe trained from the decoder's
gradients), each under a fixed plan with multi-layer stages on 2 devices, at
``recompute_grain="stage"`` and ``"layer"``. The prediction is
``fxpipe.plan.predict_memory`` (layers costed on fake tensors for one microbatch). The
measurement is ``measured_peaks``: today ``tests/memory_harness.py`` (every storage each
stage job's compute allocates, counted on the CPU under a dispatch mode, with the
resident parameters, gradients and boundary values placed as the Program keeps them);
``--measure virtual`` reads ``VirtualDevice.peak_bytes(kind)`` after a real
``forward_backward`` instead, which becomes the measurement once virtual devices count
every tensor their work allocates (issue #16, item 2); ``--measure cuda-sim`` does so on
``VirtualDevice(semantics="cuda")`` and adds what each device's allocator reserved
(memory allocated and freed when the host issues, kept for reuse as torch's CUDA caching
allocator keeps it) over the prediction (target, issue 25: <= 1.3). Error: |predicted -
measured| / measured, per device (its highest stage) and the worst single stage.

Part (c): the longest trainable sequence (``fxpipe.plan.max_sequence_length``, multiples
of 1024 tokens, microbatch size 1, bf16, 8 devices) for Llama-3.1-8B and Qwen3-32B shapes
built on ``meta`` from transformers' ``LlamaConfig`` / ``Qwen3Config`` (no download),
next to RoundPipe's published figures. The models are hand-written to the configs'
shapes (``CausalLM`` below: the HF modules' ops, with SDPA ``is_causal`` and
``enable_gqa`` as HF runs eagerly on a GPU). Columns: the loss over materialized logits
in ``loss_fn`` (``cross_entropy(logits.float())``), and ``fxpipe.linear_cross_entropy``
in the model. ``--hf`` adds transformers' own ``LlamaForCausalLM`` / ``Qwen3ForCausalLM``
as users bring them: called with ``labels=``, its loss fused by fxpipe's loss pass, its
MLPs tiled where they would not fit (``fxpipe.passes.loss``, ``fxpipe.passes.tiling``), its
attention causal SDPA (no padding mask); and Llama-3.1-8B with LoRA on one 80 GiB device,
without and with a 120 GiB host limit, next to Unsloth's published 342K. The device
limit is the planner's default, 90% of the device memory.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import fxpipe  # noqa: E402
from fxpipe.demo import TinyLlama  # noqa: E402
from fxpipe.passes.costs import _attr_tensors, compute_costs  # noqa: E402
from fxpipe.passes.stage_memory import ChainMemory, Residency, human_bytes, stage_peak  # noqa: E402
from fxpipe.passes.partition import build_layer_graph  # noqa: E402
from fxpipe.plan import ExecutePlan, predict_memory  # noqa: E402
from fxpipe.runtime.issue.microbatch import split_input, split_label  # noqa: E402

sys.path.insert(0, str(ROOT / "examples"))
from encoder_decoder import Decoder, Encoder  # noqa: E402
from tests.memory_harness import chain_values, measure_stage  # noqa: E402
from tests.models import MLPBlock  # noqa: E402

GiB = 2**30
ROUNDPIPE = {("Llama-3.1-8B", 24): 49, ("Qwen3-32B", 24): 28,     # K tokens, 8 x RTX 4090
             ("Llama-3.1-8B", 80): 226, ("Qwen3-32B", 80): 126}   # 8 x A800


# --- part (a): host memory -------------------------------------------------------------------

RSS_ROWS = ["eager", "fused", "three_styles", "fused_bf16"]


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def rss_row(name: str) -> dict:
    """One row of part (a), in this (fresh) process."""
    torch.set_num_threads(1)
    base = _rss_kib("VmRSS")

    torch.manual_seed(0)
    model = nn.Sequential(*[MLPBlock(1024) for _ in range(24)])
    P = sum(p.numel() * p.element_size() for p in model.parameters())
    x, y = torch.randn(16, 1024), torch.randn(16, 1024)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    device = 0
    if name == "eager":
        for _ in range(3):
            F.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    else:
        devs = [fxpipe.VirtualDevice() for _ in range(2)]
        pipe = fxpipe.compile(model, example_inputs=(x,), devices=devs,
                              config=fxpipe.RunConfig(num_microbatch=2),
                              param_dtype=torch.bfloat16 if name == "fused_bf16" else None)
        for _ in range(3):
            pipe.forward_backward((x,), label=y, loss_fn=F.mse_loss)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if name == "three_styles":
                F.mse_loss(pipe(x), y).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                with torch.no_grad():
                    pipe(x)
        device = sum(d.peak_reserved_bytes() for d in devs)
    peak = (_rss_kib("VmHWM") - base) * 1024
    return {"row": name, "P_bytes": P, "rss_bytes": peak, "rss_over_P": peak / P,
            "device_bytes": device, "device_over_P": device / P}


def part_a(default_malloc: bool = False) -> list[dict]:
    rows = []
    env = dict(os.environ)
    if not default_malloc:
        env["MALLOC_MMAP_THRESHOLD_"] = "131072"
    for name in RSS_ROWS:   # each in a fresh process: RSS peaks do not come down
        run = subprocess.run([sys.executable, __file__, "--rss-row", name], capture_output=True,
                             text=True, timeout=1800, cwd=ROOT, env=env)
        if run.returncode != 0:
            raise RuntimeError(f"part (a) row {name} failed:\n{run.stderr[-3000:]}")
        rows.append(json.loads(run.stdout.strip().splitlines()[-1]))
    eager = rows[0]["rss_over_P"]
    targets = {"fused": lambda r: eager + r["device_over_P"] + 0.10,
               "three_styles": lambda r: eager + r["device_over_P"] + 0.15,
               "fused_bf16": lambda r: eager + 0.5 + r["device_over_P"] + 0.10}
    print(f"(a) host memory: peak RSS above the baseline, / P (P = {rows[0]['P_bytes'] / 2**20:.0f} MiB"
          f"{', default malloc' if default_malloc else ', MALLOC_MMAP_THRESHOLD_=131072'})")
    print(f"{'row':>14} | {'RSS / P':>8} | {'device / P':>10} | {'target <=':>9} | met")
    for r in rows:
        target = targets[r["row"]](r) if r["row"] in targets else None
        r["target_over_P"] = target
        r["met"] = None if target is None else r["rss_over_P"] <= target
        print(f"{r['row']:>14} | {r['rss_over_P']:8.2f} | {r['device_over_P']:10.2f} | "
              f"{'' if target is None else f'{target:9.2f}':>9} | "
              f"{'' if r['met'] is None else ('yes' if r['met'] else 'NO')}")
    return rows


# --- part (b): predicted vs measured ---------------------------------------------------------

def ce(out, label):
    return F.cross_entropy(out.flatten(0, 1), label.flatten())


def cases():
    """(name, model, example inputs (whole batch), run type, plan, loss_fn, label)."""
    torch.manual_seed(0)
    R = range
    mlp = nn.Sequential(*[MLPBlock(64) for _ in range(8)])
    x = torch.randn(8, 4096, 64)
    yield ("MLP chain 8 x (64 -> 256 -> 64), 8 x 4096 rows", mlp, (x,), "fused",
           ExecutePlan([R(0, 3), R(3, 6)], [R(6, 8), R(3, 6), R(0, 3)]),
           lambda o, y: F.mse_loss(o, y), torch.randn(8, 4096, 64))
    llama = TinyLlama(vocab=512, dim=128, heads=4, depth=6)   # prefix, 6 blocks, suffix
    ids = torch.randint(0, 512, (2, 4096))
    yield ("Llama-style 6 x d128, 4096 tokens", llama, (ids,), "fused",
           ExecutePlan([R(0, 4)], [R(4, 8), R(1, 4), R(0, 1)]), ce, ids)
    dec = Decoder(vocab=256, dim=64, heads=4, depth=6, max_len=2048)
    tgt = torch.randint(0, 256, (4, 2048))
    memory = torch.randn(4, 1024, 64, requires_grad=True)
    yield ("Encoder-decoder: decoder 6 x d64, 2048 tokens over 1024", dec, (tgt, memory), "fused",
           ExecutePlan([R(0, 4)], [R(4, 8), R(1, 4), R(0, 1)]), ce, tgt)
    enc = Encoder(vocab=256, dim=64, heads=4, depth=6, max_len=2048)
    src = torch.randint(0, 256, (4, 2048))
    yield ("Encoder-decoder: encoder 6 x d64, 2048 tokens", enc, (src,), "train",
           ExecutePlan([R(0, 4), R(4, 8)], [R(4, 8), R(1, 4), R(0, 1)]), None, None)


def measured_peaks(lg, prediction, inputs, num_microbatch: int, loss) -> list[dict[str, int]]:
    """Measured peak bytes by kind (and ``"total"``) of every stage ``prediction`` lists,
    with the same resident set. Today: ``tests/memory_harness.measure_stage``."""
    args = split_input(inputs, {}, num_microbatch, None)[0][0]
    flat = [x for x in args if isinstance(x, torch.Tensor)]
    env = chain_values(lg, flat)
    if loss is not None:
        loss = loss[0], split_label(loss[1], num_microbatch)[0]
    out = []
    for p in prediction.stages:
        nxt = [t for i in (p.prefetch or ()) for t in {id(t): t for t in _attr_tensors(lg.layers[i].gm).values()}.values()]
        out.append(measure_stage(lg, p.kind, p.layers, flat, grain=p.grain, residency=p.residency,
                                 prefetched=nxt, loss=loss, env=env))
    return out


def virtual_device_peaks(model, inputs, plan, run_type, num_microbatch, grain, loss_fn, label,
                         semantics="sync"):
    """Per device, ``VirtualDevice.peak_bytes(kind)`` after one real call, and what its
    allocator reserved (``peak_reserved_bytes``: with ``semantics="cuda"``, allocated and
    freed when the host issues, reused as torch's CUDA caching allocator does)."""
    devices = [fxpipe.VirtualDevice(semantics=semantics) for _ in range(2)]
    cfg = fxpipe.RunConfig(num_microbatch=num_microbatch, recompute_grain=grain)
    with fxpipe.compile(copy.deepcopy(model), example_inputs=inputs, devices=devices, plan=plan,
                        config=cfg) as pipe:
        if run_type == "fused":
            pipe.forward_backward(inputs, label=label, loss_fn=loss_fn)
        else:
            pipe(*inputs).float().sum().backward()
    return [{**{k: d.peak_bytes(k) for k in ("params", "activations", "gradients", "saved", "workspace")},
             "total": d.peak_bytes(), "reserved": d.peak_reserved_bytes()} for d in devices]


def part_b(measure: str) -> list[dict]:
    M, G = 2, 2
    rows = []
    print(f"(b) predicted vs measured peak device bytes, {G} devices, {M} microbatches "
          f"(measured: {'tests/memory_harness.py' if measure == 'harness' else 'VirtualDevice.peak_bytes()'})")
    reserved = measure != "harness"
    print(f"{'model':<58} {'grain':<6} {'device':>6} {'predicted':>10} {'measured':>10} {'error':>7}"
          f" {'worst stage':>12}" + (f" {'reserved':>10} {'/pred':>6}" if reserved else ""))
    for name, model, inputs, run_type, plan, loss_fn, label in cases():
        lg = build_layer_graph(model, inputs, {})
        compute_costs(lg, [x for x in inputs if isinstance(x, torch.Tensor)])
        for grain in ("stage", "layer"):
            start = time.perf_counter()
            pred = predict_memory(lg, plan, run_type=run_type, num_microbatch=M, grain=grain,
                                  num_devices=G, loss_fn=loss_fn, label=label)
            if measure == "harness":
                stages = measured_peaks(lg, pred, inputs, M, None if loss_fn is None else (loss_fn, label))
                devices = [max((m for p, m in zip(pred.stages, stages) if p.device == d),
                               key=lambda m: m["total"]) for d in range(G)]
                worst = max(abs(p.total - m["total"]) / m["total"] for p, m in zip(pred.stages, stages))
            else:
                stages, worst = [], float("nan")
                devices = virtual_device_peaks(model, inputs, plan, run_type, M, grain, loss_fn,
                                               label, "cuda" if measure == "cuda-sim" else "sync")
            for d, (p, m) in enumerate(zip(pred.devices, devices)):
                err = (p.total - m["total"]) / m["total"]
                print(f"{name if d == 0 else '':<58} {grain if d == 0 else '':<6} {d:>6} "
                      f"{human_bytes(p.total):>10} {human_bytes(m['total']):>10} {100 * err:>+6.1f}%"
                      f" {f'{100 * worst:.1f}%' if d == 0 and worst == worst else '':>12}"
                      + (f" {human_bytes(m['reserved']):>10} {m['reserved'] / p.total:>6.2f}"
                         if reserved else ""))
                rows.append({"model": name, "grain": grain, "device": d, "predicted": p.bytes,
                             "predicted_total": p.total, "measured": m, "error": err,
                             "worst_stage_error": worst, "seconds": time.perf_counter() - start,
                             "stages": [{"stage": s.stage, "kind": s.kind, "layers": [s.layers.start, s.layers.stop],
                                         "device": s.device, "predicted": s.bytes, "measured": ms}
                                        for s, ms in zip(pred.stages, stages)]})
    return rows


# --- part (c): the longest sequence ----------------------------------------------------------

class RMSNorm(nn.Module):
    """transformers' LlamaRMSNorm: normalized in fp32, cast back, scaled."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Block(nn.Module):
    """transformers' LlamaDecoderLayer / Qwen3DecoderLayer (``qk_norm``), SDPA attention."""

    def __init__(self, c, qk_norm: bool):
        super().__init__()
        H, hd = c.hidden_size, c.head_dim
        self.nh, self.nkv, self.hd = c.num_attention_heads, c.num_key_value_heads, hd
        self.input_layernorm = RMSNorm(H, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(H, c.rms_norm_eps)
        self.q_proj = nn.Linear(H, self.nh * hd, bias=False)
        self.k_proj = nn.Linear(H, self.nkv * hd, bias=False)
        self.v_proj = nn.Linear(H, self.nkv * hd, bias=False)
        self.o_proj = nn.Linear(self.nh * hd, H, bias=False)
        self.q_norm = RMSNorm(hd, c.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(hd, c.rms_norm_eps) if qk_norm else None
        self.gate_proj = nn.Linear(H, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(H, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, H, bias=False)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        h = self.input_layernorm(x)
        q = self.q_proj(h).view(b, t, self.nh, self.hd)
        k = self.k_proj(h).view(b, t, self.nkv, self.hd)
        v = self.v_proj(h).view(b, t, self.nkv, self.hd)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.o_proj(a.transpose(1, 2).reshape(b, t, -1))
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class CausalLM(nn.Module):
    """A causal LM of a transformers config's shapes; with ``chunked`` it takes the labels
    and returns ``fxpipe.linear_cross_entropy`` of its last hidden states."""

    def __init__(self, c, qk_norm: bool = False, chunked: bool = False):
        super().__init__()
        self.chunked = chunked
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList([Block(c, qk_norm) for _ in range(c.num_hidden_layers)])
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        theta = c.rope_parameters["rope_theta"]
        inv = 1.0 / (theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float32) / c.head_dim))
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, ids, labels=None):
        x = self.embed_tokens(ids)
        f = torch.outer(torch.arange(ids.shape[1], device=ids.device, dtype=torch.float32),
                        self.inv_freq.float())
        emb = torch.cat((f, f), dim=-1)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        h = self.norm(x)
        if self.chunked:
            return fxpipe.linear_cross_entropy(h, self.lm_head.weight, labels)
        return self.lm_head(h)


def configs():
    import transformers as T
    common = dict(rms_norm_eps=1e-6, tie_word_embeddings=False, use_cache=False)
    yield "Llama-3.1-8B", T.LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=500000.0,
        max_position_embeddings=131072, **common), False, T.LlamaForCausalLM
    yield "Qwen3-32B", T.Qwen3Config(
        vocab_size=151936, hidden_size=5120, intermediate_size=25600, num_hidden_layers=64,
        num_attention_heads=64, num_key_value_heads=8, head_dim=128, rope_theta=1000000.0,
        max_position_embeddings=40960, **common), True, T.Qwen3ForCausalLM


def ids2(n: int):
    ids = torch.zeros(1, n, dtype=torch.long, device="meta")
    return ids, ids


def binding_stage(model, example, n: int, num_devices: int):
    """The single-layer stage with the highest predicted peak at ``n`` tokens, as the planner
    sees it (what stops a longer sequence), with the prefetch reserve in its parameters."""
    args = example(n)
    flat = [x for x in args if isinstance(x, torch.Tensor)]
    lg = build_layer_graph(model, args, {}, param_dtype=torch.bfloat16)
    memory = ChainMemory.of(compute_costs(lg, flat, store=False), sum(x.numel() * x.element_size() for x in flat))
    res, last = Residency.worst(num_devices + 1, num_devices), len(memory) - 1
    stages = [stage_peak(memory, kind, range(i, i + 1), residency=res, prefetch=range(j, j + 1))
              for j in [max(range(len(memory)), key=lambda i: memory.params[i])]
              for i in range(len(memory))
              for kind in (("fused",) if i == last else ("fwd", "bwd"))]
    return max(stages, key=lambda p: p.total)


def hf_batch(n: int) -> dict:
    """A transformers causal LM's call as users write it: token ids and ``labels=``."""
    ids = torch.zeros(1, n, dtype=torch.long, device="meta")
    return {"input_ids": ids, "labels": ids}


def part_c(hf: bool) -> tuple[list[dict], list[dict]]:
    rows = []
    print("\n(c) longest trainable sequence, 8 devices, bf16, microbatch 1 (K = 1024 tokens)")
    head = f"{'model':<14} {'device':>8} {'RoundPipe':>10} {'logits+CE':>10} {'chunked CE':>11}"
    print(head + (f" {'HF labels=':>11}" if hf else "") + f" {'vs RoundPipe':>13} {'seconds':>8}")
    hf_ce = lambda out, y: F.cross_entropy(out.flatten(0, 1).float(), y.flatten())  # noqa: E731
    notes = []
    for name, cfg, qk_norm, hf_class in configs():
        with torch.device("meta"):
            plain, chunked = CausalLM(cfg, qk_norm), CausalLM(cfg, qk_norm, chunked=True)
            lm = hf_class(cfg) if hf else None
        for gib in (24, 80):
            start = time.perf_counter()
            common = dict(device_memory=gib * GiB, num_devices=8,
                          sequence_chunks=None)   # whole sequences (in chunks: bench_long_context)
            logits = fxpipe.plan.max_sequence_length(plain, loss_fn=hf_ce, **common)
            best = fxpipe.plan.max_sequence_length(chunked, ids2, **common)
            via_hf = fxpipe.plan.max_sequence_length(lm, hf_batch, **common) if hf else None
            seconds = time.perf_counter() - start
            rp = ROUNDPIPE[(name, gib)]
            print(f"{name:<14} {gib:>5} GiB {rp:>9}K {logits // 1024:>9}K {best // 1024:>10}K"
                  + (f" {via_hf // 1024:>10}K" if hf else "")
                  + f" {best / 1024 / rp:>12.2f}x {seconds:>8.1f}")
            binding = binding_stage(chunked, ids2, best, 8)
            rows.append({"model": name, "device_gib": gib, "devices": 8, "roundpipe_k": rp,
                         "logits_ce_tokens": logits, "chunked_ce_tokens": best,
                         "hf_labels_tokens": via_hf, "seconds": seconds,
                         "chunked_binding_stage": {"kind": binding.kind, "layer": binding.layer,
                                                   "bytes": binding.bytes, "total": binding.total}})
            notes.append(f"{name}, {gib} GiB, chunked CE at {best // 1024}K: {binding}")
    print("\nthe stage that stops a longer sequence (chunked CE; params include the prefetch reserve):")
    print("\n".join(notes))
    return rows, part_c_lora() if hf else []


UNSLOTH_K = 342   # Llama-3.1-8B, one 80 GB GPU, LoRA (Unsloth's published context length)


def part_c_lora() -> list[dict]:
    """transformers' Llama-3.1-8B with peft LoRA (r=16, every linear of the blocks), its
    frozen base in bf16, one 80 GiB device, the host limited to 120 GiB, one microbatch."""
    import peft
    name, cfg, _, hf_class = next(configs())
    with torch.device("meta"):
        lm = peft.get_peft_model(hf_class(cfg).to(torch.bfloat16), peft.LoraConfig(
            r=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                  "up_proj", "down_proj"]))
    rows = []
    print(f"\n{name}, LoRA, 1 x 80 GiB, one microbatch (Unsloth: {UNSLOTH_K}K)")
    for host_gib in (None, 120):
        start = time.perf_counter()
        n = fxpipe.plan.max_sequence_length(
            lm, hf_batch, device_memory=80 * GiB, num_devices=1, num_microbatch=1,
            host_memory=None if host_gib is None else host_gib * GiB, sequence_chunks=None)
        seconds = time.perf_counter() - start
        print(f"  host limit {host_gib or 'none':>4} GiB: {n // 1024}K tokens ({seconds:.1f} s)")
        rows.append({"model": name, "mode": "lora", "devices": 1, "device_gib": 80,
                     "host_gib": host_gib, "hf_labels_tokens": n, "unsloth_k": UNSLOTH_K,
                     "seconds": seconds})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=["a", "b", "c", "all"], default="all")
    ap.add_argument("--rss-row", choices=RSS_ROWS, help=argparse.SUPPRESS)
    ap.add_argument("--default-malloc", action="store_true",
                    help="part (a) without MALLOC_MMAP_THRESHOLD_ (glibc's dynamic threshold)")
    ap.add_argument("--measure", choices=["harness", "virtual", "cuda-sim"], default="harness",
                    help="part (b)'s measurement (default: the CPU harness; cuda-sim: virtual "
                    "devices with a GPU's semantics, peak reserved too)")
    ap.add_argument("--hf", action="store_true",
                    help="part (c): also transformers' models as users bring them (labels=), "
                    "and Llama-3.1-8B with LoRA on one 80 GiB device")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "bench_memory.json"))
    args = ap.parse_args(argv)
    if args.rss_row:   # one row of part (a), in a fresh process
        print(json.dumps(rss_row(args.rss_row)))
        return 0
    torch.set_num_threads(max(1, torch.get_num_threads()))
    result = {"torch": torch.__version__}
    if args.part in ("a", "all"):
        result["host_memory"] = part_a(args.default_malloc)
        result["host_memory_malloc"] = "default" if args.default_malloc else "MALLOC_MMAP_THRESHOLD_=131072"
    if args.part in ("b", "all"):
        result["predicted_vs_measured"] = part_b(args.measure)
        result["measure"] = args.measure
    if args.part in ("c", "all"):
        result["longest_sequence"], lora = part_c(args.hf)
        if lora:
            result["longest_sequence_lora"] = lora
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.exists():   # keep the other part's figures when running one part
        result = {**json.loads(out.read_text()), **result}
    out.write_text(json.dumps(result, indent=1))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
