"""The values lowering makes: a ``Stage`` (one GraphModule with its transfers) and an
``Executable`` (everything one kind of call runs: its Program and every GraphModule its
computes execute). The runtime interprets an ``Executable`` and nothing else."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.fx as fx

from fxpipe.passes.program import Program


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
    tail: tuple[str, ...] = ()  # nodes a recompute for backward skips (passes.recompute)
    kind: str = "fwd"
    piece: bool = False

    @property
    def code(self) -> str:
        return self.gm.code


@dataclass(frozen=True)
class Executable:
    """What one kind of call runs (``passes.executable.build_executable``).

    ``stages``: the Program's stages by index; ``pieces``: at ``grain="layer"``, the
    single-layer pieces a split backward stage runs instead, by ``(stage, layer)``;
    ``top``: the top-level graph calling the forward stages (what ``print(pipe)`` shows
    for the inference Executable).
    """

    run_type: str
    grain: str
    program: Program
    stages: dict[int, Stage]
    pieces: dict[tuple[int, int], Stage] = field(default_factory=dict)
    top: fx.GraphModule | None = None

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


def comment_at_top(g: fx.Graph, comment: str) -> None:
    """Put ``# comment`` as the first line of ``g``'s generated code (it is what runs)."""
    def make(prev):
        def transform(lines):
            lines = prev(lines) if prev else lines
            return [f"# {comment}\n"] + lines
        return transform
    g.on_generate_code(make)
