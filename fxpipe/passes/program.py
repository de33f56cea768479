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
    UploadGrad(s, m)        [sGm]   the host's gradient parts of its values       h2d
    Forward(s, m)           [sFm]   forward of a fwd stage                        compute
    FusedBackward(s, m)     [sFBm]  tail forward + loss, then backward            compute
    RecomputeBackward(s, m) [sBm]   recompute, then backward                      compute
    Checkpoint(s, m)        [sKm]   layer grain: forward keeping layer inputs     compute
    RecomputeBackward(s, m, i) [sBm.i] layer grain: recompute + backward, layer i compute
    Offload(s, m)           [sOm]   values (fwd, fused) / input gradients → host  d2h
    Free(s, m)              [sXm]   drop the values and gradients (s, m) was last  free
                                    to use on the device
    DownloadGrads(s)        [sD]    parameter gradients → host, then their        grads
                                    device buffers are freed
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
                                    speculative steps, the check and the redo)
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
   DESIGN rule 2) and the inputs of the next compute after the current compute (one
   microbatch of look-ahead).
3. Residency: a ``Prefetch`` starts after every ``Release`` listed before it, and after
   the host's ``Refresh`` (and ``BroadcastBuffers``, when there is one); a compute needs the latest
   ``Prefetch`` of its stage listed before it (not released).
4. Inputs: the first compute of ``(s, m)`` needs ``Upload(s, m)`` listed before it when
   it reads anything from the host, and the compute that made each value it takes over
   on the device. ``Upload(s, m)`` waits for the ``Offload`` of each value's maker (on
   any device; a ``hop`` when the devices differ).
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
   layers for them, ``AllGather(layers)`` for that ``OptimizerStep``.

A two-part compute (``FusedBackward``: tail forward then backward;
``RecomputeBackward``: recompute then backward) has its ``grad`` dependencies gate only
its backward part; everything else gates its start.
"""

from __future__ import annotations

import heapq
import re
from dataclasses import dataclass
from functools import cached_property
from typing import Literal, Sequence, Union

from fxpipe.stage_plan import RunType

StageKind = Literal["fwd", "bwd", "fused"]
HOST = -1
LABEL = "<label>"
"""The value a ``"fused"`` Program's fused stage reads as its loss's label: a model input
of the Program (on the host when the call starts), uploaded to the device with the
stage's other inputs, like them (a GPU's loss cannot read a label left on the host)."""
"""Lane and producer index meaning "the host" (model inputs, the user's loss gradient,
the optimizer and commit actions)."""


@dataclass(frozen=True, slots=True)
class OptimizerSpec:
    """What a call's optimizer puts in its Program's host lane (``passes.schedule.host_lane``).

    ``mode="exact"``: the optimizer's own step, stepped in the call (``"async"``: the
    previous call's update applied at its start, ``A``, and this call's queued, ``Q``).
    ``steps``: whether this call steps (an accumulating call does not; with
    ``"async"`` it still applies the pending update). ``clip``: ``max_grad_norm``
    (``N``); ``speculate``: with ``clip``, step each stage as its gradients are final
    and check the norm after the ``Commit``. ``scaler``: a ``GradScaler`` step after the
    ``Commit`` (``SS``: its inf check needs every gradient).

    >>> str(OptimizerSpec()), str(OptimizerSpec(clip=True, speculate=False))
    ('exact', 'exact+clip')
    """

    mode: Literal["exact", "async"] = "exact"
    steps: bool = True
    clip: bool = False
    speculate: bool = True
    scaler: bool = False

    def __post_init__(self) -> None:
        if self.mode not in ("exact", "async"):
            raise ValueError(f"optimizer mode must be 'exact' or 'async', got {self.mode!r}")
        if self.scaler and self.mode == "async":
            raise ValueError("a GradScaler step with mode='async' is not supported")

    @property
    def streamed(self) -> bool:
        """Whether each backward stage is stepped as soon as its gradients are final,
        during the backward (an ``OptimizerStep`` before the ``Commit``)."""
        return (self.mode == "exact" and self.steps and not self.scaler
                and (not self.clip or self.speculate))

    def __str__(self) -> str:
        text = self.mode + ("" if self.steps else "+accumulate")
        if self.clip:
            text += "+clip" + ("(speculate)" if self.streamed else "")
        return text + ("+scaler" if self.scaler else "")


@dataclass(frozen=True)
class CallSpec:
    """Everything that decides which Executable (stages and Program) a call runs: the
    compiler builds one per CallSpec and plan (``fxpipe.api``), and ``pipe.program()``
    prints the one a call with the same spec runs.

    ``outputs``: whether the host gets the model's outputs (always, but for a
    ``"fused"`` call without ``return_outputs``); ``input_grads``: the model inputs whose
    gradients go to the host (they require grad); ``data_parallel``: ``"allreduce"`` or
    ``"shard"`` collectives, ``broadcast_buffers`` the buffers' broadcast (training
    calls of a data-parallel pipe).

    >>> str(CallSpec("fused", 4, optimizer=OptimizerSpec(clip=True)))
    'fused x4 grain=stage optimizer=exact+clip(speculate)'
    >>> str(CallSpec("fused", 2, outputs=True)), CallSpec("infer", 2).outputs
    ('fused x2 grain=stage outputs', True)
    """

    run_type: RunType
    num_microbatch: int
    grain: Literal["stage", "layer"] = "stage"
    optimizer: OptimizerSpec | None = None
    outputs: bool = False
    input_grads: tuple[str, ...] = ()
    data_parallel: Literal["allreduce", "shard"] | None = None
    broadcast_buffers: bool = False

    def __post_init__(self) -> None:
        if self.run_type not in ("infer", "train", "fused"):
            raise ValueError(f"run_type must be 'infer', 'train' or 'fused', got "
                             f"{self.run_type!r}")
        if not isinstance(self.num_microbatch, int) or self.num_microbatch < 1:
            raise ValueError(f"num_microbatch must be an int >= 1, got {self.num_microbatch!r}")
        if self.grain not in ("stage", "layer"):
            raise ValueError(f"grain must be 'stage' or 'layer', got {self.grain!r}")
        if self.optimizer is not None and self.run_type != "fused":
            raise ValueError(f"optimizer steps run in fused calls only, not {self.run_type!r}")
        if (self.data_parallel is not None or self.broadcast_buffers) and \
                self.run_type == "infer":
            raise ValueError("collectives (data_parallel, broadcast_buffers) run in training "
                             "calls only, not 'infer'")
        # only a fused call can leave its outputs on the devices
        object.__setattr__(self, "outputs", self.outputs or self.run_type != "fused")
        object.__setattr__(self, "input_grads", tuple(self.input_grads))

    def __str__(self) -> str:
        parts = [f"{self.run_type} x{self.num_microbatch}", f"grain={self.grain}"]
        if self.optimizer is not None:
            parts.append(f"optimizer={self.optimizer}")
        if self.run_type == "fused" and self.outputs:
            parts.append("outputs")
        if self.input_grads:
            parts.append(f"input_grads={','.join(self.input_grads)}")
        if self.data_parallel:
            parts.append(f"data_parallel={self.data_parallel}")
        if self.broadcast_buffers:
            parts.append("broadcast_buffers")
        return " ".join(parts)


@dataclass(frozen=True, slots=True)
class StageSpec:
    """One stage of a Program: its execution-order index, kind, layer range, the values
    it reads and makes, and (a backward stage) the trainable parameters it owns: those it
    is the last backward stage (execution order) to use, which its ``OptimizerStep``
    steps and its ``AllReduce`` / ``ReduceScatter`` reduces (a tied parameter under its
    first name, with the last stage holding it). Computed once, by ``build_executable``.

    >>> str(StageSpec(3, "bwd", range(4, 6), ("l3", "mask"), ("l5",), ("4.weight",)))
    '3 bwd 4:6 reads=l3,mask makes=l5 owns=4.weight'
    """

    index: int
    kind: StageKind
    layers: range
    reads: tuple[str, ...] = ()
    makes: tuple[str, ...] = ()
    owns: tuple[str, ...] = ()

    def __str__(self) -> str:
        text = f"{self.index} {self.kind} {self.layers.start}:{self.layers.stop}"
        if self.reads:
            text += f" reads={','.join(self.reads)}"
        if self.makes:
            text += f" makes={','.join(self.makes)}"
        if self.owns:
            text += f" owns={','.join(self.owns)}"
        return text


# ----------------------------------------------------------------------------- actions

@dataclass(frozen=True, slots=True)
class Prefetch:
    """Upload stage ``stage``'s parameters to the device (``str``: ``3P``)."""
    stage: int

    def __str__(self) -> str:
        return f"{self.stage}P"


@dataclass(frozen=True, slots=True)
class Upload:
    """Copy the values ``(stage, mb)`` reads from the host to the device (``3U1``)."""
    stage: int
    mb: int

    def __str__(self) -> str:
        return f"{self.stage}U{self.mb}"


@dataclass(frozen=True, slots=True)
class UploadGrad:
    """Copy the host's gradient parts of ``(stage, mb)``'s values to the device (``3G1``)."""
    stage: int
    mb: int

    def __str__(self) -> str:
        return f"{self.stage}G{self.mb}"


@dataclass(frozen=True, slots=True)
class Forward:
    """Forward of a fwd stage on one microbatch (``3F1``)."""
    stage: int
    mb: int

    def __str__(self) -> str:
        return f"{self.stage}F{self.mb}"


@dataclass(frozen=True, slots=True)
class FusedBackward:
    """Tail forward + loss, then backward, no recompute (``3FB1``)."""
    stage: int
    mb: int

    def __str__(self) -> str:
        return f"{self.stage}FB{self.mb}"


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """``recompute_grain="layer"``: run the stage forward without grad, keeping each
    layer's inputs on the device for the per-layer backward (``3K1``)."""
    stage: int
    mb: int

    def __str__(self) -> str:
        return f"{self.stage}K{self.mb}"


@dataclass(frozen=True, slots=True)
class RecomputeBackward:
    """Recompute the stage's layers from their saved inputs, then backward (``3B1``); at
    layer grain one layer, from the inputs its ``Checkpoint`` kept (``3B1.5``)."""
    stage: int
    mb: int
    layer: int | None = None

    def __str__(self) -> str:
        return f"{self.stage}B{self.mb}" + ("" if self.layer is None else f".{self.layer}")


@dataclass(frozen=True, slots=True)
class Offload:
    """Copy ``(stage, mb)``'s values (fwd, fused) and input gradients (bwd, fused) that
    the host needs to the host (``3O1``)."""
    stage: int
    mb: int

    def __str__(self) -> str:
        return f"{self.stage}O{self.mb}"


@dataclass(frozen=True, slots=True)
class Free:
    """Drop, on the device, the values and gradients ``(stage, mb)`` was the last to use
    (``3X1``)."""
    stage: int
    mb: int

    def __str__(self) -> str:
        return f"{self.stage}X{self.mb}"


@dataclass(frozen=True, slots=True)
class DownloadGrads:
    """Bring the stage's accumulated parameter gradients to the host, then free their
    device buffers (``3D``)."""
    stage: int

    def __str__(self) -> str:
        return f"{self.stage}D"


@dataclass(frozen=True, slots=True)
class Release:
    """Free the stage's parameters on the device (``3R``)."""
    stage: int

    def __str__(self) -> str:
        return f"{self.stage}R"


@dataclass(frozen=True, slots=True)
class OptimizerStep:
    """Host: step the parameters of ``layers`` once their gradients are final (``S4:6``)."""
    layers: range

    def __str__(self) -> str:
        return f"S{self.layers.start}:{self.layers.stop}"


@dataclass(frozen=True, slots=True)
class AsyncUpdate:
    """Host: apply the previous call's optimizer update, if one is pending (``A``;
    ``fxpipe.optim``'s ``mode="async"``)."""

    def __str__(self) -> str:
        return "A"


@dataclass(frozen=True, slots=True)
class Commit:
    """Host: the call's parameter gradients to ``.grad`` and its buffer updates to the
    model, all or nothing, once everything else of its phase has run (``C``)."""

    def __str__(self) -> str:
        return "C"


@dataclass(frozen=True, slots=True)
class BroadcastBuffers:
    """Host, data parallel: the model's buffers (BatchNorm statistics...) from rank 0 to
    every rank, before any stage's parameters and buffers go to a device, as
    ``DistributedDataParallel(broadcast_buffers=True)`` does at each forward (``BC``)."""

    def __str__(self) -> str:
        return "BC"


@dataclass(frozen=True, slots=True)
class AllReduce:
    """Host, data parallel: average across ranks the gradients of the parameters
    ``OptimizerStep(layers)`` steps (that stage's bucket), once its downloads landed
    (``AR4:6``)."""
    layers: range

    def __str__(self) -> str:
        return f"AR{self.layers.start}:{self.layers.stop}"


@dataclass(frozen=True, slots=True)
class ReduceScatter:
    """Host, ``shard_optimizer``: like ``AllReduce``, but each rank gets only the average
    of its 1/N of the bucket, the part it steps (``RS4:6``)."""
    layers: range

    def __str__(self) -> str:
        return f"RS{self.layers.start}:{self.layers.stop}"


@dataclass(frozen=True, slots=True)
class AllGather:
    """Host, ``shard_optimizer``: every rank's stepped part of the bucket's parameters into
    every rank's parameters (``AG4:6``)."""
    layers: range

    def __str__(self) -> str:
        return f"AG{self.layers.start}:{self.layers.stop}"


@dataclass(frozen=True, slots=True)
class Refresh:
    """Host, first: the copies devices read the parameters from made current (the
    ``param_dtype`` casts of the masters; with an asynchronous optimizer, the snapshot
    the call's uploads read while the update steps the masters), and a copy of the
    model's buffers that a failed call puts back. Every ``Prefetch`` waits for it
    (``RF``)."""

    def __str__(self) -> str:
        return "RF"


@dataclass(frozen=True, slots=True)
class Accumulate:
    """Host: add the downloaded parameter gradients of the backward stage of ``layers`` to
    the call's sums, once its downloads landed; the ``Commit`` writes the sums to
    ``.grad`` (``M4:6``; a stage whose gradients an ``OptimizerStep`` or a collective
    takes has none)."""
    layers: range

    def __str__(self) -> str:
        return f"M{self.layers.start}:{self.layers.stop}"


@dataclass(frozen=True, slots=True)
class ClipGradNorm:
    """Host, after the ``Commit``: ``clip_grad_norm_`` over every ``.grad`` the optimizer
    steps (``max_grad_norm``; first ``scaler.unscale_``, with a ``GradScaler``). After
    speculative ``OptimizerStep``s it checks the norm instead: when clipping changes
    anything it puts the stepped parameters and state back, clips, and steps them all
    again (``N``)."""

    def __str__(self) -> str:
        return "N"


@dataclass(frozen=True, slots=True)
class ScalerStep:
    """Host, after the ``Commit``: ``scaler.step(optimizer)`` (its inf check needs every
    gradient; ``SS``)."""

    def __str__(self) -> str:
        return "SS"


@dataclass(frozen=True, slots=True)
class QueueUpdate:
    """Host, after the ``Commit``: keep this call's update (a copy of the gradients) for
    the next call's ``AsyncUpdate`` (``Q``; ``mode="async"``)."""

    def __str__(self) -> str:
        return "Q"


Action = Union[Prefetch, Upload, UploadGrad, Forward, FusedBackward, Checkpoint,
               RecomputeBackward, Offload, Free, DownloadGrads, Release, OptimizerStep,
               AsyncUpdate, Commit, BroadcastBuffers, AllReduce, ReduceScatter, AllGather,
               Refresh, Accumulate, ClipGradNorm, ScalerStep, QueueUpdate]
Compute = (Forward, FusedBackward, Checkpoint, RecomputeBackward)
Collective = (BroadcastBuffers, AllReduce, ReduceScatter, AllGather)
HostAction = (Refresh, Accumulate, OptimizerStep, AsyncUpdate, Commit, ClipGradNorm,
              ScalerStep, QueueUpdate, *Collective)
AfterCommit = (ClipGradNorm, ScalerStep, QueueUpdate)
"""Host actions that only follow a ``Commit`` (they read ``.grad``)."""
_CODES: dict[str, type] = {"P": Prefetch, "D": DownloadGrads, "R": Release, "U": Upload,
                           "G": UploadGrad, "F": Forward, "FB": FusedBackward, "K": Checkpoint,
                           "B": RecomputeBackward, "O": Offload, "X": Free}
_ACTION_RE = re.compile(r"^(\d+)(FB|[PDRUGFKBOX])(\d*)(?:\.(\d+))?$")
_HOST_RE = re.compile(r"^(S|M|AR|RS|AG)(\d+):(\d+)$")
_HOST_CODES: dict[str, type] = {"S": OptimizerStep, "M": Accumulate, "AR": AllReduce,
                                "RS": ReduceScatter, "AG": AllGather}
_HOST_WORDS: dict[str, type] = {"A": AsyncUpdate, "C": Commit, "BC": BroadcastBuffers,
                                "RF": Refresh, "N": ClipGradNorm, "SS": ScalerStep,
                                "Q": QueueUpdate}


def parse_action(text: str) -> Action:
    """The action whose ``str`` is ``text``.

    >>> parse_action("3FB1"), parse_action("S0:4"), parse_action("2B0.5")
    (FusedBackward(stage=3, mb=1), OptimizerStep(layers=range(0, 4)), RecomputeBackward(stage=2, mb=0, layer=5))
    >>> parse_action("AR4:6"), parse_action("BC")
    (AllReduce(layers=range(4, 6)), BroadcastBuffers())
    """
    if text in _HOST_WORDS:
        return _HOST_WORDS[text]()
    if m := _HOST_RE.match(text):
        return _HOST_CODES[m[1]](range(int(m[2]), int(m[3])))
    m = _ACTION_RE.match(text)
    if not m or (m[2] in "PDR") != (m[3] == "") or (m[4] is not None and m[2] != "B"):
        raise ValueError(f"not an action: {text!r} (expected e.g. 3P, 3U1, 3FB1, 3B1.5, S0:4, "
                         "AR0:4, C)")
    cls = _CODES[m[2]]
    if m[3] == "":
        return cls(int(m[1]))
    if m[4] is not None:
        return cls(int(m[1]), int(m[3]), int(m[4]))
    return cls(int(m[1]), int(m[3]))


STREAM = {Prefetch: "prefetch", Upload: "h2d", UploadGrad: "h2d", Forward: "compute",
          FusedBackward: "compute", Checkpoint: "compute", RecomputeBackward: "compute",
          Offload: "d2h", Free: "free", DownloadGrads: "grads", Release: "control",
          OptimizerStep: "host", AsyncUpdate: "host", Commit: "host", Refresh: "host",
          Accumulate: "host", ClipGradNorm: "host", ScalerStep: "host", QueueUpdate: "host",
          BroadcastBuffers: "collective", AllReduce: "collective", ReduceScatter: "collective",
          AllGather: "collective"}


def stream_of(action: Action) -> str:
    """The stream an action runs on: ``prefetch``, ``h2d``, ``compute``, ``d2h``,
    ``free``, ``grads``, ``control`` (``Release``), and on the host ``host`` or
    ``collective``."""
    return STREAM[type(action)]


@dataclass(frozen=True, slots=True)
class Dep:
    """Action at ``(device, step)`` must reach ``on`` ("start"/"end") first.

    ``device`` is a device index or ``HOST`` (the host lane). ``why`` is one of
    ``stream``, ``issue``, ``release``, ``params``, ``input``, ``grad``, ``job``,
    ``free``, ``buffers``, ``reduced``, ``stepped``; ``hop`` marks a hand-off between two
    devices.
    """

    device: int
    step: int
    on: Literal["start", "end"]
    why: str
    hop: bool = False


# ----------------------------------------------------------------------------- dataflow

Key = tuple[int, int]   # (stage, microbatch): one compute job of one microbatch


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
        lines = [f"program devices={self.num_devices} microbatches={self.num_microbatches}"]
        if self.inputs:
            lines.append("inputs " + " ".join(self.inputs))
        if self.outputs:
            lines.append("outputs " + " ".join(self.outputs))
        if self.input_grads:
            lines.append("input-grads " + " ".join(self.input_grads))
        lines += ["shared " + " ".join(map(str, group)) for group in self.shared]
        lines += [f"stage {st}" for st in self.stages]
        lanes = [*self.actions, self.host]
        steps = max((len(a) for a in lanes), default=0)
        cells = [["step"] + [f"d{d}" for d in range(self.num_devices)] + ["host"]]
        for i in range(steps):
            cells.append([str(i)] + [str(a[i]) if i < len(a) else "." for a in lanes])
        widths = [max(len(row[c]) for row in cells) + 1 for c in range(len(cells[0]))]
        for row in cells:
            lines.append("".join(x.ljust(w) for x, w in zip(row, widths)).rstrip())
        return "\n".join(lines)

    @classmethod
    def parse(cls, text: str) -> Program:
        """Inverse of ``str(program)``."""
        lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
        m = re.match(r"^program devices=(\d+) microbatches=(\d+)$", lines[0]) if lines else None
        if not m:
            raise ValueError("a Program text starts with 'program devices=N microbatches=M'")
        num_devices, stages, rows = int(m[1]), [], []
        inputs: tuple[str, ...] = ()
        outputs: tuple[str, ...] = ()
        input_grads: tuple[str, ...] = ()
        shared: list[tuple[int, ...]] = []
        stage_re = re.compile(r"^stage (\d+) (fwd|bwd|fused) (\d+):(\d+)"
                              r"(?: reads=(\S+))?(?: makes=(\S+))?(?: owns=(\S+))?$")
        header = ["step"] + [f"d{d}" for d in range(num_devices)] + ["host"]
        for ln in lines[1:]:
            word = ln.split()[0]
            if word == "inputs":
                inputs = tuple(ln.split()[1:])
            elif word == "outputs":
                outputs = tuple(ln.split()[1:])
            elif word == "input-grads":
                input_grads = tuple(ln.split()[1:])
            elif word == "shared":
                shared.append(tuple(int(x) for x in ln.split()[1:]))
            elif word == "stage":
                sm = stage_re.match(ln)
                if not sm:
                    raise ValueError(f"bad stage line {ln!r}")
                stages.append(StageSpec(int(sm[1]), sm[2], range(int(sm[3]), int(sm[4])),
                                        tuple(sm[5].split(",")) if sm[5] else (),
                                        tuple(sm[6].split(",")) if sm[6] else (),
                                        tuple(sm[7].split(",")) if sm[7] else ()))
            elif word == "step":
                if ln.split() != header:
                    raise ValueError(f"bad table header {ln!r}")
            else:
                rows.append(ln.split())
        lanes: list[list[Action]] = [[] for _ in range(num_devices + 1)]
        for i, row in enumerate(rows):
            if row[0] != str(i) or len(row) != num_devices + 2:
                raise ValueError(f"bad table row {i}: {' '.join(row)!r}")
            for d, cell in enumerate(row[1:]):
                if cell != ".":
                    if len(lanes[d]) != i:
                        raise ValueError(f"{'host' if d == num_devices else f'device {d}'} "
                                         f"has a gap before step {i}")
                    lanes[d].append(parse_action(cell))
        return cls(num_devices, int(m[2]), tuple(stages), tuple(tuple(a) for a in lanes[:-1]),
                   tuple(lanes[-1]), inputs, outputs, input_grads, tuple(shared))

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
        computes: dict[Key, list[tuple[int, int]]] = {}
        offload_at: dict[Key, tuple[int, int]] = {}
        downloads: dict[int, list[tuple[int, int]]] = {}
        for d, acts in enumerate(self.actions):
            for i, a in enumerate(acts):
                if isinstance(a, Compute):
                    at = computes.setdefault((a.stage, a.mb), [])
                    if at and (at[-1][0] != d or isinstance(a, (Forward, FusedBackward))
                               or a.layer is None):
                        raise ValueError(f"device {d} step {i}: {a} appears twice "
                                         f"(first on device {at[0][0]})")
                    at.append((d, i))
                elif isinstance(a, Offload):
                    if (a.stage, a.mb) in offload_at:
                        raise ValueError(f"device {d} step {i}: {a} appears twice "
                                         f"(first on device {offload_at[(a.stage, a.mb)][0]})")
                    offload_at[(a.stage, a.mb)] = (d, i)
                elif isinstance(a, DownloadGrads):
                    downloads.setdefault(a.stage, []).append((d, i))
        broadcast = [i for i, a in enumerate(self.host) if isinstance(a, (Refresh,
                                                                          BroadcastBuffers))]
        out = {d: self._device_deps(d, computes, offload_at, broadcast)
               for d in range(self.num_devices)}
        out[HOST] = self._host_deps(downloads)
        return out

    def _device_deps(self, d, computes, offload_at, broadcast) -> tuple[tuple[Dep, ...], ...]:
        flow = self.flow
        out: list[tuple[Dep, ...]] = []
        last_stream: dict[str, int] = {}
        last_compute: int | None = None
        prefetched: dict[int, int] = {}
        job: dict[int, dict[str, int]] = {}   # stage -> its last compute / download here
        releases: list[int] = []
        uploads: dict[tuple[type, Key], int] = {}

        def fail(i: int, a: Action, msg: str):
            raise ValueError(f"device {d} step {i}: {a} {msg}")

        def offloaded(i, a, producer, mb, why) -> Dep:
            if (producer, mb) not in offload_at:
                fail(i, a, f"needs Offload({producer}, {mb}) somewhere in the program")
            od, oi = offload_at[(producer, mb)]
            return Dep(od, oi, "end", why, hop=od != d)

        def made_here(i, a, producer, mb, what) -> Dep:
            at = computes.get((producer, mb), [])
            if not at or at[-1][0] != d or at[-1][1] > i:
                fail(i, a, f"takes over {what} on device {d}, but stage {producer} did not "
                           f"compute microbatch {mb} there before it")
            return Dep(d, at[-1][1], "end", "grad" if what.startswith("the gradient") else "input")

        def uploaded(i, a, kind, key, why) -> list[Dep]:
            if (kind, key) not in uploads:
                fail(i, a, f"has no {kind.__name__} before it, and it reads "
                           f"{'gradients' if kind is UploadGrad else 'values'} from the host")
            return [Dep(d, uploads.pop((kind, key)), "end", why)]

        for i, a in enumerate(self.actions[d]):
            deps: list[Dep] = []
            stream = stream_of(a)
            if stream in last_stream:
                deps.append(Dep(d, last_stream[stream], "end", "stream"))
            last_stream[stream] = i
            if stream in ("prefetch", "h2d") and last_compute is not None:
                deps.append(Dep(d, last_compute, "start", "issue"))
            match a:
                case Prefetch(stage=s):
                    deps += [Dep(d, r, "end", "release") for r in releases]
                    deps += [Dep(HOST, b, "end", "buffers") for b in broadcast]
                    releases.clear()
                    prefetched[s] = i
                    job[s] = {}
                case Upload(stage=s, mb=mb):
                    for v in flow.upload.get((s, mb), ()):
                        if v not in self.inputs:
                            deps.append(offloaded(i, a, flow.maker[v], mb, "input"))
                    uploads[(Upload, (s, mb))] = i
                case UploadGrad(stage=s, mb=mb):
                    if not flow.upload_grads.get((s, mb)):
                        fail(i, a, f"but no gradient of stage {s}'s values comes through the host")
                    for _, producer in flow.host_grad_parts.get((s, mb), ()):
                        deps.append(offloaded(i, a, producer, mb, "grad"))
                    if self.run_type == "train":
                        for v in set(self.outputs) & set(self.stages[s].makes):
                            deps += [offloaded(i, a, flow.maker[v], m, "grad")
                                     for m in range(self.num_microbatches)]
                    uploads[(UploadGrad, (s, mb))] = i
                case Forward(stage=s, mb=mb) | FusedBackward(stage=s, mb=mb) | Checkpoint(
                        stage=s, mb=mb) | RecomputeBackward(stage=s, mb=mb):
                    key = (s, mb)
                    first = computes[key][0][1] == i
                    if s not in prefetched:
                        fail(i, a, f"runs stage {s} with no Prefetch({s}) before it on device {d}")
                    deps.append(Dep(d, prefetched[s], "end", "params"))
                    if first:
                        if flow.upload.get(key):
                            deps += uploaded(i, a, Upload, key, "input")
                        for v, p in flow.handoff.get(key, ()):
                            deps.append(made_here(i, a, p, mb, f"value {v!r}"))
                    if isinstance(a, RecomputeBackward) and (a.layer is None or first or
                                                             computes[key][1][1] == i):
                        if flow.upload_grads.get(key):
                            deps += uploaded(i, a, UploadGrad, key, "grad")
                        for v, p in flow.grad_parts.get(key, ()):
                            deps.append(made_here(i, a, p, mb, f"the gradient of {v!r}"))
                    job[s]["compute"] = i
                    last_compute = i
                case Offload(stage=s, mb=mb) | Free(stage=s, mb=mb):
                    at = computes.get((s, mb), [])
                    if not at or at[-1][0] != d or at[-1][1] > i:
                        fail(i, a, f"but ({s}, {mb}) was not computed on device {d} before it")
                    deps.append(Dep(d, at[-1][1], "end", "input" if isinstance(a, Offload)
                                    else "free"))
                    if isinstance(a, Free):
                        makers = {flow.maker[v] for v in flow.free.get((s, mb), ())} | {s}
                        for p in sorted(makers):
                            if (p, mb) in offload_at:
                                od, oi = offload_at[(p, mb)]
                                deps.append(Dep(od, oi, "end", "free"))
                case DownloadGrads(stage=s) | Release(stage=s):
                    if s not in prefetched:
                        fail(i, a, f"but stage {s} is not resident on device {d}")
                    deps += [Dep(d, j, "end", "job") for j in job[s].values()]
                    if isinstance(a, DownloadGrads):
                        job[s]["download"] = i
                    else:
                        del prefetched[s], job[s]
                        releases.append(i)
            out.append(tuple(deps))
        return tuple(out)

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

    def _host_deps(self, downloads) -> tuple[tuple[Dep, ...], ...]:
        out: list[tuple[Dep, ...]] = []
        last: dict[str, int] = {}                    # host stream -> its latest action
        reduced: dict[tuple[int, int], int] = {}     # layers -> its AllReduce / ReduceScatter
        stepped: dict[tuple[int, int], int] = {}     # layers -> its OptimizerStep
        for i, a in enumerate(self.host):
            stream = stream_of(a)
            deps = [Dep(HOST, last[stream], "end", "stream")] if stream in last else []
            span = (a.layers.start, a.layers.stop) if hasattr(a, "layers") else None
            match a:
                case Accumulate():
                    s = self.backward_stage_of.get(span)
                    if s is None:
                        raise ValueError(f"host step {i}: {a} names no backward stage's layers")
                    deps += [Dep(dd, di, "end", "grad") for dd, di in downloads.get(s, [])]
                case OptimizerStep() | AllReduce() | ReduceScatter():
                    try:
                        stages = self.step_stages(a)
                    except ValueError as e:
                        raise ValueError(f"host step {i}: {e}") from None
                    for w in stages:
                        deps += [Dep(dd, di, "end", "grad") for dd, di in downloads.get(w, [])]
                    if isinstance(a, OptimizerStep):
                        if span in reduced:
                            deps.append(Dep(HOST, reduced[span], "end", "reduced"))
                        stepped[span] = i
                    else:
                        reduced[span] = i
                case AllGather():
                    if span not in stepped:
                        raise ValueError(f"host step {i}: {a} gathers what no OptimizerStep "
                                         f"of layers {span[0]}:{span[1]} listed before it stepped")
                    deps.append(Dep(HOST, stepped[span], "end", "stepped"))
                case Commit():
                    phase = self._phase_of(a)
                    for d, acts in enumerate(self.actions):
                        ends: dict[str, int] = {}
                        for j, b in enumerate(acts):
                            if self._phase_of(b) == phase:
                                ends[stream_of(b)] = j
                        deps += [Dep(d, j, "end", "job") for j in sorted(ends.values())]
                    ends = {}
                    for j, b in enumerate(self.host[:i]):
                        if self._phase_of(b) == phase:
                            ends[stream_of(b)] = j
                    deps += [Dep(HOST, j, "end", "job") for j in sorted(ends.values())
                             if j != last.get("host")]
            last[stream] = i
            out.append(tuple(deps))
        return tuple(out)

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
        could run them: what ``print(pipe)`` lists. Ties go to the action with the
        shortest chain of dependencies before it, then to the lower lane (the host
        last).

        >>> from fxpipe.passes.schedule import build_program
        >>> p = build_program([range(0, 1), range(1, 2)], [], "infer", 2, 1, "stage")
        >>> " ".join(str(p.lane(lane)[i]) for lane, i in p.order())
        'RF 0P 1P 0U0 0F0 0O0 0X0 1U0 0R 1F0 1O0 1X0 1R C'
        """
        deps, keep = self.dependencies(), self.issued(phase)
        preds: dict[tuple[int, int], set[tuple[int, int]]] = {}
        for lane, acts in self.lanes():
            prev = None
            for i in range(len(acts)):
                if not keep[lane][i]:
                    continue
                got = {(d.device, d.step) for d in deps[lane][i] if keep[d.device][d.step]}
                preds[(lane, i)] = got | ({(lane, prev)} if prev is not None else set())
                prev = i
        users: dict[tuple[int, int], list[tuple[int, int]]] = {}
        for k, ps in preds.items():
            for q in ps:
                users.setdefault(q, []).append(k)
        depth = {k: 0 for k in preds}
        left = {k: len(ps) for k, ps in preds.items()}
        rank = lambda k: (depth[k], k[0] if k[0] != HOST else self.num_devices, k[1])  # noqa: E731
        ready = [(rank(k), k) for k, n in left.items() if n == 0]
        heapq.heapify(ready)
        out: list[tuple[int, int]] = []
        while ready:
            _, k = heapq.heappop(ready)
            out.append(k)
            for u in users.get(k, ()):
                depth[u] = max(depth[u], depth[k] + 1)
                left[u] -= 1
                if left[u] == 0:
                    heapq.heappush(ready, (rank(u), u))
        return out

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
            _check_issue_order(self, self.dependencies(), keep)
            self._issued[phase] = keep
        return self._issued[phase]

    @cached_property
    def _issued(self) -> dict[str, dict[int, tuple[bool, ...]]]:
        return {}

    def phase(self, a: Action) -> str:
        """The call that runs ``a``: ``"all"``, or in a ``"train"`` program
        ``"forward"`` (``pipe(x)``) or ``"backward"`` (``.backward()``)."""
        return self._phase_of(a)


def _check_issue_order(p, deps, keep) -> None:
    """Raise unless the lanes can be issued each in list order: no action depends on one
    listed after it in its own lane, and the dependencies have no cycle (else an issue
    thread would wait forever)."""
    indeg: dict[tuple[int, int], int] = {}
    users: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for lane, acts in p.lanes():
        prev = None
        for i in range(len(acts)):
            if not keep[lane][i]:
                continue
            preds = {(dep.device, dep.step) for dep in deps[lane][i] if keep[dep.device][dep.step]}
            if prev is not None:
                preds.add((lane, prev))
            prev = i
            for dep in preds:
                if dep[0] == lane and dep[1] > i:
                    raise ValueError(f"lane {lane} step {i} ({acts[i]}) depends on step {dep[1]} "
                                     "listed after it: the Program cannot run in list order")
                users.setdefault(dep, []).append((lane, i))
            indeg[(lane, i)] = len(preds)
    ready = [k for k, n in indeg.items() if n == 0]
    seen = 0
    while ready:
        k = ready.pop()
        seen += 1
        for u in users.get(k, ()):
            indeg[u] -= 1
            if indeg[u] == 0:
                ready.append(u)
    if seen != len(indeg):
        raise ValueError("the Program's dependencies have a cycle")
