"""Posting collectives in a call's order, and data parallel's reduce-scatter on the devices.

A :class:`Channel` is one process group's collectives of a call: fxpipe's host group
(the host lane's ``BC``, ``AR``, ``RS``, ``AG``), and with ``data_parallel="device"``
(or ``True`` on GPUs: :func:`reduces_on_devices`) one group per device index (device
``d`` of every rank). Every rank posts a channel's
collectives in the same order, the Program's (``begin`` lists them); a rank whose call
fails completes what it still owes each channel with zeros (``drain``: neither gloo
nor NCCL can cancel a posted collective).

``data_parallel="device"``: a backward stage's gradients are reduce-scattered where
they are, on the device's ``collective`` stream (``DeviceReduceScatter``), before its
``DownloadGrads``. Each parameter is cut as the sharded optimizer cuts it (rank ``r``
owns ``[r*c, (r+1)*c)``, ``c = ceil(numel / N)``, ``runtime.host.buckets``), so a
parameter's gradient, divided by N and zero-padded to ``N*c`` where ``c`` does not
divide it, is reduce-scattered straight into its place in the stage's shard
(:func:`reduce_scatter_grads`). Small gradients are coalesced (:func:`groups`): a run of
neighbours below ``SMALL`` bytes each is packed into one ``(N, sum c)`` buffer (each
rank's pieces side by side, ``torch._chunk_cat``) and reduced by one collective, whose
output is their pieces' places in the shard, as FSDP's reduce-scatter packs a unit's
gradients; each collective costs a launch and a round of latency whatever its size
(NCCL's), and a LoRA stage has dozens of small gradients. The download then moves
that shard, 1/N of the gradients; the host adds each parameter's piece to the call's
sums (:meth:`Pieces.add_to`), and the stage's ``OptimizerStep`` steps them as the sharded
optimizer steps a host reduce-scatter's shards (:func:`shards_from_pieces`). A call
that steps no sharded optimizer (every call of ``True`` on GPUs without
``shard_optimizer``) averages them in place instead (``DeviceAllReduce``,
:func:`all_reduce_grads`, packed the same way) and downloads them whole. After calls that
did not synchronize (``no_sync()``) either first adds the host's accumulated ``.grad``,
uploaded a piece at a time (``sRS+``, ``sAR+``: :func:`add_host_grads`).

>>> import torch.nn as nn
>>> from fxpipe.runtime.host.params import HostParams
>>> from fxpipe.runtime.host.param_store import ParamStore
>>> lin = nn.Linear(3, 2)
>>> store = ParamStore(HostParams.of(lin, pin=False), {0: dict(lin.named_parameters())})
>>> [(b.names, b.chunks, b.shard_len) for b, _ in device_buckets(store, 0, 2, 1, {})]
[(['bias', 'weight'], [1, 3], 4)]
>>> [list(r) for b, _ in device_buckets(store, 0, 2, 1, {}) for r in groups(b)]
[[0, 1]]
"""

from __future__ import annotations

import datetime
import threading
from dataclasses import dataclass
from collections.abc import Collection, Mapping, Sequence
from typing import Any, Callable

import torch
import torch.distributed as dist

from fxpipe.passes.actions import DeviceAllGather, DeviceReduce, DeviceReduceScatter
from fxpipe.runtime.devices.cuda import CudaDevice
from fxpipe.runtime.devices.device import Device
from fxpipe.runtime.devices.emulator import VirtualDevice
from fxpipe.runtime.host.buckets import Bucket, Shard, _chunk
from fxpipe.runtime.host.param_store import ParamStore
from fxpipe.runtime.host.params import grad_dtype
from fxpipe.runtime.issue.threads import Cancelled

Op = tuple[str, int, torch.dtype]   # (kind, numel of this rank's input, dtype)


class Channel:
    """One process group's collectives of a call, posted in the Program's order (module
    docstring). ``device``: where :meth:`drain`'s zeros live (the host, or a GPU for an
    NCCL group)."""

    def __init__(self, group: Any, device: torch.device, world: int):
        self.group, self.device, self.world = group, device, world
        self.lock = threading.Lock()   # held while a collective is posted, not waited for
        self.ops: list[Op] = []        # this call's collectives
        self.posted = 0                # how many were posted
        self.draining = False          # the call failed: only :meth:`drain` posts now

    def begin(self, ops: Sequence[Op]) -> None:
        """A call starts: ``ops`` are the collectives it will post here, in order."""
        with self.lock:
            self.ops, self.posted, self.draining = list(ops), 0, False

    def expect(self, ops: Sequence[Op]) -> None:
        """The call posts ``ops`` next, beyond the Program's list (every rank decides
        alike): a failure drains them too."""
        with self.lock:
            self.ops[self.posted:self.posted] = ops

    def post(self, kind: str, tensor: torch.Tensor, out: torch.Tensor | None) -> Any:
        """Post the call's next collective (checked against the Program's list); returns
        its work. Once the call drains, an action that would post raises ``Cancelled``
        (the drain posts zeros in its place)."""
        with self.lock:
            if self.draining:
                raise Cancelled(f"{kind}: the call failed (its collectives are completed with "
                                "zeros)")
            if self.posted < len(self.ops) and self.ops[self.posted][0] != kind:
                raise RuntimeError(f"collective {self.posted} of the call is {kind}, the "
                                   f"Program said {self.ops[self.posted][0]}")
            work = issue(kind, tensor, out, self.group)
            self.posted += 1
            return work

    def drain(self) -> None:
        """Complete every collective of the call not posted yet, with zeros (bounded by
        the group's timeout); from now on only this posts."""
        while True:
            with self.lock:
                self.draining = True
                if self.posted >= len(self.ops):
                    return
                kind, numel, dtype = self.ops[self.posted]
                zeros = lambda n: torch.zeros(n, dtype=dtype, device=self.device)  # noqa: E731
                out = zeros(numel * self.world if kind == "all_gather" else
                            numel // self.world) \
                    if kind in ("all_gather", "reduce_scatter") else None
                self.posted += 1
                try:
                    work = issue(kind, zeros(numel), out, self.group)
                except Exception:  # noqa: BLE001
                    return
            try:
                work.wait()
            except Exception:  # noqa: BLE001
                return


def issue(kind: str, tensor: torch.Tensor, out: torch.Tensor | None, group: Any) -> Any:
    """Post one collective on ``group``: ``broadcast`` (from rank 0) and ``all_reduce``
    (sum) in place, ``reduce_scatter`` (sum) and ``all_gather`` into ``out``."""
    if kind == "broadcast":
        return dist.broadcast(tensor, group=group, group_src=0, async_op=True)
    if kind == "all_reduce":
        return dist.all_reduce(tensor, group=group, async_op=True)
    # torch 2.13 names these *_single (its *_tensor names warn, deprecated); 2.11, on the
    # GPU machines, has only *_tensor
    if kind == "reduce_scatter":
        op = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return op(out, tensor, group=group, async_op=True)
    if kind == "all_gather":
        op = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return op(out, tensor, group=group, async_op=True)
    raise ValueError(f"not a collective: {kind!r}")


# ------------------------------------------------------------------- on the devices

def check_data_parallel(data_parallel: Any) -> tuple[bool | None, bool]:
    """``compile``'s ``data_parallel``: ``(on_devices, zero3)``, whether the gradients are
    reduced on the devices (``"device"``, ``"zero3"``; ``"host"``: no; ``True``: None,
    where the devices are, :func:`reduces_on_devices`), and whether the ranks share the
    host parameters and gather them on the devices (``"zero3"``). Raises for anything
    else.

    >>> check_data_parallel(True), check_data_parallel("host"), check_data_parallel("zero3")
    ((None, False), (False, False), (True, True))
    """
    if data_parallel not in (False, True, "host", "device", "zero3") or \
            not isinstance(data_parallel, (bool, str)):
        raise TypeError(f"data_parallel must be False, True, 'host', 'device' or 'zero3', "
                        f"got {data_parallel!r}")
    return (None if data_parallel is True else data_parallel in ("device", "zero3"),
            data_parallel == "zero3")


def reduces_on_devices(devices: Sequence[Device]) -> bool:
    """``data_parallel=True``: whether the gradients are reduced on ``devices``: when every
    one is a GPU (and torch has NCCL) or a cuda-semantics virtual device (gloo on its
    tensors, the Program a GPU run has), as ``pin_memory``'s default decides; else on the
    host (gloo), the fallback the Program prints (``AR``).

    >>> reduces_on_devices([VirtualDevice()]), reduces_on_devices([VirtualDevice(semantics="cuda")])
    (False, True)
    """
    return all((isinstance(d, CudaDevice) and dist.is_nccl_available())
               or (isinstance(d, VirtualDevice) and d.semantics == "cuda") for d in devices)


def shared_gpu(gpus_by_rank: Sequence[Sequence[str]]) -> tuple[int, int, str] | None:
    """The first two ranks listing one GPU, and it (``check_devices``), or None.

    >>> shared_gpu([["GPU-a"], ["GPU-b"]]), shared_gpu([["GPU-a", "GPU-b"], ["GPU-b"]])
    (None, (0, 1, 'GPU-b'))
    """
    owner: dict[str, int] = {}
    for rank, gpus in enumerate(gpus_by_rank):
        for gpu in gpus:
            if gpu in owner:
                return owner[gpu], rank, gpu
            owner[gpu] = rank
    return None


class OnDevices:
    """``data_parallel="device"``'s part of ``DataParallel``: a process group per device
    index, the stages' device buckets, and the ``DeviceReduceScatter`` itself. Needs
    ``rank``, ``world``, ``timeout``, ``group``, ``local_sync``, ``_lock``, ``_names``,
    ``_start`` and ``_wait`` from the class that has it as a base."""

    rank: int
    world: int
    timeout: float
    group: Any
    local_sync: bool
    _lock: threading.Lock
    _names: dict[int, str]
    _start: Callable[..., Any]
    _wait: Callable[..., None]

    def __init__(self) -> None:
        self._devices: list[Channel] = []   # one per device index, made at compile
        self._device_buckets: dict[tuple[int, int], tuple[ParamStore, list]] = {}

    def _device_channel(self, device: Device) -> Channel:
        """A group over the ranks for ``device``'s index, one device of every rank
        (NCCL for a GPU, gloo for a virtual device's tensors, which are host memory)."""
        cuda = isinstance(device, CudaDevice)
        group = dist.new_group(dist.get_process_group_ranks(self.group),
                               backend="nccl" if cuda else "gloo",
                               timeout=datetime.timedelta(seconds=self.timeout),
                               use_local_synchronization=self.local_sync)
        return Channel(group, device.device if cuda else torch.device("cpu"), self.world)

    def plan_device_ops(self, program: Any, keep: Mapping[int, Sequence[bool]],
                        store: ParamStore) -> dict[int, list[Op]]:
        """Per device, the collectives its kept ``DeviceReduceScatter``,
        ``DeviceAllReduce`` and ``DeviceAllGather`` actions post, in order."""
        def ops(a: Any) -> list[Op]:
            if isinstance(a, DeviceAllGather):
                return [("all_gather", c, dtype) for c, dtype in store.gather_parts(a.stage)]
            if isinstance(a, DeviceReduce):
                return device_ops(self.device_buckets(store, a.stage),
                                  scatter=isinstance(a, DeviceReduceScatter))
            return []
        return {d: [op for i, a in enumerate(acts) if keep[d][i] for op in ops(a)]
                for d, acts in enumerate(program.actions)}

    def device_gather(self, d: int, device: Device, stage: int, params: Any) -> None:
        """``DeviceAllGather``, on device ``d``'s collective stream: each of the stage's
        parameter runs ``params.gathers`` (``ParamStore.upload``: this rank's part
        uploaded) filled with every other rank's part, in place."""
        channel = self._devices[d]
        works = []
        for full, c in params.gathers:
            device.record_stream(full)
            works.append(self._start("all_gather", full[self.rank * c:(self.rank + 1) * c],
                                     full, channel))
        self._wait(works, f"all-gather of stage {stage}'s parameters on {device.name}")

    def device_buckets(self, store: ParamStore, stage: int) -> list:
        """Stage ``stage``'s device buckets (``device_collectives.device_buckets``), made
        once per store."""
        key = (id(store), stage)
        with self._lock:
            if key not in self._device_buckets:
                self._device_buckets[key] = (store, device_buckets(
                    store, stage, self.world, self.rank, self._names))
            return self._device_buckets[key][1]

    def device_reduce(self, d: int, device: Device, store: ParamStore, stage: int,
                      params: Mapping[str, torch.Tensor], scatter: bool,
                      owned: Collection[int] = (), stats: Any = None
                      ) -> list[tuple[Any, Any]]:
        """On device ``d``'s collective stream, the stage's gradients there (``params``'
        ``.grad``) averaged over the ranks: ``scatter`` (``DeviceReduceScatter``), this
        rank's shard of each bucket kept on the device, ``[(bucket, shard)]``; else
        (``DeviceAllReduce``) in place, each parameter's ``.grad`` the average (made where
        it had none), ``[]``. ``owned`` (``sRS+``, ``sAR+``): ``id``s of the host
        parameters whose ``.grad`` (accumulated by calls that did not synchronize) is
        uploaded and added to their device gradient first (:func:`add_host_grads`; a
        tied parameter's by the stage that owns it only), counted in ``stats`` as
        ``h2d_bytes_grads``."""
        if not self._devices:
            raise RuntimeError(f"rank {self.rank}: a Program with device collectives ran on "
                               "a pipe compiled without data_parallel='device'")
        channel = self._devices[d]
        grads = {f: t.grad for f, t in params.items() if t.requires_grad}
        works: list[Any] = []
        versions: list[tuple[torch.Tensor, int]] = []

        def post(kind: str, tensor: torch.Tensor, out: torch.Tensor) -> None:
            device.record_stream(tensor)   # read by the collective after its last reference
            versions.append((tensor, tensor._version))
            works.append(self._start(kind, tensor, out, channel))

        buckets = self.device_buckets(store, stage)   # none: nothing trainable here
        what = (f"{'reduce-scatter' if scatter else 'all-reduce'} of stage {stage}'s gradients "
                f"on {device.name}")
        with device.allocating("gradients"):
            if owned:
                uploaded = add_host_grads(device, buckets, grads, owned, params)
                if stats is not None:
                    stats.add("h2d_bytes_grads", uploaded)
            reduce = reduce_scatter_grads if scatter else all_reduce_grads
            out = [(b, reduce(post, b, fqns, grads, params[fqns[0]], device.record_stream))
                   for b, fqns in buckets]
        self._wait(works, what)
        if getattr(device, "strict", False):   # strict cuda-sim: as a GPU would corrupt it
            written = [tuple(t.shape) for t, v in versions if t._version != v]
            if written:
                raise RuntimeError(
                    f"rank {self.rank}: the {what}: {len(written)} of its inputs ({written[0]} "
                    "first) were written while the collective read them (their version "
                    "changed between posting and completion): device work on another "
                    "stream wrote a gradient being reduced; order that work after the "
                    "collective's event")
        if not scatter:   # the averages in place: packed ones copied back
            with device.allocating("gradients"):
                for _, unpack in out:
                    unpack()
            for f, g in grads.items():
                params[f].grad = g
            return []
        return out


UPLOAD_CHUNK = 4 << 20
"""Bytes of a host gradient :func:`add_host_grads` uploads at a time (the device
workspace an ``sRS+`` or ``sAR+`` adds: ``memory_prediction.host_grad_piece``)."""


def add_host_grads(device: Device, buckets: Sequence[tuple[Bucket, list[str]]],
                   grads: dict[str, torch.Tensor | None], owned: Collection[int],
                   params: Mapping[str, torch.Tensor]) -> int:
    """``sRS+``, ``sAR+``: add the host ``.grad`` of each bucket parameter in ``owned`` (what
    calls that did not synchronize accumulated on this rank) to its device gradient in
    ``grads`` (by name in the stage; made, as zeros, where this call gave none), before
    the collective reads them. Uploaded ``UPLOAD_CHUNK`` bytes at a time on the
    current stream (the collective one), each piece added in the device gradient's dtype
    (a bf16 gradient rounds the fp32 sum once) and freed at once: the device holds one
    piece beside the gradients. Returns the bytes uploaded."""
    uploaded = 0
    for bucket, fqns in buckets:
        for p, fqn in zip(bucket.params, fqns):
            host = p.grad if id(p) in owned else None
            if host is None:
                continue
            g = grads.get(fqn)
            if g is None:
                g = grads[fqn] = torch.zeros(params[fqn].shape, dtype=bucket.dtype,
                                             device=params[fqn].device)
            flat, src = g.view(-1), host.detach().reshape(-1)
            uploaded += src.numel() * src.element_size()
            step = max(1, UPLOAD_CHUNK // src.element_size())
            for lo in range(0, src.numel(), step):
                piece = device.to_device(src[lo:lo + step], "gradients",
                                         f"the host's accumulated gradient of {fqn}",
                                         use=())
                device.in_order()   # (the copy has landed where the add reads it)
                flat[lo:lo + step].add_(piece)
                device.free(piece)
    return uploaded


def device_buckets(store: ParamStore, stage: int, world: int, rank: int,
                   names: Mapping[int, str]) -> list[tuple[Bucket, list[str]]]:
    """Stage ``stage``'s trainable parameters as it uploads them, one bucket per upload
    dtype, cut in ``world`` parts; with each parameter's name in the stage (what its
    device gradient is keyed by). ``names``: ``id(parameter) -> its name`` for the
    shard state (default: its name in the stage). The same on every rank."""
    by_dtype: dict[torch.dtype, list[tuple[str, torch.Tensor]]] = {}
    for fqn, tensor, dtype in sorted(store.trainable(stage), key=lambda x: x[0]):
        by_dtype.setdefault(dtype, []).append((fqn, tensor))
    out = []
    for dtype, named in by_dtype.items():
        sizes = [t.numel() for _, t in named]
        chunks = [_chunk(n, world) for n in sizes]
        offsets = [sum(chunks[:i]) for i in range(len(chunks))]
        params = [t for _, t in named]
        out.append((Bucket(None, dtype, params, [names.get(id(t), f) for f, t in named],
                           sizes, chunks, offsets, world, rank, [None] * len(params)),
                    [f for f, _ in named]))
    return out


# A gradient whose padded bytes are below SMALL is packed with its small neighbours into
# one collective of at most GROUP bytes; a larger one is reduced alone, in place (from 4
# MiB on, a reduce-scatter is bandwidth-bound on NVLink and PCIe alike, and packing it
# would hold a second copy of it on the device).
SMALL = 4 << 20
GROUP = 32 << 20


def groups(bucket: Bucket) -> list[range]:
    """The collectives of ``bucket``: each a run of its parameters (by index), a single
    one of ``SMALL`` bytes or more, else neighbours below it up to ``GROUP`` bytes."""
    out: list[range] = []
    start, size, item = 0, 0, bucket.dtype.itemsize
    for i, c in enumerate(bucket.chunks):
        nbytes = bucket.parts * c * item
        if i > start and (nbytes >= SMALL or size >= SMALL or size + nbytes > GROUP):
            out.append(range(start, i))
            start, size = i, 0
        size += nbytes
    if start < len(bucket.chunks):
        out.append(range(start, len(bucket.chunks)))
    return out


def device_ops(buckets: Sequence[tuple[Bucket, list[str]]], scatter: bool = True) -> list[Op]:
    """The collectives :func:`reduce_scatter_grads` (``scatter``) or
    :func:`all_reduce_grads` posts for ``buckets``."""
    if not scatter:
        return [("all_reduce", sum(b.sizes[i] for i in r), b.dtype)
                for b, _ in buckets for r in groups(b)]
    return [("reduce_scatter", b.parts * sum(b.chunks[i] for i in r), b.dtype)
            for b, _ in buckets for r in groups(b)]


def reduce_scatter_workspace(named: Sequence[tuple[str, int, torch.dtype]], world: int,
                             scatter: bool = True) -> int:
    """Device bytes a stage's ``DeviceReduceScatter`` holds beside its gradients until its
    collectives complete: this rank's shard of each dtype's bucket, and the packed or
    zero-padded copies its collectives read (:func:`groups`; a gradient reduced in place
    adds nothing). ``named``: the stage's trainable parameters as ``(name, numel, dtype
    on the device)``, bucketed as :func:`device_buckets` does. What ``predict_memory``
    adds to the stage's peak under ``data_parallel="device"``. Not ``scatter``: a
    ``DeviceAllReduce``'s, the packed copies only (:func:`all_reduce_grads`: no shard, no
    padding).

    >>> # a shard of 2 + 3 floats, both packed into one (2, 5) buffer: 15 floats
    >>> reduce_scatter_workspace([("w", 6, torch.float32), ("b", 3, torch.float32)], 2)
    60
    >>> reduce_scatter_workspace([("w", 6, torch.float32), ("b", 3, torch.float32)], 2, False)
    36
    """
    by_dtype: dict[torch.dtype, list[int]] = {}
    for _, numel, dtype in sorted(named, key=lambda x: x[0]):
        by_dtype.setdefault(dtype, []).append(numel)
    total = 0
    for dtype, sizes in by_dtype.items():
        chunks = [_chunk(n, world) for n in sizes]
        k = len(sizes)
        bucket = Bucket(None, dtype, [None] * k, [""] * k, sizes, chunks,
                        [sum(chunks[:i]) for i in range(k)], world, 0, [None] * k)
        if not scatter:
            total += sum(sum(sizes[i] for i in run) * dtype.itemsize
                         for run in groups(bucket) if len(run) > 1)
            continue
        total += bucket.shard_len * dtype.itemsize
        for run in groups(bucket):
            if len(run) > 1 or sizes[run.start] != world * chunks[run.start]:
                total += world * sum(chunks[i] for i in run) * dtype.itemsize
    return total


def reduce_scatter_bound(named: Sequence[tuple[str, int, torch.dtype]], world: int,
                         scatter: bool = True) -> int:
    """An upper bound of :func:`reduce_scatter_workspace` that adds up over parameters:
    each one's piece of the shard, and a copy of each gradient that may be packed or
    zero-padded (below ``SMALL`` bytes, or not divided by ``world``). What the planner
    counts per layer, whatever stage the layer ends up in. Not ``scatter``: a copy of
    each gradient that may be packed.

    >>> reduce_scatter_bound([("w", 6, torch.float32), ("b", 3, torch.float32)], 2)
    60
    >>> reduce_scatter_bound([("w", 6, torch.float32), ("b", 3, torch.float32)], 2, False)
    36
    """
    total = 0
    for _, numel, dtype in named:
        c, item = _chunk(numel, world), dtype.itemsize
        small = world * c * item < SMALL
        if not scatter:
            total += numel * item if small else 0
            continue
        total += c * item
        if small or numel != world * c:
            total += world * c * item
    return total


def reduce_scatter_grads(post: Callable[[str, torch.Tensor, torch.Tensor], None],
                         bucket: Bucket, fqns: Sequence[str],
                         grads: Mapping[str, torch.Tensor | None], like: torch.Tensor,
                         read: Callable[[torch.Tensor], None] = lambda t: None
                         ) -> torch.Tensor:
    """This rank's shard of ``bucket``'s average over the ranks, on the device: each
    parameter's gradient (``grads[fqn]``, None: zeros) divided by the number of ranks
    (DDP's order: divide, then sum) and reduce-scattered by ``post`` into its place, one
    collective per :func:`groups` run (several packed side by side per rank). Each
    gradient is given to ``read`` before this stream reads it (``Device.record_stream``:
    it was made on the compute stream, whose allocator must not reuse its memory before
    the packing ran; the executor drops the gradients right after this returns).
    ``like``: a tensor on the device (where new memory goes). Call it on the device's
    ``collective`` stream."""
    shard = torch.empty(bucket.shard_len, dtype=bucket.dtype, device=like.device)
    N = bucket.parts
    for run in groups(bucket):
        flats = []
        for i in run:
            g = grads.get(fqns[i])
            if g is not None:
                read(g)
            flats.append(torch.zeros(bucket.sizes[i], dtype=bucket.dtype, device=like.device)
                         if g is None else g.detach().reshape(-1))
        i = run.start
        if len(run) == 1 and bucket.sizes[i] == N * bucket.chunks[i]:
            flat = flats[0]   # reduced in place
        else:   # row r: rank r's piece of each, zero-padded (one kernel on a GPU)
            flat = torch._chunk_cat(flats, 0, N).reshape(-1)
        flat.div_(N)
        o = bucket.offsets[i]
        post("reduce_scatter", flat, shard[o:o + flat.numel() // N])
    return shard


def all_reduce_grads(post: Callable[[str, torch.Tensor, Any], None], bucket: Bucket,
                     fqns: Sequence[str], grads: dict[str, torch.Tensor | None],
                     like: torch.Tensor, read: Callable[[torch.Tensor], None] = lambda t: None
                     ) -> Callable[[], None]:
    """``bucket``'s gradients (``grads[fqn]``; None: zeros, put in ``grads``) averaged over
    the ranks in place on the device: each divided by the number of ranks and all-reduced
    by ``post``, one collective per :func:`groups` run (several packed side by side, as
    :func:`reduce_scatter_grads` packs them). Returns what copies the packed averages
    back into ``grads``, to call once the collectives completed. ``read``: as there."""
    pending: list[tuple[torch.Tensor, range]] = []
    for run in groups(bucket):
        flats = []
        for i in run:
            g = grads.get(fqns[i])
            if g is None:
                g = grads[fqns[i]] = torch.zeros(bucket.params[i].shape, dtype=bucket.dtype,
                                                 device=like.device)
            read(g)
            flats.append(g)
        flat = flats[0] if len(run) == 1 else torch.cat([g.detach().reshape(-1) for g in flats])
        flat.div_(bucket.parts)
        post("all_reduce", flat, None)
        if len(run) > 1:
            pending.append((flat, run))

    def unpack() -> None:
        with torch.no_grad():
            for flat, run in pending:
                at = 0
                for i in run:
                    g = grads[fqns[i]]
                    g.copy_(flat[at:at + g.numel()].view_as(g))
                    at += g.numel()
    return unpack


@dataclass
class Pieces:
    """What a ``DownloadGrads`` after a ``DeviceReduceScatter`` brought: this rank's shard
    of each of the stage's device buckets, on the host (there once the download's event
    ended)."""

    shards: list[tuple[Bucket, torch.Tensor]]

    def add_to(self, sums: dict[int, torch.Tensor]) -> None:
        """Add this rank's piece of each parameter to ``sums`` (``id(parameter) ->`` its
        piece, in its gradient dtype: a bf16 piece is widened)."""
        for bucket, shard in self.shards:
            for i, lo, hi, at in bucket.pieces():
                p = bucket.params[i]
                piece = shard[at:at + hi - lo]
                if id(p) in sums:
                    sums[id(p)].add_(piece)
                else:
                    sums[id(p)] = piece.to(grad_dtype(p), copy=True)


def shards_from_pieces(buckets: Sequence[Bucket], sums: dict[int, torch.Tensor]
                       ) -> list[Shard]:
    """The sharded step's shards of the host ``buckets`` (one stage's, cut in N), from
    the pieces the stage's downloads added to ``sums`` (taken out of it); a parameter with
    none counts as zero."""
    out = []
    for b in buckets:
        grad = torch.zeros(b.shard_len, dtype=b.dtype)
        for i, lo, hi, at in b.pieces():
            piece = sums.pop(id(b.params[i]), None)
            if piece is not None:
                grad[at:at + hi - lo].copy_(piece)
        out.append(Shard(b, grad))
    return out
