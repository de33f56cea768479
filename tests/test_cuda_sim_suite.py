"""The HF matrix (a decoder, an encoder-decoder, an MoE captured by blocks), fuzz and
artifact suites once more, on virtual devices with a GPU's semantics toward the host
(``FXPIPE_TEST_DEVICE=cuda-sim``: ``VirtualDevice(semantics="cuda")``, copies land when
their stream reaches them, unwritten memory reads as NaN). The runtime's own tests run on
those semantics in the suite itself (``conftest.ON_CUDA_SIM``).

A runtime that reads data on the host before the copy bringing it has landed, or that
frees memory a stream may still read, passes on plain virtual devices (a copy there is
done when it returns) and fails here, as it would on a GPU.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
SUITES = {"hf-matrix-fuzz": ["test_hf_matrix.py", "test_fuzz.py", "test_artifact.py"]}


@pytest.mark.skipif(os.environ.get("FXPIPE_TEST_DEVICE") == "cuda-sim",
                    reason="already running on cuda-sim devices")
@pytest.mark.parametrize("part", SUITES)
def test_suites_pass_on_cuda_semantics(part):
    env = {**os.environ, "FXPIPE_TEST_DEVICE": "cuda-sim"}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", *[f"tests/{s}" for s in SUITES[part]], "-q", "-p",
         "no:logging"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    report = (run.stdout + run.stderr)[-6000:]
    assert run.returncode == 0, f"fails with GPU semantics (FXPIPE_TEST_DEVICE=cuda-sim):\n{report}"
    assert " passed" in report, report
