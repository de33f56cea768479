"""The host's issue path: runnable stage code, kept issue threads, InlineDevice, the
planner's host cost per action, and benchmarks/bench_issue.py."""

from __future__ import annotations

import copy
import json
import sys
import threading
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from expecttest import assert_expected_inline

import fxpipe
from fxpipe.passes.chain_costs import ChainCosts, estimate_makespan
from fxpipe.passes.planner import plan_chains

HOST_MS_PER_ACTION = 0.05   # the default outside this suite (tests/conftest.py)
from fxpipe.runtime.stages import unfilled
from fxpipe.runtime.devices.emulator import InlineDevice
from tests.test_recompute import Block

ROOT = Path(__file__).resolve().parents[1]


def blocks_pipe(devices, num_blocks=2, plan=None):
    torch.manual_seed(0)
    model = nn.Sequential(*[Block(4) for _ in range(num_blocks)])
    ref = copy.deepcopy(model)
    x, y = torch.randn(4, 3, 4), torch.randn(4, 3, 4)
    pipe = fxpipe.compile(model, example_inputs=(x,), devices=devices, plan=plan,
                          config=fxpipe.RunConfig(num_microbatch=2))
    return model, ref, pipe, x, y


def test_runnable_code_serves_transfers_with_plain_calls_and_leaves_nodes_unfilled():
    """What a stage run executes: no ``torch.ops.fxpipe`` op (each transfer a plain
    call), a mark where each layer starts, and in the recompute the nodes it leaves unfilled
    called through ``unfilled_*``; the host parameters the prefetch read are gone."""
    *_, pipe, _, _ = blocks_pipe(["cpu"], plan=fxpipe.ExecutePlan([range(0, 1)],
                                                                  [range(1, 2), range(0, 1)]))
    code = pipe.code("fused", runnable=True)
    recompute = code[code.rindex("def forward", 0, code.index("# runnable recompute")):]
    assert_expected_inline(recompute, """\
def forward(self, input_1):
    # runnable recompute, unfilled: stage 2 bwd | layer 0 (0) | vcpu:0 | params 304 B | saved 960 B | out 192 B | fwd 1.54 kFLOP | bwd 2.30 kFLOP
    params = fxpipe_runtime_stages_stage_code_resident(2)
    _0_up_weight = params[0]
    _0_up_bias = params[1]
    _0_down_weight = params[2]
    _0_down_bias = params[3];  params = None
    input_1_dev = fxpipe_runtime_stages_stage_code_uploaded(input_1, 0);  input_1 = None
    layer_0_starts = fxpipe_runtime_stages_stage_code_layer(0);  layer_0_starts = None
    linear = torch._C._nn.linear(input_1_dev, _0_up_weight, _0_up_bias);  _0_up_weight = _0_up_bias = None
    gelu = torch._C._nn.gelu(linear);  linear = None
    linear_1 = fxpipe_runtime_stages_stage_code_unfilled_linear(gelu, _0_down_weight, _0_down_bias);  gelu = _0_down_weight = _0_down_bias = None
    add = fxpipe_runtime_stages_stage_code_unfilled_add(input_1_dev, linear_1);  input_1_dev = linear_1 = None
    add_host = fxpipe_runtime_stages_stage_code_offloaded(add);  add = None
    release = fxpipe_runtime_stages_stage_code_released(2);  release = None
    return (add_host,)
    
""")
    assert "torch.ops.fxpipe" not in code and "getattr(self" not in code


def test_a_pipe_on_inline_devices_equals_eager_and_issues_every_action_inline():
    model, ref, pipe, x, y = blocks_pipe([InlineDevice(), InlineDevice()], num_blocks=4)
    issuers: set[str] = set()
    for dev in pipe.devices:
        submit = dev.submit

        def spy(*args, _submit=submit, **kwargs):
            issuers.add(threading.current_thread().name)
            return _submit(*args, **kwargs)
        dev.submit = spy
    loss = pipe.forward_backward((x,), label=y, loss_fn=F.mse_loss)
    ref_loss = F.mse_loss(ref(x), y)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach())
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    assert issuers == {"fxpipe-issue-0", "fxpipe-issue-1"}
    assert pipe.stats()["host_issue_us"] > 0
    assert all(dev.resident_bytes() == 0 for dev in pipe.devices)


def test_inline_device_work_fails_into_its_event_and_skips_after_a_failed_wait():
    d = InlineDevice()
    bad = d.submit("compute", lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        bad.result()
    ran = []
    after = d.submit("h2d", lambda: ran.append(1), wait=[bad])
    assert isinstance(after.exception(), ZeroDivisionError) and not ran
    with pytest.raises(ValueError, match="stream must be one of"):
        d.submit("nowhere", lambda: None)
    d.close()
    with pytest.raises(RuntimeError, match="is closed"):
        d.submit("compute", lambda: None)


def test_issue_threads_are_kept_between_calls():
    """Starting a thread costs the caller about a millisecond: a call's lanes are issued
    by threads kept from earlier calls, named for their lane while they issue."""
    *_, pipe, x, y = blocks_pipe(["cpu", "cpu"])
    pipe.forward_backward((x,), label=y, loss_fn=F.mse_loss)
    before = {t.ident for t in threading.enumerate() if t.name.startswith("fxpipe-issue")}
    for _ in range(3):
        pipe.forward_backward((x,), label=y, loss_fn=F.mse_loss)
    after = {t.ident for t in threading.enumerate() if t.name.startswith("fxpipe-issue")}
    assert before and after == before
    assert {t.name for t in threading.enumerate() if t.ident in after} == {"fxpipe-issue-idle"}


# -- the planner's host cost ----------------------------------------------------------

def test_the_planner_keeps_layers_too_small_to_pay_for_their_issuing_together():
    tiny = ChainCosts.from_times([0.01] * 16)
    free = plan_chains("fused", [tiny], num_devices=2, num_microbatch=4)[0]
    costed = plan_chains("fused", [tiny], num_devices=2, num_microbatch=4,
                         host_ms_per_action=0.05)[0]
    assert len(free[1]) == 16                            # one layer per backward stage
    assert len(costed[0]) + len(costed[1]) <= 4
    big = ChainCosts.from_times([50.0] * 16)             # layers that dwarf the host cost
    assert plan_chains("fused", [big], num_devices=2, num_microbatch=4, host_ms_per_action=0.05) \
        == plan_chains("fused", [big], num_devices=2, num_microbatch=4)
    with pytest.raises(ValueError, match="host_ms_per_action"):
        plan_chains("fused", [tiny], num_devices=2, host_ms_per_action=-1.0)


def test_the_makespan_estimate_is_at_least_the_host_time_of_every_stage():
    assert estimate_makespan([1.0] * 8, 2, 4) == pytest.approx(4.25)
    assert estimate_makespan([0.01] * 8, 2, 4, host_ms=1.0) == pytest.approx(8.0)


def test_auto_plans_a_chain_of_tiny_blocks_into_few_stages():
    """The issue's probe: 16 Linear(16, 16) blocks, 4 microbatches. With issuing free
    the plan cut one backward stage per layer (17 stages); it costs the host ~0.05 ms
    an action, more than such a layer computes."""
    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.l = nn.Linear(16, 16)

        def forward(self, x):
            return x + torch.relu(self.l(x))

    model = nn.Sequential(*[Tiny() for _ in range(16)])
    pipe = fxpipe.compile(model, example_inputs=(torch.randn(8, 16),), devices=["cpu"] * 2,
                          config=fxpipe.RunConfig(num_microbatch=4))
    free = fxpipe.ExecutePlan.auto("fused", pipe, num_microbatch=4, host_ms_per_action=0)
    plan = fxpipe.ExecutePlan.auto("fused", pipe, num_microbatch=4,
                                   host_ms_per_action=HOST_MS_PER_ACTION)
    assert len(free.bwd_plan) == 16
    assert 2 <= len(plan.fwd_plan) + len(plan.bwd_plan) <= 4   # min_stages: the 2 devices


# -- the recompute's unfilled nodes without a meta function --------------------------------------

@pytest.mark.parametrize("op, args", [
    ("mm", (torch.randn(3, 4), torch.randn(4, 5))),
    ("mm", (torch.randn(4, 3).t(), torch.randn(5, 4).t())),
    ("addmm", (torch.randn(5), torch.randn(3, 4), torch.randn(4, 5))),
    ("bmm", (torch.randn(2, 3, 4), torch.randn(2, 4, 5))),
    ("baddbmm", (torch.randn(2, 3, 5), torch.randn(2, 3, 4), torch.randn(2, 4, 5))),
    ("add", (torch.randn(2, 3), torch.randn(2, 3))),
    ("add", (torch.randn(2, 3), torch.randn(3))),                 # broadcast: meta
    ("add", (torch.randn(3, 2).t(), torch.randn(2, 3))),          # strided: meta
])
def test_an_unfilled_result_has_the_shape_and_strides_of_the_real_one(op, args):
    func = getattr(torch.ops.aten, op).default if op != "add" else torch.ops.aten.add.Tensor
    real = func(*args)
    with unfilled.Unfilled():
        out = func(*args)
    assert out.shape == real.shape and out.stride() == real.stride() and out.dtype == real.dtype


# -- the benchmark ---------------------------------------------------------------------

def test_bench_issue_prints_its_rows_as_json(tmp_path, capsys):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_issue
    # eager stage code only: inductor's rows compile (minutes on 2 cores); their one
    # computed figure is tested below. No issue-lock A/B (twelve 8-GPU steps)
    assert bench_issue.main(["--models", "Qwen3-1.7B", "--gpus", "2", "--tokens", "4096",
                             "--repeats", "1", "--backends", "eager", "--json", "--no-lock-ab",
                             "--out", str(tmp_path / "out.json")]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result == json.loads((tmp_path / "out.json").read_text())
    (row,) = result["rows"]
    assert {"model", "gpus", "seq_len", "host_issue_ms", "predicted_gpu_ms", "ratio",
            "kernels_per_layer", "host_us_per_layer"} <= set(row) and row["stage_backend"] is None
    # the profiler counts the kernels of the pipe's issue threads: as many as eager's
    assert 0.8 <= row["kernels_per_layer"] / row["eager_kernels_per_layer"] <= 1.25, row
    assert (row["model"], row["gpus"], row["seq_len"]) == ("Qwen3-1.7B", 2, 4096)
    assert row["ratio"] == pytest.approx(row["host_issue_ms"] / row["predicted_gpu_ms"])
    assert row["actions"] > 0 and row["step_tflop"] > 0
    assert result["action_us"]["min_us"] > 0 and result["action_us"]["devices_8"]["min_us"] > 0


def test_an_action_around_an_empty_stage_makes_few_python_calls():
    """The issue path's cost per action, counted (not timed): 61.9 Python calls per action
    before #55's cut of the per-action path, 29.6 after. A regression back past the
    budget fails here, on any CPU."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_issue
    calls = bench_issue.action_calls()
    assert calls["actions"] == [8, 68], calls
    assert 20 <= calls["per_action"] <= 34, calls


def test_bench_issue_models_a_compiled_rows_host_time_from_its_kernel_count():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_issue
    eager = {"host_issue_ms": 500.0, "kernels_per_layer": 120.0,
             "host_issue_us_by_kind": {"Forward": 100e3, "RecomputeBackward": 200e3,
                                       "Upload": 50e3}}
    # the compute actions' share, 300 of 350 ms of action time, scaled by 40/120 kernels
    share = 300 / 350
    assert bench_issue.modelled_host_ms(eager, 40.0) == \
        pytest.approx(500.0 * (1 - share + share / 3))
