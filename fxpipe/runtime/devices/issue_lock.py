"""The issue lock, and host work that blocks inside it.

One issue thread at a time runs an action's Python on a device that runs it when it is
submitted (``Device.runs_at_issue``: a GPU's host part, an ``InlineDevice``). Every torch
op lets go of the GIL; with several threads wanting it, each op would hand it to another
thread and wait to get it back. So the executor takes this lock around each such submit
(:func:`issuing`).

Work inside it that blocks the host — a copy from or to pageable memory, a dtype
conversion on the host, a copy into a page-locked ring block, registering a file map's
window with CUDA, waiting for a host-lane or collective event — would stall every other GPU's issue
for as long. It runs under :func:`blocking`, which lets go of the lock and takes it back
afterwards (docs/design.md, rule 15). Never while holding another lock that an issue
thread may wait for under the issue lock (a pool's, a ring's): taking the issue lock back
would then deadlock. So do capturing a device graph and registering a new page-locked
pool block (both drain or pin for milliseconds to seconds).

The lock is an :class:`OrderedLock`: handed over to the waiting thread whose action
comes first in the Program, so a device's issue thread cannot take it back ahead of a
device behind it. An issue thread keeps it from one action to the next (:class:`Kept`)
until a waiting thread's action comes :data:`SLACK` steps before its own: a hand-over
wakes another thread and moves the GIL, which cost more than the action's own Python
with eight devices.
What each issue thread waited for it is ``pipe.stats()["issue_lock_wait_us"]``, and how
many times ``["issue_lock_waits"]``.

>>> with issuing(True):
...     held = holding()
...     with blocking():
...         released = not holding()
>>> held, released, holding()
(True, True, False)
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import threading
import time
from collections.abc import Iterator


class OrderedLock:
    """A lock handed over, when its holder lets go, to the waiting thread whose next
    action comes first in the Program (the lowest step: :func:`at_step`; ties in the order
    they asked), not to whichever thread the OS wakes first. A plain ``threading.Lock``
    lets a device's issue thread, between two of its actions, take the lock back ahead of
    a device that is behind it, on the critical path (#55); here the device behind goes
    first, and a thread letting go and asking again at once waits for the threads
    already waiting with earlier actions.

    Uncontended it costs one short internal lock. :meth:`acquire` returns the seconds
    this thread waited (0.0 when the lock was free).

    >>> lock = OrderedLock()
    >>> lock.acquire(), lock.locked()
    (0.0, True)
    >>> lock.release(); lock.locked()
    False
    """

    __slots__ = ("_state", "_held", "_waiters", "_asked")

    def __init__(self) -> None:
        self._state = threading.Lock()
        self._held = False
        self._waiters: list[tuple[int, int, threading.Lock]] = []   # a heap: (step, asked, turn)
        self._asked = itertools.count()

    def acquire(self, step: int = 0) -> float:
        with self._state:
            if not self._held:
                self._held = True
                return 0.0
            turn = threading.Lock()
            turn.acquire()
            heapq.heappush(self._waiters, (step, next(self._asked), turn))
        start = time.perf_counter()
        turn.acquire()   # released by the holder's ``release``: the lock is now this thread's
        return time.perf_counter() - start

    def release(self) -> None:
        with self._state:
            if not self._held:
                raise RuntimeError("OrderedLock.release(): not held")
            if self._waiters:
                heapq.heappop(self._waiters)[2].release()   # handed over: stays held
            else:
                self._held = False

    def pass_on(self, step: int, slack: int) -> float:
        """The holder goes on to its action at ``step``: it keeps the lock unless a
        waiting thread's action comes ``slack`` or more steps before it; else the lock
        is handed to the earliest waiter and this thread queues at ``step``. Returns the
        seconds it waited (0.0 when it kept the lock)."""
        with self._state:
            if not self._waiters or self._waiters[0][0] + slack > step:
                return 0.0
            turn = threading.Lock()
            turn.acquire()
            heapq.heappop(self._waiters)[2].release()   # handed over: stays held
            heapq.heappush(self._waiters, (step, next(self._asked), turn))
        start = time.perf_counter()
        turn.acquire()
        return time.perf_counter() - start

    def locked(self) -> bool:
        return self._held


_ISSUING = OrderedLock()


class _Holding(threading.local):
    on: bool = False
    step: int = 0         # the Program step of the action this thread issues (``at_step``)
    waited: float = 0.0   # seconds this thread waited for the lock (``waited``)
    waits: int = 0        # how many times it waited


_HOLDING = _Holding()


def at_step(step: int) -> None:
    """This thread's next action is at ``step`` of its Program lane: where it queues for
    the issue lock (:class:`OrderedLock`)."""
    _HOLDING.step = step


def holding() -> bool:
    """Whether this thread holds the issue lock now."""
    return _HOLDING.on


def waited() -> tuple[float, int]:
    """Seconds this thread waited for the issue lock since the last call, and how many
    times (an issue thread reads them once per call: ``pipe.stats()["issue_lock_wait_us"]``,
    ``["issue_lock_waits"]``)."""
    s, n = _HOLDING.waited, _HOLDING.waits
    _HOLDING.waited, _HOLDING.waits = 0.0, 0
    return s, n


def _waited(seconds: float) -> None:
    if seconds:
        _HOLDING.waited += seconds
        _HOLDING.waits += 1


class _Issuing:
    """``with``: hold the issue lock (a class, not a generator: it is taken once per
    action, and a generator-based context costs the issue path a few microseconds)."""

    __slots__ = ()

    def __enter__(self) -> None:
        _waited(_ISSUING.acquire(_HOLDING.step))
        _HOLDING.on = True

    def __exit__(self, *exc: object) -> None:
        _HOLDING.on = False
        _ISSUING.release()


_TAKE, _LEAVE = _Issuing(), contextlib.nullcontext()


def hold(step: int) -> None:
    """Take the issue lock for this thread's action at ``step`` of its lane: what
    ``at_step(step)`` then ``with issuing(True):`` do, as the executor does it for each
    action (no context object per action); :func:`let_go` after."""
    _HOLDING.step = step
    _waited(_ISSUING.acquire(step))
    _HOLDING.on = True


# How far (in Program steps) an issue thread may run ahead of the earliest thread waiting
# for the lock before it hands the lock over between two of its actions (``Kept``).
# Handing over after every action costs each action a wake-up of another thread and
# the GIL's hand-offs. On this 2-core VM (benchmarks/bench_issue.py, recorded): eight
# InlineDevices' threads issue an action around an empty stage in 47 us (min) keeping
# it, 89-91 handing it over after every action, one device's thread in 24; the 8-GPU
# Llama-3.1-8B 4K step issues in 753 ms against 831 (1,211 waits a step -> 113). Larger
# values gain a little more here (32: about 10% more) and let a device fall further
# behind. The cost to a device that is behind: it waits at most this many of the
# holder's actions, and once it holds the lock it issues in a batch too.
SLACK = 16


class Kept:
    """One issue thread's hold on the lock across its lane's actions: :meth:`take` before
    each action (the lock kept from the previous one unless a thread waits with an action
    ``SLACK`` or more steps earlier: :meth:`OrderedLock.pass_on`; then it queues behind
    it as :func:`hold` would), :meth:`drop` before anything it waits for (another lane's
    action, released memory) and at the end."""

    __slots__ = ("held",)

    def __init__(self) -> None:
        self.held = False
        waited()   # this thread's waits are counted from here

    def take(self, step: int) -> None:
        if not self.held:
            hold(step)
            self.held = True
            return
        _HOLDING.step = step
        _waited(_ISSUING.pass_on(step, SLACK))

    def drop(self) -> None:
        if self.held:
            self.held = False
            let_go()


def let_go() -> None:
    """Let go of the issue lock :func:`hold` took (handed over to the first waiter)."""
    _HOLDING.on = False
    _ISSUING.release()


def issuing(take: bool) -> contextlib.AbstractContextManager:
    """Hold the issue lock (when ``take``: the device runs its work at issue)."""
    return _TAKE if take else _LEAVE


@contextlib.contextmanager
def blocking() -> Iterator[None]:
    """Host work that blocks runs here: with the issue lock let go if this thread holds
    it (other devices' issue goes on meanwhile), taken back after."""
    if not _HOLDING.on:
        yield
        return
    _HOLDING.on = False
    _ISSUING.release()
    try:
        yield
    finally:
        _waited(_ISSUING.acquire(_HOLDING.step))
        _HOLDING.on = True
