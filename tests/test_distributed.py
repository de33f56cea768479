"""Data parallel across processes (issue 18): 2 and 3 ranks on localhost (gloo, spawned
with ``torch.multiprocessing``, two virtual devices per rank) against one process
training the concatenated batch with eager PyTorch.

Spawning is slow (each rank imports torch): each group of ranks runs every check in
one spawn (``_checks``), the failure check last (it leaves fxpipe's process group dead).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from collections.abc import Iterator

import expecttest
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

import fxpipe
from fxpipe.optim import overlapped

ROWS = 6          # rows per rank and microstep
TIMEOUT = 20.0    # collective_timeout of the pipes (seconds)
ce = nn.functional.cross_entropy


class Scale(nn.Module):
    """A buffer the forward reads (broadcast from rank 0: ``BC``)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("s", torch.ones(()))

    def forward(self, x):
        return x * self.s


class Gain(nn.Module):
    """A trainable scalar: fewer elements than ranks, so some ranks own none of it."""

    def __init__(self):
        super().__init__()
        self.g = nn.Parameter(torch.full((1,), 1.5))

    def forward(self, x):
        return x * self.g


def make_model(hidden: int = 8) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, hidden), nn.Tanh(), nn.Linear(hidden, 7), Gain(),
                         nn.Tanh(), nn.Linear(7, 5), Scale(), nn.Linear(5, 3))


def data(world: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The concatenated batch of every rank for ``step`` (rank r has rows r*ROWS...)."""
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(ROWS * world, 4, generator=g), torch.randint(0, 3, (ROWS * world,),
                                                                    generator=g)


def mine(t: torch.Tensor, rank: int) -> torch.Tensor:
    return t[rank * ROWS:(rank + 1) * ROWS]


def compile_dp(model: nn.Module, rank: int, **kw) -> fxpipe.PipelineModule:
    x, _ = data(1, 0)
    kw = {"devices": ["cpu", "cpu"], "data_parallel": True, **kw}
    return fxpipe.compile(model, (x,), collective_timeout=TIMEOUT, **kw)


def assert_close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a is not None and b is not None, what
    err = (a - b).abs().max().item()
    assert err <= 1e-6, f"{what}: max error {err:.3g}"


def assert_grads(model: nn.Module, ref: nn.Module, what: str) -> None:
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_close(p.grad, q.grad, f"{what}: {name}.grad")


def assert_params(model: nn.Module, ref: nn.Module, what: str) -> None:
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_close(p.detach(), q.detach(), f"{what}: {name}")


def mean_across(t: torch.Tensor) -> torch.Tensor:
    t = t.clone()
    dist.all_reduce(t)
    return t / dist.get_world_size()


# ----------------------------------------------------------------------------- the checks

def check_gradients(rank: int, world: int) -> None:
    """One fused step and one eager-style step: loss and every .grad equal eager on the
    concatenated batch; the buffer is rank 0's on every rank (BC)."""
    X, Y = data(world, 0)
    ref = make_model()
    ce(ref(X), Y).backward()
    model = make_model()
    model[6].s.fill_(1.0 + rank)        # rank 0's value wins
    pipe = compile_dp(model, rank)
    with pipe.trace() as rec:
        loss = pipe.forward_backward((mine(X, rank),), label=mine(Y, rank), loss_fn=ce)
    host = [str(a) for a in pipe.program("fused").host]
    assert host[:2] == ["RF", "BC"] and "AR0:1" in host, host
    assert sorted(a for d, a in rec.actions if d == -1) == sorted(host)  # what ran is printed
    assert model[6].s.item() == 1.0
    assert_close(mean_across(loss), ce(ref(X), Y).detach(), "fused loss")
    assert_grads(model, ref, "fused")
    # eager style: pipe(x) ... .backward()
    model.zero_grad()
    ref.zero_grad()
    out = pipe(mine(X, rank))
    ce(out, mine(Y, rank)).backward()
    ce(ref(X), Y).backward()
    assert_grads(model, ref, "pipe(x).backward()")
    # a second synchronized call before zero_grad accumulates, as DDP does
    pipe.forward_backward((mine(X, rank),), label=mine(Y, rank), loss_fn=ce)
    ce(ref(X), Y).backward()
    assert_grads(model, ref, "accumulated without zero_grad")
    pipe.close()


class Tied(nn.Module):
    """An embedding tied to the output projection: one parameter, two stages."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(11, 6)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(3))
        self.out = nn.Linear(6, 11, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, ids):
        x = self.embed(ids)
        for b in self.blocks:
            x = b(x)
        return self.out(x)


def check_tied(rank: int, world: int) -> None:
    """A weight shared by the first and the last stage is reduced once, with the last."""
    g = torch.Generator().manual_seed(7)
    ids, y = torch.randint(0, 11, (ROWS * world,), generator=g), \
        torch.randint(0, 11, (ROWS * world,), generator=g)
    ref, model = Tied(), Tied()
    ce(ref(ids), y).backward()
    pipe = fxpipe.compile(model, (mine(ids, rank),), devices=["cpu", "cpu"],
                          data_parallel=True, collective_timeout=TIMEOUT)
    pipe.forward_backward((mine(ids, rank),), label=mine(y, rank), loss_fn=ce)
    assert_grads(model, ref, "tied")
    pipe.close()


def check_streamed_optimizer(rank: int, world: int) -> None:
    """The streamed exact optimizer over 3 steps equals eager on the whole batch."""
    ref, model = make_model(), make_model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9, fused=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    pipe = compile_dp(model, rank)
    three_steps(pipe, model, opt, ref, ref_opt, rank, world, "streamed")
    pipe.close()


def same_on_every_rank(model: nn.Module, what: str) -> None:
    """Every rank holds bitwise the same parameters."""
    flat = torch.cat([p.detach().float().flatten() for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    assert all(torch.equal(g, flat) for g in gathered), f"{what}: the ranks differ"


def three_steps(pipe, model, opt, ref, ref_opt, rank: int, world: int, what: str,
                n: int = 3, batch=data, clip: tuple = (), speculate: bool = True) -> None:
    """``n`` steps of ``pipe`` with ``opt`` on this rank's share of the batch, each equal
    to eager ``ref`` stepping ``ref_opt`` on the whole batch (loss averaged across ranks),
    the ranks identical after each. ``clip``: each step's ``max_grad_norm`` (None: no
    clipping), eager's ``clip_grad_norm_`` against ``overlapped(opt, max_grad_norm=,
    speculate=)``."""
    for step in range(n):
        X, Y = batch(world, step)
        loss_ref = ce(ref(X), Y)
        loss_ref.backward()
        limit = clip[step] if step < len(clip) else None
        if limit is not None:
            norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), limit)
        ref_opt.step()
        ref_opt.zero_grad()
        stepper = opt if limit is None else overlapped(opt, max_grad_norm=limit,
                                                       speculate=speculate)
        loss = pipe.forward_backward((mine(X, rank),), label=mine(Y, rank), loss_fn=ce,
                                     optimizer=stepper)
        opt.zero_grad()
        if limit is not None:
            assert abs(stepper.grad_norm.item() / norm.item() - 1) < 1e-6, \
                (what, step, stepper.grad_norm, norm)
        assert_close(mean_across(loss), loss_ref.detach(), f"{what} step {step} loss")
        assert_params(model, ref, f"{what}, after step {step}")
        same_on_every_rank(model, f"{what}, after step {step}")


def check_clipped_first(rank: int, world: int, data_parallel: bool | str = True) -> None:
    """Sharded, clipped without speculation (``overlapped(opt, speculate=False)``): the
    shards reduced, the ranks' norm of them (``N``), then every stage stepped once (and
    gathered: ``AG``; zero3 writes them); 3 SGD steps with momentum (clipped, kept,
    clipped; SGD moves as the clipped gradient does) equal eager's ``clip_grad_norm_`` +
    step on the whole batch."""
    ref, model = make_model(), make_model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    pipe = compile_dp(model, rank, shard_optimizer=True, data_parallel=data_parallel)
    host = [str(a) for a in pipe.program(optimizer=overlapped(opt, max_grad_norm=1.0,
                                                              speculate=False)).host]
    assert host.index("N") < min(i for i, a in enumerate(host) if a.startswith("S")), host
    three_steps(pipe, model, opt, ref, ref_opt, rank, world, f"{data_parallel} clipped first",
                clip=(0.05, 1e3, 0.05), speculate=False)
    pipe.close()


def check_async_reads_the_weights_before_the_update(rank: int, world: int) -> None:
    """``overlapped(opt, mode="async")``: a call computes on the weights before the
    previous call's update, which it applies meanwhile, on every rank. A rank's buffer
    broadcast (``BC``, on its collective thread) refreshed every upload copy, so on rank
    1 the call's snapshot of the parameters took whatever part of the update had landed
    (here all of it: the broadcast waits until the update is applied)."""
    import time
    from fxpipe.runtime.issue.distributed import DataParallel
    ref, model = make_model(), make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    pipe = compile_dp(model, rank)
    stepper = overlapped(opt, mode="async")
    original = DataParallel.broadcast_buffers

    def late(self, *args) -> None:
        time.sleep(0.2)   # after the host thread's AsyncUpdate
        original(self, *args)

    DataParallel.broadcast_buffers = late
    try:
        losses = []
        for step in range(3):
            X, Y = data(world, step)
            losses.append(pipe.forward_backward((mine(X, rank),), label=mine(Y, rank),
                                                loss_fn=ce, optimizer=stepper))
            opt.zero_grad()
    finally:
        DataParallel.broadcast_buffers = original
    stepper.synchronize()
    pipe.close()

    def share_loss(step: int) -> float:
        X, Y = data(world, step)
        return ce(ref(mine(X, rank)), mine(Y, rank)).item()

    # calls 0 and 1 compute on the original weights (call 0's update lands during call 1),
    # call 2 on those of call 0's update: the whole batch's gradient there
    expected = [share_loss(0), share_loss(1)]
    X, Y = data(world, 0)
    ce(ref(X), Y).backward()
    torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9).step()
    expected.append(share_loss(2))
    assert max(abs(a.item() - b) for a, b in zip(losses, expected)) <= 1e-6, (losses, expected)


def check_no_sync(rank: int, world: int) -> None:
    """Two microsteps, the first without the all-reduce, equal one big batch; in both
    training styles, and with ``sync_gradients=False``."""
    (X0, Y0), (X1, Y1) = data(world, 0), data(world, 1)
    ref = make_model()
    ce(ref(torch.cat([X0, X1])), torch.cat([Y0, Y1])).backward()
    half = lambda out, y: ce(out, y) / 2  # noqa: E731 — the mean over both microsteps
    model = make_model()
    pipe = compile_dp(model, rank)
    assert not any(str(a).startswith("AR") for a in pipe.program(sync_gradients=False).host)
    with pipe.no_sync():
        pipe.forward_backward((mine(X0, rank),), label=mine(Y0, rank), loss_fn=half)
    pipe.forward_backward((mine(X1, rank),), label=mine(Y1, rank), loss_fn=half)
    assert_grads(model, ref, "fused, no_sync()")
    model.zero_grad()
    pipe.forward_backward((mine(X0, rank),), label=mine(Y0, rank), loss_fn=half,
                          sync_gradients=False)
    pipe.forward_backward((mine(X1, rank),), label=mine(Y1, rank), loss_fn=half)
    assert_grads(model, ref, "fused, sync_gradients=False")
    model.zero_grad()
    with pipe.no_sync():
        half(pipe(mine(X0, rank)), mine(Y0, rank)).backward()
    half(pipe(mine(X1, rank)), mine(Y1, rank)).backward()
    assert_grads(model, ref, "pipe(x).backward(), no_sync()")
    # accumulate=2: the call that does not step does not synchronize either
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ref_opt.step()
    model.zero_grad()
    step = overlapped(torch.optim.SGD(model.parameters(), lr=0.1), accumulate=2)
    pipe.forward_backward((mine(X0, rank),), label=mine(Y0, rank), loss_fn=half, optimizer=step)
    assert not step.stepped
    pipe.forward_backward((mine(X1, rank),), label=mine(Y1, rank), loss_fn=half, optimizer=step)
    assert step.stepped
    assert_params(model, ref, "accumulate=2")
    with pipe.no_sync(), pytest.raises(ValueError, match="parameters would differ"):
        pipe.forward_backward((mine(X1, rank),), label=mine(Y1, rank), loss_fn=half,
                              optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    pipe.close()


def check_shard_optimizer(rank: int, world: int) -> None:
    """``shard_optimizer=True`` equals unsharded data parallel (= eager on the whole
    batch) over 3 AdamW steps, the last two clipped (``max_grad_norm`` 0.05: the
    speculated steps redone, clipped; 1e3: kept); this rank keeps about 1/N of the
    optimizer state."""
    ref, model = make_model(), make_model()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01, fused=True)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    pipe = compile_dp(model, rank, shard_optimizer=True)
    host = [str(a) for a in pipe.program(optimizer=True).host]
    assert any(a.startswith("RS") for a in host) and any(a.startswith("AG") for a in host)
    predicted = fxpipe.plan.predict_memory(pipe, loss_fn=ce, label=mine(data(world, 0)[1], rank),
                                           optimizer=opt).host["optimizer"]
    three_steps(pipe, model, opt, ref, ref_opt, rank, world, "sharded", clip=(None, 0.05, 1e3))
    full = sum(t.numel() * t.element_size() for s in ref_opt.state.values()
               for t in s.values() if t.dim() > 0)
    state = opt._fxpipe_overlapped.shard_state
    shard = sum(t.numel() * t.element_size() for s in state.values() for t in s.values()
                if t.dim() > 0)
    assert not opt.state   # the state lives in the shards
    assert abs(shard - full / world) <= 0.05 * full / world + 64 * world, (shard, full)
    # predicted before the first step: this rank's pieces, their steps included
    assert predicted == sum(t.numel() * t.element_size() for s in state.values()
                            for t in s.values()), (predicted, state)
    with pytest.raises(NotImplementedError, match="sharded"):
        opt.state_dict()
    pipe.close()


def check_shard_across_plans(rank: int, world: int) -> None:
    """Each rank owns the same pieces of each parameter whatever the plan: a call under
    another plan (other backward stages, so other buckets) steps with the same optimizer
    state and masters, equal to eager AdamW on the whole batch."""
    ref, model = make_model(), make_model()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    pipe = compile_dp(model, rank, shard_optimizer=True)
    n = len(pipe.layers)
    other = fxpipe.ExecutePlan([range(0, n - 2)],
                               [range(n - 2, n), range(2, n - 2), range(0, 2)])
    assert other.bwd_plan != pipe.plan.bwd_plan
    for step, plan in enumerate([None, other, None, other]):
        X, Y = data(world, step)
        ce(ref(X), Y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        pipe.forward_backward((mine(X, rank),), label=mine(Y, rank), loss_fn=ce, optimizer=opt,
                              run_config=fxpipe.RunConfig(execute_plan=plan))
        opt.zero_grad()
        assert_params(model, ref, f"step {step} under {plan or pipe.plan}")
    pipe.close()


def check_sharded_masters(rank: int, world: int) -> None:
    """``shard_optimizer=True`` with ``param_dtype=bf16``: each rank keeps 1/N of the fp32
    masters, the parameters are their bf16 copies; 3 AdamW steps equal unsharded data
    parallel in bf16 (losses; masters gathered vs the unsharded fp32 parameters; the
    parameters are the masters cast), the last two clipped (the first clipping: the
    speculated steps of the masters redone). ``pipe.load_state_dict`` sets the masters at
    full precision; a parameter written outside fxpipe warns and re-reads its master."""
    bf16 = torch.bfloat16
    ref, model = make_model(), make_model()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    ref_pipe = compile_dp(ref, rank, param_dtype=bf16)
    pipe = compile_dp(model, rank, param_dtype=bf16, shard_optimizer=True)
    assert all(p.dtype == bf16 and p.grad_dtype == torch.float32 for p in model.parameters())
    assert all(p.dtype == torch.float32 for p in ref.parameters())
    full = sum(p.numel() * 4 for p in ref.parameters())
    mine_bytes = sum(m.numel() * m.element_size() for m in pipe._dp.masters.values())
    assert abs(mine_bytes - full / world) <= 4 * world * len(list(ref.parameters())), \
        (mine_bytes, full)
    predicted = fxpipe.plan.predict_memory(pipe, loss_fn=ce, label=mine(data(world, 0)[1], rank),
                                           optimizer=opt).host
    assert predicted["masters"] == mine_bytes
    for step in range(3):
        X, Y = data(world, step)
        limit = (None, 0.05, 1e3)[step]
        steppers = [o if limit is None else overlapped(o, max_grad_norm=limit)
                    for o in (ref_opt, opt)]
        losses = [p.forward_backward((mine(X, rank),), label=mine(Y, rank), loss_fn=ce,
                                     optimizer=o) for p, o in zip((ref_pipe, pipe), steppers)]
        if limit is not None:
            assert_close(steppers[1].grad_norm, steppers[0].grad_norm, f"step {step} norm")
        ref_opt.zero_grad()
        opt.zero_grad()
        assert_close(losses[1], losses[0], f"step {step} loss")
        if step == 0:   # AdamW's moments and step of this rank's fp32 pieces
            state = opt._fxpipe_overlapped.shard_state
            assert predicted["optimizer"] == sum(t.numel() * t.element_size()
                                                 for s in state.values() for t in s.values())
        masters = pipe.full_state_dict()
        for name, q in ref.named_parameters():
            assert masters[name].dtype == torch.float32
            assert_close(masters[name], q.detach(), f"step {step}: master {name}")
            assert torch.equal(model.get_parameter(name).detach(), masters[name].to(bf16)), name
    assert torch.equal(masters["6.s"], model[6].s)    # buffers: the model's own
    # fp32 weights in: the masters take them exactly
    pipe.load_state_dict(ref.state_dict())
    for name, q in ref.named_parameters():
        assert torch.equal(pipe.full_state_dict()[name], q.detach()), name
    # outside fxpipe, in place or by replacing .data: the masters are re-read (a warning)
    # before a step, and before gathering them (a checkpoint would save the edit too)
    with torch.no_grad():
        model[0].weight.mul_(2)
    X, Y = data(world, 3)
    with pytest.warns(UserWarning, match=r"\(0\.weight\) changed outside fxpipe"):
        pipe.forward_backward((mine(X, rank),), label=mine(Y, rank), loss_fn=ce, optimizer=opt)
    model[2].bias.data = torch.full_like(model[2].bias, 0.25)
    with pytest.warns(UserWarning, match=r"\(2\.bias\) changed outside fxpipe"):
        edited = pipe.full_state_dict()
    assert torch.equal(edited["2.bias"], torch.full((7,), 0.25))
    ref_pipe.close()
    pipe.close()


def check_checkpoint(rank: int, world: int, folder: str, shard: bool,
                     param_dtype: torch.dtype | None = None,
                     data_parallel: bool | str = True) -> None:
    """Save after 2 steps (DCP, every rank), run 2 more; a fresh model, pipe and optimizer
    loading the checkpoint give bit-identical later losses and parameters (and fp32
    masters, sharded with ``param_dtype``)."""
    def train(steps, model, pipe, opt):
        losses = []
        for step in steps:
            X, Y = data(world, step)
            losses.append(pipe.forward_backward((mine(X, rank),), label=mine(Y, rank),
                                                loss_fn=ce, optimizer=opt))
            opt.zero_grad()
        return losses

    path = f"{folder}/ckpt-{'sharded' if shard else 'unsharded'}-{param_dtype}-{data_parallel}"
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    pipe = compile_dp(model, rank, shard_optimizer=shard, param_dtype=param_dtype,
                      data_parallel=data_parallel)
    train(range(2), model, pipe, opt)
    pipe.save_checkpoint(path, opt)
    later = train(range(2, 4), model, pipe, opt)
    masters = pipe.full_state_dict()
    pipe.close()
    torch.manual_seed(123)
    fresh = make_model()
    for p in fresh.parameters():          # other weights: the checkpoint must set them
        p.data.add_(1.0)
    opt2 = torch.optim.AdamW(fresh.parameters(), lr=0.5)
    pipe2 = compile_dp(fresh, rank, shard_optimizer=shard, param_dtype=param_dtype,
                       data_parallel=data_parallel)
    pipe2.load_checkpoint(path, opt2)
    again = train(range(2, 4), fresh, pipe2, opt2)
    assert [x.item() for x in again] == [x.item() for x in later], (again, later)
    for p, q in zip(fresh.parameters(), model.parameters()):
        assert torch.equal(p, q)
    for name, value in pipe2.full_state_dict().items():
        assert torch.equal(value, masters[name]), name
    pipe2.close()


def check_checkpoints(rank: int, world: int) -> None:
    folder = os.environ["FXPIPE_TEST_FOLDER"]
    check_checkpoint(rank, world, folder, shard=True)
    check_checkpoint(rank, world, folder, shard=False)
    check_checkpoint(rank, world, folder, shard=True, param_dtype=torch.bfloat16)


def check_mismatch(rank: int, world: int) -> None:
    """Ranks compiling different parameter shapes fail at compile time, on every rank."""
    model = make_model(hidden=8 if rank == 0 else 9)
    with pytest.raises(ValueError, match=r"ranks differ in the parameters .*rank 1 has"):
        compile_dp(model, rank)


def check_batch_mismatch(rank: int, world: int) -> None:
    """#58: a rank whose batch differs from the others' (its last, smaller batch) raises
    on every rank before any collective of the call, naming the ranks' shapes; nothing
    ran, so the ranks train on afterwards with equal batches."""
    model = make_model()
    pipe = compile_dp(model, rank)
    X, Y = data(world, 0)
    x, y = mine(X, rank), mine(Y, rank)
    before = [p.detach().clone() for p in model.parameters()]
    short = (x[:-2], y[:-2]) if rank == 1 else (x, y)
    with pytest.raises(fxpipe.errors.DistributedError,
                       match=r"batches differ: rank \d has 3 microbatches: .*\(\d, 4\).*"
                             r"rank \d has .*drop_last"):
        pipe.forward_backward((short[0],), label=short[1], loss_fn=ce)
    assert all(p.grad is None for p in model.parameters())   # nothing ran
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    pipe.forward_backward((x,), label=y, loss_fn=ce)           # equal batches: it trains
    assert all(p.grad is not None for p in model.parameters())
    pipe.close()


def check_failure(rank: int, world: int, shard: bool = False,
                  param_dtype: torch.dtype | None = None, on_devices: bool = False,
                  clip: bool = False, zero3: bool = False) -> None:
    """Rank 1 fails in the middle of a step's backward (after deeper stages were reduced
    and stepped): every rank raises within the timeout, rank 0 a DistributedError naming
    rank 1, and every rank's parameters and .grad are as before the call. Leaves the pipe's
    process group dead: a later call says so. ``on_devices`` (``data_parallel="device"``,
    sharded): rank 1 fails in its shallowest stage's device reduce-scatter, where the
    other ranks' devices wait for it (tests/test_dp_devices.py). ``clip`` (sharded): rank
    1 fails redoing the clipped step, after the norm decided it, while the others gather
    their redone shards. ``zero3`` (``data_parallel="zero3"``, tests/test_zero3.py): the
    ranks share the parameters, each putting back the pieces it wrote."""
    import fxpipe.optim
    from fxpipe.runtime.host.param_store import ParamStore
    from fxpipe.runtime.issue.distributed import DataParallel

    model = make_model()
    opt = overlapped(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                     **({"max_grad_norm": 1e-3} if clip else {"atomic": True}))
    on_devices = on_devices or zero3
    shard = shard or on_devices
    pipe = compile_dp(model, rank, shard_optimizer=shard, param_dtype=param_dtype,
                      **({"data_parallel": "zero3" if zero3 else "device"} if on_devices else {}))
    X, Y = data(world, 0)
    x, y = mine(X, rank), mine(Y, rank)
    pipe.forward_backward((x,), label=y, loss_fn=ce, optimizer=opt)   # grads + momentum exist
    before = [(p.detach().clone(), None if p.grad is None else p.grad.clone())
              for p in model.parameters()]
    state_before = {k: [v.clone() for v in s.values() if torch.is_tensor(v)]
                    for k, s in opt.shard_state.items()}
    masters_before = {n: m.clone() for n, m in pipe._dp.masters.items()}
    assert bool(masters_before) == (param_dtype is not None)
    owner, name, at = (DataParallel, "device_reduce", 4) if on_devices else \
        (ParamStore, "download_grads", 1)   # the stage: that argument of that method
    if clip:
        owner, name = fxpipe.optim, "step_shards"
    original = getattr(owner, name)
    shallowest = len(pipe.program().stages) - 1
    normed = DataParallel.total_norm

    def failing(self, *args, **kwargs):
        if clip:   # fxpipe.optim.step_shards(opt, ...), once the norm decided the redo
            if opt.optimizer.__dict__.get("redo"):
                raise RuntimeError("injected failure")
            return original(self, *args, **kwargs)
        if args[at - 1] == shallowest:
            raise RuntimeError("injected failure")
        return original(self, *args, **kwargs)

    def total_norm(self, *args):
        total = normed(self, *args)
        opt.optimizer.__dict__["redo"] = True
        return total

    if rank == 1:
        setattr(owner, name, failing)
        DataParallel.total_norm = total_norm
    start = time.monotonic()
    try:
        with pytest.raises(Exception) as info:
            pipe.forward_backward((x,), label=y, loss_fn=ce, optimizer=opt)
    finally:
        setattr(owner, name, original)
        DataParallel.total_norm = normed
    elapsed = time.monotonic() - start
    assert elapsed < TIMEOUT / 2, f"rank {rank} took {elapsed:.1f} s to fail: {info.value!r}"
    if rank == 1:
        assert "injected failure" in str(info.value)
    else:
        assert isinstance(info.value, fxpipe.DistributedError), repr(info.value)
        assert info.value.rank == 1 and "rank 1" in str(info.value), str(info.value)
    if zero3:   # every rank has put its pieces back
        dist.barrier()
    for (p0, g0), p in zip(before, model.parameters()):
        assert torch.equal(p0, p.detach()), "half-written parameters"
        assert (g0 is None and p.grad is None) or torch.equal(g0, p.grad), "half-written .grad"
    if shard:
        assert {k: [v.clone() for v in s.values() if torch.is_tensor(v)]
                for k, s in opt.shard_state.items()}.keys() == state_before.keys()
        for k, s in opt.shard_state.items():
            for v, v0 in zip([v for v in s.values() if torch.is_tensor(v)], state_before[k]):
                assert torch.equal(v, v0), f"half-written shard state {k}"
    for n, m in pipe._dp.masters.items():
        assert torch.equal(m, masters_before[n]), f"half-written master {n}"
    with pytest.raises(fxpipe.DistributedError, match="cannot be used again"):
        pipe.forward_backward((x,), label=y, loss_fn=ce, optimizer=opt if zero3 else None)
    pipe.close()


def check_hf_bf16(rank: int, world: int, data_parallel: bool | str = True) -> None:
    """A Hugging Face Llama in bf16 (``param_dtype``): each rank trains its share of the
    batch; the averaged losses and the masters after 2 AdamW steps follow the bf16 eager
    reference (``hf_zoo.Eager``) on the whole batch, and every rank holds the same.
    ``data_parallel="device"``: the gradients reduced in bf16 on the devices, the masters
    sharded (tests/test_dp_devices.py)."""
    import copy
    pytest.importorskip("transformers")
    from tests import hf_zoo
    model, kw, _, loss_fn = hf_zoo.setup("llama")    # 4 rows, labels = ids (no padding label)
    ref = hf_zoo.Eager(copy.deepcopy(model), "param_dtype")
    rows = kw["input_ids"].shape[0] // world
    part = {k: v[rank * rows:(rank + 1) * rows] for k, v in kw.items()}
    pipe = fxpipe.compile(model, example_kwargs=part, devices=["cpu", "cpu"],
                          data_parallel=data_parallel, collective_timeout=TIMEOUT,
                          param_dtype=torch.bfloat16, config=fxpipe.RunConfig(num_microbatch=2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.master.parameters(), lr=1e-2, fused=True)
    before = torch.cat([p.detach().float().flatten() for p in model.parameters()])
    for _ in range(2):
        loss = pipe.forward_backward((), part, loss_fn=loss_fn, optimizer=opt)
        dist.all_reduce(loss)
        ref_loss = ref.step(kw, None, loss_fn)
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        assert abs(loss.item() / world - ref_loss.item()) <= 2e-2 * ref_loss.item(), \
            (loss.item() / world, ref_loss.item())
        same_on_every_rank(model, "bf16")
    if data_parallel is True:   # unsharded: the parameters are their own fp32 masters
        assert all(p.dtype == torch.float32 for p in model.parameters())
    masters = pipe.full_state_dict()
    after = torch.cat([masters[n].float().flatten() for n, _ in model.named_parameters()])
    ref_after = torch.cat([p.detach().flatten() for p in ref.master.parameters()])
    moved, ref_moved = after - before, ref_after - before
    cos = (moved @ ref_moved / (moved.norm() * ref_moved.norm())).item()
    assert cos >= 0.9, f"updates' cosine {cos:.3f}"
    pipe.close()


def check_subgroup(rank: int, world: int) -> None:
    """``process_group=`` a user's subgroup (ranks 0 and 1 of 3; rank 2 makes no fxpipe
    group): two clipped AdamW steps, reduced on the devices, equal eager on the two
    ranks' batch; then that pipe is closed and a second one over the same ranks trains too
    (torch names a subgroup's groups by the count of live groups: had the first pipe's
    been destroyed, the second's would take their names and read their stale rendezvous)."""
    sub = dist.new_group([0, 1])
    if rank >= 2:
        return
    for attempt in range(2):
        ref, model = make_model(), make_model()
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01)
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        pipe = compile_dp(model, rank, data_parallel="device", process_group=sub)
        for step in range(2):
            X, Y = data(2, step)
            ce(ref(X), Y).backward()
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
            ref_opt.step()
            ref_opt.zero_grad()
            pipe.forward_backward((mine(X, rank),), label=mine(Y, rank), loss_fn=ce,
                                  optimizer=overlapped(opt, max_grad_norm=0.05))
            assert_params(model, ref, f"subgroup, pipe {attempt}, step {step}")
        pipe.close()


def check_failure_sharded(rank: int, world: int) -> None:
    """The same with shard_optimizer=True: stepped shards and their state put back, the
    fp32 masters too when they are sharded (param_dtype); and failing in a clipped redo."""
    check_failure(rank, world, shard=True)
    check_failure(rank, world, shard=True, param_dtype=torch.bfloat16)
    check_failure(rank, world, shard=True, param_dtype=torch.bfloat16, clip=True)


CHECKS = {
    2: [check_gradients, check_tied, check_streamed_optimizer,
        check_async_reads_the_weights_before_the_update, check_no_sync,
        check_shard_optimizer, check_clipped_first, check_shard_across_plans,
        check_sharded_masters,
        check_checkpoints, check_mismatch, check_batch_mismatch, check_hf_bf16, check_failure,
        check_failure_sharded],
    3: [check_gradients, check_no_sync, check_shard_optimizer, check_sharded_masters,
        check_subgroup],
}


def _rank_main(rank: int, world: int, folder: str, checks: str = "") -> None:
    """Run ``CHECKS[world]``, or the checks named in ``checks`` (comma-separated; a name
    of this module, or ``module:name``)."""
    import importlib
    import zlib

    def named(c: str):
        module, _, name = c.rpartition(":")
        return getattr(importlib.import_module(module), name) if module else globals()[c]

    import faulthandler   # a rank that aborts (gloo's C++) says in which check, on stderr
    faulthandler.enable(all_threads=True)
    torch.set_num_threads(1)
    os.environ["FXPIPE_TEST_FOLDER"] = folder
    dist.init_process_group(
        "gloo", init_method=f"file://{folder}/store"
        f"{f'-{zlib.crc32(checks.encode()):08x}' if checks else ''}", rank=rank,
        world_size=world)
    try:
        for check in [named(c) for c in checks.split(",")] if checks else CHECKS[world]:
            try:
                check(rank, world)
            except BaseException as e:
                import traceback
                with open(f"{folder}/rank{rank}.err", "w") as f:
                    f.write(f"rank {rank}/{world}: {check.__name__}: {type(e).__name__}: {e}\n")
                    traceback.print_exc(file=f)
                raise
            dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_data_parallel(world, tmp_path):
    spawn(world, tmp_path)


def spawn(world: int, folder, checks: str = "") -> None:
    try:
        mp.spawn(_rank_main, args=(world, str(folder), checks), nprocs=world, join=True)
    except mp.ProcessRaisedException as e:
        errors = [f.read_text() for f in sorted(folder.glob("rank*.err"))]
        raise AssertionError("\n".join(errors) or str(e)) from None


RESHARD = [(torch.optim.AdamW, None, True), (torch.optim.AdamW, torch.bfloat16, True),
           (torch.optim.SGD, torch.bfloat16, True),
           (torch.optim.AdamW, None, "zero3")]   # (optimizer, param_dtype, data_parallel)


def reshard_save(rank: int, world: int) -> None:
    """2 sharded steps on ``world`` ranks, then a checkpoint (and the gathered masters)."""
    folder = os.environ["FXPIPE_TEST_FOLDER"]
    for k, (cls, dtype, mode) in enumerate(RESHARD):
        model = make_model()
        kw = {"momentum": 0.9} if cls is torch.optim.SGD else {}
        opt = cls(model.parameters(), lr=0.01, **kw)
        pipe = compile_dp(model, rank, shard_optimizer=True, param_dtype=dtype,
                          data_parallel=mode)
        for step in range(2):
            X, Y = data(world, step)
            pipe.forward_backward((mine(X, rank),), label=mine(Y, rank), loss_fn=ce, optimizer=opt)
            opt.zero_grad()
        pipe.save_checkpoint(f"{folder}/reshard{k}", opt)
        full = pipe.full_state_dict()
        if rank == 0:
            torch.save(full, f"{folder}/reshard{k}.pt")
        pipe.close()


def reshard_load(rank: int, world: int) -> None:
    """Load the checkpoint of 2 ranks on ``world`` ranks: the masters gathered equal the
    saved ones; 2 more steps equal eager training through all 4 steps (fp32), so every
    piece of the optimizer state (moments and step counts) landed on its new owner."""
    folder = os.environ["FXPIPE_TEST_FOLDER"]
    for k, (cls, dtype, mode) in enumerate(RESHARD):
        kw = {"momentum": 0.9} if cls is torch.optim.SGD else {}
        model = make_model()
        opt = cls(model.parameters(), lr=0.5, **kw)       # the checkpoint sets lr back
        pipe = compile_dp(model, rank, shard_optimizer=True, param_dtype=dtype,
                          data_parallel=mode)
        pipe.load_checkpoint(f"{folder}/reshard{k}", opt)
        saved = torch.load(f"{folder}/reshard{k}.pt")
        for name, value in pipe.full_state_dict().items():
            assert torch.equal(value, saved[name]), f"{cls.__name__} {dtype}: {name}"
        if dtype is not None:
            pipe.close()
            continue
        ref = make_model()
        ref_opt = cls(ref.parameters(), lr=0.01, **kw)
        for step in range(4):
            X, Y = data(2 if step < 2 else world, step)
            ce(ref(X), Y).backward()
            ref_opt.step()
            ref_opt.zero_grad()
            if step >= 2:
                pipe.forward_backward((mine(X, rank),), label=mine(Y, rank), loss_fn=ce,
                                      optimizer=opt)
                opt.zero_grad()
        assert_params(model, ref, f"{cls.__name__}: 2 steps on 2 ranks, 2 on {world}")
        pipe.close()


def test_checkpoint_onto_another_number_of_ranks(tmp_path):
    """Sharded optimizer state and masters saved by 2 ranks, loaded by 3 (zero3's too)."""
    spawn(2, tmp_path, "reshard_save")
    spawn(3, tmp_path, "reshard_load")


# ----------------------------------------------------------------- in this process (rank 0 of 1)

@contextlib.contextmanager
def one_rank_job() -> Iterator[None]:
    """Rank 0 of a one-rank gloo job, for the block."""
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("gloo", init_method=f"file://{d}/store", rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


@pytest.fixture
def one_rank():
    with one_rank_job():
        yield


class TestProgram(expecttest.TestCase):
    def test_printed_data_parallel_program(self):
        with one_rank_job():
            model = nn.Sequential(nn.Linear(4, 4), Scale(), nn.Linear(4, 2))
            pipe = fxpipe.compile(model, (torch.randn(4, 4),), devices=["cpu", "cpu"],
                                  data_parallel=True, plan=fxpipe.ExecutePlan(
                                      [range(0, 2)], [range(2, 3), range(0, 2)]))
            text = str(pipe.program("fused", num_microbatch=2, optimizer=True))
            self.assertExpectedInline(text, """\
program devices=2 microbatches=2
inputs input_1 <label>
stage 0 fwd 0:2 reads=input_1 makes=mul
stage 1 fused 2:3 reads=mul,<label> makes=linear_1 owns=2.weight,2.bias
stage 2 bwd 0:2 reads=input_1 makes=mul owns=0.weight,0.bias
step d0  d1   host
0    0P  1P   RF
1    0U0 1U0  BC
2    0F0 1FB0 AR2:3
3    0O0 1O0  S2:3
4    0X0 1X0  AR0:2
5    2P  1U1  S0:2
6    0U1 1FB1 C
7    0F1 1O1  .
8    0O1 1X1  .
9    0X1 1D   .
10   2U0 1R   .
11   2G0 .    .
12   0R  .    .
13   2B0 .    .
14   2X0 .    .
15   2U1 .    .
16   2G1 .    .
17   2B1 .    .
18   2X1 .    .
19   2D  .    .
20   2R  .    .""")
            shard = fxpipe.compile(model, (torch.randn(4, 4),), devices=["cpu", "cpu"],
                                   data_parallel=True, shard_optimizer=True,
                                   plan=pipe.plan)
            host = [str(a) for a in shard.program("fused", 2, optimizer=True).host]
            self.assertExpectedInline(str(host), """['RF', 'BC', 'RS2:3', 'S2:3', 'RS0:2', 'AG2:3', 'S0:2', 'AG0:2', 'C']""")
            train = [str(a) for a in pipe.program("train", 2).host]
            self.assertExpectedInline(str(train), """['RF', 'BC', 'C', 'AR2:3', 'AR0:2']""")
            pipe.close()
            shard.close()


def test_needs_initialized_process_group():
    assert not dist.is_initialized()
    model = make_model()
    with pytest.raises(RuntimeError, match="init_process_group.*torchrun"):
        fxpipe.compile(model, (torch.randn(2, 4),), devices=["cpu"], data_parallel=True)


@pytest.mark.parametrize("kw, match", [
    ({"shard_optimizer": True}, "shard_optimizer only apply with data_parallel=True"),
    ({"process_group": object()}, "process_group only apply with data_parallel=True"),
    ({"data_parallel": 1}, "data_parallel must be False, True"),
])
def test_bad_arguments(kw, match):
    with pytest.raises((ValueError, TypeError), match=match):
        fxpipe.compile(make_model(), (torch.randn(2, 4),), devices=["cpu"], **kw)


def test_no_sync_needs_data_parallel():
    pipe = fxpipe.compile(make_model(), (torch.randn(2, 4),), devices=["cpu"])
    with pytest.raises(ValueError, match="data-parallel pipes only"):
        with pipe.no_sync():
            pass
    pipe.close()


def test_a_failing_rank_drains_at_once_and_posts_nothing_after(one_rank):
    """``DataParallel.fail`` starts completing the call's owed collectives with zeros at
    once, beside the actions still running: one of them may wait for a collective another
    rank posts only after this rank's drain has served it (a 4-rank CI run waited out the
    20 s timeout on every rank when the drain waited for every action first). An action
    that would post afterwards raises ``Cancelled``; ``drain`` waits for the drain."""
    from fxpipe.runtime.issue.threads import Cancelled
    pipe = compile_dp(make_model(), 0)
    dp = pipe._dp
    owed = [("all_reduce", 4, torch.float32), ("all_gather", 2, torch.float32)]
    dp.begin(owed)
    dp.fail(RuntimeError("injected failure"))
    dp._drainer.join(TIMEOUT)
    assert dp._host_lane.posted == len(owed)   # drained without waiting for drain()
    with pytest.raises(Cancelled, match="completed with zeros"):
        dp._start("all_reduce", torch.zeros(4), None, dp._host_lane)
    dp.drain()
    with pytest.raises(fxpipe.DistributedError, match="cannot be used again"):
        pipe.forward_backward((torch.randn(4, 4),), label=torch.randint(0, 3, (4,)), loss_fn=ce)
    pipe.close()


def test_bad_timeout(one_rank):
    with pytest.raises(ValueError, match="collective_timeout must be > 0"):
        fxpipe.compile(make_model(), (torch.randn(2, 4),), devices=["cpu"], data_parallel=True,
                       collective_timeout=0)


def test_shard_optimizer_refuses_what_it_cannot_shard(one_rank):
    model = make_model()
    pipe = fxpipe.compile(model, (torch.randn(4, 4),), devices=["cpu", "cpu"],
                          data_parallel=True, shard_optimizer=True)
    x, y = torch.randn(4, 4), torch.randint(0, 3, (4,))
    with pytest.raises(NotImplementedError, match="shard_optimizer=True"):   # (nothing stepped)
        pipe.forward_backward((x,), label=y, loss_fn=ce, optimizer=overlapped(
            torch.optim.SGD(model.parameters(), lr=0.1), mode="async"))
    with pytest.raises(NotImplementedError, match="shard_optimizer=True steps each rank.s shard"):
        pipe.program(optimizer="async")
    # one rank: the sharded step is the whole step, and equals eager; clipped too (the
    # norm 0.05 clips: the speculated steps redone; 1e3 does not)
    ref = make_model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9, fused=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    gloo = {}
    for clip in (None, None, 0.05, 1e3, 0.05):
        ce(ref(x), y).backward()
        norm = None if clip is None else torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        ref_opt.step()
        ref_opt.zero_grad()
        step = opt if clip is None else overlapped(opt, max_grad_norm=clip)
        pipe.forward_backward((x,), label=y, loss_fn=ce, optimizer=step)
        gloo[clip] = pipe.stats()["host_collective_bytes"]
        if clip is not None:
            assert_close(step.grad_norm, norm, f"the norm clipped to {clip}")
        assert_params(model, ref, f"one rank, sharded, max_grad_norm={clip}")
    # the norm's gather (its part and a flag: 16 bytes), and when redone every parameter
    # gathered again
    assert gloo[1e3] - gloo[None] == 16
    assert gloo[0.05] - gloo[1e3] == 4 * sum(p.numel() for p in model.parameters())
    host = [str(a) for a in pipe.program(optimizer=overlapped(opt, max_grad_norm=1.0)).host]
    assert host[-3].startswith("AG0:") and host[-2:] == ["C", "N"], host
    pipe.close()


def test_sharded_masters_errors(one_rank, tmp_path):
    """Sharding the masters of a model another pipe already holds, ``assign=True``, and a
    checkpoint saved with masters loaded without (and back) fail with what to do."""
    x, y = torch.randn(4, 4), torch.randint(0, 3, (4,))
    model = make_model()
    plain = fxpipe.compile(model, (x,), devices=["cpu"])
    plain.forward_backward((x,), label=y, loss_fn=ce)       # its parameters move to the host
    with pytest.raises(ValueError, match="an earlier pipe of this model already laid them out"):
        fxpipe.compile(model, (x,), devices=["cpu"], data_parallel=True, shard_optimizer=True,
                       param_dtype=torch.bfloat16)
    plain.close()
    model = make_model()
    pipe = fxpipe.compile(model, (x,), devices=["cpu"], data_parallel=True, shard_optimizer=True,
                          param_dtype=torch.bfloat16)
    assert model[0].weight.dtype == torch.bfloat16 and pipe._dp.masters["0.weight"].dtype == \
        torch.float32
    with pytest.raises(NotImplementedError, match="assign=False"):
        pipe.load_state_dict(make_model().state_dict(), assign=True)
    # the user's own step over the bf16 copies could not reach the masters: refused with
    # what to do, nothing stepped; the pipe steps the same optimizer, the .grad the calls
    # without it accumulated included (an accumulating overlapped(opt) the same way)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ce(pipe(x), y).backward()
    pipe.forward_backward((x,), label=y, loss_fn=ce)
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())
    with pytest.raises(ValueError, match=r"SGD.step\(\) over a parameter .*fp32 master fxpipe "
                       r"shards.*optimizer=opt"):
        sgd.step()
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    step = overlapped(sgd, accumulate=2)
    for _ in range(2):
        pipe.forward_backward((x,), label=y, loss_fn=ce, optimizer=step)
    assert step.stepped and all(p.grad is None for p in model.parameters())
    assert all(not torch.equal(p, before[n]) for n, p in model.named_parameters())
    pipe.save_checkpoint(str(tmp_path / "masters"))
    other = fxpipe.compile(make_model(), (x,), devices=["cpu"], data_parallel=True,
                           shard_optimizer=True)
    with pytest.raises(ValueError, match="saved with sharded fp32 masters"):
        other.load_checkpoint(str(tmp_path / "masters"))
    other.save_checkpoint(str(tmp_path / "plain"))
    with pytest.raises(ValueError, match="saved without sharded fp32 masters"):
        pipe.load_checkpoint(str(tmp_path / "plain"))
    assert set(other.full_state_dict()) == set(other.state_dict())   # nothing to gather
    other.close()
    pipe.close()


def test_reshard_stitches_the_pieces_of_any_number_of_ranks():
    """``reshard`` against checkpoint metadata: every new rank of every world size gets
    exactly its elements from the pieces of every old world size (parameters with fewer
    elements than ranks included), scalars once; a checkpoint that does not fit raises
    the same error on every rank."""
    from types import SimpleNamespace

    from fxpipe.runtime.host.buckets import _piece, reshard

    def md(t):
        return SimpleNamespace(size=t.shape, properties=SimpleNamespace(dtype=t.dtype))

    full = {"a.w": torch.arange(12.0), "b": torch.arange(100.0, 105.0), "c.g": torch.tensor([7.0])}
    numel = {n: t.numel() for n, t in full.items()}
    for old in range(1, 5):
        tensors = {}
        for q in range(old):
            for n, t in full.items():
                lo, hi = _piece(t.numel(), old, q)
                if lo < hi:
                    tensors[f"optim.rank{q}.{n}.exp_avg"] = t[lo:hi].clone()
                    tensors[f"optim.rank{q}.{n}.step"] = torch.tensor(3.0)
        saved = {k: md(t) for k, t in tensors.items()}
        for world in range(1, 6):
            for rank in range(world):
                want, stitch = reshard(saved, "optim", old, numel, world, rank, states=True)
                for k, t in want.items():      # what dcp.load does
                    t.copy_(tensors[k])
                got = stitch()
                for n, t in full.items():
                    lo, hi = _piece(t.numel(), world, rank)
                    key = f"optim.rank{rank}.{n}"
                    if lo == hi:
                        assert key + ".exp_avg" not in got
                        continue
                    assert torch.equal(got[key + ".exp_avg"], t[lo:hi]), (old, world, rank, n)
                    assert got[key + ".step"].item() == 3.0
    del saved["optim.rank1.a.w.exp_avg"]
    for rank in range(3):
        with pytest.raises(ValueError, match="lacks rank 1's optim piece of 'a.w' exp_avg"):
            reshard(saved, "optim", 4, numel, 3, rank, states=True)
    saved["optim.rank1.a.w.exp_avg"] = md(torch.zeros(2, 3))
    for rank in range(3):
        with pytest.raises(NotImplementedError, match="only elementwise state"):
            reshard(saved, "optim", 4, numel, 3, rank, states=True)


def test_simulated_collectives_overlap_the_backward():
    """The simulator times AR on the host's collective stream: on a slow network the step
    grows by less than the sum of the all-reduces (they overlap the shallower stages'
    backward), and not at all with one rank."""
    from fxpipe.passes.schedule import build_program
    from fxpipe.sim import Hardware, LayerCost

    costs = [LayerCost(1.0, 2.0, param_bytes=10**6, grad_bytes=10**6)] * 6
    prog = build_program([range(0, 3), range(3, 5)], [range(5, 6), range(4, 5), range(3, 4),
                                                      range(0, 3)], "fused", 2, 4,
                         optimizer=True, data_parallel="allreduce")
    assert [str(a) for a in prog.host][:3] == ["RF", "AR5:6", "S5:6"]
    base = fxpipe.simulate(prog, costs=costs, hardware=Hardware()).makespan
    one = fxpipe.simulate(prog, costs=costs, hardware=Hardware(ranks=1, network_bytes_per_s=1e9))
    assert one.makespan == base
    hw = Hardware(ranks=4, network_bytes_per_s=1e9)   # AR of 1 MB: 1.5 ms
    slow = fxpipe.simulate(prog, costs=costs, hardware=hw)
    total_ar = sum(hw.collective_ms("all_reduce", 10**6 * len(r)) for r in
                   (range(5, 6), range(4, 5), range(3, 4), range(0, 3)))
    assert base < slow.makespan < base + total_ar
    assert any(iv.stream == "collective" and iv.label == "AR0:3" for iv in slow.intervals)


if __name__ == "__main__":   # python tests/test_distributed.py: one spawn, verbose
    os.environ.setdefault("PYTHONPATH", os.getcwd())
    pytest.main([__file__, "-q"])


