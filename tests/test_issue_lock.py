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
