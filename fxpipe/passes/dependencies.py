"""What each action of a Program waits for (``Program.dependencies()``), the order one
thread could run them in (``Program.order``), and the check that every lane can be
issued in list order. The rules are those of ``passes.program``'s docstring; ``program``
is a ``Program`` (not imported here: it imports this module). And :func:`graph_program`,
the Program as ``stage_backend="cudagraphs"`` runs it: which uploads can write a graph
job's input slot follows from what waits for what.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Collection

from fxpipe.passes.actions import (
    HOST, Accumulate, Action, AllGather, AllReduce, BroadcastBuffers, Checkpoint, Commit, Compute,
    Dep, DeviceAllGather, DeviceAllReduce, DeviceReduce, DeviceReduceScatter, DownloadGrads,
    Forward, Free, FusedBackward, GraphForward, GraphRecomputeBackward, GraphUpload, Key, Offload,
    OptimizerStep, Prefetch, RecomputeBackward, ReduceScatter, Refresh, Release, Upload,
    UploadGrad, stream_of,
)


def dependencies(program) -> dict[int, tuple[tuple[Dep, ...], ...]]:
    """For each lane (device index, or ``HOST``) and step of ``program``, the ``Dep``s of that
    action (the rules of ``passes.program``'s docstring); ``Program.dependencies()``
    keeps them."""
    computes: dict[Key, list[tuple[int, int]]] = {}
    offload_at: dict[Key, tuple[int, int]] = {}
    downloads: dict[int, list[tuple[int, int]]] = {}
    for d, acts in enumerate(program.actions):
        for i, a in enumerate(acts):
            if isinstance(a, Compute):
                at = computes.setdefault((a.stage, a.mb), [])
                if at and (at[-1][0] != d or isinstance(a, (Forward, FusedBackward))
                           or a.layer is None):
                    raise ValueError(f"device {d} step {i}: {a} appears twice "
                                     f"(first on device {at[0][0]})")
                at.append((d, i))
            elif isinstance(a, Offload):
                if (a.stage, a.mb) in offload_at:
                    raise ValueError(f"device {d} step {i}: {a} appears twice "
                                     f"(first on device {offload_at[(a.stage, a.mb)][0]})")
                offload_at[(a.stage, a.mb)] = (d, i)
            elif isinstance(a, DownloadGrads):
                downloads.setdefault(a.stage, []).append((d, i))
    before = [i for i, a in enumerate(program.host) if isinstance(a, (Refresh,
                                                                      BroadcastBuffers))]
    out = {d: _device_deps(program, d, computes, offload_at, before)
           for d in range(program.num_devices)}
    out[HOST] = _host_deps(program, downloads)
    return out


def _device_deps(program, d, computes, offload_at, before) -> tuple[tuple[Dep, ...], ...]:
    flow = program.flow
    out: list[tuple[Dep, ...]] = []
    last_stream: dict[str, int] = {}
    last_compute: int | None = None
    prefetched: dict[int, int] = {}
    gathered: dict[int, int] = {}   # stage -> its DeviceAllGather, which computes wait for
    job: dict[int, dict[str, int]] = {}   # stage -> its last compute / download here
    releases: list[int] = []
    uploads: dict[tuple[type, Key], int] = {}

    def fail(i: int, a: Action, msg: str):
        raise ValueError(f"device {d} step {i}: {a} {msg}")

    def offloaded(i, a, producer, mb, why) -> Dep:
        if (producer, mb) not in offload_at:
            fail(i, a, f"needs Offload({producer}, {mb}) somewhere in the program")
        od, oi = offload_at[(producer, mb)]
        return Dep(od, oi, "end", why, hop=od != d)

    def made_here(i, a, producer, mb, what) -> Dep:
        at = computes.get((producer, mb), [])
        if not at or at[-1][0] != d or at[-1][1] > i:
            fail(i, a, f"takes over {what} on device {d}, but stage {producer} did not "
                       f"compute microbatch {mb} there before it")
        return Dep(d, at[-1][1], "end", "grad" if what.startswith("the gradient") else "input")

    def uploaded(i, a, kind, key, why) -> list[Dep]:
        if (kind, key) not in uploads:
            fail(i, a, f"has no {kind.__name__} before it, and it reads "
                       f"{'gradients' if kind is UploadGrad else 'values'} from the host")
        return [Dep(d, uploads.pop((kind, key)), "end", why)]

    for i, a in enumerate(program.actions[d]):
        deps: list[Dep] = []
        stream = stream_of(a)
        if stream in last_stream:
            deps.append(Dep(d, last_stream[stream], "end", "stream"))
        last_stream[stream] = i
        if stream in ("prefetch", "h2d") and last_compute is not None:
            deps.append(Dep(d, last_compute, "start", "issue"))
        match a:
            case Prefetch(stage=s):
                deps += [Dep(d, r, "end", "release") for r in releases]
                deps += [Dep(HOST, b, "end", "refresh" if isinstance(program.host[b], Refresh)
                             else "buffers") for b in before]
                releases.clear()
                prefetched[s] = i
                gathered.pop(s, None)
                job[s] = {}
            case DeviceAllGather(stage=s):
                if s not in prefetched or s in gathered:
                    fail(i, a, f"gathers stage {s}'s parameters, but no Prefetch({s}) before "
                               f"it on device {d} uploaded this rank's part")
                deps.append(Dep(d, prefetched[s], "end", "params"))
                gathered[s] = job[s]["gather"] = i
            case Upload(stage=s, mb=mb):
                for v in flow.upload.get((s, mb), ()):
                    if v not in program.inputs:
                        deps.append(offloaded(i, a, flow.maker[v], mb, "input"))
                if isinstance(a, GraphUpload):   # the slot's last reader, job (s, mb - 2)
                    at = computes.get((s, mb - 2), [])
                    if at and (at[0][0] != d or at[-1][1] > i):
                        fail(i, a, f"writes the input slot job ({s}, {mb - 2}) reads, but that "
                                   "job does not run before it on this device")
                    deps += [Dep(d, at[-1][1], "end", "slot")] if at else []
                uploads[(Upload, (s, mb))] = i
            case UploadGrad(stage=s, mb=mb):
                if not flow.upload_grads.get((s, mb)):
                    fail(i, a, f"but no gradient of stage {s}'s values comes through the host")
                for _, producer in flow.host_grad_parts.get((s, mb), ()):
                    deps.append(offloaded(i, a, producer, mb, "grad"))
                if program.run_type == "train":
                    for v in set(program.outputs) & set(program.stages[s].makes):
                        deps += [offloaded(i, a, flow.maker[v], m, "grad")
                                 for m in range(program.num_microbatches)]
                uploads[(UploadGrad, (s, mb))] = i
            case Forward(stage=s, mb=mb) | FusedBackward(stage=s, mb=mb) | Checkpoint(
                    stage=s, mb=mb) | RecomputeBackward(stage=s, mb=mb):
                key = (s, mb)
                first = computes[key][0][1] == i
                if s not in prefetched:
                    fail(i, a, f"runs stage {s} with no Prefetch({s}) before it on device {d}")
                deps.append(Dep(d, gathered.get(s, prefetched[s]), "end", "params"))
                if first:
                    if flow.upload.get(key):
                        deps += uploaded(i, a, Upload, key, "input")
                    for v, p in flow.handoff.get(key, ()):
                        deps.append(made_here(i, a, p, mb, f"value {v!r}"))
                if isinstance(a, RecomputeBackward) and (a.layer is None or first or
                                                         computes[key][1][1] == i):
                    if flow.upload_grads.get(key):
                        deps += uploaded(i, a, UploadGrad, key, "grad")
                    for v, p in flow.grad_parts.get(key, ()):
                        deps.append(made_here(i, a, p, mb, f"the gradient of {v!r}"))
                job[s]["compute"] = i
                last_compute = i
            case Offload(stage=s, mb=mb) | Free(stage=s, mb=mb):
                at = computes.get((s, mb), [])
                if not at or at[-1][0] != d or at[-1][1] > i:
                    fail(i, a, f"but ({s}, {mb}) was not computed on device {d} before it")
                deps.append(Dep(d, at[-1][1], "end", "input" if isinstance(a, Offload)
                                else "free"))
                if isinstance(a, Free):
                    makers = {flow.maker[v] for v in flow.free.get((s, mb), ())} | {s}
                    for p in sorted(makers):
                        if (p, mb) in offload_at:
                            od, oi = offload_at[(p, mb)]
                            deps.append(Dep(od, oi, "end", "free"))
            case DownloadGrads(stage=s) | Release(stage=s) | DeviceReduceScatter(stage=s) \
                    | DeviceAllReduce(stage=s):
                if s not in prefetched:
                    fail(i, a, f"but stage {s} is not resident on device {d}")
                deps += [Dep(d, j, "end", "reduced" if k == "reduce" else "job")
                         for k, j in job[s].items()]
                if isinstance(a, DeviceReduce):
                    job[s]["reduce"] = i
                elif isinstance(a, DownloadGrads):
                    job[s]["download"] = i
                else:
                    del prefetched[s], job[s]
                    gathered.pop(s, None)
                    releases.append(i)
        out.append(tuple(deps))
    return tuple(out)


def _host_deps(program, downloads) -> tuple[tuple[Dep, ...], ...]:
    out: list[tuple[Dep, ...]] = []
    last: dict[str, int] = {}                    # host stream -> its latest action
    reduced: dict[tuple[int, int], int] = {}     # layers -> its AllReduce / ReduceScatter
    stepped: dict[tuple[int, int], int] = {}     # layers -> its OptimizerStep
    for i, a in enumerate(program.host):
        stream = stream_of(a)
        deps = [Dep(HOST, last[stream], "end", "stream")] if stream in last else []
        span = (a.layers.start, a.layers.stop) if hasattr(a, "layers") else None
        match a:
            case Accumulate():
                s = program.backward_stage_of.get(span)
                if s is None:
                    raise ValueError(f"host step {i}: {a} names no backward stage's layers")
                deps += [Dep(dd, di, "end", "grad") for dd, di in downloads.get(s, [])]
            case OptimizerStep() | AllReduce() | ReduceScatter():
                try:
                    stages = program.step_stages(a)
                except ValueError as e:
                    raise ValueError(f"host step {i}: {e}") from None
                for w in stages:
                    deps += [Dep(dd, di, "end", "grad") for dd, di in downloads.get(w, [])]
                if isinstance(a, OptimizerStep):
                    if span in reduced:
                        deps.append(Dep(HOST, reduced[span], "end", "reduced"))
                    stepped[span] = i
                else:
                    reduced[span] = i
            case AllGather():
                if span not in stepped:
                    raise ValueError(f"host step {i}: {a} gathers what no OptimizerStep "
                                     f"of layers {span[0]}:{span[1]} listed before it stepped")
                deps.append(Dep(HOST, stepped[span], "end", "stepped"))
            case Commit():
                phase = program._phase_of(a)
                for d, acts in enumerate(program.actions):
                    ends: dict[str, int] = {}
                    for j, b in enumerate(acts):
                        if program._phase_of(b) == phase:
                            ends[stream_of(b)] = j
                    deps += [Dep(d, j, "end", "job") for j in sorted(ends.values())]
                ends = {}
                for j, b in enumerate(program.host[:i]):
                    if program._phase_of(b) == phase:
                        ends[stream_of(b)] = j
                deps += [Dep(HOST, j, "end", "job") for j in sorted(ends.values())
                         if j != last.get("host")]
        last[stream] = i
        out.append(tuple(deps))
    return tuple(out)


def order(program, phase: str = "all") -> list[tuple[int, int]]:
    """Every ``(lane, step)`` of ``phase`` in one order its dependencies allow (each
    after what it waits for and after its lane's earlier actions), as one thread
    could run them: what ``print(pipe)`` lists. Ties go to the action with the
    shortest chain of dependencies before it, then to the lower lane (the host
    last).

    >>> from fxpipe.passes.schedule import build_program
    >>> p = build_program([range(0, 1), range(1, 2)], [], "infer", 2, 1, "stage")
    >>> " ".join(str(p.lane(lane)[i]) for lane, i in order(p))
    'RF 0P 1P 0U0 0F0 0O0 0X0 1U0 0R 1F0 1O0 1X0 1R C'
    """
    deps, keep = program.dependencies(), program.issued(phase)
    preds: dict[tuple[int, int], set[tuple[int, int]]] = {}
    for lane, acts in program.lanes():
        prev = None
        for i in range(len(acts)):
            if not keep[lane][i]:
                continue
            got = {(d.device, d.step) for d in deps[lane][i] if keep[d.device][d.step]}
            preds[(lane, i)] = got | ({(lane, prev)} if prev is not None else set())
            prev = i
    users: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for k, ps in preds.items():
        for q in ps:
            users.setdefault(q, []).append(k)
    depth = {k: 0 for k in preds}
    left = {k: len(ps) for k, ps in preds.items()}
    rank = lambda k: (depth[k], k[0] if k[0] != HOST else program.num_devices, k[1])  # noqa: E731
    ready = [(rank(k), k) for k, n in left.items() if n == 0]
    heapq.heapify(ready)
    out: list[tuple[int, int]] = []
    while ready:
        _, k = heapq.heappop(ready)
        out.append(k)
        for u in users.get(k, ()):
            depth[u] = max(depth[u], depth[k] + 1)
            left[u] -= 1
            if left[u] == 0:
                heapq.heappush(ready, (rank(u), u))
    return out


def check_issue_order(p, deps, keep) -> None:
    """Raise unless the lanes can be issued each in list order: no action depends on one
    listed after it in its own lane, and the dependencies have no cycle (else an issue
    thread would wait forever)."""
    indeg: dict[tuple[int, int], int] = {}
    users: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for lane, acts in p.lanes():
        prev = None
        for i in range(len(acts)):
            if not keep[lane][i]:
                continue
            preds = {(dep.device, dep.step) for dep in deps[lane][i] if keep[dep.device][dep.step]}
            if prev is not None:
                preds.add((lane, prev))
            prev = i
            for dep in preds:
                if dep[0] == lane and dep[1] > i:
                    raise ValueError(f"lane {lane} step {i} ({acts[i]}) depends on step {dep[1]} "
                                     "listed after it: the Program cannot run in list order")
                users.setdefault(dep, []).append((lane, i))
            indeg[(lane, i)] = len(preds)
    ready = [k for k, n in indeg.items() if n == 0]
    seen = 0
    while ready:
        k = ready.pop()
        seen += 1
        for u in users.get(k, ()):
            indeg[u] -= 1
            if indeg[u] == 0:
                ready.append(u)
    if seen != len(indeg):
        raise ValueError("the Program's dependencies have a cycle")


def graph_program(program, graphed: Collection[int] | None = None):
    """``program`` as ``stage_backend="cudagraphs"`` runs it: each ``Forward`` of a stage in
    ``graphed`` (None: every stage) a ``GraphForward``, each of its stage
    ``RecomputeBackward``s a ``GraphRecomputeBackward``, and each ``Upload`` of such a job a
    ``GraphUpload`` (into the job's input slot of parity ``m % 2``) where that slot's last
    reader, job ``(s, m - 2)``, runs before it on the device (or ``m < 2``: the call before
    has ended). ``runtime.stages.graphs.graph_jobs`` passes the stages it can capture; the
    simulator models every stage (``fxpipe.sim``).

    >>> from fxpipe.passes.schedule import build_program
    >>> p = build_program([range(0, 1)], [range(1, 2), range(0, 1)], "fused", 1, 4, "stage")
    >>> " ".join(str(a) for a in graph_program(p).actions[0] if str(a).startswith("0"))
    '0P 0U0g 0F0g 0X0 0U1g 0F1g 0X1 0U2g 0F2g 0X2 0U3g 0F3g 0X3 0R'
    """
    def graph(a: Action) -> Action:
        if graphed is not None and getattr(a, "stage", None) not in graphed:
            return a
        if a.__class__ is Forward:
            return GraphForward(a.stage, a.mb)
        if a.__class__ is RecomputeBackward and a.layer is None:
            return GraphRecomputeBackward(a.stage, a.mb)
        return a

    def into_slots(acts: tuple[Action, ...]) -> tuple[Action, ...]:
        jobs = {(a.stage, a.mb): i for i, a in enumerate(acts)
                if isinstance(a, (GraphForward, GraphRecomputeBackward))}
        return tuple(GraphUpload(a.stage, a.mb) if a.__class__ is Upload and (a.stage, a.mb) in jobs
                     and (a.mb < 2 or jobs.get((a.stage, a.mb - 2), i) < i) else a
                     for i, a in enumerate(acts))

    return dataclasses.replace(program, actions=tuple(into_slots(tuple(map(graph, acts)))
                                                      for acts in program.actions))
