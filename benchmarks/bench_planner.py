"""Planner benchmark: how close each partitioner gets to the optimal bottleneck, and how
fast fxpipe's exact planner is.

    .venv/bin/python benchmarks/bench_planner.py            # ~1 min
    .venv/bin/python benchmarks/bench_planner.py --repeats 5

Problem: cut a chain of per-layer times into contiguous stages; the bottleneck is the
slowest stage. Ratio = a method's bottleneck / the optimal bottleneck with the same
number of stages (1.000 is optimal). Methods:

- ``fxpipe``: ``planner.min_bottleneck`` (exact; the optimum it is divided by comes from
  an independent O(k L^2) dynamic program, so 1.000 is a check, not a tautology).
- ``uniform``: equal layer counts (sizes differ by at most one, first stages larger).
- ``block``: the Bárány–Grinberg block partition (arXiv 1308.2452) as torchgpipe's
  ``balance`` uses it, written from the paper's description: start from cuts nearest to
  i * total / k; while the longest and shortest block differ by more than the largest
  layer, the shortest block steals one layer from its neighbour on the side of a longest
  block.
- ``params``: DeepSpeed-style ``partition_method="parameters"``: the min-max partition of
  parameter counts, judged on time.
- ``roundpipe``: ``fxpipe.roundpipe.greedy.roundpipe_greedy`` (stages up to 1.1 x the slowest layer,
  greedy packing, min_stages = k as a hint); compared with the optimum at the number of
  stages it produced.

Families (per-layer forward times and parameter counts): ``uniform`` (48 equal layers),
``llama`` (a cheap embedding holding a large vocabulary matrix, 32 equal blocks, an LM
head 4x a block), ``random`` (48 layers, times U(0.2, 2), independent parameter counts),
``heavy-tail`` (48 layers, Pareto(1.5) times). Random families use 20 seeds each.
k in {4, 8, 16}. Timing: 1,000 random layers, min and median over repeats, interleaved.

Writes ``benchmarks/results/bench_planner.json``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fxpipe.passes.chain_costs import ChainCosts  # noqa: E402
from fxpipe.passes.planner import min_bottleneck, plan_chains  # noqa: E402
from fxpipe.roundpipe.greedy import roundpipe_greedy  # noqa: E402

OUT = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "bench_planner.json"
METHODS = ["fxpipe", "uniform", "block", "params", "roundpipe"]
KS = [4, 8, 16]


def bottleneck(times, parts):
    return max(sum(times[i] for i in r) for r in parts)


def uniform_split(n, k):
    q, r = divmod(n, k)
    sizes = [q + (i < r) for i in range(k)]
    starts = [sum(sizes[:i]) for i in range(k + 1)]
    return [range(a, b) for a, b in zip(starts, starts[1:])]


def block_partition(times, k):
    """Bárány–Grinberg block partition (see the module docstring)."""
    n = len(times)
    k = min(k, n)
    prefix = [0.0]
    for t in times:
        prefix.append(prefix[-1] + t)
    total, biggest = prefix[-1], max(times)
    cuts = [0]
    for i in range(1, k):  # the available break nearest to i * total / k, leaving room
        lo, hi = cuts[-1] + 1, n - (k - i)
        cuts.append(min(range(lo, hi + 1), key=lambda j: abs(prefix[j] - i * total / k)))
    cuts.append(n)
    for _ in range(50 * n * k):
        sums = [prefix[b] - prefix[a] for a, b in zip(cuts, cuts[1:])]
        longest, shortest = max(sums), min(sums)
        if longest - shortest <= biggest:
            break
        b, c = sums.index(longest), sums.index(shortest)
        if c > b:       # C steals the last layer of the block on its left
            if cuts[c] - cuts[c - 1] <= 1:
                break
            cuts[c] -= 1
        else:           # C steals the first layer of the block on its right
            if cuts[c + 2] - cuts[c + 1] <= 1:
                break
            cuts[c + 1] += 1
    return [range(a, b) for a, b in zip(cuts, cuts[1:])]


def families(seeds):
    yield "uniform", [([1.0] * 48, [1.0] * 48)]
    blocks = 32
    yield "llama", [([0.05] + [1.0] * blocks + [4.0], [2.0] + [1.0] * blocks + [2.0])]
    out = []
    for s in range(seeds):
        rng = random.Random(s)
        out.append(([rng.uniform(0.2, 2.0) for _ in range(48)], [rng.uniform(0.2, 2.0) for _ in range(48)]))
    yield "random", out
    out = []
    for s in range(seeds):
        rng = random.Random(1000 + s)
        times = [rng.paretovariate(1.5) for _ in range(48)]
        out.append((times, [t ** 0.5 * rng.uniform(0.5, 1.5) for t in times]))
    yield "heavy-tail", out


def dp_optimum(times, k):
    """The optimal bottleneck with at most k stages by O(k L^2) dynamic programming —
    independent of fxpipe's planner, so the fxpipe column is a real check."""
    n = len(times)
    prefix = [0.0]
    for t in times:
        prefix.append(prefix[-1] + t)
    best = [0.0] + [float("inf")] * n          # best[j]: first j layers, stages so far
    for _ in range(min(k, n)):
        best = [0.0] + [min(max(best[i], prefix[j] - prefix[i]) for i in range(j)) for j in range(1, n + 1)]
    return best[n]


def ratios(times, params, k):
    best = {}

    def optimum(count):
        if count not in best:
            best[count] = dp_optimum(times, count)
        return best[count]

    parts = {
        "fxpipe": min_bottleneck(times, k)[1],
        "uniform": uniform_split(len(times), k),
        "block": block_partition(times, k),
        "params": min_bottleneck(params, k)[1],
        "roundpipe": roundpipe_greedy(times, 1.1, min_stages=k),
    }
    out = {}
    for name, p in parts.items():
        count = len(p) if name == "roundpipe" else k
        out[name] = (bottleneck(times, p) / optimum(count), len(p))
    return out


def quality(seeds):
    rows = []
    for family, instances in families(seeds):
        for k in KS:
            per = {m: [] for m in METHODS}
            stages = []
            for times, params in instances:
                r = ratios(times, params, k)
                for m in METHODS:
                    per[m].append(r[m][0])
                stages.append(r["roundpipe"][1])
            rows.append({"family": family, "k": k, "instances": len(instances),
                         "roundpipe_stages": statistics.median(stages),
                         **{f"{m}_mean": statistics.fmean(v) for m, v in per.items()},
                         **{f"{m}_max": max(v) for m, v in per.items()}})
    return rows


def timing(repeats):
    rng = random.Random(42)
    times = [rng.uniform(0.5, 1.5) for _ in range(1000)]
    llama_1000 = ChainCosts.from_times([0.05] + [1.0] * 998 + [4.0])
    rand_1000 = ChainCosts.from_times(times)
    cases = {
        "min_bottleneck k=8": lambda: min_bottleneck(times, 8),
        "min_bottleneck k=64": lambda: min_bottleneck(times, 64),
        "min_bottleneck k=512": lambda: min_bottleneck(times, 512),
        "plan_chains fused G=8 (llama)": lambda: plan_chains("fused", [llama_1000], num_devices=8),
        "plan_chains fused G=8 (random)": lambda: plan_chains("fused", [rand_1000], num_devices=8),
    }
    samples = {name: [] for name in cases}
    for name, fn in cases.items():  # warm up
        fn()
    for _ in range(repeats):        # interleaved
        for name, fn in cases.items():
            t0 = time.perf_counter()
            fn()
            samples[name].append((time.perf_counter() - t0) * 1e3)
    return [{"case": name, "layers": 1000, "min_ms": min(v), "median_ms": statistics.median(v),
             "repeats": repeats} for name, v in samples.items()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=21)
    args = ap.parse_args()
    rows = quality(args.seeds)
    print("bottleneck / optimal bottleneck with the same number of stages: mean (max)")
    print("(roundpipe* picks its own stage count, shown as 'rp stages' (median); k is its min_stages hint)")
    names = [m + "*" if m == "roundpipe" else m for m in METHODS]
    head = f"{'family':<11}{'k':>3}  " + "".join(f"{m:>16}" for m in names) + f"{'rp stages':>11}"
    print(head)
    print("-" * len(head))
    for r in rows:
        cells = "".join(f"{r[m + '_mean']:>8.3f} ({r[m + '_max']:.3f})" for m in METHODS)
        print(f"{r['family']:<11}{r['k']:>3}  {cells}{r['roundpipe_stages']:>11g}")
    t = timing(args.repeats)
    print(f"\nsolve time, 1,000 layers ({args.repeats} repeats, interleaved)")
    for row in t:
        print(f"  {row['case']:<32} min {row['min_ms']:7.2f} ms   median {row['median_ms']:7.2f} ms")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"quality": rows, "timing": t}, indent=2))
    print(f"\nwrote {OUT.relative_to(OUT.parents[2])}")


if __name__ == "__main__":
    main()
