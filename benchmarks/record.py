"""Run a benchmark and stamp its result JSON with how it was made.

    python benchmarks/record.py benchmarks/results/bench_schedule.json -- \\
        python benchmarks/bench_schedule.py

runs the command (from the repository root), then adds to the JSON it wrote a
``"runs"`` entry: the exact command, the top-level keys it wrote, the date, the commit,
a description of the machine and its load average before and after (other jobs on a
shared machine slow a timing down). ``benchmarks/report.py`` prints each table with the
command that produced it. Nothing else is changed in the file; a command that fails or
does not write the file records nothing.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} CPUs, {platform.system()} {platform.release()}, Python {platform.python_version()}"


def main(argv: list[str]) -> int:
    if "--" not in argv or argv.index("--") != 1:
        print(__doc__)
        return 2
    out = (ROOT / argv[0]).resolve()
    command = argv[2:]
    before = json.loads(out.read_text()) if out.exists() else {}
    mtime = out.stat().st_mtime if out.exists() else None
    load_before = os.getloadavg()[0]
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    rc = subprocess.call(command, cwd=ROOT, env=env)
    if rc != 0 or not out.exists() or out.stat().st_mtime == mtime:
        print(f"record: {shlex.join(command)} exited {rc} without writing {argv[0]}; nothing recorded",
              file=sys.stderr)
        return rc or 1
    result = json.loads(out.read_text())
    runs = [r for r in before.get("runs", []) if isinstance(r, dict)]
    command_text = shlex.join(["python" if Path(command[0]).name.startswith("python") else command[0],
                               *command[1:]])
    same = {k for r in runs if r.get("command") == command_text for k in r.get("keys", [])}
    written = sorted(k for k in result if k != "runs" and (result[k] != before.get(k) or k in same))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True).stdout.strip()
    for r in runs:   # an earlier run no longer made what this one rewrote
        r["keys"] = [k for k in r.get("keys", []) if k not in written]
    runs = [r for r in runs if r.get("command") != command_text and r["keys"]]
    runs.append({"command": command_text, "keys": written,
                 "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
                 "commit": commit, "machine": machine(),
                 "load": [round(load_before, 1), round(os.getloadavg()[0], 1)]})
    result["runs"] = runs
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"record: {argv[0]}: {command_text} wrote {', '.join(written)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
