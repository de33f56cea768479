"""Device backends: stream order, events, errors, memory accounting, overlap, lifecycle."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from fxpipe.errors import DeviceMemoryError
from fxpipe.runtime.devices.cuda import CudaDevice
from fxpipe.runtime.devices.device import Device
from fxpipe.runtime.devices.emulator import VirtualDevice
from fxpipe.runtime.devices.resolve import resolve_devices

TIMEOUT = 10.0  # seconds; a hang fails the test instead of blocking the suite
cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture
def dev():
    d = VirtualDevice(name="vcpu:test", record=True)
    yield d
    d.close()


def _matmuls(seconds: float) -> float:
    """Work that releases the GIL: matmuls for about ``seconds``; returns when it started."""
    a = torch.randn(256, 256)
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        a = torch.tanh(a @ a)
    return start


# --- streams and events ---------------------------------------------------------------

def test_stream_runs_work_in_submission_order(dev):
    seen = []

    def work(i):
        time.sleep(0.002 * (i % 3 == 0))  # uneven durations
        seen.append(i)
        return i

    events = [dev.submit("compute", work, i) for i in range(40)]
    assert [e.result(TIMEOUT) for e in events] == list(range(40))
    assert seen == list(range(40))


def test_compute_waits_for_h2d_copy_event(dev):
    host = torch.arange(1000.0)
    staged = {}

    def upload():
        time.sleep(0.1)  # a slow copy: without the wait, compute would find nothing
        staged["x"] = dev.to_device(host, kind="activations", owner="stage 0")

    copied = dev.submit("h2d", upload, label="H2D s0")
    total = dev.submit("compute", lambda: staged["x"].sum().item(), wait=[copied], label="F s0")
    assert total.result(TIMEOUT) == host.sum().item()
    (_, _, _, copy_end), = [r for r in dev.records if r[1] == "H2D s0"]
    (_, _, compute_start, _), = [r for r in dev.records if r[1] == "F s0"]
    assert compute_start >= copy_end


def test_events_across_devices(dev):
    with VirtualDevice(name="vcpu:other") as other:
        first = other.submit("compute", lambda: time.sleep(0.05) or 21)
        second = dev.submit("compute", lambda: first.result() * 2, wait=[first])
        assert second.result(TIMEOUT) == 42


def test_exception_reaches_wait_and_later_work_does_not_hang(dev):
    boom = ValueError("bad microbatch")

    def fail():
        raise boom

    failed = dev.submit("compute", fail, label="F s1 m0")
    after = dev.submit("compute", lambda: "next", label="F s1 m1")
    ran = []
    dependent = dev.submit("d2h", lambda: ran.append(1), wait=[failed], label="D2H s1 m0")
    with pytest.raises(ValueError, match="bad microbatch") as info:
        failed.wait(TIMEOUT)
    assert info.value is boom
    with pytest.raises(ValueError):
        failed.result(TIMEOUT)
    assert failed.exception(TIMEOUT) is boom
    assert after.result(TIMEOUT) == "next"  # the stream keeps going
    with pytest.raises(ValueError) as info:  # work waiting on a failure does not run
        dependent.wait(TIMEOUT)
    assert info.value is boom and ran == []
    with pytest.raises(ValueError):
        failed.value(TIMEOUT)
    dev.synchronize()  # does not raise: errors stay in their events
    assert "failed" in repr(failed)


def test_wait_times_out_instead_of_hanging(dev):
    gate = threading.Event()
    blocked = dev.submit("compute", gate.wait)
    with pytest.raises(TimeoutError, match="not complete"):
        blocked.wait(timeout=0.05)
    assert not blocked.done()
    gate.set()
    blocked.wait(TIMEOUT)


def test_submit_checks_its_arguments(dev):
    with pytest.raises(ValueError, match="stream must be one of"):
        dev.submit("copy", lambda: None)
    with pytest.raises(TypeError, match="wait= takes Events"):
        dev.submit("compute", lambda: None, wait=[threading.Event()])


def test_synchronize_waits_for_every_stream(dev):
    done = []
    for stream in ("compute", "h2d", "d2h"):
        dev.submit(stream, lambda s=stream: (time.sleep(0.05), done.append(s)))
    dev.synchronize()
    assert sorted(done) == ["compute", "d2h", "h2d"]


def test_workers_use_one_thread_and_leave_caller_alone(dev):
    before = torch.get_num_threads()
    assert dev.submit("compute", torch.get_num_threads).result(TIMEOUT) == 1
    assert torch.get_num_threads() == before


# --- overlap --------------------------------------------------------------------------

def _overlap(a: tuple, b: tuple) -> float:
    return min(a[3], b[3]) - max(a[2], b[2])


def test_two_devices_compute_at_the_same_time():
    with VirtualDevice(name="vcpu:0", record=True) as d0, VirtualDevice(name="vcpu:1", record=True) as d1:
        e0 = d0.submit("compute", _matmuls, 0.3, label="F s0")
        e1 = d1.submit("compute", _matmuls, 0.3, label="F s1")
        e0.wait(TIMEOUT), e1.wait(TIMEOUT)
        (r0,), (r1,) = d0.records, d1.records
    assert r0[:2] == ("compute", "F s0") and r1[:2] == ("compute", "F s1")
    assert _overlap(r0, r1) > 0.1, (r0, r1)


def test_copy_stream_overlaps_compute_stream(dev):
    compute = dev.submit("compute", _matmuls, 0.3, label="F s0")
    # a copy stream's kernel (with a GPU's semantics its Python runs at issue)
    prefetch = dev.submit("h2d", lambda: dev.kernel(lambda: _matmuls(0.3)), label="H2D s2")
    compute.wait(TIMEOUT), prefetch.wait(TIMEOUT)
    by_label = {r[1]: r for r in dev.records}
    assert _overlap(by_label["F s0"], by_label["H2D s2"]) > 0.1, dev.records


def test_records_are_off_by_default():
    with VirtualDevice() as d:
        d.submit("compute", lambda: None).wait(TIMEOUT)
        assert d.records == []


# --- memory ---------------------------------------------------------------------------

def test_to_device_and_to_host_are_real_copies(dev):
    host = torch.ones(4, requires_grad=True)
    on_dev = dev.to_device(host, kind="params", owner="stage 0")
    assert torch.equal(on_dev, host.detach()) and not on_dev.requires_grad
    assert on_dev.untyped_storage().data_ptr() != host.untyped_storage().data_ptr()
    back = dev.to_host(on_dev)
    on_dev.add_(1)
    assert torch.equal(back, torch.ones(4)) and torch.equal(host.detach(), torch.ones(4))
    t = torch.arange(6.0).view(2, 3).t()  # non-contiguous input
    assert dev.to_device(t, kind="activations", owner="stage 0").is_contiguous()


def test_memory_limit_names_owner_and_bytes_and_changes_nothing():
    with VirtualDevice(memory_limit=1000, name="vcpu:7") as d:
        d.to_device(torch.zeros(200, dtype=torch.uint8), kind="params", owner="stage 1")
        d.to_device(torch.zeros(150, dtype=torch.float32), kind="activations", owner="stage 1")  # 600 B
        with pytest.raises(DeviceMemoryError) as info:
            d.to_device(torch.zeros(50, dtype=torch.float64), kind="params", owner="stage 3")  # 400 B
        message = str(info.value)
        for part in ("vcpu:7", "stage 3", "400 B", "800 B resident", "params 200 B",
                     "activations 600 B", "limit 1000 B", "memory_limit"):
            assert part in message, (part, message)
        assert isinstance(info.value, torch.OutOfMemoryError)
        assert d.resident_bytes() == 800 and d.resident_bytes("params") == 200
        assert d.peak_bytes() == 800 and d.peak_bytes("params") == 200
        d.to_device(torch.zeros(200, dtype=torch.uint8), kind="params", owner="stage 3")  # fits exactly
        assert d.resident_bytes() == 1000


def test_track_counts_device_made_tensors_against_the_limit():
    with VirtualDevice(memory_limit=100) as d:
        g = d.track(torch.zeros(20), kind="gradients", owner="stage 2")  # 80 B
        assert d.resident_bytes("gradients") == 80
        with pytest.raises(DeviceMemoryError, match="gradients for stage 4"):
            d.track(torch.zeros(10), kind="gradients", owner="stage 4")
        with pytest.raises(ValueError, match="already counted"):
            d.track(g[:5], kind="gradients", owner="stage 2")  # same storage
        assert d.resident_bytes() == 80
        d.free(g[3:])  # any view frees its allocation
        assert d.resident_bytes() == 0


def test_peak_by_kind_and_reset(dev):
    p = dev.to_device(torch.zeros(100), kind="params", owner="stage 0")  # 400 B
    a = dev.to_device(torch.zeros(50), kind="activations", owner="stage 0")  # 200 B
    dev.free(a)
    g = dev.to_device(torch.zeros(25), kind="gradients", owner="stage 0")  # 100 B
    assert dev.resident_bytes() == 500
    assert dev.resident_bytes("activations") == 0
    assert (dev.peak_bytes(), dev.peak_bytes("params"), dev.peak_bytes("activations"),
            dev.peak_bytes("gradients")) == (600, 400, 200, 100)
    dev.reset_peak()
    assert dev.peak_bytes() == 500 and dev.peak_bytes("activations") == 0
    dev.free(p), dev.free(g)
    assert dev.resident_bytes() == 0 and dev.peak_bytes() == 500


def test_free_rejects_unknown_or_double_free(dev):
    t = dev.to_device(torch.zeros(4), kind="params", owner="stage 0")
    dev.free(t)
    with pytest.raises(ValueError, match="already freed"):
        dev.free(t)
    with pytest.raises(ValueError, match="not counted"):
        dev.free(torch.zeros(3))
    with pytest.raises(ValueError, match="memory kind"):
        dev.to_device(torch.zeros(1), kind="weights", owner="stage 0")


def test_concurrent_allocations_respect_the_limit():
    with VirtualDevice(memory_limit=20 * 400) as d:
        errors, kept = [], []
        host = torch.zeros(100)   # made on the host: only the copies are the device's

        def allocate():
            for _ in range(10):
                try:
                    kept.append(d.to_device(host, kind="activations", owner="stage 0"))
                except DeviceMemoryError as e:
                    errors.append(e)

        events = [d.submit(s, allocate) for s in ("compute", "h2d", "d2h")]
        for e in events:
            e.wait(TIMEOUT)
        assert len(kept) == 20 and len(errors) == 10
        assert d.resident_bytes() == d.peak_bytes() == 20 * 400


# --- lifecycle --------------------------------------------------------------------------

def test_threads_start_lazily_and_close_joins_them():
    baseline = threading.active_count()
    d = VirtualDevice()
    assert threading.active_count() == baseline
    for stream in ("compute", "h2d", "d2h"):
        d.submit(stream, time.sleep, 0.01)
    assert threading.active_count() == baseline + 3
    last = d.submit("compute", lambda: "queued before close")
    d.close()
    assert last.result(0) == "queued before close"  # queued work ran before the stop
    assert threading.active_count() == baseline
    d.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        d.submit("compute", lambda: None)


def test_stop_workers_keeps_the_device_usable_and_streams_in_order():
    d = VirtualDevice()
    order: list[int] = []
    d.submit("compute", lambda: (time.sleep(0.05), order.append(0)))
    d.stop_workers()  # waits for the queued work, then the thread is gone
    assert order == [0] and not [t for t in threading.enumerate() if d.name in t.name]
    # stopped from its own worker (which cannot join itself), the old thread is still
    # busy when new work arrives: the new worker waits for it, so the stream keeps order
    stopped = threading.Event()
    d.submit("compute", lambda: (d.stop_workers(), stopped.set(), time.sleep(0.05), order.append(1)))
    assert stopped.wait(TIMEOUT)
    d.submit("compute", lambda: order.append(2)).result(TIMEOUT)
    assert order == [0, 1, 2]
    d.close()


def test_import_has_no_side_effects():
    code = ("import threading, torch; import fxpipe.runtime.devices.events, fxpipe.runtime.devices.device, "
            "fxpipe.runtime.devices.emulator, fxpipe.runtime.devices.cuda, fxpipe.runtime.devices.resolve, "
            "fxpipe.runtime.host.params, fxpipe.runtime.host.param_store, fxpipe.runtime.host.grad_accum; "
            "print(threading.active_count(), torch.cuda.is_initialized())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["1", "False"]


# --- resolve_devices ------------------------------------------------------------------

def test_resolve_devices_rules():
    mine = VirtualDevice(name="mine")
    resolved = resolve_devices(["cpu", torch.device("cpu"), mine])
    assert [type(d) for d in resolved] == [VirtualDevice] * 3
    assert [d.name for d in resolved] == ["vcpu:0", "vcpu:1", "mine"]
    assert resolved[2] is mine
    assert [d.name for d in resolve_devices("cpu")] == ["vcpu:0"]
    assert all(isinstance(d, Device) for d in resolved)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU default")
def test_resolve_devices_none_without_gpu_gives_two_virtual_devices():
    resolved = resolve_devices(None)
    assert [type(d) for d in resolved] == [VirtualDevice, VirtualDevice]
    assert [d.name for d in resolved] == ["vcpu:0", "vcpu:1"]


@pytest.mark.parametrize("entry, message", [
    ("tpu:0", r"devices\[1\]='tpu:0'"), ("banana", r"devices\[1\]='banana' is not a device"),
    (3, r"devices\[1\]=3: expected"), ("meta", "not 'meta'"), (None, "got NoneType"),
])
def test_resolve_devices_rejects_bad_entries(entry, message):
    with pytest.raises(ValueError, match=message):
        resolve_devices(["cpu", entry])


def test_resolve_devices_refuses_a_count():
    """``devices=2`` is a number of devices, not devices: the error says what to pass."""
    with pytest.raises(TypeError, match=r"devices=2: pass the devices, not their number: "
                                        r"\[f'cuda:\{i\}' for i in range\(2\)\].*\['cpu'\] \* 2"):
        resolve_devices(2)


def test_resolve_devices_rejects_duplicates_and_empty():
    d = VirtualDevice(name="twice")
    with pytest.raises(ValueError, match="twice is listed twice"):
        resolve_devices([d, d])
    with pytest.raises(ValueError, match="empty"):
        resolve_devices([])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_cuda_device_fails_clearly_without_cuda():
    with pytest.raises(RuntimeError, match=r"CudaDevice\(1\): CUDA is not available.*VirtualDevice"):
        CudaDevice(1)
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        resolve_devices(["cuda:0"])


# --- CUDA (runs on a GPU machine) -----------------------------------------------------

@cuda_only
def test_cuda_h2d_then_compute_then_d2h():
    with CudaDevice(0) as d:
        host = torch.arange(1 << 20, dtype=torch.float32).pin_memory()
        up = d.submit("h2d", d.to_device, host, "activations", "stage 0")
        doubled = d.submit("compute", lambda: up.value() * 2, wait=[up])
        back = d.submit("d2h", lambda: d.to_host(doubled.value()), wait=[doubled])
        out = back.result(TIMEOUT)
        assert out.is_pinned() and torch.equal(out, host * 2)
        assert d.resident_bytes("activations") == host.numel() * 4
        d.free(up.result())
        assert d.resident_bytes() == 0
        assert d.peak_bytes() >= host.numel() * 4 and d.peak_bytes("activations") == host.numel() * 4


@cuda_only
def test_cuda_errors_and_memory_limit():
    with CudaDevice(0, memory_limit=1024) as d:
        assert d.name == "cuda:0" and d.memory_limit == 1024
        failed = d.submit("compute", lambda: 1 / 0)
        dependent = d.submit("d2h", lambda: "never", wait=[failed])
        with pytest.raises(ZeroDivisionError):
            failed.wait(TIMEOUT)
        with pytest.raises(ZeroDivisionError):
            dependent.wait(TIMEOUT)
        assert d.submit("compute", lambda: 7).result(TIMEOUT) == 7
        with pytest.raises(DeviceMemoryError, match="stage 5"):
            d.to_device(torch.zeros(512), kind="params", owner="stage 5")
        assert d.resident_bytes() == 0
    assert CudaDevice(0).memory_limit == torch.cuda.get_device_properties(0).total_memory


@cuda_only
def test_cuda_compute_waits_for_slow_copy():
    with CudaDevice(0) as d:
        host = torch.ones(4096, 4096).pin_memory()  # sums exactly to 2**24
        busy = torch.randn(2048, 2048, device="cuda:0")
        torch.cuda.synchronize()

        def upload():  # long kernels before the copy on the h2d stream
            for _ in range(20):
                busy.matmul(busy)
            return d.to_device(host, "params", "stage 0")

        up = d.submit("h2d", upload)
        total = d.submit("compute", lambda: up.value().sum(), wait=[up])
        assert total.result(TIMEOUT).item() == 2.0 ** 24


@cuda_only
def test_resolve_devices_none_gives_every_gpu():
    resolved = resolve_devices(None)
    assert [d.name for d in resolved] == [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    assert all(isinstance(d, CudaDevice) for d in resolved)
    assert re.fullmatch(r"cuda:0", resolve_devices(["cuda:0"])[0].name)


def test_workers_use_one_thread_and_leave_everyone_elses_count():
    """``torch.set_num_threads(1)`` in a worker also sets the value other threads adopt
    on first use; the caller and threads started later keep theirs. In a fresh process:
    the main thread's first query comes after the workers started."""
    code = textwrap.dedent("""
        import threading, torch, fxpipe
        d = fxpipe.VirtualDevice()
        inside = d.submit("compute", torch.get_num_threads).result(30)
        copy = d.submit("h2d", torch.get_num_threads).result(30)
        fresh = []
        t = threading.Thread(target=lambda: fresh.append(torch.get_num_threads()))
        t.start(); t.join()
        print(inside, copy, torch.get_num_threads(), fresh[0])
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "2"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1", "1", "2", "2"], out.stdout


def test_freed_transfer_memory_is_reused_only_when_nothing_holds_it():
    d = VirtualDevice()
    host = torch.arange(6.0)
    a = d.to_device(host, kind="params", owner="stage 0")
    ptr = a.data_ptr()
    d.free(a)
    del a
    assert d.cached_bytes() == 24 and d.resident_bytes() == 0
    b = d.to_device(host * 2, kind="activations", owner="stage 1")  # same size: same memory
    assert b.data_ptr() == ptr and torch.equal(b, host * 2) and b.is_contiguous()
    assert d.resident_bytes("activations") == 24 and d.cached_bytes() == 0
    view = b[1:]  # e.g. an output aliasing its input, or an autograd graph holding it
    d.free(b)
    del b
    c = d.to_device(host * 3, kind="params", owner="stage 2")
    assert c.data_ptr() != ptr and torch.equal(view, (host * 2)[1:])  # not overwritten
    del view
    e = d.to_device(torch.ones(3, 2), kind="params", owner="stage 3")  # now free: reused
    assert e.data_ptr() == ptr and e.shape == (3, 2) and torch.equal(e, torch.ones(3, 2))
    d.free(c)
    assert d.cached_bytes() == 24
    d.empty_cache()
    assert d.cached_bytes() == 0
    tracked = d.track(torch.zeros(6), kind="gradients", owner="stage 0")
    d.free(tracked)  # made by compute, not by to_device: not kept
    assert d.cached_bytes() == 0
    d.free(e)
    d.stop_workers()  # gives the cache back too
    assert d.cached_bytes() == 0


def test_torchrun_ranks_take_their_share_of_the_nodes_gpus():
    """``devices=None`` under torchrun: each local rank its contiguous share of the node's
    GPUs (not every GPU for every rank); more ranks than GPUs refused; two ranks naming
    one GPU found (``DataParallel.check_devices`` raises on it)."""
    from fxpipe.runtime.devices.resolve import local_gpus
    from fxpipe.runtime.issue.device_collectives import shared_gpu
    assert local_gpus(8, {"LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "8"}) == [3]
    assert local_gpus(7, {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}) == [3, 4, 5]
    assert local_gpus(4, {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}) == [0, 1, 2, 3]
    assert local_gpus(2, {}) == [0, 1]
    with pytest.raises(ValueError, match=r"4 ranks on this node \(LOCAL_WORLD_SIZE\) share 2 "
                                         r"visible GPU\(s\).*at most 2 rank\(s\) per node"):
        local_gpus(2, {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "4"})
    assert shared_gpu([["GPU-a"], ["GPU-b", "GPU-c"], ["GPU-c"]]) == (1, 2, "GPU-c")
    assert shared_gpu([[], []]) is None


def test_workers_finish_and_are_joined_before_the_interpreter_exits(tmp_path):
    """A script that queues work on a VirtualDevice and exits without ``close()``: the exit
    hook stops and joins the workers first, so the work completes and no daemon thread is
    inside torch's code when the interpreter finalizes (there ``pthread_exit`` unwinding
    through C++ aborts the process: the cause seen of a finished torchrun job's SIGABRT)."""
    import subprocess
    import sys
    done = tmp_path / "done"
    script = f"""
import time, torch, fxpipe
def slow(path):
    time.sleep(0.5)
    torch.ones(256, 256) @ torch.ones(256, 256)
    open(path, "w").write("ok")
device = fxpipe.VirtualDevice()
device.submit("compute", slow, {str(done)!r})
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert done.read_text() == "ok"
