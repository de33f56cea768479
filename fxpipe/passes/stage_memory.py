"""The stage memory model: the bytes a stage holds on its device at its peak, from layer costs.

Pure arithmetic over per-layer byte vectors (no tensors, no planning): the planner
(``fxpipe.passes.planner``), the simulator and the prediction for a pipe
(``fxpipe.memory_prediction``, public as ``fxpipe.plan.predict_memory``) use it;
``fxpipe.live_bytes`` is the dispatch mode that counts the bytes the costs hold.

``compute_costs`` measures each layer's own allocations on fake tensors (its memory
profile, ``fxpipe.passes.costs``). ``ChainMemory`` holds them as per-layer vectors, and
``stage_peak`` composes them into a stage's peak the way the runtime runs the stage, by
kind (``KINDS``):

- ``params``: the stage's parameters and buffers, and those of the stage its device
  prefetches while it computes (docs/design.md, rule 2: at most two stages resident);
- ``gradients``: a backward stage's parameter gradients, accumulated over its job;
- ``activations``: values between computes: the stage's inputs (and the next
  microbatch's, uploaded during this compute), the gradients of its outputs (backward),
  the previous microbatch's outputs or input gradients until offloaded (with a
  same-device hand-off, every microbatch's);
- ``saved``: what the compute keeps for backward at its peak;
- ``workspace``: the rest of the compute at its peak (intermediates, gradients in flight,
  the loss).

The compute, per kind of stage (``k`` is the layer at the peak):

- forward (no grad): the values made in the stage and still live, plus layer ``k``'s
  forward peak;
- backward, ``recompute_grain="stage"``: every layer is recomputed with grad, then
  back-propagated deep to shallow; at layer ``k`` the layers before it hold what their
  forward left (``held_bytes``), layer ``k`` its recompute or backward peak (with the
  gradient of its output);
- backward, ``"layer"``: the checkpoint keeps each layer's inputs (``saved``), then one
  layer at a time is recomputed and back-propagated;
- fused tail: as a stage-grain backward without recompute, plus the loss after the last
  layer's forward (``Cost.loss_bytes``; when no loss was costed, ``LOSS_FACTOR`` x the
  model output's bytes: a cross-entropy keeps its log-softmax, then makes its gradient
  and the logits' gradient).

>>> m = ChainMemory(params=(100, 100), grads=(100, 100), boundary=(10, 10), out=(10, 10),
...                 carried=(0, 0), fwd_peak=(20, 20), recompute_peak=(50, 50), held=(40, 40),
...                 bwd_peak=(60, 60), input_bytes=10)
>>> print(stage_peak(m, "bwd", range(0, 2), num_microbatch=1))
bwd 0:2: 520 B (params 200 B, gradients 200 B, activations 20 B, saved 80 B, workspace 20 B) at layer 1
>>> stage_peak(m, "bwd", range(0, 2), grain="layer", num_microbatch=1).total
490
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Literal, Sequence

from fxpipe.passes.program import (
    Checkpoint, GraphForward, GraphRecomputeBackward, GraphUpload, Prefetch, Program, Release,
)
from fxpipe.passes.program import StageKind as Kind
from fxpipe.units import human

KINDS = ("params", "gradients", "activations", "saved", "workspace")
LOSS_FACTOR = 3
Grain = Literal["stage", "layer"]


@dataclass(frozen=True)
class ChainMemory:
    """Per-layer memory of a chain for one microbatch (index = layer), from ``Cost``s.

    ``boundary[i]``: bytes live across the cut after layer ``i``, ``carried[i]`` the part
    layer ``i`` passed on unchanged; ``input_bytes``: the model inputs (before layer 0);
    ``loss_bytes``: the loss's peak, ``None`` when not costed (``LOSS_FACTOR`` x the
    output bytes then); ``kept``: bytes a layer keeps on its stage's device for the whole
    job, counted with the stage's ``params`` but never prefetched (a chunked call's keys and
    values: ``fxpipe.sequence_plan``; empty: none). The other fields are the ``Cost`` memory profile (``params``
    includes buffers).
    """

    params: tuple[int, ...]
    grads: tuple[int, ...]
    boundary: tuple[int, ...]
    out: tuple[int, ...]
    carried: tuple[int, ...]
    fwd_peak: tuple[int, ...]
    recompute_peak: tuple[int, ...]
    held: tuple[int, ...]
    bwd_peak: tuple[int, ...]
    input_bytes: int = 0
    loss_bytes: int | None = None
    kept: tuple[int, ...] = ()

    @classmethod
    def of(cls, costs: Sequence[Any], input_bytes: int = 0) -> ChainMemory:
        """From per-layer ``Cost`` (or ``fxpipe.sim.LayerCost``) objects. A cost without a
        memory profile counts its ``saved_bytes`` plus its boundary as what it holds and
        as every peak.

        >>> from fxpipe.sim import LayerCost
        >>> ChainMemory.of([LayerCost(1.0, 2.0, param_bytes=8, saved_bytes=4)]).held
        (4,)
        """
        def get(c: Any, name: str, default: int = 0) -> int:
            v = getattr(c, name, None)
            return int(default if v is None else v)

        boundary = [get(c, "boundary_bytes") for c in costs]
        out = [get(c, "out_bytes", b) for c, b in zip(costs, boundary)]
        held = [get(c, "held_bytes", get(c, "saved_bytes") + o) for c, o in zip(costs, out)]
        grads = [get(c, "grad_bytes", get(c, "param_bytes")) for c in costs]  # LayerCost: None
        return cls(
            params=tuple(get(c, "param_bytes") + get(c, "buffer_bytes") for c in costs),
            grads=tuple(grads), boundary=tuple(boundary), out=tuple(out),
            carried=tuple(get(c, "carried_bytes") for c in costs),
            fwd_peak=tuple(get(c, "fwd_peak_bytes", o) for c, o in zip(costs, out)),
            recompute_peak=tuple(get(c, "recompute_peak_bytes", h) for c, h in zip(costs, held)),
            held=tuple(held),
            bwd_peak=tuple(get(c, "bwd_peak_bytes", h) for c, h in zip(costs, held)),
            input_bytes=int(input_bytes),
            loss_bytes=getattr(costs[-1], "loss_bytes", None) if costs else None)

    def __len__(self) -> int:
        return len(self.params)

    def before(self, i: int) -> int:
        """Bytes live across the cut before layer ``i`` (the model inputs for layer 0)."""
        return self.input_bytes if i == 0 else self.boundary[i - 1]

    @property
    def loss(self) -> int:
        """The loss's peak: costed, or ``LOSS_FACTOR`` x the model output's bytes."""
        return LOSS_FACTOR * self.boundary[-1] if self.loss_bytes is None else self.loss_bytes


@dataclass(frozen=True)
class StagePeak:
    """A stage's predicted peak on its device: ``bytes`` by kind (``KINDS``), reached while
    computing ``layer``; what it assumed: ``grain``, ``residency``, and ``prefetch``, the
    layers of the stage its device prefetches meanwhile. ``stage`` / ``device``: where it
    sits in a Program, if known."""

    kind: str
    layers: range
    bytes: dict[str, int]
    layer: int
    stage: int | None = None
    device: int | None = None
    grain: str = "stage"
    residency: Residency | None = None
    prefetch: range | None = None

    @property
    def total(self) -> int:
        return sum(self.bytes.values())

    def __str__(self) -> str:
        where = "" if self.stage is None else f"stage {self.stage} "
        on = "" if self.device is None else f" on device {self.device}"
        kinds = ", ".join(f"{k} {human_bytes(self.bytes[k])}" for k in KINDS)
        return (f"{where}{self.kind} {self.layers.start}:{self.layers.stop}{on}: "
                f"{human_bytes(self.total)} ({kinds}) at layer {self.layer}")


@dataclass(frozen=True)
class Residency:
    """How many microbatches' worth of a stage's boundary values are on its device at
    once: its inputs, the gradients of its values (backward), its values or input
    gradients awaiting offload; separately for *carried* values (read beyond the next
    layer: inputs made before the stage's previous layer, values it makes that layers
    after the next one read): a value a stage makes and a later stage on the same device
    reads is kept there for every microbatch (a hand-off)."""

    inputs: int = 1
    grads: int = 1
    outputs: int = 0
    carried_inputs: int = 1
    carried_grads: int = 1
    carried_outputs: int = 0
    # another microbatch's residency the peak may come at instead (the larger counts)
    alternative: Residency | None = None

    def scenarios(self) -> list[Residency]:
        """Each microbatch's residency the peak may come at."""
        if self.alternative is None:
            return [self]
        return [replace(self, alternative=None), *self.alternative.scenarios()]

    @classmethod
    def of(cls, num_microbatch: int, *, inputs_handed: bool = False, grads_handed: bool = False,
           outputs_handed: bool = False, one_device: bool = False) -> Residency:
        """In a Program: the current microbatch's values, the next one's (uploaded during
        this compute), the previous one's outputs until offloaded; every microbatch's for
        the values a stage takes over or hands over on the device: the carried ones, and
        all of them when every stage runs on ``one_device``. With two microbatches the
        first has no previous one and the second no next one: two scenarios
        (``alternative``), the peak is the larger."""
        M = num_microbatch

        def at(ahead: int, behind: int) -> Residency:   # next microbatch's, previous one's
            def n(handed: bool, usual: int) -> int:
                return M if handed else usual

            return cls(n(inputs_handed and one_device, 1 + ahead),
                       n(grads_handed and one_device, 1 + ahead),
                       n(outputs_handed and one_device, behind), n(inputs_handed, 1 + ahead),
                       n(grads_handed, 1 + ahead), n(outputs_handed, behind))

        if M == 2:  # the first has a next one, the last a previous one: never both at once
            return replace(at(1, 0), alternative=at(0, 1))
        return at(int(M > 2), int(M > 2))

    @classmethod
    def worst(cls, num_microbatch: int, num_devices: int) -> Residency:
        """Before the Program exists (the planner): every value that can be handed over
        is: on one device all of them, else the carried ones."""
        return cls.of(num_microbatch, inputs_handed=True, grads_handed=True, outputs_handed=True,
                      one_device=num_devices == 1)


class Growth:
    """A stage's compute peak and own bytes as it takes layers one at a time: a forward
    stage grows deeper from layer ``edge``, a backward or fused stage shallower from
    ``edge`` (its stop). The planner packs with it; ``stage_peak`` grows a whole stage.
    ``own()`` is every kind except the prefetched stage's parameters."""

    def __init__(self, m: ChainMemory, kind: Kind, edge: int, *, grain: Grain = "stage",
                 residency: Residency | None = None):
        if kind not in ("fwd", "bwd", "fused"):
            raise ValueError(f"kind must be 'fwd', 'bwd' or 'fused', got {kind!r}")
        if grain not in ("stage", "layer"):
            raise ValueError(f"grain must be 'stage' or 'layer', got {grain!r}")
        self.m, self.kind, self.layer_grain = m, kind, grain == "layer" and kind == "bwd"
        self.start = self.stop = edge
        self.res = residency or Residency()
        self.params = self.grads = self.kept = 0   # kept: what the job holds, never prefetched
        self.peak = (0, 0, -1)   # (saved, workspace, layer) of the compute's peak

    def __len__(self) -> int:
        return self.stop - self.start

    def add(self) -> None:
        """Take the next layer (deeper for forward, shallower otherwise)."""
        m = self.m
        if self.kind == "fwd":
            k, self.stop = self.stop, self.stop + 1
            live = 0
            if k > self.start:  # values made in the stage and live: the last output, and
                made = m.out[k - 1]   # carried values not among the stage's inputs
                live = made + max(0, m.boundary[k - 1] - made - m.before(self.start))
            self._keep((0, live + m.fwd_peak[k], k))
            self.params += m.params[k]
            self.kept += m.kept[k] if m.kept else 0
            return
        k = self.start = self.start - 1
        last = k == self.stop - 1
        grad_out = 0 if last and self.kind == "bwd" else m.boundary[k]  # else uploaded
        saved, work, at = self.peak
        if self.layer_grain:   # the checkpoint keeps this layer's output for deeper ones
            shifted = (saved + m.out[k], work, at)
            own = max(m.recompute_peak[k], m.bwd_peak[k]) + grad_out
        else:                  # the recompute holds what this layer's forward left
            shifted = (saved + m.held[k], work, at)
            own = max(m.recompute_peak[k], m.bwd_peak[k] + grad_out)
        held = min(m.held[k], own)
        new = (held, own - held, k)
        if self.kind == "fused" and last:  # the loss, after the last layer's forward
            shifted = (m.held[k], m.loss, k)
        self.peak = (0, 0, -1)
        self._keep(new)
        if len(self) > 1 or self.kind == "fused":
            self._keep(shifted)
        self.params += m.params[k]
        self.kept += m.kept[k] if m.kept else 0
        self.grads += m.grads[k]

    def _keep(self, candidate: tuple[int, int, int]) -> None:
        if candidate[0] + candidate[1] > self.peak[0] + self.peak[1] or self.peak[2] < 0:
            self.peak = candidate

    def activations(self) -> int:
        return max(self._activations(r) for r in self.res.scenarios())

    def _activations(self, r: Residency) -> int:
        m, a, b = self.m, self.start, self.stop
        before, after = m.before(a), m.boundary[b - 1]
        cin = m.carried[a - 1] if a > 0 else 0      # inputs made before the previous layer
        made = after - min(cin, after)              # what the stage makes (not passed through)
        onward = min(made, max(0, (m.carried[b] if b < len(m) else 0) - cin))  # read beyond
        handed = r.inputs if self.kind == "bwd" else r.carried_inputs  # bwd: from the host
        acts = (before - cin) * r.inputs + cin * handed
        if self.kind == "fwd":                      # its values, until offloaded
            return acts + (made - onward) * r.outputs + onward * r.carried_outputs
        if self.kind == "bwd":                      # the gradients of its values
            acts += (made - onward) * r.grads + onward * r.carried_grads
        if a > 0:                                   # its input gradients, until offloaded
            acts += (before - cin) * r.outputs + cin * r.carried_outputs
        return acts

    def bytes(self, prefetched: int = 0) -> dict[str, int]:
        """The peak by kind, with ``prefetched`` bytes of the next stage's parameters."""
        saved, work, _ = self.peak
        return {"params": self.params + self.kept + prefetched,
                "gradients": self.grads,
                "activations": self.activations(), "saved": saved, "workspace": work}

    def own(self) -> int:
        return sum(self.bytes().values())


def stage_peak(m: ChainMemory, kind: Kind, layers: range, *, grain: Grain = "stage",
               num_microbatch: int = 1, residency: Residency | None = None,
               prefetch: range | None = None, stage: int | None = None,
               device: int | None = None) -> StagePeak:
    """The peak of a stage running ``layers`` (see the module docstring). ``residency``
    defaults to ``Residency.of(num_microbatch)``; ``prefetch``: the layers of the stage
    its device prefetches meanwhile (their parameters count)."""
    if not layers or layers.start < 0 or layers.stop > len(m):
        raise ValueError(f"layers {layers.start}:{layers.stop} are not a non-empty range of "
                         f"the chain's {len(m)} layers")
    residency = residency or Residency.of(num_microbatch)
    g = Growth(m, kind, layers.start if kind == "fwd" else layers.stop, grain=grain,
               residency=residency)
    for _ in layers:
        g.add()
    prefetched = sum(m.params[i] for i in prefetch or ())
    return StagePeak(kind, layers, g.bytes(prefetched), g.peak[2], stage, device,
                     "layer" if g.layer_grain else "stage", residency, prefetch)


def program_peaks(program: Program, m: ChainMemory) -> list[StagePeak]:
    """Every stage's peak in a ``Program``: its device, the stage that device prefetches
    next, what is handed over on the device, and its grain (a stage with ``Checkpoint``
    actions runs at layer grain) come from the Program."""
    order: dict[int, tuple[int, int | None]] = {}   # stage -> (device, next stage there)
    split: set[int] = set()
    for d, acts in enumerate(program.actions):
        stages = [a.stage for a in acts if isinstance(a, Prefetch)]
        for s, nxt in zip(stages, stages[1:] + [None]):
            order[s] = (d, nxt)
        split |= {a.stage for a in acts if isinstance(a, Checkpoint)}
    flow, M = program.flow, program.num_microbatches
    handed = {p for keys in flow.handoff.values() for _, p in keys}    # values and gradients
    handed |= {p for parts in flow.grad_parts.values() for _, p in parts}  # taken on the device
    grads_here = {key[0] for key, parts in flow.grad_parts.items() if parts}
    peaks = []
    for st in program.stages:
        if st.index not in order:
            continue
        d, nxt = order[st.index]
        res = Residency.of(M, inputs_handed=any(flow.handoff.get((st.index, mb)) for mb in range(M)),
                           grads_handed=st.index in grads_here, outputs_handed=st.index in handed,
                           one_device=program.num_devices == 1)
        peaks.append(stage_peak(m, st.kind, st.layers, grain="layer" if st.index in split else "stage",
                                residency=res, stage=st.index, device=d,
                                prefetch=None if nxt is None else program.stages[nxt].layers))
    return peaks


GRAPH_SLOTS = 2
"""Parameter slots per device under ``stage_backend="cudagraphs"`` (``runtime.stages.graphs``)."""


def with_graphs(peaks: Sequence[StagePeak], program: Program, m: ChainMemory) -> list[StagePeak]:
    """``peaks`` as a Program with graph jobs (``GraphForward``, ``GraphRecomputeBackward``:
    ``stage_backend="cudagraphs"``) holds memory, by device, per graph:

    - its parameter slots, ``GRAPH_SLOTS`` x the largest graphed stage's parameters (and
      gradients, for a backward), under ``params`` (a graphed stage's own parameters and
      its prefetched one's are in them; another stage's come on top);
    - each live graph's own inputs and outputs, kept between calls, under ``workspace``: a
      graph per graphed stage, parameter slot it is uploaded into (:func:`graph_slots`)
      and, where its inputs come by ``GraphUpload``, input slot (microbatch parity); a
      forward's output boundary, a backward's input boundary (its gradient out) and its
      output boundary (the gradient coming in); and its input boundary, once per graph,
      or once per input slot where a ``GraphUpload`` writes it (its graphs read it;
      conservative: the stage's peak counts its inputs under ``activations`` too);
    - the device's graph pool, under ``workspace``: what a graphed job computes with at its
      peak (``saved`` and ``workspace`` of its stage's peak), the largest on the device,
      held for the graphs' life (one pool and one capture stream per device: the graphs
      reuse each other's intermediates). A graphed stage's own compute is in the pool,
      not on top of it.

    Conservative: a graphed backward's gradients are counted in the slots and under
    ``gradients`` too."""
    graphed: dict[int, int] = {}   # stage -> device
    for d, acts in enumerate(program.actions):
        graphed |= {a.stage: d for a in acts
                    if isinstance(a, (GraphForward, GraphRecomputeBackward))}
    if not graphed:
        return list(peaks)
    uses = graph_slots(program, set(graphed))
    parities: dict[int, set[int]] = {}   # stage -> the input slots its GraphUploads write
    for acts in program.actions:
        for a in acts:
            if isinstance(a, GraphUpload):
                parities.setdefault(a.stage, set()).add(a.mb % 2)
    slots: dict[int, int] = {}
    statics: dict[int, int] = {}
    pool: dict[int, int] = {}
    for p in peaks:
        if p.stage in graphed:
            pool[p.device] = max(pool.get(p.device, 0), p.bytes["saved"] + p.bytes["workspace"])
    for s, d in graphed.items():
        st = program.stages[s]
        held = sum(m.params[i] for i in st.layers)
        if st.kind != "fwd":
            held += sum(m.grads[i] for i in st.layers)
        slots[d] = max(slots.get(d, 0), GRAPH_SLOTS * held)
        into = m.input_bytes if st.layers.start == 0 else m.boundary[st.layers.start - 1]
        out = m.boundary[st.layers.stop - 1]
        per_graph = out if st.kind == "fwd" else into + out
        inputs = len(parities.get(s, ()))
        graphs = max(1, uses.get(s, 1)) * max(1, inputs)
        statics[d] = statics.get(d, 0) + graphs * per_graph + (inputs or graphs) * into
    out_peaks = []
    for p in peaks:
        b = dict(p.bytes)
        slot = slots.get(p.device, 0)
        b["params"] = max(b["params"], slot) if p.stage in graphed else b["params"] + slot
        if p.stage in graphed:   # its compute runs in the pool
            b["saved"] = b["workspace"] = 0
        b["workspace"] += statics.get(p.device, 0) + pool.get(p.device, 0)
        out_peaks.append(replace(p, bytes=b))
    return out_peaks


def graph_slots(program: Program, graphed: set[int]) -> dict[int, int]:
    """How many parameter slots each graphed stage is uploaded into over repeated calls
    (each is a graph of its own: ``runtime.stages.graphs`` keys a job by its slot): each
    device's ``Prefetch``es take the first free slot and its ``Release``s give it back,
    as ``StageGraphs.take`` does, over two calls (the slots carry over between calls)."""
    taken: dict[int, set[int]] = {}
    for acts in program.actions:
        holder: list[int | None] = [None] * GRAPH_SLOTS
        for a in (*acts, *acts):
            if isinstance(a, Prefetch) and a.stage in graphed:
                free = next((i for i, h in enumerate(holder) if h is None), None)
                if free is not None:   # else it falls back to the compiled code
                    holder[free] = a.stage
                    taken.setdefault(a.stage, set()).add(free)
            elif isinstance(a, Release) and a.stage in holder:
                holder[holder.index(a.stage)] = None
    return {s: len(used) for s, used in taken.items()}


def device_peaks(peaks: Sequence[StagePeak], num_devices: int) -> list[StagePeak | None]:
    """Per device, the stage whose peak is highest there (``None``: no stage)."""
    out: list[StagePeak | None] = [None] * num_devices
    for p in peaks:
        best = out[p.device]
        if best is None or p.total > best.total:
            out[p.device] = p
    return out


def human_bytes(n: float) -> str:
    """``1.05 GB``, ``32.8 kB``, ``512 B``: three significant digits, SI prefixes."""
    return human(int(n), "B")
