"""The host's issue time: the kernels the cost pass counts, the simulator's issue pass
(``Hardware.host_us_per_*``, ``stage_backend``), its figures fitted to the H200 run and
their CPU-ratio refit."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

import fxpipe
from fxpipe.demo import TinyLlama
from fxpipe.passes.costs import Cost, compute_costs
from fxpipe.passes.partition import build_layer_graph
from fxpipe.passes.dependencies import graph_program
from fxpipe.passes.schedule import build_program
from fxpipe.sim import Hardware, LayerCost
from fxpipe.sim.hardware import H200_HOST, H200_HOST_REFIT
from fxpipe.passes.program import FusedBackward, GraphUpload
from fxpipe.sim.simulate import INDUCTOR_KERNELS, action_kernels, graph_job_kernels, simulate

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_the_cost_pass_counts_the_kernels_a_layer_launches():
    """A Linear launches one kernel forward (addmm; the transpose is a view) and one per
    gradient backward; a Llama block launches more backward than forward; ``Cost.sum``
    adds them."""
    x = torch.randn(8, 16)
    lg = build_layer_graph(nn.Sequential(nn.Linear(16, 16), nn.ReLU()), (x,))
    costs = compute_costs(lg, [x])
    assert sum(c.fwd_kernels for c in costs) == 2                       # addmm, relu
    assert sum(c.bwd_kernels for c in costs) >= 4                       # relu', dx, dW, db
    with torch.device("meta"):
        model = TinyLlama(vocab=64, dim=32, depth=2)
    ids = torch.zeros(2, 8, dtype=torch.long, device="meta")
    lg = build_layer_graph(model, (ids,))
    block = compute_costs(lg, [ids])[1]
    assert 0 < block.fwd_kernels < block.bwd_kernels
    assert Cost.sum([block, block]).fwd_kernels == 2 * block.fwd_kernels


def _program_and_costs():
    program = build_program([range(0, 2)], [range(2, 4), range(0, 2)], "fused", 2, 4, "stage")
    return program, [LayerCost(1.0, 2.0, fwd_kernels=30, bwd_kernels=60)] * 4


def test_issuing_is_free_by_default_and_a_slow_host_lengthens_the_step():
    program, costs = _program_and_costs()
    base = simulate(program, costs)
    assert base.host_issue_ms == 0
    same = simulate(program, costs, Hardware(host_us_per_action=0.0))
    assert same.makespan == base.makespan
    slow = Hardware(host_us_per_action=100.0, host_us_per_kernel=50.0)
    t = simulate(program, costs, slow)
    kernels = action_kernels(program, costs)
    devices = sum(len(acts) for lane, acts in program.lanes() if lane >= 0)
    expected = (devices * 100.0 + sum(k for k, _ in kernels.values()) * 50.0) / 1e3
    assert t.host_issue_ms == pytest.approx(expected)
    assert t.makespan >= t.host_issue_ms > base.makespan              # host-bound
    fast = simulate(program, costs, Hardware(host_us_per_action=1.0, host_us_per_kernel=0.01))
    assert fast.makespan == pytest.approx(base.makespan, rel=0.01)    # device-bound


def test_grad_kernels_and_stage_backends_price_what_they_launch():
    program, costs = _program_and_costs()
    kernels = action_kernels(program, costs)
    assert {g for _, g in kernels.values()} == {False, True}
    assert all(k == 60 if not g else k in (90, 180) for k, g in kernels.values())
    hw = Hardware(host_us_per_kernel=10.0, host_us_per_grad_kernel=20.0)
    no_grad = sum(k for k, g in kernels.values() if not g)
    grad = sum(k for k, g in kernels.values() if g)
    assert simulate(program, costs, hw).host_issue_ms == pytest.approx((no_grad * 10 + grad * 20) / 1e3)
    eager = simulate(program, costs, hw, stage_backend="eager").host_issue_ms
    inductor = simulate(program, costs, hw, stage_backend="inductor").host_issue_ms
    graphs = simulate(program, costs, hw, stage_backend="cudagraphs").host_issue_ms
    assert inductor == pytest.approx(eager * INDUCTOR_KERNELS)
    # MODELLED: a Forward or stage RecomputeBackward replays a graph (its launch, the
    # copies in and out, no grad; none in for the inputs its GraphUpload put in its input
    # slot); a FusedBackward runs inductor's kernels
    graph_kernels = action_kernels(program, costs, "cudagraphs")
    slotted = {(a.stage, a.mb) for acts in graph_program(program).actions for a in acts
               if isinstance(a, GraphUpload)}
    assert slotted   # every graph job's upload but the ones before its slot's last reader
    expected = 0.0
    for (d, i), (k, g) in graph_kernels.items():
        a = program.actions[d][i]
        if isinstance(a, FusedBackward):
            assert (k, g) == (kernels[(d, i)][0] * INDUCTOR_KERNELS, True)
        else:
            in_place = len(program.flow.upload.get((a.stage, a.mb), ())) \
                if (a.stage, a.mb) in slotted else 0
            assert (k, g) == (graph_job_kernels(program.stages[a.stage], a, in_place), False)
            assert in_place == 0 or k < graph_job_kernels(program.stages[a.stage], a)
        expected += k * (20 if g else 10)
    assert graphs == pytest.approx(expected / 1e3) and graphs < inductor
    with pytest.raises(ValueError, match="stage_backend must be"):
        simulate(program, costs, hw, stage_backend="tensorrt")


def test_fxpipe_simulate_prices_the_pipes_stage_backend():
    model = nn.Sequential(*[nn.Linear(32, 32) for _ in range(4)])
    x = torch.randn(16, 32)
    hw = Hardware(host_us_per_kernel=10.0)
    times = {}
    for backend in (None, "inductor"):
        pipe = fxpipe.compile(model, example_inputs=(x,), devices=["cpu"] * 2,
                              config=fxpipe.RunConfig(stage_backend=backend))
        times[backend] = fxpipe.simulate(pipe, hw).host_issue_ms
        pipe.close()
    assert times["inductor"] == pytest.approx(times[None] * INDUCTOR_KERNELS)
    # under "cudagraphs", its Program's graph jobs: a launch each, and their copies
    model = nn.Sequential(*[nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 64), nn.GELU(),
                                          nn.Linear(64, 32), nn.Tanh()) for _ in range(4)])
    for backend in ("inductor", "cudagraphs"):
        pipe = fxpipe.compile(model, example_inputs=(x,), devices=["cpu"] * 2,
                              config=fxpipe.RunConfig(stage_backend=backend))
        times[backend] = fxpipe.simulate(pipe, hw).host_issue_ms
        assert ("F0g" in str(pipe.program())) == (backend == "cudagraphs")
        pipe.close()
    assert times["cudagraphs"] < times["inductor"]


def test_the_h200_figures_are_the_fit_to_the_committed_run():
    """``H200_HOST`` is what ``benchmarks/bench_host_model.py`` fits to
    ``benchmarks/results/gpu_check.json``, and the fitted host gives the run's issue time;
    ``INDUCTOR_KERNELS`` is ``bench_issue.json``'s measured kernel ratio."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_host_model import calibrate
    gpu = json.loads((ROOT / "benchmarks" / "results" / "gpu_check.json").read_text())
    fit = calibrate(gpu)
    assert fit["program_actions"] == fit["run_actions"]                 # the call rebuilt
    for name, value in H200_HOST.items():
        assert value == pytest.approx(fit[name], rel=1e-3), name
    assert fit["simulated_host_issue_ms"] == pytest.approx(fit["measured_host_issue_ms"], rel=1e-3)
    issue = json.loads((ROOT / "benchmarks" / "results" / "bench_issue.json").read_text())
    ratios = {(r["model"], r["gpus"], r["seq_len"]): r["kernels_per_layer"] for r in issue["rows"]
              if r["stage_backend"] is None}
    measured = [r["kernels_per_layer"] / ratios[(r["model"], r["gpus"], r["seq_len"])]
                for r in issue["rows"] if r["stage_backend"] == "inductor"]
    assert INDUCTOR_KERNELS == pytest.approx(sum(measured) / len(measured), abs=0.005)


def test_the_refit_figures_are_the_documented_projection_of_the_h200_fit():
    """``H200_HOST_REFIT`` is ``bench_host_model.refit`` of ``H200_HOST`` with the inputs
    ``benchmarks/results/bench_host_model.json`` recorded: the action costs it measured
    (the H200 run's code, the commit ``gpu_check.json``'s ``stats`` ran, against this
    tree) and fxpipe's issue / eager dispatch ratios of the ``bench_issue.json`` record of
    that code and of today's. Editing the constants, or recording either benchmark again,
    without rerunning ``bench_host_model.py`` and setting the figures it prints fails here."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_host_model import THEN_RECORD, issue_over_eager, refit
    results = ROOT / "benchmarks" / "results"
    d = json.loads((results / "bench_host_model.json").read_text())
    gpu = json.loads((results / "gpu_check.json").read_text())
    a, ie = d["refit"]["action_us"], d["refit"]["issue_over_eager"]
    derived = refit(H200_HOST, a["then"]["min_us"], a["now"]["min_us"], ie["then"]["ratio"],
                    ie["now"]["ratio"])
    assert H200_HOST_REFIT == derived == d["refit"]["figures"], (
        "rerun benchmarks/bench_host_model.py and set fxpipe.sim.hardware.H200_HOST_REFIT "
        f"to the figures it prints ({derived} from the recorded inputs)")
    assert a["then"]["commit"] == next(r["commit"] for r in gpu["runs"] if "stats" in r["keys"])
    assert ie["then"]["record"] == THEN_RECORD
    assert ie["then"]["fxpipe_differs_from_h200_run"] == ["fxpipe/check.py"]   # the same issue path
    now = issue_over_eager(json.loads((results / "bench_issue.json").read_text()))
    assert ie["now"]["ratio"] == now["ratio"], \
        "bench_issue.json was recorded again: rerun bench_host_model.py"
    then = subprocess.run(["git", "show", f"{THEN_RECORD}:benchmarks/results/bench_issue.json"],
                          cwd=ROOT, capture_output=True, text=True)
    if then.returncode == 0:   # a shallow clone lacks the record
        assert ie["then"]["ratio"] == issue_over_eager(json.loads(then.stdout))["ratio"]
