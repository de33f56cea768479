"""Fit ``Hardware``'s host figures to a measured call's issue time per action kind.

A call's ``pipe.stats()`` has the host's issue time per action kind
(``host_issue_us.Forward``, ...). With the call's Program and its layers' kernel counts
(``Cost.fwd_kernels`` / ``bwd_kernels``), :func:`fit_host` solves for the figures the
simulator's issue pass prices (``fxpipe.sim.simulate``):

- ``host_us_per_action``: the time of the actions that launch none of the stage code's
  kernels (``NO_KERNELS``), per action;
- ``host_us_per_kernel``: the ``Forward`` / ``Checkpoint`` actions' time less that, per
  kernel (no grad);
- ``host_us_per_grad_kernel``: the recompute-and-backward actions' time (``WITH_GRAD``)
  less that, per kernel (with grad: autograd records and runs them).

``fxpipe.sim.hardware.H200_HOST`` is this fit to the H200 run
(``benchmarks/bench_host_model.py``); the GPU kit's ``stats`` section fits the host it
runs on.

>>> from fxpipe.passes.schedule import build_program
>>> from fxpipe.sim import LayerCost
>>> p = build_program([range(0, 1)], [range(1, 2), range(0, 1)], "fused", 1, 2, "stage")
>>> costs = [LayerCost(1.0, 2.0, fwd_kernels=10, bwd_kernels=20)] * 2
>>> {k: r["actions"] for k, r in action_counts(p, costs).items() if r["kernels"]}
{'Forward': 2, 'FusedBackward': 2, 'RecomputeBackward': 2}
>>> fit = fit_host(p, costs, {"Forward": 2 * 100 + 20 * 5, "FusedBackward": 2 * 100 + 60 * 9,
...                           "RecomputeBackward": 2 * 100 + 60 * 9, "Prefetch": 300,
...                           "Upload": 600, "Free": 600, "Release": 300, "DownloadGrads": 200})
>>> round(fit["host_us_per_action"]), round(fit["host_us_per_kernel"]), round(fit["host_us_per_grad_kernel"])
(100, 5, 9)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from fxpipe.passes.program import Program
from fxpipe.sim.hardware import LayerCost
from fxpipe.sim.simulate import StageBackend, action_kernels

__all__ = ["NO_KERNELS", "WITH_GRAD", "action_counts", "fit_host", "issue_us_by_kind"]

NO_KERNELS = ("Prefetch", "Upload", "GraphUpload", "Offload", "Free", "Release", "DownloadGrads")
NO_GRAD = ("Forward", "Checkpoint")
WITH_GRAD = ("RecomputeBackward", "FusedBackward")


def issue_us_by_kind(stats: Mapping[str, Any]) -> dict[str, float]:
    """The host's issue time per action kind in ``pipe.stats()`` (its
    ``host_issue_us.<kind>`` entries).

    >>> issue_us_by_kind({"host_issue_us": 7, "host_issue_us.Forward": 5, "actions": 3})
    {'Forward': 5}
    """
    return {k.split(".", 1)[1]: v for k, v in stats.items() if k.startswith("host_issue_us.")}


def action_counts(program: Program, costs: Sequence[LayerCost],
                  stage_backend: StageBackend | None = None) -> dict[str, dict[str, float]]:
    """Per action kind of ``program``'s device lanes: how many, and the kernels they
    launch (``simulate.action_kernels``)."""
    kernels = action_kernels(program, costs, stage_backend)
    out: dict[str, dict[str, float]] = {}
    for lane, acts in program.lanes():
        if lane < 0:
            continue
        for i, a in enumerate(acts):
            row = out.setdefault(type(a).__name__, {"actions": 0, "kernels": 0.0})
            row["actions"] += 1
            row["kernels"] += kernels.get((lane, i), (0.0, False))[0]
    return out


def fit_host(program: Program, costs: Sequence[LayerCost], issue_us: Mapping[str, float],
             stage_backend: StageBackend | None = None) -> dict[str, Any]:
    """The host figures (module docstring) from ``issue_us``, the measured issue time per
    action kind (µs) of a call that ran ``program``; and per kind, the measured and the
    fitted time (``kinds``). A figure with nothing to fit it (no such actions, or no
    kernels) is ``None``."""
    kinds = action_counts(program, costs, stage_backend)

    def total(names: Sequence[str], field: str) -> float:
        return sum(kinds[k][field] for k in names if k in kinds)

    def measured(names: Sequence[str]) -> float:
        return sum(issue_us.get(k, 0.0) for k in names)

    n = total(NO_KERNELS, "actions")
    per_action = measured(NO_KERNELS) / n if n else None
    base = per_action or 0.0

    def per_kernel(names: Sequence[str]) -> float | None:
        k = total(names, "kernels")
        return (measured(names) - total(names, "actions") * base) / k if k else None

    per, per_grad = per_kernel(NO_GRAD), per_kernel(WITH_GRAD)
    rows = []
    for kind, r in sorted(kinds.items()):
        each = per_grad if kind in WITH_GRAD else per if kind in NO_GRAD else 0.0
        rows.append({"kind": kind, "actions": r["actions"], "kernels": r["kernels"],
                     "measured_us": issue_us.get(kind, 0.0),
                     "fitted_us": r["actions"] * base + r["kernels"] * (each or 0.0)})
    return {"host_us_per_action": per_action, "host_us_per_kernel": per,
            "host_us_per_grad_kernel": per_grad, "stage_backend": stage_backend, "kinds": rows}
