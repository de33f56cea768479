"""What the GPU kit's sections share (``fxpipe.check``'s sections, ``fxpipe.check.finetune``,
``benchmarks/bench_finetune.py``): waiting for the GPUs, timing calls, switching the
layer timer off, the host link's bandwidth, JSON-safe records of values and errors
(without this machine's paths: the JSON is committed), and the kit's model (a
``TinyLlama`` with its batch and loss) and devices."""

from __future__ import annotations

import gc
import math
import os
import re
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import fxpipe
from fxpipe.demo import TinyLlama, progression_batch
from fxpipe.runtime.stages.timer import KINDS

ROOT = Path(__file__).resolve().parents[2]   # the checkout (or site-packages)
TAIL_LINES = 40


def sync_fn(dry_run: bool) -> Callable[[], None]:
    """What waits for every GPU's queued work (nothing to wait for in a dry run)."""
    if dry_run:
        return lambda: None

    def sync() -> None:
        for i in range(torch.cuda.device_count()):
            torch.cuda.synchronize(i)
    return sync


def timed(fn: Callable[[], Any], warmup: int, repeats: int, sync: Callable[[], None]) -> list[float]:
    """``fn``'s wall times (s) over ``repeats`` calls after ``warmup`` untimed ones, each
    ended by ``sync`` (the GPUs' queued work done)."""
    for _ in range(warmup):
        fn()
    sync()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - t0)
    return out


def samples(pipe) -> int:
    """How many layer-time samples the pipe's timer has recorded (warm-ups included)."""
    timer = pipe.timings
    return sum(timer.count(i, k) for i in range(len(pipe.layers)) for k in KINDS)


@contextmanager
def unsampled(pipe) -> Iterator[dict[str, Any]]:
    """Calls in the block are not timed layer by layer (``LayerTimer.sample`` is false:
    no first calls, no every-n-th); yields a dict whose ``sampled`` says, after the
    block, whether any call was timed anyway (verbose mode times every call)."""
    timer = pipe.timings
    saved = timer.first, timer.every
    timer.first, timer.every = 0, sys.maxsize
    before = samples(pipe)
    out: dict[str, Any] = {"sampled": None}
    try:
        yield out
    finally:
        timer.first, timer.every = saved
        if pipe.timings is timer:    # the same graph ran throughout (else: unknown)
            out["sampled"] = samples(pipe) != before


def link_bandwidth(dry_run: bool) -> tuple[float, float]:
    """Measured host→device and device→host bytes/s of GPU 0 (pinned, 256 MiB)."""
    if dry_run:
        return float("inf"), float("inf")
    n = 256 * 2**20
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(n, dtype=torch.uint8, device="cuda:0")
    up = min(timed(lambda: dev.copy_(host, non_blocking=True), 2, 5, torch.cuda.synchronize))
    down = min(timed(lambda: host.copy_(dev, non_blocking=True), 2, 5, torch.cuda.synchronize))
    return n / up, n / down


def jsonable(x: Any) -> Any:
    """Strict JSON: non-finite floats as strings ("inf", "nan"), keys as strings."""
    if isinstance(x, float):
        return x if math.isfinite(x) else str(x)
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if x is None or isinstance(x, (bool, int, str)):
        return x
    return str(x)


_SITE = re.compile(r"/\S*/(?:site|dist)-packages/")


def machine_neutral(line: str) -> str:
    """A traceback line without this machine's paths: the checkout's files relative to
    it, installed packages under ``<site-packages>/`` (the JSON is committed).

    >>> machine_neutral('  File "/opt/venv/lib/python3.12/site-packages/torch/_ops.py", line 8')
    '  File "<site-packages>/torch/_ops.py", line 8'
    """
    return _SITE.sub("<site-packages>/", line.replace(f"{ROOT}/", ""))


def error_record(e: BaseException) -> dict[str, Any]:
    lines = "".join(traceback.format_exception(type(e), e, e.__traceback__)).splitlines()
    return {"type": type(e).__name__, "message": machine_neutral(str(e)),
            "traceback": [machine_neutral(line) for line in lines[-TAIL_LINES:]]}


def say(msg: str) -> None:
    print(f"[fxpipe.check] {msg}", flush=True)


# ---------------------------------------------------------------------------- the kit's model

def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), target.flatten())


def host_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def model_shape(dry_run: bool) -> dict[str, int]:
    """Dims of the Llama-style model: tiny for a dry run; else fp32 parameters about a
    quarter of one GPU's memory, capped at 8% of host RAM."""
    if dry_run:
        return dict(vocab=256, dim=64, heads=4, depth=4, batch=4, seq=32)
    gpu = torch.cuda.get_device_properties(0).total_memory
    budget = min(0.25 * gpu, 0.08 * host_memory())
    dim = 2048
    per_block = 12 * dim * dim * 4          # attention 4d^2 + MLP 6d^2 (+ margin), fp32
    depth = max(2, min(64, int(budget // per_block)))
    return dict(vocab=32000, dim=dim, heads=16, depth=depth, batch=4, seq=1024)


def devices(n: int, dry_run: bool) -> list[Any]:
    if dry_run:
        return [fxpipe.VirtualDevice(semantics="cuda") for _ in range(n)]
    return [f"cuda:{i}" for i in range(n)]


@contextmanager
def capped_devices(cap: int, dry_run: bool,
                   virtual: int = 1) -> Iterator[tuple[list[Any], dict[str, Any]]]:
    """Devices that may hold ``cap`` bytes, for a model bigger than the device: in a dry
    run ``virtual`` CPU virtual devices with that ``memory_limit``; on a GPU cuda:0 capped
    with ``torch.cuda.set_per_process_memory_fraction`` (what is allocated already does not
    count against the cap) and one ``CudaDevice(0, memory_limit=cap)`` (the planner sizes
    stages to the cap). Yields the devices and the cap's figures for the JSON (none in a
    dry run); the GPU's fraction is back to 1 after the block."""
    if dry_run:
        yield [fxpipe.VirtualDevice(semantics="cuda", memory_limit=cap) for _ in range(virtual)], {}
        return
    from fxpipe.runtime.devices.cuda import CudaDevice
    settle(False)
    before = torch.cuda.memory_allocated(0)
    fraction = (before + cap) / torch.cuda.get_device_properties(0).total_memory
    figures = {"memory_fraction": fraction, "allocated_before_bytes": before,
               "reserved_before_bytes": torch.cuda.memory_reserved(0)}
    torch.cuda.set_per_process_memory_fraction(fraction, 0)
    torch.cuda.reset_peak_memory_stats(0)
    try:
        yield [CudaDevice(0, memory_limit=cap)], figures
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, 0)


def settle(dry_run: bool) -> None:
    """Between sections and between variants: drop garbage and (GPUs) give the caching
    allocator's free blocks back, so the next phase starts from a clean allocator."""
    gc.collect()
    if not dry_run and torch.cuda.is_available():
        sync_fn(False)()
        torch.cuda.empty_cache()


def call_path(pipe) -> dict[str, int]:
    """How many stage runs the last call made (each as its generated code)."""
    s = pipe.stats()
    return {k: s[k] for k in ("generated_runs",) if k in s}


def build_model(shape: dict) -> TinyLlama:
    return TinyLlama(vocab=shape["vocab"], dim=shape["dim"], heads=shape["heads"], depth=shape["depth"])


def model_and_batch(shape: dict) -> tuple[TinyLlama, torch.Tensor, torch.Tensor]:
    """The kit's model (seeded) and its batch, for ``shape``."""
    torch.manual_seed(0)
    ids, target = progression_batch(shape["batch"], shape["seq"], shape["vocab"],
                                    torch.Generator().manual_seed(0))
    return build_model(shape), ids, target
