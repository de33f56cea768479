"""The fine-tuning measurement (``fxpipe.check.finetune``: the kit's ``finetune`` section
and ``benchmarks/bench_finetune.py``) at tiny widths: models made once in host memory,
eager copies made on the device from them, the FLOP formulas, and the simulator's
prediction, whose host optimizer prices only what trains. The runs end to end are in
``tests/test_check.py`` (the kit's dry run)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

from fxpipe.check import finetune as ft  # noqa: E402
from fxpipe.check import finetune_predict as fp  # noqa: E402
from fxpipe.check.common import link_bandwidth, timed  # noqa: E402


@pytest.fixture(scope="module")
def specs():
    return {s["mode"]: s for s in ft.run_specs(dry_run=True)}


def test_a_host_model_is_made_once_in_host_memory(specs):
    from transformers import AutoModelForCausalLM
    spec = specs["full"]          # Qwen3: tied embeddings, q/k norms
    model = ft.host_model(spec["config"], torch.float32, torch.device("cpu"))
    params = dict(model.named_parameters(remove_duplicate=False))
    assert all(p.device.type == "cpu" and p.dtype == torch.float32 for p in params.values())
    assert params["lm_head.weight"] is params["model.embed_tokens.weight"]   # tied: one tensor
    norms = [p for n, p in params.items() if "norm" in n]
    assert norms and all(bool((p == 1).all()) for p in norms)
    big = [p for p in params.values() if p.dim() == 2]
    assert all(0.01 < float(p.detach().std()) < 0.03 for p in big)       # N(0, initializer_range)
    # buffers are computed as usual: the rotary tables equal a normally built model's
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(spec["config"])
    torch.testing.assert_close(dict(model.named_buffers()), dict(ref.named_buffers()))


def test_lora_trains_only_the_adapters_in_fp32_over_a_bf16_base(specs):
    model = ft.with_lora(ft.host_model(specs["lora"]["config"], torch.bfloat16, torch.device("cpu")))
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n and p.dtype == torch.float32 for n, p in trainable.items())
    assert {n.split(".")[-4] for n in trainable} >= {"q_proj", "k_proj", "v_proj", "o_proj",
                                                     "gate_proj", "up_proj", "down_proj"}
    frozen = [p for p in model.parameters() if not p.requires_grad]
    assert all(p.dtype == torch.bfloat16 for p in frozen)


def test_a_device_copy_shares_nothing_with_the_host_model(specs):
    model = ft.with_lora(ft.host_model(specs["lora"]["config"], torch.bfloat16, torch.device("cpu")))
    copy = ft.device_copy(model, "cpu")
    host, dev = dict(model.named_parameters()), dict(copy.named_parameters())
    assert host.keys() == dev.keys()
    for name, p in host.items():
        assert dev[name] is not p and dev[name].data_ptr() != p.data_ptr()
        assert torch.equal(dev[name], p) and dev[name].requires_grad == p.requires_grad
    with torch.no_grad():
        next(iter(dev.values())).add_(1)
    assert not torch.equal(next(iter(dev.values())), next(iter(host.values())))


def test_step_flops_follow_the_documented_formulas(specs):
    spec = specs["full"]
    cfg = spec["config"]
    model = ft.host_model(cfg, torch.float32, torch.device("cpu"))
    T, S = 4 * 64, 64
    f = ft.step_flops(model, cfg, T, S)
    N = sum(p.numel() for p in model.parameters())
    assert f["model"] == 6 * N * T
    lin = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    head = model.lm_head.weight.numel()
    d_attn = cfg.num_attention_heads * cfg.head_dim
    # forward, the blocks' recompute, input and weight gradients; causal attention
    assert f["hardware"] == T * (2 * lin + 2 * (lin - head) + 2 * lin + 2 * lin) + \
        cfg.num_hidden_layers * 8 * S * T * d_attn
    # LoRA: no weight gradients for the frozen base, only for the adapters
    lcfg = specs["lora"]["config"]
    lora = ft.with_lora(ft.host_model(lcfg, torch.bfloat16, torch.device("cpu")))
    linears = [m for m in lora.modules() if isinstance(m, torch.nn.Linear)]
    lin = sum(m.weight.numel() for m in linears)
    trains = sum(m.weight.numel() for m in linears if m.weight.requires_grad)
    head = lora.get_output_embeddings().weight.numel()
    assert 0 < trains < lin / 2
    assert ft.step_flops(lora, lcfg, T, S)["hardware"] == \
        T * (2 * lin + 2 * (lin - head) + 2 * lin + 2 * trains) + \
        lcfg.num_hidden_layers * 8 * S * T * lcfg.hidden_size


def test_the_predicted_host_optimizer_prices_what_trains_only(specs):
    """LoRA's streamed AdamW steps the adapters: a slow host optimizer costs their bytes,
    not the frozen base's (the simulator priced every parameter before)."""
    spec = specs["lora"]
    slow = 1e6     # bytes/s
    rows = {r["host_work"]: r for r in fp.predict(
        spec, memory=2**30, link=1e9, flops=1e9,
        hosts={"slow": (slow, float("inf")), "free": (float("inf"), float("inf"))})}
    model = fp.meta_model(spec)
    trainable = sum(p.numel() * 4 for p in model.parameters() if p.requires_grad)
    every = sum(p.numel() * p.element_size() for p in model.parameters())
    extra = rows["slow"]["predicted_step_s"] - rows["free"]["predicted_step_s"]
    # (part of it hides behind the backward: 0.5 of it in the plan for 1 GiB devices)
    assert trainable / slow * 0.4 < extra <= trainable / slow * 1.01 < every / slow
    assert rows["free"]["flops_per_s"] == 1e9 and rows["free"]["tokens_per_step"] == \
        spec["microbatches"] * spec["seq"]


def test_the_eager_step_calibrates_the_predicted_flop_rate(specs):
    spec = specs["lora"]
    free = {"free": (float("inf"), float("inf"))}
    (row,) = fp.predict(spec, memory=2**30, link=float("inf"), hosts=free, eager_step_s=2.0)
    assert row["flops_per_s"] > 0
    # eager's checkpointed step in the cost pass's FLOPs at that rate takes the 2 s it took
    (again,) = fp.predict(spec, memory=2**30, link=float("inf"), hosts=free,
                          flops=row["flops_per_s"])
    assert again["predicted_step_s"] == pytest.approx(row["predicted_step_s"])
    assert 0.5 < row["predicted_step_s"] / 2.0 < 1.5


def test_the_prediction_prices_each_backends_host_issue(specs):
    """#54 item 6: with the H200's fitted host issuing, the predicted step per stage backend:
    inductor and cudagraphs launch fewer kernels than eager, so the host issues less; on a
    fast GPU (the tiny model at 1 PFLOP/s) the host binds and the step is the host's."""
    from fxpipe.sim.hardware import H200_HOST
    spec = specs["lora"]
    free = {"free": (float("inf"), float("inf"))}
    rows = {r["stage_backend"]: r for r in fp.predict(
        spec, memory=2**30, link=float("inf"), hosts=free, flops=1e15, host_issue=H200_HOST,
        backends=("eager", "inductor", "cudagraphs"))}
    (bare,) = fp.predict(spec, memory=2**30, link=float("inf"), hosts=free, flops=1e15)
    assert bare["host_issue_s"] == 0.0 and bare["stage_backend"] == "eager"
    issue = [rows[b]["host_issue_s"] for b in ("eager", "inductor", "cudagraphs")]
    assert issue[0] > issue[1] > issue[2] > 0, issue
    step = [rows[b]["predicted_step_s"] for b in ("eager", "inductor", "cudagraphs")]
    assert step[0] > step[1] >= step[2] > bare["predicted_step_s"], step
    assert rows["eager"]["predicted_step_s"] >= rows["eager"]["host_issue_s"]


def test_a_lora_run_under_inductor(specs, monkeypatch):
    """The kit's LoRA run with its stage code compiled by inductor between two runs of
    eager stage code (a lent GPU runs cudagraphs, inductor, eager), at tiny widths on
    virtual devices: the model is built once and each backend starts from the same
    weights (the runs before it are undone: the two eager runs' losses are the same
    bits); each row says its backend and what it compiled; inductor's losses are the
    eager stage code's within bf16's rounding."""
    sync = lambda: None   # noqa: E731
    ctx = ft.context(True, 2, lambda fn, warmup, repeats: timed(fn, warmup, repeats, sync), sync,
                     link_bandwidth(True))
    built = []
    host_model = ft.host_model
    monkeypatch.setattr(ft, "host_model", lambda *args: built.append(args) or host_model(*args))
    first, compiled, again = ft.run_all(ctx, modes=("lora",), eager=False, steps=1,
                                        backends=(None, "inductor", None), say=lambda line: None)
    assert len(built) == 1
    for b, row in zip((None, "inductor", None), (first, compiled, again)):
        assert row["stage_backend"] == b and "error" not in row, row.get("error")
    assert first["stage_compiles"] == 0 and first["stage_compile_s"] == 0
    assert compiled["stage_compile_s"] >= 0 and compiled["warmup_s"] > 0
    assert len(first["losses"]) >= 2 and first["losses"] == again["losses"]
    eager, compiled = first["losses"], compiled["losses"]
    assert all(abs(a - b) <= 2e-2 * abs(a) for a, b in zip(eager, compiled)), (eager, compiled)
