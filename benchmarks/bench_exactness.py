"""Exactness on real batches: fxpipe's loss and gradients against eager's on padded batches.

    .venv/bin/python benchmarks/bench_exactness.py          # ~2 min on 2 cores

Hugging Face Llama (causal LM), T5 (seq2seq) and BERT (masked LM), tiny configs built in
code, each trained one fused step with its own ``labels=`` loss on a fine-tuning batch of 4
rows (``tests/hf_zoo.sft_batch``: a masked prompt, a row cut short, a row with no target;
BERT's targets only where 30 % of the tokens were masked), 2 virtual devices, 1 to 4
microbatches. Per row: the loss's relative difference from eager's, and the largest
gradient difference over the model's largest gradient, side by side for fxpipe's
weights (each microbatch by its share of the target tokens: ``fxpipe.runtime.issue.loss_weights``)
and for the earlier design (by its share of the rows, the model's mean as it is). And the
host time the count of targets adds to a call (the count graph run on every microbatch's
inputs before the call), min and median over repeats. Errors are the same on any CPU; the
time is this CPU's.

Writes ``benchmarks/results/bench_exactness.json``.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import fxpipe  # noqa: E402
from fxpipe.runtime.issue.inputs import check_inputs  # noqa: E402
from fxpipe.runtime.issue.loss_weights import shares  # noqa: E402
from fxpipe.runtime.issue.microbatch import split_input  # noqa: E402
from tests import hf_zoo  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "bench_exactness.json"
MODELS = ("llama", "t5", "bert")


def errors(model, ref, loss, expected) -> tuple[float, float]:
    """(loss relative difference, largest gradient difference / largest gradient)."""
    worst = scale = 0.0
    for p, q in zip(model.parameters(), ref.parameters()):
        if q.grad is not None:
            scale = max(scale, q.grad.abs().max().item())
            worst = max(worst, (p.grad - q.grad).abs().max().item())
    return abs(loss - expected) / abs(expected), worst / scale


def by_rows(pipe) -> None:
    """The earlier design: no loss weighted by its targets (the rows' shares)."""
    for compiled in pipe._cache:
        for chain in (compiled, compiled.trimmed(pipe.module)):
            chain.layers.token_means = {}


def count_us(pipe, batch: dict, m: int, repeats: int) -> list[float]:
    """Host µs of a call's ``shares`` (the count of every microbatch's targets)."""
    lg = pipe.layers
    args, kwargs = split_input((), batch, m, None)
    envs = [dict(zip(lg.input_names, check_inputs(lg, a, k))) for a, k in zip(args, kwargs)]
    rows = [e[lg.input_names[0]].shape[0] for e in envs]
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        shares(lg, envs, rows)
        times.append((time.perf_counter() - t) * 1e6)
    return times


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--microbatches", default="1,2,3,4")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    counts = [int(m) for m in args.microbatches.split(",")]
    rows, timing = [], []
    for name in MODELS:
        model, _, _, _ = hf_zoo.setup(name)
        batch = hf_zoo.sft_batch(name)
        ref = copy.deepcopy(model)
        expected = ref(**batch).loss
        expected.backward()
        result: dict[str, dict[int, tuple[float, float]]] = {}
        for design in ("tokens", "rows"):
            net = copy.deepcopy(model)
            with fxpipe.compile(net, example_kwargs=batch,
                                devices=[fxpipe.VirtualDevice() for _ in range(2)]) as pipe:
                if design == "rows":
                    by_rows(pipe)
                else:
                    times = count_us(pipe, batch, max(counts), args.repeats)
                    timing.append({"model": name, "microbatches": max(counts),
                                   "count_us_min": min(times),
                                   "count_us_median": statistics.median(times)})
                for m in counts:
                    net.zero_grad()
                    loss = pipe.forward_backward((), batch, loss_fn=hf_zoo.own_loss,
                                                 run_config=fxpipe.RunConfig(num_microbatch=m))
                    result.setdefault(design, {})[m] = errors(net, ref, loss.item(),
                                                              expected.item())
        for m in counts:
            (tl, tg), (rl, rg) = result["tokens"][m], result["rows"][m]
            rows.append({"model": name, "microbatches": m, "loss_rel_diff": tl,
                         "grad_rel_diff": tg, "rows_loss_rel_diff": rl, "rows_grad_rel_diff": rg})
            print(f"{name:6s} M={m}  tokens: loss {tl:.1e} grads {tg:.1e}   "
                  f"rows: loss {rl:.1e} grads {rg:.1e}", flush=True)
    for t in timing:
        print(f"{t['model']:6s} counting {t['microbatches']} microbatches: "
              f"{t['count_us_min']:.0f} µs min, {t['count_us_median']:.0f} µs median")
    out = Path(args.out)
    data = json.loads(out.read_text()) if out.exists() else {}
    data.update({"rows": rows, "count_time": timing})
    out.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
