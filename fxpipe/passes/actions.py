"""The Program's vocabulary: stages (``StageSpec``), the actions of the device and host
lanes (frozen values with a short ``str``: ``2F0``, ``S4:6``, parsed back by
:func:`parse_action`), the stream each runs on, and a dependency (``Dep``). What the
rules between them are and how a Program is built: ``passes.program``, which re-exports
every name here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal, Union

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

    @property
    def clipped_first(self) -> bool:
        """Whether every stage is stepped after the ``Commit`` and the norm (``N``), with
        nothing else between (``clip``, not ``speculate``, no ``GradScaler``): what a
        sharded step does instead of speculating."""
        return self.mode == "exact" and self.steps and self.clip and not self.speculate \
            and not self.scaler

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
    calls of a data-parallel pipe); ``chunks``: the microbatches are one sequence's token
    chunks (``RunConfig.sequence_chunks``), which every backward stage runs last first;
    ``gather_params`` (every call of a ``data_parallel="zero3"`` pipe): each ``Prefetch``
    uploads this rank's 1/N of the stage's parameters and a ``DeviceAllGather`` gathers
    the rest.

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
    chunks: bool = False
    gather_params: bool = False

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
        if self.chunks:
            parts.append("sequence_chunks")
        if self.gather_params:
            parts.append("gather_params")
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
class GraphUpload(Upload):
    """``Upload`` into the input slot of a graphed job (``stage_backend="cudagraphs"``,
    ``3U1g``): the buffer of microbatch parity ``mb % 2`` that the job's graph reads, so
    the replay copies no input. It waits for the end of job ``(stage, mb - 2)``, the
    slot's last reader (``runtime.stages.graphs``)."""

    def __str__(self) -> str:
        return f"{self.stage}U{self.mb}g"


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
class GraphForward(Forward):
    """Forward as a device graph (``RunConfig(stage_backend="cudagraphs")``, ``3F1g``):
    the stage job captured at its key's first run, replayed after (``runtime.stages.graphs``)."""

    def __str__(self) -> str:
        return f"{self.stage}F{self.mb}g"


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
class GraphRecomputeBackward(RecomputeBackward):
    """A stage's recompute and backward as a device graph (``stage_backend="cudagraphs"``,
    ``3B1g``): captured at its key's first run, replayed after (``runtime.stages.graphs``)."""

    def __str__(self) -> str:
        return f"{self.stage}B{self.mb}g"


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
class DeviceReduceScatter:
    """Data parallel on the devices (``data_parallel="device"``): the stage's accumulated
    parameter gradients on this device reduce-scattered across ranks, with the same device
    of every other rank, on the device's ``collective`` stream; its ``DownloadGrads`` then
    brings this rank's 1/N only (``3RS``). ``accumulated`` (``3RS+``, a call after calls
    that did not synchronize): the host's ``.grad`` of the parameters the stage owns (what
    those calls accumulated locally) is uploaded on that stream and added to the device's
    gradients first, so the ranks reduce all of it there."""
    stage: int
    accumulated: bool = False

    def __str__(self) -> str:
        return f"{self.stage}RS{'+' if self.accumulated else ''}"


@dataclass(frozen=True, slots=True)
class DeviceAllReduce:
    """Data parallel on the devices, a call that does not step a sharded optimizer
    (``data_parallel="device"``, or ``True`` on GPUs): the stage's accumulated parameter
    gradients on this device averaged across ranks in place, with the same device of
    every other rank, on the device's ``collective`` stream; its ``DownloadGrads`` then
    brings them whole (``3AR``). ``accumulated`` (``3AR+``): the host's ``.grad`` of the parameters the
    stage owns is uploaded and added first, and the average replaces it."""
    stage: int
    accumulated: bool = False

    def __str__(self) -> str:
        return f"{self.stage}AR{'+' if self.accumulated else ''}"


DeviceReduce = (DeviceReduceScatter, DeviceAllReduce)
"""The devices' collectives of a backward stage's gradients, before its ``DownloadGrads``."""


@dataclass(frozen=True, slots=True)
class DeviceAllGather:
    """``data_parallel="zero3"``: after the stage's ``Prefetch`` uploaded this rank's 1/N
    of its parameters, the rest gathered from the same device of every other rank, on
    the device's ``collective`` stream; the stage's computes wait for it (``3AG``)."""
    stage: int

    def __str__(self) -> str:
        return f"{self.stage}AG"


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
class Barrier:
    """Host, ``data_parallel="zero3"``, last: the ranks share one copy of the parameters
    (host shared memory), each writing the 1/N it stepped; no rank goes on (to a call
    whose uploads read them) before every rank has written (``SY``)."""

    def __str__(self) -> str:
        return "SY"


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


Action = Union[Prefetch, Upload, GraphUpload, UploadGrad, Forward, GraphForward, FusedBackward,
               Checkpoint, RecomputeBackward, GraphRecomputeBackward, Offload, Free, DownloadGrads,
               DeviceReduceScatter, DeviceAllReduce, DeviceAllGather, Release, OptimizerStep,
               AsyncUpdate, Commit, BroadcastBuffers, AllReduce, ReduceScatter, AllGather,
               Barrier, Refresh, Accumulate, ClipGradNorm, ScalerStep, QueueUpdate]
Compute = (Forward, FusedBackward, Checkpoint, RecomputeBackward)
Collective = (BroadcastBuffers, AllReduce, ReduceScatter, AllGather, Barrier)
HostAction = (Refresh, Accumulate, OptimizerStep, AsyncUpdate, Commit, ClipGradNorm,
              ScalerStep, QueueUpdate, *Collective)
AfterCommit = (ClipGradNorm, ScalerStep, QueueUpdate)
"""Host actions that only follow a ``Commit`` (they read ``.grad``)."""
_CODES: dict[str, type] = {"P": Prefetch, "D": DownloadGrads, "R": Release, "U": Upload,
                           "RS": DeviceReduceScatter, "AR": DeviceAllReduce,
                           "AG": DeviceAllGather,
                           "G": UploadGrad, "F": Forward, "FB": FusedBackward, "K": Checkpoint,
                           "B": RecomputeBackward, "O": Offload, "X": Free}
_GRAPH_CODES: dict[str, type] = {"F": GraphForward, "B": GraphRecomputeBackward, "U": GraphUpload}
_ACTION_RE = re.compile(r"^(\d+)(FB|RS|AR|AG|[PDRUGFKBOX])(\d*)(?:\.(\d+))?(g?)(\+?)$")
_JOB_CODES = ("P", "D", "R", "RS", "AR", "AG")   # a stage's job, no microbatch
_HOST_RE = re.compile(r"^(S|M|AR|RS|AG)(\d+):(\d+)$")
_HOST_CODES: dict[str, type] = {"S": OptimizerStep, "M": Accumulate, "AR": AllReduce,
                                "RS": ReduceScatter, "AG": AllGather}
_HOST_WORDS: dict[str, type] = {"A": AsyncUpdate, "C": Commit, "BC": BroadcastBuffers,
                                "RF": Refresh, "N": ClipGradNorm, "SS": ScalerStep,
                                "Q": QueueUpdate, "SY": Barrier}


def parse_action(text: str) -> Action:
    """The action whose ``str`` is ``text``.

    >>> parse_action("3FB1"), parse_action("S0:4"), parse_action("2B0.5")
    (FusedBackward(stage=3, mb=1), OptimizerStep(layers=range(0, 4)), RecomputeBackward(stage=2, mb=0, layer=5))
    >>> parse_action("AR4:6"), parse_action("BC"), parse_action("3F1g")
    (AllReduce(layers=range(4, 6)), BroadcastBuffers(), GraphForward(stage=3, mb=1))
    >>> parse_action("3B1g"), parse_action("3RS"), parse_action("3AR+")
    (GraphRecomputeBackward(stage=3, mb=1, layer=None), DeviceReduceScatter(stage=3, accumulated=False), DeviceAllReduce(stage=3, accumulated=True))
    >>> parse_action("3U1g")
    GraphUpload(stage=3, mb=1)
    """
    if text in _HOST_WORDS:
        return _HOST_WORDS[text]()
    if m := _HOST_RE.match(text):
        return _HOST_CODES[m[1]](range(int(m[2]), int(m[3])))
    m = _ACTION_RE.match(text)
    if not m or (m[2] in _JOB_CODES) != (m[3] == "") or (m[4] is not None and m[2] != "B") \
            or (m[5] and (m[2] not in "FBU" or m[4] is not None)) \
            or (m[6] and m[2] not in ("RS", "AR")):
        raise ValueError(f"not an action: {text!r} (expected e.g. 3P, 3U1, 3FB1, 3B1.5, S0:4, "
                         "AR0:4, C)")
    cls = _GRAPH_CODES[m[2]] if m[5] else _CODES[m[2]]
    if m[6]:
        return cls(int(m[1]), accumulated=True)
    if m[3] == "":
        return cls(int(m[1]))
    if m[4] is not None:
        return cls(int(m[1]), int(m[3]), int(m[4]))
    return cls(int(m[1]), int(m[3]))


STREAM = {Prefetch: "prefetch", Upload: "h2d", GraphUpload: "h2d", UploadGrad: "h2d",
          Forward: "compute", GraphForward: "compute", GraphRecomputeBackward: "compute",
          FusedBackward: "compute", Checkpoint: "compute", RecomputeBackward: "compute",
          Offload: "d2h", Free: "free", DownloadGrads: "grads", Release: "control",
          DeviceReduceScatter: "collective", DeviceAllReduce: "collective",
          DeviceAllGather: "collective", OptimizerStep: "host", AsyncUpdate: "host", Commit: "host", Refresh: "host",
          Accumulate: "host", ClipGradNorm: "host", ScalerStep: "host", QueueUpdate: "host",
          BroadcastBuffers: "collective", AllReduce: "collective", ReduceScatter: "collective",
          AllGather: "collective", Barrier: "collective"}


def stream_of(action: Action) -> str:
    """The stream an action runs on: ``prefetch``, ``h2d``, ``compute``, ``d2h``,
    ``free``, ``grads``, ``control`` (``Release``), ``collective`` (a device's
    ``DeviceReduceScatter``, ``DeviceAllReduce``, ``DeviceAllGather``), and on the host ``host`` or
    ``collective``."""
    return STREAM[type(action)]


@dataclass(frozen=True, slots=True)
class Dep:
    """Action at ``(device, step)`` must reach ``on`` ("start"/"end") first.

    ``device`` is a device index or ``HOST`` (the host lane). ``why`` is one of
    ``stream``, ``issue``, ``release``, ``params``, ``input``, ``grad``, ``job``,
    ``free``, ``refresh``, ``buffers``, ``reduced``, ``stepped``, ``slot``; ``hop`` marks a
    hand-off between two devices.
    """

    device: int
    step: int
    on: Literal["start", "end"]
    why: str
    hop: bool = False


Key = tuple[int, int]   # (stage, microbatch): one compute job of one microbatch
