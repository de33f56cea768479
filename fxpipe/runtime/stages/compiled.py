"""Stage code compiled by a backend: ``RunConfig(stage_backend="inductor" | "auto")``.

The runnable code of a stage (``runtime.stages.stage_code.runnable``) keeps its transfers, layer
marks and unfilled nodes as plain Python calls; :func:`compile_layers` replaces each
*layer segment* (a maximal run of one layer's compute nodes between them) by one call of a
:class:`CompiledLayer`, which runs the segment as inductor's generated code: fused
kernels, no per-op Python dispatch, in forward, in the recompute (autograd records one
node per segment; its backward is compiled with it) and in the fused tail.

- **Shared by structure.** A segment's graph is written with canonical names (its inputs
  ``x0, x1, ...``, its nodes ``v0, v1, ...``, its attributes ``c0, c1, ...``), so the
  segments of repeated blocks have the same code; they share one :class:`Artifact`,
  compiled once per *signature* (grad mode, autocast state, each input's shape, strides,
  dtype, device and ``requires_grad``; non-tensor inputs by value, baked in as constants).
  Compile time grows with the number of distinct layer graphs, not with depth.
- **Compiled without dynamo.** ``torch._inductor.compile`` on the segment's GraphModule at
  its first call (forward without grad: an inference graph; with grad: AOTAutograd's
  forward and backward). So the compiled code also runs under a virtual device's
  counting dispatch mode, which ``torch.compile``'s frames refuse. Outputs that are not
  tensors (a size) depend on the signature only: they are learned once on fake tensors
  and returned as constants.
- **What stays eager.** A block captured at block granularity (run as its module: opaque,
  eager by design). A layer that draws random numbers (its masks would not replay in
  the recompute: inductor's RNG is not the eager generator's): ``"inductor"`` refuses it,
  ``"auto"`` leaves it eager. A recompute's unfilled nodes (``runtime.stages.unfilled``) stay
  out of the segments, so the recompute still skips them. A segment inductor cannot
  compile raises :class:`StageCompileError` naming it, or under ``"auto"`` runs eagerly
  from then on (with a warning).
- **Memory on virtual devices.** Inductor's generated code allocates host buffers below
  the dispatcher; the modules it loads allocate through it instead (``torch.empty_strided``),
  so a virtual device counts a compiled segment's buffers and holds its kernels to the
  device rule as it does eager ops'. A fused C++ kernel itself reads raw pointers: the
  rule is checked where buffers are made and extern kernels (``addmm.out``) run.
"""

from __future__ import annotations

import contextlib
import hashlib
import operator
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch.utils._python_dispatch import _disable_current_modes

from fxpipe.passes import fetch_attr
from fxpipe.passes.layer_graph import is_random
from fxpipe.runtime.devices.issue_lock import blocking


class StageCompileError(RuntimeError):
    """A backend could not compile a layer segment of a stage (which, and why)."""


class Artifact:
    """One segment graph (canonical names) and what ``backend`` compiled of it, per
    signature. Segments with the same graph share it (:func:`artifact`)."""

    def __init__(self, gm: fx.GraphModule, backend: str, name: str):
        self.gm = gm
        self.backend = backend
        self.name = name
        self.compiled: dict[tuple, tuple[Callable[..., Any], dict[int, Any]]] = {}
        self.failed: str | None = None    # under "auto": why it runs eagerly
        self.compiles = 0                  # signatures compiled (tests, benchmarks)
        self.compile_s = 0.0               # seconds spent compiling them
        self.lock = threading.Lock()


_artifacts: dict[tuple, Artifact] = {}
_artifacts_lock = threading.Lock()
_compile_lock = threading.Lock()   # inductor compiles one graph at a time
_totals = [0, 0.0]   # signatures compiled in this process, seconds spent
_totals_lock = threading.Lock()   # not _compile_lock: a call reads them while another compiles


def compile_totals() -> tuple[int, float]:
    """(signatures compiled, seconds spent compiling, failed tries included) by every
    artifact of this process so far: a call's ``stage_compiles`` and ``stage_compile_us``
    in ``pipe.stats()`` are what it adds. An artifact is shared by every pipe whose
    segments have its code (repeated blocks, another pipe over the same model): a pipe
    compiles what no earlier one did."""
    with _totals_lock:
        return _totals[0], _totals[1]


def artifacts() -> list[Artifact]:
    """Every artifact made in this process (``bench_issue.py`` counts compiles)."""
    with _artifacts_lock:
        return list(_artifacts.values())


class CompiledLayer:
    """The call a compiled layer segment is in the runnable code: ``(inputs...) ->
    tuple(outputs)`` through its artifact; one per artifact in a stage's code.
    ``layers``: the segments it runs there (named in errors)."""

    __module__ = __name__

    def __init__(self, art: Artifact, stage: str):
        self.artifact = art
        self.stage = stage
        self.layers: list[int] = []
        self.__name__ = self.__qualname__ = f"{art.backend}_{art.name}"

    @property
    def where(self) -> str:
        return (f"layer{'s' if len(self.layers) > 1 else ''} "
                f"{', '.join(map(str, self.layers))} of {self.stage}")

    def __call__(self, *args: Any) -> tuple:
        art = self.artifact
        if art.failed is not None:
            return art.gm(*args)
        sig = _signature(args)
        entry = art.compiled.get(sig)   # compiled: no lock on the hot path
        if entry is None:
            entry = self._compile(sig, args)
            if entry is None:
                return art.gm(*args)
        fn, constants = entry
        with _autocast_off():
            out = fn(*[a for a in args if isinstance(a, torch.Tensor)])
        if not constants:
            return tuple(out)
        it = iter(out)
        return tuple(constants[i] if i in constants else next(it)
                     for i in range(len(constants) + len(out)))

    def _compile(self, sig: tuple, args: tuple) -> tuple[Callable[..., Any], dict] | None:
        art = self.artifact
        # compiling takes seconds: with the issue lock let go (other devices issue
        # meanwhile), taken before the compile locks, given back after them (a thread
        # holding the issue lock never waits for a compile lock)
        with blocking(), art.lock, _compile_lock, _disable_current_modes():
            if sig in art.compiled:
                return art.compiled[sig]
            if art.failed is not None:
                return None
            start = time.perf_counter()
            try:
                entry = _compile_segment(art.gm, args)
            except Exception as e:  # noqa: BLE001 — which segment, and why
                why = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
                if art.backend != "auto":
                    raise StageCompileError(
                        f"stage_backend={art.backend!r}: inductor could not compile {self.where} "
                        f"({why}). Use stage_backend='auto' to run what inductor cannot compile "
                        "eagerly, or stage_backend=None for eager stage code") from e
                art.failed = why
                warnings.warn(f"stage_backend='auto': {self.where} runs eagerly: inductor could "
                              f"not compile it ({why})", stacklevel=2)
                return None
            finally:
                spent = time.perf_counter() - start
                art.compile_s += spent
                with _totals_lock:
                    _totals[1] += spent
            art.compiled[sig] = entry
            art.compiles += 1
            with _totals_lock:
                _totals[0] += 1
            return entry


def _compile_segment(gm: fx.GraphModule, args: tuple) -> tuple[Callable[..., Any], dict]:
    """Inductor's code for ``gm`` at these ``args``: non-tensor inputs baked in, the
    non-tensor outputs (learned on fake tensors) returned by the caller as constants."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        fake = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        probe = gm(*fake)
    constants = {i: v for i, v in enumerate(probe) if not isinstance(v, torch.Tensor)}
    graph = fx.Graph()
    env: dict[fx.Node, Any] = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for n, a in zip(placeholders, args):
        env[n] = graph.placeholder(n.name) if isinstance(a, torch.Tensor) else a
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            continue
        if n.op == "output":
            outs = [env[o] if isinstance(o, fx.Node) else o for o in n.args[0]]
            graph.output(tuple(o for i, o in enumerate(outs) if i not in constants))
            break
        env[n] = graph.node_copy(n, lambda x: env[x])
    specialized = fx.GraphModule(gm, graph)
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    # the backward compiled now too (not at its first run): its module is loaded here
    with torch._functorch.config.patch(force_non_lazy_backward_lowering=True):
        try:
            fn = _compile_cached(specialized, tensors)
        except Exception:  # noqa: BLE001 - a graph the shape environment trips (a
            # BatchNorm's in-place counter: a symbol no input defines): uncached
            fn = torch._inductor.compile(specialized, tensors)
    _allocate_visibly()
    return fn, constants


def _compile_cached(gm: fx.GraphModule, tensors: list[torch.Tensor]) -> Callable[..., Any]:
    """Inductor's code for ``gm``, compiled where its caches can find it: inductor's FX
    graph cache and AOTAutograd's look a graph up through the tracing context's shape
    environment, and without one bypass both ("No shape env"), so every process compiled
    every segment again. The inputs are handed over as that context's fake tensors with
    static shapes (as the segment is compiled per signature): real ones would be
    fakified with a symbol per size, and the code compiled for any shape, slower to build
    and to run. A graph that fails here is compiled again uncached (the caller)."""
    from torch._guards import TracingContext, tracing
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    mode = FakeTensorMode(shape_env=ShapeEnv(), static_shapes=True)
    with tracing(TracingContext(mode)):
        fakes = [mode.from_tensor(t, static_shapes=True) for t in tensors]
        return torch._inductor.compile(gm, fakes)


def _allocate_visibly() -> None:
    """Inductor's generated modules allocate host buffers below the dispatcher
    (``_empty_strided_cpu``); on a virtual device (host memory standing for a GPU's),
    allocate them through it, where the device's counting and strict rule see them. A
    GPU's allocations are the CUDA allocator's, counted as such: untouched."""
    from torch._inductor.codecache import PyCodeCache

    raw = torch._C._dynamo.guards._empty_strided_cpu
    for module in list(PyCodeCache.modules):
        if getattr(module, "empty_strided_cpu", None) is raw:
            module.empty_strided_cpu = _empty_strided_cpu


def _empty_strided_cpu(size: Sequence[int], stride: Sequence[int], dtype: torch.dtype
                       ) -> torch.Tensor:
    return torch.empty_strided(size, stride, dtype=dtype, device="cpu")


# -- building: the runnable graph's layer segments -----------------------------------------

def compile_layers(gm: fx.GraphModule, backend: str, *, keep: Callable[[fx.Node], bool],
                   stage: str) -> None:
    """Replace each layer segment of ``gm`` (consecutive nodes of one ``meta["layer"]``
    that ``keep`` does not hold back: transfers, layer marks, unfilled nodes) by a
    :class:`CompiledLayer` call and one ``getitem`` per value used after it (named as the
    value was). ``backend="inductor"`` refuses a layer that draws random numbers;
    ``"auto"`` leaves it eager."""
    runs: list[list[fx.Node]] = []
    for n in gm.graph.nodes:
        layer = n.meta.get("layer")
        # a block captured at block granularity (``meta["random"]`` says what it may do)
        # runs as its module, eagerly by design: opaque code is not compiled
        if n.op not in ("call_function", "call_method", "call_module") or layer is None \
                or keep(n) or "random" in n.meta:
            runs.append([])
            continue
        if runs and runs[-1] and runs[-1][-1].meta.get("layer") == layer:
            runs[-1].append(n)
        else:
            runs.append([n])
    calls: dict[int, CompiledLayer] = {}   # by artifact: one named call per graph
    for run in (r for r in runs if r):
        if any(is_random(n) for n in run):
            if backend != "auto":
                raise NotImplementedError(
                    f"stage_backend={backend!r}: layer {run[0].meta['layer']} of {stage} draws "
                    "random numbers (dropout): compiled, its masks would not replay in the "
                    "recompute for backward (inductor's RNG is not the eager generator's). Use "
                    "stage_backend='auto' to run such layers eagerly, or disable the dropout")
            continue
        _replace(gm, run, backend, calls, stage)
    _renamed(gm)


def _replace(gm: fx.GraphModule, run: list[fx.Node], backend: str,
             calls: dict[int, CompiledLayer], stage: str) -> None:
    members = set(run)
    inputs: list[fx.Node] = []
    attrs: list[fx.Node] = []
    for n in run:
        for a in n.all_input_nodes:
            if a in members or a in inputs or a in attrs:
                continue
            (attrs if a.op == "get_attr" else inputs).append(a)
    outputs = [n for n in run if any(u not in members for u in n.users)]
    seg, constants = _segment_graph(gm, run, inputs, attrs, outputs)
    art = artifact(seg, backend, constants)
    fn = calls.setdefault(id(art), CompiledLayer(art, stage))
    layer = run[0].meta["layer"]
    fn.layers.append(layer)
    with gm.graph.inserting_before(run[0]):
        call = gm.graph.create_node("call_function", fn, tuple(inputs), name=f"layer_{layer}")
        call.meta = dict(run[0].meta)
        for i, o in enumerate(outputs):
            got = gm.graph.call_function(operator.getitem, (call, i))
            got.meta = dict(o.meta)
            o.replace_all_uses_with(got, delete_user_cb=lambda u: u not in members)
            got.meta["value_name"] = o.name   # the value keeps its name: ``_renamed``
    for n in reversed(run):
        gm.graph.erase_node(n)


def _renamed(gm: fx.GraphModule) -> None:
    """``gm``'s graph copied with each compiled call's outputs named as the values they
    stand for (their old nodes are gone, but a graph never frees a name)."""
    graph = fx.Graph(owning_module=gm)
    graph._codegen = gm.graph._codegen
    env: dict[fx.Node, fx.Node] = {}
    for n in gm.graph.nodes:
        new = graph.create_node(n.op, n.target, fx.map_arg(n.args, env.__getitem__),
                                fx.map_arg(n.kwargs, env.__getitem__),
                                name=n.meta.pop("value_name", n.name), type_expr=n.type)
        new.meta = n.meta
        env[n] = new
    graph.lint()
    gm.graph = graph


def _segment_graph(gm: fx.GraphModule, run: list[fx.Node], inputs: list[fx.Node],
                   attrs: list[fx.Node], outputs: list[fx.Node]
                   ) -> tuple[fx.GraphModule, tuple]:
    """The segment as a GraphModule of its own, every name canonical; and what its
    attributes are (for the sharing key)."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for i, n in enumerate(inputs):
        env[n] = graph.placeholder(f"x{i}")
    root: dict[str, Any] = {}
    for i, n in enumerate(attrs):
        root[f"c{i}"] = fetch_attr(gm, n.target)
        env[n] = graph.get_attr(f"c{i}")
    modules: dict[str, str] = {}
    for i, n in enumerate(run):
        target = n.target
        if n.op == "call_module":
            target = modules.setdefault(n.target, f"m{len(modules)}")
            root[target] = gm.get_submodule(n.target)
        env[n] = graph.create_node(n.op, target, fx.map_arg(n.args, env.__getitem__),
                                   fx.map_arg(n.kwargs, env.__getitem__), name=f"v{i}")
    graph.output(tuple(env[o] for o in outputs))
    seg = fx.GraphModule(root, graph, class_name="Segment")
    return seg, tuple(_fingerprint(root[k]) for k in sorted(root))


def _fingerprint(value: Any) -> Any:
    """What decides whether two segments' attributes are the same: a GraphModule's code,
    a small tensor's values, anything else itself."""
    if isinstance(value, fx.GraphModule):
        return ("graph", value.code)
    if isinstance(value, torch.Tensor):
        if value.numel() <= 64 and value.device.type != "meta":
            return ("tensor", value.dtype, tuple(value.shape), tuple(value.flatten().tolist()))
        return ("tensor", id(value))
    return ("object", id(value))


def artifact(seg: fx.GraphModule, backend: str, constants: tuple) -> Artifact:
    """The artifact of ``seg``'s graph under ``backend``: shared by every segment with the
    same code and attributes."""
    code = seg.code
    key = (backend, code, constants)
    with _artifacts_lock:
        art = _artifacts.get(key)
        if art is None:
            digest = hashlib.sha1(repr(key[1:]).encode()).hexdigest()[:8]
            art = _artifacts[key] = Artifact(seg, backend, digest)
        return art


def describe(gm: fx.GraphModule) -> str:
    """One line for a runnable's header: its compiled segments and their artifacts."""
    layers = [n.target for n in gm.graph.nodes if isinstance(n.target, CompiledLayer)]
    if not layers:
        return "eager"
    shared = len(set(map(id, layers)))
    backend = layers[0].artifact.backend
    return (f"stage_backend={backend}: {len(layers)} layer segment(s) compiled, "
            f"{shared} distinct")


# -- at a call ----------------------------------------------------------------------------

def _signature(args: Sequence[Any]) -> tuple:
    sig: list[Any] = [torch.is_grad_enabled(), _autocast_state()]
    for a in args:
        if isinstance(a, torch.Tensor):
            sig.append((a.shape, a.stride(), a.dtype, a.device, a.requires_grad))
        else:
            try:
                hash(a)
                sig.append(("value", a))
            except TypeError:
                sig.append(("repr", repr(a)))
    return tuple(sig)


def _autocast_state() -> tuple:
    return tuple((torch.is_autocast_enabled(t), torch.get_autocast_dtype(t))
                 for t in ("cpu", "cuda"))


@contextlib.contextmanager
def _autocast_off() -> Iterator[None]:
    """The compiled code holds the casts its trace recorded: autocast must not add more."""
    with contextlib.ExitStack() as regions:
        for t in ("cpu", "cuda"):
            if torch.is_autocast_enabled(t):
                regions.enter_context(torch.autocast(t, enabled=False))
        yield
