"""The examples in ``examples/`` run, in their small size, and check what they claim.

Each runs as a user would run it (``python examples/<name>.py``, from the repository
root) with ``FXPIPE_EXAMPLE_SMALL=1``; the example itself compares with eager PyTorch or
checks that the loss fell, and exits non-zero otherwise. Most of an example's time was
importing torch and transformers (some 7 s of CPU a process): the single-process ones
run one after another in one interpreter (:data:`RUNNER`: each as ``__main__`` through
``runpy``, with its own ``sys.argv`` and ``sys.path[0]``, its exit code, output and
traceback kept), ``train_distributed`` in its own process (it spawns its ranks).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parent.parent
EXPECTED = {
    "finetune_hf": r"loss \d+\.\d+ -> \d+\.\d+ over \d+ steps",
    "inference": r"logits equal to eager at every step .* same tokens",
    "generate": r"reward \d+\.\d+ -> \d+\.\d+ over \d+ rounds of generate \+ train",
    "grpo": r"GRPO: reward \d+\.\d+ -> \d+\.\d+ over \d+ rounds of \d+ prompts x \d+ completions",
    "encoder_decoder": r"gradients of encoder and decoder equal eager",
    "train_distributed": r"loss \d+\.\d+ -> \d+\.\d+ over \d+ steps on 2 ranks; parameters "
                         r"identical on every rank: True",
}
OWN_PROCESS = {"train_distributed"}   # mp.spawn: its ranks import the script as __main__

# examples/<name>.py for each name in argv[2:], in order, as `python examples/<name>.py`
# runs it; {name: {returncode, stdout, stderr}} written to argv[1] as JSON
RUNNER = r"""
import contextlib, io, json, os, runpy, sys, traceback
out_file, names, results = sys.argv[1], sys.argv[2:], {}
for name in names:
    path = os.path.join("examples", name + ".py")
    sys.argv = [path]
    sys.path[0] = os.path.dirname(os.path.abspath(path))
    out, err, code = io.StringIO(), io.StringIO(), 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_path(path, run_name="__main__")
        except SystemExit as e:
            if isinstance(e.code, str):
                print(e.code, file=sys.stderr)
            code = e.code if isinstance(e.code, int) else int(e.code is not None)
        except BaseException:
            traceback.print_exc()
            code = 1
    results[name] = {"returncode": code, "stdout": out.getvalue(), "stderr": err.getvalue()}
with open(out_file, "w") as f:
    json.dump(results, f)
"""


def run(*cmd: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "FXPIPE_EXAMPLE_SMALL": "1"}
    return subprocess.run([sys.executable, *cmd], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)


@pytest.fixture(scope="module")
def in_one_process(tmp_path_factory) -> dict:
    """The single-process examples' results, run once in one interpreter."""
    names = [n for n in EXPECTED if n not in OWN_PROCESS]
    out = tmp_path_factory.mktemp("examples") / "results.json"
    proc = run("-c", RUNNER, str(out), *names)
    assert proc.returncode == 0 and out.exists(), (
        f"the examples' runner exited with {proc.returncode}\n--- stdout\n"
        f"{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


@pytest.mark.parametrize("name", list(EXPECTED))
def test_example_runs(name: str, request) -> None:
    if name in OWN_PROCESS:
        proc = run(f"examples/{name}.py")
        returncode, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
    else:
        result = request.getfixturevalue("in_one_process")[name]
        returncode, stdout, stderr = result["returncode"], result["stdout"], result["stderr"]
    assert returncode == 0, (f"examples/{name}.py exited with {returncode}\n"
                             f"--- stdout\n{stdout[-3000:]}\n--- stderr\n{stderr[-3000:]}")
    expected = EXPECTED[name]
    assert re.search(expected, stdout), \
        f"examples/{name}.py printed no line matching {expected!r}:\n{stdout}"
