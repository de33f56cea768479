"""ExecutePlan: value semantics, every validation rule (with its message), default, auto."""

from types import SimpleNamespace

import pytest

from fxpipe.errors import PlanError
from fxpipe.plan import ExecutePlan, predict_memory


def R(a, b):
    return range(a, b)


def test_value_semantics_and_repr():
    plan = ExecutePlan([R(0, 3), R(3, 6)], [R(6, 7), R(5, 6), R(0, 5)])
    assert repr(plan) == "ExecutePlan(fwd=[0:3, 3:6], bwd=[6:7, 5:6, 0:5])"
    assert plan == ExecutePlan((R(0, 3), R(3, 6)), iter([R(6, 7), R(5, 6), R(0, 5)]))
    assert plan != ExecutePlan([R(0, 6)], plan.bwd_plan)
    assert ExecutePlan() == ExecutePlan([], []) and repr(ExecutePlan()) == "ExecutePlan(fwd=[], bwd=[])"
    assert ExecutePlan().fwd_plan is not ExecutePlan().fwd_plan
    with pytest.raises(PlanError, match="fwd_plan must be a list of range objects"):
        ExecutePlan(R(0, 3))


@pytest.mark.parametrize("run_type", ["infer", "train", "fused"])
@pytest.mark.parametrize("n", [1, 2, 5])
def test_default_plans_are_valid(run_type, n):
    plan = ExecutePlan.default(n, run_type)
    plan.validate(n, run_type)
    assert all(len(r) == 1 for r in plan.fwd_plan + plan.bwd_plan)
    if run_type == "fused":
        assert plan.bwd_plan[0] == R(n - 1, n) and len(plan.fwd_plan) == n - 1
    assert (plan.bwd_plan == []) == (run_type == "infer")


def test_valid_plans_pass():
    ExecutePlan([R(0, 2), R(2, 4)], [R(3, 4), R(2, 3), R(1, 2), R(0, 1)]).validate(4, "train")
    ExecutePlan([R(0, 3)], [R(3, 4), R(2, 3), R(1, 2), R(0, 1)]).validate(4, "fused")
    ExecutePlan([], [R(0, 4)]).validate(4, "fused")           # the tail is the whole model
    ExecutePlan([R(0, 4)], [range(9, 1, -1)]).validate(4, "infer")  # infer ignores bwd_plan


# each case: plan, num_layers, run_type, fragments the message must contain
CASES = {
    "not a range": (ExecutePlan([(0, 2)], []), 2, "infer", ["fwd_plan[0] = (0, 2)", "range of layer indices"]),
    "step": (ExecutePlan([range(0, 4, 2)], []), 4, "infer", ["fwd_plan[0]", "contiguous range (step 1)"]),
    "empty": (ExecutePlan([R(0, 2), R(2, 2)], []), 2, "infer", ["fwd_plan[1] = range(2, 2)", "non-empty"]),
    "reversed": (ExecutePlan([R(2, 0)], []), 2, "infer", ["fwd_plan[0] = range(2, 0)", "non-empty"]),
    "past the end": (ExecutePlan([R(0, 5)], []), 4, "infer", ["fwd_plan[0] = range(0, 5)", "0..3", "4 layers"]),
    "negative": (ExecutePlan([R(-1, 2)], []), 4, "infer", ["fwd_plan[0] = range(-1, 2)", "0..3"]),
    "fwd gap": (ExecutePlan([R(0, 2), R(3, 4)], []), 4, "infer",
                ["exactly once in ascending order", "layer 2 not covered", "fwd_plan[0] = 0:2", "fwd_plan[1] = 3:4"]),
    "fwd overlap": (ExecutePlan([R(0, 3), R(2, 4)], []), 4, "infer",
                    ["overlap", "layer 2 covered twice", "fwd_plan[0] = 0:3"]),
    "fwd duplicate": (ExecutePlan([R(0, 2), R(0, 2), R(2, 4)], []), 4, "infer", ["layers 0..1 covered twice"]),
    "fwd head missing": (ExecutePlan([R(1, 4)], []), 4, "infer", ["layer 0 not covered"]),
    "fwd tail missing": (ExecutePlan([R(0, 2)], []), 4, "infer", ["layers 2..3 not covered"]),
    "fwd empty": (ExecutePlan([], []), 3, "infer", ["the plan is empty", "layers 0..2"]),
    "fwd order": (ExecutePlan([R(2, 4), R(0, 2)], []), 4, "infer",
                  ["fwd_plan[0] = 2:4 comes before fwd_plan[1] = 0:2", "ascending (shallow to deep)"]),
    "train fwd incomplete": (ExecutePlan([R(0, 3)], [R(3, 4), R(0, 3)]), 4, "train", ["fwd_plan", "layer 3 not covered"]),
    "bwd missing": (ExecutePlan([R(0, 4)], []), 4, "train", ["bwd_plan", "descending order", "the plan is empty"]),
    "bwd order": (ExecutePlan([R(0, 4)], [R(0, 2), R(2, 4)]), 4, "train",
                  ["bwd_plan[0] = 0:2 comes before bwd_plan[1] = 2:4", "descending (deep to shallow)"]),
    "bwd gap": (ExecutePlan([R(0, 4)], [R(3, 4), R(0, 2)]), 4, "train", ["bwd_plan", "layer 2 not covered"]),
    "bwd overlap": (ExecutePlan([R(0, 4)], [R(1, 4), R(0, 2)]), 4, "train", ["bwd_plan", "layer 1 covered twice"]),
    "fused fwd includes tail": (ExecutePlan([R(0, 4)], [R(3, 4), R(0, 3)]), 4, "fused",
                                ["fwd_plan[-1].stop must equal bwd_plan[0].start = 3", "fwd_plan[0] = 0:4 includes layer 3",
                                 "tail layer 3 runs only in the fused first backward stage"]),
    "fused fwd short": (ExecutePlan([R(0, 2)], [R(3, 4), R(2, 3), R(0, 2)]), 4, "fused",
                        ["fwd_plan", "layer 2 not covered", "bwd_plan[0].start = 3"]),
    "fused tail everything": (ExecutePlan([R(0, 1)], [R(0, 4)]), 4, "fused", ["fwd_plan[0] = 0:1 includes layer 0"]),
    "fused bwd missing": (ExecutePlan([R(0, 3)], []), 4, "fused", ["bwd_plan", "the plan is empty"]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_each_rule_is_enforced_and_named(name):
    plan, n, run_type, fragments = CASES[name]
    with pytest.raises(PlanError) as info:
        plan.validate(n, run_type)
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))


def test_plan_error_is_a_value_error_and_arguments_are_checked():
    assert issubclass(PlanError, ValueError)
    with pytest.raises(ValueError, match="run_type must be one of"):
        ExecutePlan.default(2, "training")
    with pytest.raises(ValueError, match="num_layers must be an int >= 1"):
        ExecutePlan([R(0, 1)]).validate(0, "infer")


# --- auto ------------------------------------------------------------------------------


def layer(fwd_ms=None, bwd_ms=None, param_bytes=0, flops=1e9, **kw):
    cost = dict(param_bytes=param_bytes, grad_bytes=param_bytes, saved_bytes=0, boundary_bytes=0,
                fwd_flops=flops, bwd_flops=2 * flops, fwd_ms=fwd_ms, recompute_ms=None, bwd_ms=bwd_ms)
    cost.update(kw)
    return SimpleNamespace(cost=SimpleNamespace(**cost))


def pipe(layers, devices=2, memory_limit=None):
    return SimpleNamespace(layers=layers, devices=[SimpleNamespace(memory_limit=memory_limit)] * devices)


def test_auto_returns_a_valid_plan_per_pipe():
    llama = [layer(0.1, 0.2)] + [layer(1.0, 2.0) for _ in range(12)] + [layer(3.0, 6.0)]
    for run_type in ("infer", "train", "fused"):
        plan = ExecutePlan.auto(run_type, pipe(llama))
        assert isinstance(plan, ExecutePlan)
        plan.validate(len(llama), run_type)
        assert len(plan.fwd_plan) + len(plan.bwd_plan) >= 2  # min_stages defaults to the devices
    plans = ExecutePlan.auto("fused", pipe(llama[:5]), pipe(llama), num_devices=4)
    assert isinstance(plans, list) and len(plans) == 2
    plans[0].validate(5, "fused")
    plans[1].validate(14, "fused")


def test_auto_uses_estimates_without_measurements():
    layers = [layer(flops=1e12), layer(flops=1e12), layer(flops=4e12)]
    plan = ExecutePlan.auto("infer", pipe(layers), min_stages=2)
    assert plan.fwd_plan == [R(0, 2), R(2, 3)]


def test_auto_memory_limits():
    GB = 2**30
    layers = [layer(1.0, 2.0, param_bytes=GB) for _ in range(4)]
    # default: 90% of the smallest device (10 GB) at the predicted peak: a backward stage holds
    # its parameters and gradients, its device the next stage's parameters meanwhile
    p = pipe(layers, devices=1, memory_limit=10 * GB)
    plan = ExecutePlan.auto("train", p, upper_threshold=100)
    assert max(len(r) for r in plan.bwd_plan) == 2   # 2 + 2 GB, and 2 GB prefetched
    assert predict_memory(p, plan, num_microbatch=2).peak <= 0.9 * 10 * GB
    plan = ExecutePlan.auto("train", pipe(layers, devices=1), model_memory_limit=100, upper_threshold=100)
    assert plan.fwd_plan == [R(0, 4)] and plan.bwd_plan == [R(0, 4)]
    with pytest.raises(PlanError, match=r"layer 3 needs 2147483648 bytes \(2.15 GB: params 1.07 GB, "
                                        r"gradients 1.07 GB.*\) in a backward stage, over the "
                                        r"per-stage limit of 1073741824 bytes"):
        ExecutePlan.auto("train", pipe(layers), model_memory_limit=2)
    with pytest.raises(ValueError, match="model_memory_limit must be > 0"):
        ExecutePlan.auto("train", pipe(layers), model_memory_limit=0)


def test_auto_needs_costs_and_pipes():
    with pytest.raises(PlanError, match="pipe 0 layer 1 has no cost"):
        ExecutePlan.auto("infer", pipe([layer(1.0), SimpleNamespace(cost=None)]))
    with pytest.raises(ValueError, match="at least one pipe"):
        ExecutePlan.auto("infer")
