"""Record a real run's timeline, in the simulator's ``Timeline`` form.

    >>> import torch, fxpipe
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    >>> x, y, loss_fn = torch.randn(6, 4), torch.randn(6, 2), torch.nn.functional.mse_loss
    >>> pipe = fxpipe.compile(model, example_inputs=(x,), devices=["cpu", "cpu"])
    >>> with pipe.trace() as rec:    # pipe.trace("run.json"): also a Chrome trace / Perfetto file
    ...     loss = pipe.forward_backward((x,), label=y, loss_fn=loss_fn)
    >>> sorted({interval.kind for interval in rec.timeline.intervals})
    ['backward', 'forward', 'transfer']
    >>> sorted(rec.actions) == sorted(pipe.program("fused").action_strings())  # ran = printed
    True
    >>> rec.timeline.plot("run.png"); rec.timeline.bubble_ratio  # doctest: +SKIP

``rec.actions`` lists every action executed, ``(lane, str(action))`` in completion
order per lane (a device index, or ``-1`` for the host lane). Each device stream's actions (labelled with the Program's action strings) become
intervals: forward computes as ``forward``, fused and recompute+backward computes as
``backward`` (one interval: the run does not split them), transfers as ``transfer``.

Figures from a recorded timeline (what ``python -m fxpipe.check`` reports):
``prefetch_figures`` (how much of a device's parameter prefetching its compute hid) and
``compute_busy_ms`` (the time a device's compute stream was busy).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from fxpipe.passes.program import (
    Checkpoint, DeviceAllReduce, DeviceReduceScatter, DownloadGrads, Forward, FusedBackward, GraphForward,
    GraphRecomputeBackward, GraphUpload, Offload, Prefetch, RecomputeBackward, Upload,
    UploadGrad, parse_action,
)
from fxpipe.runtime.devices.device import Device
from fxpipe.sim.timeline import Interval, Timeline


class ActionLog:
    """What a pipe's calls report: while a ``trace`` block records, the actions they
    execute (``actions`` is None otherwise); the counters of the last call
    (``pipe.stats()``)."""

    def __init__(self) -> None:
        self.actions: list[tuple[int, str]] | None = None
        self.stats: dict[str, int] = {}


@dataclass
class Recording:
    """Filled in when the ``with pipe.trace()`` block ends."""

    timeline: Timeline | None = None
    actions: list[tuple[int, str]] = field(default_factory=list)


@contextlib.contextmanager
def trace(devices: Sequence[Device], log: ActionLog,
          path: str | Path | None = None) -> Iterator[Recording]:
    """Record what ``devices`` run during the block (see module docstring)."""
    if log.actions is not None:
        raise RuntimeError("pipe.trace() blocks do not nest: this pipe is already recording")
    rec = Recording()
    was = [d.is_recording() for d in devices]
    starts = [len(d.records) for d in devices]
    for d in devices:
        d.reset_peak()
        d.recording(True)
    log.actions = rec.actions
    try:
        yield rec
    finally:
        log.actions = None
        for d, on in zip(devices, was):
            d.recording(on)
    rec.timeline = timeline_of([d.records[n:] for d, n in zip(devices, starts)],
                               [d.peak_bytes() for d in devices])
    if path is not None:
        rec.timeline.to_chrome_trace(path)


_KIND = {Forward: "forward", GraphForward: "forward", Checkpoint: "forward",
         FusedBackward: "backward",
         RecomputeBackward: "backward", GraphRecomputeBackward: "backward",
         Prefetch: "transfer", Upload: "transfer", GraphUpload: "transfer",
         UploadGrad: "transfer", Offload: "transfer",
         DownloadGrads: "transfer", DeviceReduceScatter: "transfer", DeviceAllReduce: "transfer"}


def timeline_of(records: Sequence[Sequence[tuple[str, str, float, float]]],
                peak_memory: Sequence[int]):
    """A ``Timeline`` (ms from the first recorded start) from per-device stream records."""
    t0 = min((r[2] for recs in records for r in recs), default=0.0)
    intervals, busy, free = [], [0.0] * len(records), [0.0] * len(records)
    for d, recs in enumerate(records):
        for stream, label, start, end in recs:
            try:
                kind = _KIND.get(type(parse_action(label)))
            except ValueError:
                kind = None
            if kind is None:  # markers (Release) and anything not a Program action
                continue
            iv = Interval(d, stream, label, kind, (start - t0) * 1e3, (end - t0) * 1e3)
            intervals.append(iv)
            if kind != "transfer":
                busy[d] += iv.end - iv.start
                free[d] = max(free[d], iv.end)
    makespan = max((iv.end for iv in intervals), default=0.0)
    return Timeline(num_devices=len(records), intervals=sorted(intervals, key=lambda i: i.start),
                    makespan=makespan, busy=busy, device_free=free,
                    peak_memory=list(peak_memory), exposed_by_compute={},
                    prefetch_exposed_by_compute={})


def compute_busy_ms(intervals: Sequence[Interval], device: int) -> float:
    """The time (ms) ``device``'s compute stream spent running, over ``intervals``."""
    return sum(iv.end - iv.start for iv in intervals
               if iv.device == device and iv.stream == "compute")


def prefetch_figures(intervals: Sequence[Interval], device: int) -> dict[str, float | int | None]:
    """One device's prefetch figures from a timeline's intervals (ms).

    ``hidden_fraction``: the share of prefetch time that overlapped the device's compute.
    ``exposed_ms``: for each stage's first compute on the device after the device's first
    compute, ``max(0, min(compute_start, prefetch_end) - previous_compute_end)`` (the time
    the compute stream idled while that stage's ``Prefetch`` was still arriving), summed.
    ``first_prefetch_ms``: the duration of the prefetch of the device's first computing
    stage (the pipeline's fill: no earlier compute on the device can hide it).

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


def _stage_of(label: str) -> tuple[object, int | None]:
    """The Program action a timeline label names, and its stage (None: no stage)."""
    try:
        action = parse_action(label)
    except ValueError:
        return None, None
    return action, getattr(action, "stage", None)


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
