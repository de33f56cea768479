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

from fxpipe.errors import DistributedError
from fxpipe.runtime.devices import VirtualDevice
from fxpipe.runtime.params import GradAccumulator, ParamStore, _grad_dtype

ORIGIN = "fxpipe/failed"   # store key: "<rank>: <what failed>", set by the first rank to fail


@dataclass
class Bucket:
    """One backward stage's parameters of one gradient dtype, as one flat tensor: each
    parameter at ``offsets[i]`` (numel ``sizes[i]``), ``numel`` in all, padded to
    ``padded`` (a multiple of the number of ranks) for a reduce-scatter; this rank's
    shard is ``[shard_start, shard_start + shard_len)``, ``shard_len = padded // world``.
    ``key`` names it the same way on every rank."""

    key: tuple[int, int, str]                # (layers.start, layers.stop, dtype)
    layers: range
    dtype: torch.dtype
    params: list[torch.Tensor]
    offsets: list[int]
    sizes: list[int]
    numel: int
    padded: int
    shard_start: int
    shard_len: int

    def pieces(self) -> list[tuple[torch.Tensor, int, int, int]]:
        """``(param, start in param, stop in param, start in shard)`` of each parameter
        that overlaps this rank's shard."""
        a, b = self.shard_start, self.shard_start + self.shard_len
        out = []
        for p, o, n in zip(self.params, self.offsets, self.sizes):
            lo, hi = max(a, o), min(b, o + n)
            if lo < hi:
                out.append((p, lo - o, hi - o, lo - a))
        return out


@dataclass
class Shard:
    """This rank's part of a bucket in a sharded step: the averaged gradient of its 1/N
    (``grad``); the step updates those parameter elements in place, the all-gather
    sends them to every rank."""

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
        self._buckets: dict[int, tuple[ParamStore, dict[tuple[int, int], list[Bucket]]]] = {}
        self._ops: list[tuple[str, int, torch.dtype]] = []   # this call's collectives
        self._posted = 0                                      # how many were posted

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
        self._ops, self._posted = list(ops), 0

    def _post(self, kind: str, tensor: torch.Tensor, what: str,
              out: torch.Tensor | None = None) -> None:
        """Post the call's next collective and wait for it; then raise ``DistributedError``
        if another rank reported a failure in the store (a failed rank says so first, then
        completes the collectives it owes with zeros: :meth:`drain`)."""
        if self._posted < len(self._ops) and self._ops[self._posted][0] != kind:
            raise RuntimeError(f"rank {self.rank}: collective {self._posted} of the call is "
                               f"{kind}, the Program said {self._ops[self._posted][0]}")
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
        while self._posted < len(self._ops):
            kind, numel, dtype = self._ops[self._posted]
            out = torch.zeros(numel * self.world if kind == "all_gather" else
                              numel // self.world, dtype=dtype) \
                if kind in ("all_gather", "reduce_scatter") else None
            self._posted += 1
            try:
                _issue(kind, torch.zeros(numel, dtype=dtype), out, self.group).wait()
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
        """Per backward stage's layers, its buckets (one per gradient dtype), in the same
        order on every rank: its ``owned_params`` in the order of the host buffers (one
        set per ``store``: per run type)."""
        key = id(store)
        if key not in self._buckets:
            host = store.host

            def order(p: torch.Tensor) -> tuple:   # host buffer order, then by name
                slot = host.slots.get(id(p))
                if slot is None or slot.region is None:
                    return (1, 0, 0, slot.names[0] if slot else "")
                return (0, slot.region, slot.offset, "")

            out: dict[tuple[int, int], list[Bucket]] = {}
            for s, params in store.owned(exe, lg).items():
                layers = exe.program.stages[s].layers
                by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
                for p in sorted(params, key=order):
                    by_dtype.setdefault(_grad_dtype(p), []).append(p)
                out[(layers.start, layers.stop)] = [
                    self._bucket(layers, dtype, ps) for dtype, ps in by_dtype.items()]
            self._buckets[key] = (store, out)   # the store kept: its id stays its own
        return self._buckets[key][1]

    def _bucket(self, layers: range, dtype: torch.dtype, params: list[torch.Tensor]) -> Bucket:
        offsets, sizes, n = [], [], 0
        for p in params:
            offsets.append(n)
            sizes.append(p.numel())
            n += p.numel()
        padded = -(-n // self.world) * self.world
        length = padded // self.world
        return Bucket((layers.start, layers.stop, str(dtype).removeprefix("torch.")), layers,
                      dtype, params, offsets, sizes, n, padded, self.rank * length, length)

    def _pack(self, bucket: Bucket, acc: GradAccumulator) -> torch.Tensor:
        """The bucket's flat gradient: per parameter its ``.grad`` plus this call's sum,
        divided by the number of ranks (DDP's order: divide, then sum across ranks)."""
        flat = torch.empty(bucket.padded, dtype=bucket.dtype)
        flat[bucket.numel:].zero_()
        with torch.no_grad():
            for p, o, n, new in zip(bucket.params, bucket.offsets, bucket.sizes,
                                    acc.sums(bucket.params)):
                seg = flat[o:o + n]
                old = p.grad
                if new is None and old is None:
                    seg.zero_()
                    continue
                seg.copy_((new if new is not None else old).reshape(-1))
                if new is not None and old is not None:
                    seg.add_(old.reshape(-1))
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
            for p, o, n in zip(b.params, b.offsets, b.sizes):
                acc.replace(p, flat[o:o + n].view(p.shape))

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
        """``AllGather``: every rank's stepped shard into every rank's parameters."""
        for sh in shards:
            b = sh.bucket
            dtype = b.params[0].dtype
            mine = torch.zeros(b.shard_len, dtype=dtype)
            with torch.no_grad():
                for p, lo, hi, at in b.pieces():
                    mine[at:at + hi - lo].copy_(p.detach().view(-1)[lo:hi])
            full = torch.empty(b.padded, dtype=dtype)
            self._post("all_gather", mine,
                       f"all-gather of layers {b.layers.start}-{b.layers.stop - 1}", full)
            with torch.no_grad():
                for p, o, n in zip(b.params, b.offsets, b.sizes):
                    p.view(-1).copy_(full[o:o + n])

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
