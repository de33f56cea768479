"""Online per-layer timings: forward, recompute and backward milliseconds per layer.

Each (layer, kind) keeps a bias-corrected exponential moving average, as Adam corrects
its moments: ``m_t = beta * m_{t-1} + (1 - beta) * x_t`` and the estimate is
``m_t / (1 - beta**t)``, so the first kept sample is its own average and old samples
fade out. The very first sample of each (layer, kind) is a warm-up (allocator, caches,
lazy init) and is dropped. With ``fxpipe.verbose.set_verbose(True)`` (or
``FXPIPE_VERBOSE=1``) every measurement is printed to stderr.

>>> timer = LayerTimer()
>>> for ms in (50.0, 2.0, 4.0):
...     timer.record(0, "fwd", ms)
>>> round(timer.time(0, "fwd"), 3)          # the 50 ms warm-up is dropped
3.053
>>> timer.times(0)
(3.0526315789473686, None, None)
>>> timer.times(1) is None
True
"""

from __future__ import annotations

import dataclasses
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any, Literal

from fxpipe.verbose import is_verbose

Kind = Literal["fwd", "recompute", "bwd"]
KINDS: tuple[str, ...] = ("fwd", "recompute", "bwd")


class LayerTimer:
    """Bias-corrected moving averages of per-layer times (thread-safe; see module doc)."""

    def __init__(self, beta: float = 0.9, warmup: int = 1, *, first: int = 4, every: int = 8):
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"beta must be in [0, 1), got {beta}")
        if warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {warmup}")
        if first < 0 or every < 1:
            raise ValueError(f"first must be >= 0 and every >= 1, got {first}, {every}")
        self.beta = beta
        self.warmup = warmup
        self.first, self.every = first, every
        self._calls = 0
        self._pending: list[Callable[[], None]] = []
        self._lock = threading.Lock()
        self._seen: dict[tuple[int, str], int] = {}       # samples seen (incl. warm-up)
        self._avg: dict[tuple[int, str], float] = {}      # biased average m_t
        self._kept: dict[tuple[int, str], int] = {}       # samples averaged (t)

    def sample(self) -> bool:
        """Whether the next call is timed: its first ``first`` calls, then every
        ``every``-th (a timed call's stage code charges each layer its time at the
        layer marks of its runnable code, ``runtime.stages.stage_code``; the others' marks do
        nothing); every call in verbose mode."""
        with self._lock:
            self._calls += 1
            n = self._calls
        return is_verbose() or n <= self.first or n % self.every == 0

    def later(self, fn: Callable[[], None]) -> None:
        """Record with ``fn()`` once the call has ended (``settle``): a GPU's timing
        events are read then, never with a wait inside the call."""
        with self._lock:
            self._pending.append(fn)

    def settle(self, drop: bool = False) -> None:
        """Run what ``later`` deferred (``drop``: forget it: the call failed)."""
        with self._lock:
            pending, self._pending = self._pending, []
        if not drop:
            for fn in pending:
                fn()

    def record(self, layer: int, kind: Kind, ms: float) -> None:
        """Add one measurement of ``layer``'s ``kind`` time, in milliseconds."""
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        ms = float(ms)
        if not ms >= 0.0:
            raise ValueError(f"layer {layer} {kind}: time must be >= 0 ms, got {ms}")
        key = (layer, kind)
        with self._lock:
            seen = self._seen.get(key, 0) + 1
            self._seen[key] = seen
            if seen <= self.warmup:
                estimate = None
            else:
                t = self._kept.get(key, 0) + 1
                self._kept[key] = t
                m = self.beta * self._avg.get(key, 0.0) + (1.0 - self.beta) * ms
                self._avg[key] = m
                estimate = m / (1.0 - self.beta ** t)
        if is_verbose():
            note = "warm-up, dropped" if estimate is None else f"avg {estimate:.3f} ms"
            print(f"fxpipe timer: layer {layer} {kind} {ms:.3f} ms ({note})", file=sys.stderr)

    def time(self, layer: int, kind: Kind) -> float | None:
        """The averaged time of ``layer``'s ``kind`` in ms, ``None`` before any kept sample."""
        with self._lock:
            t = self._kept.get((layer, kind), 0)
            return None if t == 0 else self._avg[(layer, kind)] / (1.0 - self.beta ** t)

    def times(self, layer: int) -> tuple[float | None, float | None, float | None] | None:
        """``(fwd_ms, recompute_ms, bwd_ms)`` for ``layer`` (``None`` for a kind not yet
        measured), or ``None`` when nothing about the layer has been kept yet."""
        values = tuple(self.time(layer, k) for k in KINDS)
        return None if all(v is None for v in values) else values  # type: ignore[return-value]

    def costs(self, layers: Iterable[Any]) -> list[Any]:
        """Each layer's ``cost`` (``passes.costs.Cost``) with the times measured so far
        in place of the estimates: what ``ExecutePlan.auto`` and ``fxpipe.simulate``
        read of a pipe (``pipe.timings.costs(pipe.layers)``). The layers' own costs, the
        compiler's estimates, are left as they are."""
        out = []
        for layer in layers:
            cost, times = layer.cost, self.times(layer.index)
            if cost is not None and times is not None:
                measured = {k: t for k, t in zip(("fwd_ms", "recompute_ms", "bwd_ms"), times)
                            if t is not None}
                cost = dataclasses.replace(cost, **measured)
            out.append(cost)
        return out

    def count(self, layer: int, kind: Kind) -> int:
        """How many samples of ``layer``'s ``kind`` were recorded (warm-up included)."""
        with self._lock:
            return self._seen.get((layer, kind), 0)

    def reset(self) -> None:
        """Forget every measurement (e.g. after the model or the hardware changed); the
        next calls are sampled as the first ones were."""
        with self._lock:
            self._calls = 0
            self._seen.clear()
            self._avg.clear()
            self._kept.clear()

    @contextmanager
    def measure(self, layer: int, kind: Kind) -> Iterator[None]:
        """Time the ``with`` body on the host clock and record it (CPU work; for CUDA
        record event-measured times with ``record``); a body that raises records nothing."""
        start = time.perf_counter()
        yield
        self.record(layer, kind, (time.perf_counter() - start) * 1e3)
