"""``python -m fxpipe.check``: the GPU kit's command line (the kit: ``fxpipe.check``'s
docstring). Parses the arguments, sizes the model to the GPUs, runs the sections
(``harness.run_sections``) and writes the JSON; the exit code is 1 when a section failed,
2 when the arguments (or the machine) do not allow a run."""

from __future__ import annotations

import argparse
import faulthandler
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

import fxpipe.check
from fxpipe.check.common import ROOT, model_shape, say
from fxpipe.check.finetune import GPU_STAGE_BACKENDS, KIT_MODES, RUN_MODES
from fxpipe.check.harness import Kit, SectionTimeout, run_sections, write
from fxpipe.check.sections import SECTIONS
from fxpipe.config import STAGE_BACKENDS


def main(argv: list[str] | None = None) -> int:
    global _interrupted
    ap = argparse.ArgumentParser(prog="python -m fxpipe.check",
                                 description=fxpipe.check.__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true",
                    help="no GPU needed: virtual devices with GPU semantics, tiny models")
    ap.add_argument("--out", default=None, help="JSON file (default: fxpipe_check.json, or "
                    "benchmarks/results/gpu_check[_dry_run].json in a source checkout)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--skip-tests", action="store_true", help="measure only")
    ap.add_argument("--budget-s", type=float, default=540.0,
                    help="time for the whole kit, in seconds (default 540)")
    ap.add_argument("--sections", default=None, metavar="NAME,...",
                    help="run only these sections, in this order (default: all: "
                    + ",".join(SECTIONS) + ")")
    ap.add_argument("--stage-backends", default=None, metavar="NAME,...",
                    help="finetune: run fxpipe with each RunConfig.stage_backend (eager, "
                    "inductor, auto, cudagraphs), in this order; default on a GPU: "
                    "cudagraphs,inductor,eager, in a dry run: eager")
    ap.add_argument("--finetune-modes", default=",".join(KIT_MODES), metavar="NAME,...",
                    help="finetune: these of its runs (" + ", ".join(RUN_MODES)
                    + "; default: " + ",".join(KIT_MODES) + ")")
    ap.add_argument("--fail-section", action="append", default=[], help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    sections = tuple(SECTIONS)
    if args.sections is not None:
        sections = tuple(n.strip() for n in args.sections.split(",") if n.strip())
        unknown = [n for n in sections if n not in SECTIONS]
        if unknown or not sections or len(set(sections)) != len(sections):
            print(f"fxpipe.check: --sections {args.sections!r}: "
                  + (f"no section named {', '.join(unknown)}; " if unknown else
                     "list each section once; " if sections else "empty; ")
                  + f"the sections are {', '.join(SECTIONS)}", file=sys.stderr)
            return 2
    if not args.dry_run and not torch.cuda.is_available():
        print("fxpipe.check: no CUDA GPU visible (torch.cuda.is_available() is False); run on a "
              "GPU machine, or use --dry-run to exercise the kit on CPU", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    if args.out:
        out = Path(args.out)
    elif (ROOT / "benchmarks").is_dir():
        out = ROOT / "benchmarks" / "results" / ("gpu_check_dry_run.json" if args.dry_run
                                                 else "gpu_check.json")
    else:
        out = Path("fxpipe_check.json")
    if args.dry_run:
        torch.set_num_threads(1)   # as each virtual device's workers: a like-for-like eager
    num = 2 if args.dry_run else torch.cuda.device_count()
    shape = model_shape(args.dry_run)
    report: dict[str, Any] = {
        "dry_run": args.dry_run, "torch": torch.__version__, "python": platform.python_version(),
        "devices": (["virtual (semantics=cuda)"] * num if args.dry_run else
                    [torch.cuda.get_device_name(i) for i in range(num)]),
        "model": shape, "budget_s": args.budget_s, "sections": list(sections)}
    say(f"{num} device(s): {report['devices']}; model {shape}; budget {args.budget_s:.0f} s; "
        f"writing {out}")
    # a hang past the budget (in C code, where the alarm cannot reach) still says where
    try:
        faulthandler.dump_traceback_later(args.budget_s + 30, exit=False)
    except (OSError, ValueError):   # a stderr without a file descriptor
        pass
    if args.stage_backends is None:
        args.stage_backends = "eager" if args.dry_run else ",".join(GPU_STAGE_BACKENDS)
    backends = tuple(b.strip() for b in args.stage_backends.split(",") if b.strip())
    if not backends or any(b not in STAGE_BACKENDS for b in backends):
        print(f"fxpipe.check: --stage-backends {args.stage_backends!r}: each must be one of "
              f"{', '.join(STAGE_BACKENDS)}", file=sys.stderr)
        return 2
    modes = tuple(m.strip() for m in args.finetune_modes.split(",") if m.strip())
    if not modes or any(m not in RUN_MODES for m in modes):
        print(f"fxpipe.check: --finetune-modes {args.finetune_modes!r}: each must be one of "
              f"{', '.join(RUN_MODES)}", file=sys.stderr)
        return 2
    # as named: unset would be "auto" (compiled) on a GPU
    kit = Kit(args.dry_run, num, args.repeats, args.skip_tests, shape, backends, modes)
    try:
        failed = run_sections(kit, SECTIONS, sections, report, out, args.budget_s,
                              args.fail_section)
    finally:
        faulthandler.cancel_dump_traceback_later()
        kit.close()
    report["failed"] = failed
    report["seconds"] = round(time.perf_counter() - t0, 1)
    write(out, report)
    say(f"done in {report['seconds']} s; wrote {out}"
        + (f"; FAILED: {', '.join(failed)}" if failed else "; every section ok"))
    _interrupted = any((report[n].get("error") or {}).get("type") == SectionTimeout.__name__
                       for n in sections)
    return 1 if failed else 0


_interrupted = False   # a section was cut off by its alarm (main): device threads may linger


if __name__ == "__main__":
    code = main()
    if _interrupted:   # do not wait for threads an interrupted section may have left running
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
