"""The GPU acceptance kit: ``python -m fxpipe.check [--dry-run] [--out FILE] [--budget-s S]``.

On whatever GPUs are visible it runs these sections, printing each with the elapsed time,
and writes the JSON file again after every one (atomically), so a crash or a kill keeps
what came before (``in_progress`` names the section that was running):

1. ``cuda_tests``: ``pytest`` over the CUDA tests, in a subprocess;
2. ``vs_checkpoint``: the fused training step against eager PyTorch with
   ``torch.utils.checkpoint`` per block, both on one GPU (min and median ratio over
   interleaved repeats);
3. ``scaling``: the fused step on 1, 2, ... N GPUs (speed-up over one); with one GPU,
   also on two logical devices over it (two ``CudaDevice``\ s, each with its own streams,
   events and copies, half the memory each): not for speed, but to run the
   cross-device ordering code on real CUDA, its losses against one device;
4. ``hidden_prefetch``: per device, the share of parameter-prefetch time that overlapped
   compute and ``exposed_ms``, the time the compute stream waited for parameters, from
   the CUDA-event timeline (``pipe.trace()``) of a step the layer timer does not sample;
5. ``predicted_vs_measured``: ``fxpipe.simulate`` with the layer times measured in a
   traced, sampled step and the host links' measured bandwidth, against its makespan;
6. ``stats``: ``pipe.stats()`` of the unsampled step (host waits, bytes moved by kind);
7. ``bigger_than_device``: cuda:0 capped (``torch.cuda.set_per_process_memory_fraction``)
   below half of the model's bf16 weights; three steps of bf16 training with AdamW streamed
   in the call (``forward_backward(optimizer=...)``): weights and peak reserved memory
   over the cap, tokens/s, losses;
8. ``weights``: ``compile(weights=DIR)`` on a model built on ``meta`` with a frozen base:
   how many frozen parameters stayed file-backed, whether their pages were registered
   for DMA (else the bounded pinned ring carried them: ``ring_bytes``), the host stalls,
   and the losses against the same model loaded in memory;
9. ``generate``: ``pipe.generate`` (KV cache) of a Hugging Face Llama from a config,
   greedy over left-padded prompts, against ``transformers``' ``model.generate`` with
   every weight resident on the same GPU: the tokens and the tokens per second;
10. ``finetune``: bf16 fine-tuning of Hugging Face models from host memory (LoRA on the
    Llama-3.1-8B shape, a full fine-tune of the Qwen3-4B shape, 16 x 4,096 tokens per
    step) against eager ``transformers`` with gradient checkpointing on the same GPU:
    tokens/s, model and hardware TFLOP/s, MFU, peaks predicted and measured, the
    simulator's step against the measured one (``fxpipe.check_finetune``); the JSON is
    written after each run. ``--stage-backends eager,inductor`` runs fxpipe's side once
    per ``RunConfig.stage_backend`` (each row's ``stage_backend``; its tokens/s and
    ``host_issue_ms`` against ``compute_busy_ms``).

``--sections NAME,...`` runs those sections, in that order (the kit no longer fits one
10-minute command: a lent GPU runs it as two).

Each section runs in ``try``/``except``: a failure is recorded as that section's
``error`` (type, message, last traceback lines) with ``"ok": false`` and the kit goes on;
the exit code is 1 when any section failed. Every section has ``ok`` and ``seconds``.

Time: the kit fits ``--budget-s`` (default 540 s, inside a 10-minute slot). Each section
may use what is left of it less a reserve for the sections after it; the CUDA tests'
subprocess gets that as its timeout, other sections get an alarm; a section past it is
recorded as a timeout error (the tests' with the tail of their output), a section with no
time left as ``BudgetSpent``.

Measuring: ``gc.collect()`` and, on GPUs, ``torch.cuda.synchronize()`` and
``torch.cuda.empty_cache()`` run between sections and before each variant's (warm-up,
timed) pair of calls, so eager and fxpipe never time inside each other's allocator state.
The pipe's layer timer (``pipe.timings``) times some calls layer by layer (an event at
each layer boundary of the stage code); it is switched off for the calls
``vs_checkpoint``, ``scaling`` and ``bigger_than_device`` time, and
``timed_calls_sampled`` says whether any was timed anyway (always, in verbose mode).

The model is a Llama-style decoder (``fxpipe.demo.TinyLlama``) sized to the GPU: its fp32
parameters about a quarter of one GPU's memory (at most 8% of host RAM). ``--dry-run``
runs the same code on two CPU virtual devices with a GPU's semantics
(``VirtualDevice(semantics="cuda")``, ``memory_limit`` as the cap of
``bigger_than_device``) and tiny models: what CI runs, so the kit cannot rot without a GPU.
"""

from __future__ import annotations

import argparse
import copy
import faulthandler
import gc
import json
import math
import os
import platform
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import fxpipe
from fxpipe import check_finetune as ft
from fxpipe.check_common import ROOT, TAIL_LINES, link_bandwidth
from fxpipe.check_common import error_record as _error
from fxpipe.check_common import jsonable as _jsonable
from fxpipe.check_common import sync_fn as _sync
from fxpipe.check_common import timed as _time
from fxpipe.check_common import unsampled as _unsampled
from fxpipe.config import STAGE_BACKENDS
from fxpipe.demo import TinyLlama, progression_batch, rotary_tables
from fxpipe.passes.program import Prefetch, parse_action
from fxpipe.sim import Hardware

CUDA_TESTS = ["tests/test_cuda.py", "tests/test_devices.py", "tests/test_params.py"]
SECTIONS = ("cuda_tests", "vs_checkpoint", "scaling", "hidden_prefetch",
            "predicted_vs_measured", "stats", "bigger_than_device", "weights", "generate",
            "finetune")
# the share of the budget kept for each section while the ones before it run
RESERVE = {"cuda_tests": 0.0, "vs_checkpoint": 0.12, "scaling": 0.12, "hidden_prefetch": 0.10,
           "predicted_vs_measured": 0.04, "stats": 0.01, "bigger_than_device": 0.15,
           "weights": 0.05, "generate": 0.06, "finetune": 0.45}


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), target.flatten())


def _say(msg: str) -> None:
    print(f"[fxpipe.check] {msg}", flush=True)


class SectionTimeout(Exception):
    """A section ran past its share of the time budget."""


class BudgetSpent(Exception):
    """No time was left for a section."""


# ---------------------------------------------------------------------------- setup

def _model_shape(dry_run: bool) -> dict[str, int]:
    """Dims of the Llama-style model: tiny for a dry run; else fp32 parameters about a
    quarter of one GPU's memory, capped at 8% of host RAM."""
    if dry_run:
        return dict(vocab=256, dim=64, heads=4, depth=4, batch=4, seq=32)
    gpu = torch.cuda.get_device_properties(0).total_memory
    budget = min(0.25 * gpu, 0.08 * _host_memory())
    dim = 2048
    per_block = 12 * dim * dim * 4          # attention 4d^2 + MLP 6d^2 (+ margin), fp32
    depth = max(2, min(64, int(budget // per_block)))
    return dict(vocab=32000, dim=dim, heads=16, depth=depth, batch=4, seq=1024)


def _host_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _devices(n: int, dry_run: bool) -> list[Any]:
    if dry_run:
        return [fxpipe.VirtualDevice(semantics="cuda") for _ in range(n)]
    return [f"cuda:{i}" for i in range(n)]


def _settle(dry_run: bool) -> None:
    """Between sections and between variants: drop garbage and (GPUs) give the caching
    allocator's free blocks back, so the next phase starts from a clean allocator."""
    gc.collect()
    if not dry_run and torch.cuda.is_available():
        _sync(False)()
        torch.cuda.empty_cache()


def _call_path(pipe) -> dict[str, int]:
    """How many stage runs the last call made (each as its generated code)."""
    s = pipe.stats()
    return {k: s[k] for k in ("generated_runs",) if k in s}


class Kit:
    """What the sections share: the arguments, the model's shape, the traced step."""

    def __init__(self, dry_run: bool, num_devices: int, repeats: int, skip_tests: bool,
                 shape: dict[str, int], stage_backends: tuple[str | None, ...] = (None,)):
        self.dry_run, self.num, self.repeats = dry_run, num_devices, repeats
        self.skip_tests, self.shape = skip_tests, shape
        self.stage_backends = stage_backends   # finetune: RunConfig.stage_backend of its runs
        self.deadline_s: float | None = None   # the running section's time allowance
        # a section's partial result, written to the JSON at once (set by run_sections)
        self.progress: Callable[[dict[str, Any]], None] = lambda partial: None
        self._traced: dict[str, Any] | None = None
        self._traced_error: BaseException | None = None

    def traced(self) -> dict[str, Any]:
        """The traced steps (run once, by the first section that needs them)."""
        if self._traced_error is not None:
            e = self._traced_error
            raise RuntimeError(f"the traced step failed (see hidden_prefetch): "
                               f"{type(e).__name__}: {e}") from e
        if self._traced is None:
            try:
                self._traced = traced_step(self.shape, self.num, self.dry_run)
            except Exception as e:
                self._traced_error = e
                raise
        return self._traced

    def close(self) -> None:
        if self._traced is not None:
            self._traced["pipe"].close()
            self._traced = None


# ---------------------------------------------------------------------------- sections

def _run_subprocess(cmd: list[str], timeout: float, cwd: Path | None = None) -> dict[str, Any]:
    """Run ``cmd`` in its own process group; past ``timeout`` s the group is killed and the
    result says so, with the tail of what it printed."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)

    def kill() -> None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)   # the group this Popen started
        except ProcessLookupError:
            pass

    try:
        out, _ = proc.communicate(timeout=max(1.0, timeout))
        timed_out = False
    except subprocess.TimeoutExpired:
        kill()
        out, _ = proc.communicate()
        timed_out = True
    except BaseException:   # Ctrl-C: its own session would not get it
        kill()
        proc.wait()
        raise
    lines = (out or "").strip().splitlines()
    return {"returncode": proc.returncode, "timed_out": timed_out, "timeout_s": round(timeout, 1),
            "seconds": round(time.perf_counter() - t0, 1), "tail": lines[-TAIL_LINES:]}


def cuda_tests(kit: Kit) -> dict[str, Any]:
    """``pytest`` over the CUDA tests (skipped, and said so, without a checkout)."""
    if kit.skip_tests:
        return {"ran": False, "why": "--skip-tests"}
    if not (ROOT / "tests").is_dir():
        return {"ran": False, "why": "no tests/ beside the package (not a source checkout)"}
    cmd = [sys.executable, "-m", "pytest", *CUDA_TESTS, "-q", "-p", "no:logging", "-k",
           "cuda or gpu or Cuda"]
    timeout = kit.deadline_s if kit.deadline_s is not None else 900.0
    _say(f"  pytest {' '.join(cmd[3:])} (timeout {timeout:.0f} s)")
    run = _run_subprocess(cmd, timeout, cwd=ROOT)
    summary = run["tail"][-1] if run["tail"] else ""
    out = {"ok": run["returncode"] == 0 and not run["timed_out"], "ran": True,
           "returncode": run["returncode"], "summary": summary,
           "gpu": torch.cuda.is_available() and not kit.dry_run}
    if run["timed_out"]:
        out["error"] = {"type": "TimeoutExpired",
                        "message": f"the CUDA tests ran past their {timeout:.0f} s share of the "
                                   "time budget (--budget-s) and were killed",
                        "output_tail": run["tail"]}
    elif run["returncode"] != 0:
        out["output_tail"] = run["tail"]
    return out


def _model(shape: dict) -> TinyLlama:
    return TinyLlama(vocab=shape["vocab"], dim=shape["dim"], heads=shape["heads"], depth=shape["depth"])


def _model_and_batch(shape: dict) -> tuple[TinyLlama, torch.Tensor, torch.Tensor]:
    """The kit's model (seeded) and its batch, for ``shape``."""
    torch.manual_seed(0)
    ids, target = progression_batch(shape["batch"], shape["seq"], shape["vocab"],
                                    torch.Generator().manual_seed(0))
    return _model(shape), ids, target


def vs_checkpoint(kit: Kit) -> dict[str, Any]:
    """The fused step on one device against eager with ``torch.utils.checkpoint`` per
    block (the whole model resident on that one GPU). Repeats interleave the two; before
    each variant's warm-up + timed call the allocator is cleaned up (``_settle``)."""
    shape, dry_run = kit.shape, kit.dry_run
    model, ids, target = _model_and_batch(shape)
    pipe = fxpipe.compile(model, example_inputs=(ids,), devices=_devices(1, dry_run))
    try:
        return _vs_checkpoint(kit, pipe, model, ids, target)
    finally:      # also when the section's alarm cuts it off
        pipe.close()


def _vs_checkpoint(kit: Kit, pipe, model, ids, target) -> dict[str, Any]:
    shape, dry_run = kit.shape, kit.dry_run
    where = "cpu" if dry_run else "cuda:0"
    eager = _model(shape).to(where)
    eager.load_state_dict(model.state_dict())
    e_ids, e_target = ids.to(where), target.to(where)

    def eager_step():
        x = eager.embed(e_ids)
        cos, sin = rotary_tables(e_ids.shape[1], eager.head_dim, e_ids.device, x.dtype)
        for layer in eager.layers:
            x = checkpoint(layer, x, cos, sin, use_reentrant=False)
        loss_fn(eager.lm_head(eager.norm(x)), e_target).backward()
        eager.zero_grad(set_to_none=True)

    def fxpipe_step():
        pipe.forward_backward((ids,), label=target, loss_fn=loss_fn)
        model.zero_grad(set_to_none=True)

    sync = _sync(dry_run)
    ratios, times = [], {"fxpipe": [], "eager_checkpoint": []}
    with _unsampled(pipe) as sampling:
        for _ in range(kit.repeats):      # interleaved: drift hits both alike
            _settle(dry_run)
            f = _time(fxpipe_step, 1, 1, sync)[0]
            _settle(dry_run)
            e = _time(eager_step, 1, 1, sync)[0]
            times["fxpipe"].append(f)
            times["eager_checkpoint"].append(e)
            ratios.append(f / e)
    path = _call_path(pipe)
    return {"fxpipe_s": min(times["fxpipe"]), "eager_checkpoint_s": min(times["eager_checkpoint"]),
            "ratio_min": min(ratios), "ratio_median": statistics.median(ratios),
            "params": sum(p.numel() for p in model.parameters()),
            "timed_calls_sampled": sampling["sampled"], "last_call": path}


def scaling(kit: Kit) -> dict[str, Any]:
    """The fused step on 1 .. N devices; speed-up over one."""
    model, ids, target = _model_and_batch(kit.shape)
    sync = _sync(kit.dry_run)
    rows: dict[int, dict[str, Any]] = {}
    sampled = []
    for n in range(1, kit.num + 1):
        _settle(kit.dry_run)
        pipe = fxpipe.compile(model, example_inputs=(ids,), devices=_devices(n, kit.dry_run),
                              config=fxpipe.RunConfig(num_microbatch=max(2, n + 1)))
        try:
            with _unsampled(pipe) as sampling:
                t = _time(lambda: (pipe.forward_backward((ids,), label=target, loss_fn=loss_fn),
                                   model.zero_grad(set_to_none=True)), 2, kit.repeats, sync)
        finally:
            pipe.close()
        sampled.append(sampling["sampled"])
        rows[n] = {"step_s_min": min(t), "step_s_median": statistics.median(t)}
        _say(f"  {n} device(s): {rows[n]['step_s_median']:.3f} s/step")
    base = rows[1]["step_s_median"]
    for n, r in rows.items():
        r["speedup_median"] = base / r["step_s_median"]
    out = {"devices": rows, "timed_calls_sampled": None if None in sampled else any(sampled),
           "note": None if kit.num > 1 else "one device visible: no scaling to measure"}
    if kit.num == 1 or kit.dry_run:
        out["logical"] = logical_devices(kit)
        out["ok"] = out["logical"]["ok"]
    return out


def logical_devices(kit: Kit, steps: int = 2) -> dict[str, Any]:
    """Two logical devices over one GPU (two ``CudaDevice(0)``, each with its own streams,
    events and copies; in a dry run two VirtualDevices) against one: the cross-device
    ordering code on real CUDA. SGD steps from the same weights; the losses must agree
    within 1e-4 (the same kernels on the same inputs, in another order: equal so far)."""
    from fxpipe.runtime.devices import CudaDevice

    def two() -> list[Any]:
        if kit.dry_run:
            return _devices(2, True)
        half = torch.cuda.get_device_properties(0).total_memory // 2
        return [CudaDevice(0, memory_limit=half, name=f"cuda:0/{i}") for i in range(2)]

    model, ids, target = _model_and_batch({**kit.shape, "depth": min(4, kit.shape["depth"])})
    state = copy.deepcopy(model.state_dict())
    losses: dict[str, list[float]] = {}
    for name, devices in (("one", lambda: _devices(1, kit.dry_run)), ("two_logical", two)):
        model.load_state_dict(state)
        _settle(kit.dry_run)
        pipe = fxpipe.compile(model, example_inputs=(ids,), devices=devices(),
                              config=fxpipe.RunConfig(num_microbatch=3))
        try:
            opt = torch.optim.SGD(model.parameters(), lr=1e-2)
            losses[name] = []
            for _ in range(steps):
                losses[name].append(float(pipe.forward_backward((ids,), label=target,
                                                                loss_fn=loss_fn, optimizer=opt)))
                opt.zero_grad(set_to_none=True)
            if name == "two_logical":
                plan = repr(pipe.plan)
        finally:
            pipe.close()
    diff = max(abs(a - b) for a, b in zip(losses["one"], losses["two_logical"]))
    return {"losses": losses, "max_loss_diff": diff, "plan": plan,
            "ok": diff <= 1e-4 * max(1.0, abs(losses["one"][0]))}


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _overlap(a: tuple[float, float], spans: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(a[1], b) - max(a[0], s)) for s, b in spans)


def _stage_of(label: str) -> tuple[Any, int | None]:
    """The Program action a timeline label names, and its stage (None: no stage)."""
    try:
        action = parse_action(label)
    except ValueError:
        return None, None
    return action, getattr(action, "stage", None)


def prefetch_figures(intervals: list[Any], device: int) -> dict[str, Any]:
    """One device's prefetch figures from a timeline's intervals (ms).

    ``hidden_fraction``: the share of prefetch time that overlapped the device's compute.
    ``exposed_ms``: for each stage's first compute on the device after the device's first
    compute, ``max(0, min(compute_start, prefetch_end) - previous_compute_end)`` (the time
    the compute stream idled while that stage's ``Prefetch`` was still arriving), summed.
    ``first_prefetch_ms``: the duration of the prefetch of the device's first computing
    stage (the pipeline's fill: no earlier compute on the device can hide it).

    >>> from fxpipe.sim.timeline import Interval
    >>> ivs = [Interval(0, "prefetch", "0P", "transfer", 0, 2),
    ...        Interval(0, "compute", "0F0", "forward", 2, 5),
    ...        Interval(0, "prefetch", "2P", "transfer", 3, 7),
    ...        Interval(0, "compute", "2F0", "forward", 7, 9)]
    >>> f = prefetch_figures(ivs, 0)
    >>> f["exposed_ms"], f["first_prefetch_ms"], round(f["hidden_fraction"], 3)
    (2.0, 2.0, 0.333)
    """
    ivs = [iv for iv in intervals if iv.device == device]
    compute = sorted((iv for iv in ivs if iv.kind != "transfer"), key=lambda iv: iv.start)
    prefetch = {}
    for iv in ivs:
        action, stage = _stage_of(iv.label)
        if isinstance(action, Prefetch):
            prefetch[stage] = iv
    spans = [(iv.start, iv.end) for iv in prefetch.values()]
    total = sum(b - a for a, b in spans)
    union = _union([(iv.start, iv.end) for iv in compute])
    hidden = sum(_overlap(p, union) for p in spans) / total if total else None
    exposed, first, seen, prev_end = 0.0, None, set(), None
    for iv in compute:
        _, stage = _stage_of(iv.label)
        if stage is not None and stage not in seen:
            seen.add(stage)
            pf = prefetch.get(stage)
            if pf is not None:
                if prev_end is None:
                    first = float(pf.end - pf.start)
                else:
                    exposed += max(0.0, float(min(iv.start, pf.end) - prev_end))
        prev_end = iv.end if prev_end is None else max(prev_end, iv.end)
    return {"hidden_fraction": hidden, "exposed_ms": exposed, "first_prefetch_ms": first,
            "prefetches": len(prefetch)}


def traced_step(shape: dict, num_devices: int, dry_run: bool) -> dict[str, Any]:
    """Two traced steps on all devices: one timed layer by layer (its layer times feed
    the simulator, its makespan is what it predicts), then one that is not (what a
    training call runs: its timeline gives the prefetch figures, its ``pipe.stats()``
    the stats). Returns the pipe (open), both recordings and the stats."""
    model, ids, target = _model_and_batch(shape)
    M = max(2, num_devices + 1)
    pipe = fxpipe.compile(model, example_inputs=(ids,), devices=_devices(num_devices, dry_run),
                          config=fxpipe.RunConfig(num_microbatch=M))
    try:
        for _ in range(2):
            pipe.forward_backward((ids,), label=target, loss_fn=loss_fn)
        pipe.timings.reset()          # the next call is timed layer by layer
        pipe.timings.warmup = 0
        with pipe.trace() as sampled_rec:
            pipe.forward_backward((ids,), label=target, loss_fn=loss_fn)
        with _unsampled(pipe) as sampling:
            pipe.forward_backward((ids,), label=target, loss_fn=loss_fn)   # warm generated code
            _settle(dry_run)
            with pipe.trace() as rec:
                pipe.forward_backward((ids,), label=target, loss_fn=loss_fn)
            stats = pipe.stats()
    except BaseException:
        pipe.close()
        raise
    return {"pipe": pipe, "M": M, "sampled_rec": sampled_rec, "rec": rec, "stats": stats,
            "unsampled": sampling}


def hidden_prefetch(kit: Kit) -> dict[str, Any]:
    tr = kit.traced()
    timeline = tr["rec"].timeline
    devices = {d: prefetch_figures(timeline.intervals, d) for d in range(kit.num)}
    return {"devices": devices,
            "exposed_ms_total": sum(f["exposed_ms"] for f in devices.values()),
            "makespan_ms": timeline.makespan, "call_sampled": tr["unsampled"]["sampled"]}


def predicted_vs_measured(kit: Kit) -> dict[str, Any]:
    tr = kit.traced()
    pipe, rec = tr["pipe"], tr["sampled_rec"]
    h2d, d2h = link_bandwidth(kit.dry_run)
    hw = Hardware(h2d_bandwidth=h2d, d2h_bandwidth=d2h)
    predicted = fxpipe.simulate(pipe, hw, num_microbatch=tr["M"]).makespan
    measured = rec.timeline.makespan
    return {"predicted_ms": predicted, "measured_ms": measured,
            "predicted_over_measured": predicted / measured if measured else None,
            "call_sampled": True, "measured_unsampled_ms": tr["rec"].timeline.makespan,
            "h2d_bytes_per_s": h2d, "d2h_bytes_per_s": d2h,
            "bubble_ratio_measured": rec.timeline.bubble_ratio, "plan": repr(pipe.plan)}


def stats(kit: Kit) -> dict[str, Any]:
    """The unsampled step's ``pipe.stats()``, and the host's issue time beside each
    device's compute busy time in it (``issue_vs_busy``: above 1, the host could not
    keep that device fed)."""
    tr = kit.traced()
    try:
        issue_ms = tr["stats"]["host_issue_us"] / 1e3
        busy = {d: sum(iv.end - iv.start for iv in tr["rec"].timeline.intervals
                       if iv.device == d and iv.stream == "compute") for d in range(kit.num)}
        return {**tr["stats"], "call_sampled": tr["unsampled"]["sampled"],
                "host_issue_ms": issue_ms, "compute_busy_ms": busy,
                "issue_vs_busy": {d: issue_ms / b if b else None for d, b in busy.items()}}
    finally:
        kit.close()


def weights(kit: Kit, steps: int = 2) -> dict[str, Any]:
    """``compile(weights=DIR)`` on a model built on ``meta`` whose base is frozen (only
    its norms train, as a LoRA-style fine-tune): the frozen parameters stay file-backed
    read-only maps; on a GPU uploads read their pages registered for DMA where the driver
    allows (``registered``), else through the bounded pinned ring (``ring_bytes``; what
    a dry run exercises). Losses against the same model loaded in memory."""
    import tempfile

    from safetensors.torch import save_file

    from fxpipe.runtime import pinned
    from fxpipe.runtime.weights import file_backed

    shape = kit.shape

    def frozen_base(m: torch.nn.Module) -> torch.nn.Module:
        for name, p in m.named_parameters():
            p.requires_grad_("norm" in name)
        return m

    model, ids, target = _model_and_batch(shape)
    out: dict[str, Any] = {"model": shape, "steps": steps, "trains": "the norms (a frozen base)"}
    losses: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as d:
        save_file({k: v.detach().contiguous().clone() for k, v in model.state_dict().items()},
                  f"{d}/model.safetensors")
        with torch.device("meta"):
            meta = _model(shape)
        for name, m, kw in (("in_memory", frozen_base(model), {}),
                            ("weights", frozen_base(meta), {"weights": d})):
            pipe = fxpipe.compile(m, example_inputs=(ids,), devices=_devices(1, kit.dry_run),
                                  pin_memory=True, **kw)
            try:
                opt = torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.1)
                losses[name] = []
                for _ in range(steps):
                    loss = pipe.forward_backward((ids,), label=target, loss_fn=loss_fn,
                                                 optimizer=opt)
                    losses[name].append(float(loss))
                if name == "weights":
                    frozen = [p for p in m.parameters() if not p.requires_grad]
                    host = pipe._current.runners[next(iter(pipe._current.runners))].host()
                    out.update({
                        "frozen_bytes": sum(p.numel() * p.element_size() for p in frozen),
                        "frozen_file_backed": sum(file_backed(p) is not None for p in frozen),
                        "frozen_params": len(frozen),
                        "registered": any(pinned.is_pinned(p) for p in frozen
                                          if file_backed(p) is not None),
                        "ring_bytes": host.ring.nbytes if host.ring is not None else 0,
                        "host_stalls": pipe.stats().get("host_stalls")})
            finally:
                pipe.close()
    out.update({"losses": losses, "max_loss_diff": max(
        abs(a - b) for a, b in zip(losses["weights"], losses["in_memory"]))})
    out["ok"] = (out["frozen_file_backed"] == out["frozen_params"] > 0
                 and out["max_loss_diff"] <= 1e-5 * max(1.0, abs(losses["in_memory"][0])))
    return out


def generate(kit: Kit, new: int = 32) -> dict[str, Any]:
    """``pipe.generate`` (KV cache) of a Hugging Face Llama from a config, greedy, left-
    padded prompts: the tokens against ``transformers``' ``model.generate`` on the same
    device with every weight resident there, and the tokens per second of both (min
    over two timed runs after a warm-up)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if kit.dry_run:
        shape, batch, prompt = dict(hidden=32, layers=2, vocab=64), 2, 8
    else:
        shape, batch, prompt = dict(hidden=2048, layers=16, vocab=32000), 16, 128
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=shape["vocab"], hidden_size=shape["hidden"],
        intermediate_size=shape["hidden"] * 11 // 4, num_hidden_layers=shape["layers"],
        num_attention_heads=16 if not kit.dry_run else 4, num_key_value_heads=4 if not kit.dry_run else 2,
        max_position_embeddings=prompt + new + 64, pad_token_id=0)).eval()
    model.generation_config.eos_token_id = None
    ids = torch.randint(1, shape["vocab"], (batch, prompt))
    mask = torch.ones_like(ids)
    mask[::2, : prompt // 4] = 0
    ids[mask == 0] = 0
    where = "cpu" if kit.dry_run else "cuda:0"
    eager = copy.deepcopy(model).to(where)
    pipe = fxpipe.compile(model, example_inputs=(ids,), devices=_devices(1, kit.dry_run))
    sync = _sync(kit.dry_run)
    try:
        def fx():
            return pipe.generate(ids, mask, max_new_tokens=new)

        def hf():
            with torch.no_grad():
                return eager.generate(ids.to(where), attention_mask=mask.to(where),
                                      max_new_tokens=new, do_sample=False).cpu()
        outs, seconds = {}, {"fxpipe": [], "transformers": []}
        for name, fn in (("fxpipe", fx), ("transformers", hf)) * 3:
            sync()
            t0 = time.perf_counter()
            outs[name] = fn()
            sync()
            seconds[name].append(time.perf_counter() - t0)
        tokens = batch * new
        rate = {k: tokens / min(v[1:]) for k, v in seconds.items()}
        same = bool(torch.equal(outs["fxpipe"], outs["transformers"]))
        agree = float((outs["fxpipe"][:, prompt:] == outs["transformers"][:, prompt:]).float().mean())
        return {"model": shape, "batch": batch, "prompt": prompt, "new": new,
                "parameters": sum(p.numel() for p in model.parameters()),
                "same_tokens": same, "token_agreement": agree,
                "tokens_per_s": rate, "over_transformers": rate["fxpipe"] / rate["transformers"],
                "kv_cache": "host", "ok": same or agree > 0.9}
    finally:
        pipe.close()


def finetune(kit: Kit) -> dict[str, Any]:
    """bf16 fine-tuning of Hugging Face models from host memory, against eager
    ``transformers`` (``fxpipe.check_finetune``); each run's row written at once."""
    sync = _sync(kit.dry_run)
    link = link_bandwidth(kit.dry_run)
    ctx = ft.context(kit.dry_run, kit.num, lambda fn, warmup, repeats: _time(fn, warmup, repeats, sync),
                     sync, link)
    head = {"peak_bf16_tflops": ctx["peak_tflops"], "h2d_bytes_per_s": link[0],
            "d2h_bytes_per_s": link[1]}
    rows = ft.run_all(ctx, backends=kit.stage_backends,
                      on_row=lambda rows: kit.progress({**head, "runs": rows}), say=_say)
    return {**head, "runs": rows, "ok": bool(rows) and all(r["ok"] for r in rows)}


def _bigger_setup(dry_run: bool) -> tuple[int, dict[str, int], int, float]:
    """(cap in bytes, model shape, microbatches, learning rate) of bigger_than_device: a
    deep model of small blocks whose bf16 weights are about 2.1x the cap."""
    if dry_run:
        cap, shape, M, lr = 320_000, dict(vocab=64, dim=32, heads=4, batch=8, seq=16), 4, 1e-2
    else:
        # 20 host bytes per parameter (fp32 master, gradient, two AdamW moments, bf16
        # copy) within a third of host RAM
        cap = int(min(2**30, _host_memory() / 3 / 20 * 2 / 2.1))
        shape, M, lr = dict(vocab=8192, dim=2048, heads=16, batch=4, seq=512), 4, 3e-4
    dim = shape["dim"]
    per_block = (10 * dim * dim + 2 * dim) * 2          # bf16: qkv, o, gate, up, down; 2 norms
    rest = (shape["vocab"] * dim + dim) * 2              # tied embedding/head, final norm
    shape["depth"] = max(2, math.ceil((2.1 * cap - rest) / per_block))
    return cap, shape, M, lr


def bigger_than_device(kit: Kit, steps: int = 3) -> dict[str, Any]:
    """Train a model whose bf16 weights are over twice what the device may hold."""
    cap, shape, M, lr = _bigger_setup(kit.dry_run)
    model, ids, target = _model_and_batch(shape)
    weights = sum(p.numel() for p in model.parameters()) * 2
    if weights < 2 * cap:
        raise AssertionError(f"bf16 weights {weights} B are not 2x the cap {cap} B")
    out: dict[str, Any] = {"cap_bytes": cap, "weights_bf16_bytes": weights,
                           "weights_over_limit": weights / cap, "model": shape,
                           "num_microbatch": M, "param_dtype": "bfloat16",
                           "optimizer": "torch.optim.AdamW, streamed: forward_backward(optimizer=)"}
    if kit.dry_run:
        devices = [fxpipe.VirtualDevice(semantics="cuda", memory_limit=cap) for _ in range(2)]
    else:
        from fxpipe.runtime.devices import CudaDevice
        _settle(False)
        # what earlier sections left allocated does not count against the cap
        before = torch.cuda.memory_allocated(0)
        fraction = (before + cap) / torch.cuda.get_device_properties(0).total_memory
        out.update({"memory_fraction": fraction, "allocated_before_bytes": before,
                    "reserved_before_bytes": torch.cuda.memory_reserved(0)})
        torch.cuda.set_per_process_memory_fraction(fraction, 0)
        torch.cuda.reset_peak_memory_stats(0)
        devices = [CudaDevice(0, memory_limit=cap)]   # the planner sizes stages to the cap
    pipe = None
    try:
        pipe = fxpipe.compile(model, example_inputs=(ids,), devices=devices,
                              param_dtype=torch.bfloat16,
                              config=fxpipe.RunConfig(num_microbatch=M))
        out["plan_stages"] = {"fwd": len(pipe.plan.fwd_plan), "bwd": len(pipe.plan.bwd_plan)}
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        sync = _sync(kit.dry_run)
        losses, seconds = [], []
        with _unsampled(pipe) as sampling:
            for _ in range(steps):
                t0 = time.perf_counter()
                loss = pipe.forward_backward((ids,), label=target, loss_fn=loss_fn, optimizer=opt)
                sync()
                seconds.append(time.perf_counter() - t0)
                opt.zero_grad(set_to_none=True)
                losses.append(float(loss))
        if kit.dry_run:
            reserved = max(d.peak_reserved_bytes() for d in pipe.devices)
            allocated = max(d.peak_bytes() for d in pipe.devices)
        else:
            reserved = torch.cuda.max_memory_reserved(0) - before
            allocated = torch.cuda.max_memory_allocated(0) - before
    finally:
        if pipe is not None:
            pipe.close()
        if not kit.dry_run:
            torch.cuda.set_per_process_memory_fraction(1.0, 0)
    if kit.dry_run and reserved > cap:
        out["note"] = ("a VirtualDevice keeps freed copies for reuse past its memory_limit (a "
                       "GPU's allocator frees its cache and retries first): reserved may exceed "
                       "the cap in a dry run; peak_allocated_over_limit is what was resident")
    timed = seconds[1:] or seconds          # the first step compiles: left out when others ran
    tokens = ids.numel()
    out.update({
        "peak_reserved_over_limit": reserved / cap, "peak_allocated_over_limit": allocated / cap,
        "tokens_per_s": tokens * len(timed) / sum(timed), "step_s": seconds, "losses": losses,
        "timed_calls_sampled": sampling["sampled"],
        "ok": all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]})
    return out


# ---------------------------------------------------------------------------- running

def _write(path: Path, report: dict[str, Any]) -> None:
    """Write ``report`` to ``path`` atomically (a temporary file, then ``os.replace``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        json.dump(_jsonable(report), f, indent=1, allow_nan=False)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


@contextmanager
def _alarm(seconds: float | None) -> Iterator[None]:
    """Raise SectionTimeout in the main thread after ``seconds`` (and every 20 s after,
    should cleanup hang too); nothing where there is no SIGALRM or off the main thread."""
    if seconds is None or not hasattr(signal, "setitimer") or \
            threading.current_thread() is not threading.main_thread():
        yield
        return

    def ring(signum, frame):
        raise SectionTimeout(f"past its {seconds:.0f} s share of the time budget (--budget-s)")

    old = signal.signal(signal.SIGALRM, ring)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.01), 20.0)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _summary(name: str, r: dict[str, Any]) -> str:
    """One line about a section's result (never raises: printing must not stop the kit)."""
    try:
        return _summary_line(name, r)
    except Exception:   # noqa: BLE001
        return "ok" if r.get("ok") else "FAILED"


def _summary_line(name: str, r: dict[str, Any]) -> str:
    if not r.get("ok"):
        err = r.get("error")
        return "FAILED: " + (f"{err['type']}: {err['message'][:300]}" if err else
                             str(r.get("summary") or r.get("losses") or ""))
    if name == "cuda_tests":
        return r.get("summary") or r.get("why", "")
    if name == "vs_checkpoint":
        return (f"fxpipe / eager+checkpoint: min {r['ratio_min']:.3f}, "
                f"median {r['ratio_median']:.3f}")
    if name == "scaling":
        line = ", ".join(f"{n}: {v['speedup_median']:.2f}x" for n, v in r["devices"].items())
        if "logical" in r:
            line += f"; two logical devices on one: loss difference {r['logical']['max_loss_diff']:.1e}"
        return line
    if name == "hidden_prefetch":
        return ", ".join(f"dev {d}: hidden {_fmt(f['hidden_fraction'])}, exposed "
                         f"{f['exposed_ms']:.1f} ms" for d, f in r["devices"].items())
    if name == "predicted_vs_measured":
        return f"predicted/measured {_fmt(r['predicted_over_measured'])}"
    if name == "stats":
        return f"host waits {r.get('host_waits')}"
    if name == "bigger_than_device":
        return (f"weights {r['weights_over_limit']:.2f}x the cap, peak reserved "
                f"{r['peak_reserved_over_limit']:.2f}x, {r['tokens_per_s']:.0f} tokens/s, "
                f"losses {[round(x, 3) for x in r['losses']]}")
    if name == "generate":
        return (f"tokens equal transformers: {r['same_tokens']} (agreement "
                f"{r['token_agreement']:.3f}); {r['tokens_per_s']['fxpipe']:.0f} tokens/s, "
                f"{r['over_transformers']:.2f}x transformers with its weights resident")
    if name == "finetune":
        return "; ".join(ft.summary(row).strip() for row in r["runs"])
    if name == "weights":
        return (f"{r['frozen_file_backed']}/{r['frozen_params']} frozen parameters file-backed, "
                f"{'registered for DMA' if r['registered'] else 'through the pinned ring'}, "
                f"loss difference {r['max_loss_diff']:.1e}")
    return ""


def _fmt(x: Any) -> str:
    return f"{x:.3f}" if isinstance(x, float) else str(x)


def _fail_injected(name: str, fail: list[str], report: dict[str, Any], out: Path) -> None:
    """``--fail-section NAME`` (tests): the section raises; ``NAME:exit``: the process
    dies there, as a crash or a kill would."""
    if f"{name}:exit" in fail:
        _write(out, report)
        sys.stdout.flush()
        os._exit(3)
    if name in fail:
        raise RuntimeError(f"{name}: failure injected by --fail-section")


def _partial(report: dict[str, Any], out: Path, name: str) -> Callable[[dict[str, Any]], None]:
    def write(partial: dict[str, Any]) -> None:
        report[name] = {"ok": False, "partial": True, **partial}
        _write(out, report)
    return write


def run_sections(kit: Kit, report: dict[str, Any], out: Path, budget_s: float,
                 fail: list[str] = (), sections: tuple[str, ...] = SECTIONS) -> list[str]:
    """Run ``sections`` in order into ``report``, writing ``out`` after each (and when a
    section reports progress); returns the names of the sections that failed."""
    t0 = time.perf_counter()
    failed = []
    # the reserves of the sections that run, scaled to leave a tenth of the budget free
    scale = budget_s * min(1.0, 0.9 / max(sum(RESERVE[n] for n in sections), 1e-9))
    for i, name in enumerate(sections):
        elapsed = time.perf_counter() - t0
        remaining = budget_s - elapsed
        later = sum(RESERVE[n] for n in sections[i + 1:]) * scale
        allowed = max(remaining - later, min(remaining, RESERVE[name] * scale))
        report["in_progress"] = name
        _write(out, report)
        _say(f"[{elapsed:6.1f} s] {name} (up to {max(allowed, 0):.0f} s) ...")
        start = time.perf_counter()
        result: dict[str, Any]
        try:
            if allowed <= 0:
                raise BudgetSpent(f"no time left of the {budget_s:.0f} s budget (--budget-s)")
            kit.deadline_s = allowed
            kit.progress = _partial(report, out, name)
            _fail_injected(name, list(fail), report, out)
            fn = globals()[name]
            # the subprocess keeps its own timeout; an alarm would cut its tail off
            with _alarm(None if name == "cuda_tests" else allowed):
                result = dict(fn(kit))
        except Exception as e:   # noqa: BLE001 - a section's failure is its report
            result = {"ok": False, "error": _error(e)}
        finally:
            kit.deadline_s = None
            kit.progress = lambda partial: None
        try:
            _settle(kit.dry_run)
        except Exception as e:   # noqa: BLE001
            result.setdefault("cleanup_error", _error(e))
        result = {"ok": bool(result.pop("ok", True)), **result,
                  "seconds": round(time.perf_counter() - start, 2)}
        report[name] = result
        del report["in_progress"]
        _write(out, report)
        if not result["ok"]:
            failed.append(name)
        _say(f"[{time.perf_counter() - t0:6.1f} s] {name}: {_summary(name, result)}")
    return failed


def main(argv: list[str] | None = None) -> int:
    global _interrupted
    ap = argparse.ArgumentParser(prog="python -m fxpipe.check", description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true",
                    help="no GPU needed: virtual devices with GPU semantics, tiny models")
    ap.add_argument("--out", default=None, help="JSON file (default: fxpipe_check.json, or "
                    "benchmarks/results/gpu_check[_dry_run].json in a source checkout)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--skip-tests", action="store_true", help="measure only")
    ap.add_argument("--budget-s", type=float, default=540.0,
                    help="time for the whole kit, in seconds (default 540)")
    ap.add_argument("--sections", default=None, metavar="NAME,...",
                    help="run only these sections, in this order (default: all: "
                    + ",".join(SECTIONS) + ")")
    ap.add_argument("--stage-backends", default="eager", metavar="NAME,...",
                    help="finetune: run fxpipe with each RunConfig.stage_backend (eager, "
                    "inductor, auto; default eager)")
    ap.add_argument("--fail-section", action="append", default=[], help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    sections = SECTIONS
    if args.sections is not None:
        sections = tuple(n.strip() for n in args.sections.split(",") if n.strip())
        unknown = [n for n in sections if n not in SECTIONS]
        if unknown or not sections or len(set(sections)) != len(sections):
            print(f"fxpipe.check: --sections {args.sections!r}: "
                  + (f"no section named {', '.join(unknown)}; " if unknown else
                     "list each section once; " if sections else "empty; ")
                  + f"the sections are {', '.join(SECTIONS)}", file=sys.stderr)
            return 2
    if not args.dry_run and not torch.cuda.is_available():
        print("fxpipe.check: no CUDA GPU visible (torch.cuda.is_available() is False); run on a "
              "GPU machine, or use --dry-run to exercise the kit on CPU", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    if args.out:
        out = Path(args.out)
    elif (ROOT / "benchmarks").is_dir():
        out = ROOT / "benchmarks" / "results" / ("gpu_check_dry_run.json" if args.dry_run
                                                 else "gpu_check.json")
    else:
        out = Path("fxpipe_check.json")
    if args.dry_run:
        torch.set_num_threads(1)   # as each virtual device's workers: a like-for-like eager
    num = 2 if args.dry_run else torch.cuda.device_count()
    shape = _model_shape(args.dry_run)
    report: dict[str, Any] = {
        "dry_run": args.dry_run, "torch": torch.__version__, "python": platform.python_version(),
        "devices": (["virtual (semantics=cuda)"] * num if args.dry_run else
                    [torch.cuda.get_device_name(i) for i in range(num)]),
        "model": shape, "budget_s": args.budget_s, "sections": list(sections)}
    _say(f"{num} device(s): {report['devices']}; model {shape}; budget {args.budget_s:.0f} s; "
         f"writing {out}")
    # a hang past the budget (in C code, where the alarm cannot reach) still says where
    try:
        faulthandler.dump_traceback_later(args.budget_s + 30, exit=False)
    except (OSError, ValueError):   # a stderr without a file descriptor
        pass
    backends = tuple(b.strip() for b in args.stage_backends.split(",") if b.strip())
    if not backends or any(b not in STAGE_BACKENDS for b in backends):
        print(f"fxpipe.check: --stage-backends {args.stage_backends!r}: each must be one of "
              f"{', '.join(STAGE_BACKENDS)}", file=sys.stderr)
        return 2
    kit = Kit(args.dry_run, num, args.repeats, args.skip_tests, shape,
              tuple(None if b == "eager" else b for b in backends))
    try:
        failed = run_sections(kit, report, out, args.budget_s, args.fail_section, sections)
    finally:
        faulthandler.cancel_dump_traceback_later()
        kit.close()
    report["failed"] = failed
    report["seconds"] = round(time.perf_counter() - t0, 1)
    _write(out, report)
    _say(f"done in {report['seconds']} s; wrote {out}"
         + (f"; FAILED: {', '.join(failed)}" if failed else "; every section ok"))
    _interrupted = any((report[n].get("error") or {}).get("type") == SectionTimeout.__name__
                       for n in sections)
    return 1 if failed else 0


_interrupted = False   # a section was cut off by its alarm (main): device threads may linger


if __name__ == "__main__":
    code = main()
    if _interrupted:   # do not wait for threads an interrupted section may have left running
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
