"""bf16 fine-tuning of Hugging Face models from host memory, measured: the ``finetune``
section of ``python -m fxpipe.check`` (:func:`finetune`) and ``benchmarks/bench_finetune.py``.

Four runs, each an element of ``finetune.runs``:

- ``lora``: the Llama-3.1-8B shape (its published sizes in a ``LlamaConfig``; rope
  scaling left out, it costs nothing), peft LoRA r=16 on every linear layer of the
  blocks; the frozen base in bf16 on the host, the adapters in fp32;
- ``full``: the Qwen3-4B shape, every parameter trained: fp32 masters on the host, bf16
  device copies (``param_dtype``), AdamW streamed into the backward
  (``forward_backward(optimizer=)``, exact: equal to ``backward(); step()``).

- ``qlora``: the ``lora`` model with its frozen linears quantized to NF4 on the host
  (``fxpipe.quant.quantize_frozen``; embeddings and head in bf16, QLoRA's default): the
  host holds and the link carries 0.5625 bytes per weight of them, each stage dequantizes
  on the GPU; no eager run (compare ``host_param_bytes``, ``h2d_bytes_params`` and
  tokens/s with the ``lora`` row's);
- ``longest``: the ``lora`` model, one sequence as long as ``fxpipe.plan.max_sequence_length``
  predicts to fit the GPU (and 80 % of the host's available memory): one step after a
  warm-up, no eager run (none could hold it); ``longest_asked`` is what was asked.

The first three: 16 microbatches of 4,096 tokens per step (RoundPipe's setup), the model's own
``labels=`` loss, random weights created straight into host memory (parameters built on
``meta``, then each allocated on the host and filled: generated on the GPU and copied
where there is one, norms at one), never twice and never on the device first.

Each run also times eager ``transformers`` on the same GPU, with gradient checkpointing
and bf16 autocast (what ``Trainer(bf16=True, gradient_checkpointing=True)`` runs), its
microbatches accumulated and AdamW (fused) on the GPU; the eager copy is made on the GPU
straight from the host weights, before fxpipe's steps change them, so the first losses
compare. Where it cannot fit (estimated from its bytes), ``eager`` says why.

Figures (docs/benchmarks.md has the formulas): ``step_s`` (median over the timed steps
after a warm-up and a layer-timed step), ``tokens_per_s``, ``model_tflops``
(6·N·T over the step, N every parameter), ``hardware_tflops`` (the FLOPs that ran:
recompute, causal attention, no weight gradients for frozen weights), ``mfu`` (model
FLOP/s over the GPU's dense bf16 peak, :data:`PEAK_BF16_TFLOPS`; null on CPU),
``peak_device_bytes`` against ``predicted_peak_bytes`` (``fxpipe.plan.predict_memory``;
``predicted_host_bytes``: its host bytes),
``predicted_step_s`` (``fxpipe.simulate`` with the layer-timed step's layer times and
the measured link), ``host_issue_ms`` and ``compute_busy_ms`` (a traced timed step;
under ``stage_backend="cudagraphs"`` its ``graph_captures`` / ``graph_replays`` /
``graph_fallbacks``), ``compile_s`` (``fxpipe.compile``), ``warmup_s`` (the first step)
and ``stage_compiles`` / ``stage_compile_s`` (what the stage backend compiled over the
run),
``host_rss_bytes`` and ``host_peak_rss_bytes``, ``vs_eager`` (fxpipe step / eager step).

``dry_run``: the same code at tiny widths on CPU virtual devices with a GPU's semantics,
eager on the CPU: what CI runs.
"""

from __future__ import annotations

import gc
import math
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn as nn

import fxpipe
from fxpipe import quant
from fxpipe.units import human
from fxpipe.check.common import error_record, link_bandwidth, say, sync_fn, timed, unsampled
from fxpipe.check.finetune_models import (device_copy, host_bytes, host_model, recompute_share,
                                          step_flops, with_lora)
from fxpipe.check.harness import Kit
from fxpipe.runtime.issue.trace import compute_busy_ms
from fxpipe.runtime.stages.compiled import compile_totals

TOKENS_PER_MICROBATCH = 4096
MICROBATCHES = 16
TIMED_STEPS = 3
RUN_MODES = ("lora", "qlora", "full", "longest")
"""Every run :func:`run_specs` knows; the kit's default (``--finetune-modes``) leaves qlora
out (``bench_finetune.py --modes`` runs it)."""
KIT_MODES = ("lora", "full", "longest")
GPU_STAGE_BACKENDS = ("cudagraphs", "inductor", "eager")
"""The stage backends a GPU's ``finetune`` runs by default (``--stage-backends``): the
ones with the fewest GPU runs behind them first, eager stage code last."""

# dense bf16 tensor-core peak (TFLOP/s, no sparsity), by a substring of
# torch.cuda.get_device_name(); the longest match wins
PEAK_BF16_TFLOPS = {
    "H200": 989.4, "H100": 989.4, "H100 PCIe": 756.5, "H100 NVL": 835.5, "H800": 989.4,
    "GH200": 989.4, "B200": 2250.0, "A100": 312.0, "A800": 312.0, "L40S": 362.1,
    "L40": 181.0, "L4": 121.0, "A10": 125.0, "A6000": 154.8, "RTX 4090": 165.2,
    "RTX 3090": 71.0,
}


def peak_bf16_tflops(device_name: str) -> float | None:
    """The dense bf16 peak of a GPU from its name (None: not in the table).

    >>> peak_bf16_tflops("NVIDIA H100 PCIe"), peak_bf16_tflops("NVIDIA H200")
    (756.5, 989.4)
    """
    hits = [k for k in PEAK_BF16_TFLOPS if k in device_name]
    return PEAK_BF16_TFLOPS[max(hits, key=len)] if hits else None


# ---------------------------------------------------------------------------- models

def run_specs(dry_run: bool) -> list[dict[str, Any]]:
    """The runs' configs: the published shapes, or tiny widths of the same classes."""
    from transformers import LlamaConfig, Qwen3Config
    if dry_run:
        llama = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=160,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            max_position_embeddings=256, tie_word_embeddings=False)
        qwen = Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=160,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=16, max_position_embeddings=256, tie_word_embeddings=True)
        seq, micro = 64, 4
    else:
        llama = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                            num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                            max_position_embeddings=131072, rope_theta=500000.0,
                            rms_norm_eps=1e-5, tie_word_embeddings=False)
        qwen = Qwen3Config(vocab_size=151936, hidden_size=2560, intermediate_size=9728,
                           num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                           head_dim=128, max_position_embeddings=40960, rope_theta=1000000.0,
                           rms_norm_eps=1e-6, tie_word_embeddings=True)
        seq, micro = TOKENS_PER_MICROBATCH, MICROBATCHES
    for cfg in (llama, qwen):
        cfg.use_cache = False
    return [dict(mode="lora", model="Llama-3.1-8B", config=llama, seq=seq, microbatches=micro),
            dict(mode="qlora", model="Llama-3.1-8B", config=llama, seq=seq, microbatches=micro),
            dict(mode="full", model="Qwen3-4B", config=qwen, seq=seq, microbatches=micro),
            # one sequence, as long as predicted to fit the device (longest_sequence)
            dict(mode="longest", model="Llama-3.1-8B", config=llama, seq=None, microbatches=1)]


LONGEST_STEP = 8192
"""The ``longest`` run's sequence is a multiple of this many tokens (64 in a dry run)."""
HOST_FRACTION = 0.8
"""The ``longest`` run may plan for this fraction of the host memory available."""


def longest_sequence(spec: dict[str, Any], ctx: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """The ``longest`` run's sequence: ``fxpipe.plan.max_sequence_length`` of the LoRA model
    built on ``meta`` (the model's own loss from ``labels=``, bf16 device copies), for the
    devices' memory and ``HOST_FRACTION`` of the host's available memory (the adapters'
    AdamW state included); and what it was asked."""
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        model = with_lora(AutoModelForCausalLM.from_config(spec["config"]).to(torch.bfloat16))
    step = 64 if ctx["dry_run"] else LONGEST_STEP

    def batch(n: int) -> dict[str, torch.Tensor]:
        ids = torch.zeros(1, n, dtype=torch.long, device="meta")
        return {"input_ids": ids, "labels": ids}
    asked = {"device_memory": ctx["device_memory"], "num_devices": len(ctx["devices"]()),
             "host_memory": int(HOST_FRACTION * host_available()), "step": step,
             "max_length": 16 * step if ctx["dry_run"] else 1 << 20}
    # whole: the run below is one unchunked step (a chunked longest run is not built yet)
    adamw = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    return fxpipe.plan.max_sequence_length(model, batch, num_microbatch=1, sequence_chunks=None,
                                           optimizer=adamw, **asked), asked


def host_available() -> int:
    """The host memory available to a new allocation (``MemAvailable``), in bytes."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/meminfo has no MemAvailable line")


# ---------------------------------------------------------------------------- host facts

def host_rss() -> tuple[int | None, int | None]:
    """(resident, peak resident) bytes of this process (Linux ``/proc``; None elsewhere)."""
    try:
        with open("/proc/self/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
    except OSError:
        return None, None
    kib = {k: int(fields[k].split()[0]) * 1024 for k in ("VmRSS", "VmHWM") if k in fields}
    return kib.get("VmRSS"), kib.get("VmHWM")


# ---------------------------------------------------------------------------- the runs

def _batch(spec: dict[str, Any]) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, spec["config"].vocab_size, (spec["microbatches"], spec["seq"]),
                         generator=g)


def _eager_fits(model: nn.Module, spec: dict[str, Any], free: int) -> tuple[bool, int]:
    """Whether eager training (checkpointed, autocast) fits ``free`` device bytes: the
    parameters, fp32 gradients and AdamW moments of the trainable ones, one microbatch's
    checkpointed activations, one block's recompute and the logits with their fp32 loss."""
    cfg, seq = spec["config"], spec["seq"]
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    acts = seq * (cfg.num_hidden_layers * cfg.hidden_size * 2
                  + 20 * cfg.hidden_size * 2 + 6 * cfg.intermediate_size * 2
                  + cfg.vocab_size * (2 + 4 + 4 + 4))
    need = params + trainable * 12 + acts
    return need < 0.9 * free, need


def _checkpointed(model: nn.Module) -> None:
    """Gradient checkpointing of every block, non-reentrant (transformers 5 renamed it)."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable({"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def eager_run(model: nn.Module, spec: dict[str, Any], ids: torch.Tensor, ctx: dict[str, Any],
              steps: int) -> dict[str, Any]:
    """Eager transformers on ``ctx['device']``: checkpointed, autocast bf16, microbatches
    accumulated, AdamW (fused on a GPU); the step times and the first loss. Or why not."""
    device = ctx["device"]
    if device.type == "cuda":
        torch.cuda.empty_cache()
        free = torch.cuda.mem_get_info(device)[0]
        fits, need = _eager_fits(model, spec, free)
        if not fits:
            return {"ran": False, "why": f"needs about {need / 2**30:.1f} GiB, the GPU has "
                                         f"{free / 2**30:.1f} GiB free"}
    try:
        return _eager_steps(model, ids, ctx, steps)
    except torch.OutOfMemoryError as e:
        return {"ran": False, "why": f"out of GPU memory: {str(e).splitlines()[0]}"}
    finally:     # the copy, its gradients and optimizer state are gone by now
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def _eager_steps(model: nn.Module, ids: torch.Tensor, ctx: dict[str, Any],
                 steps: int) -> dict[str, Any]:
    device = ctx["device"]
    ctx["reset_peak"](None)
    eager = device_copy(model, device)
    _checkpointed(eager)
    eager.train()
    opt = torch.optim.AdamW([p for p in eager.parameters() if p.requires_grad], lr=1e-5,
                            **({"fused": True} if device.type == "cuda" else {}))
    ids_d = ids.to(device)
    M = ids.shape[0]
    losses: list[float] = []

    def step() -> None:
        total = torch.zeros((), device=device)
        for i in range(M):
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = eager(input_ids=ids_d[i:i + 1], labels=ids_d[i:i + 1]).loss / M
            loss.backward()
            total += loss.detach().float()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(total))

    times = ctx["time"](step, 1, steps)
    return {"ran": True, "step_s": statistics.median(times), "step_s_all": times,
            "first_loss": losses[0], "losses": losses, "peak_device_bytes": ctx["peak"]()}


def fxpipe_run(model: nn.Module, spec: dict[str, Any], ids: torch.Tensor, ctx: dict[str, Any],
               steps: int, backend: str | None = None) -> dict[str, Any]:
    """fxpipe on ``ctx['devices']``: bf16 device copies, AdamW on the host streamed into
    the backward, the stage code run by ``backend`` (``RunConfig.stage_backend``); a
    warm-up (inductor compiles there), one layer-timed traced step (the simulator's
    input), then ``steps`` timed steps (the last traced: host issue and compute busy
    time). ``steps=0``: one traced step, the first (the ``longest`` run: minutes a step
    on a GPU, its figure the memory it held), no layer times for the simulator."""
    from fxpipe.sim import Hardware
    M = ids.shape[0]
    batch = dict(input_ids=ids, labels=ids)
    compiles, compile_s = compile_totals()
    t0 = time.perf_counter()
    pipe = fxpipe.compile(model, example_kwargs=batch, devices=ctx["devices"](),
                          param_dtype=torch.bfloat16,
                          config=fxpipe.RunConfig(num_microbatch=M, stage_backend=backend))
    out: dict[str, Any] = {"compile_s": time.perf_counter() - t0, "plan": repr(pipe.plan),
                           **recompute_share(pipe.layers, pipe.plan),
                           "devices": [d.name for d in pipe.devices]}
    try:
        # torch's defaults: the streamed step runs them as fused=True (docs/optimizer.md)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
        losses: list[float] = []

        def step() -> None:
            losses.append(float(pipe.forward_backward((), batch, loss_fn=lambda o, _: o.loss,
                                                      optimizer=opt)))
            opt.zero_grad(set_to_none=True)

        ctx["reset_peak"](pipe)
        sampled = None
        if steps:
            t0 = time.perf_counter()
            step()                               # warm-up (compiles, fills caches)
            ctx["sync"]()
            out["warmup_s"] = time.perf_counter() - t0
            pipe.timings.reset()                 # the next call is timed layer by layer
            pipe.timings.warmup = 0
            with pipe.trace() as sampled:
                step()
        with unsampled(pipe) as sampling:
            times = ctx["time"](step, 0, steps - 1) if steps else []
            ctx["sync"]()
            t0 = time.perf_counter()
            with pipe.trace() as rec:
                step()
                ctx["sync"]()
            times.append(time.perf_counter() - t0)
            st = pipe.stats()
        h2d, d2h = ctx["link"]
        compiled = compile_totals()
        predicted = fxpipe.simulate(pipe, Hardware(h2d_bandwidth=h2d, d2h_bandwidth=d2h),
                                    num_microbatch=M).makespan / 1e3 if sampled else None
        busy = compute_busy_ms(rec.timeline.intervals, 0)
        out.update({
            "step_s": statistics.median(times), "step_s_all": times,
            "first_loss": losses[0], "losses": losses,
            "peak_device_bytes": ctx["pipe_peak"](pipe),
            **_predicted_bytes(pipe, opt),
            "predicted_step_s": predicted,
            "sampled_step_s": sampled.timeline.makespan / 1e3 if sampled else None,
            "host_issue_ms": st["host_issue_us"] / 1e3, "compute_busy_ms": busy,
            "traced_step_ms": rec.timeline.makespan,
            "host_stalls": st.get("host_stalls"), "host_waits": st.get("host_waits"),
            "h2d_bytes_params": st.get("h2d_bytes_params"),
            "d2h_bytes_grads": st.get("d2h_bytes_grads"),
            **{k: st.get(k) for k in ("graph_captures", "graph_replays", "graph_fallbacks")},
            # what the stage backend compiled over the run (the warm-up, mostly)
            "stage_compiles": compiled[0] - compiles, "stage_compile_s": compiled[1] - compile_s,
            "timed_calls_sampled": sampling["sampled"]})
        return out
    finally:
        pipe.close()


def _predicted_bytes(pipe: Any, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """The pipe's predicted device peak and host bytes (``optimizer``'s state included)
    for the run's fused call."""
    p = fxpipe.plan.predict_memory(pipe, run_type="fused", loss_fn=lambda o, _: o.loss,
                                   optimizer=optimizer)
    return {"predicted_peak_bytes": p.peak, "predicted_host_bytes": p.host_total}


def measure(spec: dict[str, Any], ctx: dict[str, Any], backends: tuple[str | None, ...], *,
            eager: bool = True, steps: int = TIMED_STEPS) -> Iterator[dict[str, Any]]:
    """One run (``spec`` from :func:`run_specs`), one row per stage backend in
    ``backends``, each yielded as it ends: the model built on the host once and eager run
    once (from the same weights), then fxpipe with its stage code run by each backend,
    the trainable weights put back between them (each backend's first step starts from
    the weights eager's did: its first loss is comparable). What a row measured stays
    there should a later part fail; a failure before fxpipe runs is every row's."""
    cfg, mode = spec["config"], spec["mode"]
    t0 = time.perf_counter()
    base: dict[str, Any] = {"model": spec["model"], "mode": mode}
    try:
        if mode == "longest":   # one sequence as long as fits: no eager run can hold it
            seq, asked = longest_sequence(spec, ctx)
            spec = dict(spec, seq=seq)
            base.update(longest_asked=asked, planning_s=time.perf_counter() - t0)
            eager, steps = False, 0
        base_dtype = torch.float32 if mode == "full" else torch.bfloat16
        model = host_model(cfg, base_dtype, ctx["gen"])
        if mode != "full":
            model = with_lora(model)
        if mode == "qlora":   # its frozen linears in NF4 on the host (the head kept in bf16)
            quant.quantize_frozen(model, "nf4")
            gc.collect()
            eager = False
        ids = _batch(spec)
        tokens = ids.numel()
        base.update({
            "params": quant.parameter_count(model),
            "host_param_bytes": host_bytes(model),
            "frozen_dtype": "nf4" if mode == "qlora" else None,
            "trainable_params": sum(p.numel() for p in model.parameters() if p.requires_grad),
            "tokens_per_step": tokens, "microbatches": ids.shape[0], "seq": spec["seq"],
            "host_dtype": str(base_dtype).removeprefix("torch."), "param_dtype": "bfloat16",
            "build_s": time.perf_counter() - t0})
        base["eager"] = eager_run(model, spec, ids, ctx, steps) if eager else \
            {"ran": False, "why": {"longest": "not run for the longest sequence fxpipe fits",
                                   "qlora": "compared with the lora run (its base in bf16)"}.get(
                                       mode, "left out (--no-eager or no time)")}
        # what each backend's run starts from (a copy only when another run follows)
        start = {n: p.detach().clone() for n, p in model.named_parameters()
                 if p.requires_grad} if len(backends) > 1 else {}
    except Exception as e:   # noqa: BLE001 - every row says it
        for backend in backends:
            yield {**base, "stage_backend": backend, "ok": False, "error": error_record(e)}
        return
    for backend in backends:
        row = {**base, "stage_backend": backend}
        try:
            with torch.no_grad():
                for n, p in model.named_parameters():
                    if n in start:
                        p.copy_(start[n])
            fx = fxpipe_run(model, spec, ids, ctx, steps, backend)
            _measured(row, fx, step_flops(model, cfg, tokens, spec["seq"], fx["recomputed"]),
                      ctx["peak_tflops"])
        except Exception as e:   # noqa: BLE001 - a backend's failure is its row
            row.update(ok=False, error=error_record(e))
        yield row


def _measured(row: dict[str, Any], fx: dict[str, Any], flops: dict[str, float],
              peak: float | None) -> None:
    """``row`` with fxpipe's figures ``fx`` and what follows from them and eager's."""
    step_s = fx.pop("step_s")
    tokens = row["tokens_per_step"]
    row.update({
        "step_s": step_s, "tokens_per_s": tokens / step_s,
        "model_tflops": flops["model"] / step_s / 1e12,
        "hardware_tflops": flops["hardware"] / step_s / 1e12,
        "mfu": flops["model"] / step_s / 1e12 / peak if peak else None,
        **fx})
    e = row["eager"]
    row["vs_eager"] = step_s / e["step_s"] if e.get("ran") else None
    if e.get("ran"):
        row["first_loss_rel_diff"] = abs(row["first_loss"] - e["first_loss"]) / abs(e["first_loss"])
    row["host_rss_bytes"], row["host_peak_rss_bytes"] = host_rss()
    row["predicted_over_measured"] = (row["predicted_step_s"] / step_s
                                      if row["predicted_step_s"] is not None else None)
    row["ok"] = all(math.isfinite(x) for x in row["losses"]) and (
        not e.get("ran") or row["first_loss_rel_diff"] < 0.05)


def context(dry_run: bool, num_devices: int, time_fn: Callable, sync: Callable,
            link: tuple[float, float]) -> dict[str, Any]:
    """What the runs need from the machine: devices, timing, peak-memory readers."""
    if dry_run:     # eager runs on the host: no device peak to read for it
        def devices():   # a known size, as a GPU's: the loss and tiling passes apply
            return [fxpipe.VirtualDevice(semantics="cuda", memory_limit=DRY_RUN_DEVICE_MEMORY)
                    for _ in range(num_devices)]

        def reset_virtual(pipe=None):
            for d in pipe.devices if pipe is not None else ():
                d.reset_peak()
        return {"dry_run": True, "device": torch.device("cpu"), "devices": devices,
                "device_memory": DRY_RUN_DEVICE_MEMORY,
                "gen": torch.device("cpu"), "time": time_fn, "sync": sync, "link": link,
                "peak_tflops": None, "peak": lambda: None, "reset_peak": reset_virtual,
                "pipe_peak": lambda pipe: max(d.peak_bytes() for d in pipe.devices)}

    def reset(pipe=None):
        for i in range(torch.cuda.device_count()):
            torch.cuda.reset_peak_memory_stats(i)

    def peak():
        return torch.cuda.max_memory_allocated(0)

    reset()
    return {"dry_run": False, "device": torch.device("cuda", 0),
            "devices": lambda: [f"cuda:{i}" for i in range(num_devices)],
            "device_memory": torch.cuda.get_device_properties(0).total_memory,
            "gen": torch.device("cuda", 0), "time": time_fn, "sync": sync, "link": link,
            "peak_tflops": peak_bf16_tflops(torch.cuda.get_device_name(0)),
            "peak": peak, "reset_peak": reset,
            "pipe_peak": lambda pipe: max(torch.cuda.max_memory_allocated(i)
                                          for i in range(num_devices))}


DRY_RUN_DEVICE_MEMORY = 64 * 2**20
"""A dry run's devices have this many bytes (its ``longest`` sequence is planned for them)."""


def run_all(ctx: dict[str, Any], *, modes: tuple[str, ...] = KIT_MODES,
            eager: bool = True, steps: int = TIMED_STEPS,
            backends: tuple[str | None, ...] = ("eager",),
            on_row: Callable[[list[dict[str, Any]]], None] = lambda rows: None,
            say: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Every run in ``modes``, its model built once, then once per stage backend in
    ``backends``, in that order (each row's ``stage_backend``: ``None`` for eager stage
    code; :func:`measure`); ``on_row(rows)`` after each (the JSON is written there). A
    run's failure is its row (``ok: false``, the error) and the next one runs."""
    rows: list[dict[str, Any]] = []
    for spec in run_specs(ctx["dry_run"]):
        if spec["mode"] not in modes:
            continue
        t0 = time.perf_counter()
        for row in measure(spec, ctx, backends, eager=eager, steps=steps):
            row["seconds"] = time.perf_counter() - t0   # the first row's: its build, eager too
            t0 = time.perf_counter()
            rows.append(row)
            gc.collect()
            if not ctx["dry_run"]:
                torch.cuda.empty_cache()
            say(summary(row))
            on_row(rows)
    return rows


def summary(row: dict[str, Any]) -> str:
    """One line about a run's row."""
    if "error" in row:
        return f"  {row['mode']} {row['model']}: FAILED {row['error']['type']}: {row['error']['message'][:300]}"
    mfu = f"{row['mfu']:.1%}" if row["mfu"] is not None else "n/a"
    if row.get("stage_backend"):
        mfu += f", stage_backend={row['stage_backend']}"
    eager = f"vs eager {row['vs_eager']:.3f}" if row["vs_eager"] is not None else \
        f"eager: {row['eager'].get('why')}"
    return (f"  {row['mode']} {row['model']} ({row['params'] / 1e9:.2f} B): "
            f"{row['step_s']:.2f} s/step, {row['tokens_per_s']:.0f} tokens/s, "
            f"{row['model_tflops']:.1f} model TFLOP/s, MFU {mfu}, {eager}; host params "
            f"{human(row['host_param_bytes'], 'B')}, h2d params {human(row['h2d_bytes_params'] or 0, 'B')}")


# ---------------------------------------------------------------------------- the kit's section

def finetune(kit: Kit) -> dict[str, Any]:
    """The kit's ``finetune`` section: every run against eager ``transformers``; each
    run's row written to the JSON at once (``kit.progress``)."""
    sync = sync_fn(kit.dry_run)
    link = link_bandwidth(kit.dry_run)
    ctx = context(kit.dry_run, kit.num, lambda fn, warmup, repeats: timed(fn, warmup, repeats, sync),
                  sync, link)
    head = {"peak_bf16_tflops": ctx["peak_tflops"], "h2d_bytes_per_s": link[0],
            "d2h_bytes_per_s": link[1]}
    rows = run_all(ctx, modes=kit.finetune_modes or KIT_MODES, backends=kit.stage_backends,
                   on_row=lambda rows: kit.progress({**head, "runs": rows}), say=say)
    return {**head, "runs": rows, "ok": bool(rows) and all(r["ok"] for r in rows)}


def finetune_summary(r: dict[str, Any]) -> str:
    return "; ".join(summary(row).strip() for row in r["runs"])
