"""The GPU acceptance kit runs end to end without a GPU (``--dry-run``): CI keeps it
working for the day a GPU runs it."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_check_dry_run_writes_every_figure(tmp_path):
    out = tmp_path / "check.json"
    run = subprocess.run([sys.executable, "-m", "fxpipe.check", "--dry-run", "--skip-tests",
                          "--repeats", "1", "--out", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["dry_run"] is True and len(report["devices"]) == 2
    assert report["vs_checkpoint"]["ratio_median"] > 0
    assert set(report["scaling"]["devices"]) == {"1", "2"}
    traced = report["traced"]
    assert set(traced["hidden_prefetch"]) == {"0", "1"}
    assert all(0.0 <= f <= 1.0 for f in traced["hidden_prefetch"].values() if f is not None)
    assert traced["predicted_ms"] > 0 and traced["measured_ms"] > 0
    assert traced["stats"]["host_waits"] == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible: the kit would run")
def test_check_without_a_gpu_says_what_to_do():
    run = subprocess.run([sys.executable, "-m", "fxpipe.check"], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 2 and "--dry-run" in run.stderr
