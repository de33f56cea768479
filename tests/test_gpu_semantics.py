"""GPU semantics on CPU: ``VirtualDevice(semantics="cuda")`` behaves as a GPU does toward the
host, the runtime issues each device from its own thread, and ``pipe.stats()`` counts what
would cost on a GPU (host waits, bytes moved by kind)."""

from __future__ import annotations

import copy
import math
import threading

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxpipe
from fxpipe.runtime import executor
from fxpipe.runtime.devices import VirtualDevice
from tests import models
from tests.test_runtime import ce, train_step


def cuda_devices(n: int, **kw) -> list[VirtualDevice]:
    return [VirtualDevice(semantics="cuda", **kw) for _ in range(n)]


# -- the device ---------------------------------------------------------------------------

def test_device_to_host_copy_lands_when_the_stream_reaches_it():
    d = VirtualDevice(semantics="cuda")
    x = d.to_device(torch.arange(4.0), kind="activations", owner="test")
    seen = {}

    def offload():
        host = d.to_host(x)
        seen["at issue"] = host.clone()       # the host reads it before the copy ran
        return host

    ev = d.submit("d2h", offload)
    assert torch.equal(ev.result(), torch.arange(4.0))   # after the event: landed
    assert torch.isnan(seen["at issue"]).all()
    d.close()


def test_host_to_device_copy_reads_its_source_when_performed():
    d = VirtualDevice(semantics="cuda")
    src = torch.zeros(3)
    gate = threading.Event()
    blocker = d.submit("h2d", gate.wait)                  # the stream is busy until gate
    up = d.submit("h2d", lambda: d.to_device(src, kind="activations", owner="test"))
    src.fill_(7.0)                                       # a host write before the copy ran
    gate.set()
    assert torch.equal(up.result(), torch.full((3,), 7.0)) and blocker.result()
    d.close()


def test_sync_semantics_copy_at_once_and_bad_semantics_is_refused():
    d = VirtualDevice(semantics="sync")
    host = d.submit("d2h", lambda: d.to_host(d.to_device(torch.ones(2), "activations", "t")))
    assert torch.equal(host.result(), torch.ones(2))
    with pytest.raises(ValueError, match="semantics must be one of"):
        VirtualDevice(semantics="gpu")
    d.close()


def test_integer_copies_show_unwritten_memory_too():
    d = VirtualDevice(semantics="cuda")
    x = d.to_device(torch.arange(3), kind="activations", owner="test")
    early = []
    done = d.submit("d2h", lambda: early.append(d.to_host(x).clone()) or None)
    done.result()
    assert (early[0] == torch.iinfo(torch.int64).min).all()
    d.close()


def test_freed_memory_is_reused_only_after_every_stream_passed_the_free():
    """``record_stream``: a copy freed on one stream while another stream may still read
    it keeps its memory until that stream's queued work has run."""
    d = VirtualDevice(semantics="cuda")
    gate = threading.Event()
    x = d.to_device(torch.ones(8), kind="activations", owner="test")
    reader = d.submit("compute", lambda: (gate.wait(), x.sum().item())[1])  # still to read x
    d.free(x)
    y = d.to_device(torch.zeros(8), kind="activations", owner="test")  # must not reuse x's memory
    assert y.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
    gate.set()
    assert reader.result() == 8.0
    d.close()


# -- the runtime on it ---------------------------------------------------------------------

PLAN = fxpipe.ExecutePlan(fwd_plan=[range(0, 3), range(3, 5)],
                          bwd_plan=[range(5, 6), range(3, 5), range(1, 3), range(0, 1)])


def gpt_pair(num_devices: int, semantics: str = "cuda", grain: str = "stage", M: int = 3):
    torch.manual_seed(0)
    model = models.GPT(depth=4).eval()
    ref = copy.deepcopy(model)
    devs = [VirtualDevice(semantics=semantics) for _ in range(num_devices)]
    pipe = fxpipe.compile(model, example_inputs=(torch.randint(0, 64, (6, 8)),), devices=devs,
                          plan=PLAN, config=fxpipe.RunConfig(num_microbatch=M,
                                                             recompute_grain=grain))
    return model, ref, pipe


def batch():
    torch.manual_seed(1)
    return torch.randint(0, 64, (6, 8)), torch.randint(0, 64, (6, 8))


def assert_grads_close(model, ref):
    for (n, p), r in zip(model.named_parameters(), ref.parameters()):
        assert (p.grad is None) == (r.grad is None), n
        if p.grad is not None:
            torch.testing.assert_close(p.grad, r.grad, atol=2e-6, rtol=1e-5, msg=n)


@pytest.mark.parametrize("num_devices", [1, 2, 3])
@pytest.mark.parametrize("style", ["fused", "eager"])
@pytest.mark.parametrize("grain", ["stage", "layer"])
def test_training_on_cuda_semantics_equals_eager(num_devices, style, grain):
    model, ref, pipe = gpt_pair(num_devices, grain=grain)
    ids, y = batch()
    loss = train_step(pipe, style, ids, y)
    ref_loss = ce(ref(ids), y)
    ref_loss.backward()
    torch.testing.assert_close(loss.detach(), ref_loss.detach())
    assert_grads_close(model, ref)


def _plant_early_host_read(monkeypatch):
    """The planted bug: the host copies each offloaded value as soon as the Offload is
    issued, without waiting for its event (what `_offload` then `prev + g` on the host
    did before)."""
    put = executor._OnHost.put

    def put_read_now(self, m, name, value):
        if isinstance(value, torch.Tensor):
            value = value.clone()        # reads memory the copy may not have written yet
        put(self, m, name, value)

    monkeypatch.setattr(executor._OnHost, "put", put_read_now)


@pytest.mark.parametrize("semantics", ["sync", "cuda"])
def test_a_planted_early_host_read_is_caught_only_with_cuda_semantics(monkeypatch, semantics):
    model, ref, pipe = gpt_pair(2, semantics=semantics)
    ids, y = batch()
    _plant_early_host_read(monkeypatch)
    loss = pipe.forward_backward((ids,), label=y, loss_fn=ce)
    ref_loss = ce(ref(ids), y)
    if semantics == "sync":   # copies are done when they return: the bug is invisible
        torch.testing.assert_close(loss, ref_loss.detach())
    else:                     # as on a GPU: the host read unwritten memory
        assert math.isnan(loss.item())


def test_stats_one_host_wait_per_fused_call_and_no_reuploads():
    model, ref, pipe = gpt_pair(2)
    ids, y = batch()
    pipe.forward_backward((ids,), label=y, loss_fn=ce)
    stats = pipe.stats()
    for key in ("host_waits", "actions", "h2d_bytes_params", "h2d_bytes_activations",
                "d2h_bytes_activations", "d2h_bytes_grads", "interpreted_nodes",
                "generated_runs"):
        assert isinstance(stats[key], int), key
    assert stats["host_waits"] == 1           # the end of the call, nothing inside
    program = pipe.program("fused", 3)
    assert stats["actions"] == sum(len(acts) for _, acts in program.lanes())
    exe = pipe._executable("fused", 3)
    store = pipe._current.runners[fxpipe.api.plan_key(pipe.plan)].store(exe)
    # each stage's parameters go up once per stage job: no re-uploads
    assert stats["h2d_bytes_params"] == sum(store.nbytes(s) for s in exe.stages)
    grads = sum(p.numel() * p.element_size() for p in model.parameters())
    tied = model.head.weight.numel() * 4 if model.head.weight is model.embed.weight else 0
    assert stats["d2h_bytes_grads"] == grads + tied   # a tied weight comes from both stages
    assert stats["h2d_bytes_activations"] > 0 and stats["d2h_bytes_activations"] > 0


def test_stats_count_host_waits_of_host_actions():
    model, ref, pipe = gpt_pair(2)
    ids, y = batch()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    pipe.forward_backward((ids,), label=y, loss_fn=ce, optimizer=opt)
    steps = len(pipe.program("fused", 3, optimizer=True).host) - 1
    assert pipe.stats()["host_waits"] == steps + 1   # each step waits for its downloads


def test_stages_run_as_generated_code_unless_timed_or_skipping_a_tail():
    from tests.test_recompute import Block   # x + down(gelu(up(x))): a linear tail to skip
    torch.manual_seed(0)
    model = nn.Sequential(*[Block(16) for _ in range(4)])
    x, y = torch.randn(4, 6, 16), torch.randn(4, 6, 16)
    pipe = fxpipe.compile(model, example_inputs=(x,), devices=cuda_devices(2),
                          plan=fxpipe.ExecutePlan([range(0, 2)], [range(2, 4), range(0, 2)]),
                          config=fxpipe.RunConfig(num_microbatch=2))
    pipe.timings.first, pipe.timings.every = 0, 10**9   # never sample: no per-layer timing
    with torch.no_grad():
        pipe(x)
    stats = pipe.stats()
    assert stats["interpreted_nodes"] == 0 and stats["generated_runs"] == 2 * 2  # stages x mbs
    pipe.forward_backward((x,), label=y, loss_fn=F.mse_loss)
    stats = pipe.stats()
    # the forward and the fused stage as code; the backward stage, recomputed without
    # its tail, node by node
    assert stats["generated_runs"] == 2 * 2
    bwd = pipe._executable("fused", 2).stages[2]
    assert bwd.tail and stats["interpreted_nodes"] == 2 * len(bwd.gm.graph.nodes)
    pipe.timings.every = 1                               # every call timed: node by node
    pipe.forward_backward((x,), label=y, loss_fn=F.mse_loss)
    assert pipe.stats()["generated_runs"] == 0


def test_issue_threads_one_per_device(monkeypatch):
    """Each device's actions are submitted by one thread of its own (and none by the
    caller's): with 3 devices, three issue threads."""
    model, ref, pipe = gpt_pair(3)
    ids, y = batch()
    issuers: dict[int, set[str]] = {}
    for d, dev in enumerate(pipe.devices):
        submit = dev.submit

        def spy(*args, _d=d, _submit=submit, **kwargs):
            issuers.setdefault(_d, set()).add(threading.current_thread().name)
            return _submit(*args, **kwargs)
        monkeypatch.setattr(dev, "submit", spy)
    pipe.forward_backward((ids,), label=y, loss_fn=ce)
    assert {d: len(names) for d, names in issuers.items()} == {0: 1, 1: 1, 2: 1}
    names = set().union(*issuers.values())
    assert len(names) == 3 and threading.current_thread().name not in names
