"""The kit's ``cuda_tests`` section: ``pytest`` over the CUDA tests, in a subprocess whose
process group is killed past its share of the time budget (``kit.deadline_s``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from fxpipe.check.common import ROOT, TAIL_LINES, say
from fxpipe.check.harness import Kit

CUDA_TESTS = ["tests/test_cuda.py", "tests/test_devices.py", "tests/test_params.py"]


def run_subprocess(cmd: list[str], timeout: float, cwd: Path | None = None) -> dict[str, Any]:
    """Run ``cmd`` in its own process group; past ``timeout`` s the group is killed and the
    result says so, with the tail of what it printed."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)

    def kill() -> None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)   # the group this Popen started
        except ProcessLookupError:
            pass

    try:
        out, _ = proc.communicate(timeout=max(1.0, timeout))
        timed_out = False
    except subprocess.TimeoutExpired:
        kill()
        out, _ = proc.communicate()
        timed_out = True
    except BaseException:   # Ctrl-C: its own session would not get it
        kill()
        proc.wait()
        raise
    lines = (out or "").strip().splitlines()
    return {"returncode": proc.returncode, "timed_out": timed_out, "timeout_s": round(timeout, 1),
            "seconds": round(time.perf_counter() - t0, 1), "tail": lines[-TAIL_LINES:]}


def cuda_tests(kit: Kit) -> dict[str, Any]:
    """``pytest`` over the CUDA tests (skipped, and said so, without a checkout)."""
    if kit.skip_tests:
        return {"ran": False, "why": "--skip-tests"}
    if not (ROOT / "tests").is_dir():
        return {"ran": False, "why": "no tests/ beside the package (not a source checkout)"}
    cmd = [sys.executable, "-m", "pytest", *CUDA_TESTS, "-q", "-p", "no:logging", "-k",
           "cuda or gpu or Cuda"]
    timeout = kit.deadline_s if kit.deadline_s is not None else 900.0
    say(f"  pytest {' '.join(cmd[3:])} (timeout {timeout:.0f} s)")
    run = run_subprocess(cmd, timeout, cwd=ROOT)
    summary = run["tail"][-1] if run["tail"] else ""
    out = {"ok": run["returncode"] == 0 and not run["timed_out"], "ran": True,
           "returncode": run["returncode"], "summary": summary,
           "gpu": torch.cuda.is_available() and not kit.dry_run}
    if run["timed_out"]:
        out["error"] = {"type": "TimeoutExpired",
                        "message": f"the CUDA tests ran past their {timeout:.0f} s share of the "
                                   "time budget (--budget-s) and were killed",
                        "output_tail": run["tail"]}
    elif run["returncode"] != 0:
        out["output_tail"] = run["tail"]
    return out


def cuda_tests_summary(r: dict[str, Any]) -> str:
    return r.get("summary") or r.get("why", "")
