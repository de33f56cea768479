"""The values lowering makes: a ``Stage`` (one GraphModule with its transfers) and an
``Executable`` (everything one kind of call runs: its Program and every GraphModule its
computes execute). The runtime interprets an ``Executable`` and nothing else."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch.fx as fx

from fxpipe.passes.program import (
    HOST, Commit, DeviceAllGather, Forward, Free, GraphUpload, Offload, Prefetch, Program,
    Refresh, Release, Upload,
)


@dataclass
class Stage:
    """One lowered stage: layers ``layers`` on device ``device`` (index into the devices).

    ``kind``: ``"fwd"``, ``"bwd"`` (recomputed, then back-propagated) or ``"fused"``; a
    layer-grain *piece* of a ``bwd`` stage is a ``Stage`` over one layer with the same
    ``index`` and ``piece=True``."""

    index: int
    layers: range
    device: int
    gm: fx.GraphModule
    inputs: list[str]     # carried values it reads
    outputs: list[str]    # carried values it makes for later stages / the output
    params: list[str]     # FQNs of the tensors it prefetches (parameters, then buffers)
    header: str           # the one-line comment at the top of its code
    random: bool = False  # some layer draws random numbers (has an rng marker)
    unfilled: tuple[str, ...] = ()  # nodes a recompute for backward leaves unfilled (passes.recompute)
    kind: str = "fwd"
    piece: bool = False

    @property
    def code(self) -> str:
        return self.gm.code


@dataclass(frozen=True)
class Executable:
    """What one kind of call runs (``passes.executable.build_executable``).

    ``stages``: the Program's stages by index; ``pieces``: at ``grain="layer"``, the
    single-layer pieces a split backward stage runs instead, by ``(stage, layer)``.
    """

    run_type: str
    grain: str
    program: Program
    stages: dict[int, Stage]
    pieces: dict[tuple[int, int], Stage] = field(default_factory=dict)

    def split(self, stage: int) -> bool:
        """Whether ``stage`` runs as layer pieces (``Checkpoint`` + per-layer backward)."""
        return (stage, self.stages[stage].layers.start) in self.pieces

    def graph_modules(self) -> list[Stage]:
        """Every stage or piece whose GraphModule this Executable runs, in stage order."""
        out: list[Stage] = []
        for index in sorted(self.stages):
            st = self.stages[index]
            out += [self.pieces[(index, i)] for i in st.layers] if self.split(index) else [st]
        return out

    def code(self) -> str:
        """The code of every GraphModule it runs, each starting with its ``# stage ...``
        header line."""
        return "\n\n".join(st.gm.code.strip("\n") for st in self.graph_modules()) + "\n"

    def listing(self, device_names: Sequence[str], inputs: Sequence[str]) -> str:
        """The Program as code: every action of a call, one line each, in an order its
        dependencies allow (``Program.order``): the transfers (``prefetch``, ``upload``,
        ``offload``, ``free``, ``release``), each stage's call on its device, the host's
        actions; the action's ``str`` and where it runs as a comment. ``inputs``: the
        model's input names (the ``def`` line). Written for forward Programs (what
        ``print(pipe)`` shows: ``pipe(x)`` under ``no_grad``); other run types list
        their actions by name."""
        p = self.program
        flow, M = p.flow, p.num_microbatches

        def name(v: str, m: int, d: int | None = None) -> str:
            base = v.strip("<>") + (f"_{m}" if M > 1 else "")
            return base if d is None else f"{base}_d{d}"

        lines, shown = [f"def forward(self, {', '.join(inputs)}):"], set()
        slotted: set[tuple[int, int, int]] = set()   # (lane, stage, microbatch): GraphUpload
        if M > 1:
            parts = ", ".join(name(v, m) for v in p.inputs for m in range(M))
            lines.append(f"    {parts} = split({', '.join(p.inputs)}, {M})".ljust(60)
                         + f"  # the caller's inputs, {M} microbatches")
        for lane, i in p.order():
            a = p.lane(lane)[i]
            where = "host" if lane == HOST else device_names[lane]
            s = getattr(a, "stage", None)
            m = getattr(a, "mb", 0)
            st = self.stages.get(s) if s is not None else None
            if isinstance(a, Prefetch) and s not in shown and st is not None:
                shown.add(s)
                lines.append(f"    # {st.header}")
            if isinstance(a, Refresh):
                code = "refresh()"
            elif isinstance(a, Prefetch):
                code = f"params_{s} = prefetch(self.stage_{s}, {where!r})"
            elif isinstance(a, DeviceAllGather):   # zero3: the other ranks' parts, in place
                code = f"all_gather(params_{s})"
            elif isinstance(a, Upload):   # a GraphUpload into its graph's input slot
                vals = flow.upload.get((s, m), ())
                slot = f", slot={m % 2}" if isinstance(a, GraphUpload) else ""
                if slot:
                    slotted.add((lane, s, m))
                code = (f"{', '.join(name(v, m, lane) for v in vals)} = "
                        f"upload({', '.join(name(v, m) for v in vals)}, {where!r}{slot})")
            elif isinstance(a, Forward):
                ins = [name(v, m, lane) for v in flow.upload.get((s, m), ())]
                ins += [name(v, m, lane) for v, _ in flow.handoff.get((s, m), ())]
                outs = ", ".join(name(v, m, lane) for v in p.stages[s].makes) or "_"
                code = f"{outs} = self.stage_{s}(params_{s}, {', '.join(ins)})"
            elif isinstance(a, Offload):
                vals = flow.offload.get((s, m), ())
                code = (f"{', '.join(name(v, m) for v in vals)} = "
                        f"offload({', '.join(name(v, m, lane) for v in vals)})")
            elif isinstance(a, Free):   # (what a GraphUpload put in an input slot stays)
                vals = [] if (lane, s, m) in slotted else list(flow.upload.get((s, m), ()))
                vals += flow.free.get((s, m), ())
                code = f"free({', '.join(name(v, m, lane) for v in vals)})"
            elif isinstance(a, Release):
                code = f"release(params_{s})"
            elif isinstance(a, Commit):
                outs = [name(v, k) for k in range(M) for v in p.outputs]
                code = f"return commit({', '.join(outs)})"
            else:
                code = f"{type(a).__name__.lower()}()"
            lines.append(f"    {code}".ljust(60) + f"  # {a} {where}")
        return "\n".join(line.rstrip() for line in lines) + "\n"


def comment_at_top(g: fx.Graph, comment: str) -> None:
    """Put ``# comment`` as the first line of ``g``'s generated code (it is what runs)."""
    def make(prev):
        def transform(lines):
            lines = prev(lines) if prev else lines
            return [f"# {comment}\n"] + lines
        return transform
    g.on_generate_code(make)
