"""The optimizer step, overlapped with the pipelined backward.

Parameters live in host memory, so the optimizer runs on the host. Run after the call
(``opt.step()``), it stalls every device. Passed to the call, it runs *during* the
backward: backward stages finish deepest first, and as soon as a stage's gradients are
final the host steps that stage's parameters (an ``OptimizerStep`` in the call's
Program, ``pipe.program("fused", optimizer=opt)`` prints them) while the devices
back-propagate the shallower stages. Only the first layers' step is left when the
backward ends::

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, 100)
    for x, y in data:
        loss = pipe.forward_backward((x,), label=y, loss_fn=ce, optimizer=opt)
        sched.step()
        opt.zero_grad(set_to_none=True)

``optimizer=opt`` steps on that call. ``optimizer=fxpipe.optim.overlapped(opt, ...)``
adds options, and counts calls for gradient accumulation (pass it on every call)::

    step = fxpipe.optim.overlapped(opt, accumulate=4, max_grad_norm=1.0)
    for x, y in data:
        loss = pipe.forward_backward((x,), label=y, loss_fn=ce, optimizer=step)
        if step.stepped:                      # every 4th call
            sched.step()
            opt.zero_grad(set_to_none=True)

``mode="exact"`` (default): parameters, ``.grad`` and optimizer state after the call are
those of eager ``loss.backward(); opt.step()`` (with ``clip_grad_norm_`` first when
``max_grad_norm`` is set), bitwise for fp32; the call returns once every step is done, so
``zero_grad``, schedulers, ``state_dict()`` and checkpointing need no care. Each stage's
parameters are stepped by the optimizer's own ``step`` on a view of it whose param
groups hold only those parameters (state is keyed by parameter, so it stays one state
dict, loadable by a plain optimizer); hyperparameters (``lr``...) are read when the call
starts. Works for optimizers whose update is per parameter: all of ``torch.optim`` but
LBFGS (SGD, Adam, AdamW, ...). Step hooks run once per stage, each seeing only that
stage's parameters.

Kernels and threads (``fxpipe.optim_step``): a param group left to torch's choice of
implementation (``foreach=None, fused=None``, the defaults) of SGD, Adam, AdamW or
Adagrad is stepped with torch's fused CPU kernels (about 3x the for-loop's speed, which
is torch's CPU default): "eager" above then means the optimizer built with
``fused=True``, bitwise. An implementation the user chose is kept; a one-time warning
says when fused kernels cannot be used. ``threads``: torch intra-op threads for each
stage's step (default: the host cores the devices leave free: 1 with virtual devices).

``max_grad_norm``: the clip coefficient needs every gradient. With ``speculate=True``
(default) stages are stepped as their gradients arrive, as if no clipping were needed,
keeping a copy of their parameters and state; when the backward ends, if the norm is
within ``max_grad_norm`` (clip coefficient 1: eager's clipping changes nothing) the
result is exact as is; otherwise the copies are put back, the gradients clipped and the
whole step runs then (not overlapped). ``speculate=False`` always waits for the end.

Every part of a step is an action of the call's Program, in its host lane, and
``pipe.program("fused", optimizer=step)`` prints them (``passes.program``):
``S4:6`` steps a stage (streamed, before the ``C``ommit, or after it when it cannot
be), ``N`` clips (or checks the speculated norm and redoes the step), ``SS`` is the
``GradScaler`` step, ``A`` applies the previous call's asynchronous update and ``Q``
queues this call's. For example ``overlapped(opt, max_grad_norm=1.0)`` prints
``RF S5:6 S3:5 S1:3 S0:1 C N`` and ``speculate=False`` ``RF M5:6 ... C N S5:6 ...``.

``mode="async"``: RoundPipe's one-step-stale optimizer. A call's update is applied
during the *next* call, which therefore computes its gradients on weights that lack the
latest update: this changes the training math (the update equals the exact one, but
gradients are one step stale). The pending update holds its own copy of the gradients,
so ``zero_grad`` is free to run; ``step.synchronize()`` applies it now (before
evaluating or saving the model; ``opt.state_dict()`` and ``opt.step()`` do it first,
``opt.load_state_dict()`` drops it). A call that fails has still applied the update it
was carrying; its own gradients are dropped, as always.

``scaler=torch.amp.GradScaler(...)``: the loss is scaled inside the pipeline and the
step is eager's ``scaler.step(opt)`` after the commit (the inf check needs every
gradient: nothing is overlapped). Call ``scaler.update()`` after the call, as in eager.

Failures: with ``atomic=True`` (or while speculating on clipping) a call failing before
its commit, or in the clipping after it (``N``), puts back the stepped parameters, their
state and ``.grad``: nothing changed. Otherwise the stages already stepped stay stepped,
each whole (never half a tensor): the ``StageError`` carries a note naming them. A step
after the commit (``SS``, ``S`` after ``C``) that fails raises with the call's gradients
in ``.grad``.
"""

from __future__ import annotations

import copy
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch

from fxpipe.errors import StageError
from fxpipe.optim_step import (clip_coefficient, default_threads, fused_groups,
                               intra_op_threads, shard_norm, step_shards, step_view)
from fxpipe.passes.program import OptimizerSpec

Mode = Literal["exact", "async"]


class Overlapped:
    """A torch optimizer run by the pipeline; see the module docstring.

    >>> import fxpipe
    >>> from torch import nn
    >>> model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    >>> x, y, ce = torch.randn(6, 4), torch.tensor([0, 1, 2, 0, 1, 2]), nn.functional.cross_entropy
    >>> pipe = fxpipe.compile(model, example_inputs=(x,), devices=["cpu", "cpu"])
    >>> step = fxpipe.optim.overlapped(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    >>> loss = pipe.forward_backward((x,), label=y, loss_fn=ce, optimizer=step)
    >>> step.stepped
    True
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *, mode: Mode = "exact",
                 accumulate: int = 1, max_grad_norm: float | None = None,
                 norm_type: float = 2.0, speculate: bool = True,
                 scaler: torch.amp.GradScaler | None = None, atomic: bool = False,
                 threads: int | None = None):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got "
                            f"{type(optimizer).__name__}")
        if isinstance(optimizer, torch.optim.LBFGS):
            raise NotImplementedError("LBFGS needs a closure re-evaluating the whole model, which "
                                      "a streamed step cannot call; step it after the call")
        if mode not in ("exact", "async"):
            raise ValueError(f"mode must be 'exact' or 'async', got {mode!r}")
        if not isinstance(accumulate, int) or accumulate < 1:
            raise ValueError(f"accumulate must be an int >= 1 (calls per step), got "
                             f"{accumulate!r}")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be > 0 or None, got {max_grad_norm!r}")
        if threads is not None and (not isinstance(threads, int) or threads < 1):
            raise ValueError(f"threads must be an int >= 1 (host threads per stage's step) or None, "
                             f"got {threads!r}")
        if scaler is not None and mode == "async":
            raise NotImplementedError("GradScaler with mode='async' is not supported: its inf check "
                                      "and scale update would have to move to the next call")
        self.optimizer = optimizer
        self.mode: Mode = mode
        self.accumulate = accumulate
        self.max_grad_norm = max_grad_norm
        self.norm_type = norm_type
        self.speculate = speculate
        self.scaler = scaler
        self.atomic = atomic
        self.threads = threads    # None: optim_step.default_threads() at each call
        self.calls = 0            # calls made with this object
        self.stepped = False      # whether the last call stepped (async: queued its update)
        # max_grad_norm: the gradients' total norm the last clipping measured, before it
        # clipped them (what clip_grad_norm_ returns, and a Trainer logs as grad_norm)
        self.grad_norm: torch.Tensor | None = None
        self._pending: _Update | None = None   # under _lock: the call's host thread queues
        # it, the caller's thread (synchronize, hooks) or the next call applies or drops it
        self._lock = threading.Lock()
        if mode == "async":
            me = weakref.ref(self)
            optimizer.register_state_dict_pre_hook(lambda opt: _call(me, "synchronize"))
            optimizer.register_load_state_dict_pre_hook(lambda opt, sd: _call(me, "_drop"))
            optimizer.register_step_pre_hook(
                lambda opt, args, kwargs: _call(me, "synchronize") if opt is optimizer else None)

    def spec(self, steps: bool = True) -> OptimizerSpec | None:
        """What a call's Program holds for this optimizer (``steps``: whether the call
        steps; an accumulating call of ``mode="exact"`` holds nothing).

        >>> sgd = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
        >>> str(overlapped(sgd, max_grad_norm=1.0, speculate=False).spec())
        'exact+clip'
        """
        if not steps and self.mode == "exact":
            return None
        return OptimizerSpec(self.mode, steps, clip=self.max_grad_norm is not None,
                             speculate=self.speculate,
                             scaler=self.scaler is not None and self.scaler.is_enabled())

    def will_step(self) -> bool:
        """Whether the next call steps (its number is a multiple of ``accumulate``)."""
        return (self.calls + 1) % self.accumulate == 0

    def synchronize(self) -> None:
        """``mode="async"``: apply the pending update now (no-op when there is none)."""
        with self._lock:
            pending, self._pending = self._pending, None
        if pending is not None:
            pending.apply()

    @property
    def shard_state(self) -> dict[str, dict]:
        """``shard_optimizer``: the state of this rank's pieces of the parameters, by
        name. Kept on the optimizer: every ``overlapped(opt, ...)`` of it (a new one per
        call, or ``optimizer=opt``) steps and checkpoints the same state."""
        return self.optimizer.__dict__.setdefault("_fxpipe_shard_state", {})

    def sharded(self) -> None:
        """``shard_optimizer``: this optimizer's state now lives in ``shard_state``, this
        rank's shards only; ``state_dict()`` and ``load_state_dict()`` would see none of it
        and raise instead."""
        if "_fxpipe_shard_hooks" in self.optimizer.__dict__:
            return

        def refuse(*_: Any) -> None:
            raise NotImplementedError(
                "this optimizer is stepped by fxpipe with shard_optimizer=True: its state is "
                "sharded across the ranks (fxpipe.optim.Overlapped.shard_state, this rank's "
                "1/N), not in optimizer.state, so optimizer.state_dict() would miss it; save "
                "and load it with pipe.save_checkpoint(path, optimizer) / "
                "pipe.load_checkpoint(path, optimizer) on every rank (torch.distributed."
                "checkpoint)")
        self.optimizer.__dict__["_fxpipe_shard_hooks"] = [
            self.optimizer.register_state_dict_pre_hook(refuse),
            self.optimizer.register_load_state_dict_pre_hook(refuse)]

    def queue(self, update: _Update) -> None:
        """``mode="async"``: ``update`` is the one the next call (or :meth:`synchronize`)
        applies."""
        with self._lock:
            self._pending = update

    def _drop(self) -> None:
        with self._lock:
            self._pending = None

    @property
    def pending(self) -> bool:
        """``mode="async"``: an update waits to be applied (during the next call)."""
        with self._lock:
            return self._pending is not None

    def close(self) -> None:
        """Apply any pending update."""
        self.synchronize()

    def call(self) -> OptimizerCall:
        """The optimizer's part of one ``forward_backward`` call."""
        return OptimizerCall(self)

    def __repr__(self) -> str:
        opts = [f"mode={self.mode!r}"] + [f"{k}={getattr(self, k)!r}" for k in
                                          ("accumulate", "max_grad_norm", "scaler", "atomic",
                                           "threads")
                                          if getattr(self, k) not in (None, 1, False)]
        return f"Overlapped({type(self.optimizer).__name__}, {', '.join(opts)})"


def overlapped(optimizer: torch.optim.Optimizer, **options: Any) -> Overlapped:
    """Wrap ``optimizer`` for ``pipe.forward_backward(..., optimizer=...)``: options
    ``mode``, ``accumulate``, ``max_grad_norm``, ``norm_type``, ``speculate``, ``scaler``,
    ``atomic``, ``threads`` (see the module docstring)."""
    return Overlapped(optimizer, **options)


def as_overlapped(optimizer: Any) -> Overlapped:
    """``optimizer=`` of a call: an ``Overlapped``, or a torch optimizer (exact, one step
    per call; one ``Overlapped`` per optimizer, kept on it, so its calls are counted
    across calls; ``Optimizer.__getstate__`` leaves it out of pickles)."""
    if isinstance(optimizer, Overlapped):
        return optimizer
    if isinstance(optimizer, torch.optim.Optimizer):
        if "_fxpipe_overlapped" not in optimizer.__dict__:
            optimizer.__dict__["_fxpipe_overlapped"] = Overlapped(optimizer)
        return optimizer.__dict__["_fxpipe_overlapped"]
    raise TypeError(f"optimizer= takes a torch.optim.Optimizer or fxpipe.optim.overlapped(...), "
                    f"got {type(optimizer).__name__}")


def _call(ref: weakref.ref, name: str) -> None:
    obj = ref()
    if obj is not None:
        getattr(obj, name)()


# ------------------------------------------------------------------------------- one call

class OptimizerCall:
    """The optimizer's part of one call: the executor's ``call.optimizer``.

    ``spec``: what the call's Program holds for it (``OptimizerSpec``, printed by
    ``pipe.program(..., optimizer=...)``; ``passes.schedule.host_lane``), None when this
    call neither steps nor applies an update. The executor runs its host actions in
    Program order: ``apply_pending()`` (``A``), ``step(layers, accumulator)`` (``S``),
    ``clip()`` (``N``), ``scaler_step()`` (``SS``) and ``queue_update()`` (``Q``).
    ``finish()`` counts the call once it succeeded; ``failed(exc)`` instead, when it
    raised.
    """

    def __init__(self, ov: Overlapped):
        self.ov = ov
        opt = ov.optimizer
        self.steps = ov.will_step()
        self.spec = ov.spec(self.steps)
        self.hyper = _hyperparameters(opt)       # read now: a scheduler may change them later
        if self.steps and not (self.spec is not None and self.spec.scaler):
            self.hyper = fused_groups(opt, self.hyper)   # stepped by step_view: fused kernels
        self.threads = ov.threads or default_threads()
        self.caller_threads = torch.get_num_threads()   # put back after a step
        streamed = self.spec is not None and self.spec.streamed
        self.backup = streamed and (ov.atomic or ov.max_grad_norm is not None)
        self.saved: list[_Saved] = []            # stages stepped with a backup, in order
        self.stepped: list[range] = []           # layers stepped, in order
        self.shards: list = []                   # the shards stepped (shard_optimizer)
        self.zero3 = False                       # data_parallel="zero3" (pipeline sets it)
        self.owned: dict[int, list[torch.Tensor]] = {}
        self.stage_of: dict[tuple[int, int], int] = {}   # the Program's backward_stage_of

    def assign(self, exe, owned: dict[int, list[torch.Tensor]]) -> None:
        """Each parameter is stepped with the last backward stage (execution order) that
        uses it: a tied parameter's gradient is final only then (the Program's
        ``OptimizerStep`` of that stage waits for every stage sharing it). By that time
        no stage of the call reads it again (forward stages and every backward stage
        holding it have run), so it may change in place. The optimizer's parameters no
        stage uses are stepped with the last backward stage."""
        self.stage_of = exe.program.backward_stage_of
        self.owned = {s: list(ps) for s, ps in owned.items()}   # owned_params(program): StageSpec.owns
        stages = [st.index for st in exe.program.stages if st.kind != "fwd"]
        if stages:
            seen = {id(p) for ps in owned.values() for p in ps}
            rest = [p for g in self.ov.optimizer.param_groups for p in g["params"]
                    if id(p) not in seen]
            self.owned.setdefault(stages[-1], []).extend(rest)

    # -- the executor's host actions ---------------------------------------------------
    def apply_pending(self) -> None:
        """``AsyncUpdate``: apply the previous call's pending update, if there is one."""
        with intra_op_threads(self.threads, self.caller_threads):
            self.ov.synchronize()

    def step(self, layers: range, accumulator, shards: list | None = None) -> None:
        """``OptimizerStep(layers)``: their gradients to ``.grad``, then step them; with
        ``shards`` (``shard_optimizer``), step this rank's shard of them instead. After
        the ``Commit`` (a step that could not be streamed) ``.grad`` is final already."""
        stage = self.stage_of[(layers.start, layers.stop)]
        params = self.owned.get(stage, [])
        in_opt = _in_optimizer(self.ov.optimizer, params)
        try:
            with intra_op_threads(self.threads, self.caller_threads):
                if shards is not None:
                    self.ov.sharded()
                    if self.backup:
                        self.saved.append(_SavedShards(self.ov, params, shards,
                                                       pieces=self.zero3))
                    step_shards(self.ov.optimizer, self.hyper, shards, self.ov.shard_state)
                    for p in params:   # their gradients were consumed by the sharded step
                        p.grad = None
                    self.shards += shards
                    self.stepped.append(layers)
                    return
                saved = _Saved(self.ov.optimizer, in_opt) if self.backup and in_opt else None
                accumulator.commit(params)
                if saved is not None:
                    self.saved.append(saved)
                step_view(self.ov.optimizer, self.hyper, in_opt)
        except Exception as e:
            raise StageError(
                f"the optimizer step of stage {stage} [layers {layers.start}-{layers.stop - 1}] "
                f"failed on the host: {type(e).__name__}: {e}", stage=stage, layers=layers,
                device="host", action=f"S{layers.start}:{layers.stop}") from e
        self.stepped.append(layers)

    def _params(self) -> list[torch.Tensor]:
        return [p for g in self.ov.optimizer.param_groups for p in g["params"]]

    def clip(self, dp: Any = None, pending: Sequence[Any] = ()) -> None:
        """``ClipGradNorm``, after the ``Commit``: eager's ``clip_grad_norm_`` over the
        optimizer's parameters (a ``GradScaler``'s ``unscale_`` first). After speculative
        steps: when clipping changes the gradients (coefficient < 1), put the stepped
        parameters and state back, clip, and step them all again. Stepped by shards
        (``dp``, ``shard_optimizer``): the norm is the ranks' (``DataParallel.total_norm``)
        and each rank clips, steps and gathers its shards again. ``pending``: the shards
        the ``OptimizerStep``s after it step (sharded, not speculated): the ranks' norm of
        them, and each rank's clipped in place."""
        ov, opt = self.ov, self.ov.optimizer
        params = self._params()
        if self.spec.scaler:
            ov.scaler.unscale_(opt)
        if pending:
            ov.grad_norm = dp.total_norm(shard_norm(opt, pending, ov.norm_type), ov.norm_type,
                                         pending, lambda t: False)
            coef = clip_coefficient(ov.max_grad_norm, ov.grad_norm)
            if coef != 1.0:   # eager's clip_grads_with_norm_, on each rank's pieces
                torch._foreach_mul_([sh.grad for sh in pending], coef)
            return
        if not self.spec.streamed:
            ov.grad_norm = torch.nn.utils.clip_grad_norm_(params, ov.max_grad_norm, ov.norm_type)
            return
        if self.shards:   # (the redone step's gathers expected when it decides so)
            total = dp.total_norm(shard_norm(opt, self.shards, ov.norm_type), ov.norm_type,
                                  self.shards,
                                  lambda t: clip_coefficient(ov.max_grad_norm, t) != 1.0)
        else:
            grads = [p.grad for p in params if p.grad is not None]
            total = torch.nn.utils.get_total_norm(grads, ov.norm_type)
        ov.grad_norm = total
        coef = clip_coefficient(ov.max_grad_norm, total)
        if coef != 1.0:  # eager clipping changes the gradients: redo it all
            for saved in reversed(self.saved):
                saved.restore()
            with intra_op_threads(self.threads, self.caller_threads):
                if self.shards:   # eager's clip_grads_with_norm_, on each rank's pieces
                    torch._foreach_mul_([sh.grad for sh in self.shards], coef)
                    step_shards(opt, self.hyper, self.shards, ov.shard_state)
                else:
                    torch.nn.utils.clip_grads_with_norm_(params, ov.max_grad_norm, total)
                    step_view(opt, self.hyper, params)
            if self.shards:
                dp.publish(self.shards)
        self.saved.clear()

    def scaler_step(self) -> None:
        """``ScalerStep``: eager's ``scaler.step(optimizer)`` (its inf check, then the
        step unless a gradient is not finite)."""
        with intra_op_threads(self.threads, self.caller_threads):
            self.ov.scaler.step(self.ov.optimizer)

    def queue_update(self) -> None:
        """``QueueUpdate`` (``mode="async"``): this call's update, applied by the next
        call's ``AsyncUpdate`` (it keeps its own copy of the gradients)."""
        self.ov.queue(_Update(self.ov.optimizer, self.hyper))

    # -- end of call -------------------------------------------------------------------
    def scale_loss(self, loss_fn: Callable) -> Callable:
        scaler = self.ov.scaler
        if scaler is None or not scaler.is_enabled():
            return loss_fn
        def scaled(out: Any, label: Any) -> Any:
            value = loss_fn(out, label)
            if isinstance(value, tuple) and len(value) == 2:   # (sum, count)
                return scaler.scale(value[0]), value[1]
            return scaler.scale(value)
        return scaled

    def unscale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        scaler = self.ov.scaler
        if scaler is None or not scaler.is_enabled():
            return loss
        return loss / scaler.get_scale()   # a power of two: exact

    def finish(self) -> None:
        """The call succeeded: count it (``Overlapped.calls``, ``stepped``; for LR
        schedulers, the optimizer did step)."""
        self.ov.calls += 1
        self.ov.stepped = self.steps
        if self.steps:
            self.ov.optimizer._opt_called = True

    def failed(self, exc: BaseException) -> None:
        """The call failed: put back what was stepped, if backed up; else say what was."""
        if self.saved:
            for saved in reversed(self.saved):
                saved.restore(grads=True)
            self.saved.clear()
        elif self.stepped:
            spans = ", ".join(f"{r.start}-{r.stop - 1}"
                              for r in sorted(self.stepped, key=lambda r: r.start))
            what = ("parameters, optimizer state and .grad; each stage whole" if not self.shards
                    else "this rank's shard: its pieces of the parameters or of their fp32 "
                    "masters, and their optimizer state; the other ranks' pieces may not have "
                    "been gathered")
            exc.add_note(f"fxpipe: the streamed optimizer step had already updated layers {spans} "
                         f"({what}) when the call failed; fxpipe.optim.overlapped(opt, "
                         "atomic=True) puts them back")


# ----------------------------------------------------------------------------- mechanics

def _hyperparameters(opt: torch.optim.Optimizer) -> list[dict]:
    """Each param group's settings without its params, tensors copied."""
    return [{k: (v.clone() if isinstance(v, torch.Tensor) else v)
             for k, v in g.items() if k != "params"} for g in opt.param_groups]


def _in_optimizer(opt: torch.optim.Optimizer, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    ids = {id(p) for p in params}
    return [p for g in opt.param_groups for p in g["params"] if id(p) in ids]


class _Saved:
    """A copy of some parameters, their optimizer state and ``.grad``, to put back."""

    def __init__(self, opt: torch.optim.Optimizer, params: Sequence[torch.Tensor]):
        self.opt = opt
        self.entries = [(p, p.detach().clone(), _copy_state(opt.state.get(p)),
                         None if p.grad is None else p.grad.clone()) for p in params]

    def restore(self, grads: bool = False) -> None:
        with torch.no_grad():
            for p, value, state, grad in self.entries:
                p.copy_(value)
                if state is None:
                    self.opt.state.pop(p, None)
                else:   # a copy: a redone step changes it in place, a failure restores again
                    self.opt.state[p] = _copy_state(state)
                if grads:
                    p.grad = grad


class _SavedShards:
    """``shard_optimizer``: a copy of a stage's parameters (the all-gather rewrites them
    whole; ``data_parallel="zero3"``: of this rank's pieces only, the ones it writes into
    the parameters the ranks share), ``.grad``, this rank's fp32 masters of them and its
    shard state, to put back."""

    def __init__(self, ov: Overlapped, params: Sequence[torch.Tensor], shards: Sequence[Any],
                 pieces: bool = False):
        self.ov = ov
        self.entries = [(p, None if p.grad is None else p.grad.clone()) for p in params]
        views = [b.params[i].detach().view(-1)[lo:hi] for b in (sh.bucket for sh in shards)
                 for i, lo, hi, _ in b.pieces()] if pieces else [p.detach() for p in params]
        self.values = [(v, v.clone()) for v in views]
        self.masters = [(m, m.clone()) for sh in shards for m in sh.bucket.masters
                        if m is not None]
        self.names = {n for sh in shards for n in sh.bucket.names}
        self.state = {k: _copy_state(v) for k, v in ov.shard_state.items() if k in self.names}

    def restore(self, grads: bool = False) -> None:
        with torch.no_grad():
            for p, grad in self.entries:
                if grads:
                    p.grad = grad
            for v, value in self.values:
                v.copy_(value)
            for m, value in self.masters:
                m.copy_(value)
        for k in [k for k in self.ov.shard_state if k in self.names]:
            del self.ov.shard_state[k]
        self.ov.shard_state.update({k: _copy_state(v) for k, v in self.state.items()
                                    if v is not None})


def shard_items(ov: Overlapped, rank: int, world: int) -> dict[str, Any]:
    """``shard_optimizer``: this rank's part of a ``torch.distributed.checkpoint`` state
    dict: the param groups' settings (the same on every rank) and this rank's shard
    state, one flat key per tensor (``optim.rank{r}.{parameter name}.{state name}``)."""
    out: dict[str, Any] = {
        "optim.world": world,
        "optim.param_groups": [{k: v for k, v in g.items() if k != "params"}
                               for g in ov.optimizer.param_groups]}
    for param, state in ov.shard_state.items():
        for name, v in state.items():
            if not isinstance(v, torch.Tensor):
                raise NotImplementedError(f"shard_optimizer checkpoint: optimizer state {name!r} "
                                          f"is a {type(v).__name__}, not a tensor")
            out[f"optim.rank{rank}.{param}.{name}"] = v
    return out


def load_shard_items(ov: Overlapped, rank: int, items: dict[str, Any]) -> None:
    """Put back what :func:`shard_items` saved (``items`` as ``dcp.load`` filled them)."""
    for g, saved in zip(ov.optimizer.param_groups, items["optim.param_groups"]):
        g.update(saved)
    prefix = f"optim.rank{rank}."
    state: dict[str, dict] = {}
    for fqn, v in items.items():
        if fqn.startswith(prefix):
            param, _, name = fqn[len(prefix):].rpartition(".")
            state.setdefault(param, {})[name] = v
    ov.shard_state.clear()
    ov.shard_state.update(state)
    ov.sharded()


def _copy_state(state: dict | None) -> dict | None:
    if not state:
        return None
    return {k: (v.clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v))
            for k, v in state.items()}


class _Update:
    """``mode="async"``: one call's update, applied later (its own gradient copies)."""

    def __init__(self, opt: torch.optim.Optimizer, hyper: list[dict]):
        self.opt, self.hyper = opt, hyper
        self.grads = {p: p.grad.clone() for g in opt.param_groups for p in g["params"]
                      if p.grad is not None}

    def apply(self) -> None:
        """Step with the saved gradients; each ``.grad`` is put back as it was."""
        params = list(self.grads)
        before = [p.grad for p in params]
        try:
            for p in params:
                p.grad = self.grads[p]
            step_view(self.opt, self.hyper, params)
        finally:
            for p, g in zip(params, before):
                p.grad = g
