"""Data parallel across processes: the collectives of a Program's host lane.

``fxpipe.compile(model, ..., data_parallel=True)`` on every rank of a ``torch.distributed``
job: each rank runs its own pipeline on its share of the batch, and the host lane of
each training call's Program holds the collectives (``passes.program``): ``BC``
broadcasts the buffers from rank 0, ``AR4:6`` averages the gradients of the parameters
``S4:6`` steps (one bucket per backward stage, reduced as soon as that stage's
gradients are downloaded, while the devices back-propagate the shallower stages), and
with ``shard_optimizer=True`` ``RS4:6`` / ``AG4:6`` reduce-scatter the bucket and
gather the stepped shards back. :class:`DataParallel` runs them on host tensors, with
``torch.distributed`` (gloo).

What is sharded: each parameter is cut in N equal pieces whatever the plan (rank ``r``
owns ``[r*c, (r+1)*c)``, ``c = ceil(numel / N)``; a bucket lays them out as N chunks,
one per rank), so the optimizer state of a piece, kept by parameter name, serves every
plan. With ``param_dtype`` the fp32 masters are sharded the same way
(:meth:`DataParallel.shard_masters`): the parameters become their ``param_dtype``
copies, the sharded step updates this rank's fp32 pieces and the all-gather writes
them, cast, into every rank's parameters.

What is averaged, exactly as ``DistributedDataParallel`` does: the bucket holds each
parameter's ``.grad`` plus this call's gradient (DDP reduces the accumulated ``.grad``),
divided by the number of ranks, then summed across ranks; the result becomes the new
``.grad`` at the commit. Nothing reaches ``.grad`` before the call's ``Commit`` (or a
streamed ``OptimizerStep``): a call that fails on any rank leaves ``.grad`` as it was
on every rank. A parameter that gets no gradient on a rank counts as zero there.

Failures: the collectives run on a process group fxpipe makes over the ranks of the
user's (gloo, ``timeout`` seconds). A rank whose training call fails writes which rank
and why into the group's store, then completes the collectives of the call it still
owes the other ranks with zeros (``drain``: gloo cannot cancel a posted collective);
every rank checks the store after each collective, so the others raise
:class:`fxpipe.errors.DistributedError` naming the rank that failed first as soon as
their pending collective completes, drain too, and no ``Commit`` runs anywhere: ``.grad`` and buffers stay as
they were on every rank (parameters too, without a streamed optimizer or with
``overlapped(opt, atomic=True)``). A rank that stops answering or dies fails the others
at the timeout. The pipe cannot train again afterwards: restart every rank
(``torchrun`` does) and resume from a checkpoint. A rank failing after its last
collective of a call (in the shallowest stage's optimizer step, or the commit) fails
alone.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from fxpipe.errors import DistributedError, warn_user
from fxpipe.runtime.devices import VirtualDevice
from fxpipe.runtime.params import (GradAccumulator, HostParams, ParamStore, _grad_dtype,
                                   owned_params)

ORIGIN = "fxpipe/failed"   # store key: "<rank>: <what failed>", set by the first rank to fail


@dataclass
class Bucket:
    """One backward stage's parameters of one gradient dtype as one flat tensor of
    ``parts`` equal chunks (``parts``: the number of ranks when sharding, else 1), a
    reduce-scatter giving each rank one chunk. Each parameter is cut the same way
    whatever the plan: rank ``r`` owns its elements ``[r * c, (r + 1) * c)``, ``c =
    chunks[i] = ceil(numel / parts)``, which sit at ``offsets[i]`` of chunk ``r`` (zero
    padded). ``names`` are the parameters' names (the same on every rank: they key the
    optimizer state and the fp32 masters of this rank's pieces, ``masters[i]``, None where
    the parameters are their own masters)."""

    layers: range | None             # None: not a stage's (DataParallel.full_masters)
    dtype: torch.dtype
    params: list[torch.Tensor]
    names: list[str]
    sizes: list[int]
    chunks: list[int]
    offsets: list[int]
    parts: int
    rank: int
    masters: list[torch.Tensor | None]

    @property
    def shard_len(self) -> int:
        """The length of one rank's chunk."""
        return sum(self.chunks)

    @property
    def padded(self) -> int:
        return self.parts * self.shard_len

    def pieces(self) -> list[tuple[int, int, int, int]]:
        """``(index, start in param, stop in param, start in shard)`` of each parameter
        that has elements in this rank's chunk."""
        out = []
        for i, (n, o) in enumerate(zip(self.sizes, self.offsets)):
            lo, hi = _piece(n, self.parts, self.rank)
            if lo < hi:
                out.append((i, lo, hi, o))
        return out

    def columns(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        """Parameter ``i``'s ``[parts, chunk]`` elements in a flat bucket tensor."""
        o = self.offsets[i]
        return flat.view(self.parts, self.shard_len)[:, o:o + self.chunks[i]]

    def pack(self, flat: torch.Tensor, i: int, *values: torch.Tensor | None) -> None:
        """Parameter ``i``'s place in ``flat`` := the sum of ``values`` (None: skipped;
        none at all: zeros), its padding zeros."""
        cols, n = self.columns(flat, i), self.sizes[i]
        values = [v.reshape(-1) for v in values if v is not None]
        if not values:
            cols.zero_()
            return
        c = cols.shape[1]
        k = n // c if c else 0          # full rows
        cols[k:].zero_()
        for j, v in enumerate(values):
            body = v[:k * c].view(k, c)
            cols[:k].copy_(body) if j == 0 else cols[:k].add_(body)
            if k * c < n:
                row = cols[k, :n - k * c]
                row.copy_(v[k * c:]) if j == 0 else row.add_(v[k * c:])

    def unpack(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        """Parameter ``i``'s value from ``flat`` (a view when ``parts == 1``)."""
        return self.columns(flat, i).reshape(-1)[:self.sizes[i]].view(self.params[i].shape)


@dataclass
class Shard:
    """This rank's part of a bucket in a sharded step: the averaged gradient of its 1/N
    (``grad``); the step updates those elements in place (the fp32 masters of them where
    this rank keeps them, else the parameters'), the all-gather sends them to every
    rank."""

    bucket: Bucket
    grad: torch.Tensor


class DataParallel:
    """The collectives of one data-parallel pipe (module docstring). Made by
    ``fxpipe.compile`` on every rank of ``process_group`` (None: the default group)."""

    def __init__(self, process_group: Any = None, *, timeout: float = 300.0,
                 shard: bool = False, broadcast: bool = True):
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "fxpipe.compile(..., data_parallel=True) needs torch.distributed initialized "
                "on every rank first: torch.distributed.init_process_group('gloo') (torchrun "
                "sets the rank, world size and address in the environment); see the README, "
                "'Several machines'")
        if not timeout > 0:
            raise ValueError(f"collective_timeout must be > 0 seconds, got {timeout!r}")
        parent = process_group if process_group is not None else dist.group.WORLD
        ranks = dist.get_process_group_ranks(parent)
        self.rank = dist.get_rank(parent)
        self.world = len(ranks)
        self.timeout = float(timeout)
        self.shard = shard            # shard_optimizer
        self.broadcast = broadcast    # broadcast_buffers
        # fxpipe's own group: host tensors (gloo) whatever the user's backend, our timeout,
        # and our store key for failures, without touching the user's group
        self.group = dist.new_group(ranks, backend="gloo",
                                    timeout=datetime.timedelta(seconds=self.timeout),
                                    use_local_synchronization=process_group is not None)
        self.store = dist.distributed_c10d._get_process_group_store(self.group)
        self.dead: DistributedError | None = None
        self._lock = threading.Lock()
        self._worker: VirtualDevice | None = None
        # under _lock: built by whichever thread first asks (the caller's plan_ops, the
        # collective worker's reduces)
        self._buckets: dict[int, tuple[ParamStore, dict[tuple[int, int], list[Bucket]]]] = {}
        # under _posting: begin (the call's host thread), _post (the collective worker) and
        # drain (the failing thread) post in the Program's order; held while a collective
        # is issued, not while it is waited for
        self._posting = threading.Lock()
        self._ops: list[tuple[str, int, torch.dtype]] = []   # this call's collectives
        self._posted = 0                                      # how many were posted
        # shard_optimizer with param_dtype (shard_masters): this rank's pieces of the fp32
        # masters, their parameters, and each parameter's version when they last agreed
        self.masters: dict[str, torch.Tensor] = {}
        self._mastered: dict[str, torch.Tensor] = {}
        self._stamps: dict[str, tuple[int, int]] = {}
        self._host: HostParams | None = None
        # id(parameter) -> its name for the shard state and masters: the first name it had
        # in the first layer graph that named it (another capture may order tied names
        # differently)
        self._names: dict[int, str] = {}

    def collectives(self, run_type: str, sync: bool, mode: str | None,
                    has_buffers: bool) -> tuple[str | None, bool]:
        """``(data_parallel, broadcast_buffers)`` of a call's Program (what ``pipe.program()``
        prints and the call runs): a training call that synchronizes gradients all-reduces
        them (``"allreduce"``), or reduce-scatters them when it steps a sharded optimizer
        (``mode="exact"``: the streamed step; None: no step), and first broadcasts the
        buffers from rank 0 (when the model ``has_buffers`` and ``broadcast_buffers=True``).
        Anything else: ``(None, False)``."""
        if run_type == "infer" or not sync:
            return None, False
        if self.shard and mode not in (None, "exact"):
            raise NotImplementedError(f"shard_optimizer=True steps with the streamed exact "
                                      f"step only, not optimizer={mode!r}")
        return ("shard" if self.shard and mode == "exact" else "allreduce",
                self.broadcast and has_buffers)

    # -- compile time ----------------------------------------------------------------------
    def check_same(self, what: Mapping[str, Any]) -> None:
        """Raise ``ValueError`` on every rank unless every rank passes equal ``what`` (the
        plan, the parameters' names, shapes and dtypes...), naming the first difference."""
        gathered: list[Any] = [None] * self.world
        try:
            dist.all_gather_object(gathered, dict(what), group=self.group)
        except Exception as e:  # noqa: BLE001 — e.g. a rank that never compiled: timeout
            raise DistributedError(
                f"rank {self.rank}: comparing the compiled pipeline with the other ranks failed "
                f"({type(e).__name__}: {e}); every rank must call fxpipe.compile(..., "
                "data_parallel=True) for the same model") from e
        mine = gathered[self.rank]
        for r, theirs in enumerate(gathered):
            for k in mine:
                if theirs.get(k) != mine[k]:
                    raise ValueError(
                        f"fxpipe.compile(data_parallel=True): ranks differ in {k}: rank "
                        f"{self.rank} has {_first_difference(mine[k], theirs.get(k), r)}. Every "
                        "rank must compile the same model with the same plan: pass the same "
                        "plan=fxpipe.ExecutePlan(...) on every rank (ExecutePlan.auto may choose "
                        "differently where ranks have other devices), and build the model the "
                        "same way everywhere")

    # -- running -----------------------------------------------------------------------------
    @property
    def worker(self) -> VirtualDevice:
        """The host thread the collective stream of the host lane runs on."""
        with self._lock:
            if self._worker is None:
                self._worker = VirtualDevice(name=f"host-collectives-r{self.rank}",
                                             count_work=False)
            return self._worker

    def check_alive(self) -> None:
        """Raise if an earlier call failed (this process group cannot be used again)."""
        if self.dead is not None:
            raise DistributedError(
                f"rank {self.rank}: an earlier data-parallel call failed ({self.dead}); fxpipe's "
                "process group cannot be used again: restart every rank and resume from a "
                "checkpoint", rank=self.dead.rank)

    def fail(self, exc: BaseException) -> None:
        """This rank's call failed: say so in the store (unless another rank failed first
        and caused it), so that every rank's pending and later collective fails now.
        Idempotent."""
        with self._lock:
            if self.dead is not None:
                return
            origin = exc.rank if isinstance(exc, DistributedError) else self.rank
            self.dead = DistributedError(f"{type(exc).__name__}: {exc}", rank=origin)
        if not isinstance(exc, DistributedError):
            try:
                self.store.compare_set(ORIGIN, "", f"{self.rank}: {type(exc).__name__}: {exc}")
            except Exception:  # noqa: BLE001 — the store is gone: the others time out
                pass
        # the other ranks see it in the store once their next collective completes (this
        # rank's drain completes it); the group is not destroyed: destroying it under a
        # collective pending on gloo's threads aborts the process

    # -- posting collectives: every rank posts the same ops in the same order -------------
    def begin(self, ops: Sequence[tuple[str, int, torch.dtype]]) -> None:
        """A call starts: ``ops`` (kind, numel, dtype) are the collectives it will post,
        in order (:meth:`plan_ops`), what :meth:`drain` completes when it fails."""
        with self._posting:
            self._ops, self._posted = list(ops), 0

    def _post(self, kind: str, tensor: torch.Tensor, what: str,
              out: torch.Tensor | None = None) -> None:
        """Post the call's next collective and wait for it; then raise ``DistributedError``
        if another rank reported a failure in the store (a failed rank says so first, then
        completes the collectives it owes with zeros: :meth:`drain`)."""
        with self._posting:
            if self._posted < len(self._ops) and self._ops[self._posted][0] != kind:
                raise RuntimeError(f"rank {self.rank}: collective {self._posted} of the call "
                                   f"is {kind}, the Program said {self._ops[self._posted][0]}")
            work = _issue(kind, tensor, out, self.group)
            self._posted += 1
        cause: Exception | None = None
        try:
            work.wait()
        except Exception as e:  # noqa: BLE001
            cause = e
        rank, why = self._origin() if cause is not None else self._origin(patience=0)
        if rank is not None:
            raise DistributedError(
                f"rank {self.rank}: the {what} failed because rank {rank} failed: {why}",
                rank=rank) from cause
        if cause is not None:
            raise DistributedError(
                f"rank {self.rank}: the {what} failed ({type(cause).__name__}: {cause}); no "
                f"rank reported a failure: one may have stopped answering (timeout "
                f"{self.timeout:g} s) or died") from cause

    def drain(self) -> None:
        """The call failed on this rank (its own failure or another's): complete every
        collective it still owes the other ranks, with zeros, so that no rank waits for
        it (gloo cannot cancel a posted collective). Bounded by the timeout."""
        while True:
            with self._posting:
                if self._posted >= len(self._ops):
                    return
                kind, numel, dtype = self._ops[self._posted]
                out = torch.zeros(numel * self.world if kind == "all_gather" else
                                  numel // self.world, dtype=dtype) \
                    if kind in ("all_gather", "reduce_scatter") else None
                self._posted += 1
                try:
                    work = _issue(kind, torch.zeros(numel, dtype=dtype), out, self.group)
                except Exception:  # noqa: BLE001
                    return
            try:
                work.wait()
            except Exception:  # noqa: BLE001
                return

    def plan_ops(self, actions: Sequence[Any], exe: Any, lg: Any, store: ParamStore
                 ) -> list[tuple[str, int, torch.dtype]]:
        """The collectives (kind, numel, dtype) the host ``actions`` post, in order."""
        from fxpipe.passes.program import AllGather, AllReduce, BroadcastBuffers, ReduceScatter
        reduces = any(isinstance(a, (AllReduce, ReduceScatter, AllGather)) for a in actions)
        buckets = self.buckets(exe, lg, store) if reduces else {}
        ops: list[tuple[str, int, torch.dtype]] = []
        for a in actions:
            match a:
                case BroadcastBuffers():
                    for dtype, tensors in _by_dtype(lg.buffers).items():
                        ops.append(("broadcast", sum(t.numel() for t in tensors), dtype))
                case AllReduce(layers=r):
                    ops += [("all_reduce", b.padded, b.dtype) for b in buckets.get(_span(r), [])]
                case ReduceScatter(layers=r):
                    ops += [("reduce_scatter", b.padded, b.dtype)
                            for b in buckets.get(_span(r), [])]
                case AllGather(layers=r):
                    ops += [("all_gather", b.shard_len, b.params[0].dtype)
                            for b in buckets.get(_span(r), [])]
        return ops

    def _origin(self, patience: float = 2.0) -> tuple[int | None, str]:
        """The rank that failed first and why, from the store (it writes before it drains,
        so a short wait suffices after a collective failed)."""
        deadline = time.monotonic() + patience
        while True:
            try:
                if self.store.check([ORIGIN]):
                    text = self.store.get(ORIGIN).decode(errors="replace")
                    rank, _, why = text.partition(": ")
                    return int(rank), why
            except Exception:  # noqa: BLE001 — the store is unreachable
                return None, ""
            if time.monotonic() >= deadline:
                return None, ""
            time.sleep(0.05)

    # -- buckets -------------------------------------------------------------------------
    def buckets(self, exe: Any, lg: Any, store: ParamStore) -> dict[tuple[int, int], list[Bucket]]:
        """Per backward stage's layers, its buckets (one per gradient and parameter
        dtype), in the same order on every rank: the parameters it owns (``StageSpec.owns``)
        in the order of the
        host buffers (one set per ``store``: per run type)."""
        key = id(store)
        with self._lock:
            return self._buckets_of(key, exe, lg, store)

    def _buckets_of(self, key: int, exe: Any, lg: Any, store: ParamStore
                    ) -> dict[tuple[int, int], list[Bucket]]:
        if key not in self._buckets:
            host = store.host
            names = {i: self._names.setdefault(i, n) for i, n in first_names(lg.params).items()}

            def order(p: torch.Tensor) -> tuple:   # host buffer order, then by name
                slot = host.slots.get(id(p))
                if slot is None or slot.region is None:
                    return (1, 0, 0, names[id(p)])
                return (0, slot.region, slot.offset, "")

            out: dict[tuple[int, int], list[Bucket]] = {}
            for s, params in owned_params(exe.program, lg).items():
                layers = exe.program.stages[s].layers
                by_dtype: dict[tuple[torch.dtype, torch.dtype], list[torch.Tensor]] = {}
                for p in sorted(params, key=order):
                    by_dtype.setdefault((_grad_dtype(p), p.dtype), []).append(p)
                out[(layers.start, layers.stop)] = [
                    self._bucket(layers, dtype, [(names[id(p)], p) for p in ps])
                    for dtype, ps in by_dtype.items()]
            self._buckets[key] = (store, out)   # the store kept: its id stays its own
        return self._buckets[key][1]

    def _bucket(self, layers: range | None, dtypes: tuple[torch.dtype, torch.dtype],
                named: Sequence[tuple[str, torch.Tensor]], parts: int | None = None) -> Bucket:
        """A bucket of ``named`` parameters; ``parts``: the number of ranks when sharding
        (the default under ``shard_optimizer``), else 1."""
        parts = parts or (self.world if self.shard else 1)
        sizes = [p.numel() for _, p in named]
        chunks = [_chunk(n, parts) for n in sizes]
        offsets = [sum(chunks[:i]) for i in range(len(chunks))]
        return Bucket(layers, dtypes[0], [p for _, p in named], [n for n, _ in named], sizes,
                      chunks, offsets, parts, self.rank,
                      [self.masters.get(n) if parts == self.world else None for n, _ in named])

    def _pack(self, bucket: Bucket, acc: GradAccumulator) -> torch.Tensor:
        """The bucket's flat gradient: per parameter its ``.grad`` plus this call's sum,
        divided by the number of ranks (DDP's order: divide, then sum across ranks)."""
        flat = torch.empty(bucket.padded, dtype=bucket.dtype)
        with torch.no_grad():
            for i, (p, new) in enumerate(zip(bucket.params, acc.sums(bucket.params))):
                bucket.pack(flat, i, new, p.grad)
            flat.div_(self.world)
        return flat

    # -- the collectives ---------------------------------------------------------------------
    def broadcast_buffers(self, store: ParamStore, buffers: Mapping[str, torch.Tensor]) -> None:
        """``BroadcastBuffers``: rank 0's buffers into every rank's (one flat tensor per
        dtype), then the upload copies refreshed."""
        for dtype, tensors in _by_dtype(buffers).items():
            flat = torch.cat([t.detach().reshape(-1) for t in tensors])
            self._post("broadcast", flat, "broadcast of the buffers")
            if self.rank != 0:
                with torch.no_grad():
                    n = 0
                    for t in tensors:
                        t.copy_(flat[n:n + t.numel()].view_as(t))
                        n += t.numel()
        if self.rank != 0:
            store.refresh()   # the copies devices upload from (param_dtype) see the new values

    def all_reduce(self, buckets: Sequence[Bucket], acc: GradAccumulator) -> None:
        """``AllReduce``: each bucket averaged across ranks, the result each parameter's
        new ``.grad`` (``GradAccumulator.replace``)."""
        for b in buckets:
            flat = self._pack(b, acc)
            self._post("all_reduce", flat,
                       f"all-reduce of layers {b.layers.start}-{b.layers.stop - 1}")
            for i, p in enumerate(b.params):
                acc.replace(p, b.unpack(flat, i))

    def reduce_scatter(self, buckets: Sequence[Bucket], acc: GradAccumulator) -> list[Shard]:
        """``ReduceScatter``: each bucket's average, this rank's shard of it only."""
        shards = []
        for b in buckets:
            flat = self._pack(b, acc)
            grad = torch.empty(b.shard_len, dtype=b.dtype)
            self._post("reduce_scatter", flat,
                       f"reduce-scatter of layers {b.layers.start}-{b.layers.stop - 1}", grad)
            acc.drop(b.params)   # consumed by the sharded step
            shards.append(Shard(b, grad))
        return shards

    def all_gather(self, shards: Sequence[Shard]) -> None:
        """``AllGather``: every rank's stepped shard into every rank's parameters (from
        the fp32 masters, cast, where this rank keeps them)."""
        for sh in shards:
            b = sh.bucket
            full = self._gather(b, b.params[0].dtype,
                                f"all-gather of layers {b.layers.start}-{b.layers.stop - 1}")
            with torch.no_grad():
                for i, p in enumerate(b.params):
                    p.view(-1).copy_(b.unpack(full, i).reshape(-1))
            self.stamp(b.names)

    def _gather(self, b: Bucket, dtype: torch.dtype, what: str, post: bool = True) -> torch.Tensor:
        """All-gather ``b`` in ``dtype``: every rank's chunk, from its masters where it
        keeps them (cast), else from the parameters."""
        mine = torch.zeros(b.shard_len, dtype=dtype)
        with torch.no_grad():
            for i, lo, hi, at in b.pieces():
                m = b.masters[i]
                if m is None:
                    m = b.params[i].detach().view(-1)[lo:hi]
                mine[at:at + hi - lo].copy_(m)
        full = torch.empty(b.padded, dtype=dtype)
        if post:
            self._post("all_gather", mine, what, full)
        else:   # outside a call: no failure protocol to follow
            _issue("all_gather", mine, full, self.group).wait()
        return full

    # -- fp32 masters (shard_optimizer with param_dtype) -------------------------------------
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
        self.stamp(self.masters)

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

    def full_masters(self) -> dict[str, torch.Tensor]:
        """Every sharded master whole, gathered from every rank (a collective: every rank
        calls it, between training calls), by name."""
        self.check_alive()
        self.check_masters()
        out: dict[str, torch.Tensor] = {}
        by_dtype: dict[torch.dtype, list[tuple[str, torch.Tensor]]] = {}
        for n, p in self._mastered.items():
            by_dtype.setdefault(self.masters[n].dtype, []).append((n, p))
        for dtype, named in by_dtype.items():
            b = self._bucket(None, (dtype, dtype), named, parts=self.world)
            full = self._gather(b, dtype, "all-gather of the masters", post=False)
            for i, (n, p) in enumerate(named):
                out[n] = b.unpack(full, i).clone()
        return out

    def close(self) -> None:
        if self._worker is not None:
            self._worker.close()
            self._worker = None


def _issue(kind: str, tensor: torch.Tensor, out: torch.Tensor | None, group: Any) -> Any:
    """Post one collective on ``group``: ``broadcast`` (from rank 0) and ``all_reduce``
    (sum) in place, ``reduce_scatter`` (sum) and ``all_gather`` into ``out``."""
    if kind == "broadcast":
        return dist.broadcast(tensor, group=group, group_src=0, async_op=True)
    if kind == "all_reduce":
        return dist.all_reduce(tensor, group=group, async_op=True)
    if kind == "reduce_scatter":
        return dist.reduce_scatter_single(out, tensor, group=group, async_op=True)
    if kind == "all_gather":
        return dist.all_gather_single(out, tensor, group=group, async_op=True)
    raise ValueError(f"not a collective: {kind!r}")


def _by_dtype(buffers: Mapping[str, torch.Tensor]) -> dict[torch.dtype, list[torch.Tensor]]:
    """The buffers by dtype, each list in name order (the same on every rank)."""
    out: dict[torch.dtype, list[torch.Tensor]] = {}
    for name in sorted(buffers):
        out.setdefault(buffers[name].dtype, []).append(buffers[name])
    return out


def reshard(saved: Mapping[str, Any], kind: str, old_world: int, numel: Mapping[str, int],
            world: int, rank: int, states: bool) -> tuple[dict[str, torch.Tensor], Any]:
    """Load a checkpoint's per-rank pieces, saved by ``old_world`` ranks, on ``world``
    ranks (the same number or not). ``saved``: its metadata by key; the pieces are
    ``{kind}.rank{q}.{name}`` (``states``: ``{kind}.rank{q}.{name}.{state}``), each 1-D
    (rank ``q``'s elements of parameter ``name``) or a scalar (a step count, the same on
    every rank). Returns the saved keys this ``rank`` reads (into new tensors, for
    ``dcp.load``) and a function to call after the load that gives this rank's pieces
    by their keys ``{kind}.rank{rank}...``. A checkpoint that does not fit raises the same
    error on every rank, before anything is read."""
    prefix = f"{kind}.rank"
    groups: dict[tuple[str, str], dict[int, str]] = {}
    for key in saved:
        if key.startswith(prefix):
            q, _, rest = key[len(prefix):].partition(".")
            name, _, state = rest.rpartition(".") if states else (rest, "", "")
            groups.setdefault((name, state), {})[int(q)] = key
    for (name, state), by_rank in groups.items():   # the same checks on every rank
        if name not in numel:
            raise ValueError(f"the checkpoint has {kind} pieces of {name!r}, which is not a "
                             "parameter of this model")
        if all(len(saved[k].size) == 0 for k in by_rank.values()):
            continue
        for q in range(old_world):
            olo, ohi = _piece(numel[name], old_world, q)
            size = tuple(saved[by_rank[q]].size) if q in by_rank else None
            if size is None and olo < ohi:
                raise ValueError(f"the checkpoint lacks rank {q}'s {kind} piece of {name!r} "
                                 f"{state}".rstrip())
            if size is not None and size != (ohi - olo,):
                raise NotImplementedError(
                    f"loading {by_rank[q]!r}: it holds {size}, not the {ohi - olo} elements "
                    f"rank {q} of {old_world} owns of {name!r}; only elementwise state (one "
                    "value per parameter element, or a scalar) can be loaded by rank pieces")
    want: dict[str, torch.Tensor] = {}
    plans: dict[str, tuple[int, torch.dtype, list[tuple[str, int, int, int]]]] = {}
    for (name, state), by_rank in groups.items():
        lo, hi = _piece(numel[name], world, rank)
        if lo == hi:
            continue   # this rank owns none of it
        new_key = f"{prefix}{rank}.{name}" + (f".{state}" if states else "")
        first = by_rank[min(by_rank)]
        dtype = saved[first].properties.dtype
        if len(saved[first].size) == 0:   # a scalar, the same on every rank
            want[first] = torch.empty((), dtype=dtype)
            plans[new_key] = (-1, dtype, [(first, 0, 0, 0)])
            continue
        parts = []
        for q, key in sorted(by_rank.items()):
            olo, ohi = _piece(numel[name], old_world, q)
            a, b = max(lo, olo), min(hi, ohi)
            if a < b:
                want[key] = torch.empty(ohi - olo, dtype=dtype)
                parts.append((key, a - olo, a - lo, b - a))
        plans[new_key] = (hi - lo, dtype, parts)

    def stitch() -> dict[str, torch.Tensor]:
        out = {}
        for new_key, (length, dtype, parts) in plans.items():
            if length < 0:
                out[new_key] = want[parts[0][0]]
                continue
            t = torch.empty(length, dtype=dtype)
            for key, src, dst, k in parts:
                t[dst:dst + k].copy_(want[key][src:src + k])
            out[new_key] = t
        return out

    return want, stitch


def _chunk(numel: int, parts: int) -> int:
    """The length of each of the ``parts`` pieces a parameter of ``numel`` elements is cut
    into (the last ones shorter or empty)."""
    return -(-numel // parts)


def _piece(numel: int, parts: int, rank: int) -> tuple[int, int]:
    """Rank ``rank``'s elements ``[lo, hi)`` of a parameter of ``numel`` elements cut in
    ``parts`` (possibly empty)."""
    c = _chunk(numel, parts)
    return min(numel, rank * c), min(numel, (rank + 1) * c)


def first_names(params: Mapping[str, torch.Tensor]) -> dict[int, str]:
    """``id(tensor) -> its first name`` (a tied parameter has several)."""
    out: dict[int, str] = {}
    for n, t in params.items():
        out.setdefault(id(t), n)
    return out


def _unique(params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``params`` with each tensor once, under its first name."""
    return {n: params[n] for n in first_names(params).values()}


def _span(layers: range) -> tuple[int, int]:
    return layers.start, layers.stop


def _first_difference(mine: Any, theirs: Any, rank: int) -> str:
    """``"X, rank r has Y"`` for the first entry where two digests differ."""
    if isinstance(mine, (list, tuple)) and isinstance(theirs, (list, tuple)):
        for a, b in zip(mine, theirs):
            if a != b:
                return f"{a!r}, rank {rank} has {b!r}"
        return f"{len(mine)} entries, rank {rank} has {len(theirs)}"
    return f"{mine!r}, rank {rank} has {theirs!r}"
