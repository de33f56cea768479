"""Host parameters: one flat buffer per dtype holding the model's tensors as views, stages as
slices of it, re-aliasing, upload copies, and gradients written into one flat buffer."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn as nn
from torch.func import functional_call

from fxpipe.errors import DeviceMemoryError
from fxpipe.runtime.devices.emulator import VirtualDevice
from fxpipe.runtime.host.grad_accum import GradAccumulator
from fxpipe.runtime.host.param_store import ParamStore
from fxpipe.runtime.host.params import HostParams

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

    def copy_to_host(self, dev_tensor, out):
        self.downloads.append(dev_tensor)
        return super().copy_to_host(dev_tensor, out)


@pytest.fixture
def dev():
    # these tests drive a ParamStore directly, outside any device work: copies at once
    # (strict cuda-sim refuses a device op outside submit, as a GPU would misplace it)
    d = CountingDevice(name="vcpu:test", semantics="sync")
    yield d
    d.close()


def _mixed_model() -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(5, 7), nn.BatchNorm1d(7), nn.Linear(7, 3))
    m[2].to(torch.bfloat16)
    return m


def _store(m: nn.Module, **kw) -> ParamStore:
    """Two stages: layers 0-1 (fp32 + BatchNorm buffers), layer 2 (bf16)."""
    params = {0: {k: v for k, v in m.named_parameters() if not k.startswith("2.")},
              1: {k: v for k, v in m.named_parameters() if k.startswith("2.")}}
    return ParamStore(HostParams.of(m, pin=False), params, {0: dict(m.named_buffers())}, **kw)


def _storages(tensors) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors}


# --- one host copy ----------------------------------------------------------------------

def test_the_model_becomes_views_of_one_buffer_per_dtype():
    """One flat buffer per dtype, parameters apart from buffers (``param_dtype`` casts
    the parameters' upload copy only)."""
    m = _mixed_model()
    objects = {n: (id(p), p.detach().clone(), p.requires_grad) for n, p in m.named_parameters()}
    state = {k: v.clone() for k, v in m.state_dict().items()}
    _store(m)
    fp32 = [p for p in m.parameters() if p.dtype == torch.float32]
    stats = [b for b in m.buffers() if b.dtype == torch.float32]
    assert len(_storages(fp32)) == 1                       # weights, biases
    assert len(_storages(stats)) == 1 and _storages(stats) != _storages(fp32)   # BN stats
    assert len(_storages(m[2].parameters())) == 1 and _storages(m[2].parameters()) != _storages(fp32)
    for n, p in m.named_parameters():                      # the same Parameter objects
        assert (id(p), p.requires_grad) == (objects[n][0], objects[n][2])
        assert torch.equal(p, objects[n][1]), n
    assert all(torch.equal(v, state[k]) for k, v in m.state_dict().items())
    host = HostParams.of(m)
    assert sum(t.numel() * t.element_size() for t in host.flats) < 2 * sum(
        t.numel() * t.element_size() for t in (*m.parameters(), *m.buffers()))  # once, + padding


def test_layout_is_layer_order_with_shared_tensors_first():
    torch.manual_seed(0)
    embed = nn.Embedding(10, 4)
    blocks = [nn.Linear(4, 4) for _ in range(3)]
    head = nn.Linear(4, 10, bias=False)
    head.weight = embed.weight                            # tied: used by the first and last
    model = nn.ModuleList([embed, *blocks, head])
    layers = [{"e": embed.weight}, *[dict(b.named_parameters()) for b in blocks], {"h": head.weight}]
    store = ParamStore(HostParams.of(model, pin=False), dict(enumerate(layers)))
    host = store.host
    offsets = [host.slot(t).offset for t in (embed.weight, *[p for b in blocks for p in b.parameters()])]
    assert offsets == sorted(offsets) and offsets[0] == 0   # the tied weight first
    for s in (1, 2, 3):                                   # a block: one contiguous run
        assert len(store._runs_of(s)) == 1
    both = ParamStore(host, {0: {**dict(blocks[0].named_parameters()),
                                 **dict(blocks[1].named_parameters())}})
    assert len(both._runs_of(0)) == 1                     # adjacent layers: still one run
    assert len(ParamStore(host, {0: {"w": blocks[1].weight, "h": head.weight}})._runs_of(0)) == 2


def test_upload_is_one_transfer_per_run_and_views_equal_the_masters(dev):
    m = _mixed_model()
    store = _store(m)
    # stage 0: fp32 parameters, BatchNorm's fp32 statistics and its int64 counter
    for stage, runs in ((0, 3), (1, 1)):
        n = len(dev.uploads)
        up = store.upload(stage, dev)
        assert len(dev.uploads) - n == len(store._runs_of(stage)) == runs
        for k, v in up.items():
            assert torch.equal(v, dict(m.state_dict())[k]), k
        assert all(v.untyped_storage().data_ptr() not in _storages(m.parameters()) for v in up.values())
        store.release(dev, up)
    assert dev.resident_bytes() == 0
    assert store.nbytes(1) == (32 + 3) * 2   # bf16: 21 weights, padded to 64 bytes, 3 biases
    with pytest.raises(KeyError, match="no stage 9"):
        store.upload(9, dev)


def test_requires_grad_follows_master_and_buffers_never_require_grad(dev):
    m = _mixed_model()
    m[0].bias.requires_grad_(False)
    up = _store(m).upload(0, dev, requires_grad=True)
    assert up["0.weight"].requires_grad and up["0.weight"].is_leaf
    assert not up["0.bias"].requires_grad and not up["1.running_mean"].requires_grad


def test_upload_over_the_memory_limit_names_the_stage_and_counts_nothing():
    m = _mixed_model()
    with VirtualDevice(memory_limit=16, semantics="sync") as d:
        with pytest.raises(DeviceMemoryError, match="stage 0"):
            _store(m).upload(0, d)
        assert d.resident_bytes() == 0


def test_masters_must_be_dense_host_tensors():
    with pytest.raises(ValueError, match="meta"):
        meta = nn.Linear(2, 2, device="meta")
        ParamStore(HostParams.of(meta, pin=False), {0: dict(meta.named_parameters())})
    with pytest.raises(ValueError, match="both as a parameter and as a buffer"):
        t = torch.zeros(2)
        ParamStore(HostParams.of(nn.Module(), pin=False), {0: {"a": t}}, {1: {"b": t}})


def test_a_tensor_sharing_memory_with_another_stays_where_it_is(dev):
    base = torch.arange(8.0)
    a, b = nn.Parameter(base[:4]), nn.Parameter(base[4:])  # views of one tensor
    holder = nn.ParameterList([a, b])
    store = ParamStore(HostParams.of(holder, pin=False), {0: {"a": a, "b": b}})
    assert a.data_ptr() == base.data_ptr()                # not moved: the sharing is kept
    up = store.upload(0, dev)
    assert torch.equal(up["a"], base[:4]) and torch.equal(up["b"], base[4:])


# --- refresh ----------------------------------------------------------------------------

def test_p_data_assignment_is_copied_in_and_re_aliased(dev):
    m = _mixed_model()
    store = _store(m)
    flat = _storages([m[0].weight])
    m[0].weight.data = torch.full((7, 5), 3.0)             # the user breaks the alias
    assert _storages([m[0].weight]) != flat
    store.refresh()
    assert _storages([m[0].weight]) == flat and torch.equal(m[0].weight, torch.full((7, 5), 3.0))
    assert torch.equal(store.upload(0, dev)["0.weight"], torch.full((7, 5), 3.0))
    m[0].weight.data = torch.zeros(2, 2)
    with pytest.raises(ValueError, match="replaced by a tensor of"):
        store.refresh()


def test_mixed_precision_uploads_a_bf16_copy_kept_up_to_date(dev):
    m = _mixed_model()
    store = _store(m, param_dtype=torch.bfloat16)
    store.refresh()
    up = store.upload(0, dev)
    assert up["0.weight"].dtype == torch.bfloat16 and up["1.num_batches_tracked"].dtype == torch.int64
    assert m[0].weight.dtype == torch.float32              # the masters stay fp32
    with torch.no_grad():
        m[0].weight.add_(1.0)                              # an optimizer step
    store.refresh()
    assert torch.equal(store.upload(0, dev)["0.weight"], m[0].weight.to(torch.bfloat16))


def test_snapshot_uploads_do_not_see_later_updates(dev):
    m = _mixed_model()
    store = _store(m)
    store.snapshot = True
    store.refresh()
    before = m[0].weight.detach().clone()
    with torch.no_grad():
        m[0].weight.add_(1.0)                              # an async update during the call
    assert torch.equal(store.upload(0, dev)["0.weight"], before)
    store.refresh()                                        # the next call sees it
    assert torch.equal(store.upload(0, dev)["0.weight"], m[0].weight)


# --- gradients --------------------------------------------------------------------------

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
    acc.add(0, store.download_grads(0, dev, dict(zip(leaves0, grads)), acc), own=True)
    acc.add(1, store.download_grads(1, dev, dict(zip(up1, grads[len(leaves0):])), acc), own=True)
    return acc


def _eager_grads(m: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    m[2](m[:2](x).to(torch.bfloat16)).float().square().mean().backward()
    return {k: p.grad.clone() for k, p in m.named_parameters()}


def test_gradients_land_in_one_flat_buffer_and_equal_eager(dev):
    m, ref = _mixed_model(), _mixed_model()
    m.eval(), ref.eval()
    x = torch.randn(8, 5)
    store = _store(m)
    acc = _pipelined_grads(m, x, store, dev)
    assert all(p.grad is None for p in m.parameters())     # nothing before the commit
    acc.commit()
    want = _eager_grads(ref, x)
    for k, p in m.named_parameters():
        assert torch.equal(p.grad, want[k]), k
    assert len(_storages(p.grad for p in m[:2].parameters())) == 1  # views of one buffer
    host = store.host
    assert all(host.slot(p).grad is not None for p in m.parameters())
    assert not any(host.slot(b).grad for b in m.buffers())  # buffers get no gradient slot


def test_frozen_parameters_get_no_gradient_memory(dev):
    m = _mixed_model()
    for p in m[0].parameters():
        p.requires_grad_(False)
    store = _store(m)
    acc = _pipelined_grads(m.eval(), torch.randn(8, 5), store, dev)
    acc.commit()
    assert m[0].weight.grad is None
    grad_bytes = sum(t.numel() * t.element_size() for t in store.host.grad_flats)
    trainable = sum(p.numel() * p.element_size() for p in m.parameters() if p.requires_grad)
    assert grad_bytes < trainable + 64 * 4                 # padding only beyond the trainable


def test_accumulating_calls_add_in_place_and_a_failed_call_changes_nothing(dev):
    m, ref = _mixed_model(), _mixed_model()
    m.eval(), ref.eval()
    x = torch.randn(8, 5)
    store = _store(m)
    _pipelined_grads(m, x, store, dev).commit()
    held = {k: p.grad for k, p in m.named_parameters()}
    _pipelined_grads(m, x, store, dev).commit()
    _eager_grads(ref, x)
    want = _eager_grads(ref, x)
    for k, p in m.named_parameters():
        assert p.grad is held[k] and torch.allclose(p.grad, want[k]), k
    before = {k: p.grad.clone() for k, p in m.named_parameters()}
    _pipelined_grads(m, x, store, dev).discard()           # a failed call
    assert all(torch.equal(p.grad, before[k]) for k, p in m.named_parameters())


def test_a_discarded_call_leaves_none_and_a_held_old_grad_is_never_overwritten(dev):
    m = _mixed_model().eval()
    x = torch.randn(8, 5)
    store = _store(m)
    _pipelined_grads(m, x, store, dev).discard()
    assert all(p.grad is None for p in m.parameters())
    _pipelined_grads(m, x, store, dev).commit()
    kept = m[0].weight.grad                                # the user keeps last step's gradient
    copy = kept.clone()
    m.zero_grad(set_to_none=True)
    _pipelined_grads(m, 2 * x, store, dev).commit()
    assert torch.equal(kept, copy)                         # its memory was not written again
    assert m[0].weight.grad is not kept
    del kept
    m.zero_grad(set_to_none=True)
    _pipelined_grads(m, x, store, dev).commit()            # nobody holds it: the flat slot again
    assert _storages([m[0].weight.grad]) == _storages([m[0].bias.grad])


def test_tied_parameter_across_stages_sums_like_autograd(dev):
    w = nn.Parameter(torch.randn(3, 3))
    holder = nn.ParameterList([w])
    store = ParamStore(HostParams.of(holder, pin=False), {0: {"embed": w}, 1: {"head": w}})
    g0, g1 = torch.randn(3, 3), torch.randn(3, 3)
    acc = GradAccumulator(store)
    first = store.download_grads(1, dev, {"head": g1}, acc)   # the deeper stage first
    second = store.download_grads(0, dev, {"embed": g0}, acc)
    acc.add(0, second, own=True)
    acc.add(1, first, own=True)
    acc.commit()
    assert torch.allclose(w.grad, g0 + g1)
    assert _storages([w.grad]) == _storages(store.host.grad_flats)  # the sum is the flat view


def test_download_grads_rejects_what_gets_no_gradient(dev):
    m = _mixed_model()
    m[0].bias.requires_grad_(False)
    store = _store(m)
    with pytest.raises(ValueError, match="buffer, which gets no gradient"):
        store.download_grads(0, dev, {"1.running_mean": torch.zeros(7)})
    with pytest.raises(ValueError, match="frozen parameter"):
        store.download_grads(0, dev, {"0.bias": torch.zeros(7)})
    with pytest.raises(ValueError, match="has shape"):
        store.download_grads(0, dev, {"0.weight": torch.zeros(5, 7)})


def test_accumulator_is_thread_safe():
    p = nn.Parameter(torch.zeros(1000))
    store = ParamStore(HostParams.of(nn.ParameterList([p]), pin=False), {0: {"p": p}})
    acc = GradAccumulator(store)

    def add():
        for _ in range(50):
            acc.add(0, {"p": torch.ones(1000)})
    threads = [threading.Thread(target=add) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    acc.commit()
    assert torch.equal(p.grad, torch.full((1000,), 200.0))


# --- on the device's streams ------------------------------------------------------------

def test_stage_job_on_streams_with_gpu_semantics():
    """h2d upload -> compute (forward + grads) -> d2h download into the flat gradient
    buffer, the executor's pattern, on a device whose copies land when their stream
    reaches them."""
    lin = nn.Linear(6, 6)
    store = ParamStore(HostParams.of(lin, pin=False), {0: dict(lin.named_parameters())})
    x = torch.randn(3, 6)
    with VirtualDevice(semantics="cuda") as d:
        acc = GradAccumulator(store)
        up = d.submit("h2d", lambda: (store.upload(0, d, requires_grad=True),
                                      d.to_device(x, "activations", "x")))   # x too: a GPU
        grads = d.submit("compute", lambda: dict(zip(up.value()[0], torch.autograd.grad(
            functional_call(lin, up.value()[0], (up.value()[1],)).sum(),
            list(up.value()[0].values())))), wait=[up])
        host = d.submit("grads", lambda: store.download_grads(0, d, grads.value(), acc),
                        wait=[grads])
        acc.add(0, host.result(TIMEOUT), own=True)         # after its event: landed
    acc.commit()
    expected = torch.autograd.grad(lin(x).sum(), [lin.weight, lin.bias])
    assert torch.equal(lin.weight.grad, expected[0]) and torch.equal(lin.bias.grad, expected[1])


@cuda_only
def test_cuda_round_trip_with_pinned_flat_buffers():
    from fxpipe.runtime.devices.cuda import CudaDevice

    m = _mixed_model()
    store = ParamStore(HostParams.of(m), {0: dict(m.named_parameters())})
    assert all(t.is_pinned() for t in store.host.flats)
    with CudaDevice(0) as d:
        acc = GradAccumulator(store)
        up = d.submit("h2d", store.upload, 0, d, label="H2D s0")
        grads = d.submit("compute", lambda: {k: torch.full_like(v, 2.0) for k, v in up.value().items()
                                             if v.is_floating_point()}, wait=[up])
        host = d.submit("grads", lambda: store.download_grads(0, d, grads.value(), acc),
                        wait=[grads])
        acc.add(0, host.result(TIMEOUT), own=True)
    acc.commit()
    assert all(torch.equal(p.grad, torch.full_like(p, 2.0)) for p in m.parameters())


def test_each_trainable_parameter_is_owned_by_the_last_backward_stage_using_it():
    """Ownership is computed once (``build_executable``), printed on the stage lines of the
    Program, parsed back, and read by ``owned_params``; a tied parameter goes with the
    last backward stage holding it, under its first name; a frozen one has no owner."""
    from fxpipe.passes.executable import build_executable
    from fxpipe.passes.partition import build_layer_graph
    from fxpipe.passes.program import Program
    from fxpipe.passes.schedule import CallSpec
    from fxpipe.runtime.host.grad_accum import owned_params
    from fxpipe.stage_plan import StagePlan

    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.Linear(4, 4))
    model[3].weight = model[0].weight          # tied: layers 0 and 3
    model[2].bias.requires_grad_(False)
    lg = build_layer_graph(model, (torch.randn(3, 4),))
    plan = StagePlan([range(0, 2)], [range(2, len(lg)), range(0, 2)])
    p = build_executable(lg, plan, CallSpec("fused", 1), ["vcpu:0", "vcpu:1"]).program
    assert p.owns[0] == ()                     # a forward stage owns nothing
    owners = {f: s for s, names in enumerate(p.owns) for f in names}
    assert owners == {"2.weight": 1, "3.bias": 1, "0.weight": 2, "0.bias": 2}
    assert p.shared == ((1, 2),)
    assert " owns=0.weight,0.bias" in str(p).splitlines()[[
        ln.startswith("stage 2 ") for ln in str(p).splitlines()].index(True)]
    assert Program.parse(str(p)) == p
    owned = owned_params(p, lg)
    assert [id(t) for t in owned[2]] == [id(model[0].weight), id(model[0].bias)]
    assert len(owned[1]) == 2 and not any(t is model[2].bias for t in owned[1])
