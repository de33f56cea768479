"""The host optimizer in the simulator: one training step's time in three modes.

- ``sync``: the optimizer steps every layer after the backward; every device waits
  (RoundPipe's synchronous mode): makespan + optimizer time.
- ``exact``: fxpipe's streamed step: an ``OptimizerStep`` per backward stage, on the one
  host optimizer, as soon as that stage's gradients are final (``with_optimizer_steps``);
  the step ends when the last of them does. The next step's first stage needs the
  layers stepped last, so steps do not overlap each other: the step time is the
  makespan of one step.
- ``async``: one-step-stale (RoundPipe's asynchronous mode): the update runs during the
  next step, so fill and drain overlap the neighbouring steps (the bubble left is
  intra + switch) and the optimizer costs nothing while it is shorter than a step.

>>> from fxpipe.passes.schedule import build_program
>>> from fxpipe.sim import Hardware, LayerCost
>>> p = build_program([range(0, 2)], [range(2, 4), range(0, 2)], "fused", 2, 4, "stage")
>>> costs = [LayerCost(1.0, 2.0, param_bytes=10**6)] * 4
>>> m = optimizer_modes(p, costs, Hardware(cpu_optimizer_bytes_per_s=10**9))
>>> m.optimizer_ms, m.compute_ms, m.sync_ms, m.exact_ms
(4.0, 32.0, 36.0, 34.0)
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass
from typing import Sequence

from fxpipe.passes.program import Accumulate, Commit, OptimizerStep, Program
from fxpipe.sim.hardware import Hardware, LayerCost
from fxpipe.sim.simulate import Semantics, simulate


@dataclass(frozen=True)
class OptimizerModes:
    """Step times (ms) of one Program with the host optimizer in each mode."""

    compute_ms: float      # makespan without the optimizer
    optimizer_ms: float    # host optimizer time for every layer
    sync_ms: float
    exact_ms: float
    async_ms: float

    @property
    def exact_exposed_ms(self) -> float:
        """How much the streamed step adds to the makespan."""
        return self.exact_ms - self.compute_ms

    def relative_throughput(self, base: str = "sync") -> dict[str, float]:
        """Throughput of each mode relative to ``base`` (steps per second ratio)."""
        ref = getattr(self, f"{base}_ms")
        return {m: ref / getattr(self, f"{m}_ms") for m in ("sync", "exact", "async")}

    def as_dict(self) -> dict:
        return {**asdict(self), "exact_exposed_ms": self.exact_exposed_ms}


def with_optimizer_steps(program: Program) -> Program:
    """``program`` with each backward stage's ``Accumulate`` in its host lane an
    ``OptimizerStep`` of its layers instead, streamed (each waits for every
    ``DownloadGrads`` of its stage, wherever they run). A Program that steps already is
    returned as is.

    >>> from fxpipe.passes.schedule import build_program
    >>> p = build_program([range(0, 1)], [range(1, 2), range(0, 1)], "fused", 2, 2, "stage")
    >>> [str(a) for a in with_optimizer_steps(p).host]
    ['RF', 'S1:2', 'S0:1', 'C']
    """
    if any(isinstance(a, OptimizerStep) for a in program.host):
        return program
    return dataclasses.replace(program, host=tuple(
        OptimizerStep(a.layers) if isinstance(a, Accumulate) else a for a in program.host))


def without_optimizer_steps(program: Program) -> Program:
    """``program`` with no ``OptimizerStep`` in its host lane: a streamed one becomes
    its stage's ``Accumulate``, one after the ``Commit`` goes."""
    host, committed = [], False
    for a in program.host:
        committed = committed or isinstance(a, Commit)
        if isinstance(a, OptimizerStep):
            if not committed:
                host.append(Accumulate(a.layers))
        else:
            host.append(a)
    return dataclasses.replace(program, host=tuple(host))


def optimizer_modes(program: Program, costs: Sequence[LayerCost], hardware: Hardware, *,
                    semantics: Semantics = "fxpipe") -> OptimizerModes:
    """Time one training step of ``program`` (a training Program) with the host optimizer
    synchronous, streamed (``exact``) and one-step stale (``async``);
    ``hardware.cpu_optimizer_bytes_per_s`` prices the layers' trainable masters on the
    host (``LayerCost.host_grads``: a frozen parameter is not stepped).
    """
    plain = without_optimizer_steps(program)
    t = simulate(plain, costs, hardware, semantics=semantics)
    layers = sorted({i for st in program.stages for i in st.layers})
    optimizer = hardware.optimizer_ms(sum(costs[i].host_grads for i in layers))
    streamed = with_optimizer_steps(plain)
    exact = simulate(streamed, costs, hardware, semantics=semantics).makespan
    steady = t.makespan * (1 - (t.fill + t.drain) / 100)
    return OptimizerModes(compute_ms=t.makespan, optimizer_ms=optimizer,
                          sync_ms=t.makespan + optimizer, exact_ms=exact,
                          async_ms=max(steady, optimizer))
