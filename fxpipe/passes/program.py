"""Program: everything one call runs, per device and on the host, as a printable value.

A ``Program`` holds the stages (each a ``StageSpec``: kind, layer range, and the values it
reads and makes), the model's inputs (on the host when the call starts) and the outputs
the host gets, and the actions: per device an ordered tuple, plus the host's own lane
(optimizer steps, the asynchronous update, the commit). It prints as a table, one row
per step and one column per lane, and parses back::

    >>> from fxpipe.passes.schedule import build_program
    >>> p = build_program([range(0, 2)], [range(2, 3), range(0, 2)], "fused", 2, 1, "stage")
    >>> print(p)
    program devices=2 microbatches=1
    inputs input <label>
    stage 0 fwd 0:2 reads=input makes=l1
    stage 1 fused 2:3 reads=l1,<label> makes=l2
    stage 2 bwd 0:2 reads=input makes=l1
    step d0  d1   host
    0    0P  1P   RF
    1    0U0 1U0  M2:3
    2    0F0 1FB0 M0:2
    3    0O0 1O0  C
    4    0X0 1X0  .
    5    2P  1D   .
    6    2U0 1R   .
    7    2G0 .    .
    8    0R  .    .
    9    2B0 .    .
    10   2X0 .    .
    11   2D  .    .
    12   2R  .    .
    >>> Program.parse(str(p)) == p
    True

Stages are indexed in execution order: forward stages ``0 .. F-1``, then backward stages
``F .. F+B-1`` (deep to shallow). In a ``"fused"`` program the first backward stage is
``fused``: it runs the tail layers forward, the loss and the backward with no recompute.
Every other backward stage (``bwd``) recomputes its layers from their saved inputs, then
back-propagates. A stage's ``reads`` are the values its compute reads (for the fused
stage: also the model outputs made earlier, which the loss reads, and the loss's label,
``LABEL``); its ``makes`` are the
values it makes for later stages or the output (for a ``bwd`` stage: the recomputed
values whose gradients it takes in).

Actions (``str`` in brackets; ``s`` stage, ``m`` microbatch; the stream it runs on)::

    Prefetch(s)             [sP]    the stage's parameters to the device         prefetch
    Upload(s, m)            [sUm]   the values (s, m) reads from the host         h2d
    GraphUpload(s, m)       [sUmg]  the same, into the input slot its graph job   h2d
                                    reads (microbatch parity m % 2: cudagraphs)
    UploadGrad(s, m)        [sGm]   the host's gradient parts of its values       h2d
    Forward(s, m)           [sFm]   forward of a fwd stage                        compute
    GraphForward(s, m)      [sFmg]  the same, as a device graph (captured at its  compute
                                    key's first run, then replayed: cudagraphs)
    FusedBackward(s, m)     [sFBm]  tail forward + loss, then backward            compute
    RecomputeBackward(s, m) [sBm]   recompute, then backward                      compute
    GraphRecomputeBackward(s, m) [sBmg] the same, as a device graph               compute
    Checkpoint(s, m)        [sKm]   layer grain: forward keeping layer inputs     compute
    RecomputeBackward(s, m, i) [sBm.i] layer grain: recompute + backward, layer i compute
    Offload(s, m)           [sOm]   values (fwd, fused) / input gradients → host  d2h
    Free(s, m)              [sXm]   drop the values and gradients (s, m) was last  free
                                    to use on the device
    DownloadGrads(s)        [sD]    parameter gradients → host, then their        grads
                                    device buffers are freed
    DeviceReduceScatter(s)  [sRS]   ``data_parallel="device"``: the stage's       collective
                                    gradients on this device reduce-scattered
                                    with the same device of every rank; ``sD``
                                    then brings this rank's 1/N. ``sRS+``: after
                                    calls that did not synchronize, the host's
                                    ``.grad`` of the stage's parameters is
                                    uploaded and added first
    DeviceAllReduce(s)      [sAR]   ``data_parallel="device"``, a call that       collective
                                    does not step sharded: the stage's gradients
                                    averaged in place across the ranks; ``sD``
                                    brings them whole (``sAR+``: with ``.grad``)
    DeviceAllGather(s)      [sAG]   ``data_parallel="zero3"``: after ``sP``       collective
                                    uploaded this rank's 1/N of the stage's
                                    parameters, the rest gathered from the same
                                    device of every rank
    Release(s)              [sR]    free the stage's parameters                   control
    Refresh()               [RF]    the copies uploads read made current (casts,  host
                                    snapshot); the buffers saved for a failure
    AsyncUpdate()           [A]     apply the previous call's optimizer update    host
    OptimizerStep(layers)   [Sa:b]  step the parameters of ``layers``             host
    Accumulate(layers)      [Ma:b]  add their downloaded gradients to the call's  host
                                    sums (no step takes them)
    Commit()                [C]     outputs merged; gradients to ``.grad`` and     host
                                    buffer updates to the model, all or nothing
    ClipGradNorm()          [N]     after C: ``clip_grad_norm_`` (or, after       host
                                    speculative steps, the check and the redo;
                                    sharded: the ranks' norms all-gathered, a
                                    redo's shards all-gathered again)
    ScalerStep()            [SS]    after C: ``scaler.step(optimizer)``           host
    QueueUpdate()           [Q]     after C: keep this call's update for the next host
    BroadcastBuffers()      [BC]    data parallel: the buffers from rank 0 to     collective
                                    every rank (``broadcast_buffers``)
    AllReduce(layers)       [ARa:b] data parallel: average the gradients of the   collective
                                    parameters ``OptimizerStep(layers)`` steps
                                    (the stage's bucket) across ranks
    ReduceScatter(layers)   [RSa:b] ``shard_optimizer``: each rank gets the       collective
                                    average of its 1/N of that bucket
    AllGather(layers)       [AGa:b] ``shard_optimizer``: the stepped shards into  collective
                                    every rank's parameters
    Barrier()               [SY]    ``data_parallel="zero3"``, last: every rank   collective
                                    wrote what it stepped into the parameters
                                    the ranks share

The host lane has two streams: ``host`` (refresh, optimizer, accumulation, commit) and
``collective`` (the collectives, in the same order on every rank, so that they match).
The ``Commit`` and what follows it run once every other action of the call has ended,
on the caller's thread, in lane order.

What each transfer moves and each ``Free`` drops is a function of the Program alone
(``Program.flow``, see :func:`dataflow`): a value a stage reads comes from the device
when a compute of the same device made it earlier in the same phase (a hand-off), else
from the host, where its maker's ``Offload`` put it. Backward stages always read their
saved inputs from the host. A value's gradient goes to the stage that recomputes it
(``makes`` it): on the device when that stage runs on the same device, else through
the host (``Offload``, then ``UploadGrad``); gradients of model inputs go to the host.

Dependency rules (``Program.dependencies()`` derives them; the executor and the
simulator both follow them, nothing else orders actions):

1. Streams are FIFO: an action starts after the previous action of the same stream on
   the same device (or the host) ended.
2. Issue: ``Prefetch``/``Upload``/``UploadGrad`` start no earlier than the start of the
   latest compute listed before them. Builders place the prefetch of a device's next
   stage after the first compute of its current stage (so it overlaps that stage,
   docs/design.md, rule 2) and the inputs of the next compute after the current compute (one
   microbatch of look-ahead).
3. Residency: a ``Prefetch`` starts after every ``Release`` listed before it, and after
   the host's ``Refresh`` (and ``BroadcastBuffers``, when there is one); a compute needs the latest
   ``Prefetch`` of its stage listed before it (not released).
4. Inputs: the first compute of ``(s, m)`` needs ``Upload(s, m)`` listed before it when
   it reads anything from the host, and the compute that made each value it takes over
   on the device. ``Upload(s, m)`` waits for the ``Offload`` of each value's maker (on
   any device; a ``hop`` when the devices differ). A ``GraphUpload(s, m)`` also waits for
   the end of job ``(s, m - 2)`` on its device, the last reader of the slot it writes.
5. Gradients: the backward part of ``(s, m)`` needs ``UploadGrad(s, m)`` when gradient
   parts of its values come through the host, and the computes that made the parts on
   its device. ``UploadGrad`` waits for the ``Offload``s that put the parts there; in a
   ``"train"`` program, the gradients of the model outputs come from the host once
   every microbatch's outputs are there (the user's loss runs in between).
6. ``Offload(s, m)`` waits for the last compute of ``(s, m)``; ``Free(s, m)`` for it,
   for ``Offload(s, m)`` and for the ``Offload`` of each value it drops.
7. ``DownloadGrads(s)`` and ``Release(s)`` wait for the last compute of ``s`` since its
   ``Prefetch`` (``Release`` also for the ``DownloadGrads``); ``OptimizerStep(layers)``
   for every ``DownloadGrads`` of its stage and of the stages sharing a parameter it
   steps (``Program.shared``: a parameter shared by several backward stages is stepped
   with the last of them); ``Accumulate(layers)`` for those of its stage; ``Commit``
   for the last action of every stream of its phase, and what follows it in the host
   lane for the ``Commit`` (stream order).
8. Data parallel: ``AllReduce(layers)`` and ``ReduceScatter(layers)`` wait for the
   downloads ``OptimizerStep(layers)`` would (rule 7), the ``OptimizerStep`` of the same
   layers for them, ``AllGather(layers)`` for that ``OptimizerStep``. A device's
   ``DeviceReduceScatter(s)`` (or ``DeviceAllReduce(s)``) waits for what its
   ``DownloadGrads(s)`` would (rule 7), and that download for it. A
   ``DeviceAllGather(s)`` waits for its ``Prefetch(s)``; the stage's computes, its
   collectives, ``DownloadGrads(s)`` and ``Release(s)`` wait for it.

A two-part compute (``FusedBackward``: tail forward then backward;
``RecomputeBackward``: recompute then backward) has its ``grad`` dependencies gate only
its backward part; everything else gates its start.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Sequence

from fxpipe.passes.actions import (  # noqa: F401 — the vocabulary, re-exported
    HOST, LABEL, STREAM, Accumulate, Action, AfterCommit, AllGather, AllReduce, AsyncUpdate,
    BroadcastBuffers, CallSpec, Checkpoint, ClipGradNorm, Collective, Commit, Compute, Dep,
    Barrier, DeviceAllGather, DeviceAllReduce, DeviceReduce, DeviceReduceScatter, DownloadGrads,
    Forward, Free, FusedBackward, GraphForward, GraphRecomputeBackward, GraphUpload, HostAction, Key, Offload, OptimizerSpec, OptimizerStep, Prefetch, QueueUpdate,
    RecomputeBackward, ReduceScatter, Refresh, Release, ScalerStep, StageKind, StageSpec, Upload,
    UploadGrad, parse_action, stream_of,
)
from fxpipe.passes.dependencies import check_issue_order, dependencies, order
from fxpipe.passes.program_text import parse_program, program_text
from fxpipe.stage_plan import RunType

# ----------------------------------------------------------------------------- dataflow



@dataclass(frozen=True)
class Dataflow:
    """What each action of a Program moves or drops, by ``(stage, microbatch)``.

    ``upload``: values ``Upload`` copies from the host; ``handoff``: ``(value, maker)``
    taken over on the device; ``offload``: values ``Offload`` copies to the host;
    ``offload_grads``: gradients ``Offload`` moves to the host (those present);
    ``upload_grads``: values whose host gradient parts ``UploadGrad`` copies;
    ``sends_grads``: the values read by a backward compute whose gradients someone takes
    (the stage recomputing them, or the host for inputs that require grad);
    ``grad_parts``: ``(value, producer stage)`` gradient parts made on the same device;
    ``host_grad_parts``: those that come through the host; ``free``: values made on the
    device that ``Free`` drops (with the copies ``Upload`` made for it, and the gradients
    its compute consumed); ``maker``: the stage making each value.
    """

    upload: dict[Key, tuple[str, ...]]
    handoff: dict[Key, tuple[tuple[str, int], ...]]
    offload: dict[Key, tuple[str, ...]]
    offload_grads: dict[Key, tuple[str, ...]]
    upload_grads: dict[Key, tuple[str, ...]]
    sends_grads: dict[Key, tuple[str, ...]]
    grad_parts: dict[Key, tuple[tuple[str, int], ...]]
    host_grad_parts: dict[Key, tuple[tuple[str, int], ...]]
    free: dict[Key, tuple[str, ...]]
    maker: dict[str, int]

    def needs_upload(self, key: Key) -> bool:
        return bool(self.upload.get(key))

    def needs_upload_grad(self, key: Key) -> bool:
        return bool(self.upload_grads.get(key))

    def needs_offload(self, key: Key) -> bool:
        return bool(self.offload.get(key) or self.offload_grads.get(key))

    def needs_free(self, key: Key, kind: StageKind) -> bool:
        return bool(self.upload.get(key) or self.free.get(key) or self.offload_grads.get(key)
                    or (kind == "bwd" and (self.grad_parts.get(key) or self.upload_grads.get(key))))


def dataflow(stages: Sequence[StageSpec], placement: Sequence[Sequence[Key]],
             inputs: Sequence[str], outputs: Sequence[str], run_type: RunType,
             input_grads: Sequence[str] = ()) -> Dataflow:
    """Decide, for computes placed on devices in the order ``placement[d]``, where each
    value and gradient comes from and goes to (see the module docstring). ``input_grads``:
    the model inputs whose gradients the host takes (inputs that require grad).

    >>> st = (StageSpec(0, "fwd", range(0, 1), ("x",), ("a",)),
    ...       StageSpec(1, "fwd", range(1, 2), ("a", "x"), ("b",)))
    >>> f = dataflow(st, [[(0, 0), (1, 0)]], ["x"], ["b"], "infer")
    >>> f.upload[(1, 0)], f.handoff[(1, 0)], f.offload[(1, 0)], f.free[(1, 0)]
    (('x',), (('a', 0),), ('b',), ('a', 'b'))
    """
    inputs, outputs = set(inputs), tuple(outputs)
    where = {key: d for d, keys in enumerate(placement) for key in keys}
    pos = {key: i for keys in placement for i, key in enumerate(keys)}
    maker: dict[str, int] = {}
    consumer: dict[str, int] = {}   # value -> the bwd stage that recomputes it
    for st in stages:
        table = consumer if st.kind == "bwd" else maker
        for v in st.makes:
            if v in table:
                raise ValueError(f"stage {st.index} makes {v!r}, which stage {table[v]} "
                                 "makes too")
            table[v] = st.index
    upload: dict[Key, tuple[str, ...]] = {}
    handoff: dict[Key, tuple[tuple[str, int], ...]] = {}
    on_host: dict[Key, set[str]] = {}
    last_use: dict[tuple[str, int, int], Key] = {}   # (value, mb, device) -> last user
    for d, keys in enumerate(placement):
        for key in keys:
            s, m = key
            st = stages[s]
            up, hand = [], []
            for v in st.reads:
                p = maker.get(v)
                if (st.kind != "bwd" and p is not None and where.get((p, m)) == d
                        and pos[(p, m)] < pos[key]):
                    hand.append((v, p))
                    last_use[(v, m, d)] = key
                    continue
                if v not in inputs:
                    if p is None:
                        raise ValueError(f"stage {s} reads {v!r}, which no forward stage makes "
                                         "and is not a model input")
                    on_host.setdefault((p, m), set()).add(v)
                up.append(v)
            upload[key], handoff[key] = tuple(up), tuple(hand)
            if st.kind != "bwd":
                for v in st.makes:
                    last_use.setdefault((v, m, d), key)
    for v in outputs:
        if v in inputs:
            continue
        if v not in maker:
            raise ValueError(f"output {v!r} is made by no forward stage")
        for m in range(1 + max((mb for _, mb in where), default=-1)):
            if (maker[v], m) in where:
                on_host.setdefault((maker[v], m), set()).add(v)
    offload = {key: tuple(v for v in stages[key[0]].makes if v in vs)
               for key, vs in on_host.items()}
    free: dict[Key, list[str]] = {}
    for (v, m, d), key in last_use.items():
        free.setdefault(key, []).append(v)
    offload_grads: dict[Key, list[str]] = {}
    sends: dict[Key, list[str]] = {}
    grad_parts: dict[Key, list[tuple[str, int]]] = {}
    host_parts: dict[Key, list[tuple[str, int]]] = {}
    for key, d in where.items():
        s, m = key
        if stages[s].kind == "fwd":
            continue
        for v in stages[s].reads:
            c = (HOST if v in input_grads else None) if v in inputs else consumer.get(v)
            if c is None:
                continue
            sends.setdefault(key, []).append(v)
            if c == HOST or where.get((c, m)) != d:
                offload_grads.setdefault(key, []).append(v)
                if c != HOST:
                    host_parts.setdefault((c, m), []).append((v, s))
            else:
                grad_parts.setdefault((c, m), []).append((v, s))
    upload_grads: dict[Key, tuple[str, ...]] = {}
    for key in where:
        st = stages[key[0]]
        if st.kind != "bwd":
            continue
        via_host = {v for v, _ in host_parts.get(key, ())}
        if run_type == "train":
            via_host |= set(outputs) & set(st.makes)
        upload_grads[key] = tuple(v for v in st.makes if v in via_host)
    return Dataflow(upload=upload, handoff=handoff, offload=offload,
                    offload_grads={k: tuple(v) for k, v in offload_grads.items()},
                    upload_grads=upload_grads, sends_grads={k: tuple(v) for k, v in sends.items()},
                    grad_parts={k: tuple(v) for k, v in grad_parts.items()},
                    host_grad_parts={k: tuple(v) for k, v in host_parts.items()},
                    free={k: tuple(v) for k, v in free.items()}, maker=maker)


# ----------------------------------------------------------------------------- program

@dataclass(frozen=True)
class Program:
    """Per-device action lists and the host lane over a chain of stages (see the module
    docstring). ``inputs``: values on the host when the call starts; ``outputs``: values
    the host gets (a ``"train"`` program gets their gradients back from the host);
    ``input_grads``: the inputs whose gradients the host takes; ``shared``: groups of
    backward stages that share a parameter (the parameters each backward stage owns are on
    its ``StageSpec``: :attr:`owns`)."""

    num_devices: int
    num_microbatches: int
    stages: tuple[StageSpec, ...]
    actions: tuple[tuple[Action, ...], ...]
    host: tuple[Action, ...] = ()
    inputs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()
    input_grads: tuple[str, ...] = ()
    shared: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        if len(self.actions) != self.num_devices:
            raise ValueError(f"Program has {len(self.actions)} action lists for "
                             f"{self.num_devices} devices")
        for i, st in enumerate(self.stages):
            if st.index != i:
                raise ValueError(f"stage {st} is listed at position {i}: stages must be in "
                                 "execution order")
        for d, acts in enumerate(self.actions):
            for i, a in enumerate(acts):
                if isinstance(a, HostAction):
                    raise ValueError(f"device {d} step {i}: {a} is a host action; list it in "
                                     "the host lane")
        committed = False
        for i, a in enumerate(self.host):
            if not isinstance(a, HostAction):
                raise ValueError(f"host step {i}: {a} runs on a device, not on the host")
            if isinstance(a, AfterCommit) and not committed:
                raise ValueError(f"host step {i}: {a} reads every .grad: list it after the "
                                 "Commit")
            if isinstance(a, (Refresh, AsyncUpdate)) and committed:
                raise ValueError(f"host step {i}: {a} must come before the Commit")
            committed = committed or isinstance(a, Commit)

    # -- lanes and stage relations ----------------------------------------------------
    def lane(self, lane: int) -> tuple[Action, ...]:
        """Device ``lane``'s actions, or the host's (``HOST``)."""
        return self.host if lane == HOST else self.actions[lane]

    def lanes(self) -> list[tuple[int, tuple[Action, ...]]]:
        """``(lane, actions)`` for every device, then the host."""
        return [*enumerate(self.actions), (HOST, self.host)]

    @cached_property
    def waited_across(self) -> frozenset[tuple[int, int]]:
        """``(lane, step)`` of the actions an action of another lane depends on: only
        their issue is waited for across issue threads (a lane issues in order)."""
        return frozenset((dep.device, dep.step) for lane, steps in self.dependencies().items()
                         for deps in steps for dep in deps if dep.device != lane)

    @cached_property
    def labels(self) -> dict[int, tuple[str, ...]]:
        """Each lane's actions as the runtime labels them (``str(action)``), made once."""
        return {lane: tuple(map(str, acts)) for lane, acts in self.lanes()}

    @cached_property
    def backward_stage_of(self) -> dict[tuple[int, int], int]:
        """The backward (or fused) stage of each ``(start, stop)`` of layers."""
        return {(st.layers.start, st.layers.stop): st.index for st in self.stages
                if st.kind != "fwd"}

    @property
    def owns(self) -> tuple[tuple[str, ...], ...]:
        """Per stage, the parameters (names) it owns (``StageSpec.owns``): empty for a
        forward stage and for a Program built without a model."""
        return tuple(st.owns for st in self.stages)

    @cached_property
    def num_forward_stages(self) -> int:
        return sum(st.kind == "fwd" for st in self.stages)

    @property
    def run_type(self) -> RunType:
        if any(st.kind == "fused" for st in self.stages):
            return "fused"
        return "train" if any(st.kind == "bwd" for st in self.stages) else "infer"

    def input_of(self, stage: int) -> int:
        """The stage holding the layer before ``stage``'s first one, or ``HOST``: what a
        layer chain reads (the simulator's view of activation bytes).

        >>> from fxpipe.passes.schedule import build_program
        >>> p = build_program([range(0, 2), range(2, 4)], [range(4, 5), range(1, 4),
        ...                   range(0, 1)], "fused", 2, 1, "stage")
        >>> [p.input_of(s) for s in range(5)]     # stage 3 = layers 1:4 reads layer 0's output
        [-1, 0, 1, 0, -1]
        """
        return self._inputs[stage]

    @cached_property
    def _inputs(self) -> tuple[int, ...]:
        holder = {i: fs.index for fs in self.stages[: self.num_forward_stages] for i in fs.layers}
        out = []
        for st in self.stages:
            if st.kind != "bwd":
                out.append(st.index - 1 if st.index > 0 else HOST)
            elif st.layers.start == 0:
                out.append(HOST)
            elif st.layers.start - 1 in holder:
                out.append(holder[st.layers.start - 1])
            else:
                raise ValueError(f"stage {st}: no forward stage produces the input of "
                                 f"layer {st.layers.start}")
        return tuple(out)

    def grad_of(self, stage: int) -> int | None:
        """The backward stage before ``stage`` (whose input gradient a layer chain's
        ``stage`` takes in), ``HOST`` (first bwd stage of a train program) or None."""
        if self.stages[stage].kind != "bwd":
            return None
        return stage - 1 if self.stages[stage - 1].kind != "fwd" else HOST

    def saved_inputs_of(self, stage: int) -> list[int]:
        """The bwd stages whose saved input is produced by fwd stage ``stage``."""
        return [st.index for st in self.stages
                if st.kind == "bwd" and st.layers.start > 0 and self.input_of(st.index) == stage]

    def placement(self) -> list[list[Key]]:
        """Per device, its ``(stage, microbatch)`` compute jobs in order."""
        out: list[list[Key]] = []
        for acts in self.actions:
            keys: list[Key] = []
            for a in acts:
                if isinstance(a, Compute) and (a.stage, a.mb) not in keys[-1:]:
                    keys.append((a.stage, a.mb))
            out.append(keys)
        return out

    @cached_property
    def flow(self) -> Dataflow:
        """What each action moves or drops (:func:`dataflow` over this Program)."""
        return dataflow(self.stages, self.placement(), self.inputs, self.outputs, self.run_type,
                        self.input_grads)

    # -- text -----------------------------------------------------------------------
    def __str__(self) -> str:
        return program_text(self)

    @classmethod
    def parse(cls, text: str) -> Program:
        """Inverse of ``str(program)``."""
        return parse_program(cls, text)

    # -- checks ---------------------------------------------------------------------
    def validate(self) -> None:
        """Raise ``ValueError`` unless every (stage, microbatch) runs exactly once with
        the compute actions its stage kind needs (at layer grain: a ``Checkpoint``, then
        each layer's backward, deepest first), and ``dependencies()`` resolves."""
        want = {"fwd": Forward, "fused": FusedBackward, "bwd": RecomputeBackward}
        seen: dict[Key, list] = {}
        for d, acts in enumerate(self.actions):
            for a in acts:
                if isinstance(a, Compute):
                    if not 0 <= a.stage < len(self.stages):
                        raise ValueError(f"device {d}: {a} names stage {a.stage}, "
                                         f"the program has {len(self.stages)} stages")
                    st = self.stages[a.stage]
                    if not isinstance(a, (want[st.kind], Checkpoint)) or (
                            isinstance(a, Checkpoint) and st.kind != "bwd"):
                        raise ValueError(f"device {d}: {a} on a {st.kind} stage; expected "
                                         f"{want[st.kind].__name__}")
                    seen.setdefault((a.stage, a.mb), []).append(a)
        for st in self.stages:
            for mb in range(self.num_microbatches):
                got = seen.get((st.index, mb), [])
                if len(got) > 1 and not isinstance(got[0], Checkpoint):
                    raise ValueError(f"stage {st.index} microbatch {mb} runs {len(got)} times; "
                                     "expected once")
                if not got:
                    raise ValueError(f"stage {st.index} microbatch {mb} runs 0 times; "
                                     "expected once")
                if isinstance(got[0], Checkpoint):
                    layers = [a.layer for a in got[1:]]
                    if layers != list(reversed(st.layers)):
                        raise ValueError(f"stage {st.index} microbatch {mb}: after {got[0]} "
                                         f"each layer's backward must run once, deepest first "
                                         f"({list(reversed(st.layers))}); got {layers}")
        self.dependencies()

    def dependencies(self) -> dict[int, tuple[tuple[Dep, ...], ...]]:
        """For each lane (device index, or ``HOST``) and step, the ``Dep``s of that
        action (module docstring rules).

        Raises ``ValueError`` naming the lane, step and action when an action's
        parameters or inputs are not provided by the Program.
        """
        return self._dependencies

    @cached_property
    def _dependencies(self) -> dict[int, tuple[tuple[Dep, ...], ...]]:
        return dependencies(self)

    def step_stages(self, step: OptimizerStep | AllReduce | ReduceScatter) -> tuple[int, ...]:
        """The backward stages whose gradients ``step`` needs: the stage of its layers, and
        every stage sharing a parameter with it when it is the last of them (rule 7). The
        parameters it steps (or reduces) are those of the stage that it is the last
        backward stage to use."""
        s = self.backward_stage_of.get((step.layers.start, step.layers.stop))
        if s is None:
            raise ValueError(f"{step} names no backward stage's layers")
        waits = {s}
        for group in self.shared:
            if max(group) == s:
                waits.update(group)
        return tuple(sorted(waits))

    def _phase_of(self, a: Action) -> str:
        """``"forward"`` or ``"backward"`` in a ``"train"`` program (its two calls); else
        ``"all"``. ``Commit`` (and ``BroadcastBuffers``) belong to the forward call: the
        backward's gradients go to autograd."""
        if self.run_type != "train":
            return "all"
        if isinstance(a, (Commit, BroadcastBuffers, Refresh)):
            return "forward"
        if isinstance(a, HostAction):
            return "backward"
        return "forward" if self.stages[a.stage].kind == "fwd" else "backward"

    def order(self, phase: str = "all") -> list[tuple[int, int]]:
        """Every ``(lane, step)`` of ``phase`` in one order its dependencies allow (each
        after what it waits for and after its lane's earlier actions), as one thread
        could run them: what ``print(pipe)`` lists (:func:`passes.dependencies.order`).

        >>> from fxpipe.passes.schedule import build_program
        >>> p = build_program([range(0, 1), range(1, 2)], [], "infer", 2, 1, "stage")
        >>> " ".join(str(p.lane(lane)[i]) for lane, i in p.order())
        'RF 0P 1P 0U0 0F0 0O0 0X0 1U0 0R 1F0 1O0 1X0 1R C'
        """
        return order(self, phase)

    def action_strings(self, phase: str | None = None) -> list[tuple[int, str]]:
        """``(lane, str(action))`` of every action (of one ``phase``, if given): what a
        ``pipe.trace()`` of the call records as ``rec.actions``, as a multiset."""
        return [(lane, str(a)) for lane, acts in self.lanes() for a in acts
                if phase is None or self.phase(a) == phase]

    def issued(self, phase: str) -> dict[int, tuple[bool, ...]]:
        """Per lane, which of its actions a call of ``phase`` issues (``"all"``: every
        one), checked once per phase: each lane can be issued in list order (no action
        depends on one listed after it in its lane, no dependency cycle; else an issue
        thread would wait forever)."""
        if phase not in self._issued:
            keep = {lane: tuple(phase == "all" or self.phase(a) == phase for a in acts)
                    for lane, acts in self.lanes()}
            check_issue_order(self, self.dependencies(), keep)
            self._issued[phase] = keep
        return self._issued[phase]

    @cached_property
    def _issued(self) -> dict[str, dict[int, tuple[bool, ...]]]:
        return {}

    def phase(self, a: Action) -> str:
        """The call that runs ``a``: ``"all"``, or in a ``"train"`` program
        ``"forward"`` (``pipe(x)``) or ``"backward"`` (``.backward()``)."""
        return self._phase_of(a)


