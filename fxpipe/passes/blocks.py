"""Capture at block granularity: the model's own forward traced with its blocks opaque.

Some models cannot be one graph because code *inside* a block branches on data: an MoE
block looping over the experts that received tokens (``.nonzero()``, ``.tolist()``), a
router that reassigns a module in ``forward``. fx, export and dynamo all refuse them.
A pipeline runs each layer eagerly anyway; only the *boundaries* between blocks need a
graph. So ``capture(method="blocks")`` (``"auto"`` tries it last) traces the model's
forward with ``torch.export`` while every block call is one opaque node::

    run_block = fxpipe_passes_blocks_run_block(self.opaque_model_layers_0,
        [model_layers_0_input_layernorm_weight, ...], [embedding, to_5, ...], [])
    getitem = run_block[0]

``run_block`` calls the block as its module (``torch.func.functional_call`` with the
tensors it is handed for the block's parameters and buffers: in a stage, the ones the
stage prefetched, so every expert of a MoE block is uploaded with it). Partition,
lowering and the runtime treat it as any other node; its costs are measured
(``fxpipe.passes.costs``), since fake tensors cannot run data-dependent code.

While tracing, each block call returns fake tensors shaped like what that call returned
when the example ran once eagerly just before (``opaque_blocks``); a size is symbolic
where it equals a symbolic size of the call's inputs (the batch), else fixed.

>>> import torch, torch.nn as nn
>>> from fxpipe.passes.capture import capture
>>> class Routed(nn.Linear):  # a block with data-dependent control flow
...     def forward(self, x):
...         return super().forward(x) if bool((x > 0).any()) else x
>>> model = nn.Sequential(Routed(4, 4), Routed(4, 4))
>>> gm = capture(model, (torch.randn(3, 4),), method="blocks", blocks=["0", "1"])
>>> [str(n.target.__name__) for n in gm.graph.nodes if n.op == "call_function"]
['run_block', 'getitem', 'run_block', 'getitem']
>>> torch.equal(gm(torch.ones(3, 4))[0], model(torch.ones(3, 4)))
True
"""

from __future__ import annotations

import contextlib
import functools
import os
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree

from fxpipe.attention import SameKernelMode
from fxpipe.runtime.stages import amp

# The node a block call is while tracing; ``call_blocks`` replaces it by ``run_block``.
_lib = torch.library.Library("fxpipe_blocks", "DEF")
_lib.define("opaque(Tensor[] params, Tensor[] tensors, SymInt[] sizes, int call) -> Tensor[]")


def _never(params, tensors, sizes, call):
    raise RuntimeError("fxpipe_blocks::opaque only exists while capturing; the captured graph "
                       "calls run_block instead")


_lib.impl("opaque", _never, "CompositeExplicitAutograd")
_OPAQUE = torch.ops.fxpipe_blocks.opaque.default


class OutsideBlocksError(RuntimeError):
    """The model's own forward, outside its blocks, could not be traced (names the line)."""


class EagerFailureError(RuntimeError):
    """The model itself fails on the example, run eagerly (without fxpipe)."""


class OpaqueBlock(nn.Module):
    """One call of a block, which ``run_block`` runs as its module.

    Holds the block by reference, not as a submodule (its parameters stay the model's,
    reached by FQN in the graph), and how to rebuild the call: ``in_leaves`` (per leaf of
    ``(args, kwargs)``: ``("tensor", i)``, ``("size", i)`` or ``("value", v)``) and
    ``out_leaves`` (per leaf of the output: ``("tensor", i)`` or ``("value", v)``).
    """

    def __init__(self, block: nn.Module, path: str, names: list[str], in_spec, in_leaves: list,
                 out_spec, out_leaves: list):
        super().__init__()
        object.__setattr__(self, "block", block)  # not registered: no second owner of its tensors
        self.path, self.names = path, names
        self.in_spec, self.in_leaves = in_spec, in_leaves
        self.out_spec, self.out_leaves = out_spec, out_leaves
        self.training = block.training
        # whether its calls run an attention with dropout (``fxpipe.attention``): None until
        # a call in training mode has run and seen
        self.attention_dropout: bool | None = None if block.training else False

    def extra_repr(self) -> str:
        return f"{self.path}: {type(self.block).__name__}, run as a module"


def run_block(block: OpaqueBlock, params: list[torch.Tensor], tensors: list[torch.Tensor],
              sizes: list[int]) -> tuple[torch.Tensor, ...]:
    """Call ``block``'s module with ``params`` as its parameters and buffers (in the order
    of ``block.names``) on the call's arguments rebuilt from ``tensors`` and ``sizes``;
    returns the output's tensors."""
    leaves = [tensors[v] if kind == "tensor" else sizes[v] if kind == "size" else v
              for kind, v in block.in_leaves]
    args, kwargs = pytree.tree_unflatten(leaves, block.in_spec)
    call = functools.partial(torch.func.functional_call, block.block,
                             dict(zip(block.names, params)), args, kwargs)
    if block.attention_dropout is False:
        out = call()
    else:   # its attention with dropout picks the recompute's kernel (``fxpipe.attention``)
        with SameKernelMode() as mode:
            out = call()
        block.attention_dropout = block.attention_dropout or mode.seen
    flat, spec = pytree.tree_flatten(out)
    if spec != block.out_spec:
        raise RuntimeError(f"block {block.path} returned a differently structured output than when "
                           f"it was captured:\n{spec}\nvs\n{block.out_spec}")
    return tuple(x for x, (kind, _) in zip(flat, block.out_leaves) if kind == "tensor")


_CONSTANTS = (type(None), bool, int, float, complex, str, torch.dtype, torch.device, torch.layout,
              torch.memory_format)


class BlockCallError(RuntimeError):
    """A block call that cannot be made opaque (an object argument or output)."""


def _constant(x: Any, path: str, how: str, dropped: list[str]) -> Any:
    """``x``, a non-tensor value a block call is given or returns, which becomes a constant
    of the graph. An object cannot be one; a cache (a type named ``...Cache``, as Hugging
    Face's are), which blocks fill in for generation, is replaced by ``None``: the cache is
    off for the captured call (the model's output carries none either)."""
    if isinstance(x, _CONSTANTS):
        return x
    if any(c.__name__.endswith("Cache") for c in type(x).__mro__):
        dropped.append(f"block {path} {how} a value of type {type(x).__name__}")
        return None
    raise BlockCallError(f"block {path} {how} a value of type {type(x).__name__}, which would be "
                         "frozen into the graph as it was while tracing; a pipeline cannot carry "
                         "such an object between layers")


class _Like(NamedTuple):
    """What a block call returned for the example: a tensor's shape, dtype and device."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device


class _Trace:
    """The block calls of one capture: each module's recorded example outputs, and the
    ``OpaqueBlock`` of every call made while tracing."""

    def __init__(self, paths: dict[int, str], examples: dict[int, list]):
        self.paths = paths
        self.examples = examples          # id(module) -> [(out_spec, leaves)] per call
        self.counts = {k: 0 for k in paths}
        self.calls: list[OpaqueBlock] = []
        self.like: list[list[_Like]] = []  # per call: the example's output tensors
        self.dropped: list[str] = []       # cache objects passed to blocks as None

    def call(self, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        key, path = id(module), self.paths[id(module)]
        k = self.counts[key]
        self.counts[key] += 1
        if k >= len(self.examples[key]):
            raise RuntimeError(f"block {path} was called {k + 1} times while tracing, but "
                               f"{len(self.examples[key])} times when the example ran eagerly")
        out_spec, out = self.examples[key][k]
        leaves, in_spec = pytree.tree_flatten((args, kwargs))
        tensors, sizes, in_leaves = [], [], []
        for x in leaves:
            if isinstance(x, torch.Tensor):
                in_leaves.append(("tensor", len(tensors)))
                tensors.append(x)
            elif isinstance(x, torch.SymInt):
                in_leaves.append(("size", len(sizes)))
                sizes.append(x)
            elif isinstance(x, torch.SymFloat):  # rare: specialized (export guards on it)
                in_leaves.append(("value", float(x)))
            elif isinstance(x, torch.SymBool):
                in_leaves.append(("value", bool(x)))
            else:
                in_leaves.append(("value", _constant(x, path, "is called with", self.dropped)))
        named = list(module.named_parameters()) + list(module.named_buffers())
        out_leaves, like = [], []
        for x in out:
            if isinstance(x, _Like):
                out_leaves.append(("tensor", len(like)))
                like.append(x)
            else:
                out_leaves.append(("value", _constant(x, path, "returns", self.dropped)))
        name = path if k == 0 else f"{path}@{k}"
        self.calls.append(OpaqueBlock(module, name, [n for n, _ in named], in_spec, in_leaves,
                                      out_spec, out_leaves))
        self.like.append(like)
        flat = iter(_OPAQUE([t for _, t in named], tensors, sizes, len(self.calls) - 1))
        leaves = [next(flat) if kind == "tensor" else v for kind, v in out_leaves]
        return pytree.tree_unflatten(leaves, out_spec)

    def where(self) -> str:
        """Where the trace is, in the words of the layer chain."""
        if not self.calls:
            return f"in the prefix layer, before block {next(iter(self.paths.values()))}"
        if all(self.counts[k] >= len(self.examples[k]) for k in self.paths):
            return f"in the suffix layer, after the last block ({self.calls[-1].path})"
        return f"after block {self.calls[-1].path}, in its layer"


_traces: list[_Trace] = []  # the captures in progress (the fake kernel reads the last)


@torch.library.register_fake("fxpipe_blocks::opaque", lib=_lib)
def _opaque_fake(params, tensors, sizes, call):
    return [_shaped_like(o, tensors, sizes) for o in _traces[-1].like[call]]


def _shaped_like(o: _Like, tensors: Sequence[torch.Tensor], sizes: Sequence[Any]) -> torch.Tensor:
    """A fake tensor like ``o``, each size symbolic where a symbolic size of the inputs (or
    the product of two adjacent ones) had the same value for the example."""
    same = next((t for t in tensors if tuple(map(_hint, t.shape)) == o.shape), None)
    if same is not None:
        return torch.empty(same.shape, dtype=o.dtype, device=o.device)
    candidates = [s for t in tensors for s in t.shape] + list(sizes)
    candidates += [a * b for t in tensors for a, b in zip(t.shape, t.shape[1:])]
    symbolic = [s for s in candidates if isinstance(s, torch.SymInt) and s.node.has_hint()]
    size = []
    for d, n in enumerate(o.shape):
        at_d = [t.shape[d] for t in tensors if t.dim() > d and isinstance(t.shape[d], torch.SymInt)]
        match = [s for s in at_d + symbolic if s.node.has_hint() and s.node.hint == n]
        size.append(match[0] if n > 1 and match else n)
    return torch.empty(size, dtype=o.dtype, device=o.device)


def _hint(s: Any) -> Any:
    return s.node.hint if isinstance(s, torch.SymInt) else s


@contextlib.contextmanager
def opaque_blocks(model: nn.Module, paths: Sequence[str],
                  run_example: Callable[[], Any]) -> Iterator[_Trace]:
    """Within the block, every module at ``paths`` is an opaque call when traced.

    ``run_example`` runs the model on the example once, eagerly and without grad, first:
    it records what each block call returns (the RNG state and buffers are restored
    afterwards). An exception raised in the block is re-raised saying where the trace was
    and which line of the model it hit."""
    modules: dict[int, tuple[str, nn.Module]] = {}
    for path in paths:
        module = model.get_submodule(path)
        modules.setdefault(id(module), (path, module))
    examples = _run_once(model, [m for _, m in modules.values()], run_example)
    trace = _Trace({k: p for k, (p, _) in modules.items()}, examples)
    for _, module in modules.values():
        module.forward = lambda *a, _m=module, **k: trace.call(_m, *a, **k)
    _traces.append(trace)
    try:
        yield trace
    except BlockCallError:
        raise
    except Exception as e:
        raise OutsideBlocksError(f"the model's own forward, outside its blocks, {trace.where()}"
                           f"{user_line(e)}, hit {type(e).__name__}: {_first_line(e)}") from e
    finally:
        _traces.remove(trace)
        for _, module in modules.values():
            del module.forward


def _run_once(model: nn.Module, modules: list[nn.Module], run_example: Callable[[], Any]) -> dict:
    """Run the example eagerly; per module, ``(out_spec, leaves)`` of each of its calls,
    tensors as ``_Like``. With grad (when training is possible) it also checks that a
    block whose parameters require grad returns something that carries a gradient: run
    as a module, a block that turns grad off inside (leaving its gradients to a custom
    ``autograd.Function`` around the blocks) would silently get none. Each block's outputs
    then go on detached: no block's saved activations outlive it."""
    examples: dict[int, list] = {id(m): [] for m in modules}
    names = {id(m): n for n, m in model.named_modules() if id(m) in examples}
    grad = torch.is_grad_enabled() and any(p.requires_grad for p in model.parameters())
    no_grad: list[str] = []

    def record(module, args, kwargs, out):
        leaves, spec = pytree.tree_flatten(out)
        examples[id(module)].append((spec, [_Like(tuple(x.shape), x.dtype, x.device)
                                            if isinstance(x, torch.Tensor) else x for x in leaves]))
        floats = [x for x in leaves if isinstance(x, torch.Tensor) and x.is_floating_point()]
        if grad and floats and not any(x.requires_grad for x in floats) and \
                any(p.requires_grad for p in module.parameters()):
            no_grad.append(names[id(module)])
        # the next block gets the values without this one's autograd graph: the run holds
        # one block's saved activations at a time, not the whole model's (an 8B model's
        # 16 x 4,096-token example held 130 GB of host memory)
        return pytree.tree_map_only(torch.Tensor, torch.Tensor.detach, out) if grad else None

    checkpointed = [n for n, m in model.named_modules()
                    if getattr(m, "gradient_checkpointing", False)]
    if checkpointed:
        raise RuntimeError(f"{checkpointed[0]} uses gradient checkpointing, whose backward would "
                           "recompute a block with the host's parameters; fxpipe recomputes each "
                           "stage itself: call model.gradient_checkpointing_disable() first")
    if any(t.is_meta for t in model.parameters()):
        raise RuntimeError("capturing at block granularity runs the example once, but the model's "
                           "parameters are on the meta device; load its weights first")
    handles = [m.register_forward_hook(record, with_kwargs=True) for m in modules]
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    cuda = sorted({t.get_device() for t in model.parameters() if t.is_cuda})
    try:
        with torch.set_grad_enabled(grad), torch.random.fork_rng(devices=cuda):
            run_example()
    except Exception as e:
        how = amp.captured()
        dtypes = sorted({str(p.dtype) for p in model.parameters() if p.is_floating_point()})
        raise EagerFailureError(
            f"the model itself fails on the example, run eagerly (parameters in "
            f"{', '.join(dtypes) or 'no floating dtype'}, {amp.describe(how)}){user_line(e)}: "
            f"{type(e).__name__}: {_first_line(e)}") from e
    finally:
        for h in handles:
            h.remove()
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
    if no_grad:
        raise RuntimeError(
            f"block {no_grad[0]} returns no gradient although its parameters require grad: the "
            "model calls it with grad off and leaves its gradients to a custom autograd.Function "
            "around the blocks that recomputes them (Reformer's reversible layers), which a "
            "pipeline cannot split. Set requires_grad=False on them if they are frozen")
    return examples


def call_blocks(gm: fx.GraphModule, trace: _Trace) -> None:
    """Replace each traced block call in ``gm`` (a captured graph) by ``run_block`` on an
    ``OpaqueBlock`` attribute named after the block (``opaque_model_layers_0``). The node
    says what ``fxpipe.passes`` cannot see inside: ``meta["random"]`` (in training mode
    it may draw random numbers) and ``meta["writes"]`` (the buffers it may update)."""
    for n in list(gm.graph.nodes):
        if n.op != "call_function" or n.target is not _OPAQUE:
            continue
        params, tensors, sizes, call = n.args
        block = trace.calls[call]
        name = "opaque_" + block.path.replace(".", "_").replace("@", "_call")
        gm.add_submodule(name, block)
        with gm.graph.inserting_before(n):
            attr = gm.graph.get_attr(name)
        attr.meta["module_path"] = ""
        n.target = run_block
        n.args = (attr, params, tensors, sizes)
        n.meta["random"] = block.training  # its module may draw random numbers (dropout)
        if block.training:  # and update its buffers in place (BatchNorm statistics)
            n.meta["writes"] = [p.target for p in params if not isinstance(
                functools.reduce(getattr, p.target.split("."), gm), nn.Parameter)]
    gm.graph.lint()
    gm.recompile()


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0][:300]


_LIBRARIES = (os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(__file__)))


def user_line(e: BaseException) -> str:
    """``, at file.py:12 in forward `code``` for the innermost frame of ``e`` outside torch
    and fxpipe (the model's line that hit it), or ``""``."""
    frames = [f for f in traceback.extract_tb(e.__traceback__)
              if not f.filename.startswith(_LIBRARIES) and "<" not in f.filename]
    if not frames:
        return ""
    f = frames[-1]
    return f", at {os.path.basename(f.filename)}:{f.lineno} in {f.name} `{(f.line or '').strip()}`"
