"""The streamed optimizer step (fxpipe.optim): equal to eager training, step for step.

The optimizers below are built with torch's defaults (``foreach=None, fused=None``), which
the streamed step runs with torch's fused CPU kernels (``fxpipe.optim_step``); their eager
references are the same optimizers built with ``fused=True`` (``reference``): the same
kernels, so bitwise. (torch's own CPU default, the for-loop, rounds differently.)"""

from __future__ import annotations

import copy
import re
import threading
import time
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxpipe
from fxpipe.optim import overlapped
from tests import models

# 6 layers (prefix, 4 blocks, suffix); the head is tied to the embedding (layers 0 and 5)
GPT_PLAN = fxpipe.ExecutePlan(fwd_plan=[range(0, 3), range(3, 5)],
                              bwd_plan=[range(5, 6), range(3, 5), range(1, 3), range(0, 1)])

OPTIMIZERS = {
    "sgd_momentum": lambda ps, **kw: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=1e-2,
                                                     **kw),
    "adam": lambda ps, **kw: torch.optim.Adam(ps, lr=1e-2, **kw),
    "adamw": lambda ps, **kw: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, **kw),
}


def reference(name, params):
    """The eager reference of ``OPTIMIZERS[name]``: the kernels the streamed step runs."""
    return OPTIMIZERS[name](params, fused=True)


def ce(out, label):
    return F.cross_entropy(out.flatten(0, 1), label.flatten())


def devices(n, **kw):
    return [fxpipe.VirtualDevice(**kw) for _ in range(n)]


def batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 64, (6, 8), generator=g), torch.randint(0, 64, (6, 8), generator=g))
            for _ in range(n)]


def gpt_pair(num_microbatch, plan=GPT_PLAN, n_devices=2):
    torch.manual_seed(0)
    model = models.GPT(depth=4).eval()
    ref = copy.deepcopy(model)
    pipe = fxpipe.compile(model, example_inputs=(torch.zeros(6, 8, dtype=torch.long),),
                          devices=devices(n_devices), plan=plan,
                          config=fxpipe.RunConfig(num_microbatch=num_microbatch))
    return model, ref, pipe


def assert_same_training_state(model, opt, ref, ref_opt, exact=True):
    for (name, p), r in zip(model.named_parameters(), ref.parameters()):
        if exact:
            assert torch.equal(p, r), f"{name}: max diff {(p - r).abs().max()}"
        else:
            torch.testing.assert_close(p, r, msg=name)
    sd, rsd = opt.state_dict(), ref_opt.state_dict()
    settings = lambda sd: [{k: v for k, v in g.items() if k != "fused"}  # noqa: E731
                           for g in sd["param_groups"]]   # the reference says fused=True
    assert settings(sd) == settings(rsd)
    assert sd["state"].keys() == rsd["state"].keys()
    for k in sd["state"]:
        for field, v in sd["state"][k].items():
            rv = rsd["state"][k][field]
            if exact:
                assert torch.equal(v, rv), f"state {k}.{field}"
            else:
                torch.testing.assert_close(v, rv)


@pytest.mark.bitwise
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_one_microbatch_equals_eager_training_bitwise(name):
    """1 microbatch: gradients are bitwise eager's, so the whole run is."""
    model, ref, pipe = gpt_pair(1)
    opt, ref_opt = OPTIMIZERS[name](model.parameters()), reference(name, ref.parameters())
    for ids, y in batches(3):
        loss = pipe.forward_backward((ids,), label=y, loss_fn=ce, optimizer=opt)
        ref_loss = ce(ref(ids), y)
        ref_loss.backward()
        ref_opt.step()
        assert torch.equal(loss, ref_loss.detach())
        assert_same_training_state(model, opt, ref, ref_opt)
        opt.zero_grad(set_to_none=True)
        ref_opt.zero_grad(set_to_none=True)


@pytest.mark.bitwise
@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("n_devices", [1, 2, 3])
def test_streamed_step_equals_step_after_the_call(name, n_devices):
    """Any microbatching: exactly what opt.step() after the same pipelined call gives."""
    model, _, pipe = gpt_pair(3, n_devices=n_devices)
    ref, _, ref_pipe = gpt_pair(3, n_devices=n_devices)
    opt, ref_opt = OPTIMIZERS[name](model.parameters()), reference(name, ref.parameters())
    for ids, y in batches(3):
        loss = pipe.forward_backward((ids,), label=y, loss_fn=ce, optimizer=opt)
        ref_loss = ref_pipe.forward_backward((ids,), label=y, loss_fn=ce)
        ref_opt.step()
        assert torch.equal(loss, ref_loss)
        for p, r in zip(model.parameters(), ref.parameters()):
            assert torch.equal(p.grad, r.grad)   # .grad holds the call's gradients, as in eager
        assert_same_training_state(model, opt, ref, ref_opt)
        opt.zero_grad()
        ref_opt.zero_grad()


@pytest.mark.bitwise
@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("max_norm", [None, 0.5, 1e6])  # None, clipping active, inactive
def test_accumulation_scheduler_clipping_equal_eager(name, max_norm):
    """k=2 accumulation, an LR schedule and global-norm clipping, against eager's loop."""
    model, ref, pipe = gpt_pair(1)
    opt, ref_opt = OPTIMIZERS[name](model.parameters()), reference(name, ref.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0 / (1 + i))
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, lambda i: 1.0 / (1 + i))
    step = overlapped(opt, accumulate=2, max_grad_norm=max_norm)
    for i, (ids, y) in enumerate(batches(6)):
        pipe.forward_backward((ids,), label=y, loss_fn=ce, optimizer=step)
        ce(ref(ids), y).backward()
        assert step.stepped == (i % 2 == 1)
        if i % 2 == 1:
            if max_norm is not None:
                torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
            ref_opt.step()
            sched.step()
            ref_sched.step()
            for p, r in zip(model.parameters(), ref.parameters()):
                assert torch.equal(p.grad, r.grad)   # clipped as eager clips .grad
            opt.zero_grad(set_to_none=True)
            ref_opt.zero_grad(set_to_none=True)
        assert_same_training_state(model, opt, ref, ref_opt)
    assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"] < opt.defaults["lr"]


def test_state_dict_loads_into_a_plain_optimizer():
    model, _, pipe = gpt_pair(2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = batches(4)
    for ids, y in data[:2]:
        pipe.forward_backward((ids,), label=y, loss_fn=ce, optimizer=opt)
        opt.zero_grad()
    _, _, ref_pipe = gpt_pair(2)
    ref_pipe.module.load_state_dict(model.state_dict())
    plain = torch.optim.AdamW(ref_pipe.module.parameters(), lr=1e-2)
    plain.load_state_dict(copy.deepcopy(opt.state_dict()))  # (torch shares 'step' tensors)
    for g in plain.param_groups:   # the loaded settings say fused=None: step as fxpipe does
        g["fused"] = True
    assert all(int(s["step"]) == 2 for s in plain.state.values())
    for ids, y in data[2:]:
        pipe.forward_backward((ids,), label=y, loss_fn=ce, optimizer=opt)
        ref_pipe.forward_backward((ids,), label=y, loss_fn=ce)
        plain.step()
        opt.zero_grad()
        plain.zero_grad()
    assert_same_training_state(model, opt, ref_pipe.module, plain)


def test_steps_overlap_the_backward():
    """The deep stages' step runs while the devices still back-propagate shallow ones."""
    model, _, pipe = gpt_pair(4)
    for d in pipe.devices:
        d.recording(True)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    starts = []
    opt.register_step_pre_hook(lambda o, a, k: starts.append(
        (time.perf_counter(), sum(len(g["params"]) for g in o.param_groups))))
    ids, y = batches(1)[0]
    pipe.forward_backward((ids,), label=y, loss_fn=ce, optimizer=opt)
    last_backward = max(t1 for d in pipe.devices for s, label, _, t1 in d.records
                        if label.startswith("5B"))   # stage 5 = layer 0, the last backward
    assert len(starts) == 4                           # one view step per backward stage
    assert starts[0][0] < last_backward               # the tail's step ran before the end
    assert sum(n for _, n in starts) == len(list(model.parameters()))


def test_program_has_one_optimizer_step_per_backward_stage():
    _, _, pipe = gpt_pair(2)
    program = pipe.program("fused", 2, optimizer=True)
    assert [str(a) for a in program.host] == ["RF", "S5:6", "S3:5", "S1:3", "S0:1", "C"]
    assert not any(str(a).startswith("S") for acts in program.actions for a in acts)


@pytest.mark.filterwarnings("ignore:Detected call of")  # the reference skips its 1st step
def test_async_is_one_step_stale():
    """mode="async": call t's gradients are taken at the weights before update t-1."""
    model, ref, pipe = gpt_pair(1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, 1, gamma=0.5)
    step = overlapped(opt, mode="async")
    pending, pending_lr = None, None
    for ids, y in batches(4):
        loss = pipe.forward_backward((ids,), label=y, loss_fn=ce, optimizer=step)
        assert step.pending
        ref_loss = ce(ref(ids), y)          # at the weights before the pending update
        ref_loss.backward()
        grads = [p.grad.clone() for p in ref.parameters()]
        if pending is not None:            # the previous update, at its own learning rate
            for p, g in zip(ref.parameters(), pending):
                p.grad = g
            lr = ref_opt.param_groups[0]["lr"]
            ref_opt.param_groups[0]["lr"] = pending_lr
            ref_opt.step()
            ref_opt.param_groups[0]["lr"] = lr
        pending, pending_lr = grads, ref_opt.param_groups[0]["lr"]
        assert torch.equal(loss, ref_loss.detach())
        sched.step()
        ref_sched.step()
        opt.zero_grad(set_to_none=True)
        ref_opt.zero_grad(set_to_none=True)
    for p, g in zip(ref.parameters(), pending):
        p.grad = g
    ref_opt.param_groups[0]["lr"] = pending_lr
    ref_opt.step()
    ref_opt.param_groups[0]["lr"] = opt.param_groups[0]["lr"]
    sd = opt.state_dict()            # applies the pending update first
    assert not step.pending
    ref_opt.zero_grad(set_to_none=True)
    assert_same_training_state(model, opt, ref, ref_opt)
    assert sd["state"][0]["step"] == 4


ARMED = {"on": False}


@torch.library.custom_op("fxpipe_test_optim::fail_in_backward", mutates_args=())
def fail_in_backward(h: torch.Tensor) -> torch.Tensor:
    return h.clone()


def _fail_backward(ctx, g):
    if ARMED["on"]:
        raise RuntimeError("boom in backward")
    return g


fail_in_backward.register_fake(lambda h: torch.empty_like(h))
fail_in_backward.register_autograd(_fail_backward, setup_context=lambda ctx, inputs, output: None)


class Stack(nn.Module):
    """Four blocks; the backward of block 0 (the last to run) fails when armed."""

    def __init__(self, width=8, depth=4):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(width, width) for _ in range(depth)])

    def forward(self, x):
        for i, b in enumerate(self.blocks):
            x = torch.tanh(b(x))
            if i == 0:
                x = torch.ops.fxpipe_test_optim.fail_in_backward(x)
        return x


@pytest.mark.parametrize("atomic", [False, True])
def test_failure_after_some_stages_stepped(atomic):
    torch.manual_seed(0)
    model = Stack()
    x = torch.randn(6, 8)
    plan = fxpipe.ExecutePlan(fwd_plan=[range(0, 2), range(2, 3)],
                              bwd_plan=[range(3, 5), range(2, 3), range(1, 2), range(0, 1)])
    pipe = fxpipe.compile(model, example_inputs=(x,), devices=devices(2), plan=plan,
                          config=fxpipe.RunConfig(num_microbatch=2))
    assert [layer.name for layer in pipe.layers] == ["blocks.0", "blocks.1", "blocks.2", "blocks.3",
                                                     "suffix"]
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    step = overlapped(opt, atomic=atomic)
    loss_fn = lambda out, _: out.square().mean()  # noqa: E731
    pipe.forward_backward((x,), loss_fn=loss_fn, optimizer=step)
    before = copy.deepcopy((model.state_dict(), opt.state_dict()))
    grads = [p.grad.clone() for p in model.parameters()]
    ARMED["on"] = True
    try:
        with pytest.raises(fxpipe.StageError, match="boom in backward") as info:
            pipe.forward_backward((x,), loss_fn=loss_fn, optimizer=step)
    finally:
        ARMED["on"] = False
    assert info.value.layers == range(0, 1)
    sd, osd = model.state_dict(), opt.state_dict()
    if atomic:  # everything as before the call
        for k, v in before[0].items():
            assert torch.equal(sd[k], v), k
        for k, st in before[1]["state"].items():
            assert all(torch.equal(osd["state"][k][f], v) for f, v in st.items())
        for p, g in zip(model.parameters(), grads):
            assert torch.equal(p.grad, g)
    else:  # the stages that stepped before the failure did so whole, and the error names them
        # exactly; which ones got there first is timing (a loaded machine may step none)
        notes = "\n".join(getattr(info.value, "__notes__", []))
        m = re.search(r"already updated layers ([-\d, ]+) \(", notes)
        spans = m[1].split(", ") if m else []
        assert set(spans) <= {"1-1", "2-2", "3-4"}, notes
        stepped = {i for span in spans for i in range(int(span.split("-")[0]),
                                                      int(span.split("-")[1]) + 1)}
        for i in range(4):
            changed = not torch.equal(sd[f"blocks.{i}.weight"], before[0][f"blocks.{i}.weight"])
            assert changed == (i in stepped), i
            assert int(osd["state"][2 * i]["step"]) == (2 if i in stepped else 1)
    pipe.forward_backward((x,), loss_fn=loss_fn, optimizer=step)  # and it still trains


def test_optimizer_argument_is_checked():
    _, _, pipe = gpt_pair(1)
    ids, y = batches(1)[0]
    with pytest.raises(TypeError, match="optimizer= takes"):
        pipe.forward_backward((ids,), label=y, loss_fn=ce, optimizer="adam")
    with pytest.raises(NotImplementedError, match="LBFGS"):
        overlapped(torch.optim.LBFGS(pipe.parameters()))
    with pytest.raises(ValueError, match="accumulate"):
        overlapped(torch.optim.SGD(pipe.parameters(), lr=1), accumulate=0)


@pytest.mark.filterwarnings("ignore:Detected call of")
def test_async_with_accumulation_applies_the_update_during_the_next_call():
    model, ref, pipe = gpt_pair(1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9, fused=True)
    step = overlapped(opt, mode="async", accumulate=2)
    data = batches(4)
    for i, (ids, y) in enumerate(data):
        pipe.forward_backward((ids,), label=y, loss_fn=ce, optimizer=step)
        assert step.stepped == (i % 2 == 1) and step.pending == (i % 2 == 1)
        if step.stepped:
            opt.zero_grad()
    # reference: calls 0, 1 at w0; update A (their gradients) applied during call 2, so
    # call 2 saw w0 and call 3 saw w1; update B applied by synchronize()
    for ids, y in data[:2]:
        ce(ref(ids), y).backward()
    grads_a = [p.grad.clone() for p in ref.parameters()]
    ref_opt.zero_grad()
    ce(ref(data[2][0]), data[2][1]).backward()          # call 2: at w0
    grads_2 = [p.grad.clone() for p in ref.parameters()]
    for p, g in zip(ref.parameters(), grads_a):         # update A
        p.grad = g
    ref_opt.step()
    for p, g in zip(ref.parameters(), grads_2):
        p.grad = g
    ce(ref(data[3][0]), data[3][1]).backward()          # call 3: at w1
    step.synchronize()                                 # update B
    ref_opt.step()
    assert not step.pending
    for p, r in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, r)


def test_simulated_optimizer_modes():
    from fxpipe.passes.schedule import build_program
    from fxpipe.sim import Hardware, LayerCost, optimizer_modes, with_optimizer_steps
    p = build_program([range(0, 3), range(3, 6)], [range(6, 8), range(4, 6), range(2, 4),
                                                    range(0, 2)], "fused", 2, 8, "stage")
    costs = [LayerCost(1.0, 2.0, param_bytes=10**6)] * 8
    free = optimizer_modes(p, costs, Hardware())
    assert free.sync_ms == free.exact_ms == free.compute_ms and free.optimizer_ms == 0
    modes = optimizer_modes(p, costs, Hardware(cpu_optimizer_bytes_per_s=2e9))   # 0.5 ms/layer
    assert modes.optimizer_ms == 4.0 and modes.sync_ms == modes.compute_ms + 4.0
    # streamed: only the last stage's two layers (1 ms) are left after the backward
    assert modes.exact_exposed_ms == pytest.approx(1.0)
    assert modes.async_ms < modes.exact_ms < modes.sync_ms
    rel = modes.relative_throughput()
    assert rel["sync"] == 1.0 and rel["async"] > rel["exact"] > 1.0
    assert [str(a) for a in with_optimizer_steps(p).host] == \
        ["RF", "S6:8", "S4:6", "S2:4", "S0:2", "C"]


# -- kernels and threads (fxpipe.optim_step) ---------------------------------------------

def train(opt_or_step, model, pipe, data):
    for ids, y in data:
        pipe.forward_backward((ids,), label=y, loss_fn=ce, optimizer=opt_or_step)
        model.zero_grad(set_to_none=True)


def eager(ref, ref_opt, data):
    for ids, y in data:
        ce(ref(ids), y).backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)


@pytest.mark.bitwise
@pytest.mark.parametrize("built", [{}, {"fused": True}])
def test_streamed_step_runs_fused_kernels_bitwise_equal_to_eager_fused(built, monkeypatch):
    """AdamW built with torch's defaults (or fused=True): the streamed step runs torch's
    fused CPU kernel, 3 steps bitwise those of eager AdamW(fused=True)."""
    calls = []
    kernel = torch._fused_adamw_
    monkeypatch.setattr(torch, "_fused_adamw_", lambda *a, **k: (calls.append(len(a[0])),
                                                                 kernel(*a, **k))[1])
    model, ref, pipe = gpt_pair(1)
    opt = OPTIMIZERS["adamw"](model.parameters(), **built)
    ref_opt = reference("adamw", ref.parameters())
    data = batches(3)
    train(opt, model, pipe, data)
    fused_calls = len(calls)
    eager(ref, ref_opt, data)
    assert_same_training_state(model, opt, ref, ref_opt)
    assert fused_calls == 3 * 4                            # each backward stage, each call
    assert sum(calls[:fused_calls]) == 3 * len(list(model.parameters()))
    assert opt.param_groups[0]["fused"] == built.get("fused")   # the user's settings stay


@pytest.mark.bitwise
@pytest.mark.parametrize("built", [{"foreach": False}, {"foreach": True}, {"fused": False}])
def test_an_implementation_the_user_chose_is_kept(built, recwarn):
    """foreach=... or fused=False: stepped as built, bitwise eager's; foreach (a choice
    that may not know fused CPU kernels exist) warns once, fused=False does not."""
    model, ref, pipe = gpt_pair(1)
    opt = OPTIMIZERS["adam"](model.parameters(), **built)
    ref_opt = OPTIMIZERS["adam"](ref.parameters(), **built)
    data = batches(3)
    train(opt, model, pipe, data)
    eager(ref, ref_opt, data)
    assert_same_training_state(model, opt, ref, ref_opt)
    mine = [str(w.message) for w in recwarn if "fxpipe: the streamed optimizer" in str(w.message)]
    if "foreach" in built:
        assert len(mine) == 1, mine                       # once, not once per call
        assert f"Adam was built with foreach={built['foreach']}, which fxpipe keeps; build it " \
               "with fused=True (or leave foreach=None)" in mine[0]
        assert "3x the parameters per second" in mine[0]
    else:
        assert mine == []


def test_optimizers_without_fused_kernels_warn_once():
    model, ref, pipe = gpt_pair(1)
    opt = torch.optim.RMSprop(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.RMSprop(ref.parameters(), lr=1e-3)
    data = batches(2)
    with pytest.warns(UserWarning, match="without torch's fused CPU kernels: RMSprop has no "
                                         "fused CPU kernel in torch.*SGD, Adam, AdamW and Adagrad"):
        train(opt, model, pipe, data[:1])
    with warnings.catch_warnings():
        warnings.simplefilter("error")                     # no second warning
        train(opt, model, pipe, data[1:])
    eager(ref, ref_opt, data)
    assert_same_training_state(model, opt, ref, ref_opt)


@pytest.mark.bitwise
def test_step_threads_give_the_same_bits_and_leave_thread_counts():
    """threads=2: each stage's step on two intra-op threads; the same result as eager
    AdamW(fused=True) after the same pipelined calls (3 microbatches), and the caller's
    count (and the one new threads adopt) as before."""
    model, _, pipe = gpt_pair(3)
    ref, _, ref_pipe = gpt_pair(3)
    opt = OPTIMIZERS["adamw"](model.parameters())
    ref_opt = reference("adamw", ref.parameters())
    step = overlapped(opt, threads=2)
    seen = []
    opt.register_step_pre_hook(lambda o, a, k: seen.append(torch.get_num_threads()))
    data = batches(3)
    train(step, model, pipe, data)
    for ids, y in data:
        ref_pipe.forward_backward((ids,), label=y, loss_fn=ce)
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
    assert_same_training_state(model, opt, ref, ref_opt)
    assert seen == [2] * 12                                # 4 stages x 3 calls, on 2 threads
    assert torch.get_num_threads() == 1                    # (the bitwise fixture's count)
    fresh = []
    t = threading.Thread(target=lambda: fresh.append(torch.get_num_threads()))
    t.start()
    t.join()
    assert fresh == [1]
    assert repr(step) == "Overlapped(AdamW, mode='exact', threads=2)"
    with pytest.raises(ValueError, match="threads must be an int >= 1"):
        overlapped(opt, threads=0)


@pytest.mark.bitwise
def test_eager_fused_step_between_calls_reaches_the_devices():
    """The user's own AdamW(fused=True).step() after the call: torch's fused kernels do not
    bump the parameters' versions, by which the parameter store sees changed weights;
    fxpipe bumps them (a step post-hook), so the next call uploads the new weights."""
    model, ref, pipe = gpt_pair(1)
    opt, ref_opt = reference("adamw", model.parameters()), reference("adamw", ref.parameters())
    for ids, y in batches(3):
        loss = pipe.forward_backward((ids,), label=y, loss_fn=ce)
        opt.step()
        opt.zero_grad()
        ref_loss = ce(ref(ids), y)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        assert torch.equal(loss, ref_loss.detach())
    assert_same_training_state(model, opt, ref, ref_opt)


def test_fused_sgd_steps_parameters_whose_first_gradient_comes_later():
    """Fused SGD steps a list all with momentum buffers or all without; a stage whose
    parameters are in both states (one was frozen on the first call) is stepped as two
    lists, as torch's for-loop steps each parameter (eager fused=True raises here)."""
    model, ref, pipe = gpt_pair(1)
    late = [model.blocks[1].up.weight, ref.blocks[1].up.weight]
    opt = OPTIMIZERS["sgd_momentum"](model.parameters())
    ref_opt = OPTIMIZERS["sgd_momentum"](ref.parameters())   # torch's for-loop
    data = batches(3)
    for i, (ids, y) in enumerate(data):
        for p in late:
            p.requires_grad_(i > 0)
        pipe.forward_backward((ids,), label=y, loss_fn=ce, optimizer=opt)
        model.zero_grad(set_to_none=True)
        ce(ref(ids), y).backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
    assert_same_training_state(model, opt, ref, ref_opt, exact=False)
    assert opt.state[late[0]]["momentum_buffer"] is not None


@pytest.mark.parametrize("make, fused, says", [
    (lambda ps: torch.optim.AdamW(ps), True, None),
    (lambda ps: torch.optim.Adagrad(ps), True, None),
    (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), True, None),
    (lambda ps: torch.optim.Adam(ps, fused=False), False, None),
    (lambda ps: torch.optim.Adam(ps, foreach=True), None, "Adam was built with foreach=True"),
    (lambda ps: torch.optim.Adam(ps, differentiable=True), None,
     "Adam was built with differentiable=True, which fused kernels do not support"),
    (lambda ps: torch.optim.Adam([nn.Parameter(torch.zeros(2, dtype=torch.complex64))]), None,
     "a param group of Adam holds a torch.complex64 torch.strided parameter on cpu"),
    (lambda ps: torch.optim.NAdam(ps), None, "NAdam has no fused CPU kernel in torch"),
])
def test_which_groups_get_fused_kernels_and_why_not(make, fused, says):
    from fxpipe.optim_step import fused_groups
    opt = make([nn.Parameter(torch.zeros(2))])
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fused_groups(opt, hyper)
        fused_groups(opt, hyper)                           # once per optimizer and reason
    assert out[0].get("fused") == fused
    assert opt.param_groups[0].get("fused") == hyper[0].get("fused")   # the optimizer's own stay
    assert len(caught) == (says is not None)
    if says is not None:
        assert f"runs without torch's fused CPU kernels: {says}" in str(caught[0].message)
