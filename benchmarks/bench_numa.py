"""What a two-socket host costs when fxpipe's host memory sits on one NUMA node (#41 item 5).

fxpipe's host buffers are first touched by one thread, so on a dual-socket 8-GPU machine
they sit on one socket's memory and the GPUs of the other socket read every prefetch
across the socket link (UPI / xGMI), which they share. The runtime does not yet place
each stage's host memory on its GPUs' node; this prices what that costs, with
``fxpipe.simulate`` (``Hardware.sockets``, ``socket_link_bytes_per_s``, ``host_memory``),
beside the same machine with the memory local. Simulated, not measured: no multi-socket
machine has run fxpipe yet.

The model is Llama-3.1-8B-shaped: 32 blocks of 218M parameters in bf16 (436 MB each),
4,096-token microbatches, 8 of them per step, on 8 GPUs with 50 GB/s host links each way,
each block's forward at 400 TFLOP/s (about 40 % of an H100's dense bf16), backward twice
that; two blocks per stage.

    python benchmarks/record.py benchmarks/results/bench_numa.json -- \\
        python benchmarks/bench_numa.py
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from fxpipe.passes.schedule import build_program
from fxpipe.sim.hardware import Hardware, LayerCost
from fxpipe.sim.simulate import simulate

ROOT = Path(__file__).resolve().parents[1]
PARAMS, TOKENS, FLOPS, LINK = 218e6, 4096, 400e12, 50e9
G, M, LAYERS = 8, 8, 32


def rows() -> list[dict]:
    fwd = 2 * PARAMS * TOKENS / FLOPS * 1e3
    costs = [LayerCost(fwd, 2 * fwd, param_bytes=2 * PARAMS, boundary_bytes=TOKENS * 4096 * 2)] * LAYERS
    fwd_plan = [range(i, i + 2) for i in range(0, LAYERS - 2, 2)]
    bwd_plan = [range(LAYERS - 2, LAYERS)] + [range(i, i + 2) for i in range(LAYERS - 4, -1, -2)]
    program = build_program(fwd_plan, bwd_plan, "fused", G, M, "stage")
    base = dict(flops=FLOPS, h2d_bandwidth=LINK, d2h_bandwidth=LINK)
    cases = [("one socket", {}),
             ("2 sockets, memory local to each stage's GPUs", dict(sockets=2, socket_link_bytes_per_s=60e9,
                                                                   host_memory="local")),
             ("2 sockets, memory on one node, 60 GB/s link", dict(sockets=2, socket_link_bytes_per_s=60e9)),
             ("2 sockets, memory on one node, 30 GB/s link", dict(sockets=2, socket_link_bytes_per_s=30e9))]
    out = []
    for name, hw in cases:
        t = simulate(program, costs, Hardware(**base, **hw))
        out.append({"case": name, "hardware": hw, "step_ms": t.makespan,
                    "exposed_transfer_ms": t.exposed_transfer_ms})
    one = out[0]["step_ms"]
    for r in out:
        r["vs_one_socket"] = r["step_ms"] / one
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "bench_numa.json"))
    args = ap.parse_args(argv)
    result = rows()
    print(f"{'case':50s} {'step ms':>9s} {'exposed ms':>11s} {'vs 1 socket':>12s}")
    for r in result:
        print(f"{r['case']:50s} {r['step_ms']:9.1f} {r['exposed_transfer_ms']:11.1f} "
              f"{r['vs_one_socket']:12.3f}")
    path = Path(args.json)
    old = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps({**old, "simulated": True, "rows": result}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
