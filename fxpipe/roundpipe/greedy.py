"""RoundPipe's stage partition, reproduced from its documentation: the baseline fxpipe's
planner (``fxpipe.passes.planner``, exact and bottleneck-optimal) is compared with in
``benchmarks/bench_planner.py``.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from fxpipe.errors import PlanError


def roundpipe_greedy(times: Sequence[float], upper_threshold: float = 1.1, min_stages: int = 1,
                     mem: Sequence[float] | None = None, cap: float | None = None) -> list[range]:
    """A stage may take up to ``upper_threshold`` x the slowest layer; pack greedily under
    that bound (and ``cap``, each stage's sum of ``mem``); if that gives fewer than
    ``min_stages`` stages, pack under ``max(slowest, total / min_stages)``.

    >>> roundpipe_greedy([1, 1, 1, 1, 2])
    [range(0, 2), range(2, 4), range(4, 5)]
    """
    n = len(times)
    mem = list(mem) if mem is not None else [0.0] * n
    if cap is not None and any(m > cap for m in mem):
        raise PlanError("roundpipe_greedy: a layer does not fit the memory cap")
    P = [0.0, *itertools.accumulate(float(t) for t in times)]
    slowest = max(b - a for a, b in zip(P, P[1:]))   # as the prefix sums see it

    def pack(bound: float) -> list[int]:
        ends, start, used = [], 0, 0.0
        for i in range(n):
            if i > start and (P[i + 1] - P[start] > bound
                              or cap is not None and used + mem[i] > cap):
                ends.append(i)
                start, used = i, 0.0
            used += mem[i]
        return ends + [n]

    ends = pack(upper_threshold * slowest)
    if len(ends) < min_stages:
        ends = pack(max(slowest, P[-1] / min_stages))
    return [range(a, b) for a, b in zip([0] + ends[:-1], ends)]
