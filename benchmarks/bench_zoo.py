"""The architecture sweep: every transformers model of four families fxpipe can build from
a tiny config, one training step each in fp32 and with ``param_dtype=torch.bfloat16``,
against the eager reference of each precision.

    .venv/bin/python benchmarks/bench_zoo.py                        # hours on 2 cores
    .venv/bin/python benchmarks/bench_zoo.py --family vision --limit 5 --timeout-s 120
    .venv/bin/python benchmarks/bench_zoo.py --only causal/xglm,vision/resnet --update

Families, from transformers' auto mappings (nothing is downloaded): ``causal``
(``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``), ``seq2seq``
(``MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES``), ``masked``
(``MODEL_FOR_MASKED_LM_MAPPING_NAMES``) and ``vision``
(``MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES``). Each architecture's default config
is shrunk by attribute name (``shrunk``: widths 32, feed-forwards 64, 4 heads, 2 layers,
a 128-token vocabulary, 4 experts, 32-pixel images) and the model built with
non-trivial weights (``tests.models.init_like_training``) in eval mode. An architecture
is *skipped*, with the reason, when its config or model cannot be built so, when it is
still over ``MAX_PARAMS``, when it returns no loss, or when eager PyTorch fails on the
batch (in bf16: when the bf16 reference fails, as FNet's FFT does). Otherwise it
*passes* when ``pipe.forward_backward`` through ``fxpipe.compile(..., devices=[2 virtual
devices])`` (2 microbatches, the model's own ``labels=`` loss) returns the reference's
loss: fp32 within ``RTOL["fp32"]`` of the model's own; bf16 within ``RTOL["bf16"]`` of
``tests.hf_zoo.Eager``'s ``"param_dtype"`` reference (bf16 parameters, and buffers in
the dtypes ``from_pretrained(..., dtype=torch.bfloat16)`` gives them). Else it *fails*:
an error, a loss out of tolerance, or more than ``--timeout-s`` seconds.

Each architecture runs in a worker process (its data bounded by ``WORKER_MEMORY``),
restarted after a timeout or a crash. Prints a table
(architecture, fp32 and bf16 ok or why, the bf16 loss over its reference's) and writes
``benchmarks/results/bench_zoo.json`` (``--update``: replaces the architectures it ran
in the existing file and keeps the others).
"""

from __future__ import annotations

import argparse
import copy
import inspect
import json
import os
import re
import resource
import select
import signal
import subprocess
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

OUT = ROOT / "benchmarks" / "results" / "bench_zoo.json"
FAMILIES = {
    "causal": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "seq2seq": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "masked": "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
    "vision": "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
}
PRECISIONS = ("fp32", "bf16")
RTOL = {"fp32": 1e-4, "bf16": 3e-2}   # bf16: tests/test_hf_matrix.py's LOSS_RTOL
MAX_PARAMS = 20_000_000
WORKER_MEMORY = 6 << 30   # bytes of data a worker may allocate (RLIMIT_DATA)
BATCH, SEQ, LABELS = 4, 16, 5
MARK = "@@zoo "   # a worker's result lines on stdout start with it

KV_HEADS = r"num_key_value_heads|num_kv_heads|n_kv_heads?|kv_n_heads|multi_query_group_num"
# config attribute (full match) -> the value it is shrunk to (never grown); first match wins
SHRINK = [
    (r"(.*_)?vocab(_size)?(_.*)?", 128),
    (r"num_hidden_layers|num_layers|n_layers?|encoder_layers|decoder_layers|"
     r"num_(en|de)coder_layers|num_text_layers|num_vision_layers", 2),
    (KV_HEADS, 2),   # 4 where the model has as many as attention heads (MLA needs it)
    (r"num_attention_heads|num_heads|n_heads?|(en|de)coder_attention_heads|attention_heads|"
     r"num_(en|de)coder_attention_heads|linear_num_(key_|value_)?heads", 4),
    (r"head_dim|d_kv|kv_channels|attention_head_dim|qk_(rope|nope)_head_dim|v_head_dim|"
     r"(linear_)?(key_|value_)?head_dim|mamba_headdim|attention_head_size|"
     r"hidden_size_per_layer_input", 8),
    (r"kv_lora_rank|q_lora_rank", 16),
    (r"rotary_dim", 4),
    (r"mamba_n_heads|n_mamba_heads", 8),
    (r"mamba_d_head|mamba_headdim", 8),
    (r"mamba_d_state|state_size|d_state", 16),
    (r"intermediate_size|ffn_dim|ffn_hidden_size|d_ff|n_inner|d_inner|mlp_dim|hidden_dim|"
     r"(en|de)coder_ffn_dim|intermediate_size_mlp|(moe|shared_expert|expert)_intermediate_size|"
     r"moe_ffn_hidden_size|dim_feedforward", 64),
    (r"hidden_size|d_model|n_embd|n_embed|dim|embed_dim|d_embed|model_dim|embedding_size|"
     r"word_embed_proj_dim|embedding_dim|attention_hidden_size|hidden_size_per_head|"
     r"hidden_size_global", 32),
    (r"num_experts|num_local_experts|n_routed_experts|moe_num_experts|num_routed_experts", 4),
    (r"num_experts_per_tok(en)?|moe_top_k|moe_k|num_selected_experts|top_k|n_group|topk_group|"
     r"num_expert_group|n_shared_experts|(moe_)?num_shared_experts", 2),
    (r"image_size", 32),
    (r"patch_size", 4),
    (r"window_size", 2),
    (r"max_position_embeddings|n_positions|max_seq_len|max_sequence_length", 128),
    (r"num_labels", LABELS),
    (r"num_groups", 4),
]
# lists of per-stage values (vision backbones): depths -> 1 each, widths scaled to at
# most 128 in multiples of 32, heads at most 2
LIST_SHRINK = [(r".*depths?|.*num_layers|.*blocks?|layers", lambda v, top: 1),
               (r"hidden_sizes|embed_dims?|dims|hidden_dims|widths|channels|num_channels_list",
                lambda v, top: max(32, round(v * 128 / top / 32) * 32)),   # GroupNorm: 32 groups
               (r"num_heads|num_attention_heads|heads", lambda v, top: min(v, 2))]
# set where the default config leaves them None (an MoE's expert counts, derived sizes)
FILL = {"num_experts_per_tok": 2, "n_routed_experts": 4, "n_shared_experts": 1, "head_dim": 8,
        "num_key_value_heads": 4, "vocab_size": 128}
TOKENS = {"pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2, "decoder_start_token_id": 0,
          "sep_token_id": 2, "cls_token_id": 0, "mask_token_id": 3, "unk_token_id": 3}


def shrunk(d: dict) -> dict:
    """The overrides that shrink a config's ``to_dict()`` ``d`` (sub-configs too)."""
    out: dict = {}
    for key, value in d.items():
        if isinstance(value, dict) and "model_type" in value:
            sub = shrunk(value)
            if sub:
                out[key] = sub
        elif isinstance(value, bool):
            continue
        elif isinstance(value, int):
            for pattern, small in SHRINK:
                if re.fullmatch(pattern, key):
                    if re.fullmatch(KV_HEADS, key) and value == d.get("num_attention_heads"):
                        small = 4
                    if value > small:
                        out[key] = small
                    break
        elif isinstance(value, (list, tuple)) and value and all(
                isinstance(v, int) and not isinstance(v, bool) for v in value):
            for pattern, fn in LIST_SHRINK:
                if re.fullmatch(pattern, key):
                    top = max(value)
                    out[key] = type(value)(fn(v, top) for v in value)
                    break
    out.update({key: v for key, v in FILL.items() if key in d and d[key] is None})
    vocab = out.get("vocab_size", d.get("vocab_size"))
    if isinstance(vocab, int):
        for key, small in TOKENS.items():
            if isinstance(d.get(key), int) and d[key] >= vocab:
                out[key] = small
    if "use_cache" in d:
        out["use_cache"] = False
    return out


def build(family: str, model_type: str, class_name: str):
    """``(model, inputs)`` of a tiny ``class_name``, or raise ``Skip`` saying why not."""
    import transformers as T
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from tests.models import init_like_training
    cls = getattr(T, class_name, None)
    if cls is None:
        raise Skip(f"transformers has no {class_name}")
    try:
        cfg_cls = CONFIG_MAPPING[model_type]
        d = cfg_cls().to_dict()
        overrides = shrunk(d)
        if family == "vision":
            overrides["num_labels"] = LABELS
        if family == "seq2seq":   # the decoder's first input, and the labels' padding
            for key in ("decoder_start_token_id", "pad_token_id"):
                if d.get(key) is None:
                    overrides[key] = TOKENS[key]
        config = cfg_cls(**overrides)
    except Exception as e:  # noqa: BLE001
        raise Skip(f"config: {_why(e)}") from None
    try:   # sized on meta first (the worker's memory is bounded too: WORKER_MEMORY)
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            n = sum(p.numel() for p in instance(cls, config)[0].parameters())
    except Exception:  # noqa: BLE001 — some models cannot be built on meta: sized below
        n = None
    if n is not None and n > MAX_PARAMS:
        raise Skip(f"still {n / 1e6:.0f}M parameters after shrinking its config")
    torch.manual_seed(0)
    try:
        model, config = instance(cls, config)
    except Exception as e:  # noqa: BLE001
        raise Skip(f"model: {_why(e)}") from None
    n = sum(p.numel() for p in model.parameters())
    if n > MAX_PARAMS:
        raise Skip(f"still {n / 1e6:.0f}M parameters after shrinking its config")
    return init_like_training(model).eval(), inputs(family, model, config)


def instance(cls, config):
    """``(cls(config), config)``, or from its text config where ``cls`` is built from
    that (a multimodal model's causal-LM class, as ``AutoModelForCausalLM`` builds it)."""
    try:
        return cls(config), config
    except Exception:  # noqa: BLE001
        text = config.get_text_config(decoder=True)
        if text is config:
            raise
        return cls(text), text


def inputs(family: str, model, config) -> dict:
    g = torch.Generator().manual_seed(1)
    params = inspect.signature(model.forward).parameters
    if family == "vision":
        size = getattr(config, "image_size", 32)
        size = tuple(size) if isinstance(size, (list, tuple)) else (size, size)
        channels = getattr(config, "num_channels", 3)
        return {"pixel_values": torch.randn(BATCH, channels, *size, generator=g),
                "labels": torch.randint(0, LABELS, (BATCH,), generator=g)}
    text = getattr(config, "get_text_config", lambda: config)()
    vocab = min(getattr(text, "vocab_size", 128) or 128, 128)
    ids = torch.randint(4, vocab, (BATCH, SEQ), generator=g)
    kw = {"input_ids": ids}
    if "attention_mask" in params:
        mask = torch.ones(BATCH, SEQ, dtype=torch.long)
        mask[1, SEQ - 4:] = 0
        kw["attention_mask"] = mask
    kw["labels"] = ids if family != "seq2seq" else \
        torch.randint(4, vocab, (BATCH, SEQ), generator=g)
    return kw


class Skip(Exception):
    """An architecture this sweep cannot hold fxpipe to (the message says why)."""


def _why(e: BaseException) -> str:
    """The exception's type and first line (a ``CaptureError``: what each method hit)."""
    lines = [x.strip() for x in str(e).strip().splitlines() if x.strip()]
    if type(e).__name__ == "CaptureError":
        lines = [" ".join(x for x in lines if not x.startswith("What to do"))]
    return f"{type(e).__name__}: {lines[0][:600] if lines else ''}"


def own_loss(out, _label):
    return out.loss


def eager_loss(model, kw) -> torch.Tensor:
    out = model(**kw)
    if getattr(out, "loss", None) is None:
        raise Skip("returns no loss for labels=")
    out.loss.backward()
    return out.loss.detach().float()


def run_one(family: str, model_type: str, class_name: str) -> dict:
    """One architecture: its row of the results (``precisions`` of status, why, losses)."""
    import fxpipe
    from tests.hf_zoo import Eager
    row = {"family": family, "model_type": model_type, "class": class_name}
    try:
        model, kw = build(family, model_type, class_name)
        row["parameters"] = sum(p.numel() for p in model.parameters())
        ref = eager_loss(copy.deepcopy(model), kw)
        if not torch.isfinite(ref):
            raise Skip(f"eager loss is {ref.item()}")
    except Skip as e:
        return {**row, **{p: {"status": "skipped", "why": str(e)} for p in PRECISIONS}}
    except Exception as e:  # noqa: BLE001
        why = f"eager fp32 fails: {_why(e)}"
        return {**row, **{p: {"status": "skipped", "why": why} for p in PRECISIONS}}
    for precision in PRECISIONS:
        t0 = time.perf_counter()
        res: dict = {}
        if precision == "fp32":
            ref_loss = ref
        else:
            try:
                ref_loss = Eager(copy.deepcopy(model), "param_dtype").step(kw, None, own_loss)
            except Exception as e:  # noqa: BLE001
                res = {"status": "skipped", "why": f"eager bf16 fails: {_why(e)}"}
        if not res:
            pipe = None
            try:
                pipe = fxpipe.compile(
                    copy.deepcopy(model), example_kwargs=kw,
                    devices=[fxpipe.VirtualDevice(), fxpipe.VirtualDevice()],
                    config=fxpipe.RunConfig(num_microbatch=2),
                    param_dtype=torch.bfloat16 if precision == "bf16" else None)
                loss = pipe.forward_backward((), kw, loss_fn=own_loss).float()
                ratio = (loss / ref_loss).item()
                res = {"loss": loss.item(), "ref_loss": ref_loss.item(), "ratio": ratio,
                       "capture": pipe.layers.capture, "layers": len(pipe.layers)}
                close = abs(ratio - 1) <= RTOL[precision]
                res.update(status="passed" if close else "failed",
                           why="" if close else f"loss {loss.item():.5g}, reference's "
                                                f"{ref_loss.item():.5g}")
            except Exception as e:  # noqa: BLE001
                res = {"status": "failed", "why": _why(e), "error": type(e).__name__,
                       "where": _where(e)}
            finally:
                if pipe is not None:
                    pipe.close()
        res["seconds"] = round(time.perf_counter() - t0, 1)
        row[precision] = res
    return row


def _where(e: BaseException) -> str:
    """The innermost frame of ``e``'s root cause: ``file:line``, relative to the repository
    or to ``site-packages``."""
    while e.__cause__ is not None:
        e = e.__cause__
    frames = traceback.extract_tb(e.__traceback__)
    if not frames:
        return ""
    path = Path(frames[-1].filename)
    path = path.relative_to(ROOT) if path.is_relative_to(ROOT) else \
        Path(str(path).split("site-packages/")[-1])
    return f"{path}:{frames[-1].lineno}"


def worker(names: list[str]) -> None:
    """Run ``family/model_type`` names in order, a result line each on stdout."""
    from transformers.models.auto import modeling_auto
    _, hard = resource.getrlimit(resource.RLIMIT_DATA)
    resource.setrlimit(resource.RLIMIT_DATA, (WORKER_MEMORY if hard == resource.RLIM_INFINITY
                                              else min(WORKER_MEMORY, hard), hard))
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    for name in names:
        family, model_type = name.split("/", 1)
        class_name = getattr(modeling_auto, FAMILIES[family])[model_type]
        class_name = class_name[0] if isinstance(class_name, (list, tuple)) else class_name
        print(MARK + json.dumps({"start": name}), flush=True)
        row = run_one(family, model_type, class_name)
        print(MARK + json.dumps({"row": row}), flush=True)


def sweep(names: list[str], timeout_s: float, log) -> list[dict]:
    """Every name in a worker process; a worker past ``timeout_s`` on one is killed, the
    name recorded as failed, and a new worker takes the rest."""
    rows: list[dict] = []
    todo = list(names)
    while todo:
        proc = subprocess.Popen([sys.executable, __file__, "--worker", *todo], cwd=ROOT,
                                stdout=subprocess.PIPE, stderr=log, text=True,
                                start_new_session=True)
        current, started = None, time.monotonic()
        while True:
            ready, _, _ = select.select([proc.stdout], [], [], 5.0)
            if ready:
                line = proc.stdout.readline()
                if not line:   # the worker ended (or crashed)
                    break
                if not line.startswith(MARK):
                    continue
                msg = json.loads(line[len(MARK):])
                if "start" in msg:
                    current, started = msg["start"], time.monotonic()
                else:
                    rows.append(msg["row"])
                    _print_row(msg["row"])
                    todo.remove(current)
                    current = None
            elif current is not None and time.monotonic() - started > timeout_s:
                os.killpg(proc.pid, signal.SIGKILL)
                break
        proc.wait()
        if current is None and proc.returncode:   # died before its first architecture
            current = todo[0]
        if current is not None:   # timed out, or the worker died on it
            family, model_type = current.split("/", 1)
            why = (f"more than {timeout_s:.0f} s" if proc.returncode == -signal.SIGKILL
                   else f"the worker died (exit {proc.returncode})")
            row = {"family": family, "model_type": model_type,
                   **{p: {"status": "failed", "why": why} for p in PRECISIONS}}
            rows.append(row)
            _print_row(row)
            todo.remove(current)
    return rows


def _cell(r: dict) -> str:
    return "ok" if r["status"] == "passed" else f"{r['status']}: {r['why'][:70]}"


def _print_row(row: dict) -> None:
    ratio = row["bf16"].get("ratio")
    print(f"{row['family'] + '/' + row['model_type']:<34} | {_cell(row['fp32'])[:80]:<80} | "
          f"{_cell(row['bf16'])[:80]:<80} | {'' if ratio is None else f'{ratio:.4f}'}", flush=True)


def counts(rows: list[dict]) -> dict:
    """Per precision (and per family): how many passed, failed, were skipped."""
    out: dict = {}
    states = ("passed", "failed", "skipped")
    for p in PRECISIONS:
        out[p] = {s: sum(r[p]["status"] == s for r in rows) for s in states}
        out[p]["by_family"] = {f: {s: sum(r[p]["status"] == s for r in rows if r["family"] == f)
                                   for s in states}
                               for f in FAMILIES if any(r["family"] == f for r in rows)}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", action="append", choices=sorted(FAMILIES),
                    help="a family to run (repeatable; default: all)")
    ap.add_argument("--limit", type=int, default=None, help="at most this many per family")
    ap.add_argument("--only", default="", help="comma-separated family/model_type names")
    ap.add_argument("--timeout-s", type=float, default=300.0, help="per architecture")
    ap.add_argument("--update", action="store_true",
                    help="keep the other architectures of the existing results file")
    ap.add_argument("--log", default=os.devnull, help="the workers' stderr")
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--worker", nargs="*", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker is not None:
        worker(args.worker)
        return 0
    import transformers
    from transformers.models.auto import modeling_auto
    names = []
    for family in args.family or FAMILIES:
        types = sorted(getattr(modeling_auto, FAMILIES[family]))
        names += [f"{family}/{t}" for t in types[:args.limit]]
    if args.only:
        names = [n for n in args.only.split(",") if n]
    print(f"{len(names)} architectures, {args.timeout_s:.0f} s each at most\n")
    print(f"{'architecture':<34} | {'fp32':<80} | {'bf16':<80} | bf16 loss / reference's")
    with open(args.log, "a") as log:
        rows = sweep(names, args.timeout_s, log)
    out = Path(args.out)
    if args.update and out.exists():
        ran = {(r["family"], r["model_type"]) for r in rows}
        old = json.loads(out.read_text())
        rows = [r for r in old.get("architectures", [])
                if (r["family"], r["model_type"]) not in ran] + rows
    rows.sort(key=lambda r: (list(FAMILIES).index(r["family"]), r["model_type"]))
    res = {"transformers": transformers.__version__, "torch": torch.__version__.split("+")[0],
           "devices": 2, "num_microbatch": 2, "rtol": RTOL, "max_params": MAX_PARAMS,
           "counts": counts(rows), "architectures": rows}
    if out.exists():   # record.py's stamps
        res["runs"] = json.loads(out.read_text()).get("runs", [])
    print()
    for p in PRECISIONS:
        c = res["counts"][p]
        families = ", ".join(f"{f} {v['passed']}/{v['failed']}/{v['skipped']}"
                             for f, v in c["by_family"].items())
        print(f"{p}: {c['passed']} passed, {c['failed']} failed, {c['skipped']} skipped; {families}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1) + "\n")
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
