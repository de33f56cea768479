"""Runtime benchmark: fxpipe training steps on virtual devices vs eager PyTorch.

    python benchmarks/bench_runtime.py [--repeats 5] [--quick]

(a) one virtual device: a fused training step (``forward_backward``, one microbatch)
    vs eager forward+backward with ``torch.utils.checkpoint`` around every block (the
    same recompute: every layer but the unrecomputed tail), and vs plain eager.
    Target: fxpipe / checkpointed eager <= 1.05. For diagnosis, also the same pipeline
    on a device whose transfers are free (host memory aliased, nothing copied): the gap
    between the two is what the transfers cost on this machine.
(b) two virtual devices vs one on a compute-bound model (8 blocks, hidden 1024), same
    microbatches. Target: speed-up >= 1.6x on a 2-core machine.

Each variant runs with one intra-op thread (virtual devices use one thread per stream),
after a warm-up, interleaved with the others, repeated; min and median are reported.
``--one-core`` pins the whole process to one CPU: the transfer streams then take turns
with the compute on it (their work adds up instead of overlapping), and a 2-vCPU VM's
run-to-run noise mostly goes away. Writes benchmarks/results/bench_runtime.json (with
``--one-core``, bench_runtime_one_core.json).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fxpipe  # noqa: E402
from fxpipe.demo import TinyLlama, progression_batch, rotary_tables  # noqa: E402


def loss_fn(logits, target):
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def checkpointed_step(model: TinyLlama, ids, target):
    """Eager forward+backward, every decoder layer under torch.utils.checkpoint."""
    x = model.embed(ids)
    cos, sin = rotary_tables(ids.shape[1], model.head_dim)
    for layer in model.layers:
        x = checkpoint(layer, x, cos, sin, use_reentrant=False)
    loss = loss_fn(model.lm_head(model.norm(x)), target)
    loss.backward()
    return loss


class ZeroCopyDevice(fxpipe.VirtualDevice):
    """A diagnostic VirtualDevice whose transfers alias host memory instead of copying
    (no memory accounting, nothing freed): the pipeline minus the cost of its copies.
    Only for models that never write a device value in place (TinyLlama does not)."""

    def to_device(self, host_tensor, kind, owner):
        return host_tensor.detach()

    def free(self, tensor):
        pass

    def to_host(self, dev_tensor, pin=True):
        return dev_tensor.detach()


def eager_step(model, ids, target):
    loss = loss_fn(model(ids), target)
    loss.backward()
    return loss


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench(variants: dict, repeats: int) -> dict[str, list[float]]:
    for fn in variants.values():  # warm-up
        fn()
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(repeats):
        for name, fn in variants.items():  # interleaved
            times[name].append(timed(fn))
    return times


def summary(times: dict[str, list[float]], base: str) -> dict:
    out = {}
    for name, ts in times.items():
        ratios = [t / b for t, b in zip(ts, times[base])]
        out[name] = {"min_s": min(ts), "median_s": statistics.median(ts),
                     f"ratio_vs_{base}_min": min(ratios),
                     f"ratio_vs_{base}_median": statistics.median(ratios)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="small models (a smoke run)")
    ap.add_argument("--part", choices=["a", "b", "both"], default="both")
    ap.add_argument("--one-core", action="store_true",
                    help="pin the process (every stream's thread) to one CPU")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    name = "bench_runtime_one_core.json" if args.one_core else "bench_runtime.json"
    args.out = args.out or str(Path(__file__).parent / "results" / name)
    if args.one_core:  # threads started later (the devices' streams) inherit it
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    torch.set_num_threads(1)
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    results = {"torch": torch.__version__, "threads_per_worker": 1, "repeats": args.repeats,
               "cpus": sorted(os.sched_getaffinity(0))}

    if args.part in ("a", "both"):
        results["a_one_device"] = part_a(args, gen)
    if args.part in ("b", "both"):
        results["b_two_devices"] = part_b(args, gen)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    print(f"wrote {out}")


def part_a(args, gen) -> dict:
    """(a) one device: fxpipe fused step vs checkpointed eager vs plain eager."""
    dim, depth, batch, seq = (128, 4, 4, 32) if args.quick else (512, 8, 8, 128)
    model = TinyLlama(vocab=256, dim=dim, depth=depth)
    ids, target = progression_batch(batch, seq, 256, gen)
    ids, target = ids % 256, target % 256
    cfg = fxpipe.RunConfig(num_microbatch=1)
    pipe = fxpipe.compile(model, example_inputs=(ids,), devices=[fxpipe.VirtualDevice()], config=cfg)
    free = fxpipe.compile(model, example_inputs=(ids,), devices=[ZeroCopyDevice()], config=cfg)
    losses = [p.forward_backward((ids,), label=target, loss_fn=loss_fn) for p in (pipe, free)]
    if not torch.equal(losses[0], losses[1]):
        raise RuntimeError(f"the zero-copy diagnostic device changed the loss: {losses}")
    variants = {
        "checkpointed_eager": lambda: checkpointed_step(model, ids, target),
        "fxpipe_1dev": lambda: pipe.forward_backward((ids,), label=target, loss_fn=loss_fn),
        "fxpipe_1dev_zero_copy": lambda: free.forward_backward((ids,), label=target, loss_fn=loss_fn),
        "eager": lambda: eager_step(model, ids, target),
    }
    a = summary(bench(variants, args.repeats), "checkpointed_eager")
    print(f"(a) one virtual device, dim {dim}, {depth} blocks, batch {batch}x{seq}")
    print(f"{'variant':>22} | {'min s':>8} | {'median s':>8} | {'vs ckpt min':>11} | {'vs ckpt med':>11}")
    for name, r in a.items():
        print(f"{name:>22} | {r['min_s']:8.3f} | {r['median_s']:8.3f} | "
              f"{r['ratio_vs_checkpointed_eager_min']:11.3f} | {r['ratio_vs_checkpointed_eager_median']:11.3f}")
    return {"model": dict(dim=dim, depth=depth, batch=batch, seq=seq), "plan": repr(pipe.plan), **a}


def part_b(args, gen) -> dict:
    """(b) two devices vs one, same microbatches."""
    dim, depth, batch, seq = (256, 4, 8, 32) if args.quick else (1024, 8, 8, 128)
    model = TinyLlama(vocab=256, dim=dim, depth=depth)
    ids, target = progression_batch(batch, seq, 256, gen)
    cfg = fxpipe.RunConfig(num_microbatch=4)
    one = fxpipe.compile(model, example_inputs=(ids,), devices=[fxpipe.VirtualDevice()], config=cfg)
    two = fxpipe.compile(model, example_inputs=(ids,), devices=[fxpipe.VirtualDevice(),
                                                               fxpipe.VirtualDevice()], config=cfg)
    variants = {
        "fxpipe_1dev": lambda: one.forward_backward((ids,), label=target, loss_fn=loss_fn),
        "fxpipe_2dev": lambda: two.forward_backward((ids,), label=target, loss_fn=loss_fn),
    }
    b = summary(bench(variants, args.repeats), "fxpipe_1dev")
    res = {"model": dict(dim=dim, depth=depth, batch=batch, seq=seq),
           "plan_1dev": repr(one.plan), "plan_2dev": repr(two.plan), "num_microbatch": 4, **b,
           "speedup_median": 1 / b["fxpipe_2dev"]["ratio_vs_fxpipe_1dev_median"],
           "speedup_best": 1 / b["fxpipe_2dev"]["ratio_vs_fxpipe_1dev_min"]}
    print(f"\n(b) 2 virtual devices vs 1, dim {dim}, {depth} blocks, batch {batch}x{seq}, 4 microbatches")
    for name, r in b.items():
        print(f"{name:>20} | {r['min_s']:8.3f} | {r['median_s']:8.3f}")
    print(f"speed-up 2 vs 1 device: median {res['speedup_median']:.2f}x, best {res['speedup_best']:.2f}x")
    return res


if __name__ == "__main__":
    main()
