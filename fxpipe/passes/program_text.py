"""A Program as text and back: ``program_text(p)`` is ``str(p)`` (a header, the
``inputs`` / ``outputs`` / ``input-grads`` / ``shared`` lines, one line per stage with
what it reads, makes and owns, then the table of lanes: one column per device and one
for the host), ``parse_program(Program, text)`` its inverse (``Program.parse``).
"""

from __future__ import annotations

import re

from fxpipe.passes.actions import StageSpec, parse_action


def program_text(p) -> str:
    """``str(p)``: the header, the stage lines and the table of lanes."""
    lines = [f"program devices={p.num_devices} microbatches={p.num_microbatches}"]
    if p.inputs:
        lines.append("inputs " + " ".join(p.inputs))
    if p.outputs:
        lines.append("outputs " + " ".join(p.outputs))
    if p.input_grads:
        lines.append("input-grads " + " ".join(p.input_grads))
    lines += ["shared " + " ".join(map(str, group)) for group in p.shared]
    lines += [f"stage {st}" for st in p.stages]
    lanes = [*p.actions, p.host]
    steps = max((len(a) for a in lanes), default=0)
    cells = [["step"] + [f"d{d}" for d in range(p.num_devices)] + ["host"]]
    for i in range(steps):
        cells.append([str(i)] + [str(a[i]) if i < len(a) else "." for a in lanes])
    widths = [max(len(row[c]) for row in cells) + 1 for c in range(len(cells[0]))]
    for row in cells:
        lines.append("".join(x.ljust(w) for x, w in zip(row, widths)).rstrip())
    return "\n".join(lines)


def parse_program(cls, text: str):
    """Inverse of :func:`program_text`: a ``cls`` (``Program``) from its text."""
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
    lanes: list[list] = [[] for _ in range(num_devices + 1)]
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
