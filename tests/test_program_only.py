"""Nothing a call does to tensors runs outside its Program.

A ``TorchDispatchMode`` on the caller's thread and on every thread the call's work runs
on (issue threads, device streams, the collectives' worker) records each tensor op that
runs outside an action's work (``issue.WHERE``). The only work allowed outside is the
short list ``issue.outside_program`` documents: splitting the caller's inputs into
microbatches (with data parallel, comparing their shapes with the other ranks'), and summing the microbatches' losses (or input gradients) afterwards. Ops
on a device's stream threads are that device's work: those threads run nothing else.

The check runs on a pipe's second call: the first also builds its host buffers (moving
the model's tensors into them), once per pipe.
"""

from __future__ import annotations

import threading
import traceback

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import fxpipe
from fxpipe.runtime.issue import executor, threads as issue
from tests import models


class _Outside(TorchDispatchMode):
    def __init__(self, found: list):
        super().__init__()
        self.found = found

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        where = issue.WHERE
        name = threading.current_thread().name
        device_stream = name.startswith("fxpipe-") and not name.startswith("fxpipe-issue")
        if where.action is None and where.outside is None and not device_stream:
            frames = [f for f in traceback.extract_stack(limit=14)[:-1]
                      if "/fxpipe/" in f.filename]
            self.found.append((name, str(func),
                               [f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno} {f.name}"
                                for f in frames[-4:]]))
        return func(*args, **(kwargs or {}))


@pytest.fixture
def watched(monkeypatch):
    """Every thread started from now on (fresh issue threads, device streams) and the
    caller's run under the recording mode while ``record`` is on."""
    found: list = []
    on = threading.Event()
    run = threading.Thread.run

    def watched_run(self):
        with _Outside(found):
            run(self)

    monkeypatch.setattr(threading.Thread, "run", watched_run)
    monkeypatch.setattr(issue, "_idle", [])   # fresh issue threads, started watched

    class Record:
        def __enter__(self):
            found.clear()
            self.mode = _Outside(found)
            self.mode.__enter__()
            on.set()
            return found

        def __exit__(self, *exc):
            self.mode.__exit__(*exc)
            on.clear()

    return Record()


def ce(out, label):
    return F.cross_entropy(out.flatten(0, 1), label.flatten())


def _sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


OPTIMIZERS = {
    "none": lambda m: None,
    "exact": lambda m: _sgd(m),
    "clip": lambda m: fxpipe.optim.overlapped(_sgd(m), max_grad_norm=1e-3),
    "clip-end": lambda m: fxpipe.optim.overlapped(_sgd(m), max_grad_norm=1e-3, speculate=False),
    "scaler": lambda m: fxpipe.optim.overlapped(
        _sgd(m), scaler=torch.amp.GradScaler("cpu", init_scale=8.0)),
    "async": lambda m: fxpipe.optim.overlapped(_sgd(m), mode="async", max_grad_norm=1.0),
}


@pytest.mark.parametrize("kind", list(OPTIMIZERS))
@pytest.mark.parametrize("param_dtype", [None, torch.bfloat16])
def test_fused_calls_do_nothing_outside_their_actions(watched, kind, param_dtype):
    torch.manual_seed(0)
    if param_dtype is None:
        model = models.GPT(depth=3).eval()
        x, y, loss_fn = torch.randint(0, 64, (6, 8)), torch.randint(0, 64, (6, 8)), ce
    else:   # (the GPT's rotary tables stay fp32)
        model = models.mlp(width=16, depth=4)
        # (the loss in fp32: torch 2.11's mse_loss backward refuses bf16 against fp32)
        x, y, loss_fn = torch.randn(6, 16), torch.randn(6, 4), lambda o, y: F.mse_loss(o.float(), y)
    pipe = fxpipe.compile(model, example_inputs=(x,), devices=["cpu", "cpu"],
                          param_dtype=param_dtype, config=fxpipe.RunConfig(num_microbatch=3))
    opt = OPTIMIZERS[kind](model)
    pipe.forward_backward((x,), label=y, loss_fn=loss_fn, optimizer=opt)   # builds the buffers
    if kind == "scaler":
        opt.scaler.update()
    with watched as found:
        pipe.forward_backward((x,), label=y, loss_fn=loss_fn, optimizer=opt, return_outputs=True)
    assert not found, "\n".join(f"{t}: {op} at {' <- '.join(reversed(w))}" for t, op, w in found)


@pytest.mark.parametrize("kind", ["infer", "eager"])
def test_other_calls_do_nothing_outside_their_actions(watched, kind):
    torch.manual_seed(0)
    model = models.GPT(depth=3).eval()
    ids, y = torch.randint(0, 64, (6, 8)), torch.randint(0, 64, (6, 8))
    pipe = fxpipe.compile(model, example_inputs=(ids,), devices=["cpu", "cpu"],
                          config=fxpipe.RunConfig(num_microbatch=3))

    def call():
        if kind == "infer":
            with torch.no_grad():
                return pipe(ids)
        out = pipe(ids)
        return out

    out = call()
    if kind == "eager":
        ce(out, y).backward()
    with watched as found:
        out = call()
    assert not found, "\n".join(f"{t}: {op} at {' <- '.join(reversed(w))}" for t, op, w in found)


def test_the_check_sees_work_outside_the_program(watched, monkeypatch):
    """What the old runtime did outside its Program (refreshing the parameters' copies on
    the caller's thread before issuing) is caught."""
    model = models.mlp(width=8, depth=2)
    x = torch.randn(4, 8)
    pipe = fxpipe.compile(model, example_inputs=(x,), devices=["cpu"])
    run = executor.Execution.run

    def refresh_first(self):
        self.call.store.refresh()
        next(iter(self.call.layers.params.values())).detach().clone()
        return run(self)

    monkeypatch.setattr(executor.Execution, "run", refresh_first)
    pipe.forward_backward((x,), loss_fn=lambda o, _: o.sum())
    with watched as found:
        pipe.forward_backward((x,), loss_fn=lambda o, _: o.sum())
    assert any("clone" in op for _, op, _ in found), found
