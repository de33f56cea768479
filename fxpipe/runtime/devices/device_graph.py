"""Device graphs: a function's kernels recorded once and replayed (``Device.capture``).

A device graph (a CUDA graph on a GPU) records the kernels ``fn(*inputs)`` launches and
the memory they read and write: the ``inputs`` and the outputs it made. A replay
launches them all at once, with no Python and one launch for the host to issue, over
the *same memory*: a replay computes on whatever the captured inputs hold now and
writes its results into the captured outputs (the previous replay's results are
overwritten). That is the static-address rule: what a replay reads must be in the
buffers the capture saw. On a GPU, a replay over buffers that moved or were freed
computes garbage silently.

- :class:`EmulatedGraph` (virtual devices): ``capture`` runs ``fn`` once (a GPU's
  warm-up: its result is the capturing call's); ``replay`` runs it again on the captured
  inputs and copies its results into the captured outputs, as the graph's kernels would
  write them. On a ``strict`` device (cuda-sim) a replay whose captured memory was
  freed since raises :class:`GraphReplayError`, where a GPU would compute garbage, and
  an op reading a device value on the host during the capture (``HOST_READS``:
  ``.item()``, ``nonzero``) raises :class:`GraphCaptureError`, as a GPU's capture fails
  there (the emulated replay reruns the Python, so it would not show the op is not redone).
  A strict device also keeps each graph's working set reserved for the graph's life, as
  a GPU's graph pool does (``VirtualDevice.capture``): its replays allocate nothing new.
  And a capture starts once its device's other streams have run what was submitted
  before it, as ``torch.cuda.graph``'s synchronize makes a GPU's wait
  (``Device.drain_for_capture``, which ``runtime.stages.graphs`` calls before taking
  the process's capture lock, so no capture waits for another device's queue).
- ``fxpipe.runtime.devices.cuda.CudaGraph``: ``torch.cuda.CUDAGraph``, captured on a side stream
  after a warm-up run, in the device's graph memory pool.

``fxpipe.runtime.stages.graphs`` decides what is captured (stage jobs under
``RunConfig(stage_backend="cudagraphs")``) and keeps the parameters in fixed buffers.

>>> from fxpipe.runtime.devices.emulator import VirtualDevice
>>> d = VirtualDevice()
>>> x = d.to_device(torch.ones(2), kind="activations", owner="a test")
>>> g = d.submit("compute", d.capture, lambda t: (t * 2,), (x,)).result()
>>> g.first[0]                          # the capture's own run
tensor([2., 2.])
>>> _ = x.fill_(5.0)                    # new data, in the captured buffer
>>> d.submit("compute", g.replay).result()[0]
tensor([10., 10.])
>>> d.close()
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class GraphReplayError(RuntimeError):
    """A device graph would replay over buffers that are not the ones it captured (moved
    or freed since): on a GPU it would compute garbage. Names the graph and the buffer."""


class GraphCaptureError(RuntimeError):
    """A function cannot be captured as a device graph: it reads device values on the
    host (``.item()``, a data-dependent shape), which a GPU refuses during a capture and a
    replay would not redo. Names the graph and the op."""


# ops whose result the host reads from the device (a sync): refused in a capture
HOST_READS = frozenset({
    torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default,
    torch.ops.aten.masked_select.default, torch.ops.aten._unique2.default,
    torch.ops.aten.unique_consecutive.default, torch.ops.aten.unique_dim.default,
    torch.ops.aten.repeat_interleave.Tensor,
})


class _NoHostReads(TorchDispatchMode):
    """A capture on a strict device: an op in ``HOST_READS`` raises ``GraphCaptureError``
    (a GPU's capture fails there: ``cudaErrorStreamCaptureUnsupported``)."""

    def __init__(self, name: str):
        super().__init__()
        self.name = name

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in HOST_READS:
            raise GraphCaptureError(
                f"{self.name}: {func} reads a device value on the host (a sync), which a "
                "CUDA graph capture refuses and a replay would not redo. Such a stage cannot "
                "run as a device graph: use stage_backend='inductor' (or make the op's "
                "result not depend on tensor values)")
        return func(*args, **(kwargs or {}))


class DeviceGraph:
    """A captured function: :meth:`replay` runs its kernels again over ``inputs`` and
    returns ``outputs`` (the same tensors every replay, overwritten by each). ``first``:
    what the capture's own run of ``fn`` returned (a GPU's warm-up run: the capture
    itself computes nothing), the result of the call that captured it; ``fn``'s writes
    to its inputs (a gradient added into a buffer) happened once, in that run."""

    name: str
    inputs: tuple[torch.Tensor, ...]
    outputs: tuple[torch.Tensor, ...]
    first: tuple[Any, ...]

    def replay(self) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError


class EmulatedGraph(DeviceGraph):
    """A device graph on a device without graphs (see the module docstring): the
    capture runs ``fn``; each replay runs it again and writes the results into the
    captured outputs. ``check``: whether a tensor is still in the device's memory
    (a strict device's rule; ``None``: not checked)."""

    def __init__(self, fn: Callable[..., Sequence[Any]], inputs: Sequence[torch.Tensor],
                 name: str, check: Callable[[torch.Tensor], bool] | None = None,
                 pooled: Callable[[], contextlib.AbstractContextManager] | None = None):
        self.fn = fn
        self.name = name
        self.inputs = tuple(inputs)
        self._check = check
        # a replay's run allocates inside this (its temporaries are in the graph's pool,
        # held since the capture: not allocated again)
        self._pooled = pooled or contextlib.nullcontext
        self._held = tuple(t for t in self.inputs if check is not None and check(t))
        with _NoHostReads(name) if check is not None else contextlib.nullcontext():
            self.outputs = self.first = tuple(fn(*self.inputs))

    def replay(self) -> tuple[torch.Tensor, ...]:
        for t in self._held:
            if not self._check(t):
                raise GraphReplayError(
                    f"{self.name}: a replay reads a {tuple(t.shape)} {t.dtype} buffer the "
                    "capture saw in device memory, and that memory was freed since: on a GPU "
                    "the graph would read whatever is there now. Keep every buffer a graph "
                    "reads allocated for as long as it is replayed")
        with torch.no_grad(), self._pooled():
            for out, new in zip(self.outputs, self.fn(*self.inputs)):
                if isinstance(out, torch.Tensor):
                    out.copy_(new)
        return self.outputs
