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
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from fxpipe.passes.program import (
    Checkpoint, DownloadGrads, Forward, FusedBackward, Offload, Prefetch, RecomputeBackward,
    Upload, UploadGrad, parse_action,
)
from fxpipe.runtime.devices import Device
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


_KIND = {Forward: "forward", Checkpoint: "forward", FusedBackward: "backward",
         RecomputeBackward: "backward",
         Prefetch: "transfer", Upload: "transfer", UploadGrad: "transfer", Offload: "transfer",
         DownloadGrads: "transfer"}


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
