"""Gradient accumulation over one call: :class:`GradAccumulator` sums the host gradients
the stages download and adds them to the parameters' ``.grad`` all at once (the
``Commit``, or a streamed ``OptimizerStep``), or drops them (a failed call); and which
stage owns which parameters' final gradients (:func:`owned_params`).
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Mapping, Sequence

import torch

from fxpipe.runtime.host.param_store import ParamStore
from fxpipe.runtime.host.params import _Slot, grad_dtype


def owned_params(program, lg) -> dict[int, list[torch.Tensor]]:
    """Per backward stage of ``program``, the trainable parameters it owns
    (``StageSpec.owns``, computed once by ``build_executable``): those whose gradients
    are final once its gradients are downloaded, which its ``OptimizerStep`` steps and
    its ``AllReduce`` reduces (a tied parameter goes with the last stage holding it)."""
    return {st.index: [lg.params[f] for f in st.owns] for st in program.stages if st.owns}


class GradAccumulator:
    """Sums host gradients over one call, then adds them to ``.grad`` all at once.

    Tied parameters (one tensor in several stages) sum. ``commit`` sets a ``.grad`` that
    is None (to its view of the flat gradient buffer, where the download put it) or adds
    into an existing one, as autograd does; ``discard`` drops everything (a failed call:
    no ``.grad`` changes). Thread-safe. Give it gradients only once their copies have
    landed (after the event of the work that downloaded them).

    Data parallel: ``replace`` puts in a parameter's final ``.grad`` (its gradients
    averaged across ranks, the ``.grad`` it had included), which ``commit`` writes in place
    of the old one instead of adding to it.

    >>> from fxpipe.runtime.host.params import HostParams
    >>> p = torch.nn.Parameter(torch.zeros(2))
    >>> store = ParamStore(HostParams.of(torch.nn.ParameterList([p]), pin=False),
    ...                    {0: {"p": p}, 1: {"p": p}})
    >>> acc = GradAccumulator(store)
    >>> acc.add(0, {"p": torch.ones(2)}); acc.add(1, {"p": torch.ones(2)})
    >>> acc.commit(); p.grad
    tensor([2., 2.])
    """

    def __init__(self, store: ParamStore):
        self._store = store
        self._lock = threading.Lock()
        self._sums: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(master) -> (master, sum)
        self._claimed: dict[int, torch.Tensor] = {}  # id(master) -> its flat gradient view
        self._replace: set[int] = set()   # id(master): the sum is the final .grad

    def claim(self, slot: _Slot) -> torch.Tensor | None:
        """Where this call's download of ``slot``'s gradient goes directly (once per
        parameter per call), or None (``HostParams.claim_grad``)."""
        with self._lock:
            if id(slot.tensor) in self._claimed:
                return None
            return self._claim(slot)

    def _claim(self, slot: _Slot) -> torch.Tensor | None:
        """``HostParams.claim_grad(slot)``, remembered (hold ``_lock``)."""
        view = self._store.host.claim_grad(slot)
        if view is not None:
            self._claimed[id(slot.tensor)] = view
        return view

    def add(self, stage: int, host_grads: Mapping[str, torch.Tensor], *, own: bool = False) -> None:
        """Add ``{fqn: host gradient}`` of ``stage`` (e.g. from ``download_grads``).

        ``own``: the tensors are the accumulator's to keep (fresh from ``download_grads``):
        a flat-buffer view it claimed, or one laid out like its parameter in its grad
        dtype, becomes the sum itself instead of being copied. A gradient in another
        dtype (bf16 downloaded for fp32 masters) is widened into the parameter's flat
        gradient view where it can have one, else into a new tensor: the sum is in the
        grad dtype from the first gradient on."""
        with self._lock, torch.no_grad():
            for fqn, g in host_grads.items():
                slot = self._store._slot(stage, fqn)
                master = slot.tensor
                if g.shape != master.shape:
                    raise ValueError(f"stage {stage}: gradient of {fqn!r} has shape {tuple(g.shape)}, "
                                     f"the parameter {tuple(master.shape)}")
                claimed = self._claimed.get(id(master))
                mine = claimed is not None and g.data_ptr() == claimed.data_ptr()
                if id(master) in self._sums:
                    total = self._sums[id(master)][1]
                    if mine:   # the flat view holds the sum: add what came before into it
                        g.add_(total)
                        self._sums[id(master)] = (master, g)
                    else:
                        total.add_(g)
                    continue
                dtype = grad_dtype(master)
                if not (own and g.dtype == dtype and g.stride() == master.stride()):
                    into = self._claim(slot) if claimed is None and g.dtype != dtype else None
                    g = (into if into is not None else
                         torch.empty_like(master, dtype=dtype)).copy_(g)
                self._sums[id(master)] = (master, g)  # the accumulator's own tensor now

    def sums(self, params: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
        """This call's gradient sum of each of ``params`` so far (None: none came)."""
        with self._lock:
            return [self._sums[id(p)][1] if id(p) in self._sums else None for p in params]

    def replace(self, master: torch.Tensor, value: torch.Tensor) -> None:
        """``value`` is ``master``'s final ``.grad`` (what the commit writes instead of adding
        this call's sum). Copied into its flat gradient view when it can have one, else
        kept as it is."""
        with self._lock, torch.no_grad():
            slot = self._store.host.slots.get(id(master))
            claimed = self._claimed.get(id(master))
            if claimed is None and slot is not None:
                claimed = self._claim(slot)
            if claimed is not None:
                value = claimed.copy_(value)
            self._sums[id(master)] = (master, value)
            self._replace.add(id(master))

    def final(self, params: Sequence[torch.Tensor]) -> None:
        """The sums to come of ``params`` are their final ``.grad`` (each includes the
        ``.grad`` it had: ``data_parallel="device"``'s ``sAR+``), which ``commit`` writes in
        place of the old one, as for :meth:`replace`."""
        with self._lock:
            self._replace.update(id(p) for p in params)

    def drop(self, params: Sequence[torch.Tensor]) -> None:
        """Forget ``params``' sums (consumed by a sharded optimizer step)."""
        with self._lock:
            for p in params:
                self._sums.pop(id(p), None)

    def commit(self, params: Collection[torch.Tensor] | None = None) -> None:
        """Add the sums into the parameters' ``.grad`` (of ``params`` only, when given: a
        streamed optimizer step commits a stage's as soon as they are final); checks
        everything before writing any."""
        with self._lock, torch.no_grad():
            keys = list(self._sums) if params is None else \
                [id(p) for p in params if id(p) in self._sums]
            for key in keys:
                master, total = self._sums[key]
                grad = master.grad
                if grad is not None and (grad.shape != total.shape
                                         or not torch.can_cast(total.dtype, grad.dtype)):
                    raise RuntimeError(f"a parameter of shape {tuple(master.shape)} has a .grad of "
                                       f"{tuple(grad.shape)} {grad.dtype}; nothing was written")
            for key in keys:
                master, total = self._sums.pop(key)
                if master.grad is None:
                    master.grad = total
                    claimed = self._claimed.get(key)
                    if claimed is not None and total.data_ptr() == claimed.data_ptr():
                        self._store.host.exposed(master, master.grad)
                elif key in self._replace:
                    master.grad.copy_(total)
                else:
                    master.grad.add_(total)

    def totals(self) -> dict[int, torch.Tensor]:
        """The sums so far, by ``id`` of the parameter, handed to autograd instead of
        committed (flat-buffer views among them count as handed out: a later call writes
        there again only once nobody holds them). Autograd adds them to ``.grad``: for a
        ``replace``d one that has a ``.grad``, the difference is handed out."""
        with self._lock, torch.no_grad():
            out = {}
            for key, (master, total) in self._sums.items():
                claimed = self._claimed.get(key)
                if claimed is not None and total.data_ptr() == claimed.data_ptr():
                    self._store.host.exposed(master, total)
                if key in self._replace and master.grad is not None:
                    total = total - master.grad
                out[key] = total
            return out

    def discard(self) -> None:
        """Drop the sums; no ``.grad`` changes."""
        with self._lock:
            self._sums.clear()
            self._claimed.clear()
            self._replace.clear()

    def __len__(self) -> int:
        return len(self._sums)
