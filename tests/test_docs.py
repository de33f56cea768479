"""The pages that say their Python blocks run do run: every ```python block, in order, in
one fresh interpreter, as a reader would paste them, printing what the page shows.

A page makes the claim with the sentence ``Every Python block on this page runs`` (the
user guide does); each such page is one test. The blocks run with the page's line
numbers (a traceback names ``docs/PAGE.md:LINE``), in a temporary working directory
(files a block writes land there), on CPU. A ```text block right after a Python block is
what that block prints, compared as doctest compares (``...`` matches anything: a
measured time, the lines left out). A block that cannot run in one session (a script
each ``torchrun`` rank runs) opens with the comment ``# not run on this page:`` and why;
it is compiled, not run.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CLAIM = "Every Python block on this page runs"
SKIP = "# not run on this page:"
BLOCK = re.compile(r"^```python\n(.*?)^```\n(?:```text\n(.*?)^```\n)?", re.S | re.M)

RUNNER = r"""
import contextlib, doctest, io, json, sys
path, skip, blocks = sys.argv[1], sys.argv[2], json.loads(sys.stdin.read())
check = doctest.OutputChecker()
flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
scope = {"__name__": "__main__"}
for line, code, want in blocks:
    compiled = compile("\n" * (line - 1) + code, path, "exec")
    if code.startswith(skip):
        continue
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compiled, scope)
    got = out.getvalue()
    sys.stdout.write(got)
    if want is not None and not check.check_output(want, got, flags):
        sys.exit(f"{path}:{line}: the block prints\n{got}\nwhere the page shows\n{want}")
"""


def blocks(page: Path) -> list[tuple[int, str, str | None]]:
    """``(line of the block's first line, code, the text shown as its output or None)``
    for each ```python block of ``page``."""
    text = page.read_text()
    return [(text.count("\n", 0, m.start(1)) + 1, m.group(1), m.group(2))
            for m in BLOCK.finditer(text)]


PAGES = sorted(p for p in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]
               if CLAIM in p.read_text())


def test_the_user_guide_claims_it():
    assert ROOT / "docs" / "user-guide.md" in PAGES


def test_blocks_are_found_with_their_lines_and_outputs():
    page = ROOT / "docs" / "user-guide.md"
    found = blocks(page)
    lines = page.read_text().splitlines()
    assert len(found) > 20
    for line, code, _ in found:
        assert lines[line - 2] == "```python" and lines[line - 1] == code.splitlines()[0]
    shown = {code.strip(): want for _, code, want in found if want is not None}
    assert shown["print(pipe)"].startswith("# PipelineModule: 6 layers")


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_every_block_runs_in_order(page: Path, tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    rel = str(page.relative_to(ROOT))
    proc = subprocess.run([sys.executable, "-c", RUNNER, rel, SKIP],
                          input=json.dumps(blocks(page)), cwd=tmp_path, capture_output=True,
                          text=True, timeout=900,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, (f"a block of {rel} failed\n--- stderr\n{proc.stderr[-6000:]}"
                                  f"\n--- stdout\n{proc.stdout[-1500:]}")
