"""A model captured again is not traced again (``fxpipe.passes.capture_cache``).

The second pipe over a model of the same code, structure and call reuses the first
capture's graph, reading its *own* parameters: the step equals eager on the second
model's weights. Whatever tracing reads that differs is a new capture: a config value,
train/eval, a frozen parameter, a patched function, a tensor attribute's value, the
input shapes, the precision. A hooked model is never cached, and the cache keeps no
model alive.
"""

from __future__ import annotations

import copy
import functools
import gc
import weakref

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxpipe
from fxpipe.passes import capture_cache
from fxpipe.passes.capture import capture


def act(x):
    return F.gelu(x)


class Net(nn.Module):
    """Two blocks whose forward calls a module-level function and reads a flag and a
    small tensor attribute."""

    def __init__(self, width: int = 8, scale: float = 1.0, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(2))
        self.head = nn.Linear(width, 3)
        self.scale = scale
        self.shift = torch.zeros(width)     # a plain tensor attribute: captured by value

    def forward(self, x):
        for block in self.blocks:
            x = act(block(x)) * self.scale + self.shift.to(x.dtype)
        return self.head(x)


def relu(x):
    return F.relu(x)


def passed_through(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)
    return wrapper


class Decorated(Net):
    """A decorated forward (as Hugging Face's often are) that calls a function nested in it,
    which calls a module-level one."""

    @passed_through
    def forward(self, x):
        def inner(y):
            return relu(y)
        return self.head(inner(self.blocks[0](x)))


def traced(model, x=None, **kw):
    """Whether capturing ``model`` traced (True) or reused an earlier graph (False)."""
    before = capture_cache.hits
    capture(model, (torch.randn(4, 8) if x is None else x,), method="export", **kw)
    return capture_cache.hits == before


@pytest.fixture(autouse=True)
def empty_cache():
    capture_cache.clear()
    yield
    capture_cache.clear()


def test_a_second_model_of_the_same_code_reuses_the_graph_and_trains_on_its_own_weights():
    x, y = torch.randn(6, 8), torch.randint(0, 3, (6,))
    loss_fn = lambda out, t: F.cross_entropy(out, t)  # noqa: E731
    for seed in (0, 1):   # the second capture is a cache hit; its weights differ
        model = Net(seed=seed)
        ref = copy.deepcopy(model)
        hits = capture_cache.hits
        with fxpipe.compile(model, example_inputs=(x,), capture="export",
                            devices=[fxpipe.VirtualDevice() for _ in range(2)]) as pipe:
            loss = pipe.forward_backward((x,), label=y, loss_fn=loss_fn,
                                         run_config=fxpipe.RunConfig(num_microbatch=3))
        assert capture_cache.hits == hits + seed
        expected = loss_fn(ref(x), y)
        expected.backward()
        torch.testing.assert_close(loss, expected.detach())
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_a_hugging_face_model_rebuilt_from_its_config_is_captured_once():
    pytest.importorskip("transformers")
    from tests import models
    batch = {"input_ids": torch.randint(0, 64, (2, 8))}
    batch["labels"] = batch["input_ids"].clone()
    for seed in (0, 1):
        torch.manual_seed(seed)
        model = models.tiny_llama()
        ref = copy.deepcopy(model)
        hits = capture_cache.hits
        with fxpipe.compile(model, example_kwargs=batch,
                            devices=[fxpipe.VirtualDevice() for _ in range(2)]) as pipe:
            loss = pipe.forward_backward((), batch, loss_fn=lambda out, _: out.loss)
        assert capture_cache.hits == hits + seed
        expected = ref(**batch).loss
        expected.backward()
        torch.testing.assert_close(loss, expected.detach())
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, msg=name)


@pytest.mark.parametrize("change", [
    "config value", "eval", "frozen", "tensor attribute", "input shape", "param_dtype",
    "autocast", "patched function", "patched method"])
def test_what_tracing_reads_differs_so_it_traces_again(change, monkeypatch):
    assert traced(Net())
    assert not traced(Net(seed=3))          # the same code, structure and call
    model, x, kw = Net(), None, {}
    if change == "config value":
        model = Net(scale=2.0)
    elif change == "eval":
        model.blocks[1].eval()
    elif change == "frozen":
        model.head.weight.requires_grad_(False)
    elif change == "tensor attribute":
        model.shift = torch.ones(8)
    elif change == "input shape":
        x = torch.randn(4, 1, 8)
    elif change == "param_dtype":
        kw = {"param_dtype": torch.bfloat16}
    elif change == "patched function":
        monkeypatch.setitem(globals(), "act", F.silu)
    elif change == "patched method":
        monkeypatch.setattr(Net, "forward", lambda self, x: self.head(x))
    if change == "autocast":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert traced(model, x, **kw)
    else:
        assert traced(model, x, **kw)


def test_a_function_patched_behind_a_decorator_and_a_nested_function_is_seen(monkeypatch):
    assert traced(Decorated()) and not traced(Decorated(seed=1))
    monkeypatch.setitem(globals(), "relu", torch.tanh)
    assert traced(Decorated())


def test_a_hooked_model_is_never_cached():
    model = Net()
    model.blocks[0].register_forward_hook(lambda m, i, o: o * 2)
    assert traced(model) and traced(model)
    assert capture_cache.key(model, [torch.randn(4, 8)], None, ["x"], "export", [[0]], (),
                             None) is None


def test_the_cache_keeps_no_model_alive():
    model = Net()
    assert traced(model) and len(capture_cache._CACHE) == 1
    gone = weakref.ref(model.blocks[0].weight)
    del model
    gc.collect()
    assert gone() is None


def test_verbose_mode_says_a_capture_was_reused(capsys):
    fxpipe.set_verbose(True)   # part of the key: verbose graphs keep their stack traces
    try:
        capture(Net(), (torch.randn(4, 8),), method="export")
        assert "reuses" not in capsys.readouterr().err
        capture(Net(seed=1), (torch.randn(4, 8),), method="export")
    finally:
        fxpipe.set_verbose(None)
    assert "Net reuses an earlier capture" in capsys.readouterr().err


def test_it_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("FXPIPE_CAPTURE_CACHE", "0")
    assert traced(Net()) and traced(Net())


def test_a_scalar_tensor_attribute_is_compared_by_value():
    def key_with(step):
        model = Net()
        model.step = torch.tensor(step)   # 0-dim (a generation's position counter, say)
        return capture_cache.key(model, [torch.randn(4, 8)], None, ["x"], "export", [[0]], (),
                                 None)
    assert key_with(1) is not None and key_with(1) == key_with(1) != key_with(2)
