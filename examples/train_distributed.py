"""Data-parallel training: one pipeline per rank, gradients averaged across ranks.

    torchrun --nproc-per-node=2 examples/train_distributed.py            # 2 ranks, this machine
    torchrun --nnodes=2 --node-rank=0 --nproc-per-node=1 \\
        --rdzv-backend=c10d --rdzv-endpoint=HOST0:29500 examples/train_distributed.py  # node 0
    python examples/train_distributed.py                 # no torchrun: spawns 2 ranks itself
    python examples/train_distributed.py --small         # quick run (or FXPIPE_EXAMPLE_SMALL=1)

Every rank compiles the same model with ``data_parallel=True`` and trains on its own
share of each batch, on its own devices (here two virtual CPU devices per rank; on GPUs
leave ``devices`` out and each rank uses the GPUs it sees, e.g. one node's). Each
backward stage's gradients are all-reduced (``AR`` in the printed Program's host lane;
on GPUs ``AR`` in each device's lane, NCCL) while the shallower stages still
back-propagate, and the streamed optimizer steps each stage after its all-reduce. Every
``--accum`` steps the first microsteps run under ``pipe.no_sync()`` (no all-reduce); the
last one averages the accumulated ``.grad``.

Options: ``--data-parallel device`` (each stage's gradients reduce-scattered on its
devices, ``RS`` in their lanes, NCCL on GPUs; each rank downloads and steps 1/N and
keeps 1/N of the optimizer state; a step after ``no_sync`` microsteps prints ``RS+``:
each device uploads the accumulated ``.grad`` and adds it before it reduces),
``--shard-optimizer`` (each rank keeps 1/N of the optimizer state; with
``--bf16`` too, 1/N of the fp32 masters: the devices compute in bf16 and the model's
parameters become the bf16 copies they upload), ``--bf16`` (``param_dtype=bfloat16``),
``--checkpoint DIR`` (resume from DIR if it holds a checkpoint, save there at the end:
``torch.distributed.checkpoint``, every rank writing its part),
``--fail-rank R --fail-step S`` (rank R raises inside step S: every rank stops with an
error naming rank R, nothing half-written), ``--steps``, ``--accum``, ``--small``.

At the end every rank checks that its parameters equal rank 0's, and rank 0 prints the
loss curve; the script exits non-zero otherwise.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn

import fxpipe


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.ff = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x):
        return x + self.ff(self.norm(x))


class Model(nn.Module):
    def __init__(self, width: int = 32, depth: int = 4, classes: int = 10):
        super().__init__()
        self.embed = nn.Linear(16, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def batch(step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step`` (every rank draws the same, and takes its share)."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(rows, 16, generator=g)
    return x, x[:, :10].argmax(dim=1)   # a learnable target


def main(args: argparse.Namespace) -> int:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)                        # the same initial weights on every rank
    model = Model()
    rows = args.rows_per_rank * world
    x0, _ = batch(0, rows)
    pipe = fxpipe.compile(model, (x0[:args.rows_per_rank],), devices=["cpu", "cpu"],
                          data_parallel=args.data_parallel,
                          shard_optimizer=args.shard_optimizer,
                          param_dtype=torch.bfloat16 if args.bf16 else None,
                          collective_timeout=60)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    step_opt = fxpipe.optim.overlapped(opt, atomic=True)   # a failed step changes nothing
    start = 0
    if args.checkpoint and os.path.exists(os.path.join(args.checkpoint, ".metadata")):
        pipe.load_checkpoint(args.checkpoint, step_opt)
        start = int(open(os.path.join(args.checkpoint, "step.txt")).read())
        if rank == 0:
            print(f"resumed from {args.checkpoint} at step {start}", flush=True)
    if rank == 0:
        program = pipe.program("fused", optimizer=True)
        host = " ".join(str(a) for a in program.host)
        print(f"{world} ranks; host lane of a training step: {host}", flush=True)
    ce = nn.functional.cross_entropy
    losses = []
    for step in range(start, start + args.steps):
        x, y = batch(step, rows * args.accum)
        mine = slice(rank * args.rows_per_rank, (rank + 1) * args.rows_per_rank)
        parts = [(x[k * rows:(k + 1) * rows][mine], y[k * rows:(k + 1) * rows][mine])
                 for k in range(args.accum)]
        loss_fn = ce if args.accum == 1 else (lambda out, lab: ce(out, lab) / args.accum)
        if rank == args.fail_rank and step == args.fail_step:
            loss_fn = _failing
        total = torch.zeros(())
        try:
            with pipe.no_sync():                 # local accumulation: no all-reduce
                for xs, ys in parts[:-1]:
                    total += pipe.forward_backward((xs,), label=ys, loss_fn=loss_fn)
            if rank == 0 and step == start and args.data_parallel == "device":
                # what the stepping call runs: its reduce-scatters (sRS; sRS+ after
                # no_sync microsteps: each device adds the accumulated .grad first)
                lane = pipe.program("fused", optimizer=True).actions[0]
                print(f"device 0's lane: {' '.join(map(str, lane))}", flush=True)
            xs, ys = parts[-1]                   # the last microstep averages .grad
            total += pipe.forward_backward((xs,), label=ys, loss_fn=loss_fn, optimizer=step_opt)
        except Exception as e:
            print(f"rank {rank}: step {step} failed: {type(e).__name__}: {e}", flush=True)
            return 3
        opt.zero_grad(set_to_none=True)
        dist.all_reduce(total)
        losses.append(total.item() / world)
        if rank == 0 and (step % 5 == 0 or step == start + args.steps - 1):
            print(f"step {step:3d}  loss {losses[-1]:.4f}", flush=True)
    if args.checkpoint:
        pipe.save_checkpoint(args.checkpoint, step_opt)
        if rank == 0:
            with open(os.path.join(args.checkpoint, "step.txt"), "w") as f:
                f.write(str(start + args.steps))
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    ref = flat.clone()
    dist.broadcast(ref, src=0)
    same = torch.equal(flat, ref)
    if not same:
        print(f"rank {rank}: parameters differ from rank 0's", flush=True)
    if rank == 0:
        print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} over {args.steps} steps on {world} "
              f"ranks; parameters identical on every rank: {same}", flush=True)
    pipe.close()
    return 0 if same and losses[-1] < losses[0] else 1


def _failing(out, label):
    raise RuntimeError("injected failure (--fail-rank)")


def _spawned(rank: int, world: int, store: str, args: argparse.Namespace) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        code = main(args)
    finally:
        dist.destroy_process_group()
    if code:
        sys.exit(code)


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--small", action="store_true", default=os.environ.get("FXPIPE_EXAMPLE_SMALL") == "1",
                   help="a quick run: 6 steps unless --steps says otherwise (or FXPIPE_EXAMPLE_SMALL=1)")
    p.add_argument("--steps", type=int, default=None, help="default 40 (6 with --small)")
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--rows-per-rank", type=int, default=8)
    p.add_argument("--data-parallel", choices=["host", "device"], default="host",
                   help="where the gradients are reduced (compile's data_parallel)")
    p.add_argument("--shard-optimizer", action="store_true")
    p.add_argument("--bf16", action="store_true", help="param_dtype=torch.bfloat16")
    p.add_argument("--checkpoint", default="", help="folder to resume from and save to")
    p.add_argument("--fail-rank", type=int, default=-1)
    p.add_argument("--fail-step", type=int, default=1)
    p.add_argument("--nproc", type=int, default=2, help="ranks to spawn without torchrun")
    args = p.parse_args()
    if args.steps is None:
        args.steps = 6 if args.small else 40
    return args


if __name__ == "__main__":
    args = parse()
    torch.set_num_threads(1)
    if "RANK" in os.environ:                     # launched by torchrun
        dist.init_process_group("gloo")          # rank, world size, address: from torchrun
        try:
            code = main(args)
        finally:
            dist.destroy_process_group()
        raise SystemExit(code)
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_spawned, args=(args.nproc, f"{d}/store", args), nprocs=args.nproc)
