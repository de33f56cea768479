"""Reliability: failure safety per action kind, interrupts, shape changes, state, resources,
determinism. (Equivalence under fuzzing is ``test_fuzz.py``.)"""

from __future__ import annotations

import _thread
import copy
import gc
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxpipe
from fxpipe.runtime.issue import executor
from tests import models
from tests.test_runtime import _assert_state, _state, ce, devices

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# 6 layers (prefix, 4 blocks, suffix) on 2 devices; asymmetric, with a fused tail
PLAN = fxpipe.ExecutePlan(fwd_plan=[range(0, 3), range(3, 5)],
                          bwd_plan=[range(5, 6), range(3, 5), range(1, 3), range(0, 1)])
M = 3


def _gpt():
    torch.manual_seed(0)
    return models.GPT(depth=4)


def _batch(seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 64, (6, 8), generator=g), torch.randint(0, 64, (6, 8), generator=g)


def _step(pipe, style, ids, labels):
    cfg = fxpipe.RunConfig(num_microbatch=M)
    if style == "eager":
        ce(pipe(ids, run_config=cfg), labels).backward()
    else:
        pipe.forward_backward((ids,), label=labels, loss_fn=ce, run_config=cfg)


def _clone(model):
    """A deep copy with the ``.grad``s too (``Parameter.__deepcopy__`` drops them)."""
    ref = copy.deepcopy(model)
    for p, r in zip(model.parameters(), ref.parameters()):
        r.grad = None if p.grad is None else p.grad.clone()
    return ref


def _eager_step(model, ids, labels):
    ce(model(ids), labels).backward()


def _assert_same_model(model, ref, atol=2e-6):
    for (n, p), r in zip(model.named_parameters(), ref.parameters()):
        assert torch.allclose(p, r), n
        assert (p.grad is None) == (r.grad is None), n
        if p.grad is not None:
            assert torch.allclose(p.grad, r.grad, atol=atol, rtol=1e-5), \
                f"grad of {n}: {(p.grad - r.grad).abs().max()}"
    for (n, b), r in zip(model.named_buffers(), ref.buffers()):
        assert torch.equal(b, r), n


def _assert_workers_idle(pipe, limit=5.0):
    """Every stream of every device runs new work promptly: nothing left blocked."""
    for d in pipe.devices:
        for stream in ("compute", "h2d", "d2h", "prefetch", "grads", "control"):
            assert d.submit(stream, lambda: 1).result(limit) == 1, f"{d.name}/{stream} stuck"
        assert d.resident_bytes() == 0, f"{d.name} still holds {d.resident_bytes()} B"


# -- failures injected into each kind of action ------------------------------------------------

KINDS = {  # action kind -> (training styles it occurs in, has a microbatch)
    "Prefetch": (("eager", "fused"), False),
    "Upload": (("eager", "fused"), True),
    "Forward": (("eager", "fused"), True),
    "Offload": (("eager", "fused"), True),
    "FusedBackward": (("fused",), True),
    "RecomputeBackward": (("eager", "fused"), True),
    "DownloadGrads": (("eager", "fused"), False),
}
CASES = [(kind, style, mb) for kind, (styles, has_mb) in KINDS.items() for style in styles
         for mb in ((0, M - 1) if has_mb else (None,))]


@pytest.mark.parametrize("kind,style,mb", CASES, ids=[f"{k}-{s}-mb{m}" for k, s, m in CASES])
def test_failure_in_any_action_leaves_the_model_untouched(monkeypatch, kind, style, mb):
    model = _gpt()
    ids, labels = _batch()
    pipe = fxpipe.compile(model, example_inputs=(ids,), devices=devices(2), plan=PLAN)
    _step(pipe, style, ids, labels)  # a good step first: there are .grads to protect
    ref = _clone(model)
    state = _state(model)
    hits = []
    act = executor.Execution._act

    def failing_act(self, d, a):
        if type(a).__name__ == kind and getattr(a, "mb", None) == mb and not hits \
                and (kind != "Upload" or a.stage > 0):
            hits.append(str(a))
            raise RuntimeError(f"injected failure in {a}")
        return act(self, d, a)

    monkeypatch.setattr(executor.Execution, "_act", failing_act)
    with pytest.raises(fxpipe.StageError) as info:
        _step(pipe, style, *_batch(seed=2))
    assert hits, f"no {kind} action ran in a {style} step"
    err = info.value
    assert err.stage is not None and err.layers is not None and err.device in \
        {d.name for d in pipe.devices}
    assert err.microbatch == mb
    assert f"stage {err.stage}" in str(err) and err.device in str(err)
    assert "injected failure" in str(err.__cause__)
    _assert_state(model, state)
    _assert_workers_idle(pipe)

    monkeypatch.setattr(executor.Execution, "_act", act)
    _step(pipe, style, ids, labels)  # the same pipe works, and accumulates onto the old .grads
    _eager_step(ref, ids, labels)
    _assert_same_model(model, ref)


class Tripwire(nn.Module):
    """A block that fails where it is told to: in the forward without grad (a forward
    stage), in a forward with grad (recompute / the fused tail), in its backward, or in
    the loss. Python-level, so it is traced as a call (capture="fx")."""

    where: str | None = None

    def __init__(self, dim):
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, x):
        return _tripwire(torch.tanh(self.lin(x)))


class _FailingBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h):
        return h.clone()

    @staticmethod
    def backward(ctx, g):
        raise RuntimeError("tripwire: backward")


@torch.fx.wrap
def _tripwire(h):
    where = Tripwire.where
    if where == "forward" and not torch.is_grad_enabled():
        raise RuntimeError("tripwire: forward")
    if where == "recompute" and torch.is_grad_enabled():
        raise RuntimeError("tripwire: recompute")
    if where == "backward" and torch.is_grad_enabled():
        return _FailingBackward.apply(h)
    return h


class TripNet(nn.Module):
    def __init__(self, dim=8, depth=4):
        super().__init__()
        self.blocks = nn.ModuleList([Tripwire(dim) for _ in range(depth)])
        self.head = nn.Linear(dim, 3)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _loss(out, y):
    if Tripwire.where == "loss":
        raise RuntimeError("tripwire: loss")
    return F.cross_entropy(out, y)


@pytest.mark.parametrize("where,style", [("forward", "eager"), ("forward", "fused"),
                                         ("recompute", "eager"), ("recompute", "fused"),
                                         ("backward", "eager"), ("backward", "fused"),
                                         ("loss", "fused")])
def test_failures_inside_the_model_are_reported_and_undone(where, style):
    torch.manual_seed(0)
    model = TripNet()
    x, y = torch.randn(6, 8), torch.randint(0, 3, (6,))
    plan = fxpipe.ExecutePlan(fwd_plan=[range(0, 2), range(2, 4)],
                              bwd_plan=[range(4, 5), range(2, 4), range(0, 2)])
    pipe = fxpipe.compile(model, example_inputs=(x,), devices=devices(2), capture="fx", plan=plan)
    cfg = fxpipe.RunConfig(num_microbatch=3)

    def step():
        if style == "eager":
            _loss(pipe(x, run_config=cfg), y).backward()
        else:
            pipe.forward_backward((x,), label=y, loss_fn=_loss, run_config=cfg)

    step()
    ref, state = _clone(model), _state(model)
    Tripwire.where = where
    try:
        with pytest.raises((fxpipe.StageError, RuntimeError)) as info:
            step()
    finally:
        Tripwire.where = None
    err = info.value
    assert f"tripwire: {where}" in str(err) + str(err.__cause__)
    if where != "loss" or style == "fused":  # an eager-style loss runs in the caller
        assert isinstance(err, fxpipe.StageError) and err.microbatch == 0
    _assert_state(model, state)
    _assert_workers_idle(pipe)
    step()
    F.cross_entropy(ref(x), y).backward()
    _assert_same_model(model, ref)


@pytest.mark.parametrize("error", [KeyboardInterrupt, fxpipe.DeviceMemoryError])
def test_interrupt_or_out_of_memory_mid_step(monkeypatch, error):
    model = _gpt()
    ids, labels = _batch()
    pipe = fxpipe.compile(model, example_inputs=(ids,), devices=devices(2), plan=PLAN)
    _step(pipe, "fused", ids, labels)
    ref, state = _clone(model), _state(model)
    act, downloaded = executor.Execution._act, threading.Event()

    def act_then_fail(self, d, a):
        if type(a).__name__ == "RecomputeBackward" and a.stage == 3 and a.mb == 1:
            # really mid-step: after the deeper stage's gradients came back (that download
            # does not depend on this stage, so waiting for it cannot deadlock)
            assert downloaded.wait(30)
            raise error("raised mid-step")
        act(self, d, a)
        if type(a).__name__ == "DownloadGrads":
            downloaded.set()

    monkeypatch.setattr(executor.Execution, "_act", act_then_fail)
    with pytest.raises(error):
        _step(pipe, "fused", ids, labels)
    assert downloaded.is_set()
    _assert_state(model, state)
    _assert_workers_idle(pipe)
    monkeypatch.setattr(executor.Execution, "_act", act)
    _step(pipe, "fused", ids, labels)
    _eager_step(ref, ids, labels)
    _assert_same_model(model, ref)


_ctrl_c_armed = threading.Event()


@torch.fx.wrap
def _ctrl_c_once_armed(h):
    """Ctrl-C in the caller's thread, sent from a stage's compute while the call runs."""
    if _ctrl_c_armed.is_set():
        _ctrl_c_armed.clear()
        _thread.interrupt_main()  # SIGINT-like, raised in the main thread
    return h


class InterruptingBlock(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, x):
        return _ctrl_c_once_armed(torch.tanh(self.lin(x)))


def _ctrl_c_leaves_the_model_untouched(block, arm, disarm):
    """A step that ``arm()`` makes end in a Ctrl-C leaves the model as it was and every
    device idle and empty; the next step then equals eager."""
    torch.manual_seed(0)
    model = nn.Sequential(*[block(8) for _ in range(4)])
    x = torch.randn(6, 8)
    pipe = fxpipe.compile(model, example_inputs=(x,), devices=devices(2), capture="fx")
    cfg = fxpipe.RunConfig(num_microbatch=3)

    def step():
        pipe.forward_backward((x,), loss_fn=lambda out, _: out.square().mean(), run_config=cfg)

    step()
    ref, state = _clone(model), _state(model)
    # Python's own Ctrl-C handler, also where the runner started with SIGINT ignored (a
    # background job): _thread.interrupt_main() does nothing without it
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    arm()
    try:
        with pytest.raises(KeyboardInterrupt):
            step()
    finally:
        disarm()
        signal.signal(signal.SIGINT, previous)
    _assert_state(model, state)
    _assert_workers_idle(pipe)
    step()
    ref(x).square().mean().backward()
    _assert_same_model(model, ref)


def test_ctrl_c_in_the_caller_mid_step_leaves_the_model_untouched():
    _ctrl_c_leaves_the_model_untouched(InterruptingBlock, _ctrl_c_armed.set, _ctrl_c_armed.clear)


def test_ctrl_c_while_the_issue_threads_start_stops_and_frees_the_call(monkeypatch):
    """A Ctrl-C held while the issue threads start is raised when they all have: it then
    cancels and waits for what they issue, as one arriving later does."""
    issue, sent = executor.Execution._issue, []

    def interrupting_issue(self, *args):
        if not sent:
            sent.append(True)
            _thread.interrupt_main()  # reaches the caller while it starts the others
        return issue(self, *args)

    _ctrl_c_leaves_the_model_untouched(
        lambda dim: nn.Linear(dim, dim),
        lambda: monkeypatch.setattr(executor.Execution, "_issue", interrupting_issue),
        monkeypatch.undo)
    assert sent


# -- shape changes -----------------------------------------------------------------------------

def test_other_batch_sizes_and_sequence_lengths_reuse_one_graph():
    model = _gpt()
    ids, _ = _batch()
    pipe = fxpipe.compile(model, example_inputs=(ids,), devices=devices(2))
    for shape in [(6, 8), (5, 8), (4, 12), (3, 5), (3, 16)]:
        x = torch.randint(0, 64, shape)
        y = torch.randint(0, 64, shape)
        model.zero_grad()
        loss = pipe.forward_backward((x,), label=y, loss_fn=ce)
        got = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad()
        ref = ce(model(x), y)
        ref.backward()
        assert torch.allclose(loss, ref.detach(), atol=1e-6), shape
        for n, p in model.named_parameters():
            assert torch.allclose(got[n], p.grad, atol=2e-6, rtol=1e-5), (shape, n)
    assert len(pipe._cache) == 1  # shape-generic: no second capture


class Specializes(nn.Module):
    """Branches on a size, which export specializes (``static_dims``)."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(3)])

    def forward(self, x):
        for b in self.blocks:
            x = torch.tanh(b(x))
        return x * 2 if x.shape[0] == 4 else x * 3


def test_a_specialized_size_is_recaptured_once_and_cached_with_the_reason(capsys):
    model = Specializes()
    pipe = fxpipe.compile(model, example_inputs=(torch.randn(4, 8),), capture="export",
                          config=fxpipe.RunConfig(num_microbatch=1), devices=devices(2))
    assert pipe.layers.static_dims  # the premise: export specialized the batch size
    fxpipe.set_verbose(True)
    try:
        for n in (4, 6, 6, 4, 6):
            x = torch.randn(n, 8)
            assert torch.allclose(pipe(x), model(x), atol=1e-6)
    finally:
        fxpipe.set_verbose(None)
    assert len(pipe._cache) == 2
    err = capsys.readouterr().err
    assert err.count("capturing the model again") == 1
    assert "input 'x': dim 0 is 6, but the captured graph is specific to 4" in err


def test_structurally_different_calls_name_the_argument():
    model = models.KwargsModel()
    x, mask = torch.randn(4, 16), torch.ones(4, 16)
    pipe = fxpipe.compile(model, example_inputs=(x,), example_kwargs={"mask": mask},
                          devices=devices(2), config=fxpipe.RunConfig(num_microbatch=1))
    with pytest.raises(TypeError, match="missing keyword argument.*'mask'"):
        pipe(x)
    with pytest.raises(TypeError, match="unexpected keyword argument.*'extra'"):
        pipe(x, mask=mask, extra=mask)
    with pytest.raises(TypeError, match="2 positional argument.*example had 1"):
        pipe(x, x, mask=mask)
    with pytest.raises(ValueError, match="input 'mask' has 1 dims, compiled with 2"):
        pipe(x, mask=torch.ones(4))
    with pytest.raises(ValueError, match="input 'x' has 3 dims"):
        pipe(torch.randn(4, 16, 1), mask=mask)
    with pytest.raises(TypeError, match="input 'mask' was a tensor"):
        pipe(x, mask=1.0)
    assert len(pipe._cache) == 1  # none of these captured anything
    torch.testing.assert_close(pipe(x, mask=mask), model(x, mask=mask))


# -- state ---------------------------------------------------------------------------------------

def test_train_eval_on_the_pipe_or_the_model_act_on_the_model():
    torch.manual_seed(0)
    model = models.ConvNet(c=4, depth=2)
    x = torch.randn(4, 3, 8, 8)
    pipe = fxpipe.compile(model, example_inputs=(x,), devices=devices(2),
                          config=fxpipe.RunConfig(num_microbatch=1))
    ref = _clone(model)
    for switch in (lambda m: m.eval(), lambda m: m.train()):
        switch(pipe)
        assert model.training == pipe.training
        switch(ref)
        torch.testing.assert_close(pipe(x), ref(x))  # BatchNorm: batch stats or running stats
        _assert_same_model(model, ref)  # running stats updated (train) or not (eval), as eager
    model.eval()
    ref.eval()
    torch.testing.assert_close(pipe(x), ref(x))


RESUME = textwrap.dedent("""
    import sys, torch, fxpipe
    sys.path.insert(0, {repo!r})
    from tests import models
    from tests.test_runtime import ce
    torch.manual_seed(0)
    model = models.GPT(depth=3, dropout=0.1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    def batch(i):
        g = torch.Generator().manual_seed(100 + i)
        return torch.randint(0, 64, (6, 8), generator=g), torch.randint(0, 64, (6, 8), generator=g)
    start = 0
    if sys.argv[1] == "resume":
        ckpt = torch.load(sys.argv[2], weights_only=False)
        model.load_state_dict(ckpt["model"])
        start = ckpt["step"]
    pipe = fxpipe.compile(model, example_inputs=(batch(0)[0],), devices=["cpu", "cpu"])
    if sys.argv[1] == "resume":
        opt.load_state_dict(ckpt["opt"])
        torch.set_rng_state(ckpt["rng"])
    for i in range(start, 6):
        if sys.argv[1] == "save" and i == 3:
            torch.save({{"model": pipe.state_dict(), "opt": opt.state_dict(), "step": i,
                        "rng": torch.get_rng_state()}}, sys.argv[2])
        ids, labels = batch(i)
        loss = pipe.forward_backward((ids,), label=labels, loss_fn=ce)
        opt.step()
        opt.zero_grad(set_to_none=True)
        print(i, loss.item().hex())
""")


def test_save_midway_and_resume_in_a_new_process_gives_identical_losses(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(RESUME.format(repo=REPO))
    ckpt = str(tmp_path / "ckpt.pt")

    def run(mode):
        out = subprocess.run([sys.executable, str(script), mode, ckpt], capture_output=True,
                             text=True, cwd=REPO, timeout=300)
        assert out.returncode == 0, out.stderr
        return dict(line.split() for line in out.stdout.splitlines())

    full = run("save")
    resumed = run("resume")
    assert sorted(resumed) == ["3", "4", "5"]
    assert {i: full[i] for i in resumed} == resumed  # bit-identical, dropout included


# -- resources -----------------------------------------------------------------------------------

def test_import_starts_nothing():
    code = ("import threading, torch, fxpipe; "
            "print(threading.active_count(), torch.cuda.is_initialized())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=REPO)
    assert out.stdout.split() == ["1", "False"]


def _workers(pipe) -> list[threading.Thread]:
    names = tuple(f"fxpipe-{d.name}-" for d in pipe.devices)
    return [t for t in threading.enumerate() if t.name.startswith(names)]


def test_workers_start_lazily_and_stop_on_close():
    model = models.mlp(width=8, depth=4)
    x = torch.randn(4, 8)
    pipe = fxpipe.compile(model, example_inputs=(x,), devices=devices(2))
    assert not _workers(pipe)  # compiling starts no worker
    pipe(x)
    assert _workers(pipe)
    pipe.close()
    assert not _workers(pipe)
    pipe.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        pipe(x)
    assert pipe.program("infer").num_microbatches > 0  # still inspectable


def test_closing_one_pipe_leaves_shared_devices_usable():
    shared = devices(2)
    model = models.mlp(width=8, depth=4)
    x = torch.randn(4, 8)
    with fxpipe.compile(model, example_inputs=(x,), devices=shared) as a:
        a(x)
    b = fxpipe.compile(model, example_inputs=(x,), devices=shared)
    torch.testing.assert_close(b(x), model(x))
    b.close()


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs /proc for RSS")
def test_fifty_pipes_leak_no_threads_or_memory():
    torch.manual_seed(0)
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))

    def one(close: bool):
        model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)], nn.Linear(16, 4))
        pipe = fxpipe.compile(model, example_inputs=(x,), devices=["cpu", "cpu"])
        pipe.forward_backward((x,), label=y, loss_fn=F.cross_entropy)
        pipe(x)
        if close:
            pipe.close()

    def settle() -> int:
        """Collect, and let stopped workers exit; the number of threads then."""
        gc.collect()
        count, deadline = threading.active_count(), time.monotonic() + 5
        while time.monotonic() < deadline:
            time.sleep(0.05)
            count, last = threading.active_count(), count
            if count == last:
                break
        return count

    for i in range(5):  # warm up allocator and library caches
        one(close=i % 2 == 0)
    threads = settle()
    rss = _rss_bytes()
    for i in range(50):
        one(close=i % 2 == 0)  # half closed explicitly, half only dropped
    assert settle() <= threads
    growth = _rss_bytes() - rss
    assert growth < 40 * 2**20, f"RSS grew by {growth / 2**20:.1f} MiB over 50 pipes"


# -- determinism ---------------------------------------------------------------------------------

def _run_dropout_training(num_devices, steps=2):
    torch.manual_seed(0)
    model = models.GPT(depth=4, dropout=0.2)
    ids, labels = _batch()
    pipe = fxpipe.compile(model, example_inputs=(ids,), devices=devices(num_devices),
                          config=fxpipe.RunConfig(num_microbatch=3))
    torch.manual_seed(123)
    losses = [pipe.forward_backward((ids,), label=labels, loss_fn=ce) for _ in range(steps)]
    return pipe.plan, losses, {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.bitwise
def test_same_seed_is_bit_identical_across_runs_and_device_counts():
    results = {n: _run_dropout_training(n) for n in (1, 2, 3)}
    assert len({str(plan) for plan, _, _ in results.values()}) > 1  # the plans differ
    again = _run_dropout_training(2)
    for n, (_, losses, grads) in [*results.items(), ("2 again", again)]:
        _, ref_losses, ref_grads = results[1]
        assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses)), n
        for name in grads:
            assert torch.equal(grads[name], ref_grads[name]), (n, name)


def test_return_outputs_equal_eager_and_a_failing_merge_writes_nothing():
    model = _gpt()
    ids, labels = _batch()
    pipe = fxpipe.compile(model, example_inputs=(ids,), devices=devices(2), plan=PLAN)
    loss, out = pipe.forward_backward((ids,), label=labels, loss_fn=ce, return_outputs=True,
                                      run_config=fxpipe.RunConfig(num_microbatch=M))
    torch.testing.assert_close(out, model(ids))  # made by the fused tail, on the host
    state = _state(model)

    def broken_merge(outs):
        raise ValueError("cannot merge")

    with pytest.raises(ValueError, match="cannot merge"):
        pipe.forward_backward((ids,), label=labels, loss_fn=ce, return_outputs=True,
                              run_config=fxpipe.RunConfig(num_microbatch=M,
                                                          merge_output=broken_merge))
    _assert_state(model, state)


def test_a_new_but_equal_plan_per_call_reuses_one_runner():
    model, x = nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)]), torch.randn(6, 4)
    pipe = fxpipe.compile(model, (x,), devices=devices(2))
    for _ in range(5):  # the natural loop: a fresh RunConfig and ExecutePlan every call
        plan = fxpipe.ExecutePlan([range(0, 2)], [range(2, 4), range(0, 2)])
        pipe.forward_backward((x,), loss_fn=lambda out, _: out.sum(),
                              run_config=fxpipe.RunConfig(execute_plan=plan))
    assert len(pipe._current.runners) == 1  # not one lowered copy of the model per call
