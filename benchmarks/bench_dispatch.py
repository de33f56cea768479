"""Per-node cost of running a stage: its generated code vs the fx interpreter.

    python benchmarks/bench_dispatch.py [--repeats 7]

A stage runs as its GraphModule's generated ``forward`` under ``interpret.Transfers`` (a
``TorchFunctionMode`` serving the fxpipe transfer nodes), or node by node through
``interpret.StageRun`` (an ``fx.Interpreter``) where that is needed: per-layer timing,
and a recompute that skips its tail. On a GPU this is host time spent issuing kernels:
per node it bounds how small a layer can be before issue, not the GPU, sets the pace.
A tiny Llama-style model on one virtual device, inference (no copies worth counting):
the call time over the nodes run, both ways, interleaved. Writes
benchmarks/results/bench_dispatch.json.
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

import fxpipe  # noqa: E402
from fxpipe.demo import TinyLlama, progression_batch  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--calls", type=int, default=20, help="calls per timing")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "bench_dispatch.json"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = TinyLlama(vocab=64, dim=32, heads=2, depth=8)
    ids, _ = progression_batch(2, 8, 64, torch.Generator().manual_seed(0))
    pipe = fxpipe.compile(model, example_inputs=(ids,), devices=[fxpipe.VirtualDevice()],
                          config=fxpipe.RunConfig(num_microbatch=1))
    nodes = sum(len(st.gm.graph.nodes) for st in pipe._executable("infer").stages.values())

    def timed(interpreted: bool) -> float:
        pipe.timings.first, pipe.timings.every = 0, 1 if interpreted else 10**9
        t0 = time.perf_counter()
        with torch.no_grad():
            for _ in range(args.calls):
                pipe(ids)
        return (time.perf_counter() - t0) / args.calls

    rows = {"generated": [], "interpreted": []}
    for _ in range(2):
        timed(False), timed(True)
    for _ in range(args.repeats):
        rows["generated"].append(timed(False))
        rows["interpreted"].append(timed(True))
    med = {k: statistics.median(v) for k, v in rows.items()}
    per_node = {k: med[k] / nodes * 1e6 for k in med}
    print(f"{nodes} graph nodes per inference call (tiny model: the call is mostly overhead)")
    print(f"{'way':>12} | {'call ms (min / median)':>22} | {'us per node (median)':>20}")
    for k, v in rows.items():
        print(f"{k:>12} | {min(v) * 1e3:9.2f} / {med[k] * 1e3:9.2f} | {per_node[k]:20.2f}")
    extra = (med["interpreted"] - med["generated"]) / nodes * 1e6
    print(f"the interpreter adds {extra:.2f} us per node "
          f"({med['interpreted'] / med['generated']:.2f}x the generated code's call time)")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"nodes": nodes, "rows_s": rows, "us_per_node_median": per_node,
                               "interpreter_extra_us_per_node": extra}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
