"""The host lane's actions: what a call does on the host is in its Program, ordered,
validated and timed by the simulator like every other action."""

from __future__ import annotations

import pytest

from fxpipe.passes.program import (
    ClipGradNorm, Commit, OptimizerSpec, Program, Refresh, parse_action,
)
from fxpipe.passes.schedule import build_program, host_lane, make_stages
from fxpipe.sim import Hardware, LayerCost, simulate

FWD, BWD = [range(0, 2)], [range(2, 4), range(0, 2)]


def test_host_actions_print_and_parse():
    for text in ("RF", "M0:2", "N", "SS", "Q", "S2:4", "C", "A"):
        assert str(parse_action(text)) == text
    p = build_program(FWD, BWD, "fused", 2, 2, "stage",
                      optimizer=OptimizerSpec(clip=True, speculate=False))
    assert [str(a) for a in p.host] == ["RF", "M2:4", "M0:2", "C", "N", "S2:4", "S0:2"]
    assert Program.parse(str(p)) == p
    p.validate()


def test_host_lane_order_is_checked():
    p = build_program(FWD, BWD, "fused", 2, 1, "stage")
    with pytest.raises(ValueError, match="after the Commit"):
        Program(p.num_devices, p.num_microbatches, p.stages, p.actions,
                (Refresh(), ClipGradNorm(), Commit()), p.inputs, p.outputs)
    with pytest.raises(ValueError, match="before the Commit"):
        Program(p.num_devices, p.num_microbatches, p.stages, p.actions,
                (Commit(), Refresh()), p.inputs, p.outputs)
    st = make_stages(FWD, BWD, "fused")
    with pytest.raises(ValueError, match="shard"):   # a sharded step: streamed, or clipped first
        host_lane(st, OptimizerSpec(scaler=True), "shard")
    with pytest.raises(ValueError, match="optimizer"):
        host_lane(st, "sometimes")


def test_prefetches_wait_for_the_refresh():
    p = build_program(FWD, BWD, "fused", 2, 1, "stage")
    deps = p.dependencies()
    for d, acts in enumerate(p.actions):
        first = next(i for i, a in enumerate(acts) if str(a).endswith("P"))
        assert any(dep.device == -1 and dep.step == 0 for dep in deps[d][first])


def test_the_simulator_times_every_host_action():
    """``Refresh`` copies ``refresh_bytes``, ``N`` and ``Q`` read every gradient once,
    ``SS`` and each ``S`` step parameters, at the hardware's host rates."""
    costs = [LayerCost(1.0, 2.0, param_bytes=10**6, grad_bytes=10**6)] * 4
    hw = Hardware(cpu_optimizer_bytes_per_s=1e9, host_copy_bytes_per_s=2e9)

    def durations(optimizer, refresh_bytes=0):
        p = build_program(FWD, BWD, "fused", 2, 2, "stage", optimizer=optimizer)
        t = simulate(p, costs, hw, refresh_bytes=refresh_bytes)
        return {iv.label: round(iv.end - iv.start, 6) for iv in t.intervals if iv.device == -1}

    end = durations(OptimizerSpec(clip=True, speculate=False), refresh_bytes=4 * 10**6)
    assert end["RF"] == 2.0                      # 4 MB at 2 GB/s
    assert end["N"] == 2.0                       # every gradient (4 MB) read once
    assert end["S2:4"] == end["S0:2"] == 2.0     # 2 MB of parameters at 1 GB/s
    assert end["M2:4"] == end["C"] == 0.0        # a download lands in place
    scaled = durations(OptimizerSpec(scaler=True))
    assert scaled["SS"] == 4.0 and scaled["RF"] == 0.0
    assert durations("async")["Q"] == 2.0
