"""Equal to eager on real batches: padding and ``-100`` labels, any microbatch count.

A loss averaged over target tokens is weighted per microbatch by its targets
(``fxpipe.passes.token_means``, ``fxpipe.runtime.issue.loss_weights``): a Hugging Face causal LM
(Llama), seq2seq LM (T5) and masked LM (BERT) trained with their own ``labels=`` loss on a
batch with masked prompts and a row with no target at all give eager's loss and every
parameter's gradient for 1 to 4 microbatches, through ``forward_backward`` and through
``pipe(...)`` + ``.backward()``. A ``loss_fn`` returning ``(sum, count)`` is weighted by
its count.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

import fxpipe
from fxpipe.passes.capture import capture
from fxpipe.passes.token_means import find_token_means
from fxpipe.runtime.issue.loss_weights import count_of
from tests import models

pytest.importorskip("transformers")
from tests import hf_zoo  # noqa: E402

TOL = 1e-6   # fp32: loss and each gradient, relative to its largest magnitude


def grad_error(model: nn.Module, ref: nn.Module) -> float:
    """The largest difference of a parameter's gradient from the reference's, relative to
    the largest gradient of the model (a gradient that is 0 in exact arithmetic, as an
    attention key's bias's, is rounding noise of any size relative to itself)."""
    worst, scale = 0.0, 0.0
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        if q.grad is None:
            assert p.grad is None or not p.grad.any(), name
            continue
        scale = max(scale, q.grad.abs().max().item())
        worst = max(worst, (p.grad - q.grad).abs().max().item())
    return worst / scale


@pytest.mark.parametrize("name", ["llama", "t5", "bert"])
def test_padded_batch_equals_eager_for_any_microbatch_count(name):
    model, _, _, _ = hf_zoo.setup(name)
    batch = hf_zoo.sft_batch(name)
    ref = copy.deepcopy(model)
    expected = ref(**batch).loss
    expected.backward()
    devices = [fxpipe.VirtualDevice() for _ in range(2)]
    with fxpipe.compile(model, example_kwargs=batch, devices=devices) as pipe:
        assert pipe.layers.token_means, "the model's loss is a mean over target tokens"
        for m in (1, 2, 3, 4):
            cfg = fxpipe.RunConfig(num_microbatch=m)
            model.zero_grad()
            loss = pipe.forward_backward((), batch, loss_fn=hf_zoo.own_loss, run_config=cfg)
            assert abs(loss.item() - expected.item()) <= TOL * expected.abs().item(), (m, loss)
            assert grad_error(model, ref) <= TOL, m
            model.zero_grad()
            out = pipe(**batch, run_config=cfg)
            assert abs(out.loss.item() - expected.item()) <= TOL * expected.abs().item(), m
            out.loss.backward()
            assert grad_error(model, ref) <= TOL, m


def test_padded_batch_in_bf16_equals_the_written_reference():
    """``param_dtype=torch.bfloat16`` on the padded batch against ``hf_zoo.Eager``'s bf16
    reference, for 3 microbatches (2 of 1 row, one with no target)."""
    model, _, _, _ = hf_zoo.setup("llama")
    batch = hf_zoo.sft_batch("llama")
    ref = copy.deepcopy(model)
    expected = hf_zoo.Eager(ref, "param_dtype").step(batch, None, hf_zoo.own_loss)
    with fxpipe.compile(model, example_kwargs=batch, devices=[fxpipe.VirtualDevice() for _ in range(2)],
                        param_dtype=torch.bfloat16) as pipe:
        loss = pipe.forward_backward((), batch, loss_fn=hf_zoo.own_loss,
                                     run_config=fxpipe.RunConfig(num_microbatch=3))
    assert abs(loss.item() - expected.item()) <= 3e-2 * expected.item()
    for p, q in zip(model.parameters(), ref.parameters()):
        g, r = p.grad.flatten(), q.grad.flatten()
        assert (g @ r / (g.norm() * r.norm()).clamp_min(1e-30)).item() > 0.99


class LM(nn.Module):
    """A small LM whose loss is ``F.cross_entropy`` over shifted labels (fx captures it)."""

    def __init__(self, vocab: int = 32, width: int = 16):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(models.MLPBlock(width) for _ in range(3))
        self.head = nn.Linear(width, vocab)

    def forward(self, ids, labels):
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h)
        logits = self.head(h)
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())


def lm_batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 32, (5, 9), generator=g)
    labels = ids.clone()
    labels[0, :6] = -100
    labels[2] = -100
    labels[4, 3:] = -100
    return ids, labels


@pytest.mark.parametrize("grain", ["stage", "layer"])
def test_own_model_cross_entropy_on_shifted_labels(grain):
    torch.manual_seed(0)
    model = LM()
    ids, labels = lm_batch()
    ref = copy.deepcopy(model)
    expected = ref(ids, labels)
    expected.backward()
    with fxpipe.compile(model, example_inputs=(ids, labels), devices=["cpu", "cpu"]) as pipe:
        assert pipe.layers.capture == "fx"
        for m in (2, 3, 5):
            cfg = fxpipe.RunConfig(num_microbatch=m, recompute_grain=grain)
            model.zero_grad()
            loss = pipe.forward_backward((ids, labels), run_config=cfg)
            torch.testing.assert_close(loss, expected.detach(), rtol=TOL, atol=0)
            assert grad_error(model, ref) <= TOL


def test_loss_fn_returning_sum_and_count():
    """A ``loss_fn`` of the user's own returns ``(sum, count)``: each microbatch's sum is
    divided by the batch's count, as one eager pass over the batch."""
    torch.manual_seed(0)
    model = models.GPT(vocab=32, dim=16, depth=3, seq=9)
    ids, labels = lm_batch()

    def loss_fn(logits, y):
        y = y[:, 1:]
        total = F.cross_entropy(logits[:, :-1].flatten(0, 1), y.flatten(), reduction="sum")
        return total, (y != -100).sum()

    ref = copy.deepcopy(model)
    total, count = loss_fn(ref(ids), labels)
    expected = total / count
    expected.backward()
    with fxpipe.compile(model, example_inputs=(ids,), devices=["cpu", "cpu"]) as pipe:
        loss = pipe.forward_backward((ids,), label=labels, loss_fn=loss_fn,
                                     run_config=fxpipe.RunConfig(num_microbatch=3))
    torch.testing.assert_close(loss, expected.detach(), rtol=TOL, atol=0)
    assert grad_error(model, ref) <= TOL


def test_a_count_from_the_outputs_is_refused():
    torch.manual_seed(0)
    model = models.GPT(vocab=32, dim=16, depth=3, seq=9)
    ids, labels = lm_batch()
    with fxpipe.compile(model, example_inputs=(ids,), devices=["cpu", "cpu"]) as pipe:
        with pytest.raises(fxpipe.StageError, match="from the label alone"):
            pipe.forward_backward((ids,), label=labels,
                                  loss_fn=lambda out, y: (out.sum(), (out > 0).sum()))
        with pytest.raises(fxpipe.StageError, match="0-dim integer tensor"):
            pipe.forward_backward((ids,), label=labels,
                                  loss_fn=lambda out, y: (out.sum(), torch.tensor(2.0)))
        with pytest.raises(fxpipe.StageError, match="do not read the outputs' values"):
            pipe.forward_backward((ids,), label=labels,
                                  loss_fn=lambda out, y: (out.sum(), int(out.argmax())))
    assert all(p.grad is None for p in model.parameters())


def test_count_of_runs_loss_fn_on_stand_ins():
    """``count_of`` runs ``loss_fn`` on stand-ins of the outputs (meta tensors) and the
    real label: the count comes out real, whatever the outputs' ops."""
    model, _, _, _ = hf_zoo.setup("llama")
    batch = hf_zoo.sft_batch("llama")
    y = batch["labels"]
    with fxpipe.compile(model, example_kwargs=batch, devices=["cpu", "cpu"]) as pipe:
        got = count_of(pipe.layers, lambda out, y: (F.cross_entropy(
            out.logits[:, :-1].flatten(0, 1), y[:, 1:].flatten(), reduction="sum"),
            (y[:, 1:] != -100).sum()), y)
    assert got == int((y[:, 1:] != -100).sum())


def test_the_count_graph_and_the_rewritten_loss():
    """The pass records the count of targets as a graph over the inputs, and the loss
    divides its sum by it (at least 1) in the code the stage runs."""
    torch.manual_seed(0)
    ids, labels = lm_batch()
    model = LM()
    gm = capture(model, (ids, labels))
    assert find_token_means(gm) == 1
    (leaf, count), = gm.meta["token_means"].items()
    assert leaf == 0 and count.inputs == ("labels",)
    assert int(count(labels)) == int((labels[:, 1:] != -100).sum())
    code = gm.code
    assert "reduction = 'sum'" in code and "clamp_min" in code and "/ divisor" in code
    torch.testing.assert_close(gm(ids, labels)[0], model(ids, labels), rtol=0, atol=0)


def test_a_target_made_from_parameters_keeps_rows():
    """A target computed from the model's own outputs (a pseudo-label) has no count the
    host can make before the call: no rewrite, the rows weigh."""

    class SelfLabelled(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return F.cross_entropy(x, x.argmax(-1))

    gm = capture(SelfLabelled(), (torch.randn(4, 8),))
    assert find_token_means(gm) == 0
    assert "reduction = 'sum'" not in gm.code
