"""``data_parallel="zero3"`` (issue 58): the ranks of one host share one copy of the
parameters in host memory, each uploads 1/N of every stage and the devices gather the
rest. 2 and 4 ranks on localhost (gloo on the virtual devices' tensors, spawned with
``torch.multiprocessing``) against one process training the concatenated batch with
eager PyTorch.
"""

from __future__ import annotations

import copy
import os

import expecttest
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import fxpipe
from fxpipe.optim import overlapped
from fxpipe.passes.schedule import OptimizerSpec, build_program
from tests.test_distributed import (
    TIMEOUT, assert_params, ce, compile_dp, data, make_model, mine, three_steps,
)
from tests.test_distributed import check_checkpoint as distributed_checkpoint
from tests.test_distributed import check_clipped_first as distributed_clipped_first
from tests.test_distributed import check_failure as distributed_failure
from tests.test_distributed import check_hf_bf16 as distributed_hf_bf16
from tests.test_distributed import one_rank, one_rank_job, spawn  # noqa: F401 — one_rank: a fixture
from tests.test_dp_devices import check_cuda_sim as devices_cuda_sim
from tests.test_dp_devices import check_tied as devices_tied


def compile_z3(model, rank: int, **kw) -> fxpipe.PipelineModule:
    return compile_dp(model, rank, data_parallel="zero3", **kw)


def shared_pss(model) -> int:
    """This process's proportional share (``Pss``: a page mapped by k processes counts
    1/k) of the memory behind ``model``'s first parameter's mapping, in bytes."""
    ptr = next(model.parameters()).data_ptr()
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= ptr < hi
            elif inside and head == "Pss:":
                total += int(line.split()[1]) * 1024
    return total


# ----------------------------------------------------------------------------- the checks

def check_steps(rank: int, world: int) -> None:
    """3 AdamW steps (no clipping, a clip that redoes the step, one that keeps it) equal
    eager on the whole batch; each Prefetch uploads 1/N of the stage's parameters and a
    device all-gather follows it; no host all-gather, a barrier last; every rank sees the
    same parameters in memory the ranks share."""
    ref, model = make_model(), make_model()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    pipe = compile_z3(model, rank)
    program = pipe.program(optimizer=True)
    assert [str(a) for a in program.host][-1] == "SY", program.host
    assert not any(str(a).startswith("AG") for a in program.host), program.host
    for acts in program.actions:
        texts = [str(a) for a in acts]
        for i, t in enumerate(texts):
            if t.endswith("P"):
                assert texts[i + 1] == t[:-1] + "AG", texts
    three_steps(pipe, model, opt, ref, ref_opt, rank, world, "zero3", clip=(None, 0.05, 1e3))
    stats = pipe.stats()
    pipe.close()
    # the same model and plan with data_parallel="device": every rank uploads it whole
    dev_model, dev_ref = make_model(), make_model()
    dev = compile_dp(dev_model, rank, data_parallel="device", plan=pipe.plan)
    three_steps(dev, dev_model, torch.optim.AdamW(dev_model.parameters(), lr=0.01), dev_ref,
                torch.optim.AdamW(dev_ref.parameters(), lr=0.01), rank, world, "device",
                clip=(None, 0.05, 1e3))
    whole = dev.stats()
    dev.close()
    assert stats["d2h_bytes_grads"] == whole["d2h_bytes_grads"], (stats, whole)
    # 1/N of each parameter run (the ranks' parts add up to it; the buffers, a scalar,
    # go whole to every rank)
    mine_up = stats["h2d_bytes_params"]
    every = torch.tensor(float(mine_up))
    dist.all_reduce(every)
    assert mine_up <= whole["h2d_bytes_params"] / world + 64, (mine_up, whole)
    assert whole["h2d_bytes_params"] <= every.item() <= whole["h2d_bytes_params"] + 64 * world, \
        (every.item(), whole)
    # no parameter crosses gloo: the buffer's broadcast, the norm's gather and the barrier
    # only ("device" all-gathers the stepped parameters there)
    assert stats["host_collective_bytes"] == 4 + 16 + 4, stats
    assert whole["host_collective_bytes"] > 4 + 16, whole


def check_clipped_first(rank: int, world: int) -> None:
    """Clipped without speculation: the norm of every rank's shards, then each stage
    stepped and written once (tests/test_distributed.py's check)."""
    distributed_clipped_first(rank, world, data_parallel="zero3")


def check_bf16(rank: int, world: int) -> None:
    """``param_dtype=torch.bfloat16``: the shared parameters are the bf16 copies, each
    rank's fp32 masters its 1/N; 3 SGD steps (one clip redone) end where
    ``data_parallel="device"`` ends (the same roundings), the fp32 masters gathered
    equal too."""
    ends = []
    for mode in ("zero3", "device"):
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        pipe = compile_dp(model, rank, data_parallel=mode, param_dtype=torch.bfloat16)
        for step, limit in enumerate((None, 0.05, None)):
            X, Y = data(world, step)
            pipe.forward_backward((mine(X, rank),), label=mine(Y, rank), loss_fn=ce,
                                  optimizer=overlapped(opt, max_grad_norm=limit)
                                  if limit else opt)
            opt.zero_grad()
        ends.append(({n: p.detach().clone() for n, p in model.named_parameters()},
                     pipe.full_state_dict()))
        pipe.close()
    (z_params, z_masters), (d_params, d_masters) = ends
    for n in d_params:
        assert z_params[n].dtype == torch.bfloat16 and torch.equal(z_params[n], d_params[n]), n
    for n in d_masters:
        assert torch.equal(z_masters[n], d_masters[n]), n


def check_memory(rank: int, world: int) -> None:
    """The ranks map one copy of the parameters: with every rank having read all of
    them, this process's proportional share of their pages is 1/N (``/proc/self/smaps``'
    ``Pss``); a write on one rank is what every rank reads."""
    torch.manual_seed(0)
    big = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Tanh(),
                              torch.nn.Linear(512, 3))
    x = torch.randn(2, 256)
    pipe = fxpipe.compile(big, (x,), devices=["cpu", "cpu"], data_parallel="zero3",
                          collective_timeout=TIMEOUT)
    nbytes = sum(p.numel() * p.element_size() for p in big.parameters())
    assert all(torch.isfinite(p).all() for p in big.parameters())   # every page read here
    dist.barrier()
    pss = shared_pss(big)
    assert pss <= nbytes / world * 1.1 + 8192, (pss, nbytes, world)
    if rank == 1:
        with torch.no_grad():
            big[0].bias[0] = 42.0
    dist.barrier()
    assert big[0].bias[0].item() == 42.0
    pipe.close()


def check_refusals(rank: int, world: int) -> None:
    """What zero3 cannot do says so, naming what to do instead."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    pipe = compile_z3(model, rank)
    X, Y = data(world, 0)
    with pytest.raises(NotImplementedError, match="steps the optimizer in the pipe"):
        pipe.forward_backward((mine(X, rank),), label=mine(Y, rank), loss_fn=ce)
    with pipe.no_sync():   # accumulating without synchronizing is fine
        pipe.forward_backward((mine(X, rank),), label=mine(Y, rank), loss_fn=ce)
    with pytest.raises(ValueError, match="zero3.*once per rank"):
        opt.step()   # the user's own step over the shared parameters
    pipe.forward_backward((mine(X, rank),), label=mine(Y, rank), loss_fn=ce, optimizer=opt)
    with torch.no_grad():   # inference gathers too: every rank calls it
        out = pipe(mine(X, rank))
    assert torch.allclose(out, model(mine(X, rank)), atol=1e-6)
    pipe.close()
    # a model an earlier pipe laid out already
    model = make_model()
    fxpipe.compile(model, (mine(X, rank),), devices=["cpu"])(mine(X, rank))
    with pytest.raises(ValueError, match="compile the zero3 pipe first"):
        compile_z3(model, rank)


def check_two_pipes(rank: int, world: int) -> None:
    """A second zero3 pipe of the same model (another batch size: the HF Trainer compiles
    one per input shape) shares the same host copy; steps through either equal eager.
    Then one rank alone runs a pipe without data parallel over the shared copy."""
    ref, model = make_model(), make_model()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    pipes = [compile_z3(model, rank), compile_dp(model, rank, data_parallel="zero3",
                                                 config=fxpipe.RunConfig(num_microbatch=1))]
    for step, pipe in enumerate(pipes + pipes):
        X, Y = data(world, step)
        ce(ref(X), Y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        pipe.forward_backward((mine(X, rank),), label=mine(Y, rank), loss_fn=ce, optimizer=opt)
        opt.zero_grad()
        assert_params(model, ref, f"pipe {step % 2}, step {step}")
    for pipe in pipes:
        pipe.close()
    if rank == 0:   # a pipe without data parallel (an evaluation's) reads the shared copy
        X, _ = data(1, 0)
        alone = fxpipe.compile(model, (X,), devices=["cpu"])
        with torch.no_grad():
            torch.testing.assert_close(alone(X), model(X), rtol=0, atol=1e-6)
        alone.close()


def check_failure(rank: int, world: int) -> None:
    """Rank 1 fails in its shallowest stage's device reduce-scatter, after the deeper
    stages were reduced, stepped and written: every rank raises within the timeout (rank
    0 a DistributedError naming rank 1), and the parameters the ranks share, the masters
    and the shard state are as before the call (tests/test_distributed.py's check)."""
    distributed_failure(rank, world, zero3=True)


def check_failure_bf16(rank: int, world: int) -> None:
    """The same with bf16 parameters over fp32 masters: each rank had written its pieces
    of the shared bf16 parameters from its masters; it puts them back."""
    distributed_failure(rank, world, zero3=True, param_dtype=torch.bfloat16)


def check_checkpoints(rank: int, world: int) -> None:
    """Save after 2 steps, 2 more; a fresh model and pipe loading the checkpoint give
    bit-identical later losses, parameters and fp32 masters (tests/test_distributed.py's
    check), fp32 and bf16."""
    folder = os.environ["FXPIPE_TEST_FOLDER"]
    for dtype in (None, torch.bfloat16):
        distributed_checkpoint(rank, world, folder, shard=True, param_dtype=dtype,
                               data_parallel="zero3")


def check_hf_bf16(rank: int, world: int) -> None:
    """A Hugging Face Llama in bf16 under zero3 (its bf16 parameters shared, the fp32
    masters sharded): the averaged losses and the updates of 2 AdamW steps follow the
    bf16 eager reference on the whole batch (tests/test_distributed.py's check)."""
    distributed_hf_bf16(rank, world, data_parallel="zero3")


def check_lora_weights(rank: int, world: int) -> None:
    """A peft LoRA on a Hugging Face Llama built on ``meta`` whose frozen base comes from a
    safetensors file (``weights=``: file-backed, not moved into the shared buffers; each
    rank reads its part of each run): 2 AdamW steps of the adapters end bit for bit where
    ``data_parallel="device"`` ends, each rank uploading half the parameter bytes."""
    peft = pytest.importorskip("peft")
    from safetensors.torch import save_file
    from tests import hf_zoo
    folder = os.environ["FXPIPE_TEST_FOLDER"]
    base, kw, _, loss_fn = hf_zoo.setup("llama")
    path = f"{folder}/base.safetensors"
    if rank == 0:
        save_file({k: v.contiguous() for k, v in base.state_dict().items()}, path)
    dist.barrier()
    rows = kw["input_ids"].shape[0] // world
    part = {k: v[rank * rows:(rank + 1) * rows] for k, v in kw.items()}
    ends = {}
    for mode in ("zero3", "device"):
        torch.manual_seed(1)   # the same adapters
        with torch.device("meta"):
            model = type(base)(base.config)
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj",
                                                                                 "v_proj"]))
        # cuda-sim devices: pinned (emulated), the file read through the ring, a part at a time
        devices = [fxpipe.VirtualDevice(semantics="cuda") for _ in range(2)]
        pipe = fxpipe.compile(model, example_kwargs=part, devices=devices,
                              data_parallel=mode, weights=path, collective_timeout=TIMEOUT,
                              config=fxpipe.RunConfig(num_microbatch=2))
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        losses = []
        for _ in range(2):
            losses.append(pipe.forward_backward((), part, loss_fn=loss_fn, optimizer=opt).item())
            opt.zero_grad()
        ends[mode] = (losses, {n: p.detach().clone() for n, p in model.named_parameters()
                               if p.requires_grad}, pipe.stats()["h2d_bytes_params"])
        pipe.close()
    (z_losses, z_params, z_up), (d_losses, d_params, d_up) = ends["zero3"], ends["device"]
    assert z_losses == d_losses, (z_losses, d_losses)
    for n, v in d_params.items():
        assert torch.equal(z_params[n], v), n
    assert z_up <= d_up / world + 64 * 8, (z_up, d_up)


def check_two_pipes_bf16(rank: int, world: int) -> None:
    """bf16 ``param_dtype`` (the fp32 masters sharded by the first pipe): a second pipe of
    the model keeps the first's masters (before, it found the parameters bf16 already,
    kept no masters, and its step failed). 4 SGD steps alternating between two pipes end
    bit for bit where one pipe ends, with ``"device"`` and with ``"zero3"``."""
    ends = {}
    for mode, pipes in (("device", 1), ("device", 2), ("zero3", 2)):
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        made = [compile_dp(model, rank, data_parallel=mode, param_dtype=torch.bfloat16)
                for _ in range(pipes)]
        for step in range(4):
            X, Y = data(world, step)
            made[step % pipes].forward_backward((mine(X, rank),), label=mine(Y, rank),
                                                loss_fn=ce, optimizer=opt)
            opt.zero_grad()
        ends[(mode, pipes)] = made[-1].full_state_dict()
        for pipe in made:
            pipe.close()
    one = ends[("device", 1)]
    for key in (("device", 2), ("zero3", 2)):
        for n, v in one.items():
            assert torch.equal(ends[key][n], v), (key, n)


def check_cuda_sim(rank: int, world: int) -> None:
    """Strict cuda-sim devices (work queued as on a GPU; each stream runs it when it gets
    there): 2 AdamW steps equal eager, so each stage computed after its all-gather had
    filled in the other ranks' parts (its memory is uninitialized until then); the
    gathers ran on the devices' collective streams (tests/test_dp_devices.py's check)."""
    devices_cuda_sim(rank, world, data_parallel="zero3")


def check_cudagraphs(rank: int, world: int) -> None:
    """``stage_backend="cudagraphs"`` on strict cuda-sim devices: each stage's part is
    uploaded into its parameter slot, gathered there in place, and the graphs captured at
    the first step replay after; 3 AdamW steps equal eager."""
    ref, model = make_model(), make_model()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    devices = [fxpipe.VirtualDevice(semantics="cuda", strict=True) for _ in range(2)]
    pipe = compile_z3(model, rank, devices=devices,
                      config=fxpipe.RunConfig(stage_backend="cudagraphs", num_microbatch=2))
    three_steps(pipe, model, opt, ref, ref_opt, rank, world, "cudagraphs")
    stats = pipe.stats()   # the last step's
    assert stats["graph_replays"] > 0 and stats["graph_captures"] == 0, stats
    pipe.close()
    for d in devices:
        d.close()


def check_tied(rank: int, world: int) -> None:
    """A weight two stages use: each stage gathers it; stepped once, clipped
    (tests/test_dp_devices.py's check)."""
    devices_tied(rank, world, data_parallel="zero3")


CHECKS = ",".join(f"tests.test_zero3:check_{c}" for c in ("steps", "clipped_first", "bf16", "tied",
                                                         "cuda_sim", "cudagraphs"))


@pytest.mark.parametrize("world", [2, 4])
def test_zero3(world, tmp_path):
    checks = CHECKS + (",tests.test_zero3:check_memory,tests.test_zero3:check_refusals,"
                       "tests.test_zero3:check_checkpoints,tests.test_zero3:check_hf_bf16,"
                       "tests.test_zero3:check_lora_weights,tests.test_zero3:check_two_pipes,"
                       "tests.test_zero3:check_two_pipes_bf16,"
                       "tests.test_zero3:check_failure_bf16"
                       if world == 2 else ",tests.test_zero3:check_failure")
    spawn(world, tmp_path, checks)


def test_the_program_gathers_after_each_prefetch():
    p = build_program([range(0, 1)], [range(1, 2), range(0, 1)], "fused", 2, 1, "stage",
                      optimizer=OptimizerSpec(), data_parallel="zero3", gather_params=True)
    lanes = [" ".join(str(a) for a in acts) for acts in p.actions]
    assert lanes == ["0P 0AG 0U0 0F0 0O0 0X0 2P 2AG 2U0 2G0 0R 2B0 2X0 2RS 2D 2R",
                     "1P 1AG 1U0 1FB0 1O0 1X0 1RS 1D 1R"], lanes
    assert [str(a) for a in p.host] == ["RF", "S1:2", "S0:1", "C", "SY"]
    deps = p.dependencies()
    # the stage's compute waits for the gather, not for the upload alone
    assert any(x.step == 1 and x.why == "params" for x in deps[0][3]), deps[0][3]


def test_bad_data_parallel_names_zero3(one_rank):
    with pytest.raises(TypeError, match="'zero3'"):
        compile_dp(make_model(), 0, data_parallel="zero4")


class TestProgram(expecttest.TestCase):
    def test_printed_zero3_program(self):
        """The Program of ``data_parallel="zero3"``: a ``sAG`` after each ``sP``, which the
        stage's computes wait for; the backward stages reduce-scatter on the devices; the
        host steps, writes and ends with a barrier (no ``AG``). Rank 0 of a one-rank job,
        whose one training call equals eager."""
        with one_rank_job():
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
            ref = copy.deepcopy(model)
            pipe = fxpipe.compile(model, (torch.randn(4, 4),), devices=["cpu", "cpu"],
                                  data_parallel="zero3", plan=fxpipe.ExecutePlan(
                                      [range(0, 2)], [range(2, 3), range(0, 2)]))
            program = pipe.program("fused", num_microbatch=2, optimizer=True)
            self.assertExpectedInline(str(program), """\
program devices=2 microbatches=2
inputs input_1 <label>
stage 0 fwd 0:2 reads=input_1 makes=tanh
stage 1 fused 2:3 reads=tanh,<label> makes=linear_1 owns=2.weight,2.bias
stage 2 bwd 0:2 reads=input_1 makes=tanh owns=0.weight,0.bias
step d0  d1   host
0    0P  1P   RF
1    0AG 1AG  S2:3
2    0U0 1U0  S0:2
3    0F0 1FB0 C
4    0O0 1O0  SY
5    0X0 1X0  .
6    2P  1U1  .
7    2AG 1FB1 .
8    0U1 1O1  .
9    0F1 1X1  .
10   0O1 1RS  .
11   0X1 1D   .
12   2U0 1R   .
13   2G0 .    .
14   0R  .    .
15   2B0 .    .
16   2X0 .    .
17   2U1 .    .
18   2G1 .    .
19   2B1 .    .
20   2X1 .    .
21   2RS .    .
22   2D  .    .
23   2R  .    .""")
            # what pipe(x) runs, printed: each stage gathered after its prefetch
            text = str(pipe)
            for s, d in ((0, 0), (1, 1)):
                self.assertIn(f"all_gather(params_{s})".ljust(56) + f"  # {s}AG vcpu:{d}",
                              text)
            x, y = torch.randn(4, 4), torch.randn(4, 2)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            with pipe.trace() as rec:
                pipe.forward_backward((x,), label=y, loss_fn=nn.functional.mse_loss,
                                      optimizer=opt, run_config=fxpipe.RunConfig(
                                          num_microbatch=2))
            self.assertEqual(sorted(a for _, a in rec.actions if a.endswith("AG")),
                             ["0AG", "1AG", "2AG"])
            ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
            nn.functional.mse_loss(ref(x), y).backward()
            ref_opt.step()
            for p, q in zip(model.parameters(), ref.parameters()):
                torch.testing.assert_close(p, q, rtol=0, atol=1e-6)
            pipe.close()


@pytest.mark.parametrize("mode", ["device", "zero3"])
def test_a_pipe_compiled_after_no_sync_calls_captures(one_rank, mode):
    """bf16 over sharded fp32 masters: calls under ``no_sync()`` leave an fp32 ``.grad`` on
    the bf16 parameters; a pipe compiled then (the HF Trainer compiles one per input
    shape, mid-accumulation) captures with export, which copied each ``.grad`` into its
    bf16 stand-in and failed; the step that follows takes the accumulated ``.grad``."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    X, Y = data(2, 0)
    first = compile_dp(model, 0, data_parallel=mode, param_dtype=torch.bfloat16)
    with first.no_sync():
        first.forward_backward((X[:6],), label=Y[:6], loss_fn=ce)
    assert all(p.grad is not None and p.grad.dtype == torch.float32
               for p in model.parameters())
    second = fxpipe.compile(model, (X,), devices=["cpu", "cpu"], data_parallel=mode,
                            param_dtype=torch.bfloat16, capture="export",
                            collective_timeout=TIMEOUT)
    second.forward_backward((X,), label=Y, loss_fn=ce, optimizer=opt)
    assert all(p.grad is None for p in model.parameters())   # taken by the sharded step
    first.close()
    second.close()
