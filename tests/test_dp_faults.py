"""Data parallel when a rank dies (#58): a rank killed with SIGKILL in the middle of a
step makes every other rank raise a clear ``DistributedError`` within seconds (gloo sees
the closed connection; not the collective timeout), and the checkpoint the ranks wrote
before stays loadable: a fresh job resuming from it trains on exactly as eager PyTorch
on the concatenated batch does.

Two ranks on localhost (gloo, two virtual devices each), spawned as processes of their
own (``torch.multiprocessing``'s ``spawn`` would tear the survivor down with the dead
rank). Each phase runs in one spawn of its own.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

import fxpipe
from tests.test_distributed import ce, data, make_model, mine

TIMEOUT = 120.0   # collective_timeout: a dead rank must be noticed well before it
STEPS_BEFORE = 2  # steps trained and checkpointed before the crash
LR, MOMENTUM = 0.05, 0.9


def _compile(model: torch.nn.Module, mode: bool | str) -> fxpipe.PipelineModule:
    x, _ = data(1, 0)
    return fxpipe.compile(model, (x,), devices=["cpu", "cpu"], data_parallel=mode,
                          collective_timeout=TIMEOUT)


def _step(pipe, opt, rank: int, world: int, step: int) -> float:
    X, Y = data(world, step)
    loss = pipe.forward_backward((mine(X, rank),), label=mine(Y, rank), loss_fn=ce,
                                 optimizer=opt)
    opt.zero_grad(set_to_none=True)
    return float(loss)


def _rank(rank: int, world: int, folder: str, phase: str, mode: bool | str) -> None:
    os.environ.setdefault("FXPIPE_HOST_MS_PER_ACTION", "0")   # the plan the suite uses
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{folder}/store-{phase}", rank=rank,
                            world_size=world)
    torch.manual_seed(0)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    pipe = _compile(model, mode)
    path = f"{folder}/ckpt"
    out: dict = {"rank": rank}
    if phase == "crash":
        for step in range(STEPS_BEFORE):
            _step(pipe, opt, rank, world, step)
        pipe.save_checkpoint(path, opt)
        if rank == 1:   # dies in the middle of the next step's backward
            from fxpipe.runtime.host.param_store import ParamStore
            from fxpipe.runtime.issue.distributed import DataParallel
            # zero3: in its shallowest stage's device reduce-scatter, the deeper stages
            # stepped and written into the parameters the ranks share
            owner, name, at = (DataParallel, "device_reduce", 4) if mode == "zero3" else \
                (ParamStore, "download_grads", 1)   # the stage: that argument of that method
            original = getattr(owner, name)
            shallowest = len(pipe.program(optimizer=True).stages) - 1

            def dying(self, *args, **kwargs):
                if args[at - 1] == shallowest:
                    os.kill(os.getpid(), signal.SIGKILL)
                return original(self, *args, **kwargs)

            setattr(owner, name, dying)
        start = time.monotonic()
        try:
            _step(pipe, opt, rank, world, STEPS_BEFORE)
            out["error"] = None
        except fxpipe.errors.DistributedError as e:
            out["error"], out["error_rank"] = str(e), e.rank
        except Exception as e:  # noqa: BLE001 — recorded: the test says what it was
            out["error"], out["error_type"] = str(e), type(e).__name__
        out["seconds"] = time.monotonic() - start
    else:   # "resume": a fresh job from the checkpoint, its next step
        for p in model.parameters():   # other weights: the checkpoint must set them
            p.data.add_(1.0)
        pipe.load_checkpoint(path, opt)
        out["loss"] = _step(pipe, opt, rank, world, STEPS_BEFORE)
        out["params"] = [p.detach().tolist() for p in model.parameters()]
    with open(f"{folder}/{phase}-rank{rank}.json", "w") as f:
        json.dump(out, f)
    os._exit(0)   # no teardown of a process group whose peer is gone


def _run(folder, phase: str, mode: bool | str, world: int = 2,
         limit: float = 150.0) -> list[int | None]:
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_rank, args=(r, world, str(folder), phase, mode))
             for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + limit
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    codes = [p.exitcode for p in procs]
    for p in procs:
        if p.is_alive():
            p.kill()
    return codes


@pytest.mark.parametrize("mode", [True, "zero3"])
def test_a_rank_killed_mid_step_fails_the_others_fast_and_the_checkpoint_resumes(tmp_path, mode):
    """``zero3``: the ranks share the parameters, which may hold pieces stepped before
    the crash (nothing backs them up here); the checkpoint is what resumes."""
    codes = _run(tmp_path, "crash", mode)
    assert codes[1] == -signal.SIGKILL, codes
    assert codes[0] == 0, f"rank 0 hung or crashed: exit code {codes[0]}"
    survivor = json.loads((tmp_path / "crash-rank0.json").read_text())
    assert survivor["error"] is not None and "error_type" not in survivor, survivor
    assert survivor["seconds"] < 60, survivor
    assert "rank" in survivor["error"], survivor

    assert _run(tmp_path, "resume", mode) == [0, 0]
    resumed = [json.loads((tmp_path / f"resume-rank{r}.json").read_text()) for r in range(2)]
    assert resumed[0]["params"] == resumed[1]["params"]   # the ranks agree
    # eager PyTorch on the concatenated batch, the same steps from the same weights
    torch.manual_seed(0)
    ref = make_model()
    opt = torch.optim.SGD(ref.parameters(), lr=LR, momentum=MOMENTUM)
    for step in range(STEPS_BEFORE + 1):
        X, Y = data(2, step)
        loss = ce(ref(X), Y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    mean_loss = (resumed[0]["loss"] + resumed[1]["loss"]) / 2
    torch.testing.assert_close(torch.tensor(mean_loss), loss.detach(), atol=1e-6, rtol=1e-6)
    for got, p in zip(resumed[0]["params"], ref.parameters()):
        torch.testing.assert_close(torch.tensor(got), p.detach(), atol=1e-6, rtol=1e-6)
