"""Program: per device, the ordered actions the executor runs and the simulator times.

A ``Program`` is a plain value: ``num_devices``, ``num_microbatches``, the stages (each a
``StageSpec``: kind and layer range) and, per device, a tuple of actions. It prints as a
table (one row per step, one column per device) and parses back::

    >>> p = build_program([range(0, 2)], [range(2, 3), range(0, 2)], "fused", 2, 1, "stage")
    >>> print(p)
    program devices=2 microbatches=1
    stage 0 fwd 0:2
    stage 1 fused 2:3
    stage 2 bwd 0:2
    step  d0   d1
    0     0P   1P
    1     0U0  1U0
    2     0F0  1FB0
    3     0O0  1O0
    4     2P   1D
    5     2U0  1R
    6     2G0  .
    7     0R   .
    8     2B0  .
    9     2D   .
    10    2R   .
    >>> Program.parse(str(p)) == p
    True

Stages are indexed in execution order: forward stages ``0 .. F-1``, then backward stages
``F .. F+B-1`` (deep to shallow). In a ``"fused"`` program the first backward stage is
``fused``: it runs the tail layers forward, the loss and the backward with no recompute.
Every other backward stage (``bwd``) recomputes its layers from their saved input, then
back-propagates.

Actions (``str`` in brackets; ``s`` stage, ``m`` microbatch)::

    Prefetch(s)           [sP]    upload the stage's parameters              (prefetch)
    Upload(s, m)          [sUm]   upload the stage's input activation        (h2d)
    UploadGrad(s, m)      [sGm]   upload the gradient of the stage output    (h2d)
    Forward(s, m)         [sFm]   forward of a fwd stage                     (compute)
    FusedBackward(s, m)   [sFBm]  tail forward + loss, then backward         (compute)
    RecomputeBackward(s, m) [sBm] recompute, then backward                   (compute)
    Offload(s, m)         [sOm]   output (fwd) / input gradient (bwd) → host (d2h)
    DownloadGrads(s)      [sD]    accumulated parameter gradients → host     (grads)
    Release(s)            [sR]    free the stage's parameters (and gradient buffer)
    OptimizerStep(layers) [Sa:b]  host optimizer hook for ``layers``         (host)

Parameters and gradients move on their own streams (``prefetch``, ``grads``) so that a
stage-sized copy never queues in front of a microbatch's activations (``h2d``, ``d2h``);
an executor with one stream per direction can merge them in list order, at a cost.

Dependency rules (``Program.dependencies()`` derives them; the executor and the
simulator both follow them, nothing else orders actions):

1. Streams are FIFO: an action starts after the previous action of the same stream on
   the same device ended (streams: ``prefetch``, ``h2d``, ``compute``, ``d2h``,
   ``grads``; ``Release`` is a marker; ``OptimizerStep`` runs on the one host optimizer,
   in order of readiness).
2. Issue: ``Prefetch``/``Upload``/``UploadGrad`` start no earlier than the start of the
   latest compute action listed before them. Builders place the prefetch of a device's
   next stage after the first compute of its current stage (so it overlaps that stage,
   DESIGN rule 2) and the inputs of the next compute after the current compute (one
   microbatch of look-ahead).
3. Residency: a ``Prefetch`` starts after every ``Release`` listed before it; a
   compute needs the latest ``Prefetch`` of its stage listed before it (not released).
4. Inputs: a compute of stage ``s`` for microbatch ``m`` needs ``Upload(s, m)`` listed
   before it on its device, or else the producer's compute of ``m`` on the same device
   (on-device hand-off). Producers: fwd/fused stage ``s`` reads stage ``s-1``'s output
   (stage 0 and a stage starting at layer 0 read the model input from the host); a bwd
   stage over ``range(a, z)`` reads the saved input of layer ``a``, i.e. the output of
   the fwd stage holding layer ``a-1`` (builders always route it through the host).
5. Gradients: a bwd stage's backward part needs ``UploadGrad(b, m)`` or stage
   ``b-1``'s compute of ``m`` on the same device. The first bwd stage of a ``"train"``
   program gets its gradient from the host once *every* microbatch's output is there
   (the user's loss runs between ``pipe(x)`` and ``.backward()``).
6. ``Upload``/``UploadGrad`` wait for the producer's ``Offload`` (on any device); that
   edge is an activation hand-off (``hop``) when the two devices differ.
7. ``Offload(s, m)`` waits for the compute of ``(s, m)`` on its device;
   ``DownloadGrads(s)`` and ``Release(s)`` wait for the last compute of ``s`` since its
   ``Prefetch`` (computes end in list order; ``Release`` also waits for the
   ``DownloadGrads``); ``OptimizerStep(layers)`` waits for every ``DownloadGrads`` (on
   any device) of a stage holding any of ``layers``.

A two-part compute (``FusedBackward``: tail forward then backward;
``RecomputeBackward``: recompute then backward) has its ``grad`` dependencies gate only
its backward part; everything else gates its start.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property
from typing import Callable, Collection, Literal, Sequence, Union

StageKind = Literal["fwd", "bwd", "fused"]
RunType = Literal["infer", "train", "fused"]
Dispatch = Literal["roundpipe", "stage"]
HOST = -1
"""Producer index meaning "the host" (model input, or the user's loss gradient)."""


@dataclass(frozen=True, slots=True)
class StageSpec:
    """One stage of a Program: its execution-order index, kind and layer range.

    >>> str(StageSpec(3, "bwd", range(4, 6)))
    '3 bwd 4:6'
    """

    index: int
    kind: StageKind
    layers: range

    def __str__(self) -> str:
        return f"{self.index} {self.kind} {self.layers.start}:{self.layers.stop}"


# ----------------------------------------------------------------------------- actions

@dataclass(frozen=True, slots=True)
class Prefetch:
    """Upload stage ``stage``'s parameters to the device (``str``: ``3P``)."""
    stage: int

    def __str__(self) -> str:
        return f"{self.stage}P"


@dataclass(frozen=True, slots=True)
class Upload:
    """Upload the input activation of ``(stage, mb)`` from the host (``3U1``)."""
    stage: int
    mb: int

    def __str__(self) -> str:
        return f"{self.stage}U{self.mb}"


@dataclass(frozen=True, slots=True)
class UploadGrad:
    """Upload the gradient of ``(stage, mb)``'s output from the host (``3G1``)."""
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
class RecomputeBackward:
    """Recompute the stage's layers from their saved input, then backward (``3B1``)."""
    stage: int
    mb: int

    def __str__(self) -> str:
        return f"{self.stage}B{self.mb}"


@dataclass(frozen=True, slots=True)
class Offload:
    """Copy ``(stage, mb)``'s output (fwd) or input gradient (bwd) to the host (``3O1``)."""
    stage: int
    mb: int

    def __str__(self) -> str:
        return f"{self.stage}O{self.mb}"


@dataclass(frozen=True, slots=True)
class DownloadGrads:
    """Add the stage's accumulated parameter gradients into the host ``.grad`` (``3D``)."""
    stage: int

    def __str__(self) -> str:
        return f"{self.stage}D"


@dataclass(frozen=True, slots=True)
class Release:
    """Free the stage's parameters (and gradient buffer) on the device (``3R``)."""
    stage: int

    def __str__(self) -> str:
        return f"{self.stage}R"


@dataclass(frozen=True, slots=True)
class OptimizerStep:
    """Host optimizer hook for ``layers`` once their gradients are final (``S4:6``)."""
    layers: range

    def __str__(self) -> str:
        return f"S{self.layers.start}:{self.layers.stop}"


Action = Union[Prefetch, Upload, UploadGrad, Forward, FusedBackward, RecomputeBackward,
               Offload, DownloadGrads, Release, OptimizerStep]
Compute = (Forward, FusedBackward, RecomputeBackward)
_CODES: dict[str, type] = {"P": Prefetch, "D": DownloadGrads, "R": Release, "U": Upload,
                           "G": UploadGrad, "F": Forward, "FB": FusedBackward,
                           "B": RecomputeBackward, "O": Offload}
_ACTION_RE = re.compile(r"^(\d+)(FB|[PDRUGFBO])(\d*)$")
_OPT_RE = re.compile(r"^S(\d+):(\d+)$")


def parse_action(text: str) -> Action:
    """The action whose ``str`` is ``text``.

    >>> parse_action("3FB1"), parse_action("S0:4")
    (FusedBackward(stage=3, mb=1), OptimizerStep(layers=range(0, 4)))
    """
    if m := _OPT_RE.match(text):
        return OptimizerStep(range(int(m[1]), int(m[2])))
    m = _ACTION_RE.match(text)
    if not m or (m[2] in "PDR") != (m[3] == ""):
        raise ValueError(f"not an action: {text!r} (expected e.g. 3P, 3U1, 3FB1, S0:4)")
    cls = _CODES[m[2]]
    return cls(int(m[1])) if m[3] == "" else cls(int(m[1]), int(m[3]))


def stream_of(action: Action) -> str | None:
    """The stream an action runs on: ``prefetch``, ``h2d``, ``compute``, ``d2h``,
    ``grads``, ``host`` or None (``Release``)."""
    match action:
        case Prefetch():
            return "prefetch"
        case Upload() | UploadGrad():
            return "h2d"
        case Forward() | FusedBackward() | RecomputeBackward():
            return "compute"
        case Offload():
            return "d2h"
        case DownloadGrads():
            return "grads"
        case OptimizerStep():
            return "host"
    return None


@dataclass(frozen=True, slots=True)
class Dep:
    """Action at ``(device, step)`` must reach ``on`` ("start"/"end") first.

    ``why`` is one of ``stream``, ``issue``, ``release``, ``params``, ``input``,
    ``grad``, ``job``; ``hop`` marks an activation hand-off between two devices.
    """

    device: int
    step: int
    on: Literal["start", "end"]
    why: str
    hop: bool = False


# ----------------------------------------------------------------------------- program

@dataclass(frozen=True)
class Program:
    """Per-device action lists over a chain of stages (see the module docstring)."""

    num_devices: int
    num_microbatches: int
    stages: tuple[StageSpec, ...]
    actions: tuple[tuple[Action, ...], ...]

    def __post_init__(self) -> None:
        if len(self.actions) != self.num_devices:
            raise ValueError(f"Program has {len(self.actions)} action lists for "
                             f"{self.num_devices} devices")
        for i, st in enumerate(self.stages):
            if st.index != i:
                raise ValueError(f"stage {st} is listed at position {i}: stages must be in "
                                 "execution order")

    # -- stage relations -------------------------------------------------------------
    @cached_property
    def num_forward_stages(self) -> int:
        return sum(st.kind == "fwd" for st in self.stages)

    @property
    def run_type(self) -> RunType:
        if any(st.kind == "fused" for st in self.stages):
            return "fused"
        return "train" if any(st.kind == "bwd" for st in self.stages) else "infer"

    def input_of(self, stage: int) -> int:
        """The stage producing ``stage``'s input activation, or ``HOST``.

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
        """The stage producing the gradient ``stage`` back-propagates: the previous
        backward stage, ``HOST`` (first bwd stage of a train program) or None (fwd/fused)."""
        if self.stages[stage].kind != "bwd":
            return None
        return stage - 1 if self.stages[stage - 1].kind != "fwd" else HOST

    def saved_inputs_of(self, stage: int) -> list[int]:
        """The bwd stages whose saved input is produced by fwd stage ``stage``."""
        return [st.index for st in self.stages
                if st.kind == "bwd" and st.layers.start > 0 and self.input_of(st.index) == stage]

    # -- text -----------------------------------------------------------------------
    def __str__(self) -> str:
        lines = [f"program devices={self.num_devices} microbatches={self.num_microbatches}"]
        lines += [f"stage {st}" for st in self.stages]
        steps = max((len(a) for a in self.actions), default=0)
        cells = [["step"] + [f"d{d}" for d in range(self.num_devices)]]
        for i in range(steps):
            cells.append([str(i)] + [str(a[i]) if i < len(a) else "." for a in self.actions])
        widths = [max(len(row[c]) for row in cells) + 2 for c in range(len(cells[0]))]
        for row in cells:
            lines.append("".join(x.ljust(w) for x, w in zip(row, widths)).rstrip())
        return "\n".join(lines)

    @classmethod
    def parse(cls, text: str) -> "Program":
        """Inverse of ``str(program)``."""
        lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
        m = re.match(r"^program devices=(\d+) microbatches=(\d+)$", lines[0]) if lines else None
        if not m:
            raise ValueError("a Program text starts with 'program devices=N microbatches=M'")
        num_devices, stages, rows = int(m[1]), [], []
        for ln in lines[1:]:
            if sm := re.match(r"^stage (\d+) (fwd|bwd|fused) (\d+):(\d+)$", ln):
                stages.append(StageSpec(int(sm[1]), sm[2], range(int(sm[3]), int(sm[4]))))
            elif ln.split()[0] == "step":
                if ln.split()[1:] != [f"d{d}" for d in range(num_devices)]:
                    raise ValueError(f"bad table header {ln!r}")
            else:
                rows.append(ln.split())
        per_dev: list[list[Action]] = [[] for _ in range(num_devices)]
        for i, row in enumerate(rows):
            if row[0] != str(i) or len(row) != num_devices + 1:
                raise ValueError(f"bad table row {i}: {' '.join(row)!r}")
            for d, cell in enumerate(row[1:]):
                if cell != ".":
                    if len(per_dev[d]) != i:
                        raise ValueError(f"device {d} has a gap before step {i}")
                    per_dev[d].append(parse_action(cell))
        return cls(num_devices, int(m[2]), tuple(stages), tuple(tuple(a) for a in per_dev))

    # -- checks ---------------------------------------------------------------------
    def validate(self) -> None:
        """Raise ``ValueError`` unless every (stage, microbatch) runs exactly once with
        the compute action its stage kind needs, and ``dependencies()`` resolves."""
        want = {"fwd": Forward, "fused": FusedBackward, "bwd": RecomputeBackward}
        seen: dict[tuple[int, int], int] = {}
        for d, acts in enumerate(self.actions):
            for a in acts:
                if isinstance(a, Compute):
                    if not 0 <= a.stage < len(self.stages):
                        raise ValueError(f"device {d}: {a} names stage {a.stage}, "
                                         f"the program has {len(self.stages)} stages")
                    kind = self.stages[a.stage].kind
                    if not isinstance(a, want[kind]):
                        raise ValueError(f"device {d}: {a} on a {kind} stage; expected "
                                         f"{want[kind].__name__}")
                    seen[(a.stage, a.mb)] = seen.get((a.stage, a.mb), 0) + 1
        for st in self.stages:
            for mb in range(self.num_microbatches):
                if seen.get((st.index, mb), 0) != 1:
                    raise ValueError(f"stage {st.index} microbatch {mb} runs "
                                     f"{seen.get((st.index, mb), 0)} times; expected once")
        self.dependencies()

    def dependencies(self) -> tuple[tuple[tuple[Dep, ...], ...], ...]:
        """For each device and step, the ``Dep``s of that action (module docstring rules).

        Raises ``ValueError`` naming the device, step and action when an action's
        parameters or inputs are not provided by the Program.
        """
        compute_at: dict[tuple[int, int], tuple[int, int]] = {}
        offload_at: dict[tuple[int, int], tuple[int, int]] = {}
        downloads: dict[int, list[tuple[int, int]]] = {}
        for d, acts in enumerate(self.actions):
            for i, a in enumerate(acts):
                if isinstance(a, Compute + (Offload,)):
                    where = offload_at if isinstance(a, Offload) else compute_at
                    if (a.stage, a.mb) in where:
                        raise ValueError(f"device {d} step {i}: {a} appears twice "
                                         f"(first on device {where[(a.stage, a.mb)][0]})")
                    where[(a.stage, a.mb)] = (d, i)
                elif isinstance(a, DownloadGrads):
                    downloads.setdefault(a.stage, []).append((d, i))
        return tuple(self._device_deps(d, offload_at, downloads) for d in range(self.num_devices))

    def _device_deps(self, d, offload_at, downloads) -> tuple[tuple[Dep, ...], ...]:
        out: list[tuple[Dep, ...]] = []
        last_stream: dict[str, int] = {}
        last_compute: int | None = None
        prefetched: dict[int, int] = {}
        job: dict[int, dict[str, int]] = {}   # stage -> its last compute / download here
        releases: list[int] = []
        uploads: dict[tuple[type, int, int], int] = {}
        computed: dict[tuple[int, int], int] = {}

        def fail(i: int, a: Action, msg: str):
            raise ValueError(f"device {d} step {i}: {a} {msg}")

        def offloaded(i, a, producer, mb) -> Dep:
            if (producer, mb) not in offload_at:
                fail(i, a, f"needs Offload({producer}, {mb}) somewhere in the program")
            od, oi = offload_at[(producer, mb)]
            return Dep(od, oi, "end", "input", hop=od != d)

        def on_device(i, a, kind, producer, why) -> Dep:
            if (kind, a.stage, a.mb) in uploads:
                return Dep(d, uploads.pop((kind, a.stage, a.mb)), "end", why)
            if producer not in (HOST, None) and (producer, a.mb) in computed:
                return Dep(d, computed[(producer, a.mb)], "end", why)
            fail(i, a, f"has no {kind.__name__} before it and its producer "
                       f"(stage {producer}) did not run on device {d}")

        for i, a in enumerate(self.actions[d]):
            deps: list[Dep] = []
            stream = stream_of(a)
            if stream not in (None, "host"):
                if stream in last_stream:
                    deps.append(Dep(d, last_stream[stream], "end", "stream"))
                last_stream[stream] = i
            if stream in ("prefetch", "h2d") and last_compute is not None:
                deps.append(Dep(d, last_compute, "start", "issue"))
            match a:
                case Prefetch(stage=s):
                    deps += [Dep(d, r, "end", "release") for r in releases]
                    releases.clear()
                    prefetched[s] = i
                    job[s] = {}
                case Upload(stage=s, mb=mb):
                    if self.input_of(s) != HOST:
                        deps.append(offloaded(i, a, self.input_of(s), mb))
                    uploads[(Upload, s, mb)] = i
                case UploadGrad(stage=s, mb=mb):
                    g = self.grad_of(s)
                    if g is None:
                        fail(i, a, f"but stage {s} back-propagates no incoming gradient")
                    if g == HOST:
                        last = self.num_forward_stages - 1
                        deps += [offloaded(i, a, last, m) for m in range(self.num_microbatches)]
                    else:
                        deps.append(offloaded(i, a, g, mb))
                    uploads[(UploadGrad, s, mb)] = i
                case Forward(stage=s, mb=mb) | FusedBackward(stage=s, mb=mb) | RecomputeBackward(
                        stage=s, mb=mb):
                    if s not in prefetched:
                        fail(i, a, f"runs stage {s} with no Prefetch({s}) before it on device {d}")
                    deps.append(Dep(d, prefetched[s], "end", "params"))
                    deps.append(on_device(i, a, Upload, self.input_of(s), "input"))
                    if isinstance(a, RecomputeBackward):
                        deps.append(on_device(i, a, UploadGrad, self.grad_of(s), "grad"))
                    computed[(s, mb)] = i
                    job[s]["compute"] = i
                    last_compute = i
                case Offload(stage=s, mb=mb):
                    if (s, mb) not in computed:
                        fail(i, a, f"but ({s}, {mb}) was not computed on device {d} before it")
                    deps.append(Dep(d, computed[(s, mb)], "end", "input"))
                case DownloadGrads(stage=s) | Release(stage=s):
                    if s not in prefetched:
                        fail(i, a, f"but stage {s} is not resident on device {d}")
                    deps += [Dep(d, j, "end", "job") for j in job[s].values()]
                    if isinstance(a, DownloadGrads):
                        job[s]["download"] = i
                    else:
                        del prefetched[s], job[s]
                        releases.append(i)
                case OptimizerStep(layers=layers):
                    for st in self.stages:
                        if st.kind != "fwd" and set(st.layers) & set(layers):
                            for dd, di in downloads.get(st.index, []):
                                deps.append(Dep(dd, di, "end", "grad"))
            out.append(tuple(deps))
        return tuple(out)


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
                  optimizer: bool = False) -> Program:
    """Build the Program for a plan.

    ``dispatch="stage"`` (DESIGN rule 1): stage ``s`` runs on device ``s mod G`` as one
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

    ``optimizer=True`` appends an ``OptimizerStep`` for each backward stage's layers
    after its last ``DownloadGrads``.

    >>> p = build_program([range(0, 2)], [range(2, 3), range(0, 2)], "fused", 2, 4)
    >>> [str(a) for a in p.actions[1] if isinstance(a, (Forward, FusedBackward))]
    ['1FB0', '1FB1', '0F2', '0F3']
    """
    if num_devices < 1 or num_microbatches < 1:
        raise ValueError("num_devices and num_microbatches must be >= 1")
    stages = make_stages(plan_fwd, plan_bwd, run_type)
    G, M, F, S = num_devices, num_microbatches, len(plan_fwd), len(stages)
    jobs: list[list[tuple[int, list[int]]]] = [[] for _ in range(G)]
    if dispatch == "stage":
        for st in stages:
            jobs[st.index % G].append((st.index, list(range(M))))
        return _emit(G, M, stages, jobs, optimizer)
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
                free = list(device_free(_emit(G, M, stages, jobs, False)))
                r0 = min(range(G), key=lambda g: (free[g], g))
        for k, (s, mbs) in enumerate(slots):
            jobs[(r0 + k) % G].append((s, list(mbs)))
        placed = len(slots)
    return _emit(G, M, stages, jobs, optimizer)


def _emit(G: int, M: int, stages: tuple[StageSpec, ...],
          jobs: list[list[tuple[int, list[int]]]], optimizer: bool) -> Program:
    """Turn per-device job lists [(stage, microbatches)] into action lists."""
    probe = Program(G, M, stages, tuple(() for _ in range(G)))
    device_of = {(s, m): d for d in range(G) for s, mbs in jobs[d] for m in mbs}
    saved_producers = {probe.input_of(st.index) for st in stages if st.kind == "bwd"}

    def inputs(s: int, m: int, d: int) -> list[Action]:
        st, acts = stages[s], []
        p = probe.input_of(s)
        if p == HOST or st.kind == "bwd" or device_of.get((p, m)) != d:
            acts.append(Upload(s, m))
        g = probe.grad_of(s)
        if g is not None and (g == HOST or device_of.get((g, m)) != d):
            acts.append(UploadGrad(s, m))
        return acts

    def needs_offload(s: int, m: int, d: int) -> bool:
        nxt = stages[s + 1] if s + 1 < len(stages) else None
        if stages[s].kind == "fwd":
            if s in saved_producers or nxt is None or nxt.kind == "bwd":
                return True               # saved input for a recompute, or the model output
            return device_of.get((s + 1, m)) != d
        return nxt is not None and device_of.get((s + 1, m)) != d   # input gradient

    compute_cls = {"fwd": Forward, "fused": FusedBackward, "bwd": RecomputeBackward}
    out: list[tuple[Action, ...]] = []
    for d in range(G):
        merged: list[tuple[int, list[int]]] = []   # consecutive jobs of a stage merged
        for s, mbs in jobs[d]:
            if merged and merged[-1][0] == s:
                merged[-1] = (s, merged[-1][1] + mbs)
            else:
                merged.append((s, list(mbs)))
        acts: list[Action] = []
        if merged:
            acts.append(Prefetch(merged[0][0]))
            acts += inputs(merged[0][0], merged[0][1][0], d)
        for j, (s, mbs) in enumerate(merged):
            for k, m in enumerate(mbs):
                acts.append(compute_cls[stages[s].kind](s, m))
                if needs_offload(s, m, d):
                    acts.append(Offload(s, m))
                if k == 0 and j + 1 < len(merged):
                    acts.append(Prefetch(merged[j + 1][0]))
                if k + 1 < len(mbs):
                    acts += inputs(s, mbs[k + 1], d)
                elif j + 1 < len(merged):
                    acts += inputs(merged[j + 1][0], merged[j + 1][1][0], d)
            if stages[s].kind != "fwd":
                acts.append(DownloadGrads(s))
            acts.append(Release(s))
            if optimizer and stages[s].kind != "fwd" and M - 1 in mbs:
                acts.append(OptimizerStep(stages[s].layers))
        out.append(tuple(acts))
    return Program(G, M, stages, tuple(out))
