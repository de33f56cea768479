"""Splitting inputs / labels into microbatches and merging outputs (RunConfig semantics)."""

import threading
from collections import namedtuple

import pytest
import torch
import torch.utils._pytree as pytree
from hypothesis import given, settings
from hypothesis import strategies as st

from fxpipe.runtime.issue.microbatch import (PackedData, TensorChunkSpec, _CustomReducer, _Replicate,
                                       merge_output, microbatch_weights, split_input, split_label)


class Opaque:
    """A custom type nobody registered with pytree: a leaf."""

    def __init__(self, t):
        self.t = t

    def __eq__(self, other):
        return isinstance(other, Opaque) and torch.equal(self.t, other.t)


class Pair:
    """A custom type registered with pytree (with key paths)."""

    def __init__(self, a, b):
        self.a, self.b = a, b


pytree.register_pytree_node(
    Pair, lambda p: ([p.a, p.b], None), lambda xs, _: Pair(*xs),
    flatten_with_keys_fn=lambda p: ([(pytree.GetAttrKey("a"), p.a), (pytree.GetAttrKey("b"), p.b)], None))


class NoKeys:
    """A custom type registered without key paths."""

    def __init__(self, x):
        self.x = x


pytree.register_pytree_node(NoKeys, lambda p: ([p.x], None), lambda xs, _: NoKeys(xs[0]))

Point = namedtuple("Point", "x y")


# --- split_input: auto ---------------------------------------------------------------


def test_auto_splits_dim0_like_tensor_split():
    x = torch.arange(10).reshape(10, 1)
    args, kwargs = split_input((x,), None, 4, None)
    assert [a[0].shape[0] for a in args] == [3, 3, 2, 2]
    for got, want in zip(args, torch.tensor_split(x, 4)):
        assert torch.equal(got[0], want)
    assert kwargs == [{}] * 4


def test_auto_walks_nested_containers_and_replicates_the_rest():
    x, s = torch.randn(4, 3), torch.tensor(2.0)
    args, kwargs = split_input(((x, [x, {"k": x}]), s, 7, "name", None), {"m": {"z": x}, "flag": True}, 2, None)
    for i, (a, k) in enumerate(zip(args, kwargs)):
        rows = x[2 * i:2 * i + 2]
        assert torch.equal(a[0][0], rows) and torch.equal(a[0][1][0], rows)
        assert torch.equal(a[0][1][1]["k"], rows)
        assert a[1] is s                      # 0-dim tensor: replicated
        assert a[2:] == (7, "name", None)     # non-tensors: replicated
        assert torch.equal(k["m"]["z"], rows) and k["flag"] is True
        assert isinstance(a[0], tuple) and isinstance(a[0][1], list)


def test_unregistered_custom_type_is_replicated_even_with_tensors():
    o = Opaque(torch.randn(4, 2))
    args, _ = split_input((o,), {}, 2, None)
    assert args[0][0] is o and args[1][0] is o


def test_registered_custom_type_is_walked():
    p = Pair(torch.arange(4), 5)
    args, _ = split_input((p,), {}, 2, None)
    assert isinstance(args[1][0], Pair)
    assert args[1][0].a.tolist() == [2, 3] and args[1][0].b == 5


def test_namedtuple_is_walked():
    args, _ = split_input((Point(torch.arange(4), 1),), {}, 2, None)
    assert isinstance(args[0][0], Point) and args[0][0].x.tolist() == [0, 1] and args[0][0].y == 1


def test_too_many_microbatches_names_the_argument_and_sizes():
    with pytest.raises(ValueError, match=r"kwargs\['mask'\].*3 rows along dim 0.*\(3, 5\).*4 microbatches"):
        split_input((torch.zeros(8, 1),), {"mask": torch.zeros(3, 5)}, 4, None)
    with pytest.raises(ValueError, match=r"args\[0\]\[1\]\.a: cannot split 1 rows"):
        split_input(([torch.zeros(4), Pair(torch.zeros(1), 0)],), {}, 2, None)


def test_type_registered_without_keys_gets_index_paths():
    with pytest.raises(ValueError, match=r"args\[0\]\[0\]: cannot split 1 rows"):
        split_input((NoKeys(torch.zeros(1)),), {}, 2, None)


def test_num_microbatch_must_be_positive():
    with pytest.raises(ValueError, match="num_microbatch"):
        split_input((), {}, 0, None)


# --- split_input: specs --------------------------------------------------------------


def test_specs_on_args_and_kwargs():
    x, y = torch.randn(4, 6), torch.randn(2, 3)
    spec = ((TensorChunkSpec(1), _Replicate), {"mask": TensorChunkSpec(-1)})
    args, kwargs = split_input((x, y), {"mask": torch.ones(5, 3), "other": torch.zeros(3)}, 3, spec)
    assert [a[0].shape for a in args] == [torch.Size([4, 2])] * 3
    assert all(a[1] is y for a in args)
    assert [k["mask"].shape[1] for k in kwargs] == [1, 1, 1]
    assert [k["other"].shape[0] for k in kwargs] == [1, 1, 1]   # key left out of the spec: auto


def test_replicate_instance_none_subspec_and_leaf_spec_on_container():
    x = torch.randn(4, 4)
    args, _ = split_input((x, [x, x], x), {}, 2, ((_Replicate(), TensorChunkSpec(1), None), None))
    assert args[0][0] is x
    assert [t.shape for t in args[0][1]] == [torch.Size([4, 2])] * 2
    assert args[1][2].shape == (2, 4)


def test_spec_mistakes_are_named():
    x = torch.zeros(4)
    with pytest.raises(TypeError, match=r"args\[1\]: TensorChunkSpec\(0\) given for int"):
        split_input((x, 3), {}, 2, ((TensorChunkSpec(0), TensorChunkSpec(0)), None))
    with pytest.raises(ValueError, match=r"kwargs: spec has keys \['nope'\]"):
        split_input((), {"a": x}, 2, (None, {"nope": _Replicate}))
    with pytest.raises(ValueError, match=r"args: spec is tuple of 1 but the value is tuple of 2"):
        split_input((x, x), {}, 2, ((TensorChunkSpec(0),), None))
    with pytest.raises(TypeError, match=r"args\[0\]: _CustomReducer only merges"):
        split_input((x,), {}, 2, ((_CustomReducer(0, max),), None))
    with pytest.raises(ValueError, match=r"args\[0\]: cannot split a 0-dim tensor"):
        split_input((torch.tensor(1.0),), {}, 2, ((TensorChunkSpec(0),), None))
    with pytest.raises(ValueError, match=r"split dim 2 is out of range"):
        split_input((x,), {}, 2, ((TensorChunkSpec(2),), None))
    with pytest.raises(TypeError, match="split_input must be None"):
        split_input((x,), {}, 2, "dim0")


def test_callable_split_input():
    def split(args, kwargs, n):
        return [(a,) for a in args[0].chunk(n)], [dict(kwargs)] * n

    args, kwargs = split_input((torch.arange(6),), {"k": 1}, 3, split)
    assert [a[0].tolist() for a in args] == [[0, 1], [2, 3], [4, 5]] and kwargs[2] == {"k": 1}
    with pytest.raises(ValueError, match=r"returned 2 args and 3 kwargs microbatches; expected 3"):
        split_input((), {}, 3, lambda a, k, n: ([()] * 2, [{}] * 3))
    with pytest.raises(TypeError, match=r"must return \(args_list, kwargs_list\)"):
        split_input((), {}, 3, lambda a, k, n: [()] * 3)


def test_split_keeps_autograd_to_the_input():
    x = torch.randn(5, 2, requires_grad=True)
    args, _ = split_input((x,), {}, 2, None)
    merge_output([a[0] * 2 for a in args]).sum().backward()
    assert torch.equal(x.grad, torch.full((5, 2), 2.0))


@settings(max_examples=40, deadline=None, derandomize=True)
@given(rows=st.integers(1, 13), n=st.integers(1, 13), dim=st.integers(0, 1))
def test_split_then_merge_round_trips(rows, n, dim):
    shape = (rows, 3) if dim == 0 else (3, rows)
    x = torch.arange(3 * rows).reshape(shape)
    spec = ((TensorChunkSpec(dim),), None)
    if n > rows:
        with pytest.raises(ValueError, match=f"cannot split {rows} rows"):
            split_input((x,), {}, n, spec)
        return
    args, _ = split_input((x,), {}, n, spec)
    sizes = [a[0].shape[dim] for a in args]
    assert sizes == sorted(sizes, reverse=True) and max(sizes) - min(sizes) <= 1
    assert torch.equal(merge_output([a[0] for a in args], TensorChunkSpec(dim)), x)


# --- split_label ---------------------------------------------------------------------


def test_split_label_auto_spec_along_dim1_and_callable():
    y = torch.arange(6)
    assert [t.tolist() for t in split_label(y, 3)] == [[0, 1], [2, 3], [4, 5]]
    label = (torch.tensor(1.0), torch.zeros(3, 12, 4), 7)
    parts = split_label(label, 4, (_Replicate, TensorChunkSpec(1), _Replicate))
    assert [p[1].shape for p in parts] == [torch.Size([3, 3, 4])] * 4
    assert all(p[0] is label[0] and p[2] == 7 for p in parts)
    assert split_label(y, 2, lambda lab, n: list(lab.chunk(n)))[1].tolist() == [3, 4, 5]
    with pytest.raises(ValueError, match="split_label callable returned 1; expected a list of 2"):
        split_label(y, 2, lambda lab, n: [lab])
    with pytest.raises(ValueError, match=r"label\[1\]: cannot split 12 rows along dim 1"):
        split_label(label, 13, (_Replicate, TensorChunkSpec(1), _Replicate))


# --- PackedData in and out -----------------------------------------------------------


class FakeEvent:
    def __init__(self):
        self.waited = 0

    def synchronize(self):
        self.waited += 1


def test_packed_data_input_feeds_microbatches_and_waits_for_events():
    ev, flag = FakeEvent(), threading.Event()
    flag.set()
    packed = PackedData([torch.zeros(2), torch.ones(3)], pending=[ev])
    packed.add_pending(flag)
    assert packed.pending == 2
    args, kwargs = split_input((packed,), {"p": PackedData(["a", "b"])}, 2, None)
    assert torch.equal(args[1][0], torch.ones(3)) and [k["p"] for k in kwargs] == ["a", "b"]
    assert ev.waited == 1 and packed.pending == 0
    with pytest.raises(ValueError, match=r"args\[0\]: PackedData holds 2 microbatches but num_microbatch is 3"):
        split_input((packed,), {}, 3, None)


def test_merge_false_packs_every_leaf():
    outs = [{"y": torch.full((1,), float(i)), "aux": (i, "s")} for i in range(3)]
    packed = merge_output(outs, False)
    assert isinstance(packed["y"], PackedData) and isinstance(packed["aux"], tuple)
    assert packed["aux"][0] == [0, 1, 2] and packed["aux"][1] == ["s"] * 3
    assert packed["y"].synchronize() is packed["y"] and repr(packed["aux"][0]) == "PackedData([0, 1, 2])"
    with pytest.raises(ValueError, match="microbatch 1 has structure"):
        merge_output([(1, 2), (1,)], False)
    # fed back in, it gives each microbatch its own value
    args, _ = split_input((packed["y"],), {}, 3, None)
    assert [a[0].item() for a in args] == [0.0, 1.0, 2.0]


# --- merge_output --------------------------------------------------------------------


def test_auto_merge_cat_average_equal_and_structure():
    outs = [((torch.full((2, 1), float(i)), torch.tensor(float(i))), {"n": 4, "o": Opaque(torch.ones(1))})
            for i in range(3)]
    merged = merge_output(outs)
    assert merged[0][0].shape == (6, 1) and merged[0][0][2:4].eq(1).all()
    assert merged[0][1].item() == pytest.approx(1.0)
    assert merged[1]["n"] == 4 and merged[1]["o"] == Opaque(torch.ones(1))
    assert torch.equal(merge_output(outs, True)[0][0], merged[0][0])


def test_auto_merge_weighted_and_integer_scalars():
    losses = [torch.tensor(1.0), torch.tensor(4.0)]
    assert merge_output(losses, weights=[3, 1]).item() == pytest.approx(1.75)
    avg = merge_output([torch.tensor(1), torch.tensor(2)])
    assert avg.is_floating_point() and avg.item() == pytest.approx(1.5)
    with pytest.raises(ValueError, match="2 weights for 3 microbatches"):
        merge_output(losses + losses[:1], weights=[1, 1])


def test_unequal_non_tensor_outputs_name_the_path():
    with pytest.raises(ValueError, match=r"output\[1\]\['acc'\]: microbatch outputs differ .*in microbatch 2"):
        merge_output([(torch.ones(1), {"acc": 0.5})] * 2 + [(torch.ones(1), {"acc": 0.7})])
    with pytest.raises(ValueError, match=r"output: microbatch 1 returned tuple of 1 but microbatch 0 returned tuple of 2"):
        merge_output([(1, 2), (1,)])
    with pytest.raises(ValueError, match=r"output\[0\]: microbatch 0 returned a tensor but microbatch 1"):
        merge_output([(torch.ones(1),), (3,)])


def test_merge_specs():
    outs = [(torch.ones(2, 1) * i, torch.tensor(float(i)), torch.zeros(2)) for i in range(1, 4)]
    merged = merge_output(outs, (TensorChunkSpec(1), _CustomReducer(torch.tensor(0.0), lambda a, b: a + b), _Replicate))
    assert merged[0].shape == (2, 3) and merged[1].item() == 6.0 and torch.equal(merged[2], torch.zeros(2))
    merged = merge_output(outs, (None, _CustomReducer(0.0, max), None))
    assert merged[0].shape == (6, 1) and merged[1].item() == 3.0
    with pytest.raises(ValueError, match=r"output\[0\]: microbatch outputs differ"):
        merge_output(outs, (_Replicate, None, None))
    with pytest.raises(ValueError, match=r"output\[1\]: cannot concatenate 0-dim tensors"):
        merge_output(outs, TensorChunkSpec(0))
    with pytest.raises(TypeError, match=r"output\[0\]: TensorChunkSpec\(0\) given for int"):
        merge_output([(1,), (1,)], (TensorChunkSpec(0),))


def test_merge_registered_type_and_callable():
    outs = [Pair(torch.ones(1) * i, "x") for i in range(2)]
    merged = merge_output(outs)
    assert isinstance(merged, Pair) and merged.a.tolist() == [0.0, 1.0] and merged.b == "x"
    assert merge_output(outs, lambda outputs: len(outputs)) == 2
    with pytest.raises(ValueError, match="no microbatch outputs"):
        merge_output([], None)


def test_microbatch_weights():
    assert microbatch_weights([3, 3, 2]) == [0.375, 0.375, 0.25]
    with pytest.raises(ValueError, match="positive total"):
        microbatch_weights([0, 0])
