"""Property-based equivalence: random chain models under random run settings equal eager.

Hypothesis draws a ``Case``: a small model (``NetSpec``: width, depth, residuals, values
carried over several blocks, tied / shared parameters, BatchNorm1d, dropout, keyword
inputs, tensor / tuple / dict outputs) and how to run it (``RunSpec``: a valid plan,
possibly asymmetric and with a fused tail, 1-4 virtual devices, 1-6 microbatches with
uneven splits (per step), one or two eager-style / fused / no-grad steps on the same pipe,
``recompute_grain``, ``loss_reduction``). Each example compiles the model and checks
outputs, losses, every ``.grad`` (parameters and inputs) and every buffer against eager
PyTorch on a copy of the model; models with active dropout are checked against eager with
fxpipe's documented masks and against another plan and device count.

Profiles (``hypothesis.settings`` profiles, so each test's budget scales with them):

- default, ``fxpipe-fuzz-ci``: derandomized, 60 examples in all (30-50 s on 2 cores);
- ``FXPIPE_FUZZ=long``: ``fxpipe-fuzz-long``, random seeds, 1000 examples per test
  (``FXPIPE_FUZZ_EXAMPLES=N`` sets another count).

A failure prints the shrunk ``Case``; ``run_equivalence(case)`` /
``run_dropout(case)`` replay it outside pytest.
"""

from __future__ import annotations

import contextlib
import copy
import os
from collections.abc import Iterator
from dataclasses import dataclass, replace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils._pytree as pytree
from hypothesis import HealthCheck, currently_in_test_context, event, given, settings
from hypothesis import strategies as st

import fxpipe
from fxpipe.runtime.stages import rng

_HEALTH = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example]
settings.register_profile("fxpipe-fuzz-ci", max_examples=60, derandomize=True, deadline=None,
                          database=None, print_blob=True, suppress_health_check=_HEALTH)
settings.register_profile("fxpipe-fuzz-long", max_examples=1000, deadline=None,
                          print_blob=True, suppress_health_check=_HEALTH)
_LONG = os.environ.get("FXPIPE_FUZZ", "") == "long"
PROFILE = settings.get_profile("fxpipe-fuzz-long" if _LONG else "fxpipe-fuzz-ci")


def budget(ci: int) -> settings:
    """This test's share of the profile: ``ci`` examples in CI, the long count otherwise."""
    n = int(os.environ.get("FXPIPE_FUZZ_EXAMPLES", PROFILE.max_examples)) if _LONG else ci
    return settings(PROFILE, max_examples=n)


# --- models -----------------------------------------------------------------------------

@dataclass(frozen=True)
class BlockSpec:
    residual: bool        # h + f(h) instead of f(h)
    carry: int            # 0, or k >= 1: also reads the hidden state from k blocks before the input
    # also applies block ``share``'s weight (one Parameter, two layers); shared submodules
    # and block objects are tested in test_capture_blocks.py
    share: int | None
    bn: bool              # BatchNorm1d after the block's Linear
    dropout: bool         # nn.Dropout(NetSpec.p) at the end of the block


@dataclass(frozen=True)
class NetSpec:
    width: int
    ids: bool             # input: token ids [B, T] through nn.Embedding, else dense [B, width]
    seq: int              # T when ``ids``
    blocks: tuple[BlockSpec, ...]
    sequential: bool      # blocks in an nn.Sequential (else nn.ModuleList)
    explicit_layers: bool  # compile(layers="blocks") instead of finding the blocks
    tie: bool             # head.weight is the input embedding's weight
    bn_prefix: bool       # BatchNorm1d in the prefix layer
    gate: bool            # a prefix value every block reads (carried along the whole chain)
    mask: bool            # keyword tensor input ``mask`` every block reads
    temp: bool            # keyword 0-dim tensor input ``temp`` (replicated to microbatches)
    scale: float | None   # keyword non-tensor input (a graph constant)
    output: str           # "tensor" | "tuple" | "dict"
    norm_out: bool        # tuple/dict output also holds a 0-dim value (h.norm())
    p: float              # dropout probability
    train: bool           # model.train() (BatchNorm uses batch statistics, dropout active)

    @property
    def in_dim(self) -> int:
        return self.width

    @property
    def out_dim(self) -> int:
        return self.width if self.tie and not self.ids else 3

    @property
    def vocab(self) -> int:
        return 11

    @property
    def num_layers(self) -> int:  # prefix + one per block + suffix
        return len(self.blocks) + 2

    @property
    def bn_batch_stats(self) -> bool:
        return self.train and (self.bn_prefix or any(b.bn for b in self.blocks))

    @property
    def random(self) -> bool:
        return self.train and self.p > 0 and any(b.dropout for b in self.blocks)


def _bn(bn: nn.BatchNorm1d, h: torch.Tensor) -> torch.Tensor:
    return bn(h) if h.dim() == 2 else bn(h.transpose(1, 2)).transpose(1, 2)


class FuzzBlock(nn.Module):
    def __init__(self, width: int, spec: BlockSpec, p: float):
        super().__init__()
        self.spec = spec
        self.lin = nn.Linear(width, width)
        self.bn = nn.BatchNorm1d(width) if spec.bn else None
        self.shared = nn.Linear(width, width, bias=False) if spec.share is not None else None
        self.drop = nn.Dropout(p) if spec.dropout and p > 0 else None

    def forward(self, h, carried=None, gate=None, mask=None):
        y = self.lin(h)
        if self.bn is not None:
            y = _bn(self.bn, y)
        y = torch.tanh(y)
        if self.shared is not None:
            y = y + 0.5 * torch.tanh(self.shared(h))
        if self.drop is not None:
            y = self.drop(y)
        if carried is not None:
            y = y + 0.5 * carried
        if gate is not None:
            y = y * gate
        if mask is not None:
            y = y * mask
        return h + y if self.spec.residual else y


class FuzzNet(nn.Module):
    """prefix (embedding, BatchNorm, gate) → blocks → suffix (head); see ``NetSpec``."""

    def __init__(self, spec: NetSpec):
        super().__init__()
        self.spec = spec
        w = spec.width
        self.embed = nn.Embedding(spec.vocab, w) if spec.ids else nn.Linear(spec.in_dim, w)
        self.bn = nn.BatchNorm1d(w) if spec.bn_prefix else None
        self.gate = nn.Linear(w, w) if spec.gate else None
        blocks = [FuzzBlock(w, b, spec.p) for b in spec.blocks]
        for blk in blocks:
            if blk.shared is not None:  # tied: the very same Parameter in two blocks
                blk.shared.weight = blocks[blk.spec.share].lin.weight
        self.blocks = nn.Sequential(*blocks) if spec.sequential else nn.ModuleList(blocks)
        self.head = nn.Linear(w, spec.vocab if spec.ids else spec.out_dim, bias=not spec.tie)
        if spec.tie:
            self.head.weight = self.embed.weight

    def forward(self, x, mask=None, temp=None, scale=None):
        s = self.spec
        h = self.embed(x)
        if self.bn is not None:
            h = _bn(self.bn, h)
        gate = torch.sigmoid(self.gate(h)) if self.gate is not None else None
        hs = [h]  # hs[i] is block i's input: earlier ones stay live for carried reads
        for i, blk in enumerate(self.blocks):
            k = s.blocks[i].carry
            carried = hs[i - k] if k else None
            h = blk(h, carried, gate, mask)
            hs.append(h)
        logits = self.head(h)
        if temp is not None:
            logits = logits * temp
        if scale is not None:
            logits = logits * scale
        if s.output == "tensor":
            return logits
        if s.output == "tuple":
            return (logits, h, h.norm()) if s.norm_out else (logits, h)
        out = {"logits": logits, "hidden": h}
        if s.norm_out:
            out["norm"] = h.norm()
        return out


def build(spec: NetSpec, seed: int = 0) -> FuzzNet:
    torch.manual_seed(seed)
    model = FuzzNet(spec)
    with torch.no_grad():  # non-trivial BatchNorm affine parameters
        for m in model.modules():
            if isinstance(m, nn.BatchNorm1d):
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.5, 0.5)
    return model.train(spec.train)


# --- run settings -----------------------------------------------------------------------

@dataclass(frozen=True)
class RunSpec:
    devices: int
    microbatches: tuple[int, ...]  # per step (runs of one pipe with different counts)
    batch: int
    example_batch: int     # batch of the compile example (graphs must not specialize on it)
    fwd: tuple[tuple[int, int], ...]
    bwd: tuple[tuple[int, int], ...]
    plan_at_compile: bool  # compile(plan=...) rather than RunConfig(execute_plan=...) per call
    config_at_compile: bool  # num_microbatch / recompute_grain in compile's config
    grain: str
    steps: tuple[str, ...]  # "eager" (pipe(x) + .backward()), "fused", "infer" (no_grad)
    return_outputs: bool
    reduction: str         # forward_backward's loss_reduction: "mean" | "sum"
    input_grads: bool      # float inputs require grad (eager-style steps only)
    loss_hidden: bool      # the loss also reads the hidden output
    loss_norm: bool        # the loss also reads the 0-dim output

    def plan(self) -> fxpipe.ExecutePlan:
        return fxpipe.ExecutePlan(fwd_plan=[range(a, b) for a, b in self.fwd],
                                  bwd_plan=[range(a, b) for a, b in self.bwd])


@dataclass(frozen=True)
class Case:
    net: NetSpec
    run: RunSpec
    seed: int


@dataclass(frozen=True)
class DropoutCase:
    net: NetSpec
    a: RunSpec
    b: RunSpec           # another plan, device count, grain and styles; same microbatches
    seed: int


@st.composite
def net_specs(draw, dropout: bool = False) -> NetSpec:
    depth = draw(st.integers(1, 5))
    blocks = []
    for i in range(depth):
        blocks.append(BlockSpec(
            residual=draw(st.booleans()),
            carry=draw(st.integers(0, min(3, i))),
            share=draw(st.none() | st.integers(0, depth - 2).map(lambda j, i=i: j + (j >= i)))
            if depth > 1 else None,  # another block than i
            bn=draw(st.booleans()) and draw(st.booleans()),
            dropout=draw(st.booleans()) if dropout else False))
    if dropout and not any(b.dropout for b in blocks):
        blocks[0] = replace(blocks[0], dropout=True)
    output = draw(st.sampled_from(["tensor", "tuple", "dict"]))
    return NetSpec(
        width=draw(st.integers(4, 16)), ids=draw(st.booleans()), seq=draw(st.integers(2, 4)),
        blocks=tuple(blocks), sequential=draw(st.booleans()),
        explicit_layers=draw(st.booleans()), tie=draw(st.booleans()),
        bn_prefix=draw(st.booleans()) and draw(st.booleans()), gate=draw(st.booleans()),
        mask=draw(st.booleans()), temp=draw(st.booleans()),
        scale=draw(st.none() | st.sampled_from([0.5, 2.0])), output=output,
        norm_out=output != "tensor" and draw(st.booleans()),
        p=draw(st.sampled_from([0.2, 0.5])) if dropout else 0.0,
        train=True if dropout else draw(st.booleans()))


def _partition(draw, lo: int, hi: int) -> list[tuple[int, int]]:
    """``lo .. hi-1`` cut into contiguous non-empty ranges (ascending)."""
    if hi <= lo:
        return []
    cuts = sorted(draw(st.sets(st.integers(lo + 1, hi - 1), max_size=hi - lo - 1))
                  if hi - lo > 1 else set())
    edges = [lo, *cuts, hi]
    return list(zip(edges[:-1], edges[1:]))


@st.composite
def run_specs(draw, net: NetSpec, microbatches: tuple[int, ...] | None = None,
              steps: tuple[str, ...] | None = None) -> RunSpec:
    L = net.num_layers
    bwd = _partition(draw, 0, L)[::-1]  # deep to shallow
    # "train" plans cover every layer forward; "fused" ones stop where the tail starts
    fwd = _partition(draw, 0, L if draw(st.booleans()) else bwd[0][0])
    if steps is None:
        steps = tuple(draw(st.lists(st.sampled_from(["eager", "fused", "infer"]),
                                    min_size=1, max_size=2)))
    if microbatches is None:  # mostly one count for every step, sometimes another
        first = draw(st.integers(1, 6))
        microbatches = tuple(first if k == 0 or draw(st.booleans()) else draw(st.integers(1, 6))
                             for k in range(len(steps)))
    # BatchNorm on [rows, width] needs 2 rows per microbatch to compute batch statistics
    rows = 2 if net.bn_batch_stats and not net.ids else 1
    batch = draw(st.integers(rows * max(microbatches), rows * max(microbatches) + 5))
    return RunSpec(
        devices=draw(st.integers(1, 4)), microbatches=microbatches, batch=batch,
        example_batch=draw(st.sampled_from([batch, rows * 2, rows * 2 + 3])),
        fwd=tuple(fwd), bwd=tuple(bwd), plan_at_compile=draw(st.booleans()),
        config_at_compile=draw(st.booleans()), grain=draw(st.sampled_from(["stage", "layer"])),
        steps=steps, return_outputs=draw(st.booleans()),
        reduction=draw(st.sampled_from(["mean", "sum"])),
        input_grads=all(s == "eager" for s in steps) and draw(st.booleans()),
        loss_hidden=net.output != "tensor" and draw(st.booleans()),
        loss_norm=net.norm_out and draw(st.booleans()))


@st.composite
def cases(draw) -> Case:
    net = draw(net_specs())
    return Case(net, draw(run_specs(net)), draw(st.integers(0, 2**16)))


@st.composite
def dropout_cases(draw) -> DropoutCase:
    net = draw(net_specs(dropout=True))
    a = draw(run_specs(net))
    # b: the same steps, but eager-style and fused may swap (infer stays infer)
    steps_b = tuple(s if s == "infer" else draw(st.sampled_from(["eager", "fused"]))
                    for s in a.steps)
    b = draw(run_specs(net, microbatches=a.microbatches, steps=steps_b))
    if a.steps != steps_b:
        # eager-style and fused losses agree only for a batch-mean loss: "sum" adds the
        # microbatch losses (a 0-dim output is weighted by rows both ways: by pipe(x)'s
        # merge and in a fused loss)
        a = replace(a, reduction="mean")
    b = replace(b, batch=a.batch, reduction=a.reduction, loss_norm=a.loss_norm,
                loss_hidden=a.loss_hidden,
                input_grads=a.input_grads and all(s == "eager" for s in steps_b))
    return DropoutCase(net, a, b, draw(st.integers(0, 2**16)))


# --- inputs, loss, reference ------------------------------------------------------------

def make_inputs(net: NetSpec, batch: int, seed: int) -> tuple[tuple, dict, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    if net.ids:
        x = torch.randint(0, net.vocab, (batch, net.seq), generator=g)
        hidden_shape, out_shape = (batch, net.seq, net.width), (batch, net.seq, net.vocab)
    else:
        x = torch.randn(batch, net.in_dim, generator=g)
        hidden_shape, out_shape = (batch, net.width), (batch, net.out_dim)
    kwargs: dict = {}
    if net.mask:
        keep = torch.rand(hidden_shape, generator=g) > 0.25
        kwargs["mask"] = keep.to(torch.get_default_dtype())
    if net.temp:
        kwargs["temp"] = torch.tensor(0.75)
    if net.scale is not None:
        kwargs["scale"] = net.scale
    return (x,), kwargs, torch.randn(out_shape, generator=g)


def make_loss_fn(net: NetSpec, run: RunSpec):
    def loss_fn(out, label):
        if net.output == "tensor":
            return F.mse_loss(out, label)
        tup = net.output == "tuple"
        logits, hidden = (out[0], out[1]) if tup else (out["logits"], out["hidden"])
        loss = F.mse_loss(logits, label)
        if run.loss_hidden:
            loss = loss + 0.1 * hidden.square().mean()
        if run.loss_norm:
            loss = loss + 0.01 * (out[2] if tup else out["norm"])
        return loss
    return loss_fn


def with_input_grads(args: tuple, kwargs: dict, on: bool) -> tuple[tuple, dict]:
    def leaf(v):
        if isinstance(v, torch.Tensor):
            v = v.detach().clone()
            if on and v.is_floating_point():
                v.requires_grad_()
        return v
    return pytree.tree_map(leaf, (args, kwargs))


def split(value, m: int) -> list:
    """fxpipe's documented auto split: >= 1-dim tensors as ``torch.tensor_split`` on dim 0,
    everything else replicated."""
    leaves, spec = pytree.tree_flatten(value)
    parts = [torch.tensor_split(v, m) if isinstance(v, torch.Tensor) and v.dim() else [v] * m
             for v in leaves]
    return [pytree.tree_unflatten([p[i] for p in parts], spec) for i in range(m)]


def merge(outs: list, mbs: list):
    """The documented auto merge: cat >= 1-dim tensors on dim 0, average 0-dim ones, each
    microbatch (of ``mbs``, its ``(args, kwargs)``) weighted by its share of the rows."""
    flat = [pytree.tree_flatten(o) for o in outs]
    spec = flat[0][1]
    rows = torch.tensor([float(a[0].shape[0]) for a, _ in mbs])
    merged = [torch.cat(col) if col[0].dim() else
              (torch.stack(col) * (rows / rows.sum()).to(col[0].dtype)).sum(0)
              for col in zip(*(f[0] for f in flat))]
    return pytree.tree_unflatten(merged, spec)


def per_microbatch(net: NetSpec, m: int) -> bool:
    """Whether eager must see each of the ``m`` microbatches on its own: BatchNorm with
    batch statistics and 0-dim outputs depend on the rows they see (README, Limitations)."""
    return m > 1 and (net.bn_batch_stats or net.norm_out)


def fused_loss(run: RunSpec, outs: list, labels: list, rows: list[int], loss_fn):
    """forward_backward's loss: per microbatch, weighted by its share of the rows
    ("mean") or added ("sum")."""
    weights = [r / sum(rows) if run.reduction == "mean" and len(rows) > 1 else 1.0
               for r in rows]
    return sum(loss_fn(o, y) * w for o, y, w in zip(outs, labels, weights))


def reference_step(model, net, run, k, args, kwargs, label, loss_fn):
    """Eager PyTorch for step ``k``: (outputs, loss)."""
    style, m = run.steps[k], run.microbatches[k]
    if not per_microbatch(net, m) and not (style == "fused" and run.reduction == "sum"):
        if style == "infer":
            with torch.no_grad():
                return model(*args, **kwargs), None
        out = model(*args, **kwargs)
        loss = loss_fn(out, label)
        loss.backward()
        return out, loss
    mbs = split((args, kwargs), m)
    if style == "infer":
        with torch.no_grad():
            return merge([model(*a, **kw) for a, kw in mbs], mbs), None
    outs = [model(*a, **kw) for a, kw in mbs]
    if style == "eager":
        out = merge(outs, mbs)
        loss = loss_fn(out, label)
    else:
        rows = [a[0].shape[0] for a, _ in mbs]
        loss = fused_loss(run, outs, split(label, m), rows, loss_fn)
        out = merge(outs, mbs)
    loss.backward()
    return out, loss


def pipe_step(pipe, run, k, args, kwargs, label, loss_fn):
    """fxpipe's step ``k``: (outputs or None, loss or None)."""
    style, m = run.steps[k], run.microbatches[k]
    cfg = fxpipe.RunConfig(
        num_microbatch=None if run.config_at_compile and m == run.microbatches[0] else m,
        recompute_grain=None if run.config_at_compile else run.grain,
        execute_plan=None if run.plan_at_compile else run.plan())
    if style == "infer":
        with torch.no_grad():
            out = pipe(*args, run_config=cfg, **kwargs)
        assert not any(t.requires_grad for t in pytree.tree_leaves(out)
                       if isinstance(t, torch.Tensor))
        return out, None
    if style == "eager":
        out = pipe(*args, run_config=cfg, **kwargs)
        loss = loss_fn(out, label)
        loss.backward()
        return out, loss.detach()
    res = pipe.forward_backward(args, kwargs, label=label, loss_fn=loss_fn,
                                loss_reduction=run.reduction,
                                return_outputs=run.return_outputs, run_config=cfg)
    loss, out = res if run.return_outputs else (res, None)
    assert not loss.requires_grad and loss.dim() == 0
    return out, loss


def compile_pipe(model, net: NetSpec, run: RunSpec, devs):
    args, kwargs, _ = make_inputs(net, run.example_batch, seed=12345)
    config = fxpipe.RunConfig(num_microbatch=run.microbatches[0], recompute_grain=run.grain) \
        if run.config_at_compile else None
    pipe = fxpipe.compile(model, example_inputs=args, example_kwargs=kwargs, devices=devs,
                          layers="blocks" if net.explicit_layers else None, config=config,
                          plan=run.plan() if run.plan_at_compile else None)
    assert [layer.name for layer in pipe.layers] == \
        ["prefix", *(f"blocks.{i}" for i in range(len(net.blocks))), "suffix"]
    return pipe


# --- comparing --------------------------------------------------------------------------

TOLERANCES = {torch.float32: (2e-6, 1e-5),   # tests/test_runtime.py's
              torch.float64: (1e-9, 1e-7)}


@contextlib.contextmanager
def dtype_for(net: NetSpec) -> Iterator[None]:
    """float32, but float64 for BatchNorm with batch statistics: over microbatches of a
    few rows it divides by tiny standard deviations (and the gradient of what comes
    before it nearly cancels), so fp32 rounding of different but equally right op orders
    exceeds any fixed tolerance (seen: 3e-6 on gradients of 1e-6; replayed in float64
    the same cases agree to 1e-12). What is under test does not depend on the dtype."""
    if not net.bn_batch_stats:
        yield
        return
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def assert_close(a, b, what: str) -> None:
    assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), what
    assert a.shape == b.shape and a.dtype == b.dtype, \
        f"{what}: {tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}"
    a, b = a.detach(), b.detach()
    if a.dtype == torch.long:
        assert torch.equal(a, b), f"{what}: {a} vs {b}"
        return
    atol, rtol = TOLERANCES[a.dtype]
    assert torch.allclose(a, b, atol=atol, rtol=rtol), \
        f"{what}: max diff {(a - b).abs().max().item():.3g} (max |ref| {b.abs().max().item():.3g})"


def assert_tree_close(a, b, what: str) -> None:
    (la, sa), (lb, sb) = pytree.tree_flatten(a), pytree.tree_flatten(b)
    assert sa == sb, f"{what}: structure {sa} vs {sb}"
    for i, (x, y) in enumerate(zip(la, lb)):
        assert_close(x, y, f"{what} leaf {i}")


def assert_state_close(model, ref, what: str) -> None:
    refs = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        r = refs[name]
        assert (p.grad is None) == (r.grad is None), f"{what}: .grad of {name} is None on one side"
        if p.grad is not None:
            assert_close(p.grad, r.grad, f"{what}: grad of {name}")
    ref_buffers = dict(ref.named_buffers())
    for name, b in model.named_buffers():
        assert_close(b, ref_buffers[name], f"{what}: buffer {name}")
    for (name, p), r in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, r), f"{what}: parameter {name} was changed"


def assert_input_grads(a: tuple, b: tuple, what: str) -> None:
    for i, (x, y) in enumerate(zip(pytree.tree_leaves(a), pytree.tree_leaves(b))):
        if isinstance(x, torch.Tensor) and x.requires_grad:
            assert (x.grad is None) == (y.grad is None), f"{what}: input {i} .grad"
            if x.grad is not None:
                assert_close(x.grad, y.grad, f"{what}: grad of input {i}")


# --- the properties ---------------------------------------------------------------------

def devices(n: int) -> list[fxpipe.VirtualDevice]:
    return [fxpipe.VirtualDevice() for _ in range(n)]


def note(net: NetSpec, run: RunSpec) -> None:
    """Coverage, shown by ``pytest --hypothesis-show-statistics``."""
    if not currently_in_test_context():  # a case replayed by hand
        return
    if not run.fwd:
        event("fused tail is every layer (fwd_plan=[])")
    if any(run.batch % m for m in run.microbatches):
        event("uneven microbatches")
    if len(set(run.microbatches)) > 1:
        event("microbatch count changes between steps")
    if net.bn_batch_stats:
        event("BatchNorm with batch statistics")
    event(f"recompute_grain={run.grain}")
    event(f"steps={'+'.join(run.steps)}")


def run_equivalence(case: Case) -> None:
    """fxpipe equals eager on ``case`` (replays a failing case outside pytest too)."""
    with dtype_for(case.net):
        _check_equivalence(case)


def _check_equivalence(case: Case) -> None:
    net, run = case.net, case.run
    note(net, run)
    model = build(net, case.seed)
    ref = copy.deepcopy(model)
    if net.tie:
        assert ref.head.weight is ref.embed.weight
    devs = devices(run.devices)
    try:
        pipe = compile_pipe(model, net, run, devs)
        loss_fn = make_loss_fn(net, run)
        for k, style in enumerate(run.steps):
            args, kwargs, label = make_inputs(net, run.batch, case.seed + k)
            p_args, p_kwargs = with_input_grads(args, kwargs, run.input_grads)
            r_args, r_kwargs = with_input_grads(args, kwargs, run.input_grads)
            out, loss = pipe_step(pipe, run, k, p_args, p_kwargs, label, loss_fn)
            ref_out, ref_loss = reference_step(ref, net, run, k, r_args, r_kwargs, label, loss_fn)
            what = f"step {k} ({style}, {run.microbatches[k]} microbatches)"
            if out is not None:
                assert_tree_close(out, ref_out, f"{what}: outputs")
            if loss is not None:
                assert_close(loss, ref_loss, f"{what}: loss")
            assert_state_close(model, ref, what)
            assert_input_grads((p_args, p_kwargs), (r_args, r_kwargs), what)
        for d in devs:
            assert d.resident_bytes() == 0, f"{d.name} holds memory after the steps"
    finally:
        for d in devs:
            d.close()


@budget(40)
@given(case=cases())
def test_matches_eager(case):
    run_equivalence(case)


def _dropout_run(net: NetSpec, run: RunSpec, seed: int):
    """Run ``run.steps`` from ``torch.manual_seed(seed)``: per step (outputs, loss),
    and the model after."""
    model = build(net, seed)
    devs = devices(run.devices)
    results = []
    try:
        pipe = compile_pipe(model, net, run, devs)
        loss_fn = make_loss_fn(net, run)
        torch.manual_seed(seed)
        for k in range(len(run.steps)):
            args, kwargs, label = make_inputs(net, run.batch, seed + k)
            args, kwargs = with_input_grads(args, kwargs, run.input_grads)
            out, loss = pipe_step(pipe, run, k, args, kwargs, label, loss_fn)
            results.append((out, loss, (args, kwargs)))
    finally:
        for d in devs:
            d.close()
    return results, model


def _layerwise_reference(net: NetSpec, run: RunSpec, seed: int):
    """Eager with fxpipe's documented masks: every layer of every microbatch runs under
    ``rng.layer_seed(call seed, layer, microbatch)``, one call seed drawn per step."""
    model = build(net, seed)
    args, kwargs, _ = make_inputs(net, run.example_batch, seed=12345)
    lg = fxpipe.compile(model, example_inputs=args, example_kwargs=kwargs,
                        devices=devices(1), layers="blocks").layers
    loss_fn = make_loss_fn(net, run)
    results = []
    torch.manual_seed(seed)
    for k, (style, m) in enumerate(zip(run.steps, run.microbatches)):
        args, kwargs, label = make_inputs(net, run.batch, seed + k)
        args, kwargs = with_input_grads(args, kwargs, run.input_grads)
        call_seed = rng.draw_call_seed()
        outs, mbs = [], split((args, kwargs), m)
        with torch.set_grad_enabled(style != "infer"):
            for mi, (a, kw) in enumerate(mbs):
                tensors = [v for v in pytree.tree_leaves((a, kw)) if isinstance(v, torch.Tensor)]
                env = dict(zip(lg.input_names, tensors))
                for layer in lg:
                    if layer.random:
                        torch.manual_seed(rng.layer_seed(call_seed, layer.index, mi))
                    env.update(zip(layer.outputs, layer.gm(*[env[n] for n in layer.inputs])))
                outs.append(pytree.tree_unflatten(lg.flat_outputs(env), lg.out_spec))
        torch.manual_seed(seed)  # the generator as fxpipe leaves it: advanced by the draws
        for _ in range(k + 1):
            rng.draw_call_seed()
        out = merge(outs, mbs)
        loss = None
        if style == "eager":
            loss = loss_fn(out, label)
        elif style == "fused":
            rows = [a[0].shape[0] for a, _ in mbs]
            loss = fused_loss(run, outs, split(label, m), rows, loss_fn)
        if loss is not None:
            loss.backward()
            loss = loss.detach()
        results.append((out, loss, (args, kwargs)))
    return results, model


def run_dropout(case: DropoutCase) -> None:
    """Dropout runs equal eager with fxpipe's masks, and each other."""
    with dtype_for(case.net):
        _check_dropout(case)


def _check_dropout(case: DropoutCase) -> None:
    net = case.net
    note(net, case.a)
    res_a, model_a = _dropout_run(net, case.a, case.seed)
    res_ref, model_ref = _layerwise_reference(net, case.a, case.seed)
    res_b, model_b = _dropout_run(net, case.b, case.seed)
    for other, model_o, name in ((res_ref, model_ref, "layerwise eager"),
                                 (res_b, model_b, "another plan/devices")):
        for k, ((out, loss, inp), (out_o, loss_o, inp_o)) in enumerate(zip(res_a, other)):
            what = f"vs {name}, step {k} ({case.a.steps[k]})"
            if out is not None and out_o is not None:
                assert_tree_close(out, out_o, f"{what}: outputs")
            if loss is not None and loss_o is not None:
                assert_close(loss, loss_o, f"{what}: loss")
            if case.a.input_grads and (name != "another plan/devices" or case.b.input_grads):
                assert_input_grads(inp, inp_o, what)
        assert_state_close(model_a, model_o, f"vs {name}")


@budget(12)
@given(case=dropout_cases())
def test_dropout_masks_follow_seed_layer_and_microbatch_only(case):
    run_dropout(case)


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__, "-q"])
