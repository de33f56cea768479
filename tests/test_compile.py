"""fxpipe.compile: outputs, every parameter's .grad and buffers equal eager PyTorch."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils._pytree as pytree

import fxpipe
from tests import models

pytestmark = pytest.mark.bitwise  # exact=True claims; the reference runs on one thread (conftest)

def _loss(out) -> torch.Tensor:
    """A scalar depending on every floating output leaf, with distinct weights."""
    leaves = [x for x in pytree.tree_leaves(out) if isinstance(x, torch.Tensor) and x.is_floating_point()]
    return sum((i + 1) * x.float().square().mean() for i, x in enumerate(leaves))


def check_equivalence(model, args=(), kwargs=None, *, exact=True, reference="eager", capture="auto",
                      layers=None, plan=None, devices=None, num_microbatch=1):
    """Compile ``model`` and compare a forward + backward with a reference run.

    ``reference="eager"``: a deep copy of the model, run eagerly. ``"captured"``: the
    captured program (``pipe.layers.gm``, the layer chain fxpipe cut the graph into) run
    eagerly in one piece on the model's own parameters; eager is then compared within
    fp32 tolerance. Use it where the model's code takes other branches when traced than
    when run (Hugging Face attention builds an explicit mask and repeats K/V heads under
    tracing instead of calling SDPA with ``is_causal``/``enable_gqa``): the captured
    program runs other kernels than eager, so only it can be matched bit for bit.

    ``exact``: bitwise equality with the reference. That holds when both run the same
    kernels in the same order: one microbatch, the reference on one intra-op thread as
    fxpipe's workers run (``conftest``: ``bitwise`` tests), and no value whose gradient has parts from three or more
    stages (they are summed in another order). Else ``exact=False`` (fp32 tolerance).
    """
    kwargs = kwargs or {}
    ref = copy.deepcopy(model)
    buffers_before = {k: v.clone() for k, v in model.named_buffers()}
    pipe = fxpipe.compile(model, example_inputs=args, example_kwargs=kwargs, capture=capture,
                          layers=layers, plan=plan, devices=devices,
                          config=fxpipe.RunConfig(num_microbatch=num_microbatch))
    for k, v in model.named_buffers():  # compiling runs nothing for real
        assert torch.equal(v, buffers_before[k]), f"compile changed buffer {k}"

    out = pipe(*args, **kwargs)
    _loss(out).backward()
    got = _state(model)
    ref_out = _forward_backward(ref, args, kwargs)
    close = lambda a, b: torch.allclose(a, b, atol=1e-6, rtol=1e-5)  # noqa: E731
    if reference == "captured":
        _compare(out, got, ref_out, _state(ref), close)  # eager: within tolerance
        model.zero_grad(set_to_none=True)
        model.load_state_dict(buffers_before, strict=False)
        leaves = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]

        def run_captured():  # the same parameters, the captured program in one piece
            ref_out = pytree.tree_unflatten(list(pipe.layers.gm(*leaves)), pipe.layers.out_spec)
            _loss(ref_out).backward()
            return ref_out
        ref_out = run_captured()
        ref = model
    else:
        assert reference == "eager", reference
    _compare(out, got, ref_out, _state(ref), torch.equal if exact else close)
    return pipe


def _forward_backward(model, args, kwargs):
    out = model(*args, **kwargs)
    _loss(out).backward()
    return out


def _state(model):
    """(grad by parameter name, buffer copies by name) of ``model`` now."""
    return ({n: p.grad for n, p in model.named_parameters()},
            {n: b.clone() for n, b in model.named_buffers()})


def _compare(out, state, ref_out, ref_state, compare):
    got, want = pytree.tree_flatten(out), pytree.tree_flatten(ref_out)
    assert got[1] == want[1], f"output structure differs: {got[1]} vs {want[1]}"
    for i, (a, b) in enumerate(zip(got[0], want[0])):
        if isinstance(a, torch.Tensor):
            assert compare(a, b), f"output leaf {i} differs (max {(a - b).abs().max()})"
        else:
            assert a == b
    (grads, buffers), (ref_grads, ref_buffers) = state, ref_state
    for name, g in grads.items():
        r = ref_grads[name]
        assert (g is None) == (r is None), f"grad presence differs for {name}"
        if g is not None:
            assert compare(g, r), f"grad of {name} differs (max {(g - r).abs().max()})"
    for name, b in buffers.items():
        assert compare(b, ref_buffers[name]), f"buffer {name} differs after the call"


def test_sequential_mlp():
    torch.manual_seed(0)
    pipe = check_equivalence(models.mlp(), (torch.randn(8, 16),))
    assert pipe.layers.capture == "fx"
    assert [layer.name for layer in pipe.layers] == [str(i) for i in range(9)]


def test_gpt_decoder_tied_rotary_dropout_eval():
    torch.manual_seed(0)
    model = models.GPT(dropout=0.1).eval()
    ids = torch.randint(0, 64, (2, 16))
    pipe = check_equivalence(model, (ids,))
    names = [layer.name for layer in pipe.layers]
    assert names == ["prefix", "blocks.0", "blocks.1", "blocks.2", "suffix"]
    # the tied embedding / head weight is one tensor, used by the first and the last layer
    assert pipe.layers.shared_params == {"embed.weight": [0, 4]}
    assert pipe.layers.params["embed.weight"] is model.embed.weight


def test_convnet_residual_batchnorm_train():
    torch.manual_seed(0)
    model = models.ConvNet().train()
    pipe = check_equivalence(model, (torch.randn(4, 3, 8, 8),))
    assert pipe.layers.capture == "export"  # fx cannot trace BatchNorm's input checks
    assert [layer.name for layer in pipe.layers] == ["prefix", "blocks.0", "blocks.1",
                                                     "blocks.2", "suffix"]


def test_kwargs_model_returning_dict():
    torch.manual_seed(0)
    x = torch.randn(4, 16)
    mask = (torch.rand(4, 16) > 0.3).float()
    # the skip value feeds every block: its gradient is summed in another order than eager
    pipe = check_equivalence(models.KwargsModel(), (x,), {"mask": mask, "scale": 2.0}, exact=False)
    # root-level ops after the last block call belong to the suffix; the skip value
    # (`linear`, made in the prefix) and the mask are carried to every layer reading them
    layers = {layer.name: layer for layer in pipe.layers}
    assert list(layers) == ["prefix", "layers.0", "layers.1", "layers.2", "suffix"]
    for name in ("layers.0", "layers.1", "suffix"):
        assert {"mask", "linear"} <= set(layers[name].inputs), name
    assert pipe.layers.boundary(1) == ["mask", "linear", "add"]


@pytest.mark.parametrize("capture", ["fx", "export", "dynamo"])
def test_every_capture_method(capture):
    torch.manual_seed(0)
    pipe = check_equivalence(models.GPT(depth=2).eval(), (torch.randint(0, 64, (2, 8)),),
                             capture=capture)
    assert pipe.layers.capture == capture


def test_hf_llama():
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = models.init_like_training(models.tiny_llama(layers=3)).eval()
    ids = torch.randint(0, 64, (2, 8))
    # traced, HF attention takes another branch (explicit mask, repeated K/V heads)
    pipe = check_equivalence(model, (), {"input_ids": ids}, reference="captured")
    assert [layer.name for layer in pipe.layers] == ["prefix", "model.layers.0", "model.layers.1",
                                                     "model.layers.2", "suffix"]
    out = pipe(input_ids=ids)
    assert type(out).__name__ == "CausalLMOutputWithPast"


def test_hf_gpt2():
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = models.tiny_gpt2(layers=2).eval()
    ids = torch.randint(0, 64, (2, 8))
    # traced, HF attention passes an explicit causal mask where eager says is_causal=True
    pipe = check_equivalence(model, (ids,), reference="captured")
    assert [layer.name for layer in pipe.layers] == ["prefix", "transformer.h.0",
                                                     "transformer.h.1", "suffix"]


def test_parameters_are_the_models_own():
    model = models.GPT(depth=2).eval()
    pipe = fxpipe.compile(model, example_inputs=(torch.randint(0, 64, (2, 8)),))
    own = {id(p) for p in model.parameters()}
    for layer in pipe.layers:
        for name in layer.params:
            assert id(pipe.layers.params[name]) in own
    for stage in pipe.stages:
        for name in stage.params:
            assert id(stage.gm.get_parameter(name)) in own
    assert list(pipe.parameters()) == list(model.parameters())
    assert pipe.state_dict().keys() == model.state_dict().keys()


def test_forward_backward_matches_eager():
    torch.manual_seed(0)
    model = models.GPT(depth=2).eval()
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 64, (4, 8))
    target = torch.randint(0, 64, (4, 8))

    def loss_fn(out, label):
        return torch.nn.functional.cross_entropy(out.flatten(0, 1), label.flatten())

    pipe = fxpipe.compile(model, example_inputs=(ids,), config=fxpipe.RunConfig(num_microbatch=1))
    loss = pipe.forward_backward((ids,), label=target, loss_fn=loss_fn)
    ref_loss = loss_fn(ref(ids), target)
    ref_loss.backward()
    assert not loss.requires_grad
    assert torch.equal(loss, ref_loss.detach())
    for (name, p), r in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p.grad, r.grad), name


def test_user_plan_changes_stages_not_results():
    torch.manual_seed(0)
    model = models.GPT(depth=3).eval()
    ids = torch.randint(0, 64, (2, 8))
    plan = fxpipe.ExecutePlan(fwd_plan=[range(0, 2), range(2, 5)],
                              bwd_plan=[range(4, 5), range(3, 4), range(2, 3), range(1, 2), range(0, 1)])
    pipe = check_equivalence(model, (ids,), plan=plan)
    assert [st.layers for st in pipe.stages] == [range(0, 2), range(2, 5)]
    assert [st.device for st in pipe.stages] == [0, 1]


def test_train_eval_switch_recaptures():
    torch.manual_seed(0)
    model = models.GPT(depth=2, dropout=0.5).train()
    ids = torch.randint(0, 64, (3, 8))
    pipe = fxpipe.compile(model, example_inputs=(ids,))
    model.eval()
    # no dropout once in eval mode (close, not bitwise: 3 microbatches of 1 row run other
    # GEMM shapes than the whole batch, and some BLAS paths block them differently)
    torch.testing.assert_close(pipe(ids), model(ids))
    pipe.train()
    assert model.training


class _AttentionBlock(nn.Module):
    def __init__(self, p):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.p = p

    def forward(self, x):
        q = self.lin(x).view(x.shape[0], 2, -1, 4)
        return F.scaled_dot_product_attention(q, q, q, dropout_p=self.p).reshape(x.shape)


def _attention(p):
    return nn.Sequential(_AttentionBlock(p), _AttentionBlock(p))


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_attention_is_random_only_with_dropout(capture):
    x = torch.randn(2, 4, 8)
    quiet = fxpipe.compile(_attention(0.0), example_inputs=(x,), capture=capture)
    assert not any(layer.random for layer in quiet.layers)
    noisy = fxpipe.compile(_attention(0.1), example_inputs=(x,), capture=capture)
    random = {layer.name for layer in noisy.layers if layer.random}
    assert random == {"0", "1"}, [(layer.name, layer.random) for layer in noisy.layers]


class _TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 4) for _ in range(2)])

    def forward(self, x, y):
        for b in self.blocks:
            x = b(x)
        return x + y


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_one_tensor_given_for_two_arguments_stays_two_inputs(capture):
    model, x = _TwoInputs(), torch.randn(3, 4)
    pipe = fxpipe.compile(model, (x, x), capture=capture)  # e.g. labels=input_ids
    y = torch.zeros(3, 4)
    with torch.no_grad():
        torch.testing.assert_close(pipe(x, y), model(x, y))


def test_the_docs_list_every_compile_keyword_and_how_to_run_the_trainer_on_cpu():
    """docs/user-guide.md's signature of ``fxpipe.compile`` names every keyword it takes;
    docs/from-trainer.md says how to run on a machine without a GPU."""
    import inspect
    import pathlib
    docs = pathlib.Path(__file__).resolve().parents[1] / "docs"
    guide = (docs / "user-guide.md").read_text()
    block = guide[guide.index("fxpipe.compile(model, example_inputs=(), example_kwargs=None, *,"):]
    block = block[:block.index("```")]
    missing = [name for name in inspect.signature(fxpipe.compile).parameters
               if f"{name}=" not in block and name != "model"]
    assert not missing, f"docs/user-guide.md's compile signature lacks {missing}"
    assert "use_cpu=True" in (docs / "from-trainer.md").read_text()
