"""Capture time of a tiny Swin and a tiny Qwen3-Next (configs in code), by policy.

    python benchmarks/bench_capture.py [--repeats 1]

- ``every dim symbolic``: ``torch.export`` with every input dim dynamic (fxpipe before
  issue 19);
- ``batch dim symbolic``: what ``fxpipe.compile`` does now on its first capture (the other
  dims specialized; a call with another size there captures once more, with that dim
  symbolic);
- ``blocks``: the block-granular capture (``fxpipe.passes.blocks``) that ``capture="auto"``
  falls back to for models that are not one graph (blocks run as modules);
- ``again, another instance``: the batch-dim capture of a second model of the same code
  and config (a deep copy) right after the first's: the capture cache
  (``fxpipe.passes.capture_cache``) serves it. The other policies run with the cache
  emptied first, so each traces.

Prints a table (seconds, min over repeats) and writes benchmarks/results/bench_capture.json.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fxpipe.passes import capture_cache  # noqa: E402
from fxpipe.passes.capture import capture  # noqa: E402
from fxpipe.passes.partition import _positions, find_block_lists  # noqa: E402


def models() -> dict:
    import transformers as T
    g = torch.Generator().manual_seed(0)
    swin = T.SwinForImageClassification(T.SwinConfig(
        image_size=16, patch_size=2, embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=2,
        num_labels=5, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        drop_path_rate=0.0, mlp_ratio=2.0)).eval()
    images = {"pixel_values": torch.randn(4, 3, 16, 16, generator=g),
              "labels": torch.randint(0, 5, (4,), generator=g)}
    qwen = T.Qwen3NextForCausalLM(T.Qwen3NextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, use_cache=False,
        head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, linear_num_value_heads=4, linear_num_key_heads=2,
        linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
        layer_types=["linear_attention", "full_attention"])).eval()
    ids = torch.randint(2, 64, (4, 8), generator=g)
    text = {"input_ids": ids, "attention_mask": torch.ones(4, 8, dtype=torch.long), "labels": ids}
    return {"swin": (swin, images), "qwen3_next": (qwen, text)}


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _traced(fn):
    """``fn`` timed with the capture cache emptied first: it traces."""
    def run(m, kw, blocks) -> float:
        capture_cache.clear()
        return _timed(lambda: fn(m, kw, blocks))
    return run


def _again(m, kw, blocks) -> float:
    """A second instance of the same model captured right after the first (untimed)."""
    capture_cache.clear()
    capture(m, (), kw, "export", dynamic=[{0} for _ in kw])
    twin = copy.deepcopy(m)
    return _timed(lambda: capture(twin, (), kw, "export", dynamic=[{0} for _ in kw]))


POLICIES = {
    "every dim symbolic": _traced(lambda m, kw, blocks: capture(m, (), kw, "export")),
    "batch dim symbolic": _traced(lambda m, kw, blocks: capture(m, (), kw, "export",
                                                                dynamic=[{0} for _ in kw])),
    "blocks": _traced(lambda m, kw, blocks: capture(m, (), kw, "blocks",
                                                    dynamic=[{0} for _ in kw], blocks=blocks)),
    "again, another instance": _again,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "bench_capture.json"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    results: dict[str, dict[str, float]] = {}
    for name, (model, kw) in models().items():
        blocks = [p for p, _ in _positions(model, find_block_lists(model))]
        POLICIES["blocks"](model, kw, blocks)  # warm-up: imports and first-trace caches
        results[name] = {}
        for _ in range(args.repeats):  # interleaved
            for policy, run in POLICIES.items():
                took = run(model, kw, blocks)
                results[name][policy] = min(took, results[name].get(policy, float("inf")))
    print(f"{'model':<12}" + "".join(f"{p:>25}" for p in POLICIES))
    for name, row in results.items():
        print(f"{name:<12}" + "".join(f"{row[p]:>24.2f}s" for p in POLICIES))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"seconds": results, "repeats": args.repeats}, indent=2))


if __name__ == "__main__":
    main()
