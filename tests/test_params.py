"""Host parameter store: flat per-dtype uploads, refresh, gradients, tied params, buffers."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn as nn
from torch.func import functional_call

from fxpipe.errors import DeviceMemoryError
from fxpipe.runtime.devices import VirtualDevice
from fxpipe.runtime.params import GradAccumulator, ParamStore

TIMEOUT = 10.0
cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


class CountingDevice(VirtualDevice):
    """A VirtualDevice that records every host->device and device->host transfer."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.uploads: list[torch.Tensor] = []
        self.downloads: list[torch.Tensor] = []

    def to_device(self, host_tensor, kind, owner):
        self.uploads.append(host_tensor)
        return super().to_device(host_tensor, kind, owner)

    def to_host(self, dev_tensor, pin=True):
        self.downloads.append(dev_tensor)
        return super().to_host(dev_tensor, pin)

    def to_host_each(self, dev_tensors):
        self.downloads.append(dev_tensors)
        return super().to_host_each(dev_tensors)


@pytest.fixture
def dev():
    d = CountingDevice(name="vcpu:test")
    yield d
    d.close()


def _mixed_model() -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(5, 7), nn.BatchNorm1d(7), nn.Linear(7, 3))
    m[2].to(torch.bfloat16)
    return m


def _stage_dicts(m: nn.Module):
    params = {0: {k: v for k, v in m.named_parameters() if not k.startswith("2.")},
              1: {k: v for k, v in m.named_parameters() if k.startswith("2.")}}
    buffers = {0: dict(m.named_buffers())}
    return params, buffers


# --- upload ---------------------------------------------------------------------------

def test_upload_views_equal_master_one_transfer_per_dtype(dev):
    m = _mixed_model()
    m[0].weight.data[0, 0] = 0.5  # not all-random, to see the copy is of this tensor
    store = ParamStore(*_stage_dicts(m), pin=False)
    assert sorted(map(str, store.flat(0))) == ["torch.float32", "torch.int64"]
    assert list(store.flat(1)) == [torch.bfloat16]

    named = {**dict(m.named_parameters()), **dict(m.named_buffers())}
    for stage in (0, 1):
        dev.uploads.clear()
        up = store.upload(stage, dev)
        assert len(dev.uploads) == len(store.flat(stage))  # one transfer per dtype
        assert set(up) == {k for k in named if k.startswith("2.") == (stage == 1)}
        for fqn, view in up.items():
            assert torch.equal(view, named[fqn]) and view.dtype == named[fqn].dtype, fqn
            assert view.untyped_storage().data_ptr() != named[fqn].untyped_storage().data_ptr()
        by_dtype: dict[torch.dtype, set[int]] = {}
        for view in up.values():  # all views of one dtype share one device buffer
            by_dtype.setdefault(view.dtype, set()).add(view.untyped_storage().data_ptr())
        assert all(len(ptrs) == 1 for ptrs in by_dtype.values())
    assert dev.resident_bytes("params") == store.nbytes(0) + store.nbytes(1)


def test_flat_offsets_are_aligned_and_disjoint():
    params = {0: {"a": torch.ones(3), "b": torch.full((5,), 2.0), "c": torch.ones(2, dtype=torch.bfloat16)}}
    store = ParamStore(params, pin=False)
    flat = store.flat(0)[torch.float32]
    assert flat.numel() == 16 + 5  # "b" starts on the next 64-byte boundary
    assert torch.equal(flat[:3], torch.ones(3)) and torch.equal(flat[16:], torch.full((5,), 2.0))
    assert store.nbytes(0) == 21 * 4 + 2 * 2


def test_refresh_picks_up_in_place_master_updates(dev):
    lin = nn.Linear(3, 2)
    store = ParamStore({0: dict(lin.named_parameters())}, pin=False)
    with torch.no_grad():
        lin.weight.mul_(3)  # the user's optimizer step
    stale = store.upload(0, dev)
    assert not torch.equal(stale["weight"], lin.weight)
    store.refresh(0)
    fresh = store.upload(0, dev)
    assert torch.equal(fresh["weight"], lin.weight) and torch.equal(fresh["bias"], lin.bias)


def test_requires_grad_follows_master_and_buffers_never_require_grad(dev):
    m = _mixed_model()
    m[0].bias.requires_grad_(False)
    store = ParamStore(*_stage_dicts(m), pin=False)
    up = store.upload(0, dev, requires_grad=True)
    assert up["0.weight"].requires_grad and up["0.weight"].is_leaf
    assert not up["0.bias"].requires_grad
    assert not up["1.running_mean"].requires_grad
    assert not any(t.requires_grad for t in store.upload(0, dev).values())


def test_release_frees_each_flat_buffer_once(dev):
    store = ParamStore(*_stage_dicts(_mixed_model()), pin=False)
    up = store.upload(0, dev)
    assert dev.resident_bytes("params") == store.nbytes(0)
    store.release(dev, up)
    assert dev.resident_bytes() == 0


def test_upload_over_the_memory_limit_names_the_stage_and_counts_nothing():
    store = ParamStore({3: {"w": torch.zeros(40), "h": torch.zeros(100, dtype=torch.float64)}}, pin=False)
    with VirtualDevice(memory_limit=512) as d:
        with pytest.raises(DeviceMemoryError, match="800 B of params for stage 3"):
            store.upload(3, d)  # the float32 buffer fits, the float64 one does not
        assert d.resident_bytes() == 0


def test_masters_must_be_dense_host_tensors():
    with pytest.raises(ValueError, match=r"stage 2: 'w' .* on meta"):
        ParamStore({2: {"w": torch.empty(3, device="meta")}})
    with pytest.raises(TypeError, match="'w' must be a tensor"):
        ParamStore({0: {"w": [1.0]}})
    with pytest.raises(ValueError, match="both as a parameter and as a buffer"):
        t = torch.zeros(2)
        ParamStore({0: {"a": t}}, {0: {"b": t}})
    with pytest.raises(KeyError, match="no stage 9"):
        ParamStore({0: {"w": torch.zeros(1)}}).refresh(9)


# --- gradients ------------------------------------------------------------------------

def _pipelined_grads(m: nn.Module, x: torch.Tensor, store: ParamStore, dev) -> GradAccumulator:
    """Run ``m`` as two stages on ``dev`` with the store; return the filled accumulator."""
    up0 = store.upload(0, dev, requires_grad=True)
    up1 = store.upload(1, dev, requires_grad=True)
    h = functional_call(m[:2], {k: up0[k] for k in up0}, (x,))
    y = functional_call(m[2], {k[2:]: v for k, v in up1.items()}, (h.to(torch.bfloat16),))
    loss = y.float().square().mean()
    leaves0 = [k for k, v in up0.items() if v.requires_grad]
    grads = torch.autograd.grad(loss, [up0[k] for k in leaves0] + list(up1.values()))
    acc = GradAccumulator(store)
    acc.add(0, store.download_grads(0, dev, dict(zip(leaves0, grads))))
    acc.add(1, store.download_grads(1, dev, dict(zip(up1, grads[len(leaves0):]))))
    return acc


def _eager_grads(m: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    m[2](m[:2](x).to(torch.bfloat16)).float().square().mean().backward()
    return {k: p.grad.clone() for k, p in m.named_parameters()}


def test_download_is_one_transfer_per_dtype_and_commit_equals_eager(dev):
    m, ref = _mixed_model(), _mixed_model()
    x = torch.randn(8, 5)
    params, _ = _stage_dicts(m)
    store = ParamStore(params, pin=False)  # buffers aside here: eval-free comparison below
    m.eval(), ref.eval()
    acc = _pipelined_grads(m, x, store, dev)
    assert len(dev.downloads) == 2  # fp32 for stage 0, bf16 for stage 1
    assert all(p.grad is None for p in m.parameters())  # nothing written before commit
    acc.commit()
    expected = _eager_grads(ref, x)
    for k, p in m.named_parameters():
        assert p.grad.dtype == p.dtype and torch.equal(p.grad, expected[k]), k
    # a second call before zero_grad accumulates, as eager does
    _pipelined_grads(m, x, store, dev).commit()
    expected = _eager_grads(ref, x)
    for k, p in m.named_parameters():
        assert torch.equal(p.grad, expected[k]), k


def test_discard_leaves_grad_untouched(dev):
    m = _mixed_model().eval()
    m[0].weight.grad = torch.full_like(m[0].weight, 7.0)
    store = ParamStore(_stage_dicts(m)[0], pin=False)
    acc = _pipelined_grads(m, torch.randn(4, 5), store, dev)
    assert len(acc) == 6  # every parameter has a pending gradient
    acc.discard()
    acc.commit()  # nothing left to commit
    assert torch.equal(m[0].weight.grad, torch.full_like(m[0].weight, 7.0))
    assert all(p.grad is None for k, p in m.named_parameters() if k != "0.weight")


def test_tied_parameter_across_stages_sums_like_autograd(dev):
    torch.manual_seed(1)
    emb = nn.Embedding(11, 4)
    tokens = torch.tensor([[1, 2, 3, 9], [4, 4, 0, 10]])

    def model(w_in, w_out):  # embedding in stage 0, tied output projection in stage 1
        return (nn.functional.embedding(tokens, w_in) @ w_out.t()).logsumexp(-1).sum()

    model(emb.weight, emb.weight).backward()
    expected = emb.weight.grad.clone()
    emb.weight.grad = None

    store = ParamStore({0: {"embed.weight": emb.weight}, 1: {"head.weight": emb.weight}}, pin=False)
    w0 = store.upload(0, dev, requires_grad=True)["embed.weight"]
    w1 = store.upload(1, dev, requires_grad=True)["head.weight"]
    g0, g1 = torch.autograd.grad(model(w0, w1), [w0, w1])
    acc = GradAccumulator(store)
    acc.add(1, store.download_grads(1, dev, {"head.weight": g1}))
    acc.add(0, store.download_grads(0, dev, {"embed.weight": g0}))
    acc.commit()
    assert torch.allclose(emb.weight.grad, expected, rtol=0, atol=1e-6)
    assert torch.equal(emb.weight.grad, g0 + g1)


def test_tied_names_in_one_stage_share_one_slot(dev):
    w = nn.Parameter(torch.randn(3, 3))
    store = ParamStore({0: {"a.weight": w, "b.weight": w}}, pin=False)
    assert store.nbytes(0) == 9 * 4  # stored once
    up = store.upload(0, dev, requires_grad=True)
    assert up["a.weight"] is up["b.weight"]
    g = torch.ones(3, 3)
    with pytest.raises(ValueError, match="same \\(tied\\) parameter"):
        store.download_grads(0, dev, {"a.weight": g, "b.weight": g})
    acc = GradAccumulator(store)
    acc.add(0, store.download_grads(0, dev, {"b.weight": g}))
    acc.commit()
    assert torch.equal(w.grad, g) and len(acc) == 0
    acc.commit()  # committed sums are gone: nothing is added twice
    assert torch.equal(w.grad, g)


def test_download_grads_rejects_what_gets_no_gradient(dev):
    m = _mixed_model()
    m[0].bias.requires_grad_(False)
    store = ParamStore(*_stage_dicts(m), pin=False)
    with pytest.raises(ValueError, match="'1.running_mean': it is a buffer"):
        store.download_grads(0, dev, {"1.running_mean": torch.zeros(7)})
    with pytest.raises(ValueError, match="'0.bias': it is a frozen parameter"):
        store.download_grads(0, dev, {"0.bias": torch.zeros(7)})
    with pytest.raises(ValueError, match=r"shape \(7,\) torch.float32, the parameter \(7, 5\)"):
        store.download_grads(0, dev, {"0.weight": torch.zeros(7)})
    with pytest.raises(KeyError, match="stage 1 has no parameter or buffer '0.weight'"):
        store.download_grads(1, dev, {"0.weight": torch.zeros(7, 5)})
    assert store.download_grads(0, dev, {"0.weight": None}) == {}


def test_commit_checks_before_writing_anything():
    a, b = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(3))
    b.grad_dtype = None  # allow any .grad dtype ...
    b.grad = torch.zeros(3, dtype=torch.int64)  # ... so a float gradient cannot be added in place
    store = ParamStore({0: {"a": a, "b": b}}, pin=False)
    acc = GradAccumulator(store)
    acc.add(0, {"a": torch.ones(2), "b": torch.ones(3)})
    with pytest.raises(RuntimeError, match="nothing was written"):
        acc.commit()
    assert a.grad is None and torch.equal(b.grad, torch.zeros(3, dtype=torch.int64))


def test_commit_honours_grad_dtype(dev):
    lin = nn.Linear(4, 2).to(torch.bfloat16)
    lin.weight.grad_dtype = torch.float32  # bf16 weights, fp32 gradients
    x = torch.randn(3, 4, dtype=torch.bfloat16)
    expected = torch.autograd.grad(lin(x).float().sum(), [lin.weight])[0].float()
    store = ParamStore({0: dict(lin.named_parameters())}, pin=False)
    up = store.upload(0, dev, requires_grad=True)
    g = torch.autograd.grad(functional_call(lin, up, (x,)).float().sum(), [up["weight"]])
    acc = GradAccumulator(store)
    acc.add(0, store.download_grads(0, dev, {"weight": g[0]}))
    acc.commit()
    assert lin.weight.grad.dtype == torch.float32 and torch.equal(lin.weight.grad, expected)


def test_accumulator_owns_its_sums_and_keeps_param_layout():
    p = nn.Parameter(torch.zeros(4, 3).t())  # non-contiguous parameter
    store = ParamStore({0: {"p": p}}, pin=False)
    g = torch.ones(3, 4)
    acc = GradAccumulator(store)
    acc.add(0, {"p": g})
    g.fill_(100)  # the download buffer is reused: the sum must not change
    acc.commit()
    assert torch.equal(p.grad, torch.ones(3, 4)) and p.grad.stride() == p.stride()


def test_accumulator_is_thread_safe():
    p = nn.Parameter(torch.zeros(1000))
    store = ParamStore({s: {"p": p} for s in range(4)}, pin=False)
    acc = GradAccumulator(store)
    threads = [threading.Thread(target=lambda s=s: [acc.add(s, {"p": torch.ones(1000)}) for _ in range(50)])
               for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    acc.commit()
    assert torch.equal(p.grad, torch.full((1000,), 200.0))



def test_buffer_write_back_matches_eager_batchnorm(dev):
    m, ref = _mixed_model(), _mixed_model()
    x = torch.randn(8, 5)
    params, buffers = _stage_dicts(m)
    store = ParamStore(params, buffers, pin=False)
    before = {k: v.clone() for k, v in m.named_buffers()}
    up = store.upload(0, dev)
    functional_call(m[:2], up, (x,))  # train mode: BatchNorm updates the device buffers
    assert not torch.equal(up["1.running_mean"], before["1.running_mean"])
    assert all(torch.equal(v, before[k]) for k, v in m.named_buffers())  # model untouched so far
    store.write_back_buffers(0, {k: up[k] for k in buffers[0]})
    ref[:2](x)
    for k, v in ref.named_buffers():
        assert torch.equal(dict(m.named_buffers())[k], v), k
    assert int(m[1].num_batches_tracked) == 1
    with pytest.raises(ValueError, match="'0.weight' is a parameter, not a buffer"):
        store.write_back_buffers(0, {"0.weight": up["0.weight"]})
    with pytest.raises(ValueError, match="came back with shape"):
        store.write_back_buffers(0, {"1.running_mean": torch.zeros(7), "1.running_var": torch.zeros(2)})
    assert torch.equal(m[1].running_mean, ref[1].running_mean)  # checked before writing


# --- on the device's streams ----------------------------------------------------------

def test_stage_job_on_streams(dev):
    """h2d upload -> compute (forward + grads) -> d2h download, the executor's pattern."""
    lin = nn.Linear(6, 6)
    store = ParamStore({0: dict(lin.named_parameters())}, pin=False)
    x = torch.randn(3, 6)
    up = dev.submit("h2d", lambda: store.upload(0, dev, requires_grad=True), label="H2D s0")
    grads = dev.submit("compute", lambda: dict(zip(up.value(), torch.autograd.grad(
        functional_call(lin, up.value(), (x,)).sum(), list(up.value().values())))), wait=[up])
    host = dev.submit("d2h", lambda: store.download_grads(0, dev, grads.value()), wait=[grads])
    acc = GradAccumulator(store)
    acc.add(0, host.result(TIMEOUT))
    acc.commit()
    expected = torch.autograd.grad(lin(x).sum(), [lin.weight, lin.bias])
    assert torch.equal(lin.weight.grad, expected[0]) and torch.equal(lin.bias.grad, expected[1])


@cuda_only
def test_cuda_round_trip_with_pinned_flat_buffers():
    from fxpipe.runtime.devices import CudaDevice

    m = _mixed_model()
    params, buffers = _stage_dicts(m)
    store = ParamStore(params, buffers)
    assert all(t.is_pinned() for s in store.stages for t in store.flat(s).values())
    with CudaDevice(0) as d:
        up = d.submit("h2d", store.upload, 0, d, label="H2D s0")
        grads = d.submit("compute", lambda: {k: torch.full_like(v, 2.0) for k, v in up.value().items()
                                             if k.endswith("weight")}, wait=[up])
        back = d.submit("d2h", lambda: store.download_grads(0, d, grads.value()), wait=[grads])
        host_grads = back.result(TIMEOUT)
        assert set(host_grads) == {"0.weight", "1.weight"}
        for g in host_grads.values():
            assert g.device.type == "cpu" and torch.equal(g, torch.full_like(g, 2.0))
        views = up.result(TIMEOUT)
        assert all(v.is_cuda for v in views.values())
        for k, v in views.items():
            assert torch.equal(v.cpu(), m.state_dict()[k]), k
        store.release(d, views)
        assert d.resident_bytes() == 0


def test_refresh_copies_only_changed_masters_and_sees_every_kind_of_update():
    a, b = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2))
    store = ParamStore({0: {"a": a, "b": b}}, pin=False)
    dev = VirtualDevice()
    with torch.no_grad():
        a.add_(1.0)                      # an optimizer-style in-place step
    store.refresh()
    b.data = torch.full((2,), 5.0)       # storage swapped under the parameter
    store.refresh()
    up = store.upload(0, dev)
    assert torch.equal(up["a"], torch.ones(3)) and torch.equal(up["b"], torch.full((2,), 5.0))
    store.release(dev, up)
    dev.close()


def test_accumulator_keeps_owned_gradients_without_copying():
    p, q, r = nn.Parameter(torch.zeros(16)), nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(4))
    store = ParamStore({0: {"p": p, "q": q, "r": r}, 1: {"p": p}}, pin=False)
    flat = torch.arange(16 + 3 + 4 + 16, dtype=torch.float32)
    gp, gq, gr, gp1 = flat[:16], flat[16:19], flat[19:23], flat[23:]
    acc = GradAccumulator(store)
    acc.add(0, {"p": gp, "q": gq, "r": gr}, own=True)
    acc.add(1, {"p": gp1}, own=True)  # tied: adds into the kept sum
    acc.commit()
    assert p.grad.data_ptr() == gp.data_ptr()  # kept, not copied
    assert torch.equal(p.grad, torch.arange(16.0) + torch.arange(23.0, 39.0))
    assert q.grad.data_ptr() == gq.data_ptr()  # 64 B in: aligned, kept
    assert r.grad.data_ptr() != gr.data_ptr() and torch.equal(r.grad, gr)  # 76 B in: copied
    # without own=True the caller's tensors are never kept
    w = nn.Parameter(torch.zeros(16))
    acc = GradAccumulator(ParamStore({0: {"w": w}}, pin=False))
    given = torch.ones(16)
    acc.add(0, {"w": given})
    acc.commit()
    assert w.grad.data_ptr() != given.data_ptr() and torch.equal(w.grad, given)
