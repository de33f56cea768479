"""One call of a compiled pipeline: split into microbatches, run the Executable, merge.

``Runner`` serves one compiled LayerGraph under one plan. It builds nothing: the
``Executable`` a call runs comes from ``executable(...)``, the compiler's cache
(``fxpipe.api``), and the Runner only keeps one host parameter store per run type.
``infer``, ``fused`` and ``TrainCall`` (the eager-style forward/backward, through
``runtime.issue.autograd``) run calls on it.

When the pipe pins host memory (``staging``, a ``pinned.Staging``), each call copies the
tensors it uploads from the caller (inputs, labels, output gradients) once into a
page-locked block, so the devices' uploads of them are asynchronous. A CUDA tensor of the
caller's goes straight to the devices when every device is a stream set of the GPU it is
on: cast (``param_dtype``) on the caller's stream, then each device's streams wait for an
event recorded there and its upload is a device-to-device copy, no host round trip
(``CudaDevice.after_caller``); the call holds the tensors until its copies are done.
Otherwise (virtual devices, or devices on other GPUs: a copy between GPUs would run on
the caller's stream, fenced both ways against the device's) it is copied to the host as
the others (synchronously, on its device's current stream).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

import torch
import torch.utils._pytree as pytree

from fxpipe.config import RunConfig
from fxpipe.errors import DeviceMemoryError
from fxpipe.passes.program import CallSpec, OptimizerSpec, Prefetch
from fxpipe.passes.layer_graph import LayerGraph
from fxpipe.passes.stage import Executable
from fxpipe.runtime.stages import amp
from fxpipe.runtime.issue import microbatch as mb
from fxpipe.runtime.stages import rng
from fxpipe.runtime.host import scratch
from fxpipe.runtime.devices.cuda import CudaDevice
from fxpipe.runtime.devices.device import Device
from fxpipe.runtime.issue.executor import Call, Execution
from fxpipe.runtime.issue.values import apply_writebacks, restore
from fxpipe.runtime.host.grad_accum import owned_params
from fxpipe.runtime.stages.compiled import compile_totals
from fxpipe.runtime.stages.graphs import StageGraphs, graph_jobs
from fxpipe.runtime.issue.inputs import check_inputs, split_tensors
from fxpipe.runtime.stages.stage_code import runnables
from fxpipe.runtime.issue.interrupts import deferred_interrupt
from fxpipe.runtime.issue.threads import outside_program
from fxpipe.runtime.issue.loss_weights import LossWeights, Shares, shares
from fxpipe.runtime.host.param_store import ParamStore
from fxpipe.runtime.host.params import HostParams
from fxpipe.runtime.devices.pinned import Staging
from fxpipe.runtime.host.scratch import ResidentBuffers
from fxpipe.runtime.stages.timer import LayerTimer
from fxpipe.runtime.issue.trace import ActionLog

# the work a call does outside its Program before it runs (``threads.outside_program``)
SPLITTING = "splitting the inputs into microbatches"
COMPARING = "comparing the microbatches' shapes with the other ranks' (data parallel)"
# the compiler's (cached) Executable of a CallSpec
BuildExecutable = Callable[[CallSpec], Executable]


class Runner:
    """Runs one compiled LayerGraph under one plan on ``devices``.

    ``executable``: returns the (cached) Executable of a ``CallSpec`` (:meth:`spec`);
    ``differentiable(inputs)``: the values that may carry a gradient when ``inputs``
    require grad (``passes.grad_flow``, evaluated by the compiler);
    ``log``: while a ``pipe.trace()`` block records, executed actions go to it.
    ``dp``: data parallel (``runtime.issue.distributed.DataParallel``): a training call that
    synchronizes (``sync``) runs the collectives :meth:`spec` gives it.
    ``staging``: the pipe's page-locked staging for what calls upload from the caller
    (None: the pipe does not pin; see the module docstring).
    """

    def __init__(self, lg: LayerGraph, devices: list[Device], executable: BuildExecutable,
                 differentiable: Callable[[Collection[str]], frozenset[str]],
                 host: Callable[[], HostParams], timer: LayerTimer | None = None,
                 param_dtype: torch.dtype | None = None, log: ActionLog | None = None,
                 dp: Any = None, staging: Staging | None = None,
                 graphs: StageGraphs | None = None):
        self.lg, self.devices = lg, devices
        self.graphs = graphs   # the pipe's device graphs (stage_backend="cudagraphs")
        self._graphed: dict[int, Executable] = {}
        self.staging = staging
        self.dp = dp   # runtime.issue.distributed.DataParallel, or None
        self.executable = executable
        self.differentiable = differentiable
        self.host = host
        self.timer = timer
        self.param_dtype = param_dtype  # mixed precision: devices compute in it
        self.log = log or ActionLog()
        self._stores: dict[str, ParamStore] = {}
        self._fits: set[tuple[int, str | None]] = set()   # (Executable, backend) checked

    def store(self, exe: Executable) -> ParamStore:
        """``exe``'s stages as slices of the model's flat host buffers (one view per run
        type: every microbatch count, grain and optimizer mode has the same stages). The
        first one moves the model's tensors into those buffers (``HostParams``); a
        training one gives the trainable parameters their gradient buffers (not with
        ``data_parallel="device"``, whose steps download 1/N of the gradients as pieces:
        a call reducing on the host makes them at its first download)."""
        if exe.run_type not in self._stores:
            lg = self.lg
            store = ParamStore(
                self.host(),
                {i: {f: lg.params[f] for f in st.params if f in lg.params}
                 for i, st in exe.stages.items()},
                {i: {f: lg.buffers[f] for f in st.params if f in lg.buffers}
                 for i, st in exe.stages.items()}, param_dtype=self.param_dtype)
            if exe.run_type != "infer" and not (self.dp is not None and self.dp.on_devices
                                                and self.dp.shard):
                store.host.make_grads()
            if self.dp is not None and self.dp.zero3:   # each upload moves 1/N
                store.shard = (self.dp.rank, self.dp.world)
            self._stores[exe.run_type] = store
        return self._stores[exe.run_type]

    def stage(self, per_mb: list[list[torch.Tensor]],
              dtype: torch.dtype | None = None) -> list[list[torch.Tensor]]:
        """``per_mb``'s tensors (per microbatch, a list), as the call uploads them: each
        copied once into the pipe's page-locked staging (in ``dtype`` when given, for its
        floating tensors), a tensor appearing several times staged once. Unchanged
        (``dtype`` aside) when the pipe does not pin."""
        def cast(t: torch.Tensor) -> torch.dtype | None:
            return dtype if dtype is not None and t.is_floating_point() else None

        gpus = {t.device for ts in per_mb for t in ts if isinstance(t, torch.Tensor) and t.is_cuda}
        direct = bool(gpus) and all(isinstance(d, CudaDevice) and {d.device} == gpus
                                    for d in self.devices)   # CUDA inputs as they are
        if self.staging is None or direct:
            per_mb = [[t.to(cast(t)) if cast(t) is not None and (self.staging is None or t.is_cuda)
                       else t for t in ts] for ts in per_mb]
            if direct:
                self._after_caller(*gpus)
        if self.staging is None:
            return per_mb if direct or not gpus else [[t.cpu() for t in ts] for ts in per_mb]
        unique: dict[int, torch.Tensor] = {}
        for ts in per_mb:
            for t in ts:
                if t.layout == torch.strided and (t.device.type == "cpu" or
                                                  (t.device.type == "cuda" and not direct)):
                    unique.setdefault(id(t), t)
        staged = dict(zip(unique, self.staging.stage(list(unique.values()),
                                                     [cast(t) for t in unique.values()])))
        return [[staged.get(id(t), t) for t in ts] for ts in per_mb]

    def _after_caller(self, gpu: torch.device) -> None:
        """The devices' streams wait for the caller's work on its CUDA inputs, on ``gpu``
        (an event recorded on its current stream)."""
        event = torch.cuda.current_stream(gpu).record_event()
        for d in self.devices:
            d.after_caller(event)

    def pinned_bytes(self) -> int:
        """Page-locked bytes reserved for this pipe: its host buffers and staging."""
        staged = self.staging.account.nbytes if self.staging is not None else 0
        return self.host().pinned_bytes + staged

    # -- calls ---------------------------------------------------------------------------
    def split(self, args: tuple, kwargs: dict, cfg: RunConfig
              ) -> tuple[list[dict], list[int], Shares]:
        """Per-microbatch input environments, each microbatch's rows, and its weights in
        the merged 0-dim outputs (``runtime.issue.loss_weights``: by rows, or for a mean over
        target tokens by its targets, counted now)."""
        with outside_program(SPLITTING):
            envs, rows = self._split(args, kwargs, cfg)
            return envs, rows, shares(self.lg, envs, rows)

    def _split(self, args: tuple, kwargs: dict, cfg: RunConfig) -> tuple[list[dict], list[int]]:
        checked = not any(isinstance(x, mb.PackedData) for x in (*args, *kwargs.values()))
        if checked:
            check_inputs(self.lg, args, kwargs)  # structure errors before splitting errors
        args_mb, kwargs_mb = mb.split_input(args, kwargs, cfg.num_microbatch, cfg.split_input)
        # split by fxpipe's rules, a checked call's microbatches have its structure
        check = split_tensors if checked and not mb.uses_callable(cfg.split_input) else check_inputs
        per_mb = [check(self.lg, a, k) for a, k in zip(args_mb, kwargs_mb)]
        envs, rows = [], []
        # floating inputs enter in the compute dtype; staged (page-locked) when pinning
        for tensors in self.stage(per_mb, self.param_dtype):
            envs.append(dict(zip(self.lg.input_names, tensors)))
            first = next((t for t in tensors if t.dim() > 0), None)
            rows.append(first.shape[0] if first is not None else 1)
        return envs, rows

    def spec(self, run_type: str, num_microbatch: int, cfg: RunConfig, *,
             optimizer: OptimizerSpec | None = None, outputs: bool = True, sync: bool = True,
             input_grads: Collection[str] = ()) -> CallSpec:
        """The ``CallSpec`` of a call (what ``pipe.program()`` prints it runs is the
        Executable of the same spec): its run type, microbatches and grain, the
        optimizer's host actions, outputs, input gradients, and with data parallel the
        collectives of a training call that synchronizes (``sync``,
        ``DataParallel.collectives``)."""
        data_parallel, broadcast = None, False
        dp = self.dp
        if dp is not None:
            steps = optimizer is not None and optimizer.steps
            if dp.shard and steps and run_type != "infer" and sync and not (
                    optimizer.streamed or optimizer.clipped_first):
                raise NotImplementedError(
                    f"shard_optimizer=True steps each rank's shard inside the call with the "
                    f"streamed exact step (or clipped without speculation); optimizer "
                    f"{optimizer} is not supported there (GradScaler and mode='async' are not "
                    "implemented with sharding): compile with shard_optimizer=False")
            data_parallel, broadcast = dp.collectives(
                run_type, sync, ("exact" if optimizer.streamed else optimizer.mode) if steps
                else None, bool(self.lg.buffers),
                accumulated=dp.on_devices and any(p.grad is not None
                                                  for p in self.lg.params.values()))
        return CallSpec(run_type, num_microbatch, cfg.recompute_grain, optimizer, outputs,
                        tuple(n for n in self.lg.input_names if n in set(input_grads)),
                        data_parallel, broadcast, chunks=cfg.sequence_chunks is not None,
                        gather_params=dp is not None and dp.zero3)

    def call(self, run_type: str, envs: list[dict], cfg: RunConfig, *, optimizer: Any = None,
             outputs: bool = True, sync: bool = True, **kw: Any) -> Call:
        """A Call of the Executable of its ``CallSpec`` (built once, then cached).
        ``optimizer``: the optimizer's part of the call (``fxpipe.optim``); ``sync``:
        data parallel, whether it synchronizes gradients (:meth:`spec`)."""
        inputs = tuple(n for n in self.lg.input_names
                       if any(isinstance(env.get(n), torch.Tensor) and env[n].requires_grad
                              for env in envs))
        spec = self.spec(run_type, len(envs), cfg, outputs=outputs, sync=sync,
                         optimizer=optimizer.spec if optimizer is not None else None,
                         input_grads=inputs)
        if self.dp is not None and self.dp.zero3 and spec.data_parallel is not None and \
                not spec.data_parallel.startswith("zero3"):
            raise NotImplementedError(
                "data_parallel='zero3': a call that synchronizes the gradients steps the "
                "optimizer in the pipe (the ranks share the parameters, each stepping its "
                "1/N): pass optimizer= (fxpipe.optim.overlapped(opt, ...) for accumulation "
                "and clipping), or wrap the calls that only accumulate in pipe.no_sync()")
        exe = self.executable_for(spec, cfg)
        use = scratch.current()
        resident = use.resident if use is not None else None
        key = (id(exe), cfg.stage_backend)   # (Executables are cached: ids stable)
        if resident is not None or key not in self._fits:
            check_fits(exe, self.store(exe), self.devices, resident)
            runnables(exe, self.devices, cfg.stage_backend)   # refused before anything runs
            if resident is None:
                self._fits.add(key)
        # (zero3: every call gathers the parameters on the devices, inference too)
        dp = self.dp if run_type != "infer" or (self.dp is not None and self.dp.zero3) else None
        if dp is not None:
            dp.check_alive()
            dp.check_masters()
            if spec.data_parallel is not None or spec.broadcast_buffers:
                with outside_program(COMPARING):
                    dp.check_batch(envs)
        if optimizer is not None and optimizer.spec is not None:
            # an asynchronous update changes the parameters while this call's devices read
            # them: they read a copy (kept from then on)
            self.store(exe).snapshot |= optimizer.spec.mode == "async"
            optimizer.assign(exe, owned_params(exe.program, self.lg))
            optimizer.zero3 = self.dp is not None and self.dp.zero3
        seed = rng.draw_call_seed() if cfg.preserve_rng_state and \
            any(layer.random for layer in self.lg) else None
        return Call(exe=exe, layers=self.lg, store=self.store(exe), devices=self.devices,
                    inputs=envs, call_seed=seed, autocast=amp.captured(),
                    timer=self.timer if self.timer is not None and self.timer.sample() else None,
                    differentiable=self.differentiable(inputs), optimizer=optimizer,
                    record=self.log.actions, dp=dp, stage_backend=cfg.stage_backend,
                    scratch=use, graphs=self.graphs if cfg.stage_backend == "cudagraphs" else None,
                    **kw)

    def executable_for(self, spec: CallSpec, cfg: RunConfig) -> Executable:
        """The Executable a call of ``spec`` runs under ``cfg``: under
        ``stage_backend="cudagraphs"`` with its graph jobs (``runtime.stages.graphs.graph_jobs``)."""
        exe = self.executable(spec)
        if cfg.stage_backend != "cudagraphs":
            return exe
        if id(exe) not in self._graphed:   # (Executables are cached: ids stable)
            self._graphed[id(exe)] = graph_jobs(exe)
        return self._graphed[id(exe)]

    def run_call(self, call: Call, results: Callable[[], Any] | None = None,
                commit_grads: bool = False) -> Any:
        """Run ``call``: every action of its Program (the ``Refresh`` of the parameters'
        upload copies among them). Its ``Commit`` runs ``results()`` (e.g. merging
        outputs, which may raise) first, then writes its buffer updates (and with
        ``commit_grads`` its parameter gradients into ``.grad``) as one step that a
        ``KeyboardInterrupt`` cannot split; the value of ``results()`` is returned. On a
        failure before the ``Commit``, put the buffers back and raise (nothing reaches
        ``.grad``); a host action after it (an optimizer step) raises with the commit
        done."""
        value = None
        stalls = sum(d.host_stalls for d in self.devices)
        flushes = sum(d.allocator_flushes for d in self.devices)
        compiles, compile_s = compile_totals()

        def commit() -> None:
            nonlocal value
            value = results() if results is not None else None
            with deferred_interrupt():
                if commit_grads:
                    call.accumulator.commit()  # checks everything before writing anything
                apply_writebacks(call.writebacks)
                call.writebacks.clear()   # device copies: nothing keeps them past the call
                call.committed = True

        call.commit = commit
        try:
            Execution(call).run()
        except BaseException:
            if not call.committed:
                if call.snapshot is not None:
                    restore(self.lg.buffers, call.snapshot)
                if call.accumulator is not None:
                    call.accumulator.discard()
            # the exception's frames keep the call: it must not keep device memory
            call.losses.clear()
            call.writebacks.clear()
            if call.timer is not None:
                call.timer.settle(drop=True)
            raise
        finally:
            call.snapshot = None
            if call.stats is not None:   # the devices' blocking copies during the call
                call.stats.add("host_stalls", sum(d.host_stalls for d in self.devices) - stalls)
                call.stats.add("host_pinned_bytes", self.pinned_bytes())
                call.stats.add("allocator_flushes",
                               sum(d.allocator_flushes for d in self.devices) - flushes)
                n, seconds = compile_totals()   # the stage backend's compiles in the call
                call.stats.add("stage_compiles", n - compiles)
                call.stats.add("stage_compile_us", round((seconds - compile_s) * 1e6))
            self.log.stats = call.stats.as_dict() if call.stats is not None else {}
            call.commit = None   # the closure refers to the call: no cycle keeps its tensors
        if call.timer is not None:
            call.timer.settle()  # device-event timings, read now that the call has ended
        return value

    def _split_label(self, label: Any, n: int, cfg: RunConfig) -> list[Any]:
        labels = mb.split_label(label, n, cfg.split_label)
        if self.staging is not None:   # the labels' tensors, page-locked
            leaves = [pytree.tree_flatten(x) for x in labels]
            tensors = [[t for t in flat if isinstance(t, torch.Tensor)] for flat, _ in leaves]
            staged = [iter(ts) for ts in self.stage(tensors)]
            labels = [pytree.tree_unflatten([next(it) if isinstance(t, torch.Tensor) else t
                                             for t in flat], spec)
                      for (flat, spec), it in zip(leaves, staged)]
        return labels

    def outputs(self, call: Call, cfg: RunConfig, shares_: Shares) -> Any:
        """The call's outputs merged over its microbatches: a 0-dim leaf weighted by
        ``shares_``."""
        per_mb = [pytree.tree_unflatten(flat, self.lg.out_spec)
                  for flat in self.lg.flat_outputs_of(call.host)]
        paths = mb.leaf_paths(per_mb[0])
        merged = mb.merge_output(per_mb, cfg.merge_output, weights=shares_.rows,
                                 leaf_weights={paths[i]: w for i, w in shares_.tokens.items()})
        if cfg.output_device is not None and torch.device(cfg.output_device).type != "cpu":
            merged = pytree.tree_map_only(torch.Tensor, lambda t: t.to(cfg.output_device), merged)
        return merged

    def infer(self, args: tuple, kwargs: dict, cfg: RunConfig) -> Any:
        envs, _, shares_ = self.split(args, kwargs, cfg)
        call = self.call("infer", envs, cfg)
        return self.run_call(call, results=lambda: self.outputs(call, cfg, shares_))

    def fused(self, args: tuple, kwargs: dict, label: Any, loss_fn: Callable,
              reduction: str, cfg: RunConfig, return_outputs: bool,
              optimizer: Any = None, sync: bool = True) -> tuple[torch.Tensor, Any]:
        """``optimizer``: an ``fxpipe.optim.Overlapped`` whose step this call runs;
        ``sync``: data parallel, whether it synchronizes gradients."""
        envs, rows, shares_ = self.split(args, kwargs, cfg)
        with outside_program(SPLITTING):
            labels = self._split_label(label, len(envs), cfg)
        weights = LossWeights(self.lg, loss_fn, labels, shares_, reduction)
        opt = optimizer.call() if optimizer is not None else None
        if opt is not None:
            loss_fn = opt.scale_loss(loss_fn)
        call = self.call("fused", envs, cfg, optimizer=opt, outputs=return_outputs, sync=sync,
                         labels=labels, loss_fn=loss_fn, loss_weights=weights)
        try:
            outputs = self.run_call(call, results=(lambda: self.outputs(call, cfg, shares_))
                                   if return_outputs else None, commit_grads=True)
        except BaseException as e:
            if opt is not None and (not call.committed or opt.saved):   # (or in ``N``)
                opt.failed(e)
            raise
        if opt is not None:
            opt.finish()
        with outside_program("the loss: the sum of the microbatches' losses"):
            loss = call.losses[0]
            for m in range(1, len(envs)):
                loss = loss + call.losses[m]
            if opt is not None:
                loss = opt.unscale_loss(loss)
            return loss.detach().to("cpu", copy=True), outputs   # the host's own copy


def check_fits(exe: Executable, store: ParamStore, devices: list[Device],
               resident: ResidentBuffers | None = None) -> None:
    """Before anything of ``exe`` runs: raise ``DeviceMemoryError`` if a stage cannot fit
    on its device's ``memory_limit`` whatever its activations: its parameters, their
    gradients (backward), the parameters of the stage its device prefetches meanwhile
    (bytes the Program moves exactly: ``ParamStore.nbytes``) and the buffers
    ``resident`` keeps on the device for all its stages (``runtime.host.scratch``)."""
    for d, acts in enumerate(exe.program.actions):
        limit = devices[d].memory_limit
        if limit is None:
            continue
        order = [a.stage for a in acts if isinstance(a, Prefetch)]
        kept = {s: store.resident_nbytes(s, resident) for s in order}
        for k, s in enumerate(order):
            st = exe.program.stages[s]
            parts = {"params": store.nbytes(s) - kept[s],
                     "gradients": store.grad_nbytes(s) if st.kind != "fwd" else 0,
                     "the resident KV cache of its device's stages": sum(kept.values())}
            nxt = order[k + 1] if k + 1 < len(order) else None
            if nxt is not None:
                parts[f"stage {nxt}'s params, prefetched meanwhile"] = store.nbytes(nxt) - kept[nxt]
            if sum(parts.values()) > limit:
                what = ", ".join(f"{kind} {n} B" for kind, n in parts.items() if n)
                raise DeviceMemoryError(
                    f"{devices[d].name}: stage {s} ({st.kind}, layers {st.layers.start}-"
                    f"{st.layers.stop - 1}) cannot fit under memory_limit {limit} B before "
                    f"any activation: {what} = {sum(parts.values())} B. Nothing ran. Give the "
                    "plan smaller stages (fxpipe.ExecutePlan.auto(..., model_memory_limit=...) "
                    "or shorter ranges), compute in param_dtype=torch.bfloat16, or raise "
                    "memory_limit.")


class TrainCall:
    """An eager-style training call: ``forward()`` now, ``backward(grads)`` later; the two
    halves (``Program.phase``) of one ``"train"`` Executable."""

    def __init__(self, runner: Runner, args: tuple, kwargs: dict, cfg: RunConfig,
                 sync: bool = True):
        self.runner, self.cfg, self.sync = runner, cfg, sync
        self.envs, self.rows, self.shares = runner.split(args, kwargs, cfg)
        self.forward_call: Call | None = None
        self.out_leaves: list[list] = []
        self.merged_flat: list = []
        self.merged_spec: Any = None

    def forward(self) -> Any:
        r = self.runner
        call = r.call("train", self.envs, self.cfg, phase="forward", sync=self.sync)
        outputs = r.run_call(call, results=lambda: r.outputs(call, self.cfg, self.shares))
        self.forward_call = call
        self.out_leaves = r.lg.flat_outputs_of(call.host)
        return outputs

    def backward(self, merged_grads: list) -> tuple[list[dict], dict[int, torch.Tensor]]:
        """Gradients of the merged output leaves → (per-microbatch input grads,
        parameter grads by ``id``)."""
        r, fc = self.runner, self.forward_call
        M = len(self.envs)
        with outside_program(SPLITTING):
            out_grads = self._split_grads(merged_grads)
        call = Call(exe=fc.exe, layers=r.lg, store=fc.store, devices=r.devices, inputs=fc.host,
                    phase="backward", call_seed=fc.call_seed, out_grads=out_grads,
                    timer=fc.timer, autocast=fc.autocast, differentiable=fc.differentiable,
                    record=r.log.actions, dp=fc.dp, stage_backend=fc.stage_backend,
                    graphs=fc.graphs)
        if fc.dp is not None:
            fc.dp.check_alive()
        r.run_call(call)
        params = call.accumulator.totals()
        call.accumulator.discard()
        with outside_program("the input gradients for autograd: each one's parts summed"):
            grads = [{n: _sum(parts) for n, parts in g.items()} for g in call.grads]
        return [{n: grads[m].get(n) for n in r.lg.input_names} for m in range(M)], params

    def _split_grads(self, merged_grads: list) -> list[dict[str, torch.Tensor]]:
        """The output gradients per microbatch, page-locked when pinning (as uploaded)."""
        r = self.runner
        names = [a.name if hasattr(a, "name") else None
                 for a in r.lg.gm.graph.output_node().args[0]]
        M = len(self.envs)
        out_grads: list[dict[str, torch.Tensor]] = [{} for _ in range(M)]
        leaf_specs = _leaf_specs(self.cfg.merge_output, r.lg, self.forward_call.host)
        for k, g in enumerate(merged_grads):
            if g is None or names[k] is None:
                continue
            parts = _unmerge(g, [leaves[k] for leaves in self.out_leaves], leaf_specs[k],
                             self.shares.of(k))
            for m, part in enumerate(parts):
                prev = out_grads[m].get(names[k])
                out_grads[m][names[k]] = part if prev is None else prev + part
        if r.staging is not None:   # page-locked, as the call uploads them
            out_grads = [dict(zip(g, ts)) for g, ts in
                         zip(out_grads, r.stage([list(g.values()) for g in out_grads]))]
        return out_grads


def _sum(parts: list[torch.Tensor]) -> torch.Tensor:
    total = parts[0]
    for p in parts[1:]:
        total = total + p
    return total


def _leaf_specs(spec: Any, lg: LayerGraph, host: list[dict]) -> list[Any]:
    """How each flat output leaf was merged: ``None`` (auto) or a TensorChunkSpec."""
    n = len(lg.gm.graph.output_node().args[0])
    if spec is None or spec is True:
        return [None] * n
    if callable(spec) or spec is False:
        raise NotImplementedError(
            "backward through pipe(...) with a callable or False merge_output cannot split the "
            "output gradient into microbatches; use pipe.forward_backward(...) or the default "
            "merge_output")
    leaves = pytree.tree_leaves(spec, is_leaf=lambda x: mb.is_chunk_spec(x) or x is None)
    if len(leaves) != n:
        raise NotImplementedError("merge_output spec must give one entry per output leaf for "
                                  "eager-style backward")
    return leaves


def _unmerge(grad: torch.Tensor, per_mb: list, spec: Any, shares_: list[float]
             ) -> list[torch.Tensor]:
    """Split the gradient of a merged output leaf back into its microbatches (a 0-dim
    leaf's microbatches were weighted by ``shares_``)."""
    first = per_mb[0]
    if mb.is_chunk_spec(spec):
        dim = spec.split_dim
    elif spec is None and isinstance(first, torch.Tensor) and first.dim() > 0:
        dim = 0
    elif spec is None and isinstance(first, torch.Tensor):
        return [grad * w for w in shares_]  # 0-dim outputs were averaged, weighted
    else:
        raise NotImplementedError(f"cannot split the gradient of an output merged with {spec!r}")
    return list(torch.split(grad, [t.shape[dim] for t in per_mb], dim=dim))
