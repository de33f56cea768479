"""One long sequence: how long it can be, and how fast it runs on 1 to 8 GPUs, in chunks.

Part (a), planned: ``fxpipe.plan.max_sequence_length`` for transformers'
Llama-3.1-8B and Qwen3-32B built on ``meta`` (no download), bf16, with the model's own
loss (``labels=``, the default), ``sequence_chunks="auto"`` (the default) against whole
sequences (``sequence_chunks=None``), with the chunks the longest length runs in and the
host bytes it needs (``details=``). Rows: the issue's (8 x 80 GiB, 1 x 80 GiB,
1 x 80 GiB LoRA with a 120 GiB host, 8 x 24 GiB; Qwen3-32B on 8 x 24 GiB).

Part (b), simulated: one 256K-token sequence of Llama-3.1-8B (full fine-tune, bf16) in
chunks on 1, 2, 4 and 8 H100s (80 GiB, 50 GB/s each way, 60 % of 989 TFLOP/s):
``fxpipe.simulate`` of the chunked Program (``pipe.program(sequence_chunks=K)``: every
backward stage's chunks last first), the layers costed at the chunk's length, each
chunk attention for the keys the average chunk reads (``(L + c) / 2``; its backward runs
the attention again) and for the keys and values it moves once per job (``2 * L * kv``
bytes, counted as uploaded with its parameters). Against the unchunked sequence on one H100 where
it fits. Tokens/s and the GPUs' busy fraction, labelled simulated.

    python benchmarks/bench_long_context.py [--parts a,b] [--out benchmarks/results/bench_long_context.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
import time

import torch

import fxpipe

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from bench_memory import configs  # noqa: E402 — the model shapes, one place

GiB = 2**30
H100 = dict(flops=989e12 * 0.6, memory=80 * GiB, link=50e9)


def build(name: str, lora: bool = False) -> torch.nn.Module:
    cfg, cls = {n: (c, k) for n, c, _, k in configs()}[name]
    with torch.device("meta"):
        model = cls(cfg)
        if lora:
            import peft
            model = peft.get_peft_model(model.to(torch.bfloat16), peft.LoraConfig(
                r=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                      "up_proj", "down_proj"]))
    return model


PLANNED = [   # (model, lora, devices, GiB each, host GiB, anchor)
    ("Llama-3.1-8B", False, 8, 80, None, "ALST 3.7M on 8 x H100"),
    ("Llama-3.1-8B", False, 1, 80, None, "ALST 500K on one H100"),
    ("Llama-3.1-8B", True, 1, 80, 120, "Unsloth 342K (QLoRA)"),
    ("Llama-3.1-8B", False, 8, 24, None, "RoundPipe 49K (8 x 4090)"),
    ("Qwen3-32B", False, 8, 24, None, "RoundPipe 28K (8 x 4090)"),
]


def part_a() -> list[dict]:
    print("(a) longest sequence, planned (bf16, labels=, max_length 8M)")
    print(f"{'model':<14} {'mode':<5} {'devices':>10} {'host':>6} {'whole':>8} {'chunked':>9} "
          f"{'chunks':>7} {'host bytes':>11} {'seconds':>8}  anchor")
    rows = []
    for name, lora, devices, gib, host, anchor in PLANNED:
        model = build(name, lora)
        common = dict(device_memory=gib * GiB, num_devices=devices,
                      host_memory=None if host is None else host * GiB)
        start = time.perf_counter()
        whole = fxpipe.plan.max_sequence_length(model, sequence_chunks=None, **common)
        details: dict = {}
        chunked = fxpipe.plan.max_sequence_length(model, details=details, **common)
        seconds = time.perf_counter() - start
        row = {"model": name, "mode": "lora" if lora else "full", "devices": devices,
               "device_gib": gib, "host_gib": host, "whole_tokens": whole,
               "chunked_tokens": chunked, "sequence_chunks": details["sequence_chunks"],
               "host_bytes": details["host_bytes"], "anchor": anchor, "seconds": seconds}
        rows.append(row)
        print(f"{name:<14} {row['mode']:<5} {devices:>2} x {gib:>2} GiB {host or '-':>6} "
              f"{whole // 1024:>7}K {chunked // 1024:>8}K {row['sequence_chunks']:>7} "
              f"{details['host_bytes'] / GiB:>7.0f} GiB {seconds:>8.1f}  {anchor}", flush=True)
    return rows


def simulated_step(model, length: int, chunks: int, num_devices: int) -> dict:
    """One chunked step of ``length`` tokens on ``num_devices`` H100s, simulated."""
    from fxpipe.plan import layer_costs
    from fxpipe.sequence_plan import kv_layout
    from fxpipe.sim import Hardware, LayerCost, simulate
    hw = Hardware(flops=H100["flops"], memory=H100["memory"], h2d_bandwidth=H100["link"],
                  d2h_bandwidth=H100["link"])
    ids = torch.zeros(1, length, dtype=torch.long, device="meta")
    devices = [fxpipe.VirtualDevice(semantics="cuda", memory_limit=H100["memory"])
               for _ in range(num_devices)]
    pipe = fxpipe.compile(model, example_kwargs={"input_ids": ids, "labels": ids},
                          devices=devices, param_dtype=torch.bfloat16)
    program = pipe.program(sequence_chunks=chunks, optimizer=True)
    step = pipe._chunk_steps[1]
    lg = step._current.layers
    kv = kv_layout(step.module, lg, torch.bfloat16)
    costs = []   # the chunk attention's FLOPs are costed (the average chunk's keys)
    for i, cost in enumerate(layer_costs(step)):
        lc = LayerCost.of(cost, hw)
        if i in kv.layers:   # its keys and values cross the link once per job
            lc = dataclasses.replace(lc, param_bytes=lc.param_bytes + 2 * length * kv.bytes_per_token)
        costs.append(lc)
    t = simulate(program, costs, hw, tokens_per_step=length)
    busy = sum(t.busy) / (num_devices * t.makespan)
    pipe.close()
    return {"devices": num_devices, "tokens": length, "sequence_chunks": chunks,
            "step_s": t.makespan / 1e3, "tokens_per_s": length / (t.makespan / 1e3),
            "busy_fraction": busy, "plan": repr(program.stages and step._current.plan)}


def part_b(length: int = 256 * 1024, chunks: int = 128) -> list[dict]:
    print(f"\n(b) one {length // 1024}K-token sequence, Llama-3.1-8B full, bf16, {chunks} chunks, "
          "H100s (simulated)")
    model = build("Llama-3.1-8B")
    rows = []
    for g in (1, 2, 4, 8):
        row = simulated_step(model, length, chunks, g)
        rows.append(row)
        base = rows[0]["tokens_per_s"]
        busy = f"  GPUs busy {row['busy_fraction']:.0%}"
        print(f"  {g} x H100: {row['tokens_per_s']:>8,.0f} tokens/s (simulated), step "
              f"{row['step_s']:.1f} s, {row['tokens_per_s'] / base:.2f}x one GPU{busy}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="a,b")
    parser.add_argument("--out", default="benchmarks/results/bench_long_context.json")
    args = parser.parse_args(argv)
    parts = set(args.parts.split(","))
    result: dict = {"command": "python benchmarks/bench_long_context.py",
                    "torch": torch.__version__}
    if "a" in parts:
        result["planned"] = part_a()
    if "b" in parts:
        result["simulated"] = part_b()
    pathlib.Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
