"""Planner algorithms over cost vectors: exactness against brute force, shapes, memory."""

import itertools
import math
import random
from types import SimpleNamespace

import pytest

from fxpipe.errors import PlanError
from fxpipe.passes.chain_costs import ChainCosts, NominalDevice, chain_costs, estimate_makespan
from fxpipe.passes.planner import min_bottleneck, plan_chains, solve_stages
from fxpipe.roundpipe.greedy import roundpipe_greedy
from fxpipe.plan import ExecutePlan

REL = 1e-9


def compositions(a, b):
    """Every way to cut [a, b) into contiguous non-empty ranges (one way for a == b: none)."""
    n = b - a
    if n == 0:
        yield []
        return
    for mask in range(2 ** (n - 1)):
        cuts = [a + i + 1 for i in range(n - 1) if mask >> i & 1]
        yield [range(x, y) for x, y in zip([a] + cuts, cuts + [b])]


def best_by_count(a, b, time, mem, cap):
    """{stage count: smallest max stage time} over memory-feasible cuts of [a, b)."""
    best = {}
    for parts in compositions(a, b):
        if cap is not None and any(sum(mem[i] for i in r) > cap for r in parts):
            continue
        worst = max((sum(time[i] for i in r) for r in parts), default=0.0)
        best[len(parts)] = min(best.get(len(parts), math.inf), worst)
    return best


def combine(tables):
    """Min over count allocations of the max of the parts: {total count: bottleneck}."""
    out = {0: 0.0}
    for table in tables:
        nxt = {}
        for c1, w1 in out.items():
            for c2, w2 in table.items():
                nxt[c1 + c2] = min(nxt.get(c1 + c2, math.inf), max(w1, w2))
        out = nxt
    return out


def brute_chain(run_type, c, cap):
    n = len(c)
    f_mem = [p + a for p, a in zip(c.param_bytes, c.fwd_act_bytes or c.act_bytes)]
    b_mem = [p + g + a for p, g, a in zip(c.param_bytes, c.grad_bytes, c.act_bytes)]
    rb = [r + b for r, b in zip(c.recompute_ms, c.bwd_ms)]
    fb = [f + b for f, b in zip(c.fwd_ms, c.bwd_ms)]
    fwd = lambda stop: best_by_count(0, stop, c.fwd_ms, f_mem, cap)  # noqa: E731
    if run_type == "infer":
        return fwd(n)
    if run_type == "train":
        return combine([fwd(n), best_by_count(0, n, rb, b_mem, cap)])
    out = {}
    for t in range(n):  # the fused tail is [t, n)
        if cap is not None and sum(b_mem[t:]) > cap:
            continue
        tail = {1: sum(fb[t:])}
        for count, w in combine([tail, fwd(t), best_by_count(0, t, rb, b_mem, cap)]).items():
            out[count] = min(out.get(count, math.inf), w)
    return out


def brute(run_type, chains, stages, cap=None):
    table = combine([brute_chain(run_type, c, cap) for c in chains])
    return min((w for count, w in table.items() if count <= stages), default=None)


def plan_bottleneck(run_type, c, fwd, bwd):
    rb = [r + b for r, b in zip(c.recompute_ms, c.bwd_ms)]
    fb = [f + b for f, b in zip(c.fwd_ms, c.bwd_ms)]
    times = [sum(c.fwd_ms[i] for i in r) for r in fwd]
    times += [sum((fb if run_type == "fused" and s == 0 else rb)[i] for i in r) for s, r in enumerate(bwd)]
    return max(times)


def random_vector(rng, n):
    kind = rng.choice(["int", "float", "zeros", "heavy"])
    if kind == "int":
        return [float(rng.randint(0, 4)) for _ in range(n)]
    if kind == "zeros":
        return [rng.choice([0.0, 1.0, 2.5]) for _ in range(n)]
    if kind == "heavy":
        return [rng.paretovariate(1.2) for _ in range(n)]
    return [rng.uniform(0.1, 2.0) for _ in range(n)]


def random_chain(rng, n):
    f = random_vector(rng, n)
    return ChainCosts(f, [x * rng.uniform(0.8, 1.2) for x in f], [x * rng.uniform(1.5, 3) for x in f],
                      [rng.randint(0, 5) for _ in range(n)], [rng.randint(0, 3) for _ in range(n)],
                      [rng.randint(0, 3) for _ in range(n)], [rng.randint(0, 1) for _ in range(n)])


def single_layer_need(chains):
    """The largest memory any single layer needs in a forward or a backward stage."""
    return max(max(p + g + a, p + f) for c in chains
               for p, g, a, f in zip(c.param_bytes, c.grad_bytes, c.act_bytes, c.fwd_act_bytes))


# --- exactness ---------------------------------------------------------------------------


def test_min_bottleneck_equals_brute_force_on_200_random_vectors():
    rng = random.Random(0)
    with_cap = 0
    for _ in range(200):
        n = rng.randint(1, 8)
        times, mem = random_vector(rng, n), [rng.randint(0, 6) for _ in range(n)]
        k = rng.randint(1, n)
        cap = rng.choice([None, rng.uniform(max(mem), sum(mem) + 1)])
        want = brute("infer", [ChainCosts(times, times, times, mem, [0] * n, [0] * n)], k, cap)
        if want is None:
            with pytest.raises(PlanError, match=f"at most {k} stages"):
                min_bottleneck(times, k, mem, cap)
            continue
        with_cap += cap is not None
        got, parts = min_bottleneck(times, k, mem, cap)
        assert got == pytest.approx(want, rel=REL, abs=1e-12)
        assert len(parts) <= k and [i for r in parts for i in r] == list(range(n))
        assert max(sum(times[i] for i in r) for r in parts) == pytest.approx(got, rel=REL, abs=1e-12)
        assert cap is None or all(sum(mem[i] for i in r) <= cap for r in parts)
    assert with_cap > 50


@pytest.mark.parametrize("run_type", ["infer", "train", "fused"])
def test_common_bottleneck_equals_brute_force(run_type):
    rng = random.Random({"infer": 1, "train": 2, "fused": 3}[run_type])
    for _ in range(70):
        chains = [random_chain(rng, rng.randint(1, 5)) for _ in range(rng.choice([1, 1, 2]))]
        cap = None
        if rng.random() < 0.5:
            cap = single_layer_need(chains) + rng.randint(0, 8)
        stages = rng.randint(len(chains) * (1 if run_type != "train" else 2), 12)
        want = brute(run_type, chains, stages, cap)
        if want is None:
            with pytest.raises(PlanError, match="too few"):
                solve_stages(run_type, chains, stages, cap)
            continue
        got, plans = solve_stages(run_type, chains, stages, cap)
        assert got == pytest.approx(want, rel=REL, abs=1e-12), (chains, stages, cap)
        assert sum(len(f) + len(b) for f, b in plans) <= stages
        for c, (fwd, bwd) in zip(chains, plans):
            ExecutePlan(fwd, bwd).validate(len(c), run_type)
            assert plan_bottleneck(run_type, c, fwd, bwd) <= got * (1 + REL) + 1e-12


def test_mixed_run_types_share_a_bottleneck_exactly():
    rng = random.Random(5)
    for _ in range(40):
        enc, dec = random_chain(rng, rng.randint(1, 4)), random_chain(rng, rng.randint(1, 4))
        stages = rng.randint(3, 10)
        want = min(w for count, w in combine([brute_chain("train", enc, None),
                                               brute_chain("fused", dec, None)]).items() if count <= stages)
        got, (ep, dp) = solve_stages(["train", "fused"], [enc, dec], stages)
        assert got == pytest.approx(want, rel=REL, abs=1e-12)
        ExecutePlan(*ep).validate(len(enc), "train")
        ExecutePlan(*dp).validate(len(dec), "fused")
    with pytest.raises(ValueError, match="1 run types for 2 chains"):
        plan_chains(["train"], [enc, dec], num_devices=2)


def test_plan_chains_is_valid_optimal_for_its_count_and_respects_memory():
    rng = random.Random(7)
    for _ in range(60):
        run_type = rng.choice(["infer", "train", "fused"])
        chains = [random_chain(rng, rng.randint(1, 12)) for _ in range(rng.choice([1, 2]))]
        cap = single_layer_need(chains) + 4
        G = rng.randint(1, 5)
        # recompute="full": the exact bottleneck for the count (a grown tail trades it)
        granularity = rng.choice([1.0, 1.1, 2.0])
        plans = plan_chains(run_type, chains, num_devices=G, memory_cap=cap, recompute="full",
                            upper_threshold=granularity)
        count = sum(len(f) + len(b) for f, b in plans)
        worst = max(plan_bottleneck(run_type, c, f, b) if f or b else 0.0 for c, (f, b) in zip(chains, plans))
        assert worst == pytest.approx(solve_stages(run_type, chains, count, cap)[0], rel=REL, abs=1e-12)
        most = sum(2 * len(c) - (run_type == "fused") if run_type != "infer" else len(c) for c in chains)
        assert count >= min(G, most)
        for c, (fwd, bwd) in zip(chains, plans):
            ExecutePlan(fwd, bwd).validate(len(c), run_type)
            for r in bwd:
                assert sum(c.param_bytes[i] + c.grad_bytes[i] + c.act_bytes[i] for i in r) <= cap
            for r in fwd:
                assert sum(c.param_bytes[i] + c.fwd_act_bytes[i] for i in r) <= cap
        # recompute="auto" (the default): a valid plan within the cap, its fused tails at
        # least as long as full recompute's
        auto = plan_chains(run_type, chains, num_devices=G, memory_cap=cap,
                           upper_threshold=granularity)
        for c, (fwd, bwd), full in zip(chains, auto, plans):
            ExecutePlan(fwd, bwd).validate(len(c), run_type)
            for r in bwd:
                assert sum(c.param_bytes[i] + c.grad_bytes[i] + c.act_bytes[i] for i in r) <= cap
            if run_type == "fused":
                assert len(bwd[0]) >= len(full[1][0])


# --- shapes ------------------------------------------------------------------------------


def llama(blocks=32, head=4.0, bwd_ratio=2.5):
    fwd = [0.05] + [1.0] * blocks + [head]
    return ChainCosts.from_times(fwd, [bwd_ratio * f for f in fwd])


@pytest.mark.parametrize("G", [2, 4, 8])
def test_llama_shape_forward_stages_hold_about_3x_the_layers_and_the_tail_is_fused(G):
    c = llama()
    (fwd, bwd), = plan_chains("fused", [c], num_devices=G)
    ExecutePlan(fwd, bwd).validate(len(c), "fused")
    tail, rest = bwd[0], bwd[1:]
    assert tail.stop == len(c) and len(tail) <= 3 and fwd[-1].stop == tail.start
    per_fwd = sum(map(len, fwd)) / len(fwd)
    per_bwd = sum(map(len, rest)) / len(rest)
    assert 2.5 <= per_fwd / per_bwd <= 4.5, (fwd, bwd)
    assert len(fwd) + len(bwd) >= G
    if G == 4:
        assert tail == range(33, 34)   # the heavy LM head alone is the fused tail


def test_train_and_infer_llama_shapes():
    c = llama()
    (fwd, bwd), = plan_chains("train", [c], num_devices=4)
    assert bwd[0] == range(33, 34) and fwd[-1].stop == 34
    (fwd, bwd), = plan_chains("infer", [c], num_devices=4)
    assert bwd == [] and len(fwd) >= 4


def test_several_pipes_share_one_bottleneck():
    encoder = ChainCosts.from_times([1.0] * 12)
    decoder = ChainCosts.from_times([3.0] * 12)
    plans = plan_chains("train", [encoder, decoder], num_devices=2)
    count = sum(len(f) + len(b) for f, b in plans)
    shared, _ = solve_stages("train", [encoder, decoder], count)
    worst = [plan_bottleneck("train", c, f, b) for c, (f, b) in zip([encoder, decoder], plans)]
    assert max(worst) == pytest.approx(shared)
    # the cheap encoder packs ~3x the layers per stage of the decoder under the same bound
    (ef, _), (df, _) = plans
    assert len(ef) < len(df)
    alone = plan_chains("train", [encoder], num_devices=2)[0]
    assert len(alone[0]) > len(ef)           # planned alone it would use smaller stages


def test_min_stages_and_upper_threshold():
    c = ChainCosts.from_times([1.0] * 8)
    assert len(plan_chains("infer", [c], num_devices=1, min_stages=4, upper_threshold=100)[0][0]) == 4
    assert len(plan_chains("infer", [ChainCosts.from_times([1.0] * 3)], num_devices=4)[0][0]) == 3
    counts = [sum(len(f) + len(b) for f, b in plan_chains("fused", [llama()], num_devices=2, upper_threshold=u))
              for u in (1.0, 1.1, 1.5, 3.0)]
    assert counts == sorted(counts, reverse=True) and counts[0] > counts[-1]
    with pytest.raises(ValueError, match="upper_threshold must be >= 1.0"):
        plan_chains("infer", [c], num_devices=2, upper_threshold=0.9)
    with pytest.raises(ValueError, match="min_stages must be an int >= 1"):
        plan_chains("infer", [c], num_devices=2, min_stages=0)
    with pytest.raises(ValueError, match="num_devices must be an int >= 1"):
        plan_chains("infer", [c], num_devices=None)
    with pytest.raises(PlanError, match="1 stages are too few: the plan needs at least 2$"):
        solve_stages("train", [c], 1)


def test_single_layer_over_the_cap_names_layer_bytes_and_limit():
    c = ChainCosts.from_times([1.0] * 4, param_bytes=[1000, 1000, 5000, 1000], grad_bytes=[0] * 4)
    with pytest.raises(PlanError, match=r"layer 2 needs 5000 bytes .* over the per-stage limit of 4000 bytes"):
        plan_chains("infer", [c], num_devices=2, memory_cap=4000)
    with pytest.raises(PlanError, match=r"layer 2 of pipe 1 needs 5000 bytes"):
        plan_chains("infer", [ChainCosts.from_times([1.0]), c], num_devices=2, memory_cap=4000)


# --- pieces ------------------------------------------------------------------------------


def test_estimate_makespan():
    assert estimate_makespan([4, 4, 4, 4], 2, 4) == 8 + 4 / 4
    assert estimate_makespan([4, 4, 4], 2, 4) == 8 + 1          # device 0 runs two stages
    assert estimate_makespan([4, 4], 4, 2) == 4 * 2 + 3 * 4 / 2  # fewer microbatches than devices
    assert estimate_makespan([], 2, 3) == 0.0


def test_roundpipe_greedy_baseline():
    times = [1, 1, 1, 1, 1, 1, 2]
    parts = roundpipe_greedy(times, upper_threshold=1.1)
    assert parts == [range(0, 2), range(2, 4), range(4, 6), range(6, 7)]
    assert len(roundpipe_greedy([1.0] * 8, upper_threshold=10, min_stages=4)) == 4


def test_chain_costs_measured_or_estimated():
    def cost(fwd_ms=None, bwd_ms=None, recompute_ms=None, flops=1e12):
        return SimpleNamespace(param_bytes=10, grad_bytes=10, saved_bytes=3, boundary_bytes=2,
                               fwd_flops=flops, bwd_flops=0, fwd_ms=fwd_ms, recompute_ms=recompute_ms,
                               bwd_ms=bwd_ms)
    (c,) = chain_costs([[cost(1.0, 2.0, 1.5), cost(3.0, 4.0, 2.5)]])
    assert c.fwd_ms == (1.0, 3.0) and c.recompute_ms == (1.5, 2.5) and c.bwd_ms == (2.0, 4.0)
    assert c.act_bytes == (5.0, 5.0) and c.fwd_act_bytes == (2.0, 2.0) and c.param_bytes == (10.0, 10.0)
    (c,) = chain_costs([[cost(1.0, 2.0), cost(3.0, 4.0)]])
    assert c.recompute_ms == c.fwd_ms                       # recompute falls back to forward
    dev = NominalDevice(flops_per_s=1e12, bytes_per_s=1e12, layer_overhead_ms=0.0)
    a, b = chain_costs([[cost(1.0, 2.0), cost(flops=1e12)], [cost(flops=2e12)]], device=dev)
    assert a.fwd_ms == (1000.0, 1000.0) and b.fwd_ms == (2000.0,)  # one missing time: all estimated
    assert b.bwd_ms == (4000.0,)                                    # bwd_flops 0: 2x forward
    (c,) = chain_costs([[cost(1.0), cost(2.0)]], need_backward=False, device=dev)
    assert c.fwd_ms == (1.0, 2.0)


def test_chain_costs_validation():
    with pytest.raises(ValueError, match="ChainCosts.bwd_ms has 1 entries but fwd_ms has 2"):
        ChainCosts([1, 1], [1, 1], [1], [0, 0], [0, 0], [0, 0])
    with pytest.raises(ValueError, match=r"ChainCosts.fwd_ms\[1\] = -1.0"):
        ChainCosts.from_times([1, -1])
    with pytest.raises(ValueError, match="at least one layer"):
        ChainCosts.from_times([])


def test_planning_is_deterministic():
    rng = random.Random(3)
    chains = [random_chain(rng, 30) for _ in range(2)]
    runs = {repr(plan_chains("fused", chains, num_devices=4)) for _ in range(3)}
    assert len(runs) == 1


def test_many_layers_stay_exact_and_fast_enough():
    rng = random.Random(11)
    times = [rng.uniform(0.5, 1.5) for _ in range(1000)]
    got, parts = min_bottleneck(times, 8)
    # optimality certificate: the greedy at any bound below `got` needs more than 8 stages
    assert len(parts) <= 8
    below = got * (1 - 1e-9)
    stages, acc = 1, 0.0
    for t in times:
        if acc + t > below:
            stages, acc = stages + 1, t
        else:
            acc += t
    assert stages > 8
    assert list(itertools.chain.from_iterable(parts)) == list(range(1000))


# --- recompute only what does not fit: the fused tail keeps what the device holds ----------

def _tail_case(n=8):
    # equal layers: forward 1, recompute 1, backward 2 ms; 1 byte of parameters,
    # gradients and activations each
    return [ChainCosts.from_times([1.0] * n, param_bytes=[1.0] * n, act_bytes=[1.0] * n)]


def test_the_tail_grows_as_far_as_memory_allows_and_no_further():
    c = _tail_case()
    tails = {}
    for cap in (6, 9, 12, 15):
        fwd, bwd = plan_chains("fused", c, num_devices=1, memory_cap=cap)[0]
        ExecutePlan(fwd, bwd).validate(8, "fused")
        tails[cap] = len(bwd[0])
        assert 3 * len(bwd[0]) <= cap          # the tail's bytes fit the cap
    assert tails == {6: 2, 9: 3, 12: 4, 15: 5}
    fwd, bwd = plan_chains("fused", c, num_devices=1, memory_cap=15, recompute="full")[0]
    assert len(bwd[0]) == 1                   # balance alone keeps the tail one layer long


def test_without_a_memory_bound_auto_plans_as_full():
    c = _tail_case()
    assert plan_chains("fused", c, num_devices=1) == \
        plan_chains("fused", c, num_devices=1, recompute="full")


def test_a_tail_the_host_cannot_take_in_stays_short():
    c = _tail_case()
    quick = plan_chains("fused", c, num_devices=1, memory_cap=15)[0][1][0]
    # gradients taken in at 1 byte per 10 ms: a long tail hands them over all at once
    slow = NominalDevice(host_grad_bytes_per_s=100.0)
    held = plan_chains("fused", c, num_devices=1, memory_cap=15, device=slow)[0][1][0]
    assert len(held) < len(quick)


def test_recompute_must_be_auto_or_full():
    with pytest.raises(ValueError, match="recompute must be 'auto' or 'full'"):
        plan_chains("fused", _tail_case(), num_devices=1, recompute="selective")
