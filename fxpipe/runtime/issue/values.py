"""One call's record (``Call``: what it needs and its results, ``Stats``: its counters),
and where its values live while it runs: the host's per-microbatch values and
gradient parts (``_OnHost``, one lock), and per device what its actions made, received
and hold (``_OnDevice``: only that device's actions touch it; its lock orders its
streams). Values are keyed by the compute that made or received them, ``(stage,
microbatch, name)``, so two actions never write the same slot.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree

from fxpipe.passes.layer_graph import LayerGraph
from fxpipe.passes.stage import Executable
from fxpipe.runtime.stages.amp import AutocastState
from fxpipe.runtime.devices.device import Device
from fxpipe.runtime.host.grad_accum import GradAccumulator
from fxpipe.runtime.host.param_store import ParamStore
from fxpipe.runtime.host.scratch import ScratchUse
from fxpipe.runtime.stages.timer import LayerTimer


@dataclass
class Call:
    """One call of an Executable: what it needs, and (after ``Execution.run``) its results.

    ``phase``: which of the Program's actions this call runs (``Program.phase``): all of
    them, or for a ``"train"`` Executable its ``"forward"`` (``pipe(x)``) or
    ``"backward"`` (``.backward()``) half. ``commit``: what the ``Commit`` action does
    (the caller's: merge results, write gradients and buffers, all or nothing).
    """

    exe: Executable
    layers: LayerGraph
    store: ParamStore
    devices: list[Device]
    inputs: list[dict[str, Any]]             # per microbatch: value name -> host value
    phase: str = "all"
    call_seed: int | None = None
    labels: list[Any] | None = None          # fused: per microbatch label
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None
    loss_weights: Any = None                 # fused: runtime.issue.loss_weights.LossWeights
    out_grads: list[dict[str, torch.Tensor]] | None = None   # train backward: output grads
    timer: LayerTimer | None = None
    optimizer: Any = None                    # fxpipe.optim's part of the call (host lane)
    dp: Any = None                           # runtime.issue.distributed.DataParallel (collectives)
    autocast: AutocastState = ()             # the caller's autocast regions (runtime.stages.amp)
    differentiable: frozenset[str] | None = None  # values that may have a gradient (None: all)
    commit: Callable[[], None] | None = None
    record: list[tuple[int, str]] | None = None   # executed (lane, action) pairs, if tracing
    stage_backend: str | None = None         # RunConfig.stage_backend (runtime.stages.compiled)
    scratch: ScratchUse | None = None        # how it uses its scratch buffers (runtime.host.scratch)
    graphs: Any = None                       # "cudagraphs": the pipe's StageGraphs (runtime.stages.graphs)
    # results
    host: list[dict[str, Any]] = field(default_factory=list)
    grads: list[dict[str, torch.Tensor]] = field(default_factory=list)
    losses: dict[int, torch.Tensor] = field(default_factory=dict)
    writebacks: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    accumulator: GradAccumulator | None = None
    stats: Stats | None = None
    snapshot: dict[str, torch.Tensor] | None = None   # the buffers, as the Refresh saved them
    committed: bool = False                           # the Commit has written its results


STATS = ("actions", "host_waits", "h2d_bytes_params", "h2d_bytes_activations",
         "h2d_bytes_grads", "d2h_bytes_activations", "d2h_bytes_grads", "d2h_bytes_cache", "generated_runs",
         "host_stalls", "host_pinned_bytes", "issue_waits", "allocator_flushes",
         "host_issue_us", "issue_lock_wait_us", "issue_lock_waits", "graph_captures",
         "graph_replays", "graph_fallbacks", "stage_compiles", "stage_compile_us",
         "collectives", "host_collective_bytes")


class Stats:
    """Counters of one call (``pipe.stats()``): actions executed; host waits for device
    work (a host action waiting for the events it reads, the end of the call); bytes
    moved by kind and direction; stage runs (``generated_runs``: each stage's runnable
    code, ``runtime.stages.stage_code``); host time spent issuing, in microseconds
    (``host_issue_us``, and per action kind ``host_issue_us.<Kind>``) and waiting for
    the issue lock (``issue_lock_wait_us``, summed over the devices' issue threads, 0
    where devices do not run their work at issue; ``issue_lock_waits``, how many times
    they waited); with data parallel, the collectives it posts (``collectives``, on the
    host and the devices) and the bytes its host-lane ones take in
    (``host_collective_bytes``); what the stage
    backend compiled (``stage_compiles``, ``stage_compile_us``). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(STATS, 0)

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    def issued(self, seconds: dict[str, float],
               lock: tuple[float, int] | None = None) -> None:
        """Host time issuing actions, in seconds by action kind (an issue thread's sums),
        and its waits for the issue lock (seconds, times: ``issue_lock.waited()``)."""
        with self._lock:
            if lock is not None:
                self._counts["issue_lock_wait_us"] += round(lock[0] * 1e6)
                self._counts["issue_lock_waits"] += lock[1]
            for kind, s in seconds.items():
                us = round(s * 1e6)
                self._counts["host_issue_us"] += us
                key = f"host_issue_us.{kind}"
                self._counts[key] = self._counts.get(key, 0) + us

    def as_dict(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


class _OnHost:
    """The call's host side: per microbatch, values (inputs and what ``Offload`` brought)
    and gradient parts (what ``Offload`` brought, the user's output gradients), kept as
    they came: the host does not add parts a copy may still be writing."""

    def __init__(self, call: Call):
        self.lock = threading.Lock()
        self.values = call.host
        self.grads = call.grads

    def value(self, m: int, name: str) -> Any:
        with self.lock:
            return self.values[m][name]

    def put(self, m: int, name: str, value: Any) -> None:
        with self.lock:
            self.values[m][name] = value

    def add_grad(self, m: int, name: str, g: torch.Tensor) -> None:
        with self.lock:
            self.grads[m].setdefault(name, []).append(g)

    def take_grads(self, m: int, name: str) -> list[torch.Tensor]:
        with self.lock:
            return self.grads[m].pop(name, [])


class _OnDevice:
    """What one device holds for a call. Keys are ``(stage, microbatch, name)`` of the
    compute that made or received the tensor (see the module docstring)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.params: dict[int, dict[str, torch.Tensor]] = {}   # stage -> resident tensors
        self.uploaded: dict[tuple[int, int, str], Any] = {}    # Upload copies for a compute
        self.made: dict[tuple[int, int, str], Any] = {}        # values a compute made
        self.parts: dict[tuple[int, int, str], torch.Tensor] = {}  # input grads a backward made
        self.host_grads: dict[tuple[int, int, str], list[torch.Tensor]] = {}  # UploadGrad copies
        self.consumed: dict[tuple[int, int], list[torch.Tensor]] = {}  # grads a compute took
        self.checkpoints: dict[tuple[int, int], _Checkpoint] = {}
        # stage -> [(bucket, this rank's shard)] a DeviceReduceScatter left for its download
        self.reduced: dict[int, list[tuple[Any, torch.Tensor]]] = {}

    def tensors(self) -> Iterator[Any]:
        """Everything still held (for cleanup after a failure)."""
        for table in (self.uploaded, self.made, self.parts):
            yield from pytree.tree_leaves(list(table.values()))
        for parts in self.host_grads.values():
            yield from parts
        for taken in self.consumed.values():
            yield from taken
        for ck in self.checkpoints.values():
            yield from pytree.tree_leaves((ck.saved, ck.grads))
        for reduced in self.reduced.values():
            yield from (shard for _, shard in reduced)


@dataclass
class _Checkpoint:
    """``recompute_grain="layer"``: each layer's inputs kept by ``Checkpoint``, and the
    gradients flowing back through the per-layer backwards."""

    saved: dict[int, list[Any]]
    grads: dict[str, torch.Tensor | None] = field(default_factory=dict)


def restore(buffers: Mapping[str, torch.Tensor], snapshot: Mapping[str, torch.Tensor]) -> None:
    """A failed call's buffers put back as they were before it."""
    with torch.no_grad():
        for k, v in snapshot.items():
            buffers[k].copy_(v)


def apply_writebacks(writebacks: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """A call's scratch-buffer writebacks, host tensor by host tensor."""
    with torch.no_grad():
        for host, value in writebacks:
            host.copy_(value)
