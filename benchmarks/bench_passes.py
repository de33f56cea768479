"""Time of each compiler pass (capture, partition, costs, lowering) for 12/48/100-layer models.

    python benchmarks/bench_passes.py [--layers 12 48 100] [--hidden 256] [--repeats 3]

Prints a table and writes benchmarks/results/bench_passes.json. Target (issue 2):
partition + costs + lowering (capture excluded) under 1 s for the 100-layer model.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fxpipe.passes import gc_paused  # noqa: E402
from fxpipe.passes.capture import capture  # noqa: E402
from fxpipe.passes.costs import compute_costs  # noqa: E402
from fxpipe.passes.lower import lower  # noqa: E402
from fxpipe.passes.partition import find_blocks, partition  # noqa: E402
from fxpipe.plan import ExecutePlan  # noqa: E402
from fxpipe.demo import TinyLlama  # noqa: E402


def time_passes(num_layers: int, hidden: int) -> dict[str, float]:
    torch.manual_seed(0)
    model = TinyLlama(vocab=256, dim=hidden, heads=4, depth=num_layers).eval()
    ids = torch.randint(0, 256, (2, 32))
    with gc_paused():  # as fxpipe.compile runs them
        t0 = time.perf_counter()
        gm = capture(model, (ids,))
        t1 = time.perf_counter()
        lg = partition(gm, model, find_blocks(model))
        t2 = time.perf_counter()
        compute_costs(lg, [ids])
        t3 = time.perf_counter()
        plan = ExecutePlan.default(len(lg), "train")
        lower(lg, list(plan.fwd_plan), ["vcpu:0", "vcpu:1"])
        t4 = time.perf_counter()
    return {"capture": t1 - t0, "partition": t2 - t1, "costs": t3 - t2, "lower": t4 - t3,
            "passes_without_capture": t4 - t1}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[12, 48, 100])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "bench_passes.json"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    time_passes(2, args.hidden)  # warm-up: imports, op registration, first-trace caches

    samples: dict[int, list[dict[str, float]]] = {n: [] for n in args.layers}
    for _ in range(args.repeats):  # interleave sizes across repeats
        for n in args.layers:
            samples[n].append(time_passes(n, args.hidden))
    keys = ["capture", "partition", "costs", "lower", "passes_without_capture"]
    rows = []
    print(f"{'layers':>6} | " + " | ".join(f"{k:>22}" for k in keys) + "   (seconds: min / median)")
    for n in args.layers:
        row = {"layers": n, "hidden": args.hidden}
        cells = []
        for k in keys:
            vals = [s[k] for s in samples[n]]
            row[k] = {"min": min(vals), "median": statistics.median(vals)}
            cells.append(f"{min(vals):10.3f} / {statistics.median(vals):9.3f}")
        rows.append(row)
        print(f"{n:>6} | " + " | ".join(f"{c:>22}" for c in cells))
    target = next((r for r in rows if r["layers"] == 100), None)
    if target:
        ok = target["passes_without_capture"]["median"] < 1.0
        print(f"target: partition+costs+lower < 1 s at 100 layers: "
              f"{target['passes_without_capture']['median']:.3f} s median -> {'met' if ok else 'NOT met'}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"benchmark": "bench_passes", "torch": torch.__version__,
                               "threads": 1, "repeats": args.repeats, "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
