"""The kit's ``many_devices`` section: eight logical devices on one GPU, as an 8-GPU box
would run them from one host process, under eager stage code and under CUDA graphs.

Eight ``CudaDevice(0, memory_limit=total // 8, name="cuda:0/i")`` (each its own streams,
events and copies, an eighth of the memory: ``scaling``'s two logical devices, four
times over); in a dry run eight CPU ``VirtualDevice(semantics="cuda")``. The kit's
Llama-shaped model (``TinyLlama``, at most 16 blocks) with bf16 device copies
(``compile(param_dtype=torch.bfloat16)``), a batch of 8 rows in 8 microbatches (a dry
run: 4 blocks, 4 rows in 4 microbatches; its ops each pass through the virtual devices'
Python dispatch, and a quarter of the work keeps it to seconds). Per ``RunConfig(stage_backend=...)`` of :data:`BACKENDS`, from the same
weights, no optimizer (the weights stay as they are, so every call's loss compares):

- ``steps``: :data:`ROUNDS` rounds of two lengths, ``seq`` then ``seq // 2``
  (L1, L2, L1, L2, ...): each call's loss, ``graph_captures`` and ``graph_replays``
  (``pipe.stats()``), and ``captures_after_step``, the captures so far. ``plateau``: the
  calls after each length was seen once captured nothing (under ``"cudagraphs"``, they
  also replayed);
- ``memory``: on a GPU ``torch.cuda.max_memory_reserved(0)`` over those calls (the
  whole GPU: every logical device's, the graphs' pools included) against the sum of the
  devices' peaks ``fxpipe.plan.predict_memory(pipe, loss_fn=, label=)`` predicts for a
  call at L1 (the pipe's stage backend: with ``"cudagraphs"``, its slots and graphs,
  ``passes.stage_memory.with_graphs``); in a dry run the sum of the devices'
  ``peak_reserved_bytes()``; per device ``counted_peak_bytes`` (fxpipe's own count);
- ``issue``, from one more call at L1, traced (``pipe.trace()``) and unsampled: the host's
  issue time (``host_issue_us``) per device action and per kernel. Per action kind of the
  call's Program (``fxpipe.sim.host_fit.action_counts``): how many ran, their issue time
  (``host_issue_us.<Kind>``) and the kernels they launch. Kernels: ``Cost.fwd_kernels`` /
  ``bwd_kernels``, the aten ops of each layer's forward and backward that launch a kernel,
  counted by the cost pass (a recompute-and-backward: both); a graph job's launches
  (``fxpipe.sim.simulate.graph_job_kernels``: the replay, a copy per input not in its
  input slot, a clone per output, a backward's gradient copies and one ``_foreach_add_``). Those counts are
  exact; the fused tail under ``"cudagraphs"`` runs inductor's code uncaptured, its
  kernels modelled (eager's x ``INDUCTOR_KERNELS``): ``issue_us_per_kernel`` is the
  issue time over the kernels of the kinds counted exactly (``per_kernel_over``) and
  ``fit`` the simulator's host figures fitted to every kind (``fit_host``). On a dry run's
  virtual devices the kernels run on the devices' workers, outside the issue time
  (``runs_at_issue`` false): the per-kernel figures mean something on a GPU only;
- ``issue_lock_wait_ms``: the time the devices' issue threads waited for the issue lock
  in that call, summed (``pipe.stats()["issue_lock_wait_us"]``; 0 on a dry run's
  virtual devices, whose work does not run at issue), and ``issue_lock_waits`` how many
  times (an issue thread keeps the lock between its actions: ``issue_lock.SLACK``);
- ``issue_idle``: GPU idle time attributable to issue, from that call's trace: per
  device, the part of its compute stream's gaps before the host began issuing the next
  compute action (:func:`device_idle` defines it), and the gaps' total;
- ``lock_ab``: calls at L1 with the issue lock kept between a thread's actions
  (``kept``: ``issue_lock.SLACK``) and handed over after every action (``each``, the
  lock before 2026-11-30), alternated :data:`LOCK_AB_ROUNDS` times: per setting the
  fastest call's wall ms, its issue µs per device action and its lock waits.

``ok``: both backends ran, every call's loss under ``"cudagraphs"`` is eager stage
code's within :data:`LOSS_RTOL`, and both plateau.

A dry run stands a segment's own graph in for inductor's code under ``"cudagraphs"``
(``compiler`` says so): inductor's CPU compile takes about 8 s per segment and signature
on CI's machines, some 90 s for the two lengths, where the rest of the dry run takes 70;
everything above the compiler (the Program's graph jobs, slots, keys, captures and
replays of ``device_graph.EmulatedGraph``) runs as on a GPU. On a GPU the section is sized
for well under three minutes (inductor's compiles for two lengths, fourteen calls of a
16-block model; 51 s on one H200 on 2026-11-30): its share of the budget is about 150 s of the
default 540 beside every section but ``finetune``, all of it alone (``python -m
fxpipe.check --sections many_devices``).
"""

from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

import fxpipe
from fxpipe.check.common import error_record, loss_fn, model_and_batch, say, settle, unsampled
from fxpipe.check.harness import Kit, SectionTimeout
from fxpipe.passes.program import GraphForward, GraphRecomputeBackward
from fxpipe.plan import layer_costs, predict_memory
from fxpipe.runtime.devices import issue_lock
from fxpipe.runtime.devices.device import Device
from fxpipe.sim import Hardware, LayerCost
from fxpipe.sim.host_fit import action_counts, fit_host, issue_us_by_kind

LOGICAL = 8
"""Logical devices the section runs on (one GPU's, or virtual ones in a dry run)."""
BACKENDS = ("eager", "cudagraphs")
ROUNDS = 3
"""Rounds of the two lengths (L1, L2): 2 x ROUNDS calls per backend before the traced one."""
LOSS_RTOL = 1e-2
"""How far a ``"cudagraphs"`` call's loss may be from eager stage code's, relative. Both
run the same bf16 weights on the same tokens; the graphs replay inductor's code, which
fuses and orders bf16 rounding differently (it keeps fused intermediates in fp32). Each
rounding is at most bf16's unit roundoff (2^-9, 2e-3) relative; they compound over the
depth but average out over the 8 x seq tokens of the mean loss: 1e-2 is five unit
roundoffs of the loss itself, room for that, while a graph replaying stale inputs or
another stage's slot moves the loss by its own size."""
GRAPHED = (GraphForward, GraphRecomputeBackward)
LOCK_AB_ROUNDS = 2


def many_devices(kit: Kit) -> dict[str, Any]:
    shape = {**kit.shape, "batch": 4 if kit.dry_run else LOGICAL,
             "depth": 4 if kit.dry_run else min(16, kit.shape["depth"])}
    model, ids, target = model_and_batch(shape)
    state = copy.deepcopy(model.state_dict())
    lengths = (shape["seq"], shape["seq"] // 2)
    out: dict[str, Any] = {
        "logical_devices": LOGICAL, "model": shape, "param_dtype": "bfloat16",
        "microbatches": shape["batch"], "lengths": list(lengths),
        "compiler": ("the segments' own graphs, standing in for inductor's CPU compile "
                     "(dry run)" if kit.dry_run else "inductor"),
        "note": (f"dry run: {LOGICAL} VirtualDevice(semantics='cuda'), not CudaDevices; 4 "
                 "blocks and 4 microbatches, not 16 and 8 (each op passes through the "
                 "virtual devices' Python dispatch)" if kit.dry_run else None),
        "loss_rtol": LOSS_RTOL, "backends": {}}
    for backend in BACKENDS:
        model.load_state_dict(state)
        settle(kit.dry_run)
        start = time.perf_counter()
        try:
            with stand_in_compiler(kit.dry_run and backend != "eager"):
                row = run_backend(kit, model, ids, target, backend, lengths, shape["batch"])
        except SectionTimeout:
            raise
        except Exception as e:   # noqa: BLE001 - the other backend still runs
            row = {"ran": False, "error": error_record(e)}
        row["seconds"] = round(time.perf_counter() - start, 2)
        out["backends"][backend] = row
        say(f"  {backend}: {backend_line(row)}")
        kit.progress(out)
    out.update(agreement(out["backends"]))
    return out


def agreement(rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Whether both backends ran, their losses agree within ``LOSS_RTOL`` call by call,
    and their captures plateau."""
    ran = all(r.get("ran") for r in rows.values())
    diff = None
    if ran:
        eager, graphs = (rows[b]["steps"] for b in BACKENDS)
        diff = max(abs(g["loss"] - e["loss"]) / abs(e["loss"]) for e, g in zip(eager, graphs))
    agree = diff is not None and diff <= LOSS_RTOL
    plateau = ran and all(r["plateau"] for r in rows.values())
    return {"max_loss_rel_diff": diff, "losses_agree": agree, "plateau": plateau,
            "ok": bool(ran and agree and plateau)}


def logical_devices(dry_run: bool) -> list[Device]:
    if dry_run:
        return [fxpipe.VirtualDevice(semantics="cuda", name=f"vcpu/{i}") for i in range(LOGICAL)]
    from fxpipe.runtime.devices.cuda import CudaDevice
    share = torch.cuda.get_device_properties(0).total_memory // LOGICAL
    return [CudaDevice(0, memory_limit=share, name=f"cuda:0/{i}") for i in range(LOGICAL)]


def run_backend(kit: Kit, model, ids: torch.Tensor, target: torch.Tensor, backend: str,
                lengths: Sequence[int], microbatches: int) -> dict[str, Any]:
    devices = logical_devices(kit.dry_run)
    pipe = fxpipe.compile(model, example_inputs=(ids,), devices=devices,
                          param_dtype=torch.bfloat16,
                          config=fxpipe.RunConfig(stage_backend=backend,
                                                  num_microbatch=microbatches))
    try:
        with unsampled(pipe), issue_stamps(devices) as issued:
            at_start = reset_peaks(kit.dry_run, devices)
            steps = alternating(pipe, model, ids, target, lengths)
            memory = memory_figures(kit.dry_run, pipe, devices, target, at_start)
            for stamps in issued:
                stamps.clear()
            with pipe.trace() as rec:
                pipe.forward_backward((ids,), label=target, loss_fn=loss_fn)
            model.zero_grad(set_to_none=True)
            stats = pipe.stats()
            idle = issue_idle(rec, devices, issued)
            issue = issue_figures(pipe, stats, backend, microbatches)
            ab = lock_ab(pipe, model, ids, target, issue["device_actions"])
        total, after = 0, []
        for s in steps:
            total += s["graph_captures"]
            after.append(total)
        later = steps[len(lengths):]
        plateau = all(s["graph_captures"] == 0 for s in later) and \
            stats.get("graph_captures", 0) == 0 and \
            (backend == "eager" or all(s["graph_replays"] > 0 for s in later))
        return {"ran": True, "stage_backend": backend, "plan": repr(pipe.plan), "steps": steps,
                "captures_after_step": after, "plateau": plateau,
                "graph_captures": total, "graph_replays": sum(s["graph_replays"] for s in steps),
                "graph_fallbacks": sum(s["graph_fallbacks"] for s in steps),
                "traced_call": {k: stats.get(k) for k in ("graph_captures", "graph_replays",
                                                          "stage_compiles")},
                "issue": issue,
                **lock_wait(stats), "issue_idle": idle, "lock_ab": ab, "memory": memory}
    finally:
        pipe.close()


def alternating(pipe, model, ids: torch.Tensor, target: torch.Tensor,
                lengths: Sequence[int]) -> list[dict[str, Any]]:
    """``ROUNDS`` rounds of a call at each of ``lengths``: each call's loss and graphs."""
    steps = []
    for _ in range(ROUNDS):
        for n in lengths:
            loss = pipe.forward_backward((ids[:, :n],), label=target[:, :n], loss_fn=loss_fn)
            model.zero_grad(set_to_none=True)
            s = pipe.stats()
            steps.append({"seq": n, "loss": float(loss),
                          **{k: s.get(k, 0) for k in ("graph_captures", "graph_replays",
                                                      "graph_fallbacks")}})
    return steps


# ---------------------------------------------------------------------------- issue

def issue_figures(pipe, stats: dict[str, Any], backend: str, microbatches: int) -> dict[str, Any]:
    """The traced call's issue time per device action and per kernel (module docstring)."""
    program = pipe.program("fused", microbatches)
    costs = [LayerCost.of(c, Hardware()) for c in layer_costs(pipe)]
    counts = action_counts(program, costs, backend)
    by_kind = issue_us_by_kind(stats)
    graphed = {type(a).__name__ for _, acts in program.lanes() for a in acts
               if isinstance(a, GRAPHED)}
    kinds, exact = {}, []
    for kind, c in sorted(counts.items()):
        us = by_kind.get(kind, 0)
        modelled = backend != "eager" and c["kernels"] > 0 and kind not in graphed
        kinds[kind] = {"actions": c["actions"], "kernels": round(c["kernels"], 1),
                       "kernels_modelled": modelled, "issue_us": us,
                       "us_per_action": us / c["actions"] if c["actions"] else None}
        if c["kernels"] and not modelled:
            exact.append(kind)
    actions = sum(c["actions"] for c in counts.values())
    kernels = sum(counts[k]["kernels"] for k in exact)
    issue_us = stats.get("host_issue_us", 0)
    return {"host_issue_ms": issue_us / 1e3, "device_actions": actions,
            "actions": stats.get("actions"), "issue_us_per_action": issue_us / actions,
            "kernels": kernels, "per_kernel_over": exact,
            "issue_us_per_kernel": sum(by_kind.get(k, 0) for k in exact) / kernels
            if kernels else None,
            "kinds": kinds, "fit": fit_host(program, costs, by_kind, stage_backend=backend),
            "runs_at_issue": all(d.runs_at_issue for d in pipe.devices)}


def lock_wait(stats: dict[str, Any]) -> dict[str, Any]:
    """The issue threads' summed wait for the issue lock in the call, in ms, and how many
    times they waited."""
    return {"issue_lock_wait_ms": stats["issue_lock_wait_us"] / 1e3,
            "issue_lock_waits": stats["issue_lock_waits"]}


def lock_ab(pipe, model, ids: torch.Tensor, target: torch.Tensor,
            device_actions: int) -> dict[str, Any]:
    """``lock_ab`` (module docstring): the issue lock kept between a thread's actions or
    handed over after each, calls alternated; per setting the fastest call's figures
    (``device_actions``: a call's, ``issue_figures``')."""
    kept = issue_lock.SLACK
    runs: dict[str, list[dict[str, float]]] = {"kept": [], "each": []}
    try:
        for _ in range(LOCK_AB_ROUNDS):
            for name, slack in (("each", -(1 << 62)), ("kept", kept)):
                issue_lock.SLACK = slack
                start = time.perf_counter()
                pipe.forward_backward((ids,), label=target, loss_fn=loss_fn)
                wall = time.perf_counter() - start
                model.zero_grad(set_to_none=True)
                s = pipe.stats()
                runs[name].append({"call_ms": wall * 1e3,
                                   "issue_us_per_action": s["host_issue_us"] / device_actions,
                                   **lock_wait(s)})
    finally:
        issue_lock.SLACK = kept
    return {"slack": kept, **{name: min(r, key=lambda x: x["call_ms"])
                              for name, r in runs.items()}}


@contextlib.contextmanager
def issue_stamps(devices: Sequence[Device]) -> Iterator[list[dict[str, float]]]:
    """Per device, ``{label: time.perf_counter()}`` of each compute-stream submit when the
    issue thread entered ``submit`` (it holds the issue lock by then: ``executor._issue``):
    when the host began issuing that action. Each device's ``submit`` is wrapped on the
    instance for the block."""
    issued: list[dict[str, float]] = [{} for _ in devices]

    def stamped(submit, at):
        def submit_stamped(stream, fn, *args, **kwargs):
            if stream == "compute":
                at[kwargs.get("label")] = time.perf_counter()
            return submit(stream, fn, *args, **kwargs)
        return submit_stamped

    for d, at in zip(devices, issued):
        d.submit = stamped(d.submit, at)
    try:
        yield issued
    finally:
        for d in devices:
            del d.submit


def issue_idle(rec, devices: Sequence[Device], issued: Sequence[dict[str, float]],
               ) -> dict[str, Any]:
    """GPU idle time attributable to issue in a traced call (``rec``), per device
    (:func:`device_idle`) and summed. ``issued``: per device, when the host began issuing
    each compute action (:func:`issue_stamps`, ``time.perf_counter()`` seconds), put on
    the timeline's clock (ms from the first record of the trace, as
    ``runtime.issue.trace.timeline_of`` does). On a GPU the stream times are CUDA events
    placed on the host's clock at the trace's start (``CudaDevice.records``): good to
    tens of microseconds."""
    origin = min((r[2] for d in devices for r in d.records), default=0.0)
    per_device = {i: device_idle(rec.timeline.intervals, i,
                                 {label: (t - origin) * 1e3 for label, t in issued[i].items()})
                  for i in range(len(devices))}
    idle = sum(f["idle_ms"] for f in per_device.values())
    bound = sum(f["issue_idle_ms"] for f in per_device.values())
    return {"issue_idle_ms": bound, "idle_ms": idle,
            "issue_idle_share": bound / idle if idle else None,
            "compute_busy_ms": sum(f["compute_busy_ms"] for f in per_device.values()),
            "makespan_ms": rec.timeline.makespan,
            "unstamped_gaps": sum(f["unstamped_gaps"] for f in per_device.values()),
            "devices": per_device}


def device_idle(intervals: Sequence[Any], device: int,
                issued: Mapping[str, float]) -> dict[str, Any]:
    """One device's compute-stream idle time, and the part of it attributable to issue.

    The device's compute actions ``c_1 .. c_n`` by start (the trace's ``forward`` /
    ``backward`` intervals on its ``compute`` stream). Between two of them the stream
    idles ``start_k - end_(k-1)`` (``end_(k-1)``: the latest end so far). The part of
    that gap before the host began issuing ``c_k`` (``issued[label]``, in the intervals'
    ms: the issue thread entered the device's ``submit`` for it, holding the issue lock
    by then, so its wait for the lock counts) is idle the device could not have avoided:
    ``issue_idle_ms = sum_k max(0, min(start_k, issued_k) - end_(k-1))``. The rest of a
    gap (the host running ``c_k``'s Python before its first kernel, the stream waiting
    for a prefetch or another device's activations) is not counted, nor is the time
    before ``c_1`` (the pipeline's fill): a lower bound of the idle issue caused.
    ``unstamped_gaps``: gaps whose action has no issue time (not counted).

    >>> from fxpipe.sim.timeline import Interval
    >>> ivs = [Interval(0, "compute", "0F0", "forward", 0, 2),
    ...        Interval(0, "prefetch", "2P", "transfer", 0, 6),
    ...        Interval(0, "compute", "2F0", "forward", 5, 7),
    ...        Interval(0, "compute", "2F1", "forward", 9, 10)]
    >>> f = device_idle(ivs, 0, {"0F0": 0.0, "2F0": 4.0, "2F1": 1.0})
    >>> f["idle_ms"], f["issue_idle_ms"]     # 2 -> 5: issued at 4; 7 -> 9: issued long before
    (5.0, 2.0)
    """
    compute = sorted((iv for iv in intervals if iv.device == device
                      and iv.stream == "compute" and iv.kind != "transfer"),
                     key=lambda iv: iv.start)
    idle = bound = 0.0
    unstamped = 0
    prev_end = None
    for iv in compute:
        if prev_end is not None and iv.start > prev_end:
            idle += iv.start - prev_end
            began = issued.get(iv.label)
            if began is None:
                unstamped += 1
            else:
                bound += max(0.0, min(iv.start, began) - prev_end)
        prev_end = iv.end if prev_end is None else max(prev_end, iv.end)
    return {"compute_actions": len(compute),
            "compute_busy_ms": sum(iv.end - iv.start for iv in compute),
            "idle_ms": idle, "issue_idle_ms": bound, "unstamped_gaps": unstamped}


# ---------------------------------------------------------------------------- memory

def reset_peaks(dry_run: bool, devices: Sequence[Device]) -> int | None:
    """Reset the devices' peaks (on a GPU, its peak stats: every logical device's);
    returns the GPU's reserved bytes then (None in a dry run)."""
    for d in devices:
        d.reset_peak()
    return None if dry_run else torch.cuda.memory_reserved(0)


def memory_figures(dry_run: bool, pipe, devices: Sequence[Device], target: torch.Tensor,
                   reserved_at_start: int | None) -> dict[str, Any]:
    """Reserved memory over the alternating calls against the predicted peaks of a call
    at the first length (module docstring)."""
    pred = predict_memory(pipe, loss_fn=loss_fn, label=target)
    predicted = [p.total if p is not None else 0 for p in pred.devices]
    if dry_run:
        reserved = sum(d.peak_reserved_bytes() for d in devices)
        source = "sum of the virtual devices' peak_reserved_bytes()"
    else:
        reserved = torch.cuda.max_memory_reserved(0)
        source = "torch.cuda.max_memory_reserved(0): the whole GPU, every logical device"
    total = sum(predicted)
    return {"memory_reserved": reserved, "predicted": total,
            "reserved_over_predicted": reserved / total if total else None,
            "reserved_from": source, "reserved_at_start": reserved_at_start,
            "predicted_from": "sum over devices of fxpipe.plan.predict_memory(pipe, loss_fn=, "
                              "label=).devices[i].total at the first length (the pipe's "
                              "stage backend)",
            "devices": [{"predicted_bytes": p, "counted_peak_bytes": Device.peak_bytes(d)}
                        for p, d in zip(predicted, devices)]}


# ---------------------------------------------------------------------------- dry run

class _StandIn:
    """A segment's own graph where inductor's code would be (a dry run's compile)."""

    def __init__(self, gm: torch.fx.GraphModule):
        self.gm = gm

    def __call__(self, *args: Any) -> Any:
        return self.gm(*args)


@contextlib.contextmanager
def stand_in_compiler(on: bool) -> Iterator[None]:
    """With ``on``: ``torch._inductor.compile``, which ``runtime.stages.compiled`` calls
    per segment and signature, returns the segment's graph itself (module docstring);
    after the block, what it "compiled" is dropped from the artifacts again, so a later
    pipe of this process compiles those segments for real."""
    if not on:
        yield
        return
    import torch._inductor
    from fxpipe.runtime.stages.compiled import artifacts
    real = torch._inductor.compile
    torch._inductor.compile = lambda gm, inputs, *args, **kwargs: _StandIn(gm)
    try:
        yield
    finally:
        torch._inductor.compile = real
        for art in artifacts():
            with art.lock:
                for sig in [s for s, (fn, _) in art.compiled.items() if isinstance(fn, _StandIn)]:
                    del art.compiled[sig]


# ---------------------------------------------------------------------------- summary

def backend_line(r: dict[str, Any]) -> str:
    if not r.get("ran"):
        err = r.get("error") or {}
        return f"did not run: {err.get('type')}: {str(err.get('message'))[:200]}"
    issue, idle = r["issue"], r["issue_idle"]
    per_kernel = issue["issue_us_per_kernel"]
    return (f"{issue['issue_us_per_action']:.0f} us/action, "
            f"{'n/a' if per_kernel is None else f'{per_kernel:.1f}'} us/kernel, "
            f"lock wait {r['issue_lock_wait_ms']:.1f} ms, "
            f"issue-bound idle {idle['issue_idle_ms']:.1f} of {idle['idle_ms']:.1f} ms, "
            f"captures {r['captures_after_step']}, "
            f"reserved/predicted {_fmt(r['memory']['reserved_over_predicted'])}, "
            f"a call with the issue lock kept / handed over after each action "
            f"{r['lock_ab']['kept']['call_ms']:.0f} / {r['lock_ab']['each']['call_ms']:.0f} ms")


def many_devices_summary(r: dict[str, Any]) -> str:
    rows = "; ".join(f"{b}: {backend_line(row)}" for b, row in r["backends"].items())
    return (f"{r['logical_devices']} logical devices; {rows}; loss rel diff "
            f"{_fmt(r['max_loss_rel_diff'], '.1e')}, plateau {r['plateau']}")


def _fmt(x: Any, spec: str = ".2f") -> str:
    return format(x, spec) if isinstance(x, float) else str(x)
