"""What a pipe shows: its layers, stages and plan, the code and the Program of each kind
of call, the counters of the last call, a trace of its streams and the measured layer
times. ``PipelineModule`` (``fxpipe.api``) is an ``Inspecting``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch
import torch.nn as nn  # noqa: F401 — the examples use it

from fxpipe.passes.layer_graph import LayerGraph
from fxpipe.passes.program import Program
from fxpipe.passes.stage import Stage
from fxpipe.plan import ExecutePlan
from fxpipe.runtime.stages.graphs import not_capturable
from fxpipe.runtime.stages.stage_code import runnable_code
from fxpipe.runtime.stages.timer import LayerTimer
from fxpipe.runtime.issue.trace import trace as _trace


class Inspecting:
    """The inspecting methods of ``PipelineModule``. Reads its ``_current`` (the compiled
    graph serving calls), ``devices``, ``config``, ``_config``, ``_log`` and ``_executable``."""

    @property
    def layers(self) -> LayerGraph:
        """The layer chain, each layer with its costs (``pipe.layers[i].cost``)."""
        return self._current.layers

    @property
    def stages(self) -> list[Stage]:
        """The forward stages an inference call runs (``pipe.code("infer")``)."""
        exe = self._executable("infer")
        return [exe.stages[i] for i in sorted(exe.stages)]

    @property
    def plan(self) -> ExecutePlan:
        """The plan the next training step (``forward_backward``, the pipe's default run
        type) runs, before and after the first call. For a Hugging Face model's own loss
        that is the chain without the logits no loss reads, as ``pipe.code("fused")``
        shows it (unless a call's ``loss_fn`` read them: from then on, the full chain's);
        a call that returns the logits, ``pipe(x)`` included, runs the full chain's plan.
        ``print(pipe)`` shows both where they differ."""
        return self._current.fused(self.module).plan

    @property
    def stage_backend(self) -> str:
        """What runs the stage code of this pipe's calls: ``RunConfig.stage_backend``
        resolved for its devices. ``"auto"`` (the default where every device is a GPU:
        inductor where it compiles), ``"eager"`` (the default on CPU devices),
        ``"inductor"`` or ``"cudagraphs"``."""
        return self._config(None).stage_backend

    @property
    def timings(self) -> LayerTimer:
        """Measured per-layer times (forward, recompute, backward), the table
        ``ExecutePlan.auto`` and ``fxpipe.simulate`` read once every layer has them:
        ``pipe.timings.costs(pipe.layers)`` gives the layers' costs with them filled in."""
        return self._current.timer

    def code(self, run_type: Literal["infer", "train", "fused", "generate"] = "fused",
             grain: Literal["stage", "layer"] | None = None, *, runnable: bool = False,
             sequence_chunks: int | None = None) -> str:
        """The code of every GraphModule a call of ``run_type`` executes (forward,
        backward and fused-tail stages; at ``grain="layer"`` the layer pieces of split
        backward stages), each starting with its ``# stage ...`` header line.
        ``grain=None``: the pipe's ``recompute_grain`` (``"stage"`` unless its config
        says otherwise). ``runnable=True``: the code the runtime executes for each
        (``fxpipe.runtime.stages.stage_code.runnable``): the same graph with each transfer node
        a plain call serving what the Program's actions moved, layer marks, and for a
        stage with a tail its recompute too, the tail's nodes unfilled.
        ``"generate"``: the prefill's stages, then a decode step's (``pipe.generate``),
        each layer's KV cache read with the stage's buffers and written back. Under a
        model-level ``RunConfig(stage_backend=...)`` each stage says which backend runs
        it (its runnable code: which layers run compiled, sharing which artifact).
        ``sequence_chunks=K``: the code of a call in ``K`` token chunks, each attention a
        ``chunk_attention`` over the earlier chunks' keys (``fxpipe.sequence_chunks``)."""
        if sequence_chunks is not None:
            return self._code(self._chunked_executable(run_type, sequence_chunks, grain=grain),
                              runnable)
        if run_type == "generate":
            from fxpipe.generation import inspected_steps
            parts = zip(("# prefill", "# each decode step"), inspected_steps(self).executables())
            return "\n".join(f"{title}\n{self._code(exe, runnable)}" for title, exe in parts)
        return self._code(self._executable(run_type, grain=grain), runnable)

    def _code(self, exe: Any, runnable: bool) -> str:
        backend = self.stage_backend
        if runnable:
            return runnable_code(exe, self.devices, backend=backend)
        if backend in (None, "eager"):
            return exe.code()
        says = (f"# run by stage_backend={backend!r}: pipe.code(..., runnable=True) shows its "
                "compiled layer calls\n")
        pieces = {id(p) for p in exe.pieces.values()}
        return "\n\n".join(says + _graph_line(backend, st, id(st) in pieces)
                           + st.gm.code.strip("\n") for st in exe.graph_modules()) + "\n"

    def __str__(self) -> str:
        exe, plan = self._executable("infer"), self._current.base.plan
        spans = lambda p: f"fwd [{', '.join(f'{r.start}:{r.stop}' for r in p.fwd_plan)}] " \
            f"bwd [{', '.join(f'{r.start}:{r.stop}' for r in p.bwd_plan)}]"  # noqa: E731
        head = (f"# PipelineModule: {len(self.layers)} layers on "
                f"{', '.join(d.name for d in self.devices)}; plan {spans(plan)}\n")
        fused = None if self._infer_only else self.plan
        if fused is not None and fused != plan:
            head += (f"# forward_backward runs plan {spans(fused)} (pipe.plan): its chain "
                     "leaves out the outputs no loss reads\n")
        head += ("# what pipe(x) runs: its Program's actions in an order they allow; "
                 "pipe.program(run_type) prints\n# a call's lanes, pipe.code(run_type) its "
                 "stages' code\n")
        return head + exe.listing([d.name for d in self.devices], self.layers.input_names)

    def extra_repr(self) -> str:
        return (f"layers={len(self.layers)}, stages={len(self.stages)}, "
                f"devices=[{', '.join(d.name for d in self.devices)}]")

    def program(self, run_type: Literal["infer", "train", "fused", "generate"] = "fused",
                num_microbatch: int | None = None, optimizer: Any = False,
                grain: Literal["stage", "layer"] | None = None, *,
                input_grads: bool | Sequence[str] = False, return_outputs: bool = False,
                sync_gradients: bool = True, sequence_chunks: int | None = None) -> Program:
        """The Program a call of ``run_type`` runs, every action included: per device its
        ordered actions, and the host lane: the ``Refresh`` of the parameters' upload
        copies, what takes each stage's downloaded gradients (``Accumulate``, or with
        ``optimizer=`` the streamed ``OptimizerStep``s), the ``Commit``, and after it
        what needs every ``.grad`` (clipping, a ``GradScaler`` step, the asynchronous
        update's queueing). ``optimizer``: what the call's ``optimizer=`` is: a torch
        optimizer or ``fxpipe.optim.overlapped(...)`` (its mode, ``max_grad_norm``,
        ``speculate``, ``scaler``), or ``True``/``"exact"``/``"async"``. The call and
        this method build the same ``CallSpec``, hence the same Executable.
        ``num_microbatch`` and ``grain`` (``None``) default to the pipe's config;
        ``return_outputs``: a fused call that also brings the model's outputs to the host
        (``forward_backward(..., return_outputs=True)``). A data-parallel pipe's training
        Programs hold their collectives (``BC``, ``AR``; ``RS`` and ``AG`` with
        ``shard_optimizer``) unless ``sync_gradients=False``. ``input_grads``: a training
        call whose inputs require grad (``True``: every floating model input; or their
        names), whose gradients the Program offloads to the host (its ``input-grads``
        line). ``"generate"``: a ``GenerationProgram``, the prefill's Program and a
        decode step's (``pipe.generate``; the last call's batch and cache, else the
        example's batch). ``sequence_chunks=K``: a call in ``K`` token chunks of the
        example's sequence, one chunk per microbatch (``fxpipe.sequence_chunks``).

        >>> import fxpipe
        >>> model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        >>> pipe = fxpipe.compile(model, example_inputs=(torch.randn(6, 4),), devices=["cpu"] * 2)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> p = pipe.program("fused", num_microbatch=2, optimizer=fxpipe.optim.overlapped(
        ...     opt, max_grad_norm=1.0, speculate=False))
        >>> [str(a) for a in p.host]
        ['RF', 'M2:3', 'M1:2', 'M0:1', 'C', 'N', 'S2:3', 'S1:2', 'S0:1']
        """
        if run_type == "generate":
            from fxpipe.generation import GenerationProgram, inspected_steps
            steps = inspected_steps(self)
            prefill, decode = steps.executables()
            return GenerationProgram(prefill.program, decode.program, steps.cache_line(),
                                     steps.chunk)
        if sequence_chunks is not None:
            return self._chunked_executable(run_type, sequence_chunks, optimizer=optimizer,
                                            grain=grain, return_outputs=return_outputs,
                                            sync_gradients=sync_gradients).program
        return self._executable(run_type, num_microbatch, optimizer=optimizer, grain=grain,
                                return_outputs=return_outputs, sync_gradients=sync_gradients,
                                input_grads=self._input_grads(input_grads)).program

    def _input_grads(self, input_grads: bool | Sequence[str]) -> tuple[str, ...]:
        """The model inputs ``program(input_grads=...)`` names (``True``: every floating
        one)."""
        lg = self._current.layers
        tensors = [x for x in lg.example_leaves if isinstance(x, torch.Tensor)]
        floating = [n for n, x in zip(lg.input_names, tensors)
                    if x.is_floating_point() or x.is_complex()]
        if input_grads is True:
            return tuple(floating)
        if input_grads is False:
            return ()
        if isinstance(input_grads, str) or not all(isinstance(n, str) for n in input_grads):
            raise TypeError(f"input_grads must be True, False or a list of input names, got "
                            f"{input_grads!r}")
        unknown = [n for n in input_grads if n not in floating]
        if unknown:
            raise ValueError(f"input_grads names {unknown}, which are not floating inputs of the "
                             f"model; its floating inputs are {floating}")
        return tuple(n for n in lg.input_names if n in set(input_grads))

    def stats(self) -> dict[str, int]:
        """Counters of the last call (empty before the first), a flat dict: ``actions``
        executed; ``host_waits``, the times a host thread waited for device work (a host
        action waiting for the events it reads, e.g. each backward stage's ``Accumulate``
        or ``OptimizerStep`` reading its downloaded gradients, and the end of the call);
        bytes moved: ``h2d_bytes_params``,
        ``h2d_bytes_activations`` (inputs, boundary values and their gradients),
        ``h2d_bytes_grads`` (``data_parallel="device"``: the accumulated ``.grad`` an
        ``sRS+`` or ``sAR+`` adds on the devices), ``d2h_bytes_activations``,
        ``d2h_bytes_grads``, ``d2h_bytes_cache`` (a
        generation's KV cache written back: ``pipe.generate``'s step calls);
        ``generated_runs`` (stage runs,
        each as its generated code: ``pipe.code(..., runnable=True)``); ``host_stalls``,
        the copies between a device and pageable (not page-locked) host memory, each of which blocks
        the issuing thread on a GPU (counted on GPUs and ``VirtualDevice(semantics="cuda")``;
        0 when the pipe pins, see ``compile``'s ``pin_memory``); ``host_pinned_bytes``,
        the page-locked host bytes fxpipe reserved for this pipe at the end of the call
        (its host parameter, copy and gradient buffers and its staging, each rounded up to
        a page); ``issue_waits``, prefetches whose issue waited for released parameter
        memory, and ``allocator_flushes``, the times a device's allocator gave its cache
        back at its limit; ``host_issue_us``, the host time the issue threads spent
        submitting actions (on a GPU: the Python that queues their kernels and copies),
        and per action kind ``host_issue_us.<Kind>`` (e.g. ``host_issue_us.Prefetch``);
        ``stage_compiles`` and ``stage_compile_us``, what the stage backend compiled during
        the call and the time it took (``RunConfig.stage_backend``: 0 for eager stage code,
        and for a call whose every layer segment an earlier call or pipe in this process
        compiled already: ``runtime.stages.compiled.compile_totals``). An eager-style step
        is two calls: ``pipe(x)`` and ``.backward()``.

        >>> import fxpipe
        >>> model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        >>> pipe = fxpipe.compile(model, example_inputs=(torch.randn(6, 4),), devices=["cpu"] * 2)
        >>> loss = pipe.forward_backward((torch.randn(6, 4),), loss_fn=lambda out, _: out.sum())
        >>> pipe.stats()["host_waits"], pipe.stats()["h2d_bytes_params"]   # 3 stages' M, the end
        (4, 392)
        """
        return dict(self._log.stats)

    def trace(self, path: str | None = None):
        """Record the devices' streams during a ``with`` block into a timeline (the
        simulator's ``Timeline``: ``plot``, ``to_chrome_trace``, ``bubble_ratio``)::

            with pipe.trace("run.json") as rec:
                pipe.forward_backward((x,), label=y, loss_fn=loss_fn)
            rec.timeline.plot("run.png")
        """
        return _trace(self.devices, self._log, path)


def _graph_line(backend: str, st: Stage, piece: bool) -> str:
    """Under ``"cudagraphs"``: whether the stage's jobs replay a device graph
    (``runtime.stages.graphs``), or why not."""
    if backend != "cudagraphs":
        return ""
    if st.kind == "fused":
        return ("# its job runs the compiled code, not a device graph: the loss_fn between "
                "its forward and backward is the caller's Python\n")
    if piece:
        return ("# it runs the compiled code, not a device graph: recompute_grain='layer' "
                "pieces are not captured\n")
    why = not_capturable(st)
    if why is not None:
        return f"# its jobs run the compiled code, not a device graph: {why}\n"
    what = ("forward job is a device graph (GraphForward)" if st.kind == "fwd" else
            "recompute and backward are one device graph (GraphRecomputeBackward)")
    return (f"# its {what}: captured once per device, parameter slot, input slot and input "
            "shapes, then replayed\n")
