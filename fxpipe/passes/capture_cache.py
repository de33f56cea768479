"""Captures remembered: a model captured again is not traced again.

``torch.export`` is most of ``fxpipe.compile``'s time on a Hugging Face model (2.2 s of a
3.2 s compile, four architectures profiled), and a process often captures the same
architecture more than once: a second pipe over the same model, a new instance of the
same config (a trainer rebuilt, an evaluation copy, a test suite). The graph depends
only on what tracing reads, so a later capture that reads the same things reuses the
first one's graph, pointed at the new model's own parameters and buffers.

What tracing reads, and ``key`` describes:

- the model's structure: each module's path and class, and every plain attribute of it
  (its config, flags, ``training``), compared by value (a tensor attribute by its
  bytes); each parameter's and buffer's name, shape, dtype, device, ``requires_grad`` and
  which names share one tensor (ties);
- the code that runs: per module class, every function of the class and of its bases
  below ``nn.Module``, and the module-level functions and classes each one names (so a
  patched ``apply_rotary_pos_emb`` or a replaced ``forward`` is a new key);
- the call: the inputs' structure, each tensor's shape, dtype, device and
  ``requires_grad``, the non-tensor inputs' values, and the names, dims, method, blocks,
  ``param_dtype``, autocast regions, grad mode and verbosity of the capture.

A model with a forward or backward hook, an attribute whose value cannot be compared
(an object with neither a ``__dict__`` nor a plain value), a large tensor attribute or
a module it does not own is never cached: ``key`` returns ``None``. The cache is bounded
(``SIZE`` graphs, least recently used dropped) and holds no model tensor: a graph is
kept as its nodes and the names of the attributes it reads. ``FXPIPE_CAPTURE_CACHE=0``
turns it off (``hits`` counts what it served, for a test or a benchmark).

>>> import torch.nn as nn
>>> k1 = key(nn.Linear(4, 4), [torch.empty(2, 4)], None, ["x"], "fx", [[0, 1]], (), None)
>>> k2 = key(nn.Linear(4, 4), [torch.empty(2, 4)], None, ["x"], "fx", [[0, 1]], (), None)
>>> k1 == k2, key(nn.Linear(4, 5), [torch.empty(2, 4)], None, ["x"], "fx", [[0, 1]], (), None) == k1
(True, False)
"""

from __future__ import annotations

import collections
import copy
import enum
import functools
import hashlib
import inspect
import os
import threading
import types
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from fxpipe.passes import fetch_attr
from fxpipe.runtime.stages import amp
from fxpipe.verbose import is_verbose

SIZE = 16                      # graphs kept
TENSOR_BYTES = 1 << 16         # a tensor attribute larger than this is not hashed: no cache
_DEPTH = 8                     # nesting of attribute values followed
_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
          "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs",
          "_forward_hooks_always_called")
_SKIPPED = frozenset(("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set",
                      "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
                      "_load_state_dict_post_hooks", "_is_full_backward_hook") + _HOOKS)
_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device,
          torch.Size, torch.memory_format, torch.layout, enum.Enum)


@dataclass
class _Template:
    graph: fx.Graph           # the captured graph, never run (``rebuild`` copies it)
    model_attrs: list[str]    # get_attr targets that are the model's parameters and buffers
    own_attrs: dict[str, Any]  # the others: constants and higher-order-op bodies, by value
    meta: dict[str, Any]      # gm.meta, but the example inputs


_CACHE: collections.OrderedDict[tuple, _Template] = collections.OrderedDict()
_LOCK = threading.Lock()
hits = 0


class _Uncacheable(Exception):
    pass


def enabled() -> bool:
    return os.environ.get("FXPIPE_CAPTURE_CACHE", "1") != "0"


def key(model: nn.Module, leaves: Sequence[Any], in_spec: Any, names: Sequence[str],
        method: str, dims: Sequence[Collection[int]], blocks: Sequence[str],
        param_dtype: torch.dtype | None) -> tuple | None:
    """What capturing ``model`` on ``leaves`` reads (see the module docstring), hashable;
    ``None``: this capture is not cached."""
    if not enabled() or method == "blocks" or _global_hooks():
        return None
    try:
        paths = {id(m): p for p, m in model.named_modules(remove_duplicate=False)}
        describe = _Describer(paths)
        modules = tuple((path, type(m), describe.module(m)) for path, m in model.named_modules())
        code = tuple(_code(cls) for cls in dict.fromkeys(type(m) for m in model.modules()))
        tensors = _tensors(model)
        call = tuple(describe.value(x, 0) if not isinstance(x, torch.Tensor) else
                     ("input", type(x), tuple(x.shape),
                      x.stride() if x.layout == torch.strided else x.layout, x.dtype, x.device,
                      x.requires_grad)
                     for x in leaves)
    except _Uncacheable:
        return None
    return (modules, code, tensors, call, repr(in_spec), tuple(names), method,
            tuple(tuple(d) for d in dims), tuple(blocks), param_dtype, amp.captured(),
            torch.is_grad_enabled(), torch.is_inference_mode_enabled(), is_verbose(),
            torch.get_default_dtype())


def rebuild(k: tuple | None, model: nn.Module, leaves: list) -> fx.GraphModule | None:
    """The graph captured for ``k`` before, reading ``model``'s own parameters and
    buffers and made for ``leaves``; ``None`` if there is none."""
    global hits
    if k is None:
        return None
    with _LOCK:
        t = _CACHE.get(k)
        if t is None:
            return None
        _CACHE.move_to_end(k)
        hits += 1
    root = {name: fetch_attr(model, name) for name in t.model_attrs}
    root.update(t.own_attrs)
    gm = fx.GraphModule(root, _copy(t.graph), class_name="CapturedModule")
    gm.meta.update(_copied(t.meta), input_leaves=leaves)
    return gm


def store(k: tuple | None, gm: fx.GraphModule, model: nn.Module) -> None:
    """Remember ``gm``, just captured for ``k`` from ``model``."""
    if k is None or gm.meta.get("capture") == "blocks":
        return
    model_attrs, own = [], {}
    for n in gm.graph.nodes:
        if n.op != "get_attr" or n.target in own or n.target in model_attrs:
            continue
        value = fetch_attr(gm, n.target)
        try:
            mine = fetch_attr(model, n.target) is value
        except AttributeError:
            mine = False
        if mine:
            model_attrs.append(n.target)
        else:
            own[n.target] = value
    meta = _copied({k_: v for k_, v in gm.meta.items() if k_ != "input_leaves"})
    with _LOCK:
        _CACHE[k] = _Template(_copy(gm.graph), model_attrs, own, meta)
        while len(_CACHE) > SIZE:
            _CACHE.popitem(last=False)


def clear() -> None:
    with _LOCK:
        _CACHE.clear()


def _copy(graph: fx.Graph) -> fx.Graph:
    """A new graph of the same nodes (names, targets and a shallow copy of each meta)."""
    new = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in graph.nodes:
        env[n] = new.node_copy(n, env.__getitem__)
    return new


def _copied(meta: dict[str, Any]) -> dict[str, Any]:
    """``meta`` with its lists and dicts copied (a pass may change them in place); the
    rest (pytree specs, dtypes, tuples) is immutable."""
    return {k: copy.deepcopy(v) if isinstance(v, (list, dict)) else v for k, v in meta.items()}


def _global_hooks() -> bool:
    from torch.nn.modules import module
    return any(getattr(module, name, None) for name in (
        "_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
        "_global_backward_pre_hooks", "_global_forward_hooks_always_called"))


def _tensors(model: nn.Module) -> tuple:
    first: dict[int, str] = {}
    out = []
    for kind, named in (("p", model.named_parameters(remove_duplicate=False)),
                        ("b", model.named_buffers(remove_duplicate=False))):
        for name, t in named:
            tied = first.setdefault(id(t), name)
            out.append((kind, name, type(t), tuple(t.shape), t.dtype, t.device, t.requires_grad,
                        tied))
    return tuple(out)


def _code(cls: type) -> tuple:
    """The functions ``cls`` runs: its own and its bases' below ``nn.Module``, each with
    the module-level functions and classes it names (looked up now: either may have been
    patched since the last capture)."""
    out = [cls]
    for klass in cls.__mro__:
        if klass in (nn.Module, object):
            break
        for name, attr in vars(klass).items():
            fn = attr.fget if isinstance(attr, property) else getattr(attr, "__func__", attr)
            if not inspect.isfunction(fn):
                continue
            body = inspect.unwrap(fn)   # a decorated forward: the decorator's and its own
            named = tuple((n, g) for f in dict.fromkeys((fn, body)) for n in _names(f.__code__)
                          if (inspect.isfunction(g := f.__globals__.get(n))
                              or inspect.isclass(g) or inspect.isbuiltin(g)))
            out.append((klass, name, fn, body, named))
    return tuple(out)


def _names(code: types.CodeType) -> list[str]:
    """The global names ``code`` and the functions nested in it may read."""
    out = list(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            out += _names(const)
    return out


class _Describer:
    """Plain attribute values as hashable values (``_Uncacheable`` where there is none)."""

    def __init__(self, paths: dict[int, str]):
        self.paths = paths
        self.seen: dict[int, int] = {}   # objects described in this key: cycles, shared configs

    def module(self, m: nn.Module) -> tuple:
        if any(getattr(m, h, None) for h in _HOOKS):
            raise _Uncacheable("a hook")
        return tuple((k, self.value(v, 0)) for k, v in vars(m).items() if k not in _SKIPPED)

    def value(self, x: Any, depth: int) -> Any:
        if isinstance(x, _PLAIN):
            return (type(x), x)
        if depth > _DEPTH:
            raise _Uncacheable("deeply nested")
        if isinstance(x, nn.Module):
            if id(x) not in self.paths:
                raise _Uncacheable("a module the model does not own")
            return ("module", self.paths[id(x)])
        if isinstance(x, torch.Tensor):
            return self._tensor(x)
        if isinstance(x, (tuple, list)):
            return (type(x), tuple(self.value(v, depth + 1) for v in x))
        if isinstance(x, (set, frozenset)):
            return (type(x), frozenset(self.value(v, depth + 1) for v in x))
        if isinstance(x, dict):
            return (type(x), tuple((self.value(k, depth + 1), self.value(v, depth + 1))
                                   for k, v in x.items()))
        if inspect.isfunction(x) and x.__closure__:   # its cells may hold anything
            raise _Uncacheable("a closure")
        if inspect.isfunction(x) or inspect.isclass(x) or inspect.isbuiltin(x) \
                or isinstance(x, (types.ModuleType, torch._ops.OpOverload,
                                  torch._ops.OpOverloadPacket)):
            return x
        if isinstance(x, types.MethodType):
            return ("method", x.__func__, self.value(x.__self__, depth + 1))
        if isinstance(x, functools.partial):
            return ("partial", self.value(x.func, depth + 1), self.value(x.args, depth + 1),
                    self.value(x.keywords, depth + 1))
        if hasattr(x, "__dict__"):
            if id(x) in self.seen:
                return ("seen", self.seen[id(x)])
            self.seen[id(x)] = len(self.seen)
            return (type(x), self.value(vars(x), depth + 1))
        raise _Uncacheable(type(x).__name__)

    def _tensor(self, t: torch.Tensor) -> tuple:
        head = ("tensor", type(t), tuple(t.shape), t.dtype, t.device, t.requires_grad)
        if t.is_meta:
            return head
        if t.numel() * t.element_size() > TENSOR_BYTES or type(t) is not torch.Tensor:
            raise _Uncacheable("a large tensor attribute")
        data = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        return head + (hashlib.sha1(data).hexdigest(),)
