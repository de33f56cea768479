"""Every byte a virtual device's work allocates is counted: intermediates, saved tensors,
gradients, workspace, not only the copies the runtime makes; the limit holds on that total."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn as nn

import fxpipe
from tests.models import MLPBlock

MiB = 2**20


def activation_heavy(limit: int | None):
    """4 blocks of x + W2 gelu(W1 x), d = 64, input 8 x 4096 x 64: one microbatch's 4d
    intermediate alone is 16 MiB."""
    torch.manual_seed(0)
    model = nn.Sequential(*[MLPBlock(64) for _ in range(4)])
    x = torch.randn(8, 4096, 64)
    devs = [fxpipe.VirtualDevice(memory_limit=limit) for _ in range(2)]
    plan = fxpipe.ExecutePlan([range(0, 2), range(2, 3)], [range(3, 4), range(2, 3), range(0, 2)])
    pipe = fxpipe.compile(model, example_inputs=(x,), devices=devs, plan=plan,
                          config=fxpipe.RunConfig(num_microbatch=2))
    return model, pipe, x


def test_the_activation_heavy_case_is_refused_under_30_mib():
    model, pipe, x = activation_heavy(30 * MiB)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(fxpipe.DeviceMemoryError) as info:
        pipe.forward_backward((x,), loss_fn=lambda out, _: out.square().mean())
    assert "exceeds the memory limit" in str(info.value)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert all(p.grad is None for p in model.parameters())
    assert all(d.resident_bytes() == 0 for d in pipe.devices)


def test_a_generous_limit_runs_and_the_peak_covers_the_intermediates():
    model, pipe, x = activation_heavy(2**31)
    for d in pipe.devices:
        d.reset_peak()
    pipe.forward_backward((x,), loss_fn=lambda out, _: out.square().mean())
    intermediate = 4 * 4096 * 256 * 4           # one microbatch's 4d hidden state: 16 MiB
    peaks = [d.peak_bytes() for d in pipe.devices]
    assert max(peaks) >= 2 * intermediate       # gelu's input and output of a block, at least
    for kind in ("params", "activations", "saved", "gradients", "workspace"):
        assert max(d.peak_bytes(kind) for d in pipe.devices) > 0, kind
    assert max(d.peak_bytes("saved") for d in pipe.devices) >= intermediate
    assert all(d.resident_bytes() == 0 for d in pipe.devices)


def test_the_message_names_the_action_and_bytes_by_kind():
    model, pipe, x = activation_heavy(30 * MiB)
    with pytest.raises(fxpipe.DeviceMemoryError) as info:
        pipe.forward_backward((x,), loss_fn=lambda out, _: out.square().mean())
    message = str(info.value)
    # the action that allocated, its stage and microbatch, and what is resident by kind
    assert re.search(r"\d+(F|B|FB)\d \(stage \d, microbatch \d\) allocated \d+ B of \w+", message), message
    assert re.search(r"resident \(params \d+ B, .*activations \d+ B", message), message
