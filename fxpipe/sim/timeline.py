"""The result of a simulation: scheduled intervals and the numbers derived from them.

Bubble accounting follows RoundPipe's simulator: over the compute streams,
``bubble_ratio = (makespan * G - busy) / (makespan * G)``, split into

- ``fill``: per device, idle time before its first compute;
- ``drain``: per device, idle time after its last compute;
- ``switch``: per device, idle time between the end of its last forward that ends
  before its first backward, and that backward (minus compute inside the window);
- ``intra``: the rest.

All five are percentages of ``makespan * G``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

COMPUTE_KINDS = ("forward", "recompute", "backward")
COLORS = {"forward": "#4F81BD", "recompute": "#F79646", "backward": "#C0504D",
          "transfer": "#9BBB59", "optimizer": "#8064A2"}


@dataclass(frozen=True, slots=True)
class Interval:
    """One scheduled piece of work: ``kind`` is forward / recompute / backward /
    transfer / optimizer / host (the host lane's other actions), ``label`` the action's
    ``str`` (``3B1``, ``2P``)."""

    device: int
    stream: str
    label: str
    kind: str
    start: float
    end: float


@dataclass
class Timeline:
    """What ``fxpipe.sim.simulate`` returns (times in ms, ratios in percent).

    >>> from fxpipe.passes.schedule import build_program
    >>> from fxpipe.sim import LayerCost, simulate
    >>> p = build_program([range(0, 1)], [range(1, 2), range(0, 1)], "fused", 2, 2, "stage")
    >>> t = simulate(p, [LayerCost(1.0, 2.0)] * 2)
    >>> t.makespan, t.busy
    (9.0, [8.0, 6.0])
    """

    num_devices: int
    intervals: list[Interval]
    makespan: float
    busy: list[float]
    device_free: list[float]
    peak_memory: list[int]
    exposed_by_compute: dict[str, float]
    prefetch_exposed_by_compute: dict[str, float]
    memory_limit: float = float("inf")
    tokens_per_s: float | None = None
    peak_memory_by_kind: list[dict[str, int]] = field(default_factory=list)  # per device
    host_issue_ms: float = 0.0   # the host's issue time (Hardware.host_us_per_*), summed
    # one rank's bytes per kind (fxpipe.sim.simulate.MOVED: pipe.stats()'s transfer names,
    # and network_bytes, what its collectives send over its node's link)
    bytes_moved: dict[str, float] = field(default_factory=dict)
    fill: float = field(init=False)
    drain: float = field(init=False)
    switch: float = field(init=False)
    intra: float = field(init=False)
    bubble_ratio: float = field(init=False)

    @property
    def exposed_transfer_ms(self) -> float:
        """Compute-stream time spent waiting on transfers and hand-off hops: per compute
        action, how much later it ended than it would have with every input transfer
        instantaneous (``exposed_by_compute`` has it per action)."""
        return sum(self.exposed_by_compute.values())

    @property
    def exposed_prefetch_ms(self) -> float:
        """The part of ``exposed_transfer_ms`` spent waiting for parameter prefetches
        (``prefetch_exposed_by_compute`` has it per action)."""
        return sum(self.prefetch_exposed_by_compute.values())

    def __post_init__(self) -> None:
        total = self.makespan * self.num_devices
        fill = drain = switch = 0.0
        per_device: list[list[Interval]] = [[] for _ in range(self.num_devices)]
        for iv in self.intervals:
            if iv.kind in COMPUTE_KINDS and iv.end > iv.start:
                per_device[iv.device].append(iv)
        for comp in per_device:
            if not comp:
                fill += self.makespan
                continue
            fill += comp[0].start
            drain += self.makespan - max(iv.end for iv in comp)
            first_bwd = min((iv.start for iv in comp if iv.kind == "backward"), default=None)
            fwd_ends = [iv.end for iv in comp if iv.kind == "forward"
                        and first_bwd is not None and iv.end <= first_bwd]
            if fwd_ends:
                lo = max(fwd_ends)
                inside = sum(max(0.0, min(iv.end, first_bwd) - max(iv.start, lo)) for iv in comp)
                switch += max(first_bwd - lo - inside, 0.0)
        bubble = total - sum(self.busy)
        pct = (lambda x: 100.0 * x / total) if total > 0 else (lambda x: 0.0)
        self.fill, self.drain, self.switch = pct(fill), pct(drain), pct(switch)
        self.bubble_ratio = pct(bubble)
        self.intra = max(self.bubble_ratio - self.fill - self.drain - self.switch, 0.0)

    @property
    def memory_ok(self) -> bool:
        """Whether every device's peak memory fits ``Hardware.memory``."""
        return all(p <= self.memory_limit for p in self.peak_memory)

    def summary(self) -> str:
        """One line: makespan, bubble and its split, exposed transfers.

        >>> t = Timeline(1, [Interval(0, "compute", "0F0", "forward", 1.0, 3.0)], 4.0, [2.0],
        ...              [3.0], [0], {}, {})
        >>> print(t.summary().replace("  ", "\\n"))
        makespan 4.000 ms
        bubble 50.00% (fill 25.00, drain 25.00, switch 0.00, intra 0.00)
        exposed transfer 0.000 ms
        """
        return (f"makespan {self.makespan:.3f} ms  bubble {self.bubble_ratio:.2f}% "
                f"(fill {self.fill:.2f}, drain {self.drain:.2f}, switch {self.switch:.2f}, "
                f"intra {self.intra:.2f})  exposed transfer {self.exposed_transfer_ms:.3f} ms")

    def to_chrome_trace(self, path: str | Path) -> Path:
        """Write a Chrome trace (chrome://tracing, Perfetto): one process per device,
        one thread per stream; zero-length intervals are left out."""
        streams = sorted({iv.stream for iv in self.intervals})
        tid = {s: i for i, s in enumerate(streams)}
        events: list[dict] = []
        for d in sorted({iv.device for iv in self.intervals}):
            events.append({"name": "process_name", "ph": "M", "pid": d, "tid": 0,
                           "args": {"name": f"device {d}" if d >= 0 else "host"}})
            for s in streams:
                events.append({"name": "thread_name", "ph": "M", "pid": d, "tid": tid[s],
                               "args": {"name": s}})
        for iv in self.intervals:
            if iv.end > iv.start:
                events.append({"name": iv.label, "cat": iv.kind, "ph": "X", "pid": iv.device,
                               "tid": tid[iv.stream], "ts": iv.start * 1e3,
                               "dur": (iv.end - iv.start) * 1e3})
        path = Path(path)
        path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
        return path

    def plot(self, path: str | Path, title: str | None = None) -> Path:
        """Draw the timeline (PNG, SVG, ... by suffix): one row per device (and one for the
        host's lane), compute in the upper band, transfers and the optimizer in a thin
        lower band."""
        try:
            from matplotlib.figure import Figure
            from matplotlib.patches import Patch
        except ImportError as e:
            raise ImportError("Timeline.plot needs matplotlib: pip install 'fxpipe[plot]' "
                              "(or pip install matplotlib)") from e
        rows = self.num_devices + any(iv.device < 0 for iv in self.intervals)  # + the host
        fig = Figure(figsize=(12, 0.6 * rows + 1.2))
        ax = fig.subplots()
        for iv in self.intervals:
            if iv.end <= iv.start:
                continue
            compute = iv.kind in COMPUTE_KINDS
            row = iv.device if iv.device >= 0 else self.num_devices
            y, h = (row + 0.05, 0.6) if compute else (row + 0.68, 0.25)
            ax.broken_barh([(iv.start, iv.end - iv.start)], (y, h), facecolors=COLORS[iv.kind],
                           edgecolors="black", linewidth=0.2)
        ax.set_xlim(0, max(self.makespan, 1e-9) * 1.01)
        ax.set_ylim(rows, 0)
        ax.set_yticks([d + 0.5 for d in range(rows)],
                      [f"device {d}" if d < self.num_devices else "host" for d in range(rows)])
        ax.set_xlabel("time (ms)")
        ax.set_title(title or f"makespan {self.makespan:.1f} ms, bubble {self.bubble_ratio:.2f}%")
        ax.legend(handles=[Patch(facecolor=c, label=k) for k, c in COLORS.items()],
                  loc="upper right", fontsize="small")
        fig.tight_layout()
        path = Path(path)
        fig.savefig(path, dpi=120)
        return path
