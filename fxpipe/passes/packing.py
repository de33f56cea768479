"""The exact packing under the planner (``fxpipe.passes.planner``, steps 1 and 2 of its
algorithm). ``Chain`` holds one chain's prefix sums and memory fits (additive bytes,
``_Additive``, or the predicted peak, ``_Peak``); ``_pack`` packs greedy stages under a
time bound and the fit; ``probe_all`` packs every chain at one bound; ``solve`` finds
the smallest common bound whose greedy needs at most a given number of stages
(``_search``), and ``rebalance`` re-cuts each segment for its own (``_segment``). Pure
functions over ``ChainCosts`` and ``ChainMemory``: no modules, no tensors.

>>> from fxpipe.passes.chain_costs import ChainCosts
>>> chain = Chain(ChainCosts.from_times([1.0, 1.0, 2.0, 1.0]), "infer")
>>> solve([chain], limit=2).parts[0][0], solve([chain], limit=2).worst   # stage ends
([2, 4], 3.0)
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fxpipe.passes.chain_costs import ChainCosts
from fxpipe.passes.stage_memory import ChainMemory, Growth, Residency, human_bytes

INF = math.inf


def _prefix(xs: Sequence[float]) -> list[float]:
    out, acc = [0.0], 0.0
    for x in xs:
        acc += x
        out.append(acc)
    return out


def _pack(P1: list[float], P: list[float], fit1: Any, fit: Any, end: int, bound: float,
          limit: float, start: int = 0) -> tuple[list[int] | None, float, float]:
    """Greedy over positions [start, end): stage 0 uses prefix sums ``P1`` and memory
    ``fit1``, later ones ``P`` and ``fit`` (``None``: no memory limit; else
    ``fit.reach(i, end)`` is where a stage from ``i`` must end to fit). Returns (stage
    ends, or None if more than ``limit`` stages are needed; worst stage time; smallest
    bound that changes a stage)."""
    cuts: list[int] = []
    i, worst, nxt, T, F = start, 0.0, INF, P1, fit1
    right = bisect.bisect_right
    while i < end:
        if len(cuts) >= limit:
            return None, worst, nxt
        Ti = T[i]
        j = right(T, Ti + bound, i + 1, end + 1) - 1
        while j > i and T[j] - Ti > bound:           # compare stage sums exactly as they
            j -= 1                                   # are reported, despite rounding
        while j < end and T[j + 1] - Ti <= bound:
            j += 1
        jm = end if F is None else F.reach(i, min(end, j + 1))  # j + 1: enough to compare
        if jm < j:                                   # memory-limited: a larger bound
            j = jm                                   # changes nothing here
        elif j < end and j < jm and T[j + 1] - Ti < nxt:
            nxt = T[j + 1] - Ti                      # the bound that would take layer j
        if j == i:                                   # one layer alone is over the bound
            return None, worst, nxt
        if T[j] - Ti > worst:
            worst = T[j] - Ti
        cuts.append(j)
        i, T, F = j, P, fit
    return cuts, worst, nxt


class _Additive:
    """Stage memory as the sum of per-layer bytes, under ``cap`` (bytes per stage)."""

    def __init__(self, mem: Sequence[float], cap: float):
        self.mem, self.Q, self.cap = list(mem), _prefix(mem), cap

    def reach(self, i: int, end: int) -> int:
        Q, cap = self.Q, self.cap
        jm = bisect.bisect_right(Q, Q[i] + cap, i + 1, end + 1) - 1
        while jm > i and Q[jm] - Q[i] > cap:
            jm -= 1
        while jm < end and Q[jm + 1] - Q[i] <= cap:
            jm += 1
        return jm

    def refusal(self, position: int, kind: str) -> str:
        m = self.mem[position]
        return (f"needs {m:.0f} bytes ({m / 2**30:.2f} GB) in a {kind} stage, over the "
                f"per-stage limit of {self.cap:.0f} bytes ({self.cap / 2**30:.2f} GB)")


class _Peak:
    """Stage memory as its predicted peak (``fxpipe.passes.stage_memory``): every stage's own
    bytes fit ``cap`` and its parameters fit ``reserve``, the room kept for the next
    stage's parameters, which its device prefetches meanwhile (``cap + reserve`` is the
    device limit). Backward positions run deep to shallow."""

    def __init__(self, memory: ChainMemory, kind: str, grain: str, residency: Residency,
                 cap: float, reserve: float):
        self.m, self.kind, self.grain, self.res = memory, kind, grain, residency
        self.cap, self.reserve, self.backward = cap, reserve, kind != "fwd"

    def _growth(self, i: int) -> Growth:
        return Growth(self.m, self.kind, len(self.m) - i if self.backward else i,
                      grain=self.grain, residency=self.res)

    def reach(self, i: int, end: int) -> int:
        g, j = self._growth(i), i
        while j < end:
            g.add()
            if g.params > self.reserve or g.own() > self.cap:
                break
            j += 1
        return j

    def refusal(self, position: int, kind: str) -> str:
        g = self._growth(position)
        g.add()
        parts = ", ".join(f"{k} {human_bytes(v)}" for k, v in g.bytes().items())
        return (f"needs {g.own():.0f} bytes ({human_bytes(g.own())}: {parts}) in a {kind} stage, "
                f"over the per-stage limit of {self.cap:.0f} bytes (the device limit "
                f"{human_bytes(self.cap + self.reserve)} less {human_bytes(self.reserve)} for the "
                f"parameters of the stage its device prefetches meanwhile); its parameters "
                f"alone: {human_bytes(g.params)}")


class Chain:
    """One chain's prefix sums in processing order (backward: deep to shallow), and its
    memory fits (``ffit`` forward, ``bfit1`` the first backward stage, ``bfit`` the
    others; ``None``: no limit): additive bytes under ``cap``, or with ``peak`` =
    ``(ChainMemory, grain, Residency, cap, reserve)`` the predicted peak."""

    def __init__(self, c: ChainCosts, run_type: str, cap: float | None = None,
                 peak: tuple | None = None):
        n = self.n = len(c)
        self.fused, self.has_bwd = run_type == "fused", run_type != "infer"
        self.F = _prefix(c.fwd_ms)
        rb = [r + b for r, b in zip(c.recompute_ms, c.bwd_ms)][::-1]
        fb = [f + b for f, b in zip(c.fwd_ms, c.bwd_ms)][::-1]
        self.B = _prefix(rb)
        self.B1 = _prefix(fb) if self.fused else self.B
        self.PB, self.GB = _prefix(c.param_bytes[::-1]), _prefix(c.grad_bytes[::-1])
        self.ffit = self.bfit = self.bfit1 = None
        if peak is not None:
            memory, grain, residency, pcap, reserve = peak
            if len(memory) != n:
                raise ValueError(f"the chain has {n} layers, its memory {len(memory)}")
            self.ffit, self.bfit = (_Peak(memory, k, grain, residency, pcap, reserve)
                                    for k in ("fwd", "bwd"))
            self.bfit1 = _Peak(memory, "fused", grain, residency, pcap, reserve) \
                if self.fused else self.bfit
        elif cap is not None:
            fact = c.fwd_act_bytes if c.fwd_act_bytes is not None else c.act_bytes
            self.ffit = _Additive([p + a for p, a in zip(c.param_bytes, fact)], cap)
            self.bfit = self.bfit1 = _Additive(
                [p + g + a for p, g, a in zip(c.param_bytes, c.grad_bytes, c.act_bytes)][::-1], cap)
        if not self.has_bwd:
            self.lower = max(c.fwd_ms)
            self.work = sum(c.fwd_ms)
        elif not self.fused:
            self.lower = max(max(c.fwd_ms), max(rb))
            self.work = sum(c.fwd_ms) + sum(rb)
        else:  # layer k < L-1 runs in the tail (with layer L-1) or in a fwd and a bwd stage
            f, r, t, last = c.fwd_ms[:-1], rb[::-1][:-1], fb[::-1][:-1], fb[0]  # layer order
            self.lower = max([last] + [min(max(a, b), x + last) for a, b, x in zip(f, r, t)])
            self.work = last + sum(min(a + b, x) for a, b, x in zip(f, r, t))
        self.max_stages = n + (n - (1 if self.fused else 0) if self.has_bwd else 0)


@dataclass
class _Probe:
    ok: bool
    parts: list[tuple[list[int], list[int]]]   # per chain: (fwd ends, bwd ends)
    worst: float
    next_bound: float
    count: int


def probe_all(chains: list[Chain], bound: float, limit: float) -> _Probe:
    parts, total, worst, nxt = [], 0, 0.0, INF
    for ch in chains:
        bcuts: list[int] = []
        fend = ch.n
        if ch.has_bwd:
            cuts, w, x = _pack(ch.B1, ch.B, ch.bfit1, ch.bfit, ch.n, bound, limit - total)
            worst, nxt = max(worst, w), min(nxt, x)
            if cuts is None:
                return _Probe(False, parts, worst, nxt, total)
            bcuts, total = cuts, total + len(cuts)
            if ch.fused:
                fend = ch.n - bcuts[0]
        cuts, w, x = _pack(ch.F, ch.F, ch.ffit, ch.ffit, fend, bound, limit - total)
        worst, nxt = max(worst, w), min(nxt, x)
        if cuts is None:
            return _Probe(False, parts, worst, nxt, total)
        total += len(cuts)
        parts.append((cuts, bcuts))
    return _Probe(True, parts, worst, nxt, total)


def _search(probe: Any, lo: float, best: _Probe) -> _Probe:
    """The feasible probe at the smallest bound, given a feasible ``best`` and ``lo`` <=
    that bound. Gallops up from ``lo`` (the answer is usually just above it), then
    bisects; every probe snaps ``lo`` / ``hi`` to real stage sums (module docstring)."""
    lo, hi = lo * (1 - 1e-12), best.worst  # guard the lower bound against rounding
    step, galloping = 0.0, True
    while lo < hi:
        bound = lo + step if galloping else lo + (hi - lo) / 2
        if galloping and bound >= hi:
            galloping = False
            continue
        p = probe(bound if lo <= bound < hi else lo)
        if p.ok:
            best, hi, galloping = p, p.worst, False
        else:
            lo = max(p.next_bound, math.nextafter(bound, INF))
            step = max(4 * step, 1e-3 * lo)
    return best


def solve(chains: list[Chain], limit: int, lo: float = 0.0,
           start: _Probe | None = None) -> _Probe | None:
    """The greedy plan at the smallest common bound needing at most ``limit`` stages
    (``None`` when memory alone needs more); ``start``: a feasible probe, if known."""
    best = start if start is not None and start.ok and start.count <= limit else \
        probe_all(chains, INF, limit)
    if not best.ok:
        return None
    return _search(lambda bound: probe_all(chains, bound, limit), lo, best)


def _segment(P: list[float], fit: Any, a: int, b: int, count: int, hi: float) -> list[int]:
    """Positions [a, b) in at most ``count`` stages with the smallest bottleneck (``hi``
    is a feasible bound)."""
    def probe(bound: float) -> _Probe:
        cuts, worst, nxt = _pack(P, P, fit, fit, b, bound, count, a)
        return _Probe(cuts is not None, [(cuts or [], [])], worst, nxt, len(cuts or []))
    start = probe(hi)
    if not start.ok:  # cannot happen for the bound the segment was packed under
        raise AssertionError(f"segment {a}:{b} does not fit {count} stages at {hi}")
    lo = max(max(P[i + 1] - P[i] for i in range(a, b)), (P[b] - P[a]) / count)
    return _search(probe, lo, start).parts[0][0]


def rebalance(chains: list[Chain], parts: list[tuple[list[int], list[int]]],
               bound: float) -> list[tuple[list[int], list[int]]]:
    """Keep each segment's stage count (and a fused tail), but re-cut every segment for
    its own smallest bottleneck: the common bottleneck stays, the other stages even out."""
    out = []
    for ch, (fcuts, bcuts) in zip(chains, parts):
        if fcuts:
            fcuts = _segment(ch.F, ch.ffit, 0, fcuts[-1], len(fcuts), bound)
        head = bcuts[:1] if ch.fused else []
        if len(bcuts) > len(head):
            bcuts = head + _segment(ch.B, ch.bfit, head[0] if head else 0, ch.n,
                                    len(bcuts) - len(head), bound)
        out.append((fcuts, bcuts))
    return out
