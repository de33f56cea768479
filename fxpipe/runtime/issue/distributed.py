"""Data parallel across processes: the collectives of a Program's host lane.

``fxpipe.compile(model, ..., data_parallel=True)`` on every rank of a ``torch.distributed``
job: each rank runs its own pipeline on its share of the batch, and the host lane of
each training call's Program holds the collectives (``passes.program``): ``BC``
broadcasts the buffers from rank 0, ``AR4:6`` averages the gradients of the parameters
``S4:6`` steps (one bucket per backward stage, reduced as soon as that stage's
gradients are downloaded, while the devices back-propagate the shallower stages), and
with ``shard_optimizer=True`` ``RS4:6`` / ``AG4:6`` reduce-scatter the bucket and
gather the stepped shards back. :class:`DataParallel` runs them on host tensors (gloo).
On GPUs (``True``) and with ``"device"`` each stage's all-reduce or reduce-scatter is the
devices' (``DeviceAllReduce``, ``DeviceReduceScatter``: ``runtime.issue.device_collectives``,
a group per device index, NCCL on GPUs), the host lane steps (and gathers).

What is sharded: each parameter is cut in N equal pieces whatever the plan (rank ``r``
owns ``[r*c, (r+1)*c)``, ``c = ceil(numel / N)``), so the optimizer state of a piece,
kept by parameter name, serves every plan; with ``param_dtype`` the fp32 masters too
(``runtime.host.masters``). Clipping (``N``) gathers each rank's part of the norm.

What is averaged, exactly as ``DistributedDataParallel`` does: the bucket holds each
parameter's ``.grad`` plus this call's gradient (DDP reduces the accumulated ``.grad``),
divided by the number of ranks, then summed across ranks; the result becomes the new
``.grad`` at the commit. Nothing reaches ``.grad`` before the call's ``Commit`` (or a
streamed ``OptimizerStep``): a call that fails on any rank leaves ``.grad`` as it was
on every rank. A parameter that gets no gradient on a rank counts as zero there.

Failures: the collectives run on a process group fxpipe makes over the ranks of the
user's (gloo, ``timeout`` seconds). A rank whose training call fails writes which rank
and why into the group's store, then completes the collectives it still owes with zeros
(``drain``: gloo cannot cancel a posted collective); every rank checks the store after
each collective (with ``"device"``, each device's group too), so the others raise
:class:`fxpipe.errors.DistributedError` naming the rank that failed first, drain too,
and no ``Commit`` runs anywhere: ``.grad`` and buffers stay as they were on every rank
(parameters too, without a streamed optimizer or with ``overlapped(opt, atomic=True)``).
A rank that stops answering or dies fails the others at the timeout. The pipe cannot
train again afterwards: restart every rank and resume from a checkpoint. A rank failing
after its last collective of a call fails alone.
"""

from __future__ import annotations

import atexit
import datetime
import hashlib
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from fxpipe.errors import DistributedError
from fxpipe.runtime.host.buckets import Bucket, Shard, _by_dtype, _chunk, _span, first_names
from fxpipe.runtime.devices.cuda import CudaDevice
from fxpipe.runtime.devices.device import Device
from fxpipe.runtime.devices.emulator import VirtualDevice
from fxpipe.runtime.host.grad_accum import GradAccumulator, owned_params
from fxpipe.runtime.host.masters import ShardedMasters
from fxpipe.runtime.host.param_store import ParamStore
from fxpipe.runtime.host.params import grad_dtype
from fxpipe.runtime.issue.device_collectives import (
    Channel, OnDevices, Op, issue, reduces_on_devices, shared_gpu,
)
from fxpipe.runtime.issue.threads import Cancelled
from fxpipe.runtime.issue.zero3 import Zero3

ORIGIN = "fxpipe/failed"   # store key: "<rank>: <what failed>", set by the first rank to fail
_open: weakref.WeakSet[DataParallel] = weakref.WeakSet()   # not closed yet (close_all)


@atexit.register
def close_all() -> None:
    """Close every data-parallel pipe's collectives not closed yet: before the
    interpreter's teardown (``atexit`` runs before it; torch's own groups are destroyed
    after)."""
    for dp in list(_open):
        dp.close()


class DataParallel(ShardedMasters, OnDevices, Zero3):
    """The collectives of one data-parallel pipe (module docstring). Made by
    ``fxpipe.compile`` on every rank of ``process_group`` (None: the default group)."""

    def __init__(self, process_group: Any = None, *, timeout: float = 300.0,
                 shard: bool = False, broadcast: bool = True, on_devices: bool | None = False,
                 zero3: bool = False):
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "fxpipe.compile(..., data_parallel=True) needs torch.distributed initialized on "
                "every rank first: torch.distributed.init_process_group('gloo') (torchrun sets "
                "the rank, world size and address in the environment); see the README")
        if not timeout > 0:
            raise ValueError(f"collective_timeout must be > 0 seconds, got {timeout!r}")
        parent = process_group if process_group is not None else dist.group.WORLD
        ranks = dist.get_process_group_ranks(parent)
        self.rank = dist.get_rank(parent)
        self.world = len(ranks)
        self.timeout = float(timeout)
        # the gradients are reduced on the devices (reduce-scattered when sharded); None
        # (data_parallel=True): where the devices are, as every rank decides (check_devices)
        self.on_devices = None if on_devices is None else on_devices or zero3
        self.shard = shard or zero3   # shard_optimizer
        self.broadcast = broadcast    # broadcast_buffers
        # fxpipe's own group: host tensors (gloo) whatever the user's backend, our timeout
        # and store key for failures. A user's subgroup: only its ranks make fxpipe's groups
        # (named by torch from the ranks and the live groups' count: not destroyed, close)
        self.local_sync = len(ranks) < dist.get_world_size()
        self.group = dist.new_group(ranks, backend="gloo",
                                    timeout=datetime.timedelta(seconds=self.timeout),
                                    use_local_synchronization=self.local_sync)
        self.store = dist.distributed_c10d._get_process_group_store(self.group)
        self.dead: DistributedError | None = None
        self._drainer: threading.Thread | None = None   # started by fail
        self._lock = threading.Lock()
        self._worker: VirtualDevice | None = None
        self._stats: Any = None   # the running call's (begin)
        # under _lock: built by the first thread to ask (plan_ops, the collective worker)
        self._buckets: dict[int, tuple[ParamStore, dict[tuple[int, int], list[Bucket]]]] = {}
        # begin (the call's host thread), _post (the collective worker, a device's
        # collective stream) and drain (the failing thread) post in the Program's order
        self._host_lane = Channel(self.group, torch.device("cpu"), self.world)
        ShardedMasters.__init__(self)
        OnDevices.__init__(self)
        Zero3.__init__(self, zero3)
        # id(parameter) -> its name for the shard state and masters: its first name in the
        # first layer graph that named it (another capture may order tied names otherwise)
        self._names: dict[int, str] = {}
        _open.add(self)   # closed at exit if the pipe is not (close_all)

    def collectives(self, run_type: str, sync: bool, mode: str | None,
                    has_buffers: bool, accumulated: bool = False) -> tuple[str | None, bool]:
        """``(data_parallel, broadcast_buffers)`` of a call's Program: a training call that
        synchronizes all-reduces (``"allreduce"``), or reduce-scatters when it steps a
        sharded optimizer (``mode="exact"``; None: no step) (``"shard"``); on the devices
        (``"device_allreduce"``, ``"device"``; ``"zero3"``), first adding the ``.grad``
        ``accumulated`` by calls that did not synchronize (``"_accumulated"``); it first
        broadcasts the buffers when the model ``has_buffers`` and ``broadcast_buffers``."""
        if run_type == "infer" or not sync:
            return None, False
        if self.shard and mode not in (None, "exact"):
            raise NotImplementedError(f"shard_optimizer=True steps with the streamed exact "
                                      f"step only, not optimizer={mode!r}")
        sharded = self.shard and mode == "exact"
        if self.on_devices:   # (zero3: a call that does not step is refused, Runner.call)
            mode = ("zero3" if sharded and self.zero3 else "device" if sharded
                    else "device_allreduce") + ("_accumulated" if accumulated else "")
        else:
            mode = "shard" if sharded else "allreduce"
        return mode, self.broadcast and has_buffers

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

    def check_devices(self, devices: Sequence[Device]) -> None:
        """Raise ``ValueError`` on every rank if two ranks compute on one GPU (by its UUID:
        ``CUDA_VISIBLE_DEVICES`` may number it differently in each), or, reducing on the
        devices, if the ranks have different numbers of devices (``True``: then on the
        host, as where any rank's are not GPUs); then make the devices' groups."""
        mine = sorted(str(torch.cuda.get_device_properties(d.device).uuid)
                      for d in devices if isinstance(d, CudaDevice))
        gathered: list[Any] = [None] * self.world
        dist.all_gather_object(gathered, (len(devices), mine, reduces_on_devices(devices)),
                               group=self.group)
        counts = [n for n, *_ in gathered]
        if self.on_devices is None:
            self.on_devices = all(gpus for *_, gpus in gathered) and len(set(counts)) == 1
        if self.on_devices and len(set(counts)) > 1:
            raise ValueError(
                f"fxpipe.compile(data_parallel='device'): the ranks have {counts} devices: "
                "device d of every rank reduces with device d of the others, so every rank "
                "needs the same number of devices")
        if self.on_devices and not self._devices:   # every rank, in the same order
            self._devices = [self._device_channel(dev) for dev in devices]
        clash = shared_gpu([gpus for _, gpus, _ in gathered])
        if clash is not None:
            a, b, gpu = clash
            raise ValueError(
                f"fxpipe.compile(data_parallel=True): ranks {a} and {b} both compute on GPU "
                f"{gpu}: every rank needs GPUs of its own. Under torchrun leave devices=None "
                "(each rank takes its share of the node's GPUs, LOCAL_RANK) or pass each rank "
                "its own devices=[...]")

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
        if self.group is None:
            raise DistributedError(f"rank {self.rank}: this data-parallel pipe was closed "
                                   "(pipe.close()): compile a new one", rank=self.rank)
        if self.dead is not None:
            raise DistributedError(
                f"rank {self.rank}: an earlier data-parallel call failed ({self.dead}); fxpipe's "
                "process group cannot be used again: restart every rank and resume from a "
                "checkpoint", rank=self.dead.rank)

    def check_batch(self, envs: Sequence[Mapping[str, Any]]) -> None:
        """Before a call's first collective: raise ``DistributedError`` on every rank unless
        every rank's call has the same microbatches, each with the same input shapes (a
        rank with another batch would post other collectives, or weigh its gradients
        otherwise, and the job would hang or drift). One all-gather of an 8-byte digest;
        the shapes themselves are gathered only to say which rank differs. Nothing of the
        call has run: the pipe stays usable."""
        shapes = [sorted((name, tuple(t.shape)) for name, t in env.items()
                         if isinstance(t, torch.Tensor)) for env in envs]
        digest = torch.tensor([int.from_bytes(hashlib.blake2b(
            repr(shapes).encode(), digest_size=7).digest(), "little")], dtype=torch.int64)
        gathered = [torch.zeros_like(digest) for _ in range(self.world)]
        try:
            dist.all_gather(gathered, digest, group=self.group)
            if all(int(g) == int(digest) for g in gathered):
                return
            every: list[Any] = [None] * self.world
            dist.all_gather_object(every, shapes, group=self.group)
        except Exception as e:  # noqa: BLE001 — a rank that died or never called
            raise DistributedError(
                f"rank {self.rank}: comparing this call's batch with the other ranks' failed "
                f"({type(e).__name__}: {e})", rank=self.rank) from e
        other = next(r for r, theirs in enumerate(every) if theirs != shapes)
        raise DistributedError(
            f"rank {self.rank}: the ranks' batches differ: rank {self.rank} has "
            f"{_batch(shapes)}, rank {other} has {_batch(every[other])}. Every rank of a "
            "data-parallel call must pass a batch of the same shape, split into the same "
            "microbatches (pad or drop the last, smaller batch: a DataLoader's "
            "drop_last=True, a DistributedSampler). Nothing ran; the pipe can be called "
            "again", rank=other)

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
        # collective pending on gloo's threads aborts the process. The drain starts now,
        # beside the call's actions still running: one of them may wait for a collective
        # that another rank posts only once this rank's drain has served it.
        self._drainer = threading.Thread(target=self._drain, name="fxpipe-drain", daemon=True)
        self._drainer.start()

    # -- posting collectives: every rank posts the same ops in the same order -------------
    def begin(self, ops: Sequence[Op], device_ops: Mapping[int, Sequence[Op]] = {},
              stats: Any = None) -> None:
        """A call starts: ``ops`` are the collectives it will post on the host lane, in
        order (:meth:`plan_ops`), ``device_ops`` each device's (:meth:`plan_device_ops`):
        what :meth:`drain` completes when it fails. ``stats``: how many in all, and the
        bytes the host-lane ones take in (``host_collective_bytes``: what crosses gloo)."""
        self._host_lane.begin(ops)
        for d, channel in enumerate(self._devices):
            channel.begin(device_ops.get(d, ()))
        self._stats = stats
        if stats is not None:
            stats.add("collectives", len(ops) + sum(len(o) for o in device_ops.values()))
            stats.add("host_collective_bytes", sum(n * dtype.itemsize for _, n, dtype in ops))

    def _post(self, kind: str, tensor: torch.Tensor, what: str, out: Any = None) -> None:
        """Post the call's next collective on the host lane and wait for it (:meth:`_wait`)."""
        self._wait([self._start(kind, tensor, out, self._host_lane)], what)

    def _start(self, kind: str, tensor: torch.Tensor, out: torch.Tensor | None,
               channel: Channel) -> Any:
        """Post the call's next collective on ``channel``; returns its work."""
        try:
            return channel.post(kind, tensor, out)
        except Cancelled:
            raise
        except RuntimeError as e:
            raise RuntimeError(f"rank {self.rank}: {e}") from None

    def _wait(self, works: Sequence[Any], what: str) -> None:
        """Wait for ``works`` (on a GPU's NCCL group: the current stream waits); then raise
        ``DistributedError`` if another rank reported a failure in the store (a failed
        rank says so first, then completes the collectives it owes with zeros:
        :meth:`drain`)."""
        cause: Exception | None = None
        for work in works:
            try:
                work.wait()
            except Exception as e:  # noqa: BLE001
                cause = cause or e
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
        it (gloo cannot cancel a posted collective). Bounded by the timeout. Started by
        :meth:`fail`, beside the actions still running (an action that would post then
        raises ``Cancelled``: the drain posts zeros in its place); this waits for it."""
        drainer = self._drainer
        if drainer is None:
            self._drain()
        else:
            drainer.join()

    def _drain(self) -> None:
        """The channels drain at once, each on its own thread: another rank's collective on
        one may wait (through its Program) for this rank's on another."""
        threads = [threading.Thread(target=c.drain, name=f"fxpipe-drain-{d}", daemon=True)
                   for d, c in enumerate(self._devices)]
        for t in threads:
            t.start()
        self._host_lane.drain()
        for t in threads:
            t.join()

    def plan_ops(self, actions: Sequence[Any], exe: Any, lg: Any, store: ParamStore
                 ) -> list[tuple[str, int, torch.dtype]]:
        """The collectives (kind, numel, dtype) the host lane's ``actions`` post, in order."""
        from fxpipe.passes.program import (AllGather, AllReduce, Barrier, BroadcastBuffers,
                                           ClipGradNorm, ReduceScatter)
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
                case ClipGradNorm() if any(isinstance(b, (AllGather, Barrier)) for b in actions):
                    # a sharded step's norm (total_norm)
                    ops.append(("all_gather", 2, torch.float64))
                case Barrier():
                    ops.append(("all_reduce", 1, torch.float32))
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
                    by_dtype.setdefault((grad_dtype(p), p.dtype), []).append(p)
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
        if self.rank != 0:   # their upload copies see the new values (not the parameters':
            store.refresh(list(buffers.values()))   # an asynchronous update writes them)

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

    def total_norm(self, local: torch.Tensor, norm_type: float, shards: Sequence[Shard],
                   clips: Callable[[torch.Tensor], bool]) -> torch.Tensor:
        """``ClipGradNorm`` of a sharded step: the total gradient norm from every rank's
        part (``optim_step.shard_norm``), gathered with a flag (a failed rank's drain
        sends zeros) and combined in rank order, so every rank takes the same decision.
        When every rank sent its part and the norm ``clips`` (the step is redone), the
        redone step's all-gathers of ``shards`` are expected (beyond the Program's list)
        before a failure found meanwhile is raised: every rank that drains drains them."""
        parts = torch.empty(2 * self.world, dtype=torch.float64)
        mine = torch.stack([local, torch.ones((), dtype=torch.float64)])
        work = self._start("all_gather", mine, parts, self._host_lane)
        try:
            work.wait()
            everyone = bool(parts[1::2].all())
        except Exception:  # noqa: BLE001 — _wait raises it below
            everyone = False
        norm_type = float(norm_type)
        total = (parts[0::2].max() if norm_type == float("inf") else
                 parts[0::2].sum() ** (1.0 / norm_type)).float()
        if everyone and clips(total) and not self.zero3:   # (zero3's redo writes, gathers nothing)
            ops = [("all_gather", sh.bucket.shard_len, sh.bucket.params[0].dtype)
                   for sh in shards]
            self._host_lane.expect(ops)
            if self._stats is not None:
                self._stats.add("collectives", len(ops))
                self._stats.add("host_collective_bytes", sum(n * t.itemsize for _, n, t in ops))
        self._wait([work], "gathering of the gradient norm")
        return total

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
            issue("all_gather", mine, full, self.group).wait()
        return full

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
        """Stop the collective worker, then destroy fxpipe's groups (also at interpreter
        exit): no gloo thread is left for the teardown. After a failed call a collective may
        be pending on gloo's threads, which destroying would abort on: left to the exit. So
        are a subgroup's: the next group over its ranks would take a destroyed one's name
        (torch names them by the live groups' count) and read its stale rendezvous."""
        if self._worker is not None:
            self._worker.close()
            self._worker = None
        group, self.group = self.group, None
        channels, self._devices = self._devices, []
        _open.discard(self)
        if group is not None and self.dead is None and dist.is_initialized() \
                and not self.local_sync:
            for g in [c.group for c in channels] + [group]:
                try:
                    dist.destroy_process_group(g)
                except Exception:  # noqa: BLE001 — the default group already went down with it
                    pass


def _batch(shapes: Sequence[Sequence[tuple[str, tuple[int, ...]]]]) -> str:
    """``"2 microbatches: input_ids (2, 16), labels (2, 16); ..."``."""
    return f"{len(shapes)} microbatches: " + "; ".join(
        ", ".join(f"{name} {shape}" for name, shape in mb) for mb in shapes)


def _first_difference(mine: Any, theirs: Any, rank: int) -> str:
    """``"X, rank r has Y"`` for the first entry where two digests differ."""
    if isinstance(mine, (list, tuple)) and isinstance(theirs, (list, tuple)):
        for a, b in zip(mine, theirs):
            if a != b:
                return f"{a!r}, rank {rank} has {b!r}"
        return f"{len(mine)} entries, rank {rank} has {len(theirs)}"
    return f"{mine!r}, rank {rank} has {theirs!r}"
