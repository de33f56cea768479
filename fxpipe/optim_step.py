"""How the host steps some parameters: which torch kernels, on how many threads.

``fxpipe.optim`` steps each backward stage's parameters with the user's optimizer, on
a *view* of it (:func:`step_view`). The step reads and writes every parameter, gradient
and state tensor once, so its speed is the host's memory bandwidth if the kernels keep
up: torch's fused CPU kernels do (SGD, Adam, AdamW, Adagrad: one pass per tensor), its
for-loop and foreach implementations do not (several passes, one per op). Measured on
this project's 2-core VM (``benchmarks/bench_optimizer.py --part cpu``, README "Host
optimizer step"), fused AdamW steps about 3x the parameters per second of the for-loop
(torch's default on CPU) and 6x those of foreach.

- Kernels (:func:`fused_groups`): a param group built with ``foreach=None, fused=None``
  (torch's defaults: torch then picks the for-loop on CPU) of a class with fused CPU
  kernels, all of whose parameters are real floating-point CPU tensors, is stepped with
  ``fused=True``. The result is then bitwise that of the same optimizer built with
  ``fused=True`` and stepped eagerly (and within rounding of the for-loop's, not equal
  to it). A choice the user made (``foreach=...``, ``fused=...``) is kept. When fused
  kernels cannot be used, a one-time warning per optimizer says why and how to opt in.
- Threads (:func:`intra_op_threads`): the step runs with ``threads`` torch intra-op
  threads (each fused kernel splits its tensors over them; results do not depend on
  the count, each element's math being its own). The default leaves the cores the
  devices use to them (:func:`default_threads`).

>>> lin = torch.nn.Linear(4, 2)
>>> opt = torch.optim.AdamW(lin.parameters())
>>> hyper = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
>>> [(g["foreach"], g["fused"]) for g in fused_groups(opt, hyper)]   # torch's defaults, then fxpipe's
[(None, True)]
"""

from __future__ import annotations

import collections
import contextlib
import os
import threading
import warnings
from collections.abc import Collection, Iterator, Sequence
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

# classes whose param groups take ``fused=True`` on CPU (AdamW is an Adam)
FUSED_ON_CPU = (torch.optim.SGD, torch.optim.Adam, torch.optim.Adagrad)
FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def fused_groups(opt: torch.optim.Optimizer, hyper: list[dict]) -> list[dict]:
    """``hyper`` (each param group's settings, as :func:`step_view` takes them) with
    ``fused=True`` in the groups torch's fused CPU kernels can step and the user left
    to torch's choice (``foreach=None, fused=None``). Warns once per optimizer and
    reason when a group is stepped without fused kernels, unless the user turned them
    off (``fused=False``)."""
    out = []
    for group, hp in zip(opt.param_groups, hyper):
        reason = _not_fused(opt, hp, group["params"])
        if reason is None:
            hp = {**hp, "fused": True}
        elif reason:
            _warn_once(opt, reason)
        out.append(hp)
    return out


def _not_fused(opt: torch.optim.Optimizer, hp: dict, params: Collection[torch.Tensor]) -> str | None:
    """Why ``opt``'s group ``hp`` is not stepped with fused kernels: None when it is
    (or will be: ``fused=True``), ``""`` when the user chose so (no warning)."""
    name = type(opt).__name__
    if not isinstance(opt, FUSED_ON_CPU):
        return f"{name} has no fused CPU kernel in torch"
    if hp.get("fused") is not None:
        return None if hp["fused"] else ""
    if hp.get("foreach") is not None:
        return (f"{name} was built with foreach={hp['foreach']}, which fxpipe keeps; build it "
                f"with fused=True (or leave foreach=None) to step with fused kernels")
    if hp.get("differentiable"):
        return f"{name} was built with differentiable=True, which fused kernels do not support"
    bad = next((p for p in params if p.requires_grad and not (
        p.device.type == "cpu" and p.dtype in FUSED_DTYPES and p.layout == torch.strided)), None)
    if bad is not None:
        return (f"a param group of {name} holds a {bad.dtype} {bad.layout} parameter on "
                f"{bad.device}; fused CPU kernels take dense {', '.join(map(str, FUSED_DTYPES))}")
    return None


def _warn_once(opt: torch.optim.Optimizer, reason: str) -> None:
    warned = opt.__dict__.setdefault("_fxpipe_warned", set())  # not pickled (__getstate__)
    if reason in warned:
        return
    warned.add(reason)
    warnings.warn(
        f"fxpipe: the streamed optimizer step runs without torch's fused CPU kernels: "
        f"{reason}. Fused AdamW steps about 3x the parameters per second of the for-loop "
        f"implementation (torch's CPU default) and 6x those of foreach (README, 'Host "
        f"optimizer step'); SGD, Adam, AdamW and Adagrad are stepped with fused kernels when "
        f"built with foreach=None and fused=None (the defaults) or fused=True.",
        UserWarning, stacklevel=3)


def step_view(opt: torch.optim.Optimizer, hyper: list[dict],
              params: Collection[torch.Tensor]) -> None:
    """``opt.step()`` restricted to ``params``, with the settings ``hyper`` (one dict per
    param group, without ``"params"``; e.g. :func:`fused_groups`'s): the class's own step
    on a view whose param groups hold only those parameters and whose ``state`` is the
    optimizer's (per-parameter math: the same result as a full step)."""
    ids = {id(p) for p in params}
    groups = []
    for g, hp in zip(opt.param_groups, hyper):
        sub = [p for p in g["params"] if id(p) in ids]
        if sub:
            groups.append({**hp, "params": sub})
    step_groups(opt, groups)


def step_groups(opt: torch.optim.Optimizer, groups: list[dict],
                state: dict | None = None) -> None:
    """Run ``opt``'s class's ``step`` over ``groups`` (param groups: settings and
    ``"params"``), with ``state`` (default: ``opt.state``), on a view of ``opt``.

    Fused SGD with momentum steps a list of parameters either all with a momentum buffer
    or all without one (its first step): a group that holds both kinds (a parameter
    whose first gradient came later) is stepped as two, each parameter as torch's
    for-loop would (eager ``fused=True`` raises there)."""
    state = opt.state if state is None else state
    split = []
    for g in groups:
        if g.get("fused") and isinstance(opt, torch.optim.SGD) and g.get("momentum"):
            started = [p for p in g["params"]
                       if state.get(p, {}).get("momentum_buffer") is not None]
            fresh = [p for p in g["params"] if state.get(p, {}).get("momentum_buffer") is None]
            split += [{**g, "params": ps} for ps in (started, fresh) if ps]
        elif g["params"]:
            split.append(g)
    if not split:
        return
    view = object.__new__(type(opt))
    view.__dict__.update(opt.__dict__)
    view.param_groups = split
    view.state = state
    watch_fused_steps()
    type(opt).step(view)


def step_shards(opt: torch.optim.Optimizer, hyper: list[dict], shards: Sequence[Any],
                state: dict[str, dict]) -> None:
    """``shard_optimizer``: step this rank's shard of some buckets
    (``fxpipe.runtime.host.buckets.Shard``: the averaged gradient of its 1/N, one flat
    tensor) with ``opt``'s class and each param group's settings ``hyper``: each
    parameter's piece in the shard is stepped in place, as its fp32 master where this
    rank keeps one (``Bucket.masters``), else as a view of the parameter (parameters
    ``opt`` does not hold are left as they are). Their state lives in ``state`` by
    parameter name, not in ``opt.state``: this rank's 1/N."""
    group_of = {id(p): i for i, g in enumerate(opt.param_groups) for p in g["params"]}
    groups: dict[int, list[torch.Tensor]] = {}
    view_state: dict = collections.defaultdict(dict)
    masters = []
    for sh in shards:
        b = sh.bucket
        for i, lo, hi, at in b.pieces():
            g = group_of.get(id(b.params[i]))
            if g is None:
                continue
            t = b.masters[i]
            if t is None:
                t = b.params[i].detach().view(-1)[lo:hi]
            t.grad = sh.grad[at:at + hi - lo]
            groups.setdefault(g, []).append(t)
            view_state[t] = state.setdefault(b.names[i], {})
            if b.masters[i] is not None:
                masters.append(t)
    try:
        step_groups(opt, [{**hyper[g], "params": ts} for g, ts in sorted(groups.items())],
                    view_state)
    finally:
        for t in masters:   # the masters outlive the step: not the shard's gradient
            t.grad = None


def clip_coefficient(max_norm: float, total: torch.Tensor) -> float:
    """What ``clip_grad_norm_`` multiplies the gradients by (1.0: clipping changes
    nothing)."""
    return torch.clamp(max_norm / (total + 1e-6), max=1.0).item()


def shard_norm(opt: torch.optim.Optimizer, shards: Sequence[Any],
               norm_type: float) -> torch.Tensor:
    """``shard_optimizer`` with ``max_grad_norm``: this rank's part of the total norm of
    ``opt``'s gradients, from the pieces :func:`step_shards` steps (its shards' averaged
    gradients): the sum of their norms to the power ``norm_type`` (for ``inf``, the
    largest), a float64 scalar the ranks combine (``DataParallel.total_norm``)."""
    norm_type = float(norm_type)
    held = {id(p) for g in opt.param_groups for p in g["params"]}
    pieces = [sh.grad[at:at + hi - lo] for sh in shards
              for i, lo, hi, at in sh.bucket.pieces() if id(sh.bucket.params[i]) in held]
    if not pieces:
        return torch.zeros((), dtype=torch.float64)
    norms = torch.stack(torch._foreach_norm(pieces, norm_type)).double()
    return norms.max() if norm_type == float("inf") else (norms ** norm_type).sum()


_watching = False                 # under _watching_lock: compiles may run on several threads
_watching_lock = threading.Lock()


def watch_fused_steps() -> None:
    """Bump the version counters of the parameters every fused optimizer step in this
    process updates (a global step post-hook, registered once, by ``fxpipe.compile`` and
    :func:`step_view`). torch's fused kernels write parameters in place without bumping
    them, and a parameter's version is how fxpipe's parameter store sees that it changed
    since its last upload copy: without this, ``AdamW(fused=True).step()`` between two
    calls would leave the devices training on the old weights."""
    global _watching
    with _watching_lock:
        if not _watching:
            register_optimizer_step_post_hook(_bump_fused)
            _watching = True


def _bump_fused(opt: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    stepped = [p for g in opt.param_groups if g.get("fused") for p in g["params"]
               if p.grad is not None]
    if stepped:
        torch.autograd.graph.increment_version(stepped)


def default_threads() -> int:
    """Host threads for a stage's step that the devices do not need: with CUDA, every
    core but one per GPU (its issue thread) and one for the caller; without, 1 (virtual
    devices compute on the host's cores, one thread each)."""
    if not torch.cuda.is_available():
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores - torch.cuda.device_count() - 1)


@contextlib.contextmanager
def intra_op_threads(threads: int, after: int) -> Iterator[None]:
    """Run the block with ``threads`` torch intra-op threads on this thread, then set
    ``after``. ``torch.set_num_threads`` also sets the count threads adopt on their
    first parallel op: give as ``after`` the caller's count (the process-wide value), so
    a host worker does not leave it at its own. Nothing is set when this thread already
    runs with ``threads``."""
    if torch.get_num_threads() == threads:
        yield
        return
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(after)
