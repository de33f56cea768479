"""Capture: ``nn.Module`` → one flat fx ``GraphModule``.

Whatever the method, the result has the same form:

- one placeholder per *tensor* leaf of the example ``(args, kwargs)``, named after the
  argument (``input_ids``, ``attention_mask``, ``x_0`` for ``x[0]``); non-tensor leaves
  (flags, ints, ``None``) are constants of the graph and checked at call time;
- parameters and buffers as ``get_attr`` nodes whose targets are their FQNs in the
  model, and whose attributes are the model's own tensors (no copies); tied tensors
  appear once, under the first name ``named_parameters()`` gives them;
- ``node.meta["module_path"]``: the innermost module path the node was made in
  (``""`` for the root), taken from the *values* of ``nn_module_stack``;
  ``node.meta["module_stack"]``: every module call around the node, outermost first, as
  ``(path, call)``: ``call`` counts earlier calls of the same module (``("blocks.0", 1)``
  is the second call of ``blocks.0``: a block object used twice);
- a flat tuple output, one entry per leaf of the model's output. Output values fxpipe
  cannot split or merge (a ``Cache`` object, anything not a tensor, number, string or
  registered pytree) are returned as ``None``; ``gm.meta["dropped_outputs"]`` names them;
- ``gm.meta``: ``in_spec``/``out_spec`` (pytree specs), ``input_leaves`` (the example
  leaves, for the constant check), ``capture`` (the method used), ``training``,
  ``param_dtype`` (the dtype the graph was captured with its floating parameters in;
  ``None``: their own), ``autocast`` (the ``torch.autocast`` regions around the capture,
  ``fxpipe.runtime.stages.amp.captured()``: export records the dtypes autocast gives, so the
  graph runs under these regions only).

Methods: ``"fx"`` (``torch.fx`` symbolic tracing through every submodule; fast, keeps
module structure), ``"export"`` (``torch.export.export(strict=False)``), ``"dynamo"``
(``torch.export.export(strict=True)``, i.e. TorchDynamo), ``"blocks"`` (export of the
model's own forward with each block an opaque call, run as its module:
``fxpipe.passes.blocks``), ``"auto"`` (fx, then export, then dynamo, then blocks).

Export and dynamo keep the dims named by ``dynamic`` symbolic (``None``: every dim) and
specialize the rest: a graph with fewer symbolic sizes is traced much faster (a tiny
Swin: 36 s with every dim symbolic, 0.9 s with the batch dim only, in
``benchmarks/bench_capture.py``), and a call with another size in a specialized dim is
captured again (``fxpipe.api``).
"""

from __future__ import annotations

import contextlib
import inspect
import keyword
import re
import sys
from collections.abc import Collection, Iterator, Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree

from fxpipe.errors import CaptureError
from fxpipe.passes import blocks as opaque
from fxpipe.passes import buffer_dtypes
from fxpipe.passes import fetch_attr
from fxpipe.passes import capture_cache
from fxpipe.passes.capture_dtypes import cast_floating, check_operand_dtypes, parameters_in, rebind
from fxpipe.passes.capture_messages import failure_message, say_what_changed, warn_branches
from fxpipe.runtime.stages import amp
from fxpipe.verbose import is_verbose

METHODS = ("fx", "export", "dynamo", "blocks")
_ROOT = "fxpipe_root"  # attribute name of the model inside the tracing wrapper


def capture(model: nn.Module, args: tuple = (), kwargs: dict | None = None,
            method: str = "auto", *, dynamic: Sequence[Collection[int]] | None = None,
            blocks: Sequence[str] = (), param_dtype: torch.dtype | None = None) -> fx.GraphModule:
    """Capture ``model(*args, **kwargs)`` as a flat GraphModule (see module docstring).

    ``dynamic``: per tensor leaf of ``(args, kwargs)``, the dims export and dynamo keep
    symbolic (``None``: all). ``blocks``: module paths of the repeated blocks, which the
    ``"blocks"`` method calls opaquely (it is skipped without them).

    ``param_dtype`` (mixed precision): capture what the devices compute, the model with
    its floating parameters in ``param_dtype``, its floating buffers in the dtypes the
    model loaded in ``param_dtype`` holds them in (``fxpipe.passes.buffer_dtypes``:
    Hugging Face keeps rotary ``inv_freq`` in fp32, BatchNorm's statistics follow), and
    its floating inputs cast to it. A model's code that reads a dtype
    (``x.to(self.weight.dtype)``, ``torch.finfo(dtype).min``) is traced with the one it
    runs under, and export's dtype asserts hold on the devices. The tensors are stood in
    for by ``param_dtype`` copies while tracing (:func:`parameters_in`); the graph refers
    to the model's own tensors afterwards, as without it. A graph whose matrix products or
    convolutions mix floating dtypes outside autocast is refused, naming the op
    (``MixedDtypeError``): the model fails so eagerly too.

    >>> gm = capture(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), (torch.randn(2, 4),))
    >>> [n.op for n in gm.graph.nodes][:2]
    ['placeholder', 'get_attr']
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"fxpipe.compile expects an nn.Module, got {type(model).__name__}")
    if not isinstance(args, tuple):
        raise TypeError(f"example_inputs must be a tuple of positional arguments, got "
                        f"{type(args).__name__}; write example_inputs=(x,)")
    kwargs = dict(kwargs or {})
    if method not in ("auto",) + METHODS:
        raise ValueError(f"capture={method!r} is not one of 'auto', 'fx', 'export', 'dynamo', "
                         "'blocks'")
    leaves, in_spec = pytree.tree_flatten((args, kwargs))
    leaves = [cast_floating(x, param_dtype) for x in leaves]
    if not any(isinstance(x, torch.Tensor) for x in leaves):
        raise ValueError(
            "fxpipe.compile needs example inputs containing at least one tensor, shaped like "
            "a real batch: fxpipe.compile(model, example_inputs=(x,)) or example_kwargs={...}")
    names = _leaf_names(model, args, kwargs)
    leaves = _unaliased(leaves)
    wrapper = _FlatCall(model, in_spec, leaves, names)
    tensors = tuple(x for x in leaves if isinstance(x, torch.Tensor))

    if method == "blocks" and not blocks:
        raise ValueError("capture='blocks' needs the blocks: pass layers='path.to.blocks'")
    dims = [range(t.dim()) if dynamic is None else dynamic[i] for i, t in enumerate(tensors)]
    low_buffers = buffer_dtypes.mark(model, param_dtype).values()
    key = capture_cache.key(model, leaves, in_spec, names, method, dims, blocks, param_dtype)
    gm = capture_cache.rebuild(key, model, leaves)
    if gm is not None:   # captured before: the same model code, structure and call
        if is_verbose():
            print(f"fxpipe: {type(model).__name__} reuses an earlier capture (the same code, "
                  "structure and call; FXPIPE_CAPTURE_CACHE=0 traces every time)", file=sys.stderr)
        return gm

    tried: dict[str, BaseException] = {}
    for m in (METHODS if method == "auto" else (method,)):
        if m == "blocks" and not blocks:
            continue
        try:
            # blocks runs the example eagerly: real copies; tracing reads no value
            with parameters_in(model, param_dtype, values=(m == "blocks"),
                               buffers=low_buffers) as masters, _grads_hidden(model):
                if m == "fx":
                    gm = _trace_fx(wrapper)
                    out_spec = wrapper.out_spec
                elif m == "blocks":
                    with opaque.opaque_blocks(model, blocks, lambda: wrapper(*tensors)) as trace:
                        gm, out_spec = _trace_export(wrapper, tensors, dims, strict=False)
                    opaque.call_blocks(gm, trace)
                    wrapper.dropped.extend(dict.fromkeys(trace.dropped))
                else:
                    gm, out_spec = _trace_export(wrapper, tensors, dims, strict=(m == "dynamo"))
            check_operand_dtypes(gm)
        except Exception as e:  # noqa: BLE001 — every failure is reported below
            tried[m] = e
            continue
        rebind(gm, masters)
        if m == "blocks":
            warn_branches(model, tried)
        _bind_python(gm)
        gm.meta.update(in_spec=in_spec, out_spec=out_spec, input_leaves=leaves, leaf_names=names,
                       capture=m, training=model.training, dropped_outputs=list(wrapper.dropped),
                       param_dtype=param_dtype, autocast=amp.captured(),
                       static_dims={} if m == "fx" else _static_dims(gm))
        if is_verbose():
            say_what_changed(model, m, tried, wrapper.dropped)
        capture_cache.store(key, gm, model)
        return gm
    raise CaptureError(failure_message(model, tried), tried)


def _bind_python(gm: fx.GraphModule) -> None:
    """Nodes of fxpipe's own opaque ops call their Python implementation instead
    (``fxpipe.losses.linear_cross_entropy``: an autograd.Function whose every op a
    dispatch mode sees, so the cost model and device byte accounting count its chunks)."""
    from fxpipe.losses import linear_cross_entropy

    op = torch.ops.fxpipe.linear_cross_entropy
    nodes = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in (op, op.default)]
    for n in nodes:
        hidden, weight, labels, bias, chunk, ignore_index, reduction, softcap, out_dtype = n.args
        n.target = linear_cross_entropy
        n.args = (hidden, weight, labels, chunk, ignore_index, reduction)
        n.kwargs = {k: v for k, v in dict(bias=bias, softcap=softcap, out_dtype=out_dtype).items()
                    if v is not None}
    if nodes:
        gm.recompile()


def _unaliased(leaves: list) -> list:
    """The example leaves with a fresh copy for each repeat of the same tensor: export
    would merge repeats into one graph input (``f(x, x)``), and the graph would then read
    one argument where the model reads two."""
    seen: set[int] = set()
    out = []
    for x in leaves:
        if isinstance(x, torch.Tensor):
            if id(x) in seen:
                x = x.detach().clone().requires_grad_(x.requires_grad)
            seen.add(id(x))
        out.append(x)
    return out


class _FlatCall(nn.Module):
    """``forward(*tensor_leaves) -> flat output leaves`` around the user's model."""

    def __init__(self, model: nn.Module, in_spec, leaves: list, names: list[str]):
        super().__init__()
        setattr(self, _ROOT, model)
        self.in_spec = in_spec
        self.leaves = leaves
        self.tensor_pos = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        self.names = names
        self.out_spec = None
        self.flatten_output = True
        self.dropped = _Notes()  # output leaves returned as None (see _dropping)
        # A real signature so tracers name placeholders after the model's arguments.
        params = ", ".join(names[i] for i in self.tensor_pos)
        src = f"def forward(self, {params}):\n    return self._call(({params}{',' if params else ''}))\n"
        ns: dict[str, Any] = {}
        exec(src, ns)  # noqa: S102 — generated from sanitized identifiers only
        # Tracers read forward from the class, so each wrapper gets its own subclass.
        self.__class__ = type("FlatCall", (_FlatCall,), {"forward": ns["forward"]})

    def _call(self, tensors: tuple):
        leaves = list(self.leaves)
        for pos, t in zip(self.tensor_pos, tensors):
            leaves[pos] = t
        args, kwargs = pytree.tree_unflatten(leaves, self.in_spec)
        out = self._dropping(getattr(self, _ROOT)(*args, **kwargs))
        if not self.flatten_output:  # export flattens itself (and undoes attribute writes)
            return out
        flat, self.out_spec = pytree.tree_flatten(out)
        return tuple(flat)

    def _dropping(self, out: Any) -> Any:
        """``out`` with each leaf that is no tensor, number, string or ``None`` (a cache
        object, which no capture method can return) replaced by ``None``; names them."""
        flat, spec = pytree.tree_flatten(out)
        bad = [i for i, x in enumerate(flat) if not isinstance(x, _OUTPUT_LEAVES)]
        if not bad:
            return out
        try:
            paths = pytree.tree_flatten_with_path(out)[0]
            names = [pytree.keystr(path).lstrip(".") for path, _ in paths]
        except Exception:  # noqa: BLE001 — a pytree node without key paths
            names = [f"output leaf {i}" for i in range(len(flat))]
        self.dropped[:] = [f"{names[i]} ({type(flat[i]).__name__})" for i in bad]
        return pytree.tree_unflatten([None if i in bad else x for i, x in enumerate(flat)], spec)


class _Notes(list):
    """A list the tracer writes into. Not a plain ``list``: export puts the plain lists on
    the module it traces back as they were, undoing what was written while tracing."""


_OUTPUT_LEAVES = (torch.Tensor, fx.Proxy, int, float, bool, complex, str, type(None), torch.dtype,
                  torch.device, torch.SymInt, torch.SymFloat, torch.SymBool)


class _Tracer(fx.Tracer):
    """Traces through every module, so parameters become ``get_attr`` nodes."""

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return False


def _trace_fx(wrapper: _FlatCall) -> fx.GraphModule:
    # fx does not proxy buffers: an in-place update of one (`self.count.add_(1)`) runs at
    # trace time instead of being recorded. Detect it, undo it, and let another method try.
    model = getattr(wrapper, _ROOT)
    tensors = list(model.named_parameters()) + list(model.named_buffers())
    versions = [t._version for _, t in tensors]
    saved = {name: b.detach().clone() for name, b in model.named_buffers() if not b.is_meta}
    with _autocast_spy() as autocast_regions:
        graph = _Tracer().trace(wrapper)
    if autocast_regions:  # they ran at trace time: the graph would compute without them
        raise RuntimeError(f"fx would drop the torch.autocast region(s) the model enters "
                           f"({', '.join(sorted(set(autocast_regions)))}); export keeps them")
    changed = [name for (name, t), v in zip(tensors, versions) if t._version != v]
    if changed:
        with torch.no_grad():
            for name, b in model.named_buffers():
                if name in saved:
                    b.copy_(saved[name])
        raise RuntimeError(f"fx would drop the in-place update of {', '.join(changed)} "
                           "(it ran at trace time instead of being recorded)")
    tensor_of: dict[fx.Node, torch.Tensor] = {}
    for n in graph.nodes:
        if n.op == "get_attr":
            tensor_of[n] = fetch_attr(wrapper, n.target)
        elif n.op == "call_module":  # cannot happen with _Tracer; keep the graph flat
            raise RuntimeError(f"fx left a module call {n.target!r} in the graph")
    gm = _normalize(wrapper, graph, tensor_of)
    propagate_fake_values(gm, [wrapper.leaves[i] for i in wrapper.tensor_pos])
    return gm


@contextlib.contextmanager
def _grads_hidden(model: nn.Module) -> Iterator[None]:
    """The parameters' ``.grad`` set aside while tracing: a trace reads none, and export
    and dynamo copy each parameter's ``.grad`` into their stand-ins, which fails for an
    fp32 gradient of a bf16 parameter (sharded fp32 masters: ``grad_dtype``), as
    calls under ``no_sync()`` leave it before a new input shape is captured."""
    held = [(p, p.grad) for p in model.parameters() if p.grad is not None]
    for p, _ in held:
        p.grad = None
    try:
        yield
    finally:
        for p, g in held:
            p.grad = g


@contextlib.contextmanager
def _autocast_spy():
    """Record the ``torch.autocast`` regions entered in the block (by device type)."""
    entered: list[str] = []
    cls = torch.amp.autocast_mode.autocast
    enter = cls.__enter__

    def spy(self):
        entered.append(f"torch.autocast({self.device!r}, dtype={self.fast_dtype})")
        return enter(self)
    cls.__enter__ = spy
    try:
        yield entered
    finally:
        cls.__enter__ = enter


def propagate_fake_values(gm: fx.GraphModule, inputs: list[torch.Tensor]) -> None:
    """Fill ``meta["val"]`` (as export does) by running ``gm`` on fake copies of ``inputs``."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    FakeTensorProp(gm, mode).propagate(*[mode.from_tensor(t) for t in inputs])


def module_stack(n: fx.Node) -> list[tuple[str, int]]:
    """``(path, call)`` of every module call around ``n``, outermost first, from its
    ``nn_module_stack`` (keys end in ``@k`` for the k-th repeated call of a module)."""
    out = []
    for key, value in (n.meta.get("nn_module_stack") or {}).items():
        path = _strip_root(value[0])
        if path:
            head, _, call = str(key).rpartition("@")
            out.append((path, int(call) if head and call.isdigit() else 0))
    return out


@contextlib.contextmanager
def _causal_attention_as_eager(positions_given: bool) -> Iterator[None]:
    """Hugging Face attention under export as it runs eagerly: causal SDPA (``is_causal=True``,
    no mask) where a call has no padding mask and its queries are its keys.

    Eagerly, transformers passes no mask to SDPA in that case (flash or memory-efficient
    attention, O(sequence) memory). While exporting it never does
    (``masking_utils._ignore_causal_mask_sdpa``), because an exported graph hard-codes the
    choice and a later call with a KV cache would need a mask. It builds a (batch, 1, L, L)
    boolean mask instead, which every layer then reads and a pipeline carries from stage to
    stage: 16 GiB per sequence at 128K tokens. fxpipe's graphs are captured for one input
    signature, so the eager choice is right for them: a call that has a padding mask
    (``attention_mask=``), a cache offset or a sliding window shorter than the sequence
    still gets the mask.

    Likewise, position ids the model made itself (``arange``: the call passes no
    ``position_ids``; ``positions_given`` is false) hold one sequence per row: transformers
    looks for packed sequences in them only because, traced, it cannot read them.
    """
    mu = sys.modules.get("transformers.masking_utils")
    original = getattr(mu, "_ignore_causal_mask_sdpa", None)
    find_packed = getattr(mu, "find_packed_sequence_indices", None)
    if original is None or find_packed is None:
        yield
        return

    def ignore(padding_mask, q_length, kv_length, q_offset, kv_offset,
               local_attention_size=None):
        if padding_mask is None and isinstance(q_offset, int) and isinstance(kv_offset, int) \
                and q_offset == 0 and kv_offset == 0 and q_length == kv_length \
                and (local_attention_size is None or kv_length < local_attention_size):
            return True
        return original(padding_mask, q_length, kv_length, q_offset, kv_offset,
                        local_attention_size)

    mu._ignore_causal_mask_sdpa = ignore
    if not positions_given:
        mu.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        mu._ignore_causal_mask_sdpa, mu.find_packed_sequence_indices = original, find_packed


def _trace_export(wrapper: _FlatCall, tensors: tuple, dims: Sequence[Collection[int]],
                  strict: bool):
    wrapper.flatten_output = False
    # the dims asked for stay symbolic where the model allows it (export specializes the
    # rest), so one graph serves every microbatch size (and sequence length, if asked); a
    # dim of size 0 or 1 is specialized anyway (export warns that it did: not asked)
    dynamic = tuple({i: torch.export.Dim.AUTO for i in d if i < t.dim() and t.shape[i] > 1}
                    for t, d in zip(tensors, dims))
    try:
        with _partial_graphs_verbose_only(), _stack_traces_verbose_only(), \
                _causal_attention_as_eager(positions_given="position_ids" in wrapper.names):
            ep = torch.export.export(wrapper, tensors, dynamic_shapes=dynamic, strict=strict)
    finally:
        wrapper.flatten_output = True
    sig = ep.graph_signature
    graph = ep.graph_module.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    tensor_of: dict[fx.Node, torch.Tensor] = {}
    from torch.export.graph_signature import InputKind, OutputKind
    for node, spec in zip(placeholders, sig.input_specs):
        if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER):
            tensor_of[node] = fetch_attr(wrapper, spec.target)
        elif spec.kind == InputKind.CONSTANT_TENSOR:
            tensor_of[node] = ep.constants[spec.target]
        elif spec.kind != InputKind.USER_INPUT:
            raise RuntimeError(f"unsupported exported input {spec.kind.name} ({spec.target})")
    for n in graph.nodes:  # get_attr left by export refers to submodules / constants
        if n.op == "get_attr":
            tensor_of[n] = fetch_attr(ep.graph_module, n.target)
    if any(s.kind != OutputKind.USER_OUTPUT for s in sig.output_specs):
        kinds = sorted({s.kind.name for s in sig.output_specs if s.kind != OutputKind.USER_OUTPUT})
        raise RuntimeError(f"export produced non-user outputs {kinds}; fxpipe expects in-place "
                           "buffer updates to stay in the graph")
    return _normalize(wrapper, graph, tensor_of), ep.call_spec.out_spec


@contextlib.contextmanager
def _partial_graphs_verbose_only() -> Iterator[None]:
    """``torch.export`` prints the partial graph of a failed trace to stderr (hundreds of
    lines for a Hugging Face model); ``capture="auto"`` then tries the next method, and
    the ``CaptureError`` says what each hit. Within the block that print goes to stderr
    in verbose mode only (``fxpipe.set_verbose``)."""
    from torch.export import _trace

    def quiet(*args: Any, file: Any = None, **kwargs: Any) -> None:
        if file is sys.stderr and not is_verbose():
            return
        print(*args, file=file, **kwargs)

    before = vars(_trace).get("print")
    _trace.print = quiet   # the module's own name shadows the builtin
    try:
        yield
    finally:
        if before is None:
            del _trace.print
        else:
            _trace.print = before


@contextlib.contextmanager
def _stack_traces_verbose_only() -> Iterator[None]:
    """Tracing records each node's Python stack (``node.meta["stack_trace"]``), which
    fxpipe reads nowhere: extracting and symbolizing it per node is about a tenth of
    export's time (measured: 14 % less CPU capturing six Hugging Face models). Within the
    block it is recorded in verbose mode only (``fxpipe.set_verbose``), where someone may
    read the graphs' nodes."""
    config = torch.fx.config
    if not hasattr(config, "do_not_emit_stack_traces"):   # torch 2.11 has no such switch
        yield
        return
    before = config.do_not_emit_stack_traces
    config.do_not_emit_stack_traces = before or not is_verbose()
    try:
        yield
    finally:
        config.do_not_emit_stack_traces = before


def _static_dims(gm: fx.GraphModule) -> dict[str, dict[int, int]]:
    """Per input placeholder, the dims the graph is specific to: ``{name: {dim: size}}``.
    fx graphs keep shapes symbolic; export specializes what the model needs (e.g. the
    channels of a conv input) and keeps the rest dynamic."""
    from torch.fx.experimental.symbolic_shapes import is_concrete_int
    out = {}
    for n in gm.graph.nodes:
        if n.op != "placeholder":
            continue
        val = n.meta.get("val")
        if isinstance(val, torch.Tensor):
            out[n.name] = {i: int(s) for i, s in enumerate(val.shape) if is_concrete_int(s)}
    return out


def _strip_root(path: str) -> str:
    # export names paths with the FQN ("fxpipe_root.layers.0"); dynamo may give
    # "L['self'].fxpipe_root.layers[0]" — normalize both to "layers.0".
    path = re.sub(r"^L\['self'\]\.?", "", path)
    path = re.sub(r"\[(\d+)\]", r".\1", path).replace("['", ".").replace("']", "")
    if path == _ROOT:
        return ""
    return path[len(_ROOT) + 1:] if path.startswith(_ROOT + ".") else path


def _normalize(wrapper: _FlatCall, graph: fx.Graph,
               tensor_of: dict[fx.Node, torch.Tensor]) -> fx.GraphModule:
    """Rebuild ``graph`` in the common form (see module docstring)."""
    model = getattr(wrapper, _ROOT)
    canonical: dict[int, str] = {}
    for fqn, t in list(model.named_parameters()) + list(model.named_buffers()):
        canonical.setdefault(id(t), fqn)
    root: dict[str, Any] = {}
    new = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    attr_nodes: dict[str, fx.Node] = {}
    names = iter(inspect.signature(wrapper.forward).parameters)
    for n in graph.nodes:
        if n in tensor_of:
            t = tensor_of[n]
            fqn = canonical.get(id(t))
            if fqn is None:  # a constant tensor, or the body of a higher-order op: by value
                kind = "submod" if isinstance(t, nn.Module) else "constant"
                fqn = f"_fxpipe_{kind}_{len([k for k in root if k.startswith('_fxpipe_' + kind)])}"
            if fqn not in attr_nodes:
                root[fqn] = t
                attr_nodes[fqn] = new.create_node("get_attr", fqn, name=fqn.replace(".", "_"))
                attr_nodes[fqn].meta["module_path"] = fqn.rpartition(".")[0]
            env[n] = attr_nodes[fqn]
        elif n.op == "placeholder":
            env[n] = new.placeholder(next(names))
            env[n].meta["module_path"] = ""
            if "val" in n.meta:  # export's sizes: ints where it specialized (static_dims)
                env[n].meta["val"] = n.meta["val"]
        else:
            env[n] = new.node_copy(n, lambda a: env[a])
            stack = module_stack(n)
            env[n].meta = {"module_path": stack[-1][0] if stack else "", "module_stack": stack}
            if "val" in n.meta:
                env[n].meta["val"] = n.meta["val"]
    new.lint()
    return fx.GraphModule(root, new, class_name="CapturedModule")


def _leaf_names(model: nn.Module, args: tuple, kwargs: dict) -> list[str]:
    """A valid, unique Python identifier per leaf of ``(args, kwargs)``, from argument names."""
    try:
        bound = inspect.signature(model.forward).bind_partial(*args)
        arg_names = list(bound.arguments)
        sig = inspect.signature(model.forward)
        var = [p.name for p in sig.parameters.values() if p.kind is p.VAR_POSITIONAL]
    except (TypeError, ValueError):
        arg_names, var = [], []
    named = [arg_names[i] if i < len(arg_names) and arg_names[i] not in var else f"arg{i}"
             for i in range(len(args))]
    seen: set[str] = set()
    out = []
    for path, _leaf in pytree.tree_flatten_with_path((args, kwargs))[0]:
        keys = [getattr(k, "idx", getattr(k, "key", getattr(k, "name", None))) for k in path]
        head = named[keys[1]] if keys[0] == 0 else str(keys[1])
        name = "_".join([head] + [str(k) for k in keys[2:]])
        name = re.sub(r"\W", "_", name) or "input"
        if name[0].isdigit() or keyword.iskeyword(name) or name == "self":
            name = "in_" + name
        base, k = name, 1
        while name in seen:
            name, k = f"{base}_{k}", k + 1
        seen.add(name)
        out.append(name)
    return out
