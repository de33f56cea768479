"""On real GPUs: the same runtime, CudaDevice streams and events, pinned host memory.

Skipped without CUDA; the multi-GPU cases skip on a machine with one GPU. ``python -m
fxpipe.check`` runs these first, then measures (see ``fxpipe/check/``).
"""

from __future__ import annotations

import copy
import threading
import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxpipe
from tests import models
from tests.test_gpu_semantics import waiting_host_actions
from tests.test_runtime import train_step

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
PLAN = fxpipe.ExecutePlan(fwd_plan=[range(0, 3), range(3, 5)],
                          bwd_plan=[range(5, 6), range(3, 5), range(1, 3), range(0, 1)])


def ce(out, label):
    return F.cross_entropy(out.float().flatten(0, 1), label.flatten())


def gpus(n: int) -> list[str]:
    if n > GPUS:
        pytest.skip(f"needs {n} GPUs, {GPUS} visible")
    return [f"cuda:{i}" for i in range(n)]


def pair(n: int, grain: str = "stage", **kw):
    torch.manual_seed(0)
    model = models.GPT(depth=4).eval()
    ref = copy.deepcopy(model).cuda()
    pipe = fxpipe.compile(model, example_inputs=(torch.randint(0, 64, (6, 8)),),
                          devices=gpus(n), plan=PLAN,
                          config=fxpipe.RunConfig(num_microbatch=3, recompute_grain=grain), **kw)
    return model, ref, pipe


def batch():
    torch.manual_seed(1)
    return torch.randint(0, 64, (6, 8)), torch.randint(0, 64, (6, 8))


def assert_grads_close(model, ref, atol=1e-5, rtol=1e-4):
    for (n, p), r in zip(model.named_parameters(), ref.parameters()):
        assert p.grad is not None and p.grad.device.type == "cpu", n
        torch.testing.assert_close(p.grad, r.grad.cpu(), atol=atol, rtol=rtol, msg=n)


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("style", ["fused", "eager"])
@pytest.mark.parametrize("grain", ["stage", "layer"])
def test_training_equals_eager_on_gpus(n, style, grain):
    model, ref, pipe = pair(n, grain)
    ids, y = batch()
    loss = train_step(pipe, style, ids, y, ce)
    ref_loss = ce(ref(ids.cuda()), y.cuda())
    ref_loss.backward()
    torch.testing.assert_close(loss.detach().cpu(), ref_loss.detach().cpu(), atol=1e-5, rtol=1e-4)
    assert_grads_close(model, ref)
    assert all(p.device.type == "cpu" for p in model.parameters())


def test_host_waits_of_a_fused_call_and_a_cuda_timeline():
    model, ref, pipe = pair(1)
    ids, y = batch()
    pipe.forward_backward((ids,), label=y, loss_fn=ce)
    with pipe.trace() as rec:
        pipe.forward_backward((ids,), label=y, loss_fn=ce)
    # the caller waits once, at the end; the host lane once per action reading device results
    assert pipe.stats()["host_waits"] == 1 + waiting_host_actions(pipe.program("fused", 3))
    kinds = {iv.kind for iv in rec.timeline.intervals}
    assert {"forward", "backward", "transfer"} <= kinds and rec.timeline.makespan > 0
    assert sorted(rec.actions) == sorted(pipe.program("fused", 3).action_strings())


def test_bf16_parameters_on_gpu():
    model, ref, pipe = pair(1, param_dtype=torch.bfloat16)
    ids, y = batch()
    loss = pipe.forward_backward((ids,), label=y, loss_fn=ce)
    ref_loss = ce(ref(ids.cuda()), y.cuda())
    ref_loss.backward()
    assert abs(loss.item() - ref_loss.item()) <= 2e-2 * abs(ref_loss.item())
    for p in model.parameters():
        assert p.dtype == p.grad.dtype == torch.float32


def test_a_failing_stage_leaves_the_model_untouched_and_the_gpu_usable():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
    x = torch.randn(6, 8)
    pipe = fxpipe.compile(model, example_inputs=(x,), devices=gpus(1))
    pipe.forward_backward((x,), loss_fn=lambda out, _: out.square().mean())
    before = {n: (p.detach().clone(), p.grad.clone()) for n, p in model.named_parameters()}
    def failing(out, _):
        raise RuntimeError("loss failed")

    with pytest.raises(fxpipe.StageError, match="loss failed"):
        pipe.forward_backward((x,), loss_fn=failing)
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n][0]) and torch.equal(p.grad, before[n][1]), n
    assert all(d.resident_bytes() == 0 for d in pipe.devices)
    pipe.forward_backward((x,), loss_fn=lambda out, _: out.square().mean())  # usable again


def test_the_streamed_optimizer_on_gpus():
    model, ref, pipe = pair(min(2, GPUS))
    ids, y = batch()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for _ in range(2):
        pipe.forward_backward((ids,), label=y, loss_fn=ce, optimizer=opt)
        opt.zero_grad()
        ce(ref(ids.cuda()), y.cuda()).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    for (n, p), r in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), r.detach().cpu(), atol=1e-4, rtol=1e-3, msg=n)


def test_pinned_memory_is_registered_at_its_exact_size():
    from fxpipe.runtime.devices import pinned

    account = pinned.Account()
    n = (3 * pinned.PAGE + 8) // 4                      # 3 pages and 8 bytes of fp32
    t = pinned.empty(n, torch.float32, emulate=False, account=account)
    assert t.is_pinned() and pinned.is_pinned(t) and pinned.is_pinned(t[5:])  # CUDA sees it
    assert t.data_ptr() % pinned.PAGE == 0 and account.nbytes == 4 * pinned.PAGE  # not 8
    # the copy does not wait for the GPU: a non_blocking upload of 256 MiB returns before it lands
    big = pinned.empty(64 << 20, torch.float32, emulate=False)
    on_gpu = torch.empty_like(big, device="cuda")
    torch.cuda.synchronize()
    on_gpu.copy_(big, non_blocking=True)
    assert not torch.cuda.current_stream().query(), "the upload blocked the issuing thread"
    torch.cuda.synchronize()
    del big, on_gpu
    t.copy_(torch.arange(n, dtype=torch.float32))
    dev = torch.empty(n, device="cuda")
    dev.copy_(t, non_blocking=True)
    back = pinned.empty(n, torch.float32, emulate=False)
    back.copy_(dev, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(back, t)
    del t
    assert account.nbytes == 0                          # unregistered and freed


@pytest.mark.parametrize("inputs_on", ["cpu", "cuda"])
def test_pinned_fused_step_has_no_host_stalls(inputs_on):
    model, ref, pipe = pair(1)    # every device a GPU: pinned by default
    ids, y = batch()
    loss = pipe.forward_backward((ids.to(inputs_on),), label=y.to(inputs_on), loss_fn=ce)
    stats = pipe.stats()
    assert stats["host_stalls"] == 0 and stats["host_pinned_bytes"] > 0, stats
    ref_loss = ce(ref(ids.cuda()), y.cuda())
    ref_loss.backward()
    torch.testing.assert_close(loss.detach().cpu(), ref_loss.detach().cpu(), atol=1e-5, rtol=1e-4)
    assert_grads_close(model, ref)
    unpinned = pair(1, pin_memory=False)[2]
    unpinned.forward_backward((ids,), label=y, loss_fn=ce)
    assert unpinned.stats()["host_stalls"] > 0 and unpinned.stats()["host_pinned_bytes"] == 0


def test_generate_on_a_gpu_equals_transformers():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        pad_token_id=0)).eval()
    ids = torch.randint(1, 128, (3, 8))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    ids[mask == 0] = 0
    pipe = fxpipe.compile(model, example_inputs=(ids,), devices=gpus(1))
    out = pipe.generate(ids, mask, max_new_tokens=8)
    with torch.no_grad():
        ref = copy.deepcopy(model).cuda().generate(ids.cuda(), attention_mask=mask.cuda(),
                                                  max_new_tokens=8, do_sample=False)
    assert out.device.type == "cpu" and torch.equal(out, ref.cpu())
    assert pipe._generation[0].pipe.stats()["host_stalls"] == 0


def test_cuda_inputs_go_straight_to_the_device():
    """A caller's CUDA inputs and labels are uploaded device to device, after the caller's
    stream (no page-locked staging copy, no host round trip), cast to param_dtype on it."""
    for dtype in (None, torch.bfloat16):
        model, ref, pipe = pair(1, param_dtype=dtype)
        ids, y = batch()
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):   # written on another stream than the call's
            big = torch.randn(2048, 2048, device="cuda")
            for _ in range(8):
                big = big @ big / 2048
            ids_gpu = ids.cuda() + (big.sum() * 0).long()
        torch.cuda.current_stream().wait_stream(side)
        loss = pipe.forward_backward((ids_gpu,), label=y.cuda(), loss_fn=ce)
        assert pipe._staging.account.nbytes == 0, "a CUDA input went through the host"
        assert pipe.stats()["host_stalls"] == 0
        if dtype is None:
            ref_loss = ce(ref(ids.cuda()), y.cuda())
            ref_loss.backward()
            torch.testing.assert_close(loss, ref_loss.detach().cpu(), atol=1e-5, rtol=1e-4)
            assert_grads_close(model, ref)
        pipe.close()


def test_cuda_inputs_on_another_gpu_go_through_the_host():
    """A copy between GPUs would run on the caller's stream, fenced both ways against the
    device's: a device refuses such a source, and a call stages it through the host."""
    gpus(2)
    with pytest.raises(ValueError, match="takes a host tensor or one on cuda:1, got one on cuda:0"):
        fxpipe.CudaDevice(1).to_device(torch.ones(2, device="cuda:0"), "activations", "x")
    model, ref, pipe = pair(2)
    ids, y = batch()
    loss = pipe.forward_backward((ids.to("cuda:0"),), label=y.to("cuda:0"), loss_fn=ce)
    assert pipe._staging.account.nbytes > 0, "inputs on another GPU went through the staging"
    ref_loss = ce(ref(ids.cuda()), y.cuda())
    ref_loss.backward()
    torch.testing.assert_close(loss.detach().cpu(), ref_loss.detach().cpu(), atol=1e-5, rtol=1e-4)
    assert_grads_close(model, ref)
    pipe.close()


def test_a_host_wait_on_the_gpu_sleeps():
    """The events the host waits on are blocking (cudaEventBlockingSync): a thread waiting
    for a long kernel sleeps, so waiting issue threads leave the cores to the one issuing."""
    d = fxpipe.CudaDevice(0)
    x = torch.randn(4096, 4096, device="cuda")

    def work():
        y = x
        for _ in range(40):
            y = y @ x / 64
        return y

    for wait in (lambda e: e.wait(), lambda e: d.synchronize()):
        event = d.submit("compute", work)
        wall, cpu = time.perf_counter(), time.thread_time()
        wait(event)
        wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
        assert wall > 0.01, "the kernels finished before the wait: make them longer"
        assert cpu < 0.5 * wall, (cpu, wall)   # spinning, it would be about wall
    d.close()


def test_a_gpu_waiting_for_a_host_event_lets_other_issue_threads_in():
    """#41 item 1: ``CudaDevice.submit`` waiting (at issue, under the issue lock) for a
    host-lane event lets go of the lock while it waits: the thread that completes the event
    needs the lock first. Under the lock this would wait out the timeout."""
    from fxpipe.runtime.devices.emulator import InlineDevice
    from fxpipe.runtime.devices.issue_lock import issuing
    d, host = fxpipe.CudaDevice(0), fxpipe.VirtualDevice()
    gate = threading.Event()
    host_event = host.submit("compute", lambda: gate.wait(timeout=30))

    def other_issue():   # another GPU's issue thread: takes the lock, then opens the gate
        with issuing(True):
            InlineDevice().submit("compute", gate.set)

    other = threading.Thread(target=other_issue)
    start = time.perf_counter()
    with issuing(True):
        other.start()
        event = d.submit("compute", lambda: torch.ones(4, device="cuda"), wait=[host_event])
    event.wait()
    other.join()
    assert time.perf_counter() - start < 20 and host_event.result() is True
    host.close()
    d.close()


def test_two_logical_devices_on_one_gpu_train_equal_to_eager():
    """Two CudaDevices of one GPU under two names: their own streams, events and copies,
    so the cross-device hand-offs run on real CUDA with one GPU (fxpipe.check's
    ``scaling`` also runs them on its model)."""
    from fxpipe.runtime.devices.cuda import CudaDevice
    half = torch.cuda.get_device_properties(0).total_memory // 2
    devices = [CudaDevice(0, memory_limit=half, name=f"cuda:0/{i}") for i in range(2)]
    assert devices[0].streams["compute"] != devices[1].streams["compute"]
    torch.manual_seed(0)
    model = models.GPT(depth=4).eval()
    ref = copy.deepcopy(model).cuda()
    pipe = fxpipe.compile(model, example_inputs=(torch.randint(0, 64, (6, 8)),),
                          devices=devices, plan=PLAN, config=fxpipe.RunConfig(num_microbatch=3))
    ids, y = batch()
    loss = pipe.forward_backward((ids,), label=y, loss_fn=ce)
    ref_loss = ce(ref(ids.cuda()), y.cuda())
    ref_loss.backward()
    torch.testing.assert_close(loss.detach().cpu(), ref_loss.detach().cpu(), atol=1e-5, rtol=1e-4)
    assert_grads_close(model, ref)
    pipe.close()


def test_the_printed_runnable_code_is_what_a_gpu_runs():
    """An HF model's stage code pins the capture host in its constants; on a GPU the code
    a stage runs names the GPU, and ``pipe.code(runnable=True)`` prints that code."""
    T = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = T.LlamaForCausalLM(T.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, use_cache=False)).eval()
    ids = torch.randint(0, 64, (4, 8))
    pipe = fxpipe.compile(model, example_kwargs=dict(input_ids=ids, labels=ids), devices=gpus(1),
                          param_dtype=torch.bfloat16)
    code = pipe.code(runnable=True)
    assert "device(type='cuda', index=0)" in code and "device(type='cpu')" not in code
    loss = pipe.forward_backward((), dict(input_ids=ids, labels=ids), loss_fn=lambda o, _: o.loss)
    assert torch.isfinite(loss)
    pipe.close()


def test_inductor_stage_code_on_a_gpu_equals_eager():
    """``stage_backend="inductor"`` on a GPU: each layer segment runs Triton kernels on the
    device's compute stream; a fused step of an HF Llama in bf16 equals eager stage code's
    within bf16 rounding, and fewer kernels run (the profiler's CUDA kernel count)."""
    T = pytest.importorskip("transformers")
    from torch.profiler import ProfilerActivity, profile

    def run(backend):
        torch.manual_seed(0)
        model = T.LlamaForCausalLM(T.LlamaConfig(
            vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, use_cache=False))
        ids = torch.randint(0, 64, (4, 16))
        batch = dict(input_ids=ids, labels=ids)
        pipe = fxpipe.compile(model, example_kwargs=batch, devices=gpus(1),
                              param_dtype=torch.bfloat16,
                              config=fxpipe.RunConfig(num_microbatch=2, stage_backend=backend))
        loss = pipe.forward_backward((), batch, loss_fn=lambda o, _: o.loss)   # compiles
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            pipe.forward_backward((), batch, loss_fn=lambda o, _: o.loss)
            torch.cuda.synchronize()
        kernels = sum(1 for e in prof.events() if e.device_type.name == "CUDA")
        grads = [p.grad.clone() for p in model.parameters()]
        pipe.close()
        return loss, grads, kernels

    loss, grads, kernels = run(None)
    c_loss, c_grads, c_kernels = run("inductor")
    torch.testing.assert_close(c_loss, loss, rtol=2e-2, atol=0)
    for g, c in zip(grads, c_grads):
        assert (g - c).abs().max() <= 5e-2 * g.abs().max() + 1e-6
    print(f"CUDA kernels per step: eager stage code {kernels}, inductor {c_kernels}")
    assert c_kernels < kernels
