"""#41 item 1: host work that blocks never holds the issue lock (``runtime.devices.issue_lock``).

On a GPU one issue thread at a time runs an action's Python under one process-wide lock.
A copy from pageable memory, a conversion on the host, a copy into the ring, registering
pages with CUDA or a wait for a host-lane event, done under it, would stall every other
GPU's issue. Each runs under ``issue_lock.blocking()``: these tests hold the lock as an
issue thread does and check, at each of those places, that it is let go (and taken back).
The CUDA-only place (``CudaDevice.submit`` waiting for a host event) is in test_cuda.py.
"""

from __future__ import annotations

import threading

import pytest
import torch
from torch.overrides import TorchFunctionMode

from fxpipe.runtime.devices import issue_lock, pinned
from fxpipe.runtime.devices.device import host_copy
from fxpipe.runtime.devices.issue_lock import blocking, holding, issuing
from fxpipe.runtime.host.params import converted


class _LockSeen(TorchFunctionMode):
    """Records, for each call of ``names``, whether this thread held the issue lock."""

    def __init__(self, *names: str):
        super().__init__()
        self.names, self.seen = names, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in self.names:
            self.seen.append(holding())
        return func(*args, **(kwargs or {}))


def test_a_blocking_wait_lets_another_issue_thread_in():
    """Thread A waits, inside its issue, for what thread B issues: under the lock this
    would hang until the timeout (B can never take it)."""
    issued = threading.Event()
    got = []

    def b():
        with issuing(True):
            issued.set()

    with issuing(True):
        threading.Thread(target=b).start()
        with blocking():
            got.append(issued.wait(timeout=10))
        assert holding()   # taken back
    assert got == [True] and not holding()
    assert not issue_lock._ISSUING.locked()


def test_blocking_outside_the_lock_does_nothing():
    with blocking():
        assert not holding()
    with issuing(False):
        assert not holding()
    assert not issue_lock._ISSUING.locked()


@pytest.mark.parametrize("where", ["pageable copy", "host conversion", "ring copy"])
def test_each_blocking_host_op_runs_with_the_lock_let_go(where):
    src = torch.arange(4096, dtype=torch.float32)
    mode = _LockSeen("copy_", "to")
    with issuing(True), mode:
        if where == "pageable copy":      # a GPU's copy from or to pageable host memory
            host_copy(torch.empty(4096), src, stalls=True)
            host_copy(torch.empty(4096), src, stalls=False)   # queued: stays under it
        elif where == "host conversion":  # an upload's source converted on the host
            assert converted(src, torch.float32) is src       # none needed: no wait
            converted(src, torch.bfloat16)
        else:                             # a file-backed upload through the ring
            ring = pinned.Ring(capacity=8 * pinned.PAGE, emulate=True)
            ring.stage(src, torch.bfloat16)
        assert holding()
    expected = {"pageable copy": [False, True], "host conversion": [False],
                "ring copy": [False]}[where]
    assert mode.seen == expected, mode.seen


def test_registering_a_file_window_runs_with_the_lock_let_go(monkeypatch):
    seen = []

    def budget():   # read while the window is registered
        seen.append(holding())
        return 1 << 40

    monkeypatch.setattr(pinned, "file_pin_budget", budget)
    pages = bytearray(2 * pinned.PAGE)
    base = torch.frombuffer(pages, dtype=torch.uint8).data_ptr()
    try:
        with issuing(True):
            assert pinned.register_window(base, len(pages), base, 16, emulate=True)
            assert pinned.register_window(base, len(pages), base + 64, 16, emulate=True)
    finally:
        pinned.forget_file(base, len(pages))
    assert seen == [False]   # once: the second read finds it registered, under the lock


def test_the_lock_is_handed_over_to_the_earliest_action():
    """#55 item 2: when the holder lets go, the lock goes to the waiting thread whose
    action comes first in the Program (ties: the one that asked first), not back to the
    holder asking again at once (a plain lock usually lets it, starving a device that is
    behind). The waits are counted per thread."""
    order: list[str] = []

    def waiter(name: str, step: int) -> threading.Thread:
        def run():
            issue_lock.at_step(step)
            with issuing(True):
                order.append(name)
        t = threading.Thread(target=run)
        queued = len(issue_lock._ISSUING._waiters)
        t.start()
        while len(issue_lock._ISSUING._waiters) == queued:   # it queued
            threading.Event().wait(0.001)
        return t

    issue_lock.waited()
    issue_lock.at_step(3)
    with issuing(True):
        threads = [waiter("late", 7), waiter("early", 2), waiter("tie", 2)]
    issue_lock.at_step(4)
    with issuing(True):   # asked again at once, at step 4: after the waiters before it
        order.append("me")
    for t in threads:
        t.join(timeout=10)
    assert order == ["early", "tie", "me", "late"], order
    assert issue_lock.waited()[0] > 0.0 and issue_lock.waited() == (0.0, 0)
    assert not issue_lock._ISSUING.locked()
    issue_lock.at_step(0)


def test_the_holder_keeps_the_lock_until_a_waiter_is_slack_steps_before_it():
    """#55: between two of its actions an issue thread keeps the lock (no hand-over: no
    thread woken, no GIL moved) while every waiting thread's action comes less than
    ``slack`` steps before its next one; once one is that far behind, the lock goes to it
    and the holder queues at its step."""
    lock = issue_lock.OrderedLock()
    order: list[str] = []
    lock.acquire(0)
    assert lock.pass_on(50, slack=4) == 0.0   # nobody waits: kept

    def waiter():
        lock.acquire(2)
        order.append("waiter")
        lock.release()

    t = threading.Thread(target=waiter)
    t.start()
    while not lock._waiters:
        threading.Event().wait(0.001)
    assert lock.pass_on(5, slack=4) == 0.0   # 2 + 4 > 5: kept
    order.append("holder at 5")
    assert lock.pass_on(6, slack=4) > 0.0    # 2 + 4 <= 6: handed over, then back
    order.append("holder at 6")
    t.join(timeout=10)
    lock.release()
    assert order == ["holder at 5", "waiter", "holder at 6"], order
    assert not lock.locked()


def test_issue_lock_waits_are_counted_in_stats():
    """Two inline devices issue at once: their waits for the lock are in the stats."""
    import fxpipe
    from fxpipe.runtime.devices.emulator import InlineDevice

    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])
    x = torch.randn(8, 8)
    pipe = fxpipe.compile(model, example_inputs=(x,), devices=[InlineDevice(), InlineDevice()],
                          config=fxpipe.RunConfig(num_microbatch=4))
    for _ in range(3):
        pipe(x)
    stats = pipe.stats()
    assert "issue_lock_wait_us" in stats and stats["issue_lock_wait_us"] >= 0
    assert stats["issue_lock_waits"] >= 0
    pipe.close()


def test_a_new_pool_block_is_made_with_the_lock_let_go(monkeypatch):
    """#55 item 2: registering a new page-locked block (``cudaHostRegister``: hundreds of
    milliseconds for a GB) runs with the issue lock let go, outside the pool's own lock;
    a block reused needs no registration."""
    seen = []
    made = pinned.empty

    def empty(*args, **kw):
        seen.append(holding())
        return made(*args, **kw)

    monkeypatch.setattr(pinned, "empty", empty)
    pool = pinned.Pool(emulate=True)
    ring = pinned.Ring(capacity=8 * pinned.PAGE, emulate=True)
    with issuing(True):
        a = pool.empty((1000,), torch.float32)
        ring.stage(torch.ones(10), torch.float32)
        assert holding()
        ptr = a.data_ptr()
        del a
        assert pool.empty((1000,), torch.float32).data_ptr() == ptr   # reused: no new block
    assert seen == [False, False]


@pytest.mark.parametrize("backend", ["inductor", "cudagraphs"])
def test_compiles_and_captures_run_with_the_lock_let_go(monkeypatch, backend):
    """#55 item 2: a stage's inductor compile (seconds) and a device graph's capture
    (which drains its GPU) run with the issue lock let go, so no other device's action
    waits for them; the calls equal eager."""
    import fxpipe
    from fxpipe.runtime.devices.emulator import InlineDevice
    from fxpipe.runtime.stages import compiled

    seen: dict[str, list[bool]] = {"compile": [], "capture": []}
    compile_segment, capture = compiled._compile_segment, InlineDevice.capture

    def compiling(*args, **kw):
        seen["compile"].append(holding())
        return compile_segment(*args, **kw)

    def capturing(self, *args, **kw):
        seen["capture"].append(holding())
        return capture(self, *args, **kw)

    monkeypatch.setattr(compiled, "_compile_segment", compiling)
    monkeypatch.setattr(InlineDevice, "capture", capturing)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())
                                  for _ in range(4)])
    x = torch.randn(6, 8)
    pipe = fxpipe.compile(model, example_inputs=(x,), devices=[InlineDevice(), InlineDevice()],
                          config=fxpipe.RunConfig(num_microbatch=2, stage_backend=backend))
    with torch.no_grad():
        torch.testing.assert_close(pipe(x), model(x), atol=1e-5, rtol=1e-5)
    pipe.close()
    assert seen["compile"] and not any(seen["compile"])
    if backend == "cudagraphs":
        assert seen["capture"] and not any(seen["capture"])
