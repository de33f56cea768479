"""Issuing a call's actions: the issue threads (one per lane, kept between calls), what
each issues (``issue_plan``: worked out once per Program and phase, so a call's issue
loop reads its steps and nothing else), what each thread is doing for a call
(``WHERE``), and stopping a call (``Cancelled``). The
lock one issue thread at a time holds while it runs an action's Python is
``runtime.devices.issue_lock``'s.

The executor (``runtime.issue.executor``) owns the calls; this module owns the threads.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import traceback
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from fxpipe.passes.program import HOST, Commit, Program, stream_of
from fxpipe.runtime.devices.emulator import InlineDevice
from fxpipe.runtime.devices.events import Event


class _IssueThread:
    """A thread that issues one lane's actions per call, kept between calls (starting a
    thread costs the caller about a millisecond)."""

    def __init__(self) -> None:
        self.work: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._loop, daemon=True, name="fxpipe-issue-idle").start()

    def _loop(self) -> None:
        me = threading.current_thread()
        while True:
            name, fn, done, threads = self.work.get()
            me.name = name
            if torch.get_num_threads() != threads:   # as a thread started now would
                torch.set_num_threads(threads)
            try:
                fn()   # catches what stops issuing itself (``Execution._issue``)
            except BaseException:  # noqa: BLE001 — never lose the thread: it is reused
                traceback.print_exc()
            finally:
                fn = None
                me.name = "fxpipe-issue-idle"
                with _idle_lock:
                    _idle.append(self)
                done.set()


_idle: list[_IssueThread] = []
_idle_lock = threading.Lock()


def _issue_thread(name: str, fn: Callable[[], None]) -> threading.Event:
    """Run ``fn`` on an idle issue thread (a new one if none is idle), named ``name``
    while it runs, with the caller's intra-op thread count (what a thread started now
    would take); the event is set once it returned."""
    with _idle_lock:
        worker = _idle.pop() if _idle else None
    if worker is None:
        worker = _IssueThread()
    done = threading.Event()
    worker.work.put((name, fn, done, torch.get_num_threads()))
    return done


def _forget_issue_threads() -> None:
    """In a forked child the issue threads are gone: start afresh."""
    _idle.clear()


os.register_at_fork(after_in_child=_forget_issue_threads)


# The host lane's ``host`` stream: its actions run when they are issued, on the host
# lane's issue thread (a host action is host work: there is nothing to queue).
_ON_HOST = InlineDevice(name="host")


class _Where(threading.local):
    """What this thread is doing for a call: the action whose work it runs, or the
    documented work a call does outside its Program (``outside_program``)."""

    action: str | None = None
    outside: str | None = None


WHERE = _Where()


class _where:   # noqa: N801 — used as a function: ``with _where(field, value):``
    """``WHERE.<field>`` is ``value`` within the block (a class: one per action)."""

    __slots__ = ("field", "value", "was")

    def __init__(self, field: str, value: str):
        self.field, self.value = field, value

    def __enter__(self) -> None:
        self.was = getattr(WHERE, self.field)
        setattr(WHERE, self.field, self.value)

    def __exit__(self, *exc: object) -> None:
        setattr(WHERE, self.field, self.was)


def _acting(label: str) -> contextlib.AbstractContextManager:
    """This thread runs the work of the action ``label``."""
    return _where("action", label)


def outside_program(why: str) -> contextlib.AbstractContextManager:
    """Mark tensor work a call does outside its Program's actions, and why. Only two
    kinds exist: splitting the caller's inputs (and labels, output gradients) into
    microbatches before the Program runs (with it, counting each microbatch's target
    tokens on the host, ``loss_weights.shares``: ``print(pipe.layers.token_means[i])``
    shows output leaf i's count graph; ``pipe.program()`` does not) and, with data
    parallel, all-gathering a digest of their shapes to compare with the other ranks'
    (``DataParallel.check_batch``); and summing the
    microbatches' losses (or input gradients) for the caller after it ended. Everything else a call does to
    tensors is an action's work (``tests/test_program_only.py`` checks it)."""
    return _where("outside", why)


class Cancelled(RuntimeError):
    """Raised inside actions once a call has been interrupted."""


_ISSUED = threading.Event()
_ISSUED.set()


class _Issued:
    """One action as its issue thread submitted it: the event it completes, and what its
    start waited for (a ``Dep`` on its start waits for the same). ``ready`` is set once it
    was issued: an action another lane waits for gets its own (:func:`issue_slots`); the
    others share one that is always set (their own lane issues in order).

    No ``__init__``: a call makes one per action, and the class's defaults cost no call."""

    ready: threading.Event = _ISSUED
    event: Event | None = None
    gate: list[Event] = []   # (never changed in place: an issue thread sets its own list)


def issue_slots(plan: _IssuePlan) -> dict[tuple[int, int], _Issued]:
    """A call's slots: one per action it issues."""
    slots = {key: _Issued() for key in plan.keys}
    for key in plan.across:
        if key in slots:
            slots[key].ready = threading.Event()
    return slots


def wait_all(slots: dict[tuple[int, int], _Issued],
             cancel: Callable[[BaseException], None]) -> BaseException | None:
    """The end of the call: wait for every action; the failure to raise is the cause,
    not the ``Cancelled`` of actions that started after it (whatever their order).
    ``cancel``: stops the call when waiting itself is interrupted."""
    events = [slot.event for slot in slots.values() if slot.event is not None]
    failures = []
    # latest first: those end last, so the caller wakes once, not once per action
    for ev in reversed(events):
        try:
            exc = ev.exception()
        except BaseException as e:  # noqa: BLE001 — e.g. KeyboardInterrupt while waiting
            cancel(e)
            exc = e
        if exc is not None:
            failures.insert(0, exc)  # in issue order
    if not failures:
        return None
    for ev in events:  # everything submitted has finished; make sure of it
        ev._done.wait()
    return next((e for e in failures if not isinstance(e, Cancelled)), failures[0])


class _Step(NamedTuple):
    """One action an issue thread issues, with what its issue reads worked out once per
    Program and phase: its dependencies as ``((lane, step), on end)``, the ones the
    phase does not issue left out."""

    i: int                                    # its step in its lane
    action: Any
    label: str
    stream: str
    kind: str                                 # its class's name (``host_issue_us.<kind>``)
    prefetch: bool
    deps: tuple[tuple[tuple[int, int], bool], ...]
    distinct: bool   # its dependencies' events are distinct (else the executor drops repeats)


class _IssuePlan(NamedTuple):
    """What a call of one phase issues (``Program.issued``): per lane with any, its
    steps; every issued ``(lane, step)``; those another lane waits for; and where the
    host lane's ``Commit`` is (it and what follows run once the call has ended)."""

    keep: dict[int, tuple[bool, ...]]
    lanes: tuple[tuple[int, tuple[_Step, ...]], ...]
    keys: tuple[tuple[int, int], ...]
    across: frozenset[tuple[int, int]]
    commit_at: int


# id(Program) -> phase -> plan, while the Program lives. By id: a Program is a frozen
# dataclass, whose hash would hash every action, and whose equality to another Program's
# compares them all, at each call
_plans: dict[int, dict[str, _IssuePlan]] = {}
_plans_lock = threading.Lock()


def issue_plan(program: Program, phase: str) -> _IssuePlan:
    """``program``'s issue plan for a call of ``phase``, made at its first call (a dict
    read after)."""
    plans = _plans.get(id(program))
    if plans is None:
        with _plans_lock:
            if id(program) not in _plans:
                _plans[id(program)] = {}
                weakref.finalize(program, _plans.pop, id(program), None)
            plans = _plans[id(program)]
    plan = plans.get(phase)
    if plan is None:
        plan = plans.setdefault(phase, _make_plan(program, phase))
    return plan


def _make_plan(p: Program, phase: str) -> _IssuePlan:
    deps, keep = p.dependencies(), p.issued(phase)
    at = next((i for i, a in enumerate(p.host) if keep[HOST][i] and isinstance(a, Commit)),
              len(p.host))
    lanes, keys = [], []
    for lane, acts in p.lanes():
        steps = []
        for i, a in enumerate(acts):
            if keep[lane][i] and not (lane == HOST and i >= at):
                on = tuple(((d.device, d.step), d.on == "end") for d in deps[lane][i]
                           if keep[d.device][d.step])
                # each dependency on an end is its own event; one on a start, what that
                # action waited for, which may repeat another's
                distinct = all(end for _, end in on) and len({k for k, _ in on}) == len(on)
                stream = stream_of(a)
                steps.append(_Step(i, a, p.labels[lane][i], stream, type(a).__name__,
                                   stream == "prefetch", on, distinct))
        steps = tuple(steps)
        keys += [(lane, s.i) for s in steps]
        if steps:
            lanes.append((lane, steps))
    return _IssuePlan(keep, tuple(lanes), tuple(keys), p.waited_across, at)
