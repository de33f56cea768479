"""A frozen base loaded with ``weights=`` (memory-mapped) against the usual way (issue 29).

    python benchmarks/bench_big_weights.py                 # a 469 MiB fp32 Llama-style base
    python benchmarks/bench_big_weights.py --layers 4 --repeat 1   # quicker

The checkpoint: a Llama-style ``LlamaForCausalLM`` (hidden 1024, intermediate 2816,
``--layers`` blocks, vocab 32000, tied embeddings; random weights) saved once with
``save_pretrained`` as 200 MB shards with an index (page cache warmed before the runs).
A LoRA adapter (PEFT, r=8 on q/v) is trained on top; the base is frozen. Each row runs in
a fresh process on 2 virtual devices (each limited to a quarter of the base, or three
embeddings) and trains
``--steps`` fused steps with an SGD step on the adapters:

- ``weights=``: the model built on the meta device, the adapter added, then
  ``fxpipe.compile(model, ..., weights=DIR)``;
- ``from_pretrained``: ``LlamaForCausalLM.from_pretrained(DIR)``, the adapter, then
  ``fxpipe.compile``.

Columns: ``anon_growth``: ``RssAnon`` (``/proc/self/status``: anonymous memory only,
file-backed pages are not in it) after the steps, above the process's baseline (after
imports), with the virtual devices' memory (a GPU's, on a GPU) given back
(``empty_cache``), as a multiple of the frozen base's bytes (target: < 0.35 for
``weights=``); ``peak_anon``: the highest ``RssAnon`` sampled every 5 ms during the run
(virtual devices' memory included), same unit; ``first_step_s``: from the start of
building the model to the end of the first step (min over ``--repeat`` interleaved
runs); ``model_ready_s`` and ``compiled_s``: the same clock when the model (with its
adapter) exists and when ``compile`` has returned. The adapters get the same values in
both rows (the losses must match). Rows run with ``MALLOC_MMAP_THRESHOLD_=131072``, so that freed large blocks go
back to the system (RssAnon measures the program, not malloc's reserve). Prints a table
and writes ``benchmarks/results/bench_big_weights.json`` (with the command).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results", "bench_big_weights.json")


def config(layers: int):
    import transformers as T
    return T.LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816,
                         num_hidden_layers=layers, num_attention_heads=16,
                         num_key_value_heads=4, max_position_embeddings=256,
                         tie_word_embeddings=True, use_cache=False)


def make_checkpoint(path: str, layers: int) -> int:
    """Save a random model to ``path``; returns its bytes."""
    import torch
    import transformers as T
    torch.manual_seed(0)
    model = T.LlamaForCausalLM(config(layers))
    model.save_pretrained(path, max_shard_size="200MB")
    return sum(p.numel() * p.element_size() for p in model.parameters())


def anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status (Linux only)")


def child(variant: str, path: str, layers: int, steps: int) -> dict:
    """One row, in this (fresh) process."""
    import threading

    import peft
    import torch
    import transformers as T

    import fxpipe
    torch.set_num_threads(1)
    base_anon = anon()
    peak = [base_anon]
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], anon())
            time.sleep(0.005)
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    lora = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                           lora_dropout=0.0)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 32000, (4, 64), generator=g)
    kw = {"input_ids": ids, "labels": ids}
    start = time.perf_counter()
    if variant == "weights":
        with torch.device("meta"):
            base = T.LlamaForCausalLM(config(layers))
        extra = {"weights": path}
    else:
        base = T.LlamaForCausalLM.from_pretrained(path)
        extra = {}
    model = peft.get_peft_model(base, lora)
    loaded = time.perf_counter() - start
    frozen = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
    limit = max(frozen // 4, 3 * 32000 * 1024 * 4)   # the embedding layer fits
    devices = [fxpipe.VirtualDevice(memory_limit=limit) for _ in range(2)]
    pipe = fxpipe.compile(model, example_kwargs=kw, devices=devices,
                          config=fxpipe.RunConfig(num_microbatch=2), **extra)
    compiled = time.perf_counter() - start
    g = torch.Generator().manual_seed(2)   # the same adapter values in both rows
    with torch.no_grad():
        for _, p in sorted((n, p) for n, p in model.named_parameters() if p.requires_grad):
            p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    first = None
    losses = []
    for _ in range(steps):
        losses.append(float(pipe.forward_backward((), kw, loss_fn=lambda out, _: out.loss,
                                                  optimizer=opt)))
        opt.zero_grad(set_to_none=True)
        if first is None:
            first = time.perf_counter() - start
    for d in devices:
        d.empty_cache()
    after = anon()
    stop.set()
    sampler.join()
    pipe.close()
    return {"variant": variant, "frozen_bytes": frozen, "anon_growth_bytes": after - base_anon,
            "peak_anon_bytes": peak[0] - base_anon, "first_step_s": first, "losses": losses,
            "model_ready_s": loaded, "compiled_s": compiled,
            "plan": str(pipe.plan)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--dir", default=None, help="where the checkpoint goes (default: a temp dir)")
    ap.add_argument("--child", nargs=2, metavar=("VARIANT", "PATH"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], args.child[1], args.layers, args.steps)))
        return
    tmp = tempfile.TemporaryDirectory() if args.dir is None else None
    path = args.dir or tmp.name
    t0 = time.perf_counter()
    total = make_checkpoint(path, args.layers)
    print(f"checkpoint: {total / 2**20:.0f} MiB in {path} ({time.perf_counter() - t0:.1f} s)")
    for name in os.listdir(path):   # warm the page cache: both rows read from it
        with open(os.path.join(path, name), "rb") as f:
            while f.read(1 << 24):
                pass
    env = dict(os.environ, PYTHONPATH=ROOT, MALLOC_MMAP_THRESHOLD_=str(1 << 17))
    env.setdefault("FXPIPE_HOST_MS_PER_ACTION", "0")
    rows: dict[str, list[dict]] = {"weights": [], "from_pretrained": []}
    for _ in range(args.repeat):
        for variant in rows:   # interleaved
            out = subprocess.run(
                ["nice", sys.executable, os.path.abspath(__file__), "--layers", str(args.layers),
                 "--steps", str(args.steps), "--child", variant, path],
                capture_output=True, text=True, env=env)
            if out.returncode:
                raise SystemExit(f"{variant} failed:\n{out.stderr[-4000:]}")
            rows[variant].append(json.loads(out.stdout.strip().splitlines()[-1]))
    summary = {}
    print(f"\n{'variant':<16} {'frozen MiB':>10} {'anon_growth':>12} {'peak_anon':>10} "
          f"{'model_ready_s':>14} {'compiled_s':>11} {'first_step_s':>13}")
    for variant, runs in rows.items():
        frozen = runs[0]["frozen_bytes"]
        s = {
            "frozen_bytes": frozen,
            "anon_growth_over_frozen": [r["anon_growth_bytes"] / frozen for r in runs],
            "peak_anon_over_frozen": [r["peak_anon_bytes"] / frozen for r in runs],
            "first_step_s": [r["first_step_s"] for r in runs],
            "model_ready_s": [r["model_ready_s"] for r in runs],
            "compiled_s": [r["compiled_s"] for r in runs],
            "losses": runs[0]["losses"], "plan": runs[0]["plan"],
        }
        summary[variant] = s
        print(f"{variant:<16} {frozen / 2**20:>10.0f} {min(s['anon_growth_over_frozen']):>11.2f}x "
              f"{min(s['peak_anon_over_frozen']):>9.2f}x {min(s['model_ready_s']):>13.1f}s "
              f"{min(s['compiled_s']):>10.1f}s {min(s['first_step_s']):>12.1f}s "
              f"(median {statistics.median(s['first_step_s']):.1f}s)")
    same = summary["weights"]["losses"] == summary["from_pretrained"]["losses"]
    w, h = summary["weights"], summary["from_pretrained"]
    verdict = {
        "anon_growth_target": 0.35,
        "anon_growth_ok": max(w["anon_growth_over_frozen"]) < 0.35,
        "first_step_ratio_weights_over_from_pretrained":
            min(w["first_step_s"]) / min(h["first_step_s"]),
        "same_losses": same,
    }
    print(f"\nweights= anon growth {max(w['anon_growth_over_frozen']):.2f}x of the frozen base "
          f"(target < 0.35: {'ok' if verdict['anon_growth_ok'] else 'MISSED'}); time to first "
          f"step {verdict['first_step_ratio_weights_over_from_pretrained']:.2f}x from_pretrained's; "
          f"losses equal: {same}")
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with open(RESULTS, "w") as f:
        json.dump({"command": " ".join(["python", "benchmarks/bench_big_weights.py", *sys.argv[1:]]),
                   "host": os.uname().nodename, "cpus": os.cpu_count(),
                   "rows": rows, "summary": summary, "verdict": verdict}, f, indent=2)
    print(f"wrote {RESULTS}")
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
