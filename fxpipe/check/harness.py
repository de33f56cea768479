"""What runs the GPU kit's sections: each in turn within its share of the time budget,
its failure recorded as its result, the JSON file written again after every one.

A section is a function of the ``Kit`` returning a dict (``sections.SECTIONS`` lists
them); ``run_sections`` runs some of them into the report. Knows nothing of what a
section measures: the sections import this module, never the other way round.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fxpipe.check.common import error_record, jsonable, say, settle


class SectionTimeout(Exception):
    """A section ran past its share of the time budget."""


class BudgetSpent(Exception):
    """No time was left for a section."""


@dataclass
class Section:
    """One section of the kit: ``run(kit)`` returns its figures (with ``ok``); ``reserve``
    is the share of the budget kept for it while the sections before it run; ``summary``
    is its one line after it ran (only called on an ``ok`` result); ``alarm=False``: no
    alarm cuts it off (a section that runs a subprocess with ``kit.deadline_s`` as its
    timeout keeps the tail of its output)."""

    name: str
    run: Callable[[Kit], dict[str, Any]]
    reserve: float
    summary: Callable[[dict[str, Any]], str]
    alarm: bool = True


class Kit:
    """What the sections share: the arguments, the model's shape, what is made once for
    several sections (``shared``: the traced step)."""

    def __init__(self, dry_run: bool, num_devices: int, repeats: int, skip_tests: bool,
                 shape: dict[str, int], stage_backends: tuple[str | None, ...] = ("eager",),
                 finetune_modes: tuple[str, ...] | None = None):
        self.dry_run, self.num, self.repeats = dry_run, num_devices, repeats
        self.skip_tests, self.shape = skip_tests, shape
        self.stage_backends = stage_backends   # finetune: RunConfig.stage_backend of its runs
        self.finetune_modes = finetune_modes   # finetune: its runs (None: its default)
        self.deadline_s: float | None = None   # the running section's time allowance
        # a section's partial result, written to the JSON at once (set by run_sections)
        self.progress: Callable[[dict[str, Any]], None] = lambda partial: None
        self._shared: dict[str, Any] = {}
        self._failed: dict[str, BaseException] = {}
        self._close: dict[str, Callable[[Any], None]] = {}

    def shared(self, key: str, make: Callable[[], Any],
               close: Callable[[Any], None] = lambda value: None, *, first: str = "") -> Any:
        """``make()``, made once for every section that asks for ``key`` (``close(value)``
        at ``release(key)`` or ``close()``); its failure is raised again to each later
        section that asks (``first``: the section that reports it)."""
        if key in self._failed:
            e = self._failed[key]
            raise RuntimeError(f"the {key} failed (see {first or 'an earlier section'}): "
                               f"{type(e).__name__}: {e}") from e
        if key not in self._shared:
            try:
                self._shared[key] = make()
            except Exception as e:
                self._failed[key] = e
                raise
            self._close[key] = close
        return self._shared[key]

    def release(self, key: str) -> None:
        """Close what ``shared(key, ...)`` made (made again if asked for later)."""
        if key in self._shared:
            self._close.pop(key)(self._shared.pop(key))

    def close(self) -> None:
        for key in list(self._shared):
            self.release(key)


def write(path: Path, report: dict[str, Any]) -> None:
    """Write ``report`` to ``path`` atomically (a temporary file, then ``os.replace``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        json.dump(jsonable(report), f, indent=1, allow_nan=False)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


@contextmanager
def alarm(seconds: float | None) -> Iterator[None]:
    """Raise SectionTimeout in the main thread after ``seconds`` (and every 20 s after,
    should cleanup hang too); nothing where there is no SIGALRM or off the main thread."""
    if seconds is None or not hasattr(signal, "setitimer") or \
            threading.current_thread() is not threading.main_thread():
        yield
        return

    def ring(signum, frame):
        raise SectionTimeout(f"past its {seconds:.0f} s share of the time budget (--budget-s)")

    old = signal.signal(signal.SIGALRM, ring)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.01), 20.0)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def summary(section: Section, r: dict[str, Any]) -> str:
    """One line about a section's result (never raises: printing must not stop the kit)."""
    try:
        if not r.get("ok"):
            err = r.get("error")
            return "FAILED: " + (f"{err['type']}: {err['message'][:300]}" if err else
                                 str(r.get("summary") or r.get("losses") or ""))
        return section.summary(r)
    except Exception:   # noqa: BLE001
        return "ok" if r.get("ok") else "FAILED"


def _fail_injected(name: str, fail: list[str], report: dict[str, Any], out: Path) -> None:
    """``--fail-section NAME`` (tests): the section raises; ``NAME:exit``: the process
    dies there, as a crash or a kill would."""
    if f"{name}:exit" in fail:
        write(out, report)
        sys.stdout.flush()
        os._exit(3)
    if name in fail:
        raise RuntimeError(f"{name}: failure injected by --fail-section")


def _partial(report: dict[str, Any], out: Path, name: str) -> Callable[[dict[str, Any]], None]:
    def write_partial(partial: dict[str, Any]) -> None:
        report[name] = {"ok": False, "partial": True, **partial}
        write(out, report)
    return write_partial


def run_sections(kit: Kit, sections: Mapping[str, Section], names: tuple[str, ...],
                 report: dict[str, Any], out: Path, budget_s: float,
                 fail: list[str] = ()) -> list[str]:
    """Run the sections ``names`` (of ``sections``) in order into ``report``, writing
    ``out`` after each (and when a section reports progress); returns the names of the
    sections that failed."""
    t0 = time.perf_counter()
    failed = []
    reserve = {n: sections[n].reserve for n in names}
    # the reserves of the sections that run, scaled to leave a tenth of the budget free
    scale = budget_s * min(1.0, 0.9 / max(sum(reserve.values()), 1e-9))
    for i, name in enumerate(names):
        section = sections[name]
        elapsed = time.perf_counter() - t0
        remaining = budget_s - elapsed
        later = sum(reserve[n] for n in names[i + 1:]) * scale
        allowed = max(remaining - later, min(remaining, reserve[name] * scale))
        report["in_progress"] = name
        write(out, report)
        say(f"[{elapsed:6.1f} s] {name} (up to {max(allowed, 0):.0f} s) ...")
        start = time.perf_counter()
        result: dict[str, Any]
        try:
            if allowed <= 0:
                raise BudgetSpent(f"no time left of the {budget_s:.0f} s budget (--budget-s)")
            kit.deadline_s = allowed
            kit.progress = _partial(report, out, name)
            _fail_injected(name, list(fail), report, out)
            with alarm(allowed if section.alarm else None):
                result = dict(section.run(kit))
        except Exception as e:   # noqa: BLE001 - a section's failure is its report
            # with what it reported before (finetune's finished rows, past a timeout too)
            result = {**report.get(name, {}), "ok": False, "error": error_record(e)}
        finally:
            kit.deadline_s = None
            kit.progress = lambda partial: None
        try:
            settle(kit.dry_run)
        except Exception as e:   # noqa: BLE001
            result.setdefault("cleanup_error", error_record(e))
        result = {"ok": bool(result.pop("ok", True)), **result,
                  "seconds": round(time.perf_counter() - start, 2)}
        report[name] = result
        del report["in_progress"]
        write(out, report)
        if not result["ok"]:
            failed.append(name)
        say(f"[{time.perf_counter() - t0:6.1f} s] {name}: {summary(section, result)}")
    return failed
