"""Optimizer benchmark: the host optimizer step, synchronous vs streamed vs asynchronous.

    .venv/bin/python benchmarks/bench_optimizer.py                 # all parts, ~15 min
    .venv/bin/python benchmarks/bench_optimizer.py --part runtime  # ~5 min

(runtime) 2 virtual devices (then 1), a 16-block Llama-style model, AdamW (``fused=True``,
    the kernels the streamed step runs for an AdamW built with torch's defaults, so
    ``sync``'s ``opt.step()`` runs them too). Wall time per
    training step for: ``none`` (forward_backward only, its weights marked changed
    between calls so it copies them for upload like the others: what the devices need),
    ``sync`` (then ``opt.step()`` after the call), ``exact``
    (``forward_backward(optimizer=opt)``: each stage stepped as soon as its gradients
    are final, on a host worker, overlapped with the remaining backward) and ``async``
    (one-step stale: the update runs during the next call). Hidden fraction of the
    optimizer time = 1 - (t_mode - t_none) / t_opt per interleaved round (median), t_opt
    the step time measured inside ``sync``; and, from the devices' records, the same
    with t = the time from the devices' last compute to the end of the step ("tail"):
    the part of the optimizer that ran while the devices still computed. Target: >= 80%
    hidden for ``exact``. On this CPU-only machine the virtual devices' compute threads
    and the host optimizer share the cores: with 2 devices on 2 vCPUs, work overlapped
    with the backward still takes CPU time from it; with 1 device the host optimizer
    has a vCPU of its own (closer to a GPU machine, where compute is not on the host).
(cpu) The host AdamW step against the memory-bandwidth limit: parameters/s of one step
    over 16.8M fp32 parameters (16 tensors) for torch's fused, foreach and for-loop
    (torch's CPU default) implementations, fxpipe's streamed step (``fxpipe.optim_step``:
    an AdamW built with torch's defaults, stepped with fused kernels on ``--threads``
    intra-op threads) and a pool of Python threads running fused steps on parameters
    partitioned by bytes, on 1 and 2 threads; against the limit of 28 bytes moved per
    parameter (param, grad, exp_avg, exp_avg_sq read; param and both moments written) at
    the bandwidth of a 256 MB tensor copy (read + write counted, 8 B/element, as STREAM
    does) and of an in-place pass (``mul_``: each element read and written back, AdamW's
    own pattern; a copy's destination is also read first, write-allocate, so its real
    traffic is 12 B/element). Also how much a compute thread slows down while the host
    optimizer runs next to it; part (sim) takes the for-loop's single-thread rate (the
    simulator's ``cpu_optimizer_bytes_per_s`` counts bf16 parameter bytes: x2).
(sim) RoundPipe's five published configurations (8 RTX 4090, 16 microbatches, their
    measured layer times; ``tests/data/roundpipe_simulation.json``) with the host
    optimizer modelled (``fxpipe.sim.optimizer_modes``): relative throughput of
    RoundPipe-sync (its schedule, step after backward), fxpipe-exact (the searched
    schedule of ``bench_schedule.py``, streamed exact step) and RoundPipe-async (one-step
    stale), at two host AdamW rates: (cpu)'s single-thread rate x ``--host-cores``, and
    the rate RoundPipe's published async/sync throughput ratios imply (median).

Timed variants run interleaved, after a warm-up, one intra-op thread per worker; min
and median are reported. Writes ``benchmarks/results/bench_optimizer.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fxpipe  # noqa: E402
import fxpipe.optim  # noqa: E402
from fxpipe.demo import TinyLlama, progression_batch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "bench_optimizer.json"


def loss_fn(logits, target):
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


# ------------------------------------------------------------------------------ runtime

def part_runtime(args, num_devices: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    vocab = 256
    ids, target = progression_batch(args.batch, args.seq, vocab, gen)

    def setup():  # one model, pipe and optimizer per variant: no state crosses variants
        torch.manual_seed(0)
        model = TinyLlama(vocab=vocab, dim=args.dim, heads=args.dim // 64, depth=args.depth)
        pipe = fxpipe.compile(model, example_inputs=(ids,),
                              devices=[fxpipe.VirtualDevice(record=True)
                                       for _ in range(num_devices)],
                              config=fxpipe.RunConfig(num_microbatch=args.microbatches))
        # fused: the kernels the streamed step runs, so sync steps with them too
        return model, pipe, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    opt_times: list[float] = []
    tails: dict[str, list[float]] = {}

    def variant(mode):
        model, pipe, opt = setup()
        step = None if mode in ("none", "sync") else fxpipe.optim.overlapped(opt, mode=mode)

        def run() -> float:
            for d in pipe.devices:
                d.records.clear()
            t0 = time.perf_counter()
            pipe.forward_backward((ids,), label=target, loss_fn=loss_fn, optimizer=step)
            if mode == "sync":
                t1 = time.perf_counter()
                opt.step()
                opt_times.append(time.perf_counter() - t1)
            end = time.perf_counter()
            last = max(r[3] for d in pipe.devices for r in d.records if r[0] == "compute")
            tails.setdefault(mode, []).append(end - last)   # after the devices' last compute
            opt.zero_grad()
            if mode == "none":  # (untimed) as if stepped: the next call copies the weights too
                with torch.no_grad():
                    for p in model.parameters():
                        p.mul_(1.0)
            return end - t0
        return run, model, pipe

    built = {mode: variant(mode) for mode in ("none", "sync", "exact", "async")}
    model, pipe = built["none"][1], built["none"][2]
    variants = {mode: b[0] for mode, b in built.items()}
    times: dict[str, list[float]] = {k: [] for k in variants}
    for fn in variants.values():  # warm-up (the first AdamW step also creates its state)
        fn()
        fn()
    opt_times.clear()
    tails.clear()
    for _ in range(args.repeats):
        for name, fn in variants.items():  # interleaved; async overlaps its previous update
            times[name].append(fn())
    t_opt = {"min": min(opt_times), "median": statistics.median(opt_times)}
    res = {"model": dict(dim=args.dim, depth=args.depth, batch=args.batch, seq=args.seq,
                         microbatches=args.microbatches, vocab=vocab,
                         parameters=sum(p.numel() for p in model.parameters())),
           "plan": repr(pipe.plan), "optimizer": "AdamW", "repeats": args.repeats,
           "optimizer_step_s": t_opt, "times_s": times, "tails_s": tails, "variants": {}}
    print(f"\n(runtime) {num_devices} virtual device(s), {len(pipe.layers)} layers "
          f"({args.depth} blocks), dim "
          f"{args.dim}, batch {args.batch}x{args.seq}, {args.microbatches} microbatches, "
          f"{res['model']['parameters'] / 1e6:.1f}M parameters, AdamW")
    print(f"  optimizer step alone (timed inside sync): min {t_opt['min']:.3f} s, "
          f"median {t_opt['median']:.3f} s")
    print(f"{'variant':>8} | {'min s':>6} | {'median s':>8} | {'/sync':>5} | {'hidden':>6} | "
          f"{'tail s':>6} | {'hidden (tail)':>13}")
    tail_none = statistics.median(tails["none"])
    for name, ts in times.items():
        paired = [t / s for t, s in zip(ts, times["sync"])]
        hidden = [1 - (t - n) / o for t, n, o in zip(ts, times["none"], opt_times)]
        tail = statistics.median(tails[name])
        row = {"min_s": min(ts), "median_s": statistics.median(ts),
               "ratio_vs_sync_median": statistics.median(paired),
               "hidden_paired_median": statistics.median(hidden),
               "hidden_from_mins": 1 - (min(ts) - min(times["none"])) / t_opt["min"],
               "tail_median_s": tail,
               "hidden_tail": 1 - (tail - tail_none) / t_opt["median"]}
        res["variants"][name] = row
        hid = ("" if name == "none" else f"{row['hidden_paired_median']:6.0%}").rjust(6)
        hid_tail = ("" if name == "none" else f"{row['hidden_tail']:13.0%}").rjust(13)
        print(f"{name:>8} | {row['min_s']:6.3f} | {row['median_s']:8.3f} | "
              f"{row['ratio_vs_sync_median']:5.3f} | {hid} | {tail:6.3f} | {hid_tail}")
    print("  hidden = 1 - (t - t_none) / t_opt per interleaved round, median; tail = time from "
          "the devices' last compute to the end of the step (median); hidden (tail) = 1 - "
          "(tail - tail_none) / t_opt")
    return res


# ---------------------------------------------------------------------------------- cpu

# AdamW in fp32 reads a parameter, its gradient and both moments, and writes the parameter
# and both moments back: 7 x 4 bytes of memory traffic per parameter and step
ADAMW_BYTES_PER_PARAM = 7 * 4


@contextlib.contextmanager
def intra_op(threads: int):
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(prev)


def bandwidth_passes(threads: int, numel: int = 1 << 26) -> dict[str, Callable[[], None]]:
    """Two passes over 256 MB of fp32, each counted as 8 B per element: a tensor copy
    (read + write, as STREAM counts it) and an in-place multiply (each element read and
    written back: AdamW's own pattern). A copy's destination is also read into the
    cache before it is written (write-allocate), so its memory traffic is 12 B per
    element; the in-place pass moves exactly what it counts."""
    src, dst = torch.randn(numel), torch.empty(numel)

    def on_threads(fn):
        def run():
            with intra_op(threads):
                fn()
        return run
    return {"copy": on_threads(lambda: dst.copy_(src)), "in place": on_threads(lambda: src.mul_(1.0))}


def adamw_steppers(numel: int, threads: int) -> dict[str, Callable[[], None]]:
    """One AdamW step over ``numel`` fp32 parameters (16 tensors) per implementation, each
    with its own parameters and state, on ``threads`` threads: torch's fused, foreach and
    for-loop (torch's default on CPU) on intra-op threads; ``fxpipe``: an AdamW built with
    torch's defaults stepped as the streamed step does (``fxpipe.optim_step``: fused
    kernels, ``threads`` intra-op threads); ``fused pool``: ``threads`` Python threads of
    one intra-op thread each, the parameters partitioned by bytes (the lever not taken)."""
    from concurrent.futures import ThreadPoolExecutor

    from fxpipe.optim_step import fused_groups, intra_op_threads, step_view

    def params():
        ps = [torch.nn.Parameter(torch.randn(numel // 16)) for _ in range(16)]
        for p in ps:
            p.grad = torch.randn_like(p)
        return ps

    def on_threads(step):
        def run():
            with intra_op(threads):
                step()
        return run
    steppers = {name: on_threads(torch.optim.AdamW(params(), lr=1e-4, **kw).step)
                for name, kw in (("fused", {"fused": True}), ("foreach", {"foreach": True}),
                                 ("for-loop", {"foreach": False}))}
    opt = torch.optim.AdamW(params(), lr=1e-4)
    hyper = fused_groups(opt, [{k: v for k, v in g.items() if k != "params"}
                               for g in opt.param_groups])
    caller = torch.get_num_threads()

    def fxpipe_step():
        with intra_op_threads(threads, caller):
            step_view(opt, hyper, opt.param_groups[0]["params"])
    steppers["fxpipe"] = fxpipe_step
    ps, parts = params(), [[] for _ in range(threads)]
    for p in sorted(ps, key=lambda p: -p.numel()):   # greedy: the lightest part takes the next
        min(parts, key=lambda part: sum(q.numel() for q in part)).append(p)
    pool = ThreadPoolExecutor(threads, initializer=lambda: torch.set_num_threads(1))
    opts = [torch.optim.AdamW(part, lr=1e-4, fused=True) for part in parts]
    steppers["fused pool"] = lambda: list(pool.map(lambda o: o.step(), opts))
    return steppers


def part_cpu(args) -> dict:
    import os
    cores = os.cpu_count() or 1
    numel, band_numel = 1 << 24, 1 << 26
    steppers = {(name, t): fn for t in args.threads for name, fn in adamw_steppers(numel, t).items()
                if not (name == "fused pool" and t == 1)}
    passes = {(name, t): fn for t in args.threads for name, fn in bandwidth_passes(t, band_numel).items()}
    times: dict[tuple, list[float]] = {k: [] for k in (*steppers, *passes)}
    for fn in (*steppers.values(), *passes.values()):  # warm-up: the first step makes the state
        fn()
    for _ in range(args.repeats):
        for k, fn in (*steppers.items(), *passes.items()):   # interleaved
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    bw = {f"{name}, {t} thread{'s' if t > 1 else ''}": 8 * band_numel / min(times[(name, t)])
          for name, t in passes}
    best = {name: max(8 * band_numel / min(times[(n, t)]) for n, t in passes if n == name)
            for name in ("copy", "in place")}
    limit = {name: b / ADAMW_BYTES_PER_PARAM for name, b in best.items()}
    rows = {}
    print(f"\n(cpu) host AdamW step, fp32, {numel / 1e6:.1f}M parameters (16 tensors), {cores} cores; "
          f"min / median of {args.repeats} interleaved steps")
    print("  bandwidth, 256 MB passes counted at 8 B/element (best of the interleaved repeats): "
          + ", ".join(f"{k} {v / 1e9:.1f} GB/s" for k, v in bw.items()))
    print(f"  limit: {ADAMW_BYTES_PER_PARAM} B per parameter (4 tensors read, 3 written): copy "
          f"{best['copy'] / 1e9:.1f} GB/s -> {limit['copy'] / 1e6:.0f}M params/s; in place "
          f"{best['in place'] / 1e9:.1f} GB/s -> {limit['in place'] / 1e6:.0f}M params/s (a copy "
          f"also reads its destination first: its real traffic is 1.5x what it counts)")
    print(f"{'implementation':>14} | {'threads':>7} | {'min ms':>6} | {'M params/s':>10} | "
          f"{'median':>6} | {'/ copy limit':>12} | {'/ in-place limit':>16}")
    for (name, t) in steppers:
        ts = times[(name, t)]
        fastest, median = numel / min(ts), numel / statistics.median(ts)
        row = {"threads": t, "min_s": min(ts), "median_s": statistics.median(ts),
               "params_per_s": fastest, "params_per_s_median": median,
               "over_copy_limit": fastest / limit["copy"],
               "over_in_place_limit": fastest / limit["in place"]}
        rows[f"{name}, {t} thread{'s' if t > 1 else ''}"] = row
        print(f"{name:>14} | {t:>7} | {row['min_s'] * 1e3:6.1f} | {fastest / 1e6:10.0f} | "
              f"{median / 1e6:6.0f} | {row['over_copy_limit']:12.2f} | "
              f"{row['over_in_place_limit']:16.2f}")
    one = numel / min(times[("for-loop", 1)])  # torch's default on CPU, one thread (part sim)
    slowdown = matmul_slowdown_next_to_adamw(args.repeats)
    print(f"  a matmul thread next to a (for-loop) AdamW thread takes {slowdown:.2f}x as long (median)")
    return {"parameters": numel, "cores": cores, "bytes_per_param": ADAMW_BYTES_PER_PARAM,
            "bandwidth_bytes_per_s": bw, "limit_params_per_s": limit, "adamw": rows,
            "params_per_s_1_thread": one, "matmul_slowdown_next_to_adamw": slowdown}


def matmul_slowdown_next_to_adamw(repeats: int) -> float:
    """How much longer a matmul loop (a virtual device's compute) takes while another
    thread runs AdamW steps (the host optimizer), both one intra-op thread."""
    import threading
    a, w = torch.randn(128, 512), torch.randn(512, 2048)

    def matmuls() -> float:
        t0 = time.perf_counter()
        for _ in range(200):
            a @ w
        return time.perf_counter() - t0
    params = [torch.nn.Parameter(torch.randn(1 << 20)) for _ in range(32)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params)
    stop = threading.Event()

    def optimizer():
        torch.set_num_threads(1)
        while not stop.is_set():
            opt.step()
    matmuls()
    ratios = []
    for _ in range(repeats):
        alone = matmuls()
        stop.clear()
        th = threading.Thread(target=optimizer)
        th.start()
        time.sleep(0.05)
        beside = matmuls()
        stop.set()
        th.join()
        ratios.append(beside / alone)
    return statistics.median(ratios)


# ---------------------------------------------------------------------------------- sim

def part_sim(args, cpu: dict | None) -> dict:
    """RoundPipe's schedule (its semantics) synchronous and asynchronous, fxpipe's searched
    schedule with the streamed exact step, at a host optimizer rate measured here."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_schedule import DATA, M, layer_costs, roundpipe_candidate, search  # noqa: E402
    from fxpipe.sim import Hardware, optimizer_modes  # noqa: E402
    data = json.loads(DATA.read_text())
    per_core = cpu["params_per_s_1_thread"] if cpu else args.params_per_core
    rates = {"measured": per_core * args.host_cores}
    published = data["published_throughput_tokens_per_s_8x4090"]
    schedules, implied = {}, {}
    for name, model in data["models"].items():   # schedules do not depend on the optimizer
        L, costs = model["num_layers"], layer_costs(model, name)
        hw = Hardware(comm_ms_per_hop=model["comm_ms_per_hop"])
        rp = roundpipe_candidate(model)
        best, _, _, _ = search(model, args.budget)
        schedules[name] = (L, costs, rp.program(L, costs, hw, "roundpipe"),
                           [best.program(L, costs, hw), rp.program(L, costs, hw)])
        if name in published:   # the host rate RoundPipe's published async/sync implies
            t = optimizer_modes(schedules[name][2], costs, hw, semantics="roundpipe")
            ratio = published[name]["roundpipe"] / published[name]["roundpipe_sync"]
            opt_ms = ratio * t.async_ms - t.compute_ms
            params = sum(c.param_bytes for c in costs) / 2
            implied[name] = params / (opt_ms / 1e3)
    rates["roundpipe_implied"] = statistics.median(implied.values())
    out = {"host_cores": args.host_cores, "params_per_s_per_core": per_core,
           "implied_params_per_s": implied, "rates_params_per_s": rates, "by_rate": {}}
    for label, rate in rates.items():
        print(f"\n(sim) 8 GPUs, {M} microbatches, RoundPipe's layer times, bf16 parameters; "
              f"host AdamW {rate / 1e9:.2f}G params/s ({label}"
              + (f": {per_core / 1e6:.0f}M/s per core x {args.host_cores} cores)"
                 if label == "measured" else ": median over the 4 published async/sync ratios)"))
        print(f"{'model':>11} | {'opt s':>6} | {'RP-sync':>7} | {'fx-exact':>8} | {'RP-async':>8} | "
              f"{'exact exposed s':>15} | published RP-async")
        rows = {}
        for name, (L, costs, rp_program, fx_programs) in schedules.items():
            hw = Hardware(cpu_optimizer_bytes_per_s=2 * rate,
                          comm_ms_per_hop=data["models"][name]["comm_ms_per_hop"])
            rp_modes = optimizer_modes(rp_program, costs, hw, semantics="roundpipe")
            fx_modes = min((optimizer_modes(p, costs, hw) for p in fx_programs),
                           key=lambda m: m.exact_ms)
            pub = published.get(name)
            pub = pub["roundpipe"] / pub["roundpipe_sync"] if pub else None
            rel = {"roundpipe_sync": 1.0, "fxpipe_exact": rp_modes.sync_ms / fx_modes.exact_ms,
                   "roundpipe_async": rp_modes.sync_ms / rp_modes.async_ms,
                   "published_roundpipe_async": pub}
            rows[name] = {"roundpipe": rp_modes.as_dict(), "fxpipe": fx_modes.as_dict(),
                          "relative_throughput": rel}
            print(f"{name:>11} | {rp_modes.optimizer_ms / 1e3:6.2f} | {1.0:7.3f} | "
                  f"{rel['fxpipe_exact']:8.3f} | {rel['roundpipe_async']:8.3f} | "
                  f"{fx_modes.exact_exposed_ms / 1e3:15.3f} | "
                  f"{'-' if pub is None else f'{pub:.3f}'}")
        out["by_rate"][label] = {"params_per_s": rate, "models": rows}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=["runtime", "cpu", "sim", "all"], default="all")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--depth", type=int, default=16)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--devices", type=int, nargs="+", default=[2, 1],
                    help="(runtime) virtual device counts to measure")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2],
                    help="(cpu) host threads to step AdamW with")
    ap.add_argument("--host-cores", type=int, default=32,
                    help="(sim) host cores running the optimizer, at the measured per-core rate")
    ap.add_argument("--budget", type=int, default=120, help="(sim) simulations per schedule search")
    ap.add_argument("--params-per-core", type=float, default=None,
                    help="(sim) AdamW parameters/s per core, instead of measuring (--part sim)")
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    results: dict = {"torch": torch.__version__}
    out = Path(args.out)
    if out.exists():
        results.update(json.loads(out.read_text()))
    if args.part in ("runtime", "all"):
        results["runtime"] = {f"{n}_devices": part_runtime(args, n) for n in args.devices}
    if args.part in ("cpu", "all") or (args.part == "sim" and args.params_per_core is None):
        results["cpu"] = part_cpu(args)
    if args.part in ("sim", "all"):
        results["sim"] = part_sim(args, None if args.params_per_core else results["cpu"])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    print(f"wrote {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
