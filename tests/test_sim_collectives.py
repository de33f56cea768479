"""The simulator's data-parallel collectives: on the host (what the runtime runs) and, as
issue 58 plans them (MODELLED), on the devices (``Hardware.collectives="device"``,
``"zero3"``; ``fxpipe.sim.collectives``)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from fxpipe.passes.schedule import build_program
from fxpipe.sim import Hardware, LayerCost, simulate
from fxpipe.sim.collectives import device_lane

MB = 10**6
# a bf16 run: 1 MB of parameters (and gradients) on a device, 2 MB of fp32 masters
COSTS = [LayerCost(1.0, 2.0, param_bytes=MB, host_param_bytes=2 * MB, host_grad_bytes=2 * MB)] * 6
FWD, BWD = [range(0, 3), range(3, 5)], [range(5, 6), range(4, 5), range(3, 4), range(0, 3)]
HW = Hardware(ranks=4, network_bytes_per_s=1e9, network_latency_ms=0.01, h2d_bandwidth=1e9,
              d2h_bandwidth=1e9, cpu_optimizer_bytes_per_s=1e9)


def program(data_parallel: str | None = "shard", devices: int = 2):
    return build_program(FWD, BWD, "fused", devices, 4, "stage", optimizer=True,
                         data_parallel=data_parallel)


def run(where: str, hw: Hardware = HW, data_parallel: str | None = "shard"):
    return simulate(program(data_parallel), COSTS, replace(hw, collectives=where))


def intervals(t, prefix: str = "", suffix: str = ""):
    return [iv for iv in t.intervals if iv.label.startswith(prefix) and iv.label.endswith(suffix)]


def test_device_collectives_download_and_step_a_shard():
    host, device, zero3 = run("host"), run("device"), run("zero3")
    # every backward stage's bf16 gradients: 6 MB, a quarter each with device collectives
    assert host.bytes_moved["d2h_bytes_grads"] == 6 * MB
    assert device.bytes_moved["d2h_bytes_grads"] == zero3.bytes_moved["d2h_bytes_grads"] == 1.5 * MB
    assert sum(iv.end - iv.start for iv in intervals(device, suffix="D")) == pytest.approx(1.5)
    # the parameters: every rank uploads them whole, but with zero3 its quarter
    assert host.bytes_moved["h2d_bytes_params"] == device.bytes_moved["h2d_bytes_params"] == 11 * MB
    assert zero3.bytes_moved["h2d_bytes_params"] == 11 * MB / 4
    # each rank steps a quarter of the fp32 masters (sharded on the host too): 2 MB/layer
    for t in (host, device, zero3):
        steps = {iv.label: iv.end - iv.start for iv in t.intervals if iv.kind == "optimizer"}
        assert steps == pytest.approx({"S5:6": 0.5, "S4:5": 0.5, "S3:4": 0.5, "S0:3": 1.5})
    unsharded = run("host", data_parallel="allreduce")
    assert sum(iv.end - iv.start for iv in unsharded.intervals if iv.kind == "optimizer") == \
        pytest.approx(12.0)


def test_a_device_reduce_scatter_takes_a_rings_time_on_the_bf16_gradients():
    t = run("device")
    rs = {iv.label: iv for iv in t.intervals if iv.label.endswith("RS") and iv.device >= 0}
    assert sorted(rs) == ["2RS", "3RS", "4RS", "5RS"]
    assert all(iv.stream == "nccl" for iv in rs.values())
    # stage 5 (layers 0:3): 3 MB of bf16 gradients, 3/4 of them sent in 3 messages
    assert rs["5RS"].end - rs["5RS"].start == pytest.approx(3 * MB * 3 / 4 / 1e9 * 1e3 + 3 * 0.01)
    # host: fp32 gradients reduce-scattered (6 MB x 3/4), bf16 parameters gathered (6 MB x 3/4)
    assert run("host").bytes_moved["network_bytes"] == pytest.approx((12 + 6) * MB * 3 / 4)
    # device: bf16 reduce-scattered on the devices, bf16 gathered on the host
    assert t.bytes_moved["network_bytes"] == pytest.approx((6 + 6) * MB * 3 / 4)
    # zero3: no gather on the host; each upload (11 MB) gathered on the devices
    assert run("zero3").bytes_moved["network_bytes"] == pytest.approx((6 + 11) * MB * 3 / 4)
    assert [iv.label for iv in run("host").intervals if iv.device < 0 and "RS" in iv.label]


def test_device_collectives_overlap_the_shallower_stages_backward():
    slow = replace(HW, network_bytes_per_s=2e8)      # 3.75 ms per MB reduce-scattered
    free = simulate(program(None), COSTS, replace(slow, cpu_optimizer_bytes_per_s=1e9))
    t = run("device", slow)
    rs = intervals(t, suffix="RS")
    collectives = sum(iv.end - iv.start for iv in t.intervals
                      if iv.stream in ("nccl", "collective"))
    assert free.makespan < t.makespan < free.makespan + collectives
    # the deepest stage's reduce-scatter runs while a shallower stage computes its backward
    first = min(rs, key=lambda iv: iv.start)
    assert any(iv.kind == "backward" and iv.start < first.end and first.start < iv.end
               for iv in t.intervals)
    # its download waits for it, and moves after it
    download = next(iv for iv in t.intervals if iv.label == first.label.replace("RS", "D"))
    assert download.start >= first.end


def test_zero3_gathers_each_stage_before_it_computes():
    t = run("zero3")
    gathers = {iv.label: iv for iv in intervals(t, suffix="AG") if iv.device >= 0}
    assert sorted(gathers) == ["0AG", "1AG", "2AG", "3AG", "4AG", "5AG"]
    for iv in t.intervals:
        if iv.kind in ("forward", "recompute"):
            assert iv.start >= gathers[f"{iv.label.split('F')[0].split('B')[0]}AG"].end
    lane = [str(a) for a in device_lane(program().actions[0], "zero3")]
    assert lane.index("0AG") == lane.index("0P") + 1 and lane.index("2RS") + 1 == lane.index("2D")


def test_one_node_prices_no_collective():
    one = replace(HW, ranks=1)
    alone = simulate(program(None), COSTS, one)
    for where in ("host", "device", "zero3"):
        t = run(where, one)
        assert t.makespan == pytest.approx(alone.makespan), where
        assert t.bytes_moved["network_bytes"] == 0
        assert t.bytes_moved["d2h_bytes_grads"] == alone.bytes_moved["d2h_bytes_grads"]


def test_a_device_mode_takes_the_sharded_programs_collectives():
    with pytest.raises(ValueError, match="data_parallel='shard'"):
        run("zero3", data_parallel="allreduce")
    with pytest.raises(ValueError, match="collectives must be"):
        Hardware(collectives="nccl")
    # a Program without collectives (one rank) is timed as it is
    assert run("zero3", data_parallel=None).makespan == run("host", data_parallel=None).makespan


def test_a_nodes_collectives_share_its_link_one_at_a_time():
    for where in ("host", "device", "zero3"):
        t = run(where)
        spans = sorted((iv.start, iv.end) for iv in t.intervals
                       if iv.stream in ("nccl", "collective") and iv.end > iv.start)
        assert len({iv.device for iv in t.intervals if iv.stream == "nccl"}) == \
            (0 if where == "host" else 2)
        assert all(b[0] >= a[1] - 1e-9 for a, b in zip(spans, spans[1:])), where


def test_the_runtimes_device_program_prices_as_the_lowering_modelled():
    """``data_parallel="device"``'s Program (what the runtime runs: the devices' ``sRS``
    printed in their lanes) simulated as it is: the same timeline and bytes as the
    sharded Program lowered by ``Hardware(collectives="device")``."""
    native = simulate(program("device"), COSTS, HW)
    lowered = run("device")
    assert [str(a) for a in program("device").actions[0]] == \
        [str(a) for a in device_lane(program().actions[0], "device")]
    assert native.makespan == pytest.approx(lowered.makespan)
    assert native.bytes_moved == pytest.approx(lowered.bytes_moved)
    a, b = (sorted((iv.label, iv.start, iv.end) for iv in t.intervals) for t in (native, lowered))
    assert [x[0] for x in a] == [x[0] for x in b]
    assert [t for x in a for t in x[1:]] == pytest.approx([t for x in b for t in x[1:]])


def test_an_all_reducing_program_on_the_devices_downloads_and_steps_them_whole():
    """``data_parallel=True`` on GPUs (the optimizer unsharded): the runtime's Program
    all-reduces each stage's gradients on its device (``sAR`` on the ``nccl`` stream) and
    is priced as ``Hardware(collectives="device")`` lowers the host's ``AR``: no host
    collective, every gradient downloaded and stepped on every rank, as the host's
    ``AR`` does, but in the devices' dtype (bf16: half the bytes)."""
    native = simulate(program("device_allreduce"), COSTS, HW)
    lowered = run("device", data_parallel="allreduce")
    host = run("host", data_parallel="allreduce")
    assert [str(a) for a in program("device_allreduce").host] == \
        [a for a in map(str, program("allreduce").host) if not a.startswith("AR")]
    assert native.makespan == pytest.approx(lowered.makespan)
    assert native.bytes_moved == pytest.approx(lowered.bytes_moved)
    assert native.bytes_moved["d2h_bytes_grads"] == host.bytes_moved["d2h_bytes_grads"] == 6 * MB
    ar = {iv.label: iv for iv in native.intervals if iv.label.endswith("AR")}
    assert sorted(ar) == ["2AR", "3AR", "4AR", "5AR"], sorted(ar)
    assert all(iv.stream == "nccl" and iv.device >= 0 for iv in ar.values())
    assert not any(iv.stream == "collective" and iv.label.startswith("AR")
                   for iv in native.intervals)
    steps = lambda t: sum(iv.end - iv.start for iv in t.intervals  # noqa: E731
                          if iv.kind == "optimizer")
    assert steps(native) == pytest.approx(steps(host)) == pytest.approx(12.0)
    # a ring all-reduce sends 2 (N-1)/N of its buffer: the bf16 gradients on the devices
    # (6 MB), the fp32 ones on the host (12 MB)
    assert native.bytes_moved["network_bytes"] == pytest.approx(2 * 3 / 4 * 6 * MB)
    assert host.bytes_moved["network_bytes"] == pytest.approx(2 * 3 / 4 * 12 * MB)


def test_an_accumulated_device_reduce_scatter_uploads_the_host_gradients_first():
    """``sRS+`` (a call after calls that did not synchronize): each backward stage's
    reduce-scatter first uploads the host's fp32 ``.grad`` of its layers (2 MB a layer at
    1 GB/s: 2 ms each) on its device's collective stream; the rest of the Program is
    priced as without it."""
    plain = simulate(program("device"), COSTS, HW)
    acc = simulate(program("device_accumulated"), COSTS, HW)
    reduced = sorted(str(a) for acts in program("device_accumulated").actions for a in acts
                     if "RS" in str(a))
    assert reduced == sorted(f"{st.index}RS+" for st in program().stages if st.kind != "fwd")
    assert acc.bytes_moved["h2d_bytes_grads"] == 6 * 2 * MB
    assert plain.bytes_moved["h2d_bytes_grads"] == 0
    assert {k: v for k, v in acc.bytes_moved.items() if k != "h2d_bytes_grads"} == \
        pytest.approx({k: v for k, v in plain.bytes_moved.items() if k != "h2d_bytes_grads"})
    spans = {iv.label: iv.end - iv.start for iv in plain.intervals if iv.label.endswith("RS")}
    for iv in acc.intervals:
        if iv.label.endswith("RS+"):
            layers = len(program().stages[int(iv.label[:-3])].layers)
            assert iv.end - iv.start == pytest.approx(spans[iv.label[:-1]] + 2.0 * layers)


def test_a_device_all_reduce_averages_on_the_nccl_stream_and_downloads_whole():
    """``sAR`` (``data_parallel="device"``, a call that steps no sharded optimizer): each
    backward stage's bf16 gradients all-reduced on its device's ``nccl`` stream (a ring's
    bytes), then downloaded whole; the host lane takes them (``M``), no host collective."""
    p = build_program(FWD, BWD, "fused", 2, 4, "stage", data_parallel="device_allreduce")
    assert [str(a) for a in p.host] == ["RF", "M5:6", "M4:5", "M3:4", "M0:3", "C"]
    t = simulate(p, COSTS, HW)
    assert t.bytes_moved["d2h_bytes_grads"] == 6 * MB
    assert t.bytes_moved["network_bytes"] == pytest.approx(HW.collective_bytes("all_reduce", 6 * MB))
    ar = [iv for iv in t.intervals if iv.label.endswith("AR")]
    assert len(ar) == len(BWD) and all(iv.stream == "nccl" for iv in ar)
    for iv in ar:
        layers = len(p.stages[int(iv.label[:-2])].layers)
        assert iv.end - iv.start == pytest.approx(HW.collective_ms("all_reduce", layers * MB))


def test_the_runtimes_zero3_program_prices_as_the_lowering_modelled():
    """``data_parallel="zero3"``'s Program (what the runtime runs: a ``sAG`` after each
    ``sP``, the ``sRS`` before each ``sD``, a barrier last in the host lane, no ``AG``)
    simulated as it is: the bytes of the sharded Program lowered by
    ``Hardware(collectives="zero3")``, the same device work, and a step longer by the
    barrier's round of latency alone."""
    native_program = build_program(FWD, BWD, "fused", 2, 4, "stage", optimizer=True,
                                   data_parallel="zero3", gather_params=True)
    assert [str(a) for a in native_program.actions[0]] == \
        [str(a) for a in device_lane(program().actions[0], "zero3")]
    assert [str(a) for a in native_program.host][-1] == "SY"
    native, lowered = simulate(native_program, COSTS, HW), run("zero3")
    assert native.bytes_moved == pytest.approx(lowered.bytes_moved)
    a, b = (sorted((iv.label, iv.start, iv.end) for iv in t.intervals if iv.device >= 0)
            for t in (native, lowered))
    assert [x[0] for x in a] == [x[0] for x in b]
    assert [t for x in a for t in x[1:]] == pytest.approx([t for x in b for t in x[1:]])
    barrier = [iv for iv in native.intervals if iv.label == "SY"]
    assert len(barrier) == 1
    assert native.makespan == pytest.approx(lowered.makespan + (barrier[0].end - barrier[0].start))
