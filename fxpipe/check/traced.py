"""The kit's sections read from one traced training step on every device:
``hidden_prefetch`` (how much parameter prefetching the compute hid, from the CUDA-event
timeline), ``predicted_vs_measured`` (``fxpipe.simulate`` against the step's makespan)
and ``stats`` (``pipe.stats()``, the host's issue time against each device's compute,
and the host's figures for ``fxpipe.simulate`` fitted to it).
The timeline arithmetic is ``fxpipe.runtime.issue.trace``'s."""

from __future__ import annotations

from typing import Any

import fxpipe
from fxpipe.check.common import devices, link_bandwidth, loss_fn, model_and_batch, settle, unsampled
from fxpipe.check.harness import Kit
from fxpipe.plan import layer_costs
from fxpipe.runtime.issue.trace import compute_busy_ms, prefetch_figures
from fxpipe.sim import Hardware, LayerCost
from fxpipe.sim.host_fit import fit_host, issue_us_by_kind


def traced_step(shape: dict, num_devices: int, dry_run: bool) -> dict[str, Any]:
    """Two traced steps on all devices: one timed layer by layer (its layer times feed
    the simulator, its makespan is what it predicts), then one that is not (what a
    training call runs: its timeline gives the prefetch figures, its ``pipe.stats()``
    the stats). Returns the pipe (open), both recordings and the stats."""
    model, ids, target = model_and_batch(shape)
    M = max(2, num_devices + 1)
    pipe = fxpipe.compile(model, example_inputs=(ids,), devices=devices(num_devices, dry_run),
                          config=fxpipe.RunConfig(num_microbatch=M))
    try:
        for _ in range(2):
            pipe.forward_backward((ids,), label=target, loss_fn=loss_fn)
        pipe.timings.reset()          # the next call is timed layer by layer
        pipe.timings.warmup = 0
        with pipe.trace() as sampled_rec:
            pipe.forward_backward((ids,), label=target, loss_fn=loss_fn)
        with unsampled(pipe) as sampling:
            pipe.forward_backward((ids,), label=target, loss_fn=loss_fn)   # warm generated code
            settle(dry_run)
            with pipe.trace() as rec:
                pipe.forward_backward((ids,), label=target, loss_fn=loss_fn)
            stats = pipe.stats()
    except BaseException:
        pipe.close()
        raise
    return {"pipe": pipe, "M": M, "sampled_rec": sampled_rec, "rec": rec, "stats": stats,
            "unsampled": sampling}


def traced(kit: Kit) -> dict[str, Any]:
    """The traced steps (run once, by the first section that needs them)."""
    return kit.shared("traced step", lambda: traced_step(kit.shape, kit.num, kit.dry_run),
                      lambda tr: tr["pipe"].close(), first="hidden_prefetch")


def hidden_prefetch(kit: Kit) -> dict[str, Any]:
    tr = traced(kit)
    timeline = tr["rec"].timeline
    figures = {d: prefetch_figures(timeline.intervals, d) for d in range(kit.num)}
    return {"devices": figures,
            "exposed_ms_total": sum(f["exposed_ms"] for f in figures.values()),
            "makespan_ms": timeline.makespan, "call_sampled": tr["unsampled"]["sampled"]}


def hidden_prefetch_summary(r: dict[str, Any]) -> str:
    return ", ".join(f"dev {d}: hidden {_fmt(f['hidden_fraction'])}, exposed "
                     f"{f['exposed_ms']:.1f} ms" for d, f in r["devices"].items())


def predicted_vs_measured(kit: Kit) -> dict[str, Any]:
    tr = traced(kit)
    pipe, rec = tr["pipe"], tr["sampled_rec"]
    h2d, d2h = link_bandwidth(kit.dry_run)
    hw = Hardware(h2d_bandwidth=h2d, d2h_bandwidth=d2h)
    predicted = fxpipe.simulate(pipe, hw, num_microbatch=tr["M"]).makespan
    measured = rec.timeline.makespan
    return {"predicted_ms": predicted, "measured_ms": measured,
            "predicted_over_measured": predicted / measured if measured else None,
            "call_sampled": True, "measured_unsampled_ms": tr["rec"].timeline.makespan,
            "h2d_bytes_per_s": h2d, "d2h_bytes_per_s": d2h,
            "bubble_ratio_measured": rec.timeline.bubble_ratio, "plan": repr(pipe.plan)}


def predicted_vs_measured_summary(r: dict[str, Any]) -> str:
    return f"predicted/measured {_fmt(r['predicted_over_measured'])}"


def stats(kit: Kit) -> dict[str, Any]:
    """The unsampled step's ``pipe.stats()``, and the host's issue time beside each
    device's compute busy time in it (``issue_vs_busy``: above 1, the host could not
    keep that device fed); ``host_fit``: this host's figures for ``fxpipe.simulate``
    (``fxpipe.sim.host_fit``: per action, per kernel without and with grad) fitted to the
    step's issue time per action kind. Its per-kernel figures mean something only where
    the devices run an action's Python at issue (``runs_at_issue``: a GPU); on virtual
    devices (the dry run) the kernels run on the devices' workers, outside the issue
    time. The last section to read the traced step: its pipe is closed."""
    tr = traced(kit)
    try:
        issue_ms = tr["stats"]["host_issue_us"] / 1e3
        busy = {d: compute_busy_ms(tr["rec"].timeline.intervals, d) for d in range(kit.num)}
        pipe = tr["pipe"]
        backend = pipe.stage_backend   # "auto" launches inductor's kernels
        fit = fit_host(pipe.program("fused", tr["M"]),
                       [LayerCost.of(c, Hardware()) for c in layer_costs(pipe)],
                       issue_us_by_kind(tr["stats"]),
                       stage_backend="inductor" if backend == "auto" else backend)
        return {**tr["stats"], "call_sampled": tr["unsampled"]["sampled"],
                "host_issue_ms": issue_ms, "compute_busy_ms": busy,
                "issue_vs_busy": {d: issue_ms / b if b else None for d, b in busy.items()},
                "host_fit": {**fit, "runs_at_issue": all(d.runs_at_issue for d in pipe.devices)}}
    finally:
        kit.release("traced step")


def stats_summary(r: dict[str, Any]) -> str:
    return f"host waits {r.get('host_waits')}"


def _fmt(x: Any) -> str:
    return f"{x:.3f}" if isinstance(x, float) else str(x)
