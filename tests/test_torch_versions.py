"""fxpipe on the torch of the GPU machines (2.11) as well as CI's (2.13): where the newer
one added an API, fxpipe falls back to what the older one has. Each test takes the newer
API away and checks the fallback runs (on 2.11 they run as they are)."""

from __future__ import annotations

import types

import torch
import torch.distributed as dist
import torch.nn as nn

from fxpipe.passes.capture import _stack_traces_verbose_only, capture
from fxpipe.runtime.issue import device_collectives


def test_capture_without_fx_configs_stack_trace_switch(monkeypatch):
    """torch 2.11's ``torch.fx.config`` has no ``do_not_emit_stack_traces``: capture by
    export ran into an AttributeError there and fell back to running the model eagerly.
    (2.13's export reads the switch itself: the older config is stood in around the
    switch alone.)"""
    real = torch.fx.config
    if hasattr(real, "do_not_emit_stack_traces"):
        before = real.do_not_emit_stack_traces
        with _stack_traces_verbose_only():
            assert real.do_not_emit_stack_traces is True   # not verbose: no stack traces
        assert real.do_not_emit_stack_traces is before
    older = types.SimpleNamespace()
    monkeypatch.setattr(torch.fx, "config", older)
    with _stack_traces_verbose_only():
        pass
    assert vars(older) == {}
    monkeypatch.undo()
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    x = torch.randn(3, 4)
    assert capture(model, (x,), method="export").meta["capture"] == "export"


def test_collectives_without_the_single_names(monkeypatch):
    """torch 2.11 has ``reduce_scatter_tensor`` / ``all_gather_into_tensor`` only (2.13
    adds ``*_single`` and deprecates those)."""
    calls = []
    for name in ("reduce_scatter_single", "all_gather_single"):
        monkeypatch.delattr(dist, name, raising=False)
    for name in ("reduce_scatter_tensor", "all_gather_into_tensor"):
        monkeypatch.setattr(dist, name, lambda out, t, group, async_op, _n=name:
                            calls.append((_n, out, t, group, async_op)) or "work")
    a, b = torch.zeros(2), torch.ones(4)
    assert device_collectives.issue("reduce_scatter", b, a, "g") == "work"
    assert device_collectives.issue("all_gather", a, b, "g") == "work"
    assert [(c[0], c[1] is x, c[2] is y, c[3], c[4]) for c, (x, y) in zip(calls, [(a, b), (b, a)])] \
        == [("reduce_scatter_tensor", True, True, "g", True),
            ("all_gather_into_tensor", True, True, "g", True)]
