"""A TorchDynamo graph (what a ``torch.compile`` backend receives) → fxpipe's captured form.

``torch.compile(model, backend=fxpipe.backend())`` hands the backend a GraphModule whose
placeholders are the model's parameters and buffers (dynamo lifts them, each with the
``Source`` it was read from: ``L['self']._modules['blocks']._modules['0']._parameters['weight']``),
the call's tensors (``L['ids']``) and the symbolic sizes it depends on
(``L['ids'].size()[0]``). :func:`from_dynamo` rewrites it into the form
``fxpipe.passes.capture`` produces (see that module), so the rest of the pipeline —
partition, costs, planning, lowering, runtime — is shared:

- parameter and buffer placeholders become ``get_attr`` of the very same tensors,
  mounted in a module tree rebuilt from their sources (numbered children become an
  ``nn.ModuleList``, so the repeated blocks are found as usual);
- size placeholders become ``x.size(d)`` of the tensor they came from;
- ``meta["module_path"]`` comes from dynamo's ``nn_module_stack``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree

from fxpipe.errors import CaptureError
from fxpipe.passes.capture import propagate_fake_values

_KEY = re.compile(r"\[(?:'([^']*)'|(\d+))\]|\.(\w+)")  # ['a'] | [0] | .a
_SIZE = re.compile(r"^(.*)\.size\(\)\[(\d+)\]$")


def from_dynamo(gm: fx.GraphModule,
                example_inputs: Sequence[Any]) -> tuple[nn.Module, fx.GraphModule, list[int]]:
    """Rewrite a dynamo graph. Returns ``(root, captured, positions)``: the rebuilt module
    tree owning the model's own parameters and buffers, the captured-form graph, and the
    positions in dynamo's flat arguments of the call's tensors (in placeholder order)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(example_inputs):
        raise CaptureError(f"the dynamo graph has {len(placeholders)} inputs but the backend got "
                           f"{len(example_inputs)} example inputs", {})
    sources = [_source_name(n) for n in placeholders]
    kinds = [_kind(src, ex) for src, ex in zip(sources, example_inputs)]
    states = {i: _state_path(sources[i]) for i, k in enumerate(kinds) if k == "state"}
    tensors = [i for i, k in enumerate(kinds) if k == "input"]
    root = _module_tree({states[i]: example_inputs[i] for i in sorted(states)})

    new = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    scalars: dict[fx.Node, Any] = {}  # module attributes dynamo passed as inputs: by value
    names: list[str] = []
    by_source: dict[str, fx.Node] = {}
    for i in tensors:  # the call's tensors first: they are the pipe's inputs
        name = _input_name(sources[i], taken=names)
        names.append(name)
        env[placeholders[i]] = by_source[sources[i]] = new.placeholder(name)
        env[placeholders[i]].meta["module_path"] = ""
    for i, (n, kind, ex) in enumerate(zip(placeholders, kinds, example_inputs)):
        if kind == "input":
            continue
        if kind == "state":
            env[n] = new.get_attr(states[i])
            env[n].meta["module_path"] = states[i].rpartition(".")[0]
        elif kind == "size":
            env[n] = _size_of(sources[i], by_source, new)
        elif isinstance(ex, torch.Tensor):  # a float attribute dynamo wrapped in a tensor
            name = f"_fxpipe_constant_{len(scalars)}"
            setattr(root, name, ex.detach().clone())
            env[n] = new.get_attr(name)
            env[n].meta["module_path"] = ""
            scalars[n] = ex.item()
        else:
            env[n] = ex  # an int/float attribute: a constant of the graph
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            continue
        if n.op == "output":
            flat, out_spec = pytree.tree_flatten(n.args[0])
            new.output(tuple(env[a] if isinstance(a, fx.Node) else a for a in flat))
            continue
        if n.op in ("call_module", "get_attr"):
            raise CaptureError(f"the dynamo graph has a {n.op} node ({n.target}); fxpipe's "
                               "torch.compile backend expects parameters lifted as inputs "
                               "(torch._dynamo.config.inline_inbuilt_nn_modules=True, the "
                               "default)", {})
        if n.op == "call_method" and n.target == "item" and n.args[0] in scalars:
            env[n] = scalars[n.args[0]]
            continue
        env[n] = new.node_copy(n, lambda a: env[a])
        env[n].meta = {"module_path": _module_path(n)}
    new.lint()
    captured = fx.GraphModule(root, new, class_name="CapturedModule")
    example = [example_inputs[i] for i in tensors]
    leaves, in_spec = pytree.tree_flatten((tuple(example), {}))
    captured.meta.update(in_spec=in_spec, out_spec=out_spec, input_leaves=leaves,
                         leaf_names=names, capture="torch.compile", training=root.training,
                         static_dims={name: _static_sizes(placeholders[i])
                                      for name, i in zip(names, tensors)})
    propagate_fake_values(captured, example)
    return root, captured, tensors


def _static_sizes(n: fx.Node) -> dict[int, int]:
    """The dims dynamo specialized (all of them, unless compiled with dynamic shapes)."""
    value = n.meta.get("example_value")
    if not isinstance(value, torch.Tensor):
        return {}
    return {d: int(size) for d, size in enumerate(value.shape) if not isinstance(size, torch.SymInt)}


def _source_name(n: fx.Node) -> str:
    arg = n.meta.get("grapharg")
    source = getattr(arg, "source", None)
    if source is None:
        raise CaptureError(f"dynamo graph input {n.name!r} has no source; fxpipe's backend "
                           "needs torch.compile's own graphs", {})
    name = source.name
    return name() if callable(name) else name


def _kind(source: str, example: Any) -> str:
    """``"state"`` (a parameter or buffer), ``"input"`` (a tensor of the call), ``"size"``
    (a size of one), or ``"attribute"`` (another value read from a module)."""
    if _SIZE.match(source):
        return "size"
    if _state_path(source) is not None and isinstance(example, torch.Tensor):
        return "state"
    module_side = source.startswith(("L['self']", "G[")) or "_modules[" in source
    return "attribute" if module_side or not isinstance(example, torch.Tensor) else "input"


def _keys(path: str) -> list[str]:
    return [a or b or c for a, b, c in _KEY.findall(path)]


def _path(source: str) -> list[str]:
    """Attribute path of a source: ``L['self']._modules['blocks']._modules['0']`` and
    ``L['self'].blocks[0]`` → ``["blocks", "0"]``. Other roots than ``self`` keep their
    name (``G['model'].blocks[0]`` → ``["model", "blocks", "0"]``)."""
    head, _, rest = source.partition("]")
    root = _keys(head + "]")
    prefix = [] if root in (["self"], []) else [re.sub(r"\W", "_", root[0])]
    return prefix + [k for k in _keys(rest) if k != "_modules"]


def _state_path(source: str) -> str | None:
    """FQN of a parameter or buffer source (``None``: the source is something else)."""
    path = _path(source)
    if len(path) < 2 or path[-2] not in ("_parameters", "_buffers"):
        return None
    return ".".join(path[:-2] + path[-1:])


def _module_tree(state: dict[str, torch.Tensor]) -> nn.Module:
    """Modules holding ``state`` (``{fqn: tensor}``, the tensors themselves, tied ones once
    per name); numbered children make an ``nn.ModuleList``."""
    tree: dict = {}
    for fqn, t in state.items():
        *mods, leaf = fqn.split(".")
        node = tree
        for m in mods:
            node = node.setdefault(m, {})
        node[leaf] = t

    def build(node: dict) -> nn.Module:
        children = {k: build(v) for k, v in node.items() if isinstance(v, dict)}
        own = {k: v for k, v in node.items() if not isinstance(v, dict)}
        if children and not own and set(children) == {str(i) for i in range(len(children))}:
            return nn.ModuleList([children[str(i)] for i in range(len(children))])
        mod = nn.Module()
        for k, c in children.items():
            mod.add_module(k, c)
        for k, t in own.items():
            if isinstance(t, nn.Parameter):
                mod.register_parameter(k, t)
            else:
                mod.register_buffer(k, t)
        return mod

    return build(tree)


def _input_name(source: str, taken: list[str]) -> str:
    name = "_".join(_keys(source)) or "input"
    name = re.sub(r"\W", "_", name)
    if name[0].isdigit():
        name = "in_" + name
    base, k = name, 1
    while name in taken:
        name, k = f"{base}_{k}", k + 1
    return name


def _size_of(source: str, by_source: dict[str, fx.Node], graph: fx.Graph) -> fx.Node:
    match = _SIZE.match(source)
    if match is None or match.group(1) not in by_source:
        raise CaptureError(f"fxpipe's torch.compile backend cannot rebuild the graph input "
                           f"{source!r} (only tensors, parameters, buffers and tensor sizes "
                           "are supported); use fxpipe.compile(model, example_inputs=...)", {})
    node = graph.call_method("size", (by_source[match.group(1)], int(match.group(2))))
    node.meta["module_path"] = ""
    return node


def _module_path(n: fx.Node) -> str:
    """Innermost module of dynamo's ``nn_module_stack``: ``L['self'].blocks[0].norm1`` →
    ``blocks.0.norm1``."""
    stack = n.meta.get("nn_module_stack")
    return ".".join(_path(list(stack.values())[-1][0])) if stack else ""
