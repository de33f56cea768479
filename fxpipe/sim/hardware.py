"""What the simulator is told about the machine (``Hardware``) and the model (``LayerCost``).

Times are milliseconds, sizes bytes, rates per second::

    >>> hw = Hardware.rtx4090_pcie4()
    >>> round(hw.transfer_ms(25e9 / 1000, "h2d"), 3)        # 25 MB at 25 GB/s
    1.0
    >>> LayerCost.from_flops(165e9, hw).fwd_ms                # 165 GFLOP at 165 TFLOP/s
    1.0
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

INF = float("inf")

H200_HOST = dict(host_us_per_action=345.4, host_us_per_kernel=19.93, host_us_per_grad_kernel=37.43)
"""The host figures fitted to the one GPU run (an H200 VM's host, eager fp32 stage code;
``benchmarks/bench_host_model.py``): ``Hardware(**H200_HOST)`` prices issuing as that
host did."""

H200_HOST_REFIT = dict(host_us_per_action=129.3, host_us_per_kernel=12.87, host_us_per_grad_kernel=24.18)
"""A PROJECTION, not a GPU measurement: :data:`H200_HOST` scaled to the code of today by
CPU ratios (issue #55; ``benchmarks/bench_host_model.py`` derives it and its docstring
says how). ``host_us_per_action`` by the host cost of one action around an empty stage
(``bench_issue.action_cost``), today's code over the H200 run's (commit 38181b0), both
measured in one run on one CPU; the per-kernel figures by fxpipe's issue time over eager
PyTorch's dispatch of the same ops (``bench_issue.py``'s Llama-3.1-8B, 8 GPUs, 4K, eager
row), today's record over the record of the H200 run's code. For one issue thread: the
GPU measured eight threads' cost since (``gpu_check.json``'s ``many_devices``, the
``threads8`` figures of ``bench_host_model.py``). ``Hardware(**H200_HOST_REFIT)`` prices
issuing as the H200 run's host would if its costs had fallen as this CPU's did. The
inputs are minima of noisy timings: the action ratio read 0.265 in one record and 0.381
in the next with code no slower (2026-11-30); fxpipe's issue over eager PyTorch's
dispatch read 1.116 on 2026-11-30 and 0.990 on 2026-12-01, the eager path unchanged.
``tests/test_sim_host.py`` checks these are what
``benchmarks/results/bench_host_model.json``'s inputs give."""


_RING = {"all_reduce": (lambda N: 2 * (N - 1) / N, lambda N: 2 * (N - 1)),
         "reduce_scatter": (lambda N: (N - 1) / N, lambda N: N - 1),
         "all_gather": (lambda N: (N - 1) / N, lambda N: N - 1),
         "broadcast": (lambda N: 1.0, lambda N: N - 1)}
"""Per ring collective: the share of the buffer a node sends, and the messages in a row."""


@dataclass(frozen=True)
class Hardware:
    """A homogeneous set of devices attached to one host.

    - ``flops``: dense FLOP/s of one device (used by ``LayerCost.from_flops``).
    - ``memory``: bytes per device (``Timeline.memory_ok`` compares peaks with it).
    - ``h2d_bandwidth`` / ``d2h_bandwidth``: bytes/s of one device's host link.
    - ``shared_bus``: all devices share one host link per direction (transfers of
      different devices are serialized, first ready first served) instead of one each.
    - ``sockets``, ``socket_link_bytes_per_s``, ``host_memory``: a multi-socket host
      (NUMA). Devices are spread evenly over the sockets in order (device ``d`` of ``G``
      on socket ``d * sockets // G``). With ``host_memory="one_node"`` (what fxpipe does
      today: one thread first-touches the host buffers, so they sit on socket 0's memory),
      every transfer of a device on another socket also crosses the socket link (UPI,
      xGMI), which those transfers share per direction at ``socket_link_bytes_per_s``;
      ``"local"``: each stage's host memory on its devices' node, nothing crosses.
    - ``cpu_optimizer_bytes_per_s``: parameter bytes the host optimizer updates per s.
    - ``host_copy_bytes_per_s``: bytes per s a host action copies or reads (casts,
      snapshots, a gradient norm).
    - ``comm_ms_per_hop``: added to every activation hand-off between two devices
      (an ``Upload`` whose producer ran on another device).
    - ``transfers``: False makes every transfer (and the host optimizer) take no time,
      as RoundPipe's schedule simulator assumes; hand-off hops still apply.
    - Data parallel: ``ranks`` (one per node: a node's devices are one rank's pipeline),
      and each node's inter-node link: ``network_bytes_per_s`` (e.g. 25 GbE: ``3.125e9``;
      200 Gb/s InfiniBand: ``25e9``; 400 Gb/s: ``50e9``) and per-message
      ``network_latency_ms``. Every collective crosses it, the host's (gloo) and the
      devices' (NCCL) alike, one at a time per node, each taking a ring algorithm's time
      (:meth:`collective_ms`; the same rate for both: gloo's TCP and its host passes are
      not priced apart).
    - ``collectives``: where a data-parallel Program's collectives run
      (``fxpipe.sim.collectives`` says how each is priced): ``"host"``, what the runtime
      does with ``data_parallel=True`` on CPU devices (gloo on the host lane);
      ``"device"``: each backward stage's gradients reduce-scattered on its devices in
      ``param_dtype``, each rank downloading and stepping 1/N (a sharded Program lowered
      to what ``data_parallel="device"``'s Program prints; that Program itself is priced
      as it is, with any ``collectives``), or an all-reducing Program's all-reduced there
      (``data_parallel=True`` on GPUs); ``"zero3"``, MODELLED across nodes (the runtime
      runs it on one host's ranks): also each rank holding and uploading 1/N of the
      parameters, all-gathered on the devices before a stage computes. A field, not a ``simulate`` argument: like ``host_memory`` it says where
      the run puts its work, and every simulation of the run takes the ``Hardware``
      (``roundpipe_program``'s dispatch, ``optimizer_modes``), not ``simulate``'s keywords.
    - The host's issue time (``fxpipe.sim.simulate``'s issue pass): one host thread at a
      time issues the devices' actions (the executor's issue lock), each costing
      ``host_us_per_action``, plus, for a compute action, each kernel it launches
      (``Cost.fwd_kernels`` / ``bwd_kernels``) ``host_us_per_kernel`` without grad (a
      ``Forward``) or ``host_us_per_grad_kernel`` with grad (a recompute, a backward; by
      default ``host_us_per_kernel``). An action starts on its device no earlier than it
      was issued. All 0 by default (issuing free); :data:`H200_HOST` are the figures
      calibrated on the H200 kit run (``benchmarks/bench_host_model.py``).
    - ``device_bytes_per_s``: a device's memory bandwidth, at which a layer's dequantizes
      of quantized frozen weights (``LayerCost.dequant_bytes``, ``fxpipe.quant``) add to
      its forward and recompute times when those come from FLOPs.
    """

    flops: float = INF
    memory: float = INF
    h2d_bandwidth: float = INF
    d2h_bandwidth: float = INF
    shared_bus: bool = False
    cpu_optimizer_bytes_per_s: float = INF
    host_copy_bytes_per_s: float = INF
    comm_ms_per_hop: float = 0.0
    transfers: bool = True
    ranks: int = 1
    network_bytes_per_s: float = INF
    network_latency_ms: float = 0.0
    collectives: Literal["host", "device", "zero3"] = "host"
    sockets: int = 1
    socket_link_bytes_per_s: float = INF
    host_memory: Literal["one_node", "local"] = "one_node"
    host_us_per_action: float = 0.0
    host_us_per_kernel: float = 0.0
    host_us_per_grad_kernel: float | None = None
    device_bytes_per_s: float = INF

    def __post_init__(self) -> None:
        if self.collectives not in ("host", "device", "zero3"):
            raise ValueError("Hardware.collectives must be 'host', 'device' or 'zero3', got "
                             f"{self.collectives!r}")

    def issue_us(self, kernels: float, grad: bool) -> float:
        """The host's time to issue one action that launches ``kernels`` kernels.

        >>> Hardware(host_us_per_action=100, host_us_per_kernel=20).issue_us(10, grad=False)
        300.0
        """
        per = self.host_us_per_kernel if not grad or self.host_us_per_grad_kernel is None \
            else self.host_us_per_grad_kernel
        return float(self.host_us_per_action + kernels * per)

    @classmethod
    def rtx4090_pcie4(cls, **overrides) -> "Hardware":
        """RTX 4090 on PCIe 4.0 x16: 165 dense bf16 TFLOP/s, 24 GiB, ~25 GB/s each way,
        1,008 GB/s of device memory bandwidth.

        >>> Hardware.rtx4090_pcie4(shared_bus=True).shared_bus
        True
        """
        base = dict(flops=165e12, memory=24 * 2**30, h2d_bandwidth=25e9, d2h_bandwidth=25e9,
                    device_bytes_per_s=1008e9)
        return cls(**{**base, **overrides})

    def transfer_ms(self, nbytes: float, direction: Literal["h2d", "d2h"],
                    crossing: bool = False) -> float:
        """Time to move ``nbytes`` over one device's link (0 when transfers are free);
        ``crossing``: through the socket link too, at the slower of the two."""
        if not self.transfers or nbytes <= 0:
            return 0.0
        bw = self.h2d_bandwidth if direction == "h2d" else self.d2h_bandwidth
        if crossing:
            bw = min(bw, self.socket_link_bytes_per_s)
        return nbytes / bw * 1e3

    def crosses_socket(self, device: int, num_devices: int) -> bool:
        """Whether ``device``'s host transfers cross the socket link (class docstring).

        >>> hw = Hardware(sockets=2, socket_link_bytes_per_s=40e9)
        >>> [hw.crosses_socket(d, 8) for d in range(8)]
        [False, False, False, False, True, True, True, True]
        >>> Hardware(sockets=2, host_memory="local").crosses_socket(7, 8)
        False
        """
        return (self.sockets > 1 and self.host_memory == "one_node"
                and device * self.sockets // num_devices != 0)

    def optimizer_ms(self, nbytes: float) -> float:
        """Host optimizer time for ``nbytes`` of parameters."""
        if not self.transfers or nbytes <= 0:
            return 0.0
        return nbytes / self.cpu_optimizer_bytes_per_s * 1e3

    def host_copy_ms(self, nbytes: float) -> float:
        """Host time to copy (or read once) ``nbytes``."""
        if not self.transfers or nbytes <= 0:
            return 0.0
        return nbytes / self.host_copy_bytes_per_s * 1e3

    def collective_ms(self, kind: Literal["all_reduce", "reduce_scatter", "all_gather",
                                          "broadcast"], nbytes: float) -> float:
        """Time of a ring collective over ``ranks`` nodes on ``nbytes`` (the whole
        buffer): an all-reduce sends ``2 (N-1)/N`` of it per node in ``2 (N-1)`` steps, a
        reduce-scatter or all-gather half that; a broadcast (pipelined) about the buffer.

        >>> round(Hardware(ranks=4, network_bytes_per_s=1e9).collective_ms("all_reduce", 1e9))
        1500
        """
        if self.ranks <= 1 or nbytes <= 0:
            return 0.0
        return (self.collective_bytes(kind, nbytes) / self.network_bytes_per_s * 1e3
                + _RING[kind][1](self.ranks) * self.network_latency_ms)

    def collective_bytes(self, kind: Literal["all_reduce", "reduce_scatter", "all_gather",
                                             "broadcast"], nbytes: float) -> float:
        """The bytes one node sends over its link in a ring collective on ``nbytes``
        (:meth:`collective_ms`); 0 with one rank.

        >>> Hardware(ranks=4).collective_bytes("reduce_scatter", 1e9)
        750000000.0
        """
        if self.ranks <= 1 or nbytes <= 0:
            return 0.0
        return nbytes * _RING[kind][0](self.ranks)

    def compute_ms(self, flops: float) -> float:
        """Time for ``flops`` floating-point operations on one device."""
        return flops / self.flops * 1e3

    def nominal_device(self, host_grad_bytes_per_param: float = 2.0):
        """This machine as the planner's device model (``ExecutePlan.auto(device=...)``):
        the layers' FLOPs at ``flops`` as the simulator times them, the host link, and
        the gradient bytes the host takes in per second as the simulator prices a
        streamed ``OptimizerStep``: each parameter's fp32 master stepped at
        ``cpu_optimizer_bytes_per_s`` and, for gradients downloaded narrower
        (``host_grad_bytes_per_param`` < 4; bf16: 2), widened at ``host_copy_bytes_per_s``.
        What this machine leaves free (infinite) stays free; infinite ``flops`` keep the
        nominal device's.

        >>> hw = Hardware(flops=400e12, h2d_bandwidth=50e9, cpu_optimizer_bytes_per_s=8e9,
        ...               host_copy_bytes_per_s=8e9)
        >>> d = hw.nominal_device()
        >>> d.flops_per_s, d.link_bytes_per_s, round(d.host_grad_bytes_per_s)   # 1 ns a byte
        (400000000000000.0, 50000000000.0, 2000000000)
        """
        from fxpipe.passes.chain_costs import NOMINAL_DEVICE, NominalDevice
        widen = 4 / self.host_copy_bytes_per_s if host_grad_bytes_per_param < 4 else 0.0
        per_param = 4 / self.cpu_optimizer_bytes_per_s + widen   # host seconds
        return NominalDevice(flops_per_s=self.flops if self.flops < INF else NOMINAL_DEVICE.flops_per_s,
                             bytes_per_s=INF, layer_overhead_ms=0.0,
                             link_bytes_per_s=min(self.h2d_bandwidth, self.d2h_bandwidth),
                             host_grad_bytes_per_s=host_grad_bytes_per_param / per_param
                             if per_param > 0 else INF)


@dataclass(frozen=True)
class LayerCost:
    """Per-microbatch cost of one layer.

    - ``fwd_ms``, ``bwd_ms``: forward and backward time (backward excludes recompute).
    - ``recompute_ms``: the forward re-run before backward (default ``fwd_ms``).
    - ``param_bytes``, ``grad_bytes`` (default ``param_bytes``): on a device.
    - ``host_param_bytes``, ``host_grad_bytes`` (default: as on a device): on the host,
      where they differ (mixed precision: the fp32 masters, which the optimizer steps, and
      their gradients, which a collective sums). A download moves the narrower of the
      two (``downloaded_grads``: bf16 gradients cross the link as they are and are
      widened on the host).
    - ``boundary_bytes``: activations leaving the layer (live across the cut after it);
      also the size of their gradient.
    - ``saved_bytes``: activations one microbatch keeps for this layer's backward.
    - ``fwd_kernels``, ``bwd_kernels``: the kernels its forward and its backward launch
      (what the host pays per kernel to issue, ``Hardware.host_us_per_kernel``).
    - ``dequant_bytes``: the device memory traffic of the dequantizes its forward (and a
      recompute) runs (``fxpipe.quant``); :meth:`of` prices it.

    >>> LayerCost(7.4, 15.8).recompute
    7.4
    """

    fwd_ms: float
    bwd_ms: float
    recompute_ms: float | None = None
    param_bytes: int = 0
    grad_bytes: int | None = None
    boundary_bytes: int = 0
    saved_bytes: int = 0
    host_param_bytes: int | None = None
    host_grad_bytes: int | None = None
    fwd_kernels: int = 0
    bwd_kernels: int = 0
    dequant_bytes: int = 0

    @property
    def host_params(self) -> int:
        return self.param_bytes if self.host_param_bytes is None else self.host_param_bytes

    @property
    def host_grads(self) -> int:
        return self.grads if self.host_grad_bytes is None else self.host_grad_bytes

    @property
    def downloaded_grads(self) -> int:
        """The gradient bytes a download moves: the device's, unless the host's are fewer.

        >>> LayerCost(1, 2, param_bytes=2, host_grad_bytes=4).downloaded_grads
        2
        """
        return min(self.grads, self.host_grads)

    @property
    def recompute(self) -> float:
        return self.fwd_ms if self.recompute_ms is None else self.recompute_ms

    @property
    def grads(self) -> int:
        return self.param_bytes if self.grad_bytes is None else self.grad_bytes

    @classmethod
    def of(cls, cost, hardware: Hardware) -> "LayerCost":
        """From a ``fxpipe.passes.costs.Cost`` (or anything with its fields): measured
        times where it has them, else its FLOPs on ``hardware``.

        >>> from types import SimpleNamespace as C
        >>> c = C(fwd_ms=None, bwd_ms=None, recompute_ms=None, fwd_flops=165e9,
        ...       bwd_flops=330e9, param_bytes=8, grad_bytes=8, boundary_bytes=4, saved_bytes=2)
        >>> lc = LayerCost.of(c, Hardware.rtx4090_pcie4())
        >>> lc.fwd_ms, lc.bwd_ms, lc.recompute, lc.param_bytes
        (1.0, 2.0, 1.0, 8)
        """
        dequant = getattr(cost, "dequant_bytes", 0)
        ms = lambda t, flops: hardware.compute_ms(flops) if t is None else t  # noqa: E731
        fwd = ms(cost.fwd_ms, cost.fwd_flops)
        if cost.fwd_ms is None:   # a measured time has the dequantizes in it
            fwd += dequant / hardware.device_bytes_per_s * 1e3
        return cls(fwd, ms(cost.bwd_ms, cost.bwd_flops),
                   cost.recompute_ms, cost.param_bytes, cost.grad_bytes, cost.boundary_bytes,
                   cost.saved_bytes, getattr(cost, "host_param_bytes", None),
                   getattr(cost, "host_grad_bytes", None),
                   getattr(cost, "fwd_kernels", None) or 0, getattr(cost, "bwd_kernels", None) or 0,
                   dequant)

    @classmethod
    def from_flops(cls, fwd_flops: float, hardware: Hardware, bwd_flops: float | None = None,
                   **sizes) -> "LayerCost":
        """Times from FLOPs on ``hardware`` (backward defaults to 2x forward)."""
        bwd = 2 * fwd_flops if bwd_flops is None else bwd_flops
        return cls(hardware.compute_ms(fwd_flops), hardware.compute_ms(bwd), **sizes)
