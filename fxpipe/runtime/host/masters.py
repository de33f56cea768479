"""The fp32 masters of ``shard_optimizer=True`` with ``param_dtype``: this rank's pieces
of each trainable floating parameter's master values, kept by name; the parameters
themselves become their ``param_dtype`` copies. ``DataParallel`` (``runtime.issue.distributed``)
is a ``ShardedMasters``: its sharded step updates the pieces and its all-gather writes
them, cast, into every rank's parameters.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from fxpipe.errors import warn_user
from fxpipe.runtime.host.buckets import _piece, _unique
from fxpipe.runtime.host.params import HostParams


# id -> (a parameter some rank's pipe steps itself, why): a step of an optimizer holding
# one is refused (fxpipe's own steps hold the masters' pieces instead)
_refused: dict[int, tuple[weakref.ref, str]] = {}
_hooked = threading.Lock()

_MASTERED = (
    "whose fp32 master fxpipe shards across the ranks (shard_optimizer=True or "
    "data_parallel='device', with param_dtype): the parameter is its {dtype} copy and this "
    "step cannot reach the masters. Let the pipe step it: pipe.forward_backward(..., "
    "optimizer=opt) (with fxpipe.optim.overlapped(opt, max_grad_norm=..., accumulate=...) "
    "for clipping and accumulation); or compile without param_dtype or with "
    "shard_optimizer=False to step with your own loop")


def refuse_outside_step(params: Iterable[torch.Tensor], why: str) -> None:
    """Refuse any optimizer's ``step()`` over ``params`` from now on (a global step
    pre-hook, registered once); ``why`` ends the message (``{dtype}``: the parameter's)."""
    for p in params:
        _refused[id(p)] = (weakref.ref(p, lambda _, i=id(p): _refused.pop(i, None)), why)
    with _hooked:
        if not getattr(_refuse_outside_step, "registered", False):
            register_optimizer_step_pre_hook(_refuse_outside_step)
            _refuse_outside_step.registered = True


def _refuse_outside_step(opt: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    """The global optimizer step pre-hook of :func:`refuse_outside_step`."""
    for g in opt.param_groups:
        for p in g["params"]:
            ref, why = _refused.get(id(p), (None, ""))
            if ref is not None and ref() is p:
                raise ValueError(f"{type(opt).__name__}.step() over a parameter "
                                 f"({tuple(p.shape)}, {p.dtype}) " + why.format(dtype=p.dtype))


class ShardedMasters:
    """This rank's pieces of the fp32 masters (``masters``, by name), their parameters,
    and each parameter's version when they last agreed. Needs ``rank``, ``world`` and
    ``_names`` (``id(parameter) -> name``) from the class that has it as a base."""

    rank: int
    world: int
    _names: dict[int, str]

    def __init__(self) -> None:
        self.masters: dict[str, torch.Tensor] = {}
        self._mastered: dict[str, torch.Tensor] = {}
        self._stamps: dict[str, tuple[int, int]] = {}
        self._host: HostParams | None = None

    def shard_masters(self, params: Mapping[str, torch.Tensor], dtype: torch.dtype,
                      host: HostParams) -> None:
        """``shard_optimizer`` with ``param_dtype``: keep the master values (the
        parameters' own dtype, fp32) of only this rank's piece of each trainable floating
        parameter (``masters``, by name); the parameter itself becomes its ``dtype`` copy,
        the one the devices upload (its ``grad_dtype`` stays the master's: gradients come
        back in fp32). The sharded step updates the masters; the all-gather writes them,
        cast, into every rank's parameters. Nothing is converted unless all can be."""
        todo = {n: p for n, p in _unique(params).items()
                if p.requires_grad and p.is_floating_point() and p.dtype != dtype}
        if not todo and host.masters is not None:   # an earlier pipe of the model sharded them
            self._adopt_masters(host)
            return
        for name, p in todo.items():
            if id(p) in host.slots:
                raise ValueError(
                    f"shard_optimizer=True with param_dtype={dtype} shards the fp32 masters of "
                    f"{name!r} and turns the parameters into {dtype} copies, but an earlier "
                    "pipe of this model already laid them out in its host buffers as they "
                    "were: compile a freshly built model (or one loaded again) with these "
                    "options")
        self._host = host
        with torch.no_grad():
            for name, p in todo.items():
                self._names.setdefault(id(p), name)
                lo, hi = _piece(p.numel(), self.world, self.rank)
                self.masters[name] = p.detach().reshape(-1)[lo:hi].clone()
                self._mastered[name] = p
                p.grad_dtype = p.dtype
                p.data = p.detach().to(dtype)
        refuse_outside_step(todo.values(), _MASTERED)
        self.stamp(self.masters)
        # every pipe of the model keeps these (the HF Trainer compiles one per input shape)
        host.masters = (self.rank, self.world, self.masters, self._mastered, self._stamps,
                        {id(p): n for n, p in self._mastered.items()})

    def _adopt_masters(self, host: HostParams) -> None:
        """The masters an earlier pipe of the model sharded (``host.masters``): the same
        pieces, parameters and stamps, if the ranks are the same."""
        rank, world, masters, mastered, stamps, names = host.masters
        if (rank, world) != (self.rank, self.world):
            raise ValueError(
                f"an earlier pipe of this model sharded its fp32 masters as rank {rank} of "
                f"{world}; this pipe is rank {self.rank} of {self.world}: compile every "
                "data-parallel pipe of a model over the same ranks")
        self._host = host
        self.masters, self._mastered, self._stamps = masters, mastered, stamps
        for key, name in names.items():
            self._names.setdefault(key, name)

    def stamp(self, names: Sequence[str] | Mapping[str, Any]) -> None:
        """The masters of ``names`` and their parameters agree now."""
        for n in names:
            if n in self._mastered:
                p = self._mastered[n]
                self._stamps[n] = (p._version, p.data_ptr())

    def _changed(self, n: str, p: torch.Tensor) -> bool:
        """Whether ``p`` was written (in place: its version) or replaced (``p.data = t``:
        its memory, other than where the host buffers put it) since its stamp."""
        version, ptr = self._stamps[n]
        slot = self._host.slots.get(id(p)) if self._host is not None else None
        if slot is not None and slot.region is not None:
            ptr = self._host.address(slot)
        return p._version != version or p.data_ptr() != ptr

    def check_masters(self) -> None:
        """Before a training call, a checkpoint or gathering the masters: a parameter
        changed outside fxpipe (an in-place write, ``p.data = t``,
        ``model.load_state_dict``) since its master was last written gets its master
        re-read from the parameter, with a warning (below ``param_dtype``'s precision it
        is lost: load fp32 weights with ``pipe.load_state_dict`` instead)."""
        changed = [n for n, p in self._mastered.items() if self._changed(n, p)]
        if not changed:
            return
        warn_user(
            f"rank {self.rank}: {len(changed)} parameter(s) ({', '.join(changed[:3])}"
            f"{', ...' if len(changed) > 3 else ''}) changed outside fxpipe since the last "
            "step; under shard_optimizer=True with param_dtype their fp32 masters are "
            "sharded, so they are re-read from the parameters' own dtype (the precision "
            "below it is lost). Load fp32 weights with pipe.load_state_dict(...) or "
            "pipe.load_checkpoint(...), which set the masters too; change the parameters "
            "the same way on every rank")
        self.set_masters({n: self._mastered[n] for n in changed}, params=False)

    def set_masters(self, values: Mapping[str, torch.Tensor], params: bool = True) -> None:
        """This rank's pieces of the masters := ``values`` (by name, whole tensors), and
        (``params``) the parameters too, cast."""
        with torch.no_grad():
            for n, v in values.items():
                p = self._mastered[n]
                lo, hi = _piece(p.numel(), self.world, self.rank)
                self.masters[n].copy_(v.detach().reshape(-1)[lo:hi])
                if params:
                    p.copy_(v)
        self.stamp(list(values))

    def set_pieces(self, pieces: Mapping[str, torch.Tensor]) -> None:
        """This rank's pieces of the masters := ``pieces`` (by name, as a checkpoint holds
        them), every non-empty one; the parameters hold them already."""
        missing = [n for n, m in self.masters.items() if m.numel() and n not in pieces]
        if missing:
            raise ValueError(f"the checkpoint has no fp32 master of {', '.join(missing[:3])}"
                             f"{', ...' if len(missing) > 3 else ''} for rank {self.rank}: it "
                             "was saved from another model")
        with torch.no_grad():
            for n, m in self.masters.items():
                if m.numel():
                    m.copy_(pieces[n])
        self.stamp(self.masters)

    def master_keys(self, state: Mapping[str, torch.Tensor]) -> dict[str, str]:
        """``key -> master name`` of the entries of ``state`` (a module's
        ``state_dict(keep_vars=True)``: its own tensors) that are sharded-master parameters
        (a tied one under each of its keys)."""
        name_of = {id(p): n for n, p in self._mastered.items()}
        return {k: name_of[id(t)] for k, t in state.items() if id(t) in name_of}
