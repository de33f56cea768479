"""Where a data-parallel Program's collectives run, as the simulator prices them.

``Hardware.collectives`` picks the mode; ``simulate`` lowers the Program before timing it.
The runtime runs ``"device"`` itself (``data_parallel="device"``: its Program holds the
``DeviceReduceScatter`` actions, which the simulator prices as they are, and
``data_parallel="zero3"``'s also its ``DeviceAllGather`` actions); ``"zero3"`` here is
the lowering of a sharded Program to what such a Program runs. A device mode
lowers the Program of the sharded optimizer (``data_parallel="shard"``: per backward
stage, deepest first, ``RS``, the shard's ``OptimizerStep``, ``AG``, on the host lane):

- ``"host"`` (what the runtime does): as printed. The host's ``collective`` stream runs
  ``AR``, or ``RS`` and ``AG``, over gloo on host tensors, after the stage's downloads.
- ``"device"`` (device NCCL): the host's ``RS`` moves to the devices. Before each
  ``DownloadGrads(s)``, a ``DeviceReduceScatter(s)`` (``sRS``) on that device's
  ``nccl`` stream reduce-scatters the stage's device gradients (``LayerCost.grads``:
  ``param_dtype``, bf16 for a bf16 run) with the same device of every other rank, as
  soon as the stage's last compute there ended, overlapping the shallower stages'
  backward on the compute stream. The download waits for it and moves 1/N of the
  gradients; the rank widens and steps only its 1/N of the masters (``OptimizerStep``
  at 1/N, as for the sharded optimizer). The stepped shards reach the other ranks
  where they live, on the host: the host's ``AG`` stays, gloo over the same link, of
  the stepped parameters in the devices' dtype (each rank keeps and uploads the whole
  model, so ``Prefetch`` bytes are unchanged). Gathering them on the devices instead
  would need each rank's shard uploaded first, which is ``"zero3"``'s upload. A
  Program that all-reduces (``data_parallel=True`` on GPUs, the optimizer unsharded)
  moves its host ``AR`` to the devices the same way: a ``DeviceAllReduce(s)`` (``sAR``)
  before each ``DownloadGrads(s)``, which then moves the averaged gradients whole, and
  each rank steps them all.
- ``"zero3"``: also the parameters. No host ``AG``: each rank keeps its 1/N of the
  parameters; each ``Prefetch(s)`` uploads 1/N, and a ``DeviceAllGather(s)`` (``sAG``)
  on the ``nccl`` stream after it gathers the rest from the other ranks before stage
  ``s`` computes (every compute that waited for the ``Prefetch`` waits for it).

A device's ``nccl`` stream runs its collectives in its lane's order (each issued as a
device action: ``Hardware.host_us_per_action``), and every collective of a node, the
host's too, crosses the node's one link (``Hardware.network_bytes_per_s``) one at a
time, first ready first served (a link shared by the node's devices, as their rings
over a node's NICs share its bandwidth; device memory and NVLink are not priced). Within a
node the devices are one pipeline (one rank per node): a collective pairs device ``d``
of every node. Each device reduce-scatters the gradients it holds (in a Program where
several devices compute one stage, each its own part, summed on the host)::

    >>> from fxpipe.passes.schedule import build_program
    >>> p = build_program([range(0, 1)], [range(1, 2), range(0, 1)], "fused", 1, 1,
    ...                   "stage", optimizer=True, data_parallel="shard")
    >>> [str(a) for a in p.host]
    ['RF', 'RS1:2', 'S1:2', 'RS0:1', 'AG1:2', 'S0:1', 'AG0:1', 'C']
    >>> [str(a) for a in host_program(p, "device").host]
    ['RF', 'S1:2', 'AG1:2', 'S0:1', 'AG0:1', 'C']
    >>> [str(a) for a in host_program(p, "zero3").host]
    ['RF', 'S1:2', 'S0:1', 'C']
    >>> " ".join(str(a) for a in device_lane(p.actions[0], "zero3"))
    '0P 0AG 0U0 0F0 0X0 1P 1AG 1U0 0R 1FB0 1X0 2P 2AG 2U0 1RS 1D 1R 2B0 2X0 2RS 2D 2R'
    >>> q = build_program([range(0, 1)], [range(1, 2), range(0, 1)], "fused", 1, 1,
    ...                   "stage", optimizer=True, data_parallel="allreduce")
    >>> [str(a) for a in q.host], [str(a) for a in host_program(q, "device").host]
    (['RF', 'AR1:2', 'S1:2', 'AR0:1', 'S0:1', 'C'], ['RF', 'S1:2', 'S0:1', 'C'])
"""

from __future__ import annotations

import dataclasses
from typing import Literal, Sequence

from fxpipe.passes.program import (
    AllGather, AllReduce, Dep, DeviceAllGather, DeviceAllReduce, DeviceReduceScatter,
    DownloadGrads, Prefetch, Program, ReduceScatter, stream_of,
)

Mode = Literal["host", "device", "zero3"]
STREAM = "nccl"
"""The device stream the device collectives run on."""


DeviceCollective = (DeviceReduceScatter, DeviceAllReduce, DeviceAllGather)


def stream(a) -> str:
    """``stream_of(a)``, with the device collectives' ``nccl`` stream."""
    return STREAM if isinstance(a, DeviceCollective) else stream_of(a)


def sharded(program: Program, mode: Mode) -> bool:
    """Whether ``program`` runs the sharded optimizer's collectives that ``mode`` lowers to
    the devices (``False`` for ``"host"``, and for a Program without collectives: one rank
    reduces nothing). ``"zero3"`` with ``AR`` is refused: it reduce-scatters."""
    if mode not in ("host", "device", "zero3"):
        raise ValueError(f"collectives must be 'host', 'device' or 'zero3', got {mode!r}")
    if mode == "host":
        return False
    if mode == "zero3" and any(isinstance(a, AllReduce) for a in program.host):
        raise ValueError("Hardware(collectives='zero3') reduce-scatters each stage's "
                         "gradients and steps each rank's shard: build the Program with "
                         "data_parallel='shard' (shard_optimizer=True), not 'allreduce'")
    return any(isinstance(a, ReduceScatter) for a in program.host)


def all_reduced(program: Program, mode: Mode) -> bool:
    """Whether ``mode`` (``"device"``) moves ``program``'s host ``AR`` to the devices:
    a ``DeviceAllReduce`` before each ``DownloadGrads``, which brings the averaged
    gradients whole (``data_parallel=True`` on GPUs, the optimizer unsharded)."""
    return mode == "device" and any(isinstance(a, AllReduce) for a in program.host)


def host_program(program: Program, mode: Mode) -> Program:
    """``program`` without the host collectives ``mode`` moves to the devices: ``RS``
    or ``AR`` (``"device"``), ``RS`` and ``AG`` (``"zero3"``)."""
    if all_reduced(program, mode):
        gone: tuple[type, ...] = (AllReduce,)
    elif sharded(program, mode):
        gone = (ReduceScatter,) if mode == "device" else (ReduceScatter, AllGather)
    else:
        return program
    return dataclasses.replace(program, host=tuple(a for a in program.host
                                                   if not isinstance(a, gone)))


def _around(a, mode: Mode, reduce: type = DeviceReduceScatter) -> tuple:
    """The device collectives ``mode`` puts before and after a device's action ``a``
    (None: none): a ``reduce`` (``DeviceReduceScatter``, or ``DeviceAllReduce`` for an
    all-reducing Program) before each ``DownloadGrads``, with ``"zero3"`` a
    ``DeviceAllGather`` after each ``Prefetch`` (module docstring)."""
    return (reduce(a.stage) if isinstance(a, DownloadGrads) else None,
            DeviceAllGather(a.stage) if mode == "zero3" and isinstance(a, Prefetch) else None)


def device_lane(actions: Sequence, mode: Mode) -> list:
    """A device's actions with ``mode``'s device collectives in the order it issues them
    (:func:`_around`'s places)."""
    out: list = []
    for a in actions:
        before, after = _around(a, mode)
        out += [x for x in (before, a, after) if x is not None]
    return out


def with_device_collectives(nodes: list, dep_ids: list, mode: Mode,
                            reduce: type = DeviceReduceScatter) -> tuple[list, list]:
    """The simulator's nodes ``(lane, step, action)`` and their dependencies
    ``[(node, Dep)]`` with ``mode``'s device collectives added (:func:`_around`'s
    places, ``reduce`` the reduction): a ``DeviceReduceScatter`` (or ``DeviceAllReduce``)
    waits for what its ``DownloadGrads`` waits for but its stream (the stage's computes
    on the device) and for the previous collective of the device's ``nccl`` stream; the
    download then waits for it. A ``DeviceAllGather`` waits
    for its ``Prefetch`` and the previous collective; every compute that waited for the
    ``Prefetch`` waits for it instead."""
    if mode == "host":
        return nodes, dep_ids
    new: list = []
    remap: list[int] = []
    added: dict[int, tuple[str, int]] = {}   # new node -> (what, the old node it goes with)
    before: dict[int, int] = {}              # old DownloadGrads -> its new DeviceReduceScatter
    after: dict[int, int] = {}               # old Prefetch -> its new DeviceAllGather
    for k, (d, i, a) in enumerate(nodes):
        rs, ag = _around(a, mode, reduce) if d >= 0 else (None, None)
        if rs is not None:
            before[k] = len(new)
            added[len(new)] = ("rs", k)
            new.append((d, i, rs))
        remap.append(len(new))
        new.append((d, i, a))
        if ag is not None:
            after[k] = len(new)
            added[len(new)] = ("ag", k)
            new.append((d, i, ag))
    deps: list = [[] for _ in new]
    for k, n in enumerate(remap):            # the Program's own nodes
        d, i, _ = nodes[k]
        deps[n] = [((after.get(j, remap[j]) if x.why == "params" else remap[j]), x)
                   for j, x in dep_ids[k]]
        if k in before:
            deps[n].append((before[k], Dep(d, i, "end", "reduced")))
    last: dict[int, int] = {}                # device -> its latest collective (new node)
    for n in sorted(added):                  # the collectives, in lane order
        what, k = added[n]
        d, i, _ = new[n]
        if what == "rs":
            deps[n] = [(remap[j], x) for j, x in dep_ids[k] if x.why != "stream"]
        else:
            deps[n] = [(remap[k], Dep(d, i, "end", "params"))]
        if d in last:
            deps[n].append((last[d], Dep(d, new[last[d]][1], "end", "stream")))
        last[d] = n
    return new, deps
