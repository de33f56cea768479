"""Schedule: build the ``Program`` a plan runs (``fxpipe.passes.program`` has the value).

``build_program`` places each stage's microbatches on devices (round-robin by stage, or
in RoundPipe's rounds), then emits every action: parameter prefetches, the transfers
and frees ``dataflow`` decides from the stages' values, the computes (at layer grain a
``Checkpoint`` and one backward per layer), gradient downloads, releases, and the
host's lane (the asynchronous update, optimizer steps, the commit)::

    >>> p = build_program([range(0, 2)], [range(2, 3), range(0, 2)], "fused", 2, 2, "stage",
    ...                   optimizer=True)
    >>> [str(a) for a in p.host]
    ['RF', 'S2:3', 'S0:2', 'C']
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Collection, Literal, Sequence

from fxpipe.passes.program import (  # noqa: F401 — the Program's vocabulary, re-exported
    HOST, LABEL, Accumulate, Action, AllGather, AllReduce, AsyncUpdate, BroadcastBuffers,
    Barrier, CallSpec, Checkpoint, ClipGradNorm, Collective, Commit, Compute, Dataflow, Dep,
    DeviceAllGather, DeviceAllReduce, DeviceReduceScatter, DownloadGrads, Forward, Free, FusedBackward, HostAction, Key, Offload, OptimizerSpec,
    OptimizerStep, Prefetch, Program, QueueUpdate, RecomputeBackward, ReduceScatter, Refresh,
    Release, RunType, ScalerStep, StageKind, StageSpec, Upload, UploadGrad, dataflow,
    parse_action, stream_of,
)

Dispatch = Literal["roundpipe", "stage"]
OptimizerMode = Literal["exact", "async"]
DataParallelMode = Literal["allreduce", "shard", "device", "device_accumulated",
                           "device_allreduce", "device_allreduce_accumulated", "zero3",
                           "zero3_accumulated"]
"""Which collectives a data-parallel training call runs: gradient all-reduce on the host
lane; (``shard_optimizer``) reduce-scatter and all-gather there; (``"device"``) each
stage's reduce-scatter on the devices (``DeviceReduceScatter``), the all-gather of the
stepped shards on the host lane; or (``"device_allreduce"``, a call that does not step a
sharded optimizer) each stage's all-reduce on the devices (``DeviceAllReduce``). The
``_accumulated`` forms add the host's accumulated ``.grad`` first (``sRS+``, ``sAR+``:
a call after calls that did not synchronize). ``"zero3"`` reduces as ``"device"``
does, but the ranks share one copy of the parameters (each writes the 1/N it stepped):
no ``AllGather``, a ``Barrier`` last."""
ZERO3 = ("zero3", "zero3_accumulated")
SHARDED_ON_DEVICES = ("device", "device_accumulated", *ZERO3)
ON_DEVICES = (*SHARDED_ON_DEVICES, "device_allreduce", "device_allreduce_accumulated")


@dataclass(frozen=True)
class Values:
    """The values a Program's stages read and make (per stage, in execution order), the
    model's inputs, the outputs the host gets, the inputs whose gradients it takes, and
    the backward stages that share a parameter (``Program.shared``), and per stage the
    parameters it owns (``StageSpec.owns``; empty without a model). ``build_program``
    without it uses :func:`chain_values`: each stage reads what the layer before it made."""

    reads: tuple[tuple[str, ...], ...]
    makes: tuple[tuple[str, ...], ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    input_grads: tuple[str, ...] = ()
    shared: tuple[tuple[int, ...], ...] = ()
    owns: tuple[tuple[str, ...], ...] = ()


def chain_values(stages: Sequence[StageSpec], run_type: RunType) -> Values:
    """Values of a plain layer chain: layer ``i`` makes ``l{i}`` from ``l{i-1}`` (layer 0
    from ``input``); a forward stage also makes the values where backward stages inside
    it start (their saved inputs); the last layer's value is the output (the host gets
    it unless the program is ``"fused"``, whose fused stage reads the label, ``LABEL``).

    >>> st = make_stages([range(0, 3)], [range(3, 4), range(1, 3), range(0, 1)], "fused")
    >>> v = chain_values(st, "fused")
    >>> v.reads, v.makes
    ((('input',), ('l2', '<label>'), ('l0',), ('input',)), (('l2', 'l0'), ('l3',), ('l2',), ('l0',)))
    """
    def name(i: int) -> str:
        return "input" if i < 0 else f"l{i}"

    starts = [st.layers.start for st in stages if st.kind == "bwd"]
    reads, makes = [], []
    for st in stages:
        r = st.layers
        reads.append((name(r.start - 1),) + ((LABEL,) if st.kind == "fused" else ()))
        extra = [name(c - 1) for c in starts if st.kind == "fwd" and r.start < c < r.stop]
        makes.append((name(r.stop - 1), *sorted(set(extra), key=extra.index)))
    last = max(st.layers.stop for st in stages) - 1
    return Values(tuple(reads), tuple(makes),
                  ("input",) + ((LABEL,) if run_type == "fused" else ()),
                  () if run_type == "fused" else (name(last),))


# ----------------------------------------------------------------------------- builders

def make_stages(plan_fwd: Sequence[range], plan_bwd: Sequence[range],
                run_type: RunType) -> tuple[StageSpec, ...]:
    """Stages in execution order for a plan.

    >>> [str(s) for s in make_stages([range(0, 2)], [range(2, 3), range(0, 2)], "fused")]
    ['0 fwd 0:2', '1 fused 2:3', '2 bwd 0:2']
    """
    if run_type not in ("infer", "train", "fused"):
        raise ValueError(f"run_type must be 'infer', 'train' or 'fused', got {run_type!r}")
    if run_type != "infer" and not plan_bwd:
        raise ValueError(f"run_type {run_type!r} needs a backward plan")
    stages = [StageSpec(i, "fwd", r) for i, r in enumerate(plan_fwd)]
    if run_type != "infer":
        for j, r in enumerate(plan_bwd):
            kind = "fused" if run_type == "fused" and j == 0 else "bwd"
            stages.append(StageSpec(len(stages), kind, r))
    return tuple(stages)


def build_program(plan_fwd: Sequence[range], plan_bwd: Sequence[range], run_type: RunType,
                  num_devices: int, num_microbatches: int, dispatch: Dispatch = "roundpipe",
                  *, round_size: int | None = None, forward_lead: int = 0,
                  split_stages: Collection[int] = (),
                  device_free: Callable[[Program], Sequence[float]] | None = None,
                  optimizer: bool | OptimizerMode | OptimizerSpec | None = False,
                  grain: str = "stage",
                  values: Values | None = None, data_parallel: DataParallelMode | None = None,
                  broadcast_buffers: bool = False, chunks: bool = False,
                  gather_params: bool = False) -> Program:
    """Build the Program for a plan.

    ``dispatch="stage"`` (docs/design.md, rule 1): stage ``s`` runs on device ``s mod G`` as one
    job over all microbatches; the prefetch of the device's next stage is issued when
    its current stage starts computing, so at most two stages are resident.

    ``dispatch="roundpipe"``: microbatches go in rounds of ``round_size`` (default G).
    Per round, every forward stage runs on the round's microbatches, then every
    backward stage does (``"train"``: all forward rounds first, then backward rounds).
    Slot ``i`` of a round (its stages in execution order) runs on device
    ``(r0 + i) mod G``; ``r0`` is 0 for the first round and then the device that becomes
    free first, which needs timing: ``device_free(partial_program)`` returns per device
    the time its compute stream is done (``fxpipe.sim.roundpipe_program`` passes the
    simulator). Without it, ``r0`` continues the rotation (``r0 + slots`` mod G).

    Two variations, off by default (RoundPipe's dispatch): ``forward_lead=k`` (fused
    only) dispatches round ``r``'s forward stages together with round ``r-k``'s backward
    stages, so forwards run ahead; ``split_stages`` gives each listed stage two slots,
    even and odd microbatches of the round, so a slow stage (the loss head) runs on two
    devices at once.

    ``optimizer`` (an ``OptimizerSpec``, or ``True``/``"exact"``/``"async"``): the
    optimizer's actions in the host lane (:func:`host_lane`).
    ``grain="layer"``: a backward stage of several layers recomputes one layer at a time
    (``Checkpoint``, then each layer's ``RecomputeBackward``, deepest first).
    ``values``: the stages' values (:class:`Values`; default :func:`chain_values`).
    ``data_parallel`` and ``broadcast_buffers``: the collectives of the host lane
    (:func:`host_lane`). ``chunks`` (``dispatch="stage"``): the microbatches are one
    sequence's token chunks; every backward stage runs them last first.
    ``gather_params`` (``data_parallel="zero3"``): a ``DeviceAllGather`` after each
    ``Prefetch``.

    >>> p = build_program([range(0, 2)], [range(2, 3), range(0, 2)], "fused", 2, 4)
    >>> [str(a) for a in p.actions[1] if isinstance(a, (Forward, FusedBackward))]
    ['1FB0', '1FB1', '0F2', '0F3']
    """
    if num_devices < 1 or num_microbatches < 1:
        raise ValueError("num_devices and num_microbatches must be >= 1")
    if grain not in ("stage", "layer"):
        raise ValueError(f"grain must be 'stage' or 'layer', got {grain!r}")
    stages = make_stages(plan_fwd, plan_bwd, run_type)
    values = values or chain_values(stages, run_type)
    if len(values.reads) != len(stages) or len(values.makes) != len(stages):
        raise ValueError(f"values describe {len(values.reads)} stages, the plan has {len(stages)}")
    if values.owns and len(values.owns) != len(stages):
        raise ValueError(f"values give owners for {len(values.owns)} stages, the plan has "
                         f"{len(stages)}")
    owns = values.owns or ((),) * len(stages)
    stages = tuple(StageSpec(st.index, st.kind, st.layers, tuple(r), tuple(m), tuple(o))
                   for st, r, m, o in zip(stages, values.reads, values.makes, owns))
    host = host_lane(stages, optimizer, data_parallel, broadcast_buffers)
    emit = _Emitter(num_devices, num_microbatches, stages, values, run_type, grain, host,
                    data_parallel, gather_params)
    G, M, F, S = num_devices, num_microbatches, len(plan_fwd), len(stages)
    jobs: list[list[tuple[int, list[int]]]] = [[] for _ in range(G)]
    if dispatch == "stage":
        for st in stages:
            order = range(M - 1, -1, -1) if chunks and st.kind != "fwd" else range(M)
            jobs[st.index % G].append((st.index, list(order)))
        return emit(jobs)
    if chunks:
        raise ValueError("sequence chunks run with dispatch='stage' (each stage's chunks in "
                         "order on one device)")
    if dispatch != "roundpipe":
        raise ValueError(f"dispatch must be 'roundpipe' or 'stage', got {dispatch!r}")
    size = round_size or G
    rounds = [list(range(r, min(r + size, M))) for r in range(0, M, size)]
    units: list[list[tuple[int, list[int]]]] = []   # what one r0 places: (stage, round)
    if run_type == "fused":
        for i in range(len(rounds) + forward_lead):
            unit = [(s, rounds[i]) for s in range(F)] if i < len(rounds) else []
            if i >= forward_lead:
                unit += [(s, rounds[i - forward_lead]) for s in range(F, S)]
            units.append(unit)
    else:
        units = [[(s, rnd) for s in range(F)] for rnd in rounds]
        units += [[(s, rnd) for s in range(F, S)] for rnd in rounds if S > F]
    r0, placed = 0, 0
    for n, unit in enumerate(units):
        slots = [job for s, rnd in unit
                 for job in ([(s, rnd[0::2]), (s, rnd[1::2])] if s in split_stages and
                             len(rnd) > 1 else [(s, rnd)])]
        if n > 0:
            if device_free is None:
                r0 = (r0 + placed) % G
            else:
                free = list(device_free(emit(jobs, partial=True)))
                r0 = min(range(G), key=lambda g: (free[g], g))
        for k, (s, mbs) in enumerate(slots):
            jobs[(r0 + k) % G].append((s, list(mbs)))
        placed = len(slots)
    return emit(jobs)


def optimizer_spec(optimizer: bool | OptimizerMode | OptimizerSpec | None) -> OptimizerSpec | None:
    """``optimizer`` as an ``OptimizerSpec``: ``True``/``"exact"`` the streamed exact step,
    ``"async"`` the asynchronous one, ``False``/``None`` none."""
    if optimizer is None or optimizer is False:
        return None
    if isinstance(optimizer, OptimizerSpec):
        return optimizer
    if optimizer is True or optimizer == "exact":
        return OptimizerSpec("exact")
    if optimizer == "async":
        return OptimizerSpec("async")
    raise ValueError(f"optimizer must be False, True, 'exact', 'async' or an OptimizerSpec, got "
                     f"{optimizer!r}")


def host_lane(stages: Sequence[StageSpec],
              optimizer: bool | OptimizerMode | OptimizerSpec | None = False,
              data_parallel: DataParallelMode | None = None,
              broadcast_buffers: bool = False) -> tuple[Action, ...]:
    """The host's actions, in issue order: the ``Refresh`` first (then ``BroadcastBuffers``,
    data parallel with buffers), the asynchronous update, then per backward stage,
    deepest first, what takes its downloaded gradients: its ``AllReduce`` (data
    parallel), its ``OptimizerStep`` when the step is streamed, else an ``Accumulate``;
    the ``Commit``; after it, what needs every ``.grad``: the norm (``ClipGradNorm``),
    then the step that could not be streamed (``OptimizerStep``s, a ``ScalerStep``), or
    the asynchronous update's queueing::

        >>> st = make_stages([range(0, 1)], [range(1, 3), range(0, 1)], "fused")
        >>> [str(a) for a in host_lane(st, True, "allreduce", True)]
        ['RF', 'BC', 'AR1:3', 'S1:3', 'AR0:1', 'S0:1', 'C']
        >>> [str(a) for a in host_lane(st)]
        ['RF', 'M1:3', 'M0:1', 'C']
        >>> [str(a) for a in host_lane(st, OptimizerSpec(clip=True))]
        ['RF', 'S1:3', 'S0:1', 'C', 'N']
        >>> [str(a) for a in host_lane(st, OptimizerSpec(clip=True, speculate=False))]
        ['RF', 'M1:3', 'M0:1', 'C', 'N', 'S1:3', 'S0:1']
        >>> [str(a) for a in host_lane(st, OptimizerSpec(scaler=True))]
        ['RF', 'M1:3', 'M0:1', 'C', 'SS']
        >>> [str(a) for a in host_lane(st, "async")]
        ['RF', 'A', 'M1:3', 'M0:1', 'C', 'Q']
        >>> [str(a) for a in host_lane(make_stages([range(0, 1)], [range(0, 1)], "train"))]
        ['RF', 'C', 'M0:1']

    With ``data_parallel="shard"`` a stage's bucket is reduce-scattered, its shard stepped,
    then gathered; each ``AllGather`` is listed after the next stage's ``ReduceScatter``,
    so that the collective stream does not hold that reduction behind a step::

        >>> [str(a) for a in host_lane(st, True, "shard")]
        ['RF', 'RS1:3', 'S1:3', 'RS0:1', 'AG1:3', 'S0:1', 'AG0:1', 'C']

    With ``data_parallel="device"`` the reduce-scatters are the devices' (each
    ``DownloadGrads`` follows a ``DeviceReduceScatter``): the host steps and gathers::

        >>> [str(a) for a in host_lane(st, True, "device")]
        ['RF', 'S1:3', 'AG1:3', 'S0:1', 'AG0:1', 'C']

    With ``"device_allreduce"`` (a call that does not step a sharded optimizer) each
    download brings its stage's averaged gradients (a ``DeviceAllReduce`` before it)::

        >>> [str(a) for a in host_lane(st, None, "device_allreduce")]
        ['RF', 'M1:3', 'M0:1', 'C']

    With ``"zero3"`` each rank writes the shards it stepped into the parameters the ranks
    share, and waits for the others last::

        >>> [str(a) for a in host_lane(st, OptimizerSpec(clip=True), "zero3")]
        ['RF', 'S1:3', 'S0:1', 'C', 'N', 'SY']

    Sharded, clipping without speculation: the shards reduced (``RS``; on the devices,
    taken by ``M``), the norm of every rank's shards (``N``), then each stage stepped
    and gathered::

        >>> [str(a) for a in host_lane(st, OptimizerSpec(clip=True, speculate=False), "shard")]
        ['RF', 'RS1:3', 'RS0:1', 'C', 'N', 'S1:3', 'AG1:3', 'S0:1', 'AG0:1']
        >>> [str(a) for a in host_lane(st, OptimizerSpec(clip=True, speculate=False), "device")]
        ['RF', 'M1:3', 'M0:1', 'C', 'N', 'S1:3', 'AG1:3', 'S0:1', 'AG0:1']
    """
    spec = optimizer_spec(optimizer)
    if data_parallel not in (None, "allreduce", "shard", *ON_DEVICES):
        raise ValueError(f"data_parallel must be None, 'allreduce', 'shard' or one of "
                         f"{ON_DEVICES}, got {data_parallel!r}")
    sharded = data_parallel in ("shard", *SHARDED_ON_DEVICES)
    if sharded and (spec is None or not (spec.streamed or spec.clipped_first)):
        raise ValueError(f"data_parallel={data_parallel!r} steps each rank's shard in the call: "
                         "it needs the streamed exact step, or clipping without speculation")
    streamed = spec is not None and spec.streamed
    gathers = sharded and data_parallel not in ZERO3   # the stepped shards, AG
    host: list[Action] = [Refresh()]
    if broadcast_buffers:
        host.append(BroadcastBuffers())
    if spec is not None and spec.mode == "async":
        host.append(AsyncUpdate())
    backward = [st.layers for st in stages if st.kind != "fwd"]
    # a "train" Program is two calls: its Commit ends the forward one (pipe(x)); the
    # backward one (.backward()) takes the gradients after it
    train = bool(backward) and not any(st.kind == "fused" for st in stages)
    if train:
        host.append(Commit())
    for j, layers in enumerate(backward):
        if sharded:
            if data_parallel == "shard":
                host.append(ReduceScatter(layers))
            if j and streamed and gathers:
                host.append(AllGather(backward[j - 1]))
        elif data_parallel == "allreduce":
            host.append(AllReduce(layers))
        if streamed:
            host.append(OptimizerStep(layers))
        elif data_parallel is None or data_parallel in ON_DEVICES:   # (reduced there)
            host.append(Accumulate(layers))
    if backward and streamed and gathers:
        host.append(AllGather(backward[-1]))
    if not train:
        host.append(Commit())
    if spec is not None and spec.steps:
        if spec.clip:
            host.append(ClipGradNorm())
        if spec.scaler:
            host.append(ScalerStep())
        elif spec.mode == "async":
            host.append(QueueUpdate())
        elif not streamed:   # (sharded: each stage's shards gathered once stepped)
            host += [a for layers in backward
                     for a in (OptimizerStep(layers),) + ((AllGather(layers),) if gathers else ())]
    if data_parallel in ZERO3:
        host.append(Barrier())
    return tuple(host)


class _Emitter:
    """Turns per-device job lists ``[(stage, microbatches)]`` into a Program."""

    def __init__(self, G: int, M: int, stages: tuple[StageSpec, ...], values: Values,
                 run_type: RunType, grain: str, host: tuple[Action, ...],
                 data_parallel: DataParallelMode | None = None, gather: bool = False):
        self.G, self.M, self.stages, self.values = G, M, stages, values
        self.gather = gather
        self.run_type, self.grain, self.host = run_type, grain, host
        self.reduce = None if data_parallel not in ON_DEVICES else \
            DeviceReduceScatter if data_parallel in SHARDED_ON_DEVICES else DeviceAllReduce
        self.accumulated = data_parallel is not None and data_parallel.endswith("_accumulated")

    def __call__(self, jobs: list[list[tuple[int, list[int]]]], partial: bool = False) -> Program:
        merged = []
        for device_jobs in jobs:
            m: list[tuple[int, list[int]]] = []   # consecutive jobs of a stage merged
            for s, mbs in device_jobs:
                if m and m[-1][0] == s:
                    m[-1] = (s, m[-1][1] + mbs)
                else:
                    m.append((s, list(mbs)))
            merged.append(m)
        placement = [[(s, mb) for s, mbs in device_jobs for mb in mbs] for device_jobs in merged]
        # a partial Program (the rounds placed so far, for timing the next) delivers no
        # outputs and has no host lane: only its devices' timing matters
        outputs = () if partial else self.values.outputs
        v = self.values
        flow = dataflow(self.stages, placement, v.inputs, outputs, self.run_type, v.input_grads)
        actions = tuple(tuple(self._device(merged[d], flow)) for d in range(self.G))
        return Program(self.G, self.M, self.stages, actions, () if partial else self.host,
                       v.inputs, outputs, v.input_grads, v.shared)

    def _inputs(self, key: Key, flow: Dataflow) -> list[Action]:
        acts: list[Action] = []
        if flow.needs_upload(key):
            acts.append(Upload(*key))
        if flow.needs_upload_grad(key):
            acts.append(UploadGrad(*key))
        return acts

    def _prefetch(self, s: int) -> list[Action]:
        return [Prefetch(s), DeviceAllGather(s)] if self.gather else [Prefetch(s)]

    def _compute(self, s: int, m: int) -> list[Action]:
        st = self.stages[s]
        if st.kind == "fwd":
            return [Forward(s, m)]
        if st.kind == "fused":
            return [FusedBackward(s, m)]
        if self.grain == "layer" and len(st.layers) > 1:
            return [Checkpoint(s, m)] + [RecomputeBackward(s, m, i) for i in reversed(st.layers)]
        return [RecomputeBackward(s, m)]

    def _device(self, merged: list[tuple[int, list[int]]], flow: Dataflow) -> list[Action]:
        acts: list[Action] = []
        if merged:
            acts += self._prefetch(merged[0][0])
            acts += self._inputs((merged[0][0], merged[0][1][0]), flow)
        for j, (s, mbs) in enumerate(merged):
            kind = self.stages[s].kind
            for k, m in enumerate(mbs):
                acts += self._compute(s, m)
                if flow.needs_offload((s, m)):
                    acts.append(Offload(s, m))
                if flow.needs_free((s, m), kind):
                    acts.append(Free(s, m))
                if k == 0 and j + 1 < len(merged):
                    acts += self._prefetch(merged[j + 1][0])
                if k + 1 < len(mbs):
                    acts += self._inputs((s, mbs[k + 1]), flow)
                elif j + 1 < len(merged):
                    acts += self._inputs((merged[j + 1][0], merged[j + 1][1][0]), flow)
            if kind != "fwd":
                if self.reduce is not None:
                    acts.append(self.reduce(s, self.accumulated))
                acts.append(DownloadGrads(s))
            acts.append(Release(s))
        return acts
