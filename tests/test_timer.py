"""Online per-layer timer and verbose mode."""

import threading

import pytest
import torch

import fxpipe.verbose as verbose
from fxpipe.runtime.stages.timer import LayerTimer


@pytest.fixture(autouse=True)
def _reset_verbose(monkeypatch):
    monkeypatch.delenv("FXPIPE_VERBOSE", raising=False)
    verbose.set_verbose(None)
    yield
    verbose.set_verbose(None)


def test_first_sample_is_warm_up_and_dropped():
    t = LayerTimer()
    t.record(0, "fwd", 100.0)
    assert t.time(0, "fwd") is None and t.times(0) is None and t.count(0, "fwd") == 1
    t.record(0, "fwd", 2.0)
    assert t.time(0, "fwd") == pytest.approx(2.0)   # bias correction: one kept sample is itself


def test_bias_corrected_moving_average():
    beta = 0.8
    t = LayerTimer(beta=beta)
    samples = [50.0, 2.0, 4.0, 3.0]
    for s in samples:
        t.record(3, "bwd", s)
    m = 0.0
    for s in samples[1:]:
        m = beta * m + (1 - beta) * s
    assert t.time(3, "bwd") == pytest.approx(m / (1 - beta ** 3))
    const = LayerTimer(beta=0.99)
    for _ in range(6):
        const.record(1, "recompute", 7.0)
    assert const.time(1, "recompute") == pytest.approx(7.0)   # no pull towards zero


def test_times_per_layer_and_kinds_are_separate():
    t = LayerTimer(warmup=0)
    t.record(2, "fwd", 1.0)
    t.record(2, "bwd", 3.0)
    t.record(5, "recompute", 2.0)
    assert t.times(2) == (pytest.approx(1.0), None, pytest.approx(3.0))
    assert t.times(5) == (None, pytest.approx(2.0), None)
    assert t.times(9) is None
    t.reset()
    assert t.times(2) is None and t.count(2, "fwd") == 0


def test_invalid_inputs():
    t = LayerTimer()
    with pytest.raises(ValueError, match="kind must be one of"):
        t.record(0, "forward", 1.0)
    with pytest.raises(ValueError, match="layer 0 fwd: time must be >= 0 ms"):
        t.record(0, "fwd", -1.0)
    with pytest.raises(ValueError, match="beta must be in"):
        LayerTimer(beta=1.0)
    with pytest.raises(ValueError, match="warmup must be >= 0"):
        LayerTimer(warmup=-1)


def test_measure_records_only_successful_bodies():
    t = LayerTimer(warmup=0)
    with t.measure(4, "fwd"):
        sum(range(1000))
    assert t.count(4, "fwd") == 1 and t.time(4, "fwd") >= 0.0
    with pytest.raises(RuntimeError):
        with t.measure(4, "fwd"):
            raise RuntimeError("boom")
    assert t.count(4, "fwd") == 1


def test_concurrent_records_are_all_counted():
    t = LayerTimer(warmup=0)

    def work():
        for _ in range(500):
            t.record(0, "fwd", 1.0)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert t.count(0, "fwd") == 2000 and t.time(0, "fwd") == pytest.approx(1.0)


def test_verbose_prints_each_measurement_to_stderr(capsys):
    t = LayerTimer()
    t.record(0, "fwd", 1.0)
    assert capsys.readouterr().err == ""
    verbose.set_verbose(True)
    t.record(0, "fwd", 1.0)
    t.record(1, "bwd", 2.5)
    err = capsys.readouterr().err
    assert "layer 0 fwd 1.000 ms (avg 1.000 ms)" in err
    assert "layer 1 bwd 2.500 ms (warm-up, dropped)" in err
    verbose.set_verbose(False)
    t.record(0, "fwd", 1.0)
    assert capsys.readouterr().err == ""


def test_env_var_is_read_lazily(monkeypatch, capsys):
    assert verbose.is_verbose() is False
    monkeypatch.setenv("FXPIPE_VERBOSE", "1")
    assert verbose.is_verbose() is True
    LayerTimer().record(7, "recompute", 0.5)
    assert "layer 7 recompute" in capsys.readouterr().err
    verbose.set_verbose(False)                     # an explicit call wins over the env var
    assert verbose.is_verbose() is False
    monkeypatch.setenv("FXPIPE_VERBOSE", "0")
    verbose.set_verbose(None)
    assert verbose.is_verbose() is False
    with pytest.raises(TypeError, match="set_verbose expects True, False or None"):
        verbose.set_verbose("yes")


def test_set_verbose_is_public():
    import fxpipe
    assert fxpipe.set_verbose is verbose.set_verbose


def test_runtime_measures_layer_times_into_costs_and_auto_uses_them(capsys):
    import torch.nn.functional as F

    import fxpipe
    from fxpipe.verbose import set_verbose
    from tests import models

    torch.manual_seed(0)
    model = models.GPT(depth=3).eval()
    ids, t = torch.randint(0, 64, (4, 8)), torch.randint(0, 64, (4, 8))
    pipe = fxpipe.compile(model, example_inputs=(ids,), devices=[fxpipe.VirtualDevice()] * 1,
                          config=fxpipe.RunConfig(num_microbatch=1))

    def step():
        pipe.forward_backward((ids,), label=t,
                              loss_fn=lambda o, y: F.cross_entropy(o.flatten(0, 1), y.flatten()))

    estimates = [layer.cost for layer in pipe.layers]
    assert all(c.fwd_ms is None for c in pipe.timings.costs(pipe.layers))
    step()  # first samples are warm-up, dropped
    assert all(c.bwd_ms is None for c in pipe.timings.costs(pipe.layers))
    set_verbose(True)
    try:
        step()
    finally:
        set_verbose(None)
    err = capsys.readouterr().err
    assert "fxpipe timer: layer 1 recompute" in err and "fxpipe timer: layer 1 bwd" in err
    measured = pipe.timings.costs(pipe.layers)
    for layer, c in zip(pipe.layers, measured):
        assert c.bwd_ms is not None and c.bwd_ms >= 0, layer.name
    assert all(c.recompute_ms > 0 and c.bwd_ms > 0 for c in measured[1:-1])
    # the layer chain an earlier pass made keeps its estimates: times live in the table
    assert [layer.cost for layer in pipe.layers] == estimates
    # measured times drive the planner: the plan follows when a block gets slower
    before = fxpipe.ExecutePlan.auto("fused", pipe, num_devices=2)
    for _ in range(50):
        for kind in ("fwd", "recompute", "bwd"):
            pipe.timings.record(1, kind, 1e4)
    after = fxpipe.ExecutePlan.auto("fused", pipe, num_devices=2)
    assert after != before
