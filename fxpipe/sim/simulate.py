"""Discrete-event simulation of a Program on a ``Hardware`` model.

Every action of the Program is timed from the dependencies ``Program.dependencies()``
derives (stream order, issue order, residency, inputs, gradients); the only other
contention is the shared host link (``Hardware.shared_bus``: one link per direction for
all devices' streams) and the host optimizer, granted first-ready-first-served. Without
a shared bus, a device's parameter and activation streams each get the link's full
bandwidth (optimistic by at most the activation traffic, small next to parameters).
Durations come from per-layer ``LayerCost``:

- ``Forward``: the stage's forward times; ``FusedBackward``: forward of its layers
  (tail + loss), then backward; ``RecomputeBackward``: recompute, then backward (at
  layer grain, one layer's); ``Checkpoint``: the stage's forward.
- ``Prefetch``: parameter bytes on a device (``param_dtype`` under mixed precision; +
  nothing for the gradient buffer, allocated on device); ``Upload``: the boundary
  entering the stage; ``UploadGrad``: the boundary leaving it; ``Offload``: a fwd stage's
  output plus any saved inputs of bwd stages inside it, a bwd stage's input gradient;
  ``DownloadGrads``: the gradient bytes a download moves (``LayerCost.downloaded_grads``:
  the narrower of the device's and the masters' gradient dtype); ``OptimizerStep``: the
  bytes of the layers' trainable masters on the host (their gradients' bytes: a frozen
  parameter is not stepped) at ``cpu_optimizer_bytes_per_s`` (``AsyncUpdate`` and
  ``ScalerStep``: every layer's); ``Refresh``: ``refresh_bytes`` at
  ``host_copy_bytes_per_s``; ``ClipGradNorm`` and ``QueueUpdate``: every layer's host
  gradient bytes at ``host_copy_bytes_per_s`` (the norm reads each once, the queued
  update copies each); ``Accumulate`` (and an ``OptimizerStep``, which takes its stage's
  downloads itself): the host gradient bytes it widens (downloaded narrower than the
  masters' dtype) at ``host_copy_bytes_per_s``, else nothing (a download lands in its
  place in the flat gradient buffer); ``Free``, ``Release`` and ``Commit`` take no time.
- Data parallel (the host's ``collective`` stream, one collective at a time):
  ``AllReduce`` / ``ReduceScatter``: the layers' gradient bytes on the host
  (``LayerCost.host_grads``) by ``Hardware.collective_ms``; ``AllGather``: the stepped
  parameters as the devices hold them (``LayerCost.grads``: bf16 under a bf16
  ``param_dtype``); ``BroadcastBuffers``: their buffer bytes. Every collective of a node
  also holds the node's link (``Hardware.network_bytes_per_s``), one at a time. An
  ``OptimizerStep`` whose layers a ``ReduceScatter`` reduced steps the rank's 1/N
  (``Hardware.ranks``); so does every ``OptimizerStep`` of a ``data_parallel="device"``
  (or ``"zero3"``) Program, whose devices' ``DeviceReduceScatter`` (and
  ``DeviceAllGather``) actions are priced as collectives on their ``nccl`` stream, its
  downloads (and uploads) at 1/N, its ``Barrier`` as a round of latency. With
  ``Hardware.collectives="device"`` or ``"zero3"`` (MODELLED: one rank per node) a
  sharded Program is lowered first (``fxpipe.sim.collectives``, to what those Programs
  print but the barrier): reduce-scatters
  (and with ``"zero3"`` all-gathers of the parameters) on each device's ``nccl`` stream,
  1/N of the gradients downloaded and widened (and with ``"zero3"`` of the parameters
  uploaded). ``Timeline.bytes_moved`` sums what one rank's transfers and collectives move.

The host (``Hardware.host_us_per_action`` / ``host_us_per_kernel`` /
``host_us_per_grad_kernel``; free by default): an issue pass first times the executor's
issuing. Each device's actions are issued in its order, each once the actions it waits
on were issued, one at a time over all devices (the issue lock), each costing the
host per action plus per kernel it launches (``LayerCost.fwd_kernels`` / ``bwd_kernels``:
a ``Forward`` or ``Checkpoint`` its layers' forward kernels without grad, a recompute
and backward both with grad). An action then starts on its device no earlier than its
issue ended, so a host slower than the devices shows as a longer makespan
(``Timeline.host_issue_ms`` is the issue time summed). The pass leaves out the one place
the executor's host waits for a device (before a ``Prefetch`` allocates, for the memory
released): where that wait matters, the devices, not the host, are the bottleneck.
``stage_backend`` scales what a compute action launches: ``"inductor"`` launches
``INDUCTOR_KERNELS`` of the eager kernels (measured, ``benchmarks/bench_issue.py``),
``"cudagraphs"`` (MODELLED: the replays' launches are not timed) a graph job one replay plus
``graph_job_kernels`` (its inputs copied into the graph's but those a ``GraphUpload`` put
in its input slot, its outputs cloned, a backward's parameter gradients added in one
foreach call), the jobs with no graph (``FusedBackward``, layer grain) inductor's kernels.
A Program with graph actions (``GraphForward``, ``GraphRecomputeBackward``:
``runtime.stages.graphs.graph_jobs``) says which jobs are graphs; one without is priced
as ``passes.dependencies.graph_program`` makes it (every ``Forward`` and stage
``RecomputeBackward`` a graph job, their uploads into input slots, with their waits).
Host-lane actions run on their own thread and cost no issue time.

``semantics`` decides where the first part of a two-part compute goes:

- ``"fxpipe"``: it starts as soon as the compute stream is free and its parameters and
  input are there; the backward part then waits for the gradient (what the executor does).
- ``"roundpipe"``: as RoundPipe's simulator, the first part (recompute, or the fused
  stage's head forward) is placed immediately before the backward part, and every data
  dependency gates only the backward part. This lets a fused head forward start before
  its input arrived; use it to reproduce RoundPipe's published figures.

Memory per device: the highest predicted peak of its stages (``fxpipe.passes.stage_memory``:
parameters of the stage and of the one its device prefetches meanwhile, gradients,
activations, saved tensors, workspace), from the layers' memory (``memory=``, a
``ChainMemory``; by default from the ``LayerCost``s' bytes, each layer holding its
``saved_bytes`` and boundary); ``Timeline.peak_memory_by_kind`` has the kinds.
"""

from __future__ import annotations

import heapq
from typing import Literal, Sequence

from fxpipe.passes import gc_paused
from fxpipe.passes.stage_memory import KINDS, ChainMemory, device_peaks, program_peaks
from fxpipe.passes.program import (
    Accumulate,
    AllGather,
    AllReduce,
    AsyncUpdate,
    Barrier,
    BroadcastBuffers,
    Checkpoint,
    ClipGradNorm,
    Commit,
    Compute,
    Dep,
    DownloadGrads,
    Forward,
    GraphForward,
    GraphRecomputeBackward,
    GraphUpload,
    LABEL,
    Offload,
    OptimizerStep,
    Prefetch,
    Program,
    QueueUpdate,
    RecomputeBackward,
    ReduceScatter,
    Refresh,
    ScalerStep,
    Upload,
    UploadGrad,
)
from fxpipe.passes.dependencies import graph_program
from fxpipe.passes.schedule import build_program
from fxpipe.sim.collectives import (
    DeviceAllGather, DeviceAllReduce, DeviceReduceScatter, all_reduced, host_program, sharded,
    stream, with_device_collectives,
)
from fxpipe.sim.hardware import Hardware, LayerCost
from fxpipe.sim.timeline import Interval, Timeline
from fxpipe.stage_plan import RunType

Semantics = Literal["fxpipe", "roundpipe"]
StageBackend = Literal["eager", "inductor", "cudagraphs"]
INDUCTOR_KERNELS = 0.32
"""Kernels inductor's stage code launches per eager kernel: 41.5 of 135.9 per layer and
microbatch in ``benchmarks/results/bench_issue.json`` (Llama-3.1-8B's block, fused step;
the profiler's count of its generated kernels and the aten ops its wrapper calls)."""
_TRANSFERS = (Prefetch, Upload, UploadGrad, Offload, DownloadGrads)
_COLLECTIVE = {AllReduce: "all_reduce", ReduceScatter: "reduce_scatter", AllGather: "all_gather",
               DeviceReduceScatter: "reduce_scatter", DeviceAllReduce: "all_reduce",
               DeviceAllGather: "all_gather", Barrier: "all_reduce"}
_COLLECTIVES = (*_COLLECTIVE, BroadcastBuffers, Barrier)
MOVED = ("h2d_bytes_params", "h2d_bytes_activations", "h2d_bytes_grads", "d2h_bytes_activations",
         "d2h_bytes_grads", "network_bytes")
"""``Timeline.bytes_moved``'s keys: ``pipe.stats()``'s names for one rank's transfers, and
the bytes its collectives send over its node's link."""


class _StageCosts:
    """Per-stage sums of the layer costs a Program's actions need."""

    def __init__(self, program: Program, costs: Sequence[LayerCost], input_bytes: int):
        n = max((st.layers.stop for st in program.stages), default=0)
        if len(costs) < n:
            raise ValueError(f"the program's stages cover {n} layers, costs has {len(costs)}")
        self.costs = costs
        self.program = program
        # the graph jobs whose inputs a GraphUpload put in their input slots (none copied)
        self.in_place = {(a.stage, a.mb) for acts in program.actions for a in acts
                         if isinstance(a, GraphUpload)}
        boundary = lambda i: input_bytes if i < 0 else costs[i].boundary_bytes  # noqa: E731
        self.fwd, self.pre, self.bwd, self.params, self.grads = [], [], [], [], []
        self.device_grads = []   # a backward stage's gradients on a device (param_dtype)
        self.inp, self.out, self.grad_in = [], [], []
        self.fwd_kernels, self.bwd_kernels = [], []
        for st in program.stages:
            lc = [costs[i] for i in st.layers]
            self.fwd_kernels.append(sum(_kernels(c, "fwd_kernels") for c in lc))
            self.bwd_kernels.append(sum(_kernels(c, "bwd_kernels") for c in lc))
            self.fwd.append(sum(c.fwd_ms for c in lc))
            self.pre.append(sum(c.recompute if st.kind == "bwd" else c.fwd_ms for c in lc))
            self.bwd.append(sum(c.bwd_ms for c in lc))
            self.params.append(sum(c.param_bytes for c in lc))
            # downloaded in the narrower of the device's and the masters' gradient dtype
            self.grads.append(0 if st.kind == "fwd" else sum(c.downloaded_grads for c in lc))
            self.device_grads.append(0 if st.kind == "fwd" else sum(c.grads for c in lc))
            self.inp.append(boundary(st.layers.start - 1))
            self.grad_in.append(boundary(st.layers.stop - 1))
            if st.kind == "fwd":
                saved = sum(boundary(program.stages[b].layers.start - 1)
                            for b in program.saved_inputs_of(st.index)
                            if program.stages[b].layers.start != st.layers.stop)
                self.out.append(boundary(st.layers.stop - 1) + saved)
            else:
                self.out.append(boundary(st.layers.start - 1))

    def parts(self, a) -> tuple[float, float]:
        """(first part, backward part) of a compute action, in ms: the forward (also a
        ``Checkpoint``'s), or the recompute / tail forward before the backward."""
        if isinstance(a, Forward):
            return self.fwd[a.stage], 0.0
        if isinstance(a, Checkpoint):
            return self.fwd[a.stage], 0.0
        if isinstance(a, RecomputeBackward) and a.layer is not None:
            c = self.costs[a.layer]
            return c.recompute, c.bwd_ms
        return self.pre[a.stage], self.bwd[a.stage]

    def kernels(self, a, backend: StageBackend | None) -> tuple[float, bool]:
        """(kernels compute action ``a`` launches, whether with grad) under ``backend``."""
        if isinstance(a, (Forward, Checkpoint)):
            n, grad = self.fwd_kernels[a.stage], False
        elif isinstance(a, RecomputeBackward) and a.layer is not None:
            c = self.costs[a.layer]
            n, grad = _kernels(c, "fwd_kernels") + _kernels(c, "bwd_kernels"), True
        else:
            n, grad = self.fwd_kernels[a.stage] + self.bwd_kernels[a.stage], True
        if backend == "cudagraphs" and isinstance(a, (GraphForward, GraphRecomputeBackward)):
            in_place = len(self.program.flow.upload.get((a.stage, a.mb), ())) \
                if (a.stage, a.mb) in self.in_place else 0
            return float(graph_job_kernels(self.program.stages[a.stage], a, in_place)), False
        return (n * INDUCTOR_KERNELS if backend in ("inductor", "cudagraphs") else float(n)), grad

def action_kernels(program: Program, costs: Sequence[LayerCost],
                   stage_backend: StageBackend | None = None) -> dict[tuple[int, int], tuple[float, bool]]:
    """``{(lane, step): (kernels, with grad)}`` of each compute action of ``program``: what
    the issue pass prices (module docstring).

    >>> from fxpipe.passes.schedule import build_program
    >>> p = build_program([range(0, 1)], [range(1, 2), range(0, 1)], "fused", 1, 1, "stage")
    >>> sorted(action_kernels(p, [LayerCost(1.0, 2.0, fwd_kernels=3, bwd_kernels=5)] * 2).values())
    [(3.0, False), (8.0, True), (8.0, True)]
    """
    program = as_run(program, stage_backend)   # (the same actions at the same steps)
    sc = _StageCosts(program, costs, 0)
    return {(d, i): sc.kernels(a, stage_backend) for d, acts in program.lanes() if d >= 0
            for i, a in enumerate(acts) if isinstance(a, Compute)}


def as_run(program: Program, stage_backend: StageBackend | None) -> Program:
    """``program`` as a call under ``stage_backend`` runs it: under ``"cudagraphs"``, one
    without graph actions as ``passes.dependencies.graph_program`` makes it (every
    ``Forward`` and stage ``RecomputeBackward`` a graph job, their uploads into input
    slots, with their waits: MODELLED); otherwise as it is."""
    if stage_backend != "cudagraphs" or any(
            isinstance(a, (GraphForward, GraphRecomputeBackward))
            for acts in program.actions for a in acts):
        return program
    return graph_program(program)


def graph_job_kernels(stage, a, in_place: int = 0) -> int:
    """What a graph job launches (``runtime.stages.graphs``): the replay, a copy per input (its
    ``reads``) into the graph's own but for the ``in_place`` ones (a ``GraphUpload`` put
    them in its input slot), and per output a clone (forward) or, for a backward, the
    output gradients copied in, the input gradients cloned and one ``_foreach_add_`` of
    the parameter gradients."""
    reads, makes = len(stage.reads), len(stage.makes)
    copies = max(0, reads - in_place)
    if isinstance(a, Forward):
        return 1 + copies + makes
    return 1 + copies + makes + reads + 1


def _kernels(cost, name: str) -> int:
    return getattr(cost, name, None) or 0


def _widened(cost: LayerCost) -> int:
    """The host gradient bytes of ``cost``'s layer that the host widens once they land
    (downloaded in a narrower dtype than the masters' gradients); 0 if none."""
    return cost.host_grads if cost.downloaded_grads < cost.host_grads else 0


def _issue(nodes: list, dep_ids: list, sc: _StageCosts, hardware: Hardware,
           backend: StageBackend | None) -> tuple[list[float], float]:
    """When each action's issue ends, by the issue pass (module docstring), and the issue
    time summed (ms); all 0 where issuing is free."""
    N = len(nodes)
    end = [0.0] * N
    if not (hardware.host_us_per_action or hardware.host_us_per_kernel
            or hardware.host_us_per_grad_kernel):
        return end, 0.0
    issued = [False] * N
    lanes: dict[int, list[int]] = {}
    for k, (d, _, _) in enumerate(nodes):
        lanes.setdefault(d, []).append(k)
    nxt = {d: 0 for d in lanes}
    host = total = 0.0
    left = N
    while left:
        best = None   # (ready time, lane) of the next action that can be issued
        for d, ks in lanes.items():
            if nxt[d] == len(ks):
                continue
            k = ks[nxt[d]]
            if all(issued[j] for j, _ in dep_ids[k]):
                prev = end[ks[nxt[d] - 1]] if nxt[d] else 0.0
                ready = max([prev] + [end[j] for j, _ in dep_ids[k]])
                if best is None or ready < best[0]:
                    best = (ready, d)
        if best is None:
            return end, total   # a deadlock: the simulation names it
        ready, d = best
        k = lanes[d][nxt[d]]
        a = nodes[k][2]
        if d < 0:      # the host lane: its own thread, no issue time
            end[k] = ready
        else:
            kernels, grad = sc.kernels(a, backend) if isinstance(a, Compute) else (0.0, False)
            cost = hardware.issue_us(kernels, grad) / 1e3
            host = end[k] = max(ready, host) + cost
            total += cost
        issued[k] = True
        nxt[d] += 1
        left -= 1
    return end, total


def simulate(program: Program, costs: Sequence[LayerCost], hardware: Hardware | None = None,
             *, semantics: Semantics = "fxpipe", tokens_per_step: int | None = None,
             input_bytes: int = 0, memory: ChainMemory | None = None,
             refresh_bytes: int = 0, stage_backend: StageBackend | None = None) -> Timeline:
    """Time ``program`` with per-layer ``costs`` on ``hardware``.

    ``hardware=None`` is ``Hardware()``: every transfer free, no memory limit.
    ``tokens_per_step`` (tokens in one call of the program) gives ``tokens_per_s``;
    ``input_bytes`` is the model input per microbatch; ``memory``: the layers' memory
    for one microbatch (``fxpipe.passes.stage_memory.ChainMemory``; default from ``costs``).
    ``refresh_bytes``: what the call's ``Refresh`` copies on the host (the
    ``param_dtype`` casts of the parameters a step changed, an asynchronous optimizer's
    snapshot; default none). ``stage_backend``: what the compute actions launch, for the
    host's issue time (module docstring; ``None`` is ``"eager"``). A data-parallel
    Program's collectives run where ``hardware.collectives`` says: as the Program prints
    them (``"host"``), or lowered to the devices (``"device"``, ``"zero3"`` MODELLED: the
    Program built with ``data_parallel="shard"``; ``fxpipe.sim.collectives``)::

        >>> from fxpipe.passes.schedule import build_program
        >>> p = build_program([range(0, 1)], [range(1, 2), range(0, 1)], "fused", 1, 2,
        ...                   "stage", optimizer=True, data_parallel="shard")
        >>> c = [LayerCost(1.0, 2.0, param_bytes=10**9)] * 2
        >>> for where in ("host", "device", "zero3"):
        ...     t = simulate(p, c, Hardware(ranks=4, network_bytes_per_s=50e9, h2d_bandwidth=50e9,
        ...                                 d2h_bandwidth=50e9, collectives=where))
        ...     b = t.bytes_moved
        ...     print(where, round(t.makespan, 1), b["h2d_bytes_params"] / 1e9,
        ...           b["d2h_bytes_grads"] / 1e9)
        host 131.0 3.0 2.0
        device 111.0 3.0 0.5
        zero3 95.0 0.75 0.5

    >>> from fxpipe.passes.schedule import build_program
    >>> p = build_program([range(0, 2)], [range(2, 4), range(0, 2)], "fused", 2, 4, "stage")
    >>> t = simulate(p, [LayerCost(1.0, 2.0)] * 4)
    >>> round(t.makespan, 3), round(t.bubble_ratio, 2)
    (32.0, 12.5)
    """
    if semantics not in ("fxpipe", "roundpipe"):
        raise ValueError(f"semantics must be 'fxpipe' or 'roundpipe', got {semantics!r}")
    if stage_backend not in (None, "eager", "inductor", "cudagraphs"):
        raise ValueError("stage_backend must be None, 'eager', 'inductor' or 'cudagraphs', "
                         f"got {stage_backend!r}")
    with gc_paused():  # many small acyclic objects: collector passes cost ~half the run
        return _simulate(program, costs, Hardware() if hardware is None else hardware,
                         semantics, tokens_per_step, input_bytes, memory, refresh_bytes,
                         stage_backend)


def _simulate(program, costs, hardware, semantics, tokens_per_step, input_bytes, memory,
              refresh_bytes=0, stage_backend=None) -> Timeline:
    lower = sharded(program, hardware.collectives)   # device collectives (module doc)
    # an all-reducing Program on the devices: each DownloadGrads whole, after an sAR
    lower_ar = all_reduced(program, hardware.collectives)
    native = any(isinstance(a, DeviceReduceScatter) for acts in program.actions for a in acts)
    on_devices = lower or native   # native: a data_parallel="device" or "zero3" Program
    zero3 = (lower and hardware.collectives == "zero3") or any(
        isinstance(a, DeviceAllGather) for acts in program.actions for a in acts)
    # each rank steps (with device collectives also downloads and widens) 1/R of these
    shard_of = {(a.layers.start, a.layers.stop) for a in program.host
                if isinstance(a, ReduceScatter) or (native and isinstance(a, OptimizerStep))}
    R = hardware.ranks
    program = host_program(program, hardware.collectives)
    program = as_run(program, stage_backend)
    sc = _StageCosts(program, costs, input_bytes)
    deps = program.dependencies()
    nodes = [(d, i, a) for d, acts in program.lanes() for i, a in enumerate(acts)]
    nid = {(d, i): k for k, (d, i, _) in enumerate(nodes)}
    dep_ids = [[(nid[(x.device, x.step)], x) for x in deps[d][i]] for d, i, _ in nodes]
    if lower or lower_ar:
        nodes, dep_ids = with_device_collectives(
            nodes, dep_ids, hardware.collectives,
            DeviceAllReduce if lower_ar else DeviceReduceScatter)
    N = len(nodes)
    waiting = [len(x) for x in dep_ids]
    dependents: list[list[int]] = [[] for _ in range(N)]
    for k, dl in enumerate(dep_ids):
        for j, _ in dl:
            dependents[j].append(k)
    start, end, split, ready_data = [0.0] * N, [0.0] * N, [0.0] * N, [0.0] * N
    done = [False] * N
    issued, host = _issue(nodes, dep_ids, sc, hardware, stage_backend)
    hop = hardware.comm_ms_per_hop
    link = {"prefetch": "h2d", "h2d": "h2d", "d2h": "d2h", "grads": "d2h", "host": "host",
            "free": None, "control": None, "collective": "collective", "nccl": "nccl"}
    bus = {"h2d": 0.0, "d2h": 0.0, "host": 0.0, "collective": 0.0, "network": 0.0,
           "socket h2d": 0.0, "socket d2h": 0.0}
    moved: dict[str, float] = dict.fromkeys(MOVED, 0.0)
    crossing = [hardware.crosses_socket(d, program.num_devices)
                for d in range(program.num_devices)] + [False]   # the host lane: -1

    def dep_time(j: int, x: Dep, instant: tuple[type, ...] = ()) -> float:
        """When dependency x (on node j) is met; transfers of the ``instant`` types count
        as done once their data was ready (what-if for the exposed-transfer metrics)."""
        if instant and isinstance(nodes[j][2], instant):
            return ready_data[j]
        return (start[j] if x.on == "start" else end[j]) + (hop if x.hop and not instant else 0.0)

    def transfer(a) -> tuple[str, float] | None:
        """(``Timeline.bytes_moved``'s key, bytes) of a transfer or collective ``a``."""
        match a:
            case Prefetch(stage=s):   # zero3: this rank's 1/R, the rest gathered
                return "h2d_bytes_params", sc.params[s] / (R if zero3 else 1)
            case Upload(stage=s, mb=m):   # the label alone: a transfer's latency
                only_label = program.flow.upload.get((s, m)) == (LABEL,)
                return "h2d_bytes_activations", 0 if only_label else sc.inp[s]
            case UploadGrad(stage=s):
                return "h2d_bytes_activations", sc.grad_in[s]
            case Offload(stage=s):
                return "d2h_bytes_activations", sc.out[s]
            case DownloadGrads(stage=s):   # device collectives: the rank's 1/R
                return "d2h_bytes_grads", sc.grads[s] / (R if on_devices else 1)
            # the collectives: their whole buffer (the network bytes are a ring's share)
            case AllReduce(layers=layers) | ReduceScatter(layers=layers):
                return "network_bytes", sum(costs[i].host_grads for i in layers)
            case AllGather(layers=layers):   # the stepped parameters, as the devices hold them
                return "network_bytes", sum(costs[i].grads for i in layers)
            case DeviceReduceScatter(stage=s) | DeviceAllReduce(stage=s):   # param_dtype grads
                return "network_bytes", sc.device_grads[s]
            case DeviceAllGather(stage=s):
                return "network_bytes", sc.params[s]
            case BroadcastBuffers():
                return "network_bytes", sum(c.buffer_bytes for c in costs)
            case Barrier():   # its latency
                return "network_bytes", 0
        return None

    def duration(a, d: int) -> float:
        x = crossing[d]
        if isinstance(a, _TRANSFERS):
            key, nbytes = transfer(a)
            moved[key] += nbytes
            return hardware.transfer_ms(nbytes, "h2d" if key.startswith("h2d") else "d2h", x)
        if isinstance(a, _COLLECTIVES):
            kind = _COLLECTIVE.get(type(a), "broadcast")
            nbytes = transfer(a)[1]
            moved["network_bytes"] += hardware.collective_bytes(kind, nbytes)
            ms = hardware.collective_ms(kind, nbytes)
            if isinstance(a, (DeviceReduceScatter, DeviceAllReduce)) and a.accumulated:   # .grad
                up = sum(costs[i].host_grads for i in program.stages[a.stage].layers)
                moved["h2d_bytes_grads"] += up
                ms += hardware.transfer_ms(up, "h2d", x)
            return ms
        match a:
            case OptimizerStep(layers=layers):   # a sharded step: the rank's 1/R
                share = R if (layers.start, layers.stop) in shard_of else 1
                widen = sum(map(_widened, (costs[i] for i in layers)))
                return hardware.optimizer_ms(sum(costs[i].host_grads for i in layers)) / share \
                    + hardware.host_copy_ms(widen / (share if on_devices else 1))
            case Accumulate(layers=layers):
                return hardware.host_copy_ms(sum(map(_widened, (costs[i] for i in layers))))
            case AsyncUpdate() | ScalerStep():
                return hardware.optimizer_ms(sum(c.host_grads for c in costs))
            case Refresh():
                return hardware.host_copy_ms(refresh_bytes)
            case ClipGradNorm() | QueueUpdate():   # read (copy) every gradient once
                return hardware.host_copy_ms(sum(c.host_grads for c in costs))
        return 0.0

    def compute_times(k: int, instant: tuple[type, ...] = ()) -> tuple[float, float, float]:
        """(start, backward start, end) of compute node k."""
        a = nodes[k][2]
        free = max([issued[k]] + [dep_time(j, x) for j, x in dep_ids[k] if x.why == "stream"])
        pre, main = sc.parts(a)
        if isinstance(a, (Forward, Checkpoint)):
            t = max([free] + [dep_time(j, x, instant) for j, x in dep_ids[k]])
            return t, t, t + pre
        if semantics == "roundpipe":
            data = max((dep_time(j, x, instant) for j, x in dep_ids[k] if x.why != "stream"),
                       default=0.0)
            b = max(free + pre, data)
            return b - pre, b, b + main
        s = max([free] + [dep_time(j, x, instant) for j, x in dep_ids[k] if x.why != "grad"])
        b = max([s + pre] + [dep_time(j, x, instant) for j, x in dep_ids[k] if x.why == "grad"])
        return s, b, b + main

    def ready_time(k: int) -> float:
        if isinstance(nodes[k][2], Compute):
            return compute_times(k)[0]
        return max([issued[k]] + [dep_time(j, x) for j, x in dep_ids[k]])

    heap = [(ready_time(k), k) for k in range(N) if waiting[k] == 0]
    heapq.heapify(heap)
    exposed: dict[str, float] = {}
    exposed_prefetch: dict[str, float] = {}
    while heap:
        t, k = heapq.heappop(heap)
        d, i, a = nodes[k]
        if isinstance(a, Compute):
            start[k], split[k], end[k] = compute_times(k)
            for what, instant in ((exposed, _TRANSFERS), (exposed_prefetch, (Prefetch,))):
                waited = end[k] - compute_times(k, instant)[2]
                if waited > 1e-9:
                    what[str(a)] = waited
        else:
            if isinstance(a, _TRANSFERS):
                ready_data[k] = max((dep_time(j, x, _TRANSFERS) for j, x in dep_ids[k]
                                     if x.why != "stream"), default=0.0)
            lane = link[stream(a)]
            shared = lane in ("host", "collective") or (hardware.shared_bus
                                                        and lane in ("h2d", "d2h"))
            # a transfer across the socket link waits for it too (Hardware.sockets), a
            # collective for the node's network link
            buses = ([lane] if shared else []) + (
                [f"socket {lane}"] if lane in ("h2d", "d2h") and crossing[d] else []) + (
                ["network"] if lane in ("collective", "nccl") else [])
            start[k] = max([t] + [bus[b] for b in buses])
            end[k] = start[k] + duration(a, d)
            for b in buses:
                bus[b] = end[k]
        done[k] = True
        for j in dependents[k]:
            waiting[j] -= 1
            if waiting[j] == 0:
                heapq.heappush(heap, (ready_time(j), j))
    if not all(done):
        d, i, a = nodes[done.index(False)]
        blockers = [str(nodes[j][2]) + f"@d{nodes[j][0]}" for j, _ in dep_ids[done.index(False)]
                    if not done[j]]
        raise ValueError(f"program deadlocks: device {d} step {i} ({a}) waits forever on "
                         f"{', '.join(blockers)}")
    memory = memory if memory is not None else ChainMemory.of(costs, input_bytes)
    return _timeline(program, sc, nodes, start, split, end, hardware,
                     (exposed, exposed_prefetch), tokens_per_step, memory, host, moved)


def _timeline(program, sc, nodes, start, split, end, hardware, exposed,
              tokens_per_step, memory, host_issue_ms=0.0, moved=None) -> Timeline:
    G = program.num_devices
    intervals: list[Interval] = []
    busy, device_free = [0.0] * G, [0.0] * G
    for k, (d, i, a) in enumerate(nodes):
        lane = stream(a)
        label = str(a)
        if isinstance(a, Compute):
            if isinstance(a, (Forward, Checkpoint)):
                pieces = [("forward" if isinstance(a, Forward) else "recompute",
                           start[k], end[k])]
            else:
                first = "recompute" if isinstance(a, RecomputeBackward) else "forward"
                pieces = [(first, start[k], start[k] + sc.parts(a)[0]),
                          ("backward", split[k], end[k])]
            for kind, s, e in pieces:
                intervals.append(Interval(d, lane, label, kind, s, e))
                busy[d] += e - s
            device_free[d] = max(device_free[d], end[k])
        else:
            kind = "optimizer" if isinstance(a, (OptimizerStep, AsyncUpdate, ScalerStep)) \
                else "host" if isinstance(a, (Refresh, Accumulate, ClipGradNorm, QueueUpdate,
                                              Commit)) else "transfer"
            intervals.append(Interval(d, lane, label, kind, start[k], end[k]))
    peaks = device_peaks(program_peaks(program, memory), G)
    makespan = max((iv.end for iv in intervals), default=0.0)
    tps = tokens_per_step / (makespan / 1e3) if tokens_per_step and makespan > 0 else None
    return Timeline(G, intervals, makespan, busy, device_free, [p.total if p else 0 for p in peaks],
                    *exposed, memory_limit=hardware.memory, tokens_per_s=tps,
                    peak_memory_by_kind=[dict(p.bytes) if p else dict.fromkeys(KINDS, 0)
                                         for p in peaks], host_issue_ms=host_issue_ms,
                    bytes_moved=dict(moved or {}))


def roundpipe_program(plan_fwd: Sequence[range], plan_bwd: Sequence[range], run_type: RunType,
                      num_devices: int, num_microbatches: int, costs: Sequence[LayerCost],
                      hardware: Hardware | None = None, *, semantics: Semantics = "fxpipe",
                      **dispatch_options) -> Program:
    """``build_program(..., dispatch="roundpipe")`` with each round's first device chosen
    by simulating the rounds before it (the device whose compute stream is free first).
    ``dispatch_options`` (``round_size``, ``forward_lead``, ``split_stages``,
    ``optimizer``) go to ``build_program``.

    >>> p = roundpipe_program([range(0, 2)], [range(2, 3), range(0, 2)], "fused", 2, 4,
    ...                       [LayerCost(1.0, 2.0)] * 3)
    >>> p.num_microbatches, len(p.stages)
    (4, 3)
    """
    return build_program(
        plan_fwd, plan_bwd, run_type, num_devices, num_microbatches, "roundpipe",
        device_free=lambda p: simulate(p, costs, hardware, semantics=semantics).device_free,
        **dispatch_options)
