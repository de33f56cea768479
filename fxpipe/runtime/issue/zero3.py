"""``data_parallel="zero3"``: the ranks of one host share one copy of the parameters, and
each rank uploads 1/N of every stage.

With ``data_parallel="device"`` every rank keeps the whole model in host memory (N
copies on a host of N ranks), uploads every stage whole, and gathers each step's
stepped shards back over gloo (``AG``). With ``"zero3"``:

- **One host copy.** The parameters' flat host buffers (``HostParams``) are files in
  ``/dev/shm`` that every rank maps (:meth:`Zero3.share_params`, at compile). Rank 0
  fills them with its parameters; the others map them and drop their own values (as
  ``DistributedDataParallel`` broadcasts rank 0's). ``model.parameters()`` stay the
  parameters, whole, on every rank. Buffers stay each rank's own.
- **1/N uploaded.** Each ``Prefetch`` uploads this rank's part ``[r*c, (r+1)*c)`` of each
  of the stage's parameter runs (``ParamStore.upload``, ``c = ceil(numel / N)``), and a
  ``DeviceAllGather`` after it fills in the other ranks' parts on the device's
  collective stream (NCCL on GPUs, gloo on virtual devices), before the stage computes.
- **No gather of the step.** Gradients are reduce-scattered on the devices and each rank
  steps its shard, as with ``"device"``; the step writes its 1/N into the shared
  parameters (from the fp32 masters under ``param_dtype``: :meth:`Zero3.publish`). The
  host lane's last action, a ``Barrier`` (``SY``), keeps every rank from uploading for
  its next call before every rank has written.

Each rank reads from the host only its own part of each run (its upload), and writes
only the pieces it steps; a piece stepped in a call was uploaded by every rank before
the reduce-scatter that precedes its step. So the only cross-rank ordering is the
``Barrier``.

Not built (``NotImplementedError`` at compile or call): ranks on several hosts (each
host would need every rank's stepped part), a call that synchronizes without stepping
(every rank's own ``opt.step()`` would step the one shared copy N times; it is refused
at the step, too) and the asynchronous optimizer. Every call is collective, inference
too (its stages gather their parameters). Under ``stage_backend="cudagraphs"`` a stage's
part is uploaded into its parameter slot and gathered there, in place.
"""

from __future__ import annotations

import os
import socket
import tempfile
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from fxpipe.runtime.host.buckets import Shard
from fxpipe.runtime.host.masters import refuse_outside_step
from fxpipe.runtime.host.params import HostParams


class Zero3:
    """``data_parallel="zero3"``'s part of ``DataParallel`` (module docstring). Needs the
    attributes annotated below from the class that has it as a base."""

    rank: int
    world: int
    shard: bool
    group: Any
    store: Any
    shard_masters: Callable[..., None]
    _post: Callable[..., None]
    stamp: Callable[[Any], None]
    all_gather: Callable[[Sequence[Shard]], None]

    def __init__(self, zero3: bool = False) -> None:
        self.zero3 = zero3

    def prepare_params(self, params: Mapping[str, torch.Tensor], param_dtype: Any,
                       host: HostParams) -> None:
        """At compile: ``shard_optimizer`` with ``param_dtype`` shards the fp32 masters
        (``ShardedMasters.shard_masters``); then ``"zero3"`` shares the parameters
        (:meth:`share_params`)."""
        if self.shard and param_dtype is not None:
            self.shard_masters(params, param_dtype, host)
        if self.zero3:
            self.share_params(host, params)

    def share_params(self, host: HostParams, params: Mapping[str, torch.Tensor]) -> None:
        """At compile, on every rank: move ``params`` (the model's) into host buffers the
        ranks share, filled with rank 0's values."""
        adopted = [name for name, p in params.items() if id(p) in host.slots]
        if adopted and len(adopted) == len(params) and host.shared_regions:
            return   # an earlier zero3 pipe of this model (another input shape) shared them
        if adopted:
            raise ValueError(
                f"data_parallel='zero3' puts the parameters in host memory the ranks share, "
                f"but an earlier pipe of this model already laid {adopted[0]!r} out in its own "
                "host buffers: compile the zero3 pipe first, or a freshly built model (or one "
                "loaded again)")
        names = [None] * self.world
        dist.all_gather_object(names, socket.gethostname(), group=self.group)
        if len(set(names)) > 1:
            raise NotImplementedError(
                f"data_parallel='zero3' shares one host copy of the parameters among the ranks "
                f"of one host; these ranks run on {len(set(names))} hosts ({sorted(set(names))}). "
                "Across hosts use data_parallel='device' (optimizer state and fp32 masters "
                "sharded, the parameters whole on every rank)")
        if self.rank == 0:
            self.store.set("fxpipe/zero3", uuid.uuid4().hex[:16])
        key = self.store.get("fxpipe/zero3").decode()
        base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        paths: list[str] = []

        def path(region: int) -> str:
            paths.append(os.path.join(base, f"fxpipe-zero3-{key}-{region}"))
            return paths[-1]

        groups = [[(n, p, False) for n, p in params.items()]]
        host.shared, host.fill_shared = path, self.rank == 0
        try:
            if self.rank == 0:   # fills them
                host.adopt(groups)
            dist.barrier(group=self.group)
            if self.rank != 0:   # maps them
                host.adopt(groups)
            dist.barrier(group=self.group)
        finally:
            host.shared, host.fill_shared = None, True
            if self.rank == 0:   # every rank holds its map: the names can go
                for p in paths:
                    try:
                        os.unlink(p)
                    except FileNotFoundError:
                        pass
        refuse_outside_step(params.values(), _STEP_REFUSED)

    def publish(self, shards: Sequence[Shard]) -> None:
        """The stepped ``shards`` into every rank's parameters: with ``"zero3"`` this
        rank's pieces written into the shared parameters (from its fp32 masters, cast,
        where it keeps them; else the step wrote them there), no collective; else
        ``all_gather``."""
        if not self.zero3:
            self.all_gather(shards)
            return
        with torch.no_grad():
            for sh in shards:
                b = sh.bucket
                for i, lo, hi, _ in b.pieces():
                    if b.masters[i] is not None:
                        b.params[i].detach().view(-1)[lo:hi].copy_(b.masters[i])
                self.stamp(b.names)

    def barrier(self) -> None:
        """``Barrier``: every rank has written what it stepped (an all-reduce of one
        element on the host lane, in the Program's order)."""
        self._post("all_reduce", torch.zeros(1), "barrier after the ranks' parameter writes")


_STEP_REFUSED = (
    "which data_parallel='zero3' ranks share in host memory, each stepping its 1/N in the "
    "pipe: a step of the whole parameter on every rank would step it once per rank. Let the "
    "pipe step it: pipe.forward_backward(..., optimizer=opt) (with "
    "fxpipe.optim.overlapped(opt, max_grad_norm=..., accumulate=...) for clipping and "
    "accumulation), or compile with data_parallel='device' to step with your own loop")
