"""Stage planning over per-layer cost vectors (pure functions: no modules, no tensors).

The algorithm (the search for the cuts); ``fxpipe.plan`` (``ExecutePlan.auto``,
``max_sequence_length``) is what users call, and ``fxpipe.stage_plan.StagePlan`` the
ranges it returns as a value. The cost vectors it packs and the makespan estimate it
ranks candidates with are ``fxpipe.passes.chain_costs``'s. It sits above the memory
model it checks stages with (``fxpipe.passes.stage_memory``) and imports nothing that
estimates memory from a model.

A pipe is a chain of L layers. A plan cuts its forward pass and its backward pass into
contiguous stages; stages run round-robin on G devices (stage s on device s mod G, the
forward stages first, then the backward stages), each stage job running all M
microbatches. Costs per layer: forward / recompute / backward ms, and bytes.

* Stage time: forward stage = sum of ``fwd_ms``; backward stage = sum of ``recompute_ms +
  bwd_ms``; for ``"fused"`` the first backward stage (the tail) runs forward + loss +
  backward without recompute, so it costs ``fwd_ms + bwd_ms`` and its layers are not in
  the forward plan. ``"infer"`` has no backward plan.
* Stage memory, either additive: ``param_bytes`` (+ ``grad_bytes`` and ``act_bytes`` in
  backward stages; ``fwd_act_bytes`` in forward stages) must fit a per-stage cap; or the
  stage's predicted peak (``fxpipe.passes.stage_memory``: parameters of this and the prefetched
  stage, gradients, boundary activations, saved tensors, workspace) must fit the device.
  A predicted peak need not shrink when a stage loses a layer at its start (the cut
  there may carry more than the layers inside held): greedy then stays correct (every
  stage it makes is checked) but may not be the fewest stages.
* Bottleneck: the slowest stage. All stages of all pipes planned together share it.

Algorithm (``plan_chains``):

Steps 1 and 2 are ``fxpipe.passes.packing``'s.

1. ``_pack`` — for a bound B, greedy packing (each stage takes as many layers as fit under
   B and the cap) uses the fewest stages. Greedy is never behind: if greedy's k-th stage
   ends at g(k) >= p(k), where any feasible plan's k-th stage ends, then that plan's stage
   [p(k), p(k+1)) is feasible, so is its sub-range [g(k), p(k+1)) (costs are >= 0 and
   both constraints are additive), so greedy's next stage ends at >= p(k+1). For ``"fused"``
   the backward chain is packed first from the deep end (the tail stage uses its own
   cost vector); the longest tail both minimises the backward count and leaves the
   shortest forward chain, so greedy is exact there too.
2. ``solve`` — the smallest common bound B*(S) whose greedy needs at most S stages:
   bisection on B where each probe snaps both ends to real stage sums — a feasible probe
   lowers ``hi`` to the bottleneck it achieved, an infeasible probe raises ``lo`` to the
   smallest bound that would change any greedy stage (a stage's sum plus its next layer).
   Bounds in [probe, that value) give the same packing, so ``lo <= B*`` always holds and
   the loop ends exactly at ``hi == B*``. Each probe is O(S log L) (``bisect`` on prefix
   sums); the number of probes is logarithmic in practice.
3. Stage count — ``B_min`` is the best bottleneck with any number of stages (about the
   slowest layer). ``upper_threshold`` (RoundPipe's knob) bounds the granularity: we use no
   more stages than greedy needs at ``upper_threshold * B_min``: below that the bottleneck
   gains at most that factor while every extra stage costs a host round trip of its
   boundary activations and a prefetch. ``min_stages`` (default G) raises the count when
   the chain is that short (stages are split, bottleneck never rises). Among counts S in
   ``[top - G + 1, top]`` (one round of G; at least ``min_stages``) we take the exact
   B*(S) plan (as packed, or re-cut per segment) with the lowest ``estimate_makespan``.
   When ``top >= 4G`` only ``top`` and the last whole round below it are tried: every
   device then runs four or more stages, and a partial round adds at most one to some.
4. Host cost — one host issues every device's actions (``host_ms_per_action``, about
   ``ACTIONS_PER_MICROBATCH`` per stage and microbatch). It adds to each stage's time in
   the granularity bound and the estimate, and the estimate is at least the host's total;
   when that total passes ``HOST_BOUND`` of the devices' time, fewer stages are tried,
   down to ``min_stages``: layers too small to pay for their issuing share stages.

Example: an embedding, 24 equal blocks and a 3x LM head; backward = 2x forward.

>>> c = ChainCosts.from_times([0.1] + [1.0] * 24 + [3.0])
>>> fwd, bwd = plan_chains("fused", [c], num_devices=4)[0]
>>> [len(r) for r in fwd], [len(r) for r in bwd]     # the fused tail is the LM head
([9, 8, 8], [1, 3, 3, 3, 3, 3, 3, 3, 4])
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Sequence

from fxpipe.errors import PlanError
from fxpipe.passes.chain_costs import (ACTIONS_PER_MICROBATCH, NOMINAL_DEVICE, ChainCosts,
                                      NominalDevice, estimate_makespan)
from fxpipe.passes.packing import INF, Chain, probe_all, rebalance, solve
from fxpipe.passes.stage_memory import ChainMemory, Residency

HOST_BOUND = 0.25
"""A plan is host-bound when issuing its stages costs the host more than this share of
the time its devices compute: the planner then also tries coarser cuts."""


def _check_memory(chains: list[Chain]) -> None:
    """Every layer fits alone in each kind of stage it can run in (the last layer of a
    fused chain: the tail)."""
    for k, ch in enumerate(chains):
        which = f"layer {{}} of pipe {k}" if len(chains) > 1 else "layer {}"
        n, tail = ch.n, 1 if ch.fused else 0
        checks = [(ch.ffit, "forward", p, p) for p in range(n - tail)]
        if ch.has_bwd:
            checks += [(ch.bfit1, "fused tail" if ch.fused else "backward", 0, n - 1)]
            checks += [(ch.bfit, "backward", p, n - 1 - p) for p in range(1, n)]
        for fit, kind, position, layer in checks:
            if fit is not None and fit.reach(position, position + 1) == position:
                raise PlanError(f"{which.format(layer)} {fit.refusal(position, kind)}; "
                                f"{_ADVICE}")


_ADVICE = ("raise the device memory (model_memory_limit), use smaller microbatches (more of "
           "them) or shorter sequences, or split the layer")


def min_bottleneck(times: Sequence[float], k: int, mem: Sequence[float] | None = None,
                   cap: float | None = None) -> tuple[float, list[range]]:
    """Exact contiguous partition of ``times`` into at most ``k`` stages minimising the
    slowest stage, each stage's ``mem`` sum <= ``cap``.

    >>> min_bottleneck([1, 2, 3, 4, 5], 2)
    (9.0, [range(0, 3), range(3, 5)])
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    n = len(times)
    c = ChainCosts(times, times, times, mem or [0.0] * n, [0.0] * n, [0.0] * n)
    ch = Chain(c, "infer", cap)
    _check_memory([ch])
    p = solve([ch], k, max(ch.lower, ch.work / k))
    if p is None:
        raise PlanError(f"no partition into at most {k} stages fits {cap} bytes per stage")
    ends = p.parts[0][0]
    return p.worst, [range(a, b) for a, b in zip([0] + ends[:-1], ends)]


def solve_stages(run_type: str | Sequence[str], chains: Sequence[ChainCosts], num_stages: int,
                 memory_cap: float | None = None) -> tuple[float, list[tuple[list[range], list[range]]]]:
    """The smallest common bottleneck of all ``chains`` using at most ``num_stages`` stages
    in total (forward + backward of every chain), and the greedy plan achieving it.

    >>> solve_stages("train", [ChainCosts.from_times([1, 1, 1, 1])], 3)
    (6.0, [([range(0, 4)], [range(2, 4), range(0, 2)])])
    """
    cs = _chains(run_type, chains, memory_cap)
    _check_memory(cs)
    lo = max(max(ch.lower for ch in cs), sum(ch.work for ch in cs) / max(num_stages, 1))
    p = solve(cs, num_stages, lo)
    if p is None:
        need = probe_all(cs, INF, INF).count
        why = f" under the memory cap of {memory_cap:.0f} bytes" if memory_cap is not None else ""
        raise PlanError(f"{num_stages} stages are too few: the plan needs at least {need}{why}")
    return p.worst, _ranges(cs, _stages(cs, p.parts))


def _ranges(cs: list[Chain], stages: list[list]) -> list[tuple[list[range], list[range]]]:
    out: list[tuple[list[range], list[range]]] = [([], []) for _ in cs]
    for _, k, d, a, b in stages:
        n = cs[k].n
        out[k][0 if d == "f" else 1].append(range(a, b) if d == "f" else range(n - b, n - a))
    return out


def _chains(run_type: str | Sequence[str], chains: Sequence[ChainCosts], cap: float | None = None,
            peaks: Sequence[tuple] | None = None) -> list[Chain]:
    """One run type for every chain, or one per chain; memory: additive under ``cap``, or
    one ``Chain`` peak tuple per chain."""
    if not chains:
        raise ValueError("the planner needs at least one chain")
    types = [run_type] * len(chains) if isinstance(run_type, str) else list(run_type)
    if len(types) != len(chains):
        raise ValueError(f"{len(types)} run types for {len(chains)} chains")
    for t in types:
        if t not in ("infer", "train", "fused"):
            raise ValueError(f"run_type must be 'infer', 'train' or 'fused', got {t!r}")
    peaks = peaks or [None] * len(chains)
    return [Chain(c, t, cap, p) for c, t, p in zip(chains, types, peaks)]


# --- stage count -----------------------------------------------------------------------


def _stages(chains: list[Chain], parts: list[tuple[list[int], list[int]]]) -> list[list]:
    """Stages as [time, chain, "f"|"b", start, stop] in processing positions, run order."""
    fwd, bwd = [], []
    for k, (ch, (fcuts, bcuts)) in enumerate(zip(chains, parts)):
        for s, (a, b) in enumerate(zip([0] + fcuts[:-1], fcuts)):
            fwd.append([ch.F[b] - ch.F[a], k, "f", a, b])
        stages = []
        for s, (a, b) in enumerate(zip([0] + bcuts[:-1], bcuts)):
            T = ch.B1 if s == 0 else ch.B
            stages.append([T[b] - T[a], k, "b", a, b])
        bwd[:0] = stages  # later pipes' backward runs first
    return fwd + bwd


def _split_to(chains: list[Chain], stages: list[list], count: int) -> list[list]:
    """Split the slowest splittable stage at its balance point until there are ``count``
    stages (a fused tail stage is never split). The bottleneck does not rise."""
    keyed = {(n, st[3]): st for n, st in enumerate(stages)}   # (run-order slot, start)
    heap = [(-st[0], key) for key, st in keyed.items()]
    heapq.heapify(heap)
    while len(keyed) < count and heap:
        _, key = heapq.heappop(heap)
        t, k, d, a, b = keyed[key]
        if b - a < 2 or (d == "b" and chains[k].fused and a == 0):
            continue
        T = chains[k].F if d == "f" else chains[k].B
        fit = chains[k].ffit if d == "f" else chains[k].bfit
        m = bisect.bisect_left(T, T[a] + (T[b] - T[a]) / 2, a + 1, b)
        m = min((x for x in (m - 1, m) if a < x < b), key=lambda x: max(T[x] - T[a], T[b] - T[x]))
        if fit is not None and (fit.reach(a, m) < m or fit.reach(m, b) < b):
            continue  # a predicted peak need not shrink with the stage: keep it whole
        keyed[key] = [T[m] - T[a], k, d, a, m]
        keyed[(key[0], m)] = [T[b] - T[m], k, d, m, b]
        heapq.heappush(heap, (-keyed[key][0], key))
        heapq.heappush(heap, (-keyed[(key[0], m)][0], (key[0], m)))
    return [keyed[key] for key in sorted(keyed)]


def plan_chains(run_type: str | Sequence[str], chains: Sequence[ChainCosts], *, num_devices: int,
                num_microbatch: int | None = None, min_stages: int | None = None,
                upper_threshold: float = 1.1, memory_cap: float | None = None,
                memory: Sequence[ChainMemory] | None = None, memory_limit: float | None = None,
                recompute_grain: str = "stage", host_ms_per_action: float = 0.0,
                recompute: str = "auto", device: NominalDevice = NOMINAL_DEVICE
                ) -> list[tuple[list[range], list[range]]]:
    """Plan every chain with one common bottleneck; returns ``(fwd_plan, bwd_plan)`` per
    chain (layer ranges; ``bwd_plan`` deep to shallow, empty for ``"infer"``).
    ``run_type`` applies to every chain, or give one per chain (e.g. an encoder run with
    ``"train"`` feeding a decoder run with ``"fused"``); ``num_microbatch`` defaults to
    G + 1. See the module docstring.

    Memory, one of: ``memory_cap``, bytes per stage of the chains' additive byte
    vectors; or ``memory`` (a ``ChainMemory`` per chain, for one microbatch) and
    ``memory_limit`` (bytes per device): every stage's predicted peak
    (``fxpipe.passes.stage_memory``, at ``recompute_grain``), the parameters of the stage its
    device prefetches included, fits the limit. A stage's parameters then fit a
    *reserve* and the rest of its peak fits the limit less the reserve; a few reserves
    between the largest layer's parameters and half the limit are tried, and the plan
    with the best ``estimate_makespan`` (then the fewest stages) is kept.

    ``host_ms_per_action``: what issuing one action costs the host, which issues every
    device's work in turn. A stage then costs ``ACTIONS_PER_MICROBATCH`` actions per
    microbatch on top of its layers (the granularity bound counts it), and a plan takes
    at least its stages' host time (``estimate_makespan`` with ``host_ms``): layers too
    small to pay for their issuing are not cut into stages of their own.

    ``recompute``: ``"auto"`` (default) — where memory is bounded (``memory_cap`` or
    ``memory``), a fused chain's tail grows while it fits the device and the estimate
    falls: its layers keep their activations (forward and backward in one stage, one
    microbatch at a time) instead of being recomputed, counting what its transfers leave
    exposed at ``device``'s link and host rates; ``"full"`` — the tail is only as long as
    the balance of stage times makes it. Without a memory bound there is no room to
    decide from, and both plan alike.

    >>> plan_chains("train", [ChainCosts.from_times([1] * 6)], num_devices=2, min_stages=2)[0][0]
    [range(0, 3), range(3, 6)]
    >>> c = [ChainCosts.from_times([1.0] * 6, param_bytes=[1.0] * 6, act_bytes=[1.0] * 6)]
    >>> fwd, bwd = plan_chains("fused", c, num_devices=1, memory_cap=9, recompute="full")[0]
    >>> fwd, bwd[0]
    ([range(0, 3), range(3, 5)], range(5, 6))
    >>> fwd, bwd = plan_chains("fused", c, num_devices=1, memory_cap=9)[0]
    >>> fwd, bwd[0]          # a tail of 3 layers fits 9 bytes: they are not recomputed
    ([range(0, 3)], range(3, 6))
    """
    if recompute not in ("auto", "full"):
        raise ValueError(f"recompute must be 'auto' or 'full', got {recompute!r}")
    keep = (device.link_bytes_per_s / 1e3, device.host_grad_bytes_per_s / 1e3) \
        if recompute == "auto" else None
    for name, v in (("num_devices", num_devices), ("num_microbatch", num_microbatch),
                    ("min_stages", min_stages)):
        if (v is not None or name == "num_devices") and \
                (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    if upper_threshold < 1.0:
        raise ValueError(f"upper_threshold must be >= 1.0, got {upper_threshold}")
    if not 0.0 <= host_ms_per_action < INF:
        raise ValueError(f"host_ms_per_action must be a finite number of ms >= 0, "
                         f"got {host_ms_per_action}")
    host = ACTIONS_PER_MICROBATCH * host_ms_per_action
    G = num_devices
    M = num_microbatch or G + 1
    want = G if min_stages is None else min_stages
    if memory is None:
        cs = _chains(run_type, chains, memory_cap)
        _check_memory(cs)
        return _ranges(cs, _plan(cs, G, M, want, upper_threshold, host,
                                 keep=keep if memory_cap is not None else None)[1])
    if memory_limit is None or len(memory) != len(chains):
        raise ValueError("plan_chains(memory=...) needs one ChainMemory per chain and memory_limit")
    largest = max(p for m in memory for p in m.params)
    reserves = sorted({largest} | {memory_limit * f for f in (1 / 8, 1 / 6, 1 / 4, 1 / 3, 1 / 2)
                                   if memory_limit * f > largest})
    best = None
    for reserve in reserves:   # the smallest reserve leaves the most room: it fits first
        cs = _peak_chains(run_type, chains, memory, memory_limit, reserve, G, M, recompute_grain)
        try:
            _check_memory(cs)
        except PlanError:
            if best is None:
                raise
            continue
        est, stages = _plan(cs, G, M, want, upper_threshold, host, keep=keep)
        if best is None or est < best[0] * (1 - 1e-12) or \
                (est <= best[0] * (1 + 1e-12) and len(stages) < len(best[2])):  # ties: fewer stages
            best = est, cs, stages
    return _ranges(best[1], best[2])


def check_memory(run_type: str | Sequence[str], memory: Sequence[ChainMemory], memory_limit: float,
                 *, num_devices: int, num_microbatch: int | None = None,
                 recompute_grain: str = "stage") -> None:
    """Raise ``PlanError`` (naming the layer and its bytes by kind) unless some plan fits
    ``memory_limit`` at every stage's predicted peak: exactly when ``plan_chains`` with
    ``memory`` finds a plan. Each layer alone must fit, with room for the largest layer's
    parameters prefetched.

    >>> from fxpipe.passes.stage_memory import ChainMemory
    >>> m = ChainMemory(*[(10, 10)] * 9)
    >>> check_memory("fused", [m], 200, num_devices=2)
    >>> check_memory("fused", [m], 50, num_devices=2)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    fxpipe.errors.PlanError: layer 0 needs 50 bytes (50 B: params 10 B, ...) in a forward stage, ...
    """
    G = num_devices
    chains = [ChainCosts.from_times([0.0] * len(m)) for m in memory]
    largest = max(p for m in memory for p in m.params)
    _check_memory(_peak_chains(run_type, chains, memory, memory_limit, largest, G,
                               num_microbatch or G + 1, recompute_grain))


def _peak_chains(run_type: str | Sequence[str], chains: Sequence[ChainCosts],
                 memory: Sequence[ChainMemory], limit: float, reserve: float, G: int, M: int,
                 grain: str) -> list[Chain]:
    residency = Residency.worst(M, G)
    return _chains(run_type, chains, peaks=[(m, grain, residency, limit - reserve, reserve)
                                            for m in memory])


def _plan(cs: list[Chain], G: int, M: int, want: int, upper_threshold: float,
          host: float = 0.0, keep: tuple[float, float] | None = None) -> tuple[float, list[list]]:
    """The stage count and plan of ``plan_chains`` for these chains (memory checked):
    (estimated makespan, stages). ``host``: the host ms each stage costs per microbatch.
    ``keep``: (link, host gradient) bytes per ms: fused tails then grow where they fit
    and gain (``_keep_activations``)."""
    max_count = sum(ch.max_stages for ch in cs)
    lower = max(ch.lower for ch in cs)
    finest = solve(cs, max_count, lower)
    assert finest is not None  # every layer fits alone (checked before)
    # within upper_threshold x the best bottleneck, each stage's host cost counted
    coarse = probe_all(cs, upper_threshold * (finest.worst + host) - host, max_count)
    top = min(max(coarse.count, want), max_count)
    bottom = max(min(want, top), top - G + 1)
    best, best_est = None, INF
    work, lo = sum(ch.work for ch in cs), finest.worst

    def counts():
        """The stage counts tried, from top down: one round of G; when the best plan's
        issuing costs the host more than ``HOST_BOUND`` of the devices' time, on down to
        ``want`` (a coarser cut issues less)."""
        floor = max(min(want, top), 1)
        step = G if top >= 4 * G else 1   # many rounds: only whole rounds matter
        tried = sorted({top, max(bottom, top - top % G)}, reverse=True) if step > 1 else \
            list(range(top, bottom - 1, -1))
        yield from tried
        if host and len(best) * host > HOST_BOUND * estimate_makespan([s[0] for s in best], G, M):
            start = tried[-1] - 1 if step == 1 else tried[-1] - G
            yield from (max(floor, S) for S in range(start, floor - step, -step))

    least = 0   # fewer stages than want only where the finest plan has fewer
    for S in counts():   # B*(S) >= B*(S + 1): each solve starts from the previous one
        p = solve(cs, S, lo := max(lo, work / S), coarse)
        if p is None:
            break
        lo = p.worst
        for parts in (p.parts, rebalance(cs, p.parts, p.worst)):
            stages = _split_to(cs, _stages(cs, parts), S)
            least = least or min(want, len(stages))
            if len(stages) < least:
                continue
            est = estimate_makespan([s[0] for s in stages], G, M, host_ms=host)
            if est <= best_est * (1 + 1e-12):   # ties: the later (fewer stages) wins
                best, best_est = stages, est
    assert best is not None
    if keep is None or not any(ch.fused for ch in cs):
        return best_est, best
    return _keep_activations(cs, best, G, M, host, keep)


def _keep_activations(cs: list[Chain], stages: list[list], G: int, M: int, host: float,
                      rates: tuple[float, float]) -> tuple[float, list[list]]:
    """Grow each fused chain's tail while it fits and the estimate falls: a layer in the
    tail runs forward and backward in one stage with its activations kept (one microbatch
    at a time), so it costs ``fwd + bwd`` instead of a forward stage's ``fwd`` and a
    backward stage's ``recompute + bwd``. The stages the tail reaches into lose those
    layers (a forward stage its end, a backward stage its start). What a long tail leaves
    exposed counts against it (``_exposed``)."""
    def score(st: list[list]) -> float:
        return estimate_makespan([s[0] for s in st], G, M, host_ms=host) + \
            _exposed(cs, st, G, M, rates)
    est = score(stages)
    for k, ch in enumerate(cs):
        if not ch.fused:
            continue
        base = stages
        first = next(st[4] for st in base if st[1] == k and st[2] == "b" and st[3] == 0)
        reach = ch.n if ch.bfit1 is None else ch.bfit1.reach(0, ch.n)
        for t in range(first + 1, reach + 1):
            grown = _with_tail(ch, k, base, t)
            if grown is None:
                continue
            e = score(grown)
            if e < est * (1 - 1e-12):
                stages, est = grown, e
    return est, stages


def _exposed(cs: list[Chain], stages: list[list], G: int, M: int,
             rates: tuple[float, float]) -> float:
    """What the transfers of a plan leave its step waiting on, beyond the stage-time
    estimate (per microbatch, as stage times are: a step's bytes move once, so their time
    is divided by ``M``). ``rates``: link and host-gradient bytes per ms.

    * A fused tail's parameters upload while the stage before it on its device computes.
    * Each backward stage's gradients download when it ends, and the host takes them in
      one stage after another: the host's queue ends after the devices by what it could
      not hide. A long tail hands its gradients over late, and all at once.
    """
    link, host_rate = rates
    busy, queue, wait = [0.0] * G, 0.0, 0.0
    for s, (t, k, d, a, b) in enumerate(stages):
        ch = cs[k]
        if d == "b" and a == 0 and ch.fused:
            before = stages[s - G][0] if s >= G else 0.0
            wait += max(0.0, (ch.PB[b] - ch.PB[a]) / link / M - before)
        busy[s % G] += t
        if d == "b":
            grads = (ch.GB[b] - ch.GB[a]) / M
            queue = max(queue, busy[s % G] + grads / link) + grads / host_rate
    return wait + max(0.0, queue - max(busy))


def _with_tail(ch: Chain, k: int, stages: list[list], t: int) -> list[list] | None:
    """``stages`` with chain ``k``'s fused tail over processing positions [0, t) (None when
    a backward stage cut short no longer fits: its peak need not shrink)."""
    out = []
    for st in stages:
        _, kk, d, a, b = st
        if kk != k:
            out.append(st)
        elif d == "f":
            b = min(b, ch.n - t)
            if a < b:
                out.append([ch.F[b] - ch.F[a], k, d, a, b])
        elif a == 0:
            out.append([ch.B1[t], k, d, 0, t])
        elif b > t:
            a = max(a, t)
            if ch.bfit is not None and ch.bfit.reach(a, b) < b:
                return None
            out.append([ch.B[b] - ch.B[a], k, d, a, b])
    return out
