"""What a new user tripped on (issue #52, item 2), each pinned by a test that failed
before its fix: the plan a pipe shows, a generation's counters, a bad ``labels=`` said
before anything runs, fp16 without loss scaling refused with the route that works,
``predict_memory`` for inference on a training pipe, and no export warnings at batch 1.
(The Trainer's logged ``grad_norm``: ``tests/test_trainer.py``.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxpipe
from fxpipe.optim import overlapped
from tests import models

T = pytest.importorskip("transformers")


def llama(vocab: int = 64, layers: int = 2) -> nn.Module:
    torch.manual_seed(0)
    return T.LlamaForCausalLM(T.LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        use_cache=False)).eval()


def own_loss(out, _):
    return out.loss


def test_the_plan_shown_is_the_plan_that_runs():
    """``pipe.plan`` is what ``forward_backward`` runs (the chain without the logits no
    loss reads), before and after the first call; where the chain with the logits (what
    ``pipe(x)`` runs) plans otherwise, ``print(pipe)`` shows both. (Which plans the two
    chains get depends on measured layer times; the second chain's plan is set here.)"""
    model = llama()
    ids = torch.randint(0, 64, (4, 16))
    kw = dict(input_ids=ids, labels=ids)
    with fxpipe.compile(model, example_kwargs=kw, devices=["cpu", "cpu"]) as pipe:
        before, base = pipe.plan, pipe._current.base
        assert base is not pipe._current.fused(model)   # the logits are left out
        assert "# forward_backward runs plan" not in str(pipe) or before != base.plan
        n = len(base.layers)
        base._plan = fxpipe.ExecutePlan([range(0, 1), range(1, n - 1)], [range(n - 1, n),
                                         range(1, n - 1), range(0, 1)])
        assert base.plan != before
        fwd = ", ".join(f"{r.start}:{r.stop}" for r in before.fwd_plan)
        assert f"# forward_backward runs plan fwd [{fwd}]" in str(pipe)
        assert "plan fwd [0:1, 1:" in str(pipe).splitlines()[0]
        pipe.forward_backward((), kw, loss_fn=own_loss)
        assert pipe._current.plan == before == pipe.plan   # the call ran it


def test_stats_after_generate_hold_the_generation():
    model = llama()
    ids = torch.randint(3, 64, (2, 5))
    with fxpipe.compile(model, example_inputs=(ids,), devices=["cpu", "cpu"]) as pipe:
        pipe.generate(ids, torch.ones_like(ids), max_new_tokens=3, pad_token_id=0)
        stats = pipe.stats()
        step = pipe._generation[0].pipe.stats()   # the last decode step's alone
    assert stats["h2d_bytes_params"] > step["h2d_bytes_params"] > 0
    assert stats["actions"] > step["actions"]
    assert "d2h_bytes_cache" in stats


def test_bad_labels_are_refused_before_anything_runs():
    model = llama()
    ids = torch.randint(0, 64, (4, 16))
    with fxpipe.compile(model, example_kwargs=dict(input_ids=ids, labels=ids),
                        devices=["cpu", "cpu"]) as pipe:
        captured = len(pipe._cache)
        with pytest.raises(ValueError, match=r"labels has shape \(4, 15\) and input_ids \(4, 16\)"):
            pipe.forward_backward((), dict(input_ids=ids, labels=ids[:, :15]), loss_fn=own_loss)
        with pytest.raises(ValueError, match=r"labels has shape \(4, 15\)"):
            pipe(input_ids=ids, labels=ids[:, :15])
        with pytest.raises(ValueError, match=r"labels has 3 rows .* the inputs 4 \(input_ids"):
            pipe.forward_backward((), dict(input_ids=ids, labels=ids[:3]), loss_fn=own_loss)
        assert len(pipe._cache) == captured   # no new capture was tried
    assert all(p.grad is None for p in model.parameters())


def test_fp16_without_loss_scaling_is_refused_with_the_route():
    torch.manual_seed(0)
    model = models.mlp(width=16, depth=4)
    x, y = torch.randn(6, 16), torch.randn(6, 4)
    mse = lambda out, y: F.mse_loss(out.float(), y)  # noqa: E731
    with fxpipe.compile(model, example_inputs=(x,), devices=["cpu", "cpu"],
                        param_dtype=torch.float16) as pipe:
        with pytest.raises(ValueError, match="GradScaler"):
            pipe.forward_backward((x,), label=y, loss_fn=mse)
        with pytest.raises(ValueError, match="GradScaler"):
            pipe.forward_backward((x,), label=y, loss_fn=mse,
                                  optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
        scaler = torch.amp.GradScaler("cpu")
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        loss = pipe.forward_backward((x,), label=y, loss_fn=mse,
                                     optimizer=overlapped(opt, scaler=scaler))
        assert torch.isfinite(loss)


def test_predict_memory_for_inference_on_a_training_pipe():
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])
    x = torch.randn(8, 64)
    with fxpipe.compile(model, example_inputs=(x,), devices=["cpu", "cpu"]) as pipe:
        infer = fxpipe.plan.predict_memory(pipe, run_type="infer")
        fused = fxpipe.plan.predict_memory(pipe)
    assert {s.kind for s in infer.stages} == {"fwd"}
    assert len(infer.stages) == len(pipe.stages)   # what pipe(x) runs under no_grad
    assert infer.peak < fused.peak                 # no gradients, nothing saved


def test_no_export_warnings_for_a_batch_of_one(capfd):
    model = llama()
    ids = torch.randint(0, 64, (1, 16))
    with fxpipe.compile(model, example_kwargs=dict(input_ids=ids, labels=ids),
                        devices=["cpu", "cpu"]) as pipe:
        assert pipe.layers.capture == "export"
    assert "specialized" not in capfd.readouterr().err
