"""Run a lowered stage on a device: the printed program, as generated code.

The stage's ``torch.ops.fxpipe.*`` nodes mark where data moves; the executor's Program
actions move it (on the device's copy streams). A stage runs as its *runnable* code
(:func:`runnable`, printed by ``pipe.code(..., runnable=True)``): the stage graph with
each transfer node calling a plain function that serves it from what those actions left
on the device, so no dispatch mode sits under the stage's other ops:

=================  ===========================================================
``prefetch``        ``resident``: the parameters the ``Prefetch`` action made resident
``upload``          ``uploaded``: the input the ``Upload`` action copied (on device)
``offload``         ``offloaded``: the value itself; the ``Offload`` action copies it
``writeback``       buffer updates, kept for the host in forward, dropped in recompute
``release``         nothing: the ``Release`` action frees the parameters
``rng``             seeds the layer from (call seed, layer, microbatch)
=================  ===========================================================

Two more things are in the runnable code: ``layer(i)`` where layer ``i``'s nodes start
(the timer's sampled calls charge each layer its time there: wall time on a CPU,
events on a GPU), and, in the recompute for backward, each node of the stage's
``unfilled`` nodes (values backward does not read) called through ``unfilled``: under
``unfilled.Unfilled`` autograd records it, its matmuls and adds do not run.

Under ``RunConfig(stage_backend="inductor" | "auto")`` every other run of one layer's
nodes is one call of its compiled code (``runtime.stages.compiled.compile_layers``).

Not to be confused with: ``runtime.issue.executor``, which runs a call's whole Program (every
action, transfers included, on the devices' streams); ``runtime.issue.compute``, the handlers
of its compute actions, which call :func:`run_stage` here on the values the transfers
left; ``runtime.stages.compiled``, which compiles a layer's nodes for a stage backend.
"""

from __future__ import annotations

import copy
import operator
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.fx as fx

from fxpipe import ops  # noqa: F401 — registers torch.ops.fxpipe.*, which the stage code calls
from fxpipe import sequence_kv   # the chunk a run of a chunked call is (and its op)
from fxpipe.passes.stage import Executable, Stage, comment_at_top
from fxpipe.runtime.stages import rng
from fxpipe.runtime.stages.compiled import compile_layers, describe
from fxpipe.runtime.host.params import is_scratch
from fxpipe.runtime.host.scratch import ScratchUse
from fxpipe.runtime.stages.unfilled import Unfilled
from fxpipe.runtime.stages.timer import LayerTimer

_op = torch.ops.fxpipe
_CHUNK_ATTENTION = _op.chunk_attention.default


class _Serve:
    """What the transfer nodes of one stage run return, and its layer times."""

    __slots__ = ("stage", "resident", "scratch", "rows", "cache_bytes", "call_seed",
                 "microbatch", "torch_device", "keep_writebacks", "writebacks", "timed",
                 "_unfilled", "layer_seconds", "_layer", "_since", "_events")

    def __init__(self, stage: Stage, resident: Mapping[str, torch.Tensor], *,
                 call_seed: int | None, microbatch: int, device: torch.device,
                 keep_writebacks: bool, timed: bool, scratch: ScratchUse | None = None):
        self.stage = stage
        self.resident = resident
        self.scratch = scratch
        self.rows = scratch.rows_of(microbatch) if scratch is not None else None
        self.cache_bytes = 0    # scratch bytes written back to the host
        self.call_seed = call_seed
        self.microbatch = microbatch
        self.torch_device = device
        self.keep_writebacks = keep_writebacks
        self.writebacks: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.timed = timed
        self._unfilled: Unfilled | None = None
        self.layer_seconds: dict[int, float] = {}  # per layer, when ``timed``
        self._layer: int | None = None
        self._since = 0.0
        self._events: list[tuple[int | None, Any]] = []  # CUDA: (layer ending here, event)

    @property
    def unfilled(self) -> Unfilled:
        """The mode a recompute's unfilled nodes run in (made at the run's first)."""
        if self._unfilled is None:
            self._unfilled = Unfilled()
        return self._unfilled

    def own_rows(self, t: torch.Tensor) -> torch.Tensor:
        """The microbatch's rows of a scratch buffer (all of it without a row split)."""
        return t if self.rows is None else t.narrow(0, self.rows[0], self.rows[1] - self.rows[0])

    def enter(self, layer: int | None) -> None:
        """Charge the time since the last layer change to that layer. On CPU, work is
        synchronous and wall time is the layer's time; on CUDA, events recorded on the
        stream at each change are read after the call."""
        if layer == self._layer:
            return
        if self.torch_device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._events.append((self._layer, event))
        else:
            now = time.perf_counter()
            if self._layer is not None:
                self.layer_seconds[self._layer] = (self.layer_seconds.get(self._layer, 0.0)
                                                   + now - self._since)
            self._since = now
        self._layer = layer

    def record_times(self, timer: LayerTimer, kind: str) -> None:
        """Record each layer's time as ``kind`` (CUDA: once the call has ended)."""
        self.enter(None)
        for layer, s in self.layer_seconds.items():
            timer.record(layer, kind, s * 1e3)
        if self._events:
            events = self._events

            def read() -> None:
                ms: dict[int, float] = {}
                for (_, start), (layer, end) in zip(events, events[1:]):
                    if layer is not None:
                        ms[layer] = ms.get(layer, 0.0) + start.elapsed_time(end)
                for layer, t in ms.items():
                    timer.record(layer, kind, t)
            timer.later(read)


class _Serving(threading.local):
    serve: _Serve | None = None


_serving = _Serving()


# -- what the runnable code calls ------------------------------------------------------

def resident(stage: int) -> list[torch.Tensor]:
    """``prefetch``: the stage's parameters and buffers as the ``Prefetch`` action made
    them resident on the device; of a scratch buffer (a KV cache), the microbatch's rows
    (``runtime.host.scratch``)."""
    serve = _serving.serve
    out = [serve.resident[fqn] for fqn in serve.stage.params]
    if serve.rows is not None:
        for i in _scratch_positions(serve.stage):
            out[i] = serve.own_rows(out[i])
    return out


def _scratch_positions(stage: Stage) -> tuple[int, ...]:
    """Where the stage's scratch buffers are in ``stage.params``."""
    found = _scratch_at.get(stage.gm)
    if found is None:
        found = _scratch_at[stage.gm] = tuple(
            i for i, fqn in enumerate(stage.params)
            if is_scratch(operator.attrgetter(fqn)(stage.gm)))
    return found


_scratch_at: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # by the stage's gm


def uploaded(x: Any, device: int) -> Any:
    """``upload``: the value, already on the device (the ``Upload`` action copied it)."""
    return x


def offloaded(x: Any) -> Any:
    """``offload``: the value itself; the ``Offload`` action copies it to the host."""
    return x


def released(stage: int) -> None:
    """``release``: nothing; the ``Release`` action frees the parameters."""


def written_back(host: torch.Tensor, value: torch.Tensor) -> None:
    """``writeback``: a buffer update, kept for the host in forward (dropped in recompute).
    A scratch buffer's (a KV cache: ``params.is_scratch``): copied to the host now, only
    the microbatch's rows and the positions the call wrote (``runtime.host.scratch``); nothing
    when the buffer is resident on the device (that copy is the cache)."""
    serve = _serving.serve
    if not serve.keep_writebacks:
        return
    if not is_scratch(host):
        serve.writebacks.append((host, value.detach().clone()))
        return
    use = serve.scratch
    with torch.no_grad():
        held = use.resident.held(host) if use is not None and use.resident is not None else None
        if held is not None:
            cache = serve.own_rows(held)
            if cache.data_ptr() != value.data_ptr():   # a functional update: into the cache
                cache.copy_(value)
            return
        dest = serve.own_rows(host)
        dim = use.dim if use is not None else 0
        start, stop = use.window(host.shape[dim]) if use is not None else (0, host.shape[0])
        part = value.narrow(dim, start, stop - start)
        dest.narrow(dim, start, stop - start).copy_(part, non_blocking=True)  # the call's end waits
        serve.cache_bytes += part.numel() * part.element_size()


def seeded(layer: int) -> None:
    """``rng``: seed the device's generator from (call seed, layer, microbatch)."""
    serve = _serving.serve
    if serve.call_seed is not None:
        rng.seed_layer(serve.torch_device, rng.layer_seed(serve.call_seed, layer,
                                                          serve.microbatch))


def layer(index: int) -> None:
    """Layer ``index``'s nodes start here (timed calls charge each layer its time)."""
    serve = _serving.serve
    if serve.timed:
        serve.enter(index)


def unfilled(fn: Any) -> Any:
    """``fn`` recorded for autograd with its matmuls and adds not run
    (``unfilled.Unfilled``): what a recompute calls for an unfilled node."""
    wrapped = _unfilled.get(fn)
    if wrapped is None:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            with _serving.serve.unfilled:
                return fn(*args, **kwargs)
        name = getattr(fn, "__name__", str(fn))
        wrapped.__name__ = wrapped.__qualname__ = f"unfilled_{name}"
        _unfilled[fn] = wrapped
    return wrapped


_unfilled: dict[Any, Any] = {}


_SERVED = {_op.prefetch.default: resident, _op.upload.default: uploaded,
           _op.offload.default: offloaded, _op.release.default: released,
           _op.writeback.default: written_back, _op.rng.default: seeded}
_runnables: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_NO_CODE: dict = {}   # (a stage none was built for)
_build_lock = threading.Lock()


def runnable(stage: Stage, recompute: bool = False, device: torch.device | None = None,
             backend: str | None = None) -> fx.GraphModule:
    """The code a stage run executes (``recompute``: the recompute for backward, its
    ``unfilled`` nodes unfilled): ``stage.gm``'s graph with each transfer node calling
    its server (module docstring; ``prefetch`` drops its host-parameter arguments, which
    then are not read), and a ``layer(i)`` call where layer ``i``'s nodes start. On a
    ``device`` other than the host, the graph's host device constants (captured on the
    host: ``arange(..., device=cpu)``, ``_assert_tensor_metadata(..., device=cpu)``,
    ``.to(device=cpu)``) name ``device``. With a ``backend`` (``RunConfig.stage_backend``:
    ``"inductor"``, ``"auto"``), each layer segment is one compiled call
    (``runtime.stages.compiled``). Built once per stage, device and backend."""
    on = device if device is not None and device.type != "cpu" else None
    key = (recompute and bool(stage.unfilled), on, None if backend == "eager" else backend)
    # built: no lock on the hot path (``.data``: the weak dictionary's own dict, read
    # without its Python ``get``: this runs per action)
    code = _runnables.data.get(weakref.ref(stage.gm), _NO_CODE).get(key)
    if code is not None:
        return code
    with _build_lock:
        built = _runnables.setdefault(stage.gm, {})
        if key not in built:
            built[key] = _build(stage, *key)
        return built[key]


def _on_device(gm: fx.GraphModule, device: torch.device) -> None:
    """In ``gm``'s graph and the GraphModules it calls (export's ``wrap_with_autocast``
    and ``wrap_with_set_grad_enabled`` bodies: copies, the stage's own stay as they
    are), the host's device constants become ``device``, and an autocast region's
    device type ``device.type``."""
    def move(a: Any) -> Any:
        return device if isinstance(a, torch.device) and a.type == "cpu" else a

    for n in gm.graph.nodes:
        if n.op in ("call_function", "call_method"):
            n.args = fx.node.map_aggregate(n.args, move)
            n.kwargs = fx.node.map_aggregate(n.kwargs, move)
            if n.target is torch.ops.higher_order.wrap_with_autocast and n.args[0] == "cpu":
                n.args = (device.type, *n.args[1:])     # the region's autocast device
        elif n.op == "get_attr":
            parent, _, name = n.target.rpartition(".")
            owner = gm.get_submodule(parent)
            sub = getattr(owner, name)
            if isinstance(sub, fx.GraphModule):
                body = fx.GraphModule(sub, copy.deepcopy(sub.graph), class_name=type(sub).__name__)
                _on_device(body, device)
                setattr(owner, name, body)
    gm.recompile()


def runnable_code(exe: Executable, devices: Sequence[Any] = (), backend: str | None = None
                  ) -> str:
    """The runnable code of every GraphModule ``exe`` runs (``pipe.code(...,
    runnable=True)``), and the recompute of each with unfilled nodes; given the pipe's
    ``devices``, each as its device runs it (a GPU's names the GPU); under a ``backend``,
    with its compiled layer calls."""
    return "\n\n".join(gm.code.strip("\n") for gm in runnables(exe, devices, backend)) + "\n"


def runnables(exe: Executable, devices: Sequence[Any] = (), backend: str | None = None
              ) -> list[fx.GraphModule]:
    """The runnable code of every GraphModule ``exe`` runs, built now (a call builds them
    before its first action: what a backend refuses is refused before anything runs)."""
    def on(st: Stage) -> torch.device | None:
        return getattr(devices[st.device], "device", None) if devices else None
    return [runnable(st, recompute, on(st), backend) for st in exe.graph_modules()
            for recompute in ((False, True) if st.unfilled else (False,))]


def _build(stage: Stage, recompute: bool, device: torch.device | None,
           backend: str | None) -> fx.GraphModule:
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    skip = set(stage.unfilled) if recompute else set()
    arg = env.__getitem__
    current: int | None = None
    for n in stage.gm.graph.nodes:
        at = n.meta.get("layer")
        if n.op in ("call_function", "call_method", "call_module") and n.target not in _SERVED \
                and at is not None and at != current:
            graph.create_node("call_function", layer, (at,), name=f"layer_{at}_starts")
            current = at
        if n.target in _SERVED:
            args = {_op.prefetch.default: n.args[1:2],
                    _op.release.default: n.args[1:]}.get(n.target, n.args)
            new = graph.create_node("call_function", _SERVED[n.target], fx.map_arg(args, arg),
                                    name=n.name)
        elif n.name in skip:   # call_function nodes (``passes.recompute.unfilled_nodes``)
            new = graph.create_node("call_function", unfilled(n.target), fx.map_arg(n.args, arg),
                                    fx.map_arg(n.kwargs, arg), name=n.name)
        else:
            new = graph.node_copy(n, arg)
        new.meta = dict(n.meta)
        env[n] = new
    for n in reversed(list(graph.nodes)):   # host parameters no transfer reads any more
        if n.op == "get_attr" and not n.users:
            graph.erase_node(n)
    gm = fx.GraphModule(stage.gm, graph, class_name=type(stage.gm).__name__)
    gm.meta.update(stage.gm.meta)
    if device is not None:
        _on_device(gm, device)
    how = ""
    if backend is not None:
        served = {*_SERVED.values(), layer}
        prefetched = {n for n in gm.graph.nodes if n.target is resident}

        # transfers, layer marks, unfilled nodes, parameters; and a chunked call's
        # attention, which reads and writes its keys from Python (``fxpipe.sequence_kv``)
        def keep(n: fx.Node) -> bool:
            return n.target in served or n.name in skip or n.target is _CHUNK_ATTENTION or (
                n.target is operator.getitem and n.args[0] in prefetched)
        compile_layers(gm, backend, keep=keep, stage=f"stage {stage.index}")
        how = f" [{describe(gm)}]"
    comment_at_top(gm.graph, f"runnable{' recompute, unfilled' if recompute else ''}{how}: "
                             f"{stage.header}")
    gm.recompile()
    return gm


def run_stage(stage: Stage, inputs: list, resident: Mapping[str, torch.Tensor], *,
              call_seed: int | None, microbatch: int, device: torch.device,
              keep_writebacks: bool, timer: LayerTimer | None = None, kind: str = "fwd",
              stats: Any = None, backend: str | None = None, scratch: ScratchUse | None = None
              ) -> tuple[tuple, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Run ``stage``'s runnable code on one microbatch; returns (outputs, buffer
    writebacks). With a ``timer``, each layer's time is recorded as ``kind``. A
    ``"recompute"`` records the stage's ``unfilled`` nodes for autograd without computing them
    (``runtime.stages.unfilled``). ``stats`` (``executor.Stats``) counts the runs. ``backend``:
    ``RunConfig.stage_backend``; ``scratch``: how the call uses its scratch buffers
    (``runtime.host.scratch``)."""
    code = runnable(stage, recompute=kind == "recompute", device=device, backend=backend)
    serve = _Serve(stage, resident, call_seed=call_seed, microbatch=microbatch, device=device,
                   keep_writebacks=keep_writebacks, timed=timer is not None, scratch=scratch)
    saved, _serving.serve = _serving.serve, serve
    chunk = sequence_kv.set_chunk(microbatch)   # a chunked call's chunk
    try:   # ``forward`` itself: the module call around it costs four Python calls
        if stage.random and call_seed is not None:
            with rng.isolated(device):
                out = code.forward(*inputs)
        else:
            out = code.forward(*inputs)
    finally:
        _serving.serve = saved
        sequence_kv.set_chunk(chunk)
    if timer is not None:
        serve.record_times(timer, kind)
    if stats is not None:
        stats.add("generated_runs")
        if serve.cache_bytes:
            stats.add("d2h_bytes_cache", serve.cache_bytes)
    return tuple(out), serve.writebacks
