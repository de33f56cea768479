"""What the GPU kit's sections share (``fxpipe.check``, ``fxpipe.check_finetune``,
``benchmarks/bench_finetune.py``): waiting for the GPUs, timing calls, switching the
layer timer off, the host link's bandwidth, and JSON-safe records of values and errors
(without this machine's paths: the JSON is committed)."""

from __future__ import annotations

import math
import re
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from fxpipe.runtime.timer import KINDS

ROOT = Path(__file__).resolve().parents[1]
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
