"""The examples in ``examples/`` run, in their small size, and check what they claim.

Each runs as a user would (``python examples/<name>.py``, from the repository root) with
``FXPIPE_EXAMPLE_SMALL=1``; the example itself compares with eager PyTorch or checks that
the loss fell, and exits non-zero otherwise. Most of their time is importing torch and
transformers and capturing the models (about 35 s of CPU for the three).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("name, expected", [
    ("finetune_hf", r"loss \d+\.\d+ -> \d+\.\d+ over \d+ steps"),
    ("inference", r"logits equal to eager at every step .* same tokens"),
    ("generate", r"reward \d+\.\d+ -> \d+\.\d+ over \d+ rounds of generate \+ train"),
    ("grpo", r"GRPO: reward \d+\.\d+ -> \d+\.\d+ over \d+ rounds of \d+ prompts x \d+ completions"),
    ("encoder_decoder", r"gradients of encoder and decoder equal eager"),
    ("train_distributed", r"loss \d+\.\d+ -> \d+\.\d+ over \d+ steps on 2 ranks; parameters "
                          r"identical on every rank: True"),
])
def test_example_runs(name: str, expected: str) -> None:
    env = {**os.environ, "FXPIPE_EXAMPLE_SMALL": "1"}
    proc = subprocess.run([sys.executable, f"examples/{name}.py"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (f"examples/{name}.py exited with {proc.returncode}\n"
                                  f"--- stdout\n{proc.stdout[-3000:]}\n"
                                  f"--- stderr\n{proc.stderr[-3000:]}")
    assert re.search(expected, proc.stdout), \
        f"examples/{name}.py printed no line matching {expected!r}:\n{proc.stdout}"
