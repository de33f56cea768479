"""Host issue cost of one training step, with the device work elided, vs the GPU time of it.

    python benchmarks/bench_issue.py [--quick] [--repeats 3] [--json]

One process issues every GPU's work from Python threads sharing one GIL. This measures
that host work on the real issue path (the executor's issue threads, the Program's
actions, the stage code, events, the host lane) and sets it beside the time the GPUs
would compute the same step:

- The plan is fxpipe's own (``ExecutePlan.auto("fused", ...)``) for the full-size model,
  built on ``meta`` (no weights) at the row's tokens per microbatch, on 80 GiB devices.
- The step is then run with that plan on a model of the same architecture (layer count,
  ops per layer, parameters per layer) at tiny widths, on ``InlineDevice``s: each
  action's Python runs at issue on its device's issue thread, as on a ``CudaDevice``,
  and its kernels run at once on tensors of a few hundred elements, so they cost next to
  nothing. ``host_issue_ms`` is the wall time of the fused call (every thread, GIL-
  serialized as they are): the host time of one step. Kernels on ``meta`` tensors would
  elide the work too, but an elementwise op on ``meta`` costs 130-150 us of Python here
  (torch's meta functions), 20x a CUDA launch, so they would measure torch, not fxpipe.
- ``eager_ms``: the same tiny model run eagerly on the host, per microbatch a forward
  without grad (the recompute) and a forward and backward: the op dispatch an eager
  PyTorch step pays anyway. ``overhead_ms`` = host - eager: what fxpipe adds.
- ``predicted_gpu_ms``: the cost model's FLOPs of the full-size step (per microbatch:
  forward, recompute but in the fused tail, backward; ``fxpipe.passes.costs``) over the
  GPUs at ``--mfu`` of H100 SXM bf16 dense (989 TFLOP/s) and RTX 4090 bf16 (165 TFLOP/s,
  fp32 accumulate).
  ``ratio`` = host_issue_ms / predicted_gpu_ms: above 1 the GPUs wait for Python.
- ``action_us``: the host cost of one action around an empty stage (one
  ``Linear(1, 1)``, one device, inference): the call's time at 16 microbatches less its
  time at 1, over the actions it adds; and what a call costs besides its actions.
  ``action_us.devices_8``: the same with eight devices of one empty stage each, eight
  issue threads taking turns at the issue lock (what eight GPUs' issue costs a host
  beyond one's).
  ``action_us.python_calls``: the Python function calls that make it, counted the same
  way (every thread; a count, not a time: it does not depend on the CPU).
- ``issue_lock``: the 8-GPU Llama-3.1-8B step at 4K issued under the issue lock
  (``issue_lock.OrderedLock``: handed over to the waiting action first in the Program,
  an issue thread keeping it between its actions until a waiter is ``issue_lock.SLACK``
  steps before it: ``ordered``), under the same lock handed over after every action
  (``ordered-each``, the lock before this), handing over in the order asked (``fifo``)
  and under a plain ``threading.Lock`` (the lock before #55), interleaved: host ms per
  step and the devices' summed waits for the lock (``issue_lock_wait_us``) and their
  count (``issue_lock_waits``). ``--no-lock-ab`` skips it (the suite's run: sixteen
  8-GPU steps).

- **Per stage backend** (``--backends``, default ``eager inductor``): each row is run with
  ``RunConfig(stage_backend=...)`` (``stage_backend`` in its JSON: ``null`` for eager).
  Under ``"inductor"`` each layer segment runs inductor's generated code; on this CPU
  machine that is its C++ code, so the row's host time is the issue cost of inductor's
  *CPU* wrapper (Python calling fused C++ kernels and extern matmuls), the measured
  stand-in for its GPU wrapper launching Triton kernels. ``kernels_per_layer``: the
  kernels one step runs per layer and microbatch, from the profiler (eager: the outermost
  aten ops that compute, views and allocations left out; inductor: its generated kernels
  and the aten ops its wrapper calls), the count a GPU would launch. ``host_us_per_layer``
  = host_issue_ms over layers x microbatches.
- ``host_issue_ms_modelled`` / ``ratio_modelled`` (compiled rows): MODELLED, not
  measured: the host time a GPU step would take with the compiled code: the eager row's
  measured host time, with its compute actions' share (``Forward``, ``FusedBackward``,
  ``RecomputeBackward``... of ``host_issue_us_by_kind``: the stage code's ops) scaled by
  the kernels the compiled code runs per eager op (``kernels_per_layer`` over the eager
  row's): one launch costing the host what one eager op's dispatch does, the compiled
  wrapper's per-segment Python left out (on this CPU, where its C++ code runs, the
  measured row holds it).
- ``"cudagraphs"`` rows (``--backends ... cudagraphs``): a CUDA graph cannot run here,
  so the graph's own kernels are elided, not the host work around them: the row runs on
  ``ElidedGraphs`` devices (``InlineDevice``s whose graphs, once captured, replay by
  returning their outputs), so the measured time is every action's Python, the graph
  jobs' copies into the graphs' inputs, output clones, gradient additions and address
  checks, and the jobs with no graph (the fused tail: inductor's CPU code). To it is
  added a MODELLED launch per replay (``GRAPH_LAUNCH_US``: the fitted H200 host cost of
  one eager kernel, ``fxpipe.sim.hardware.H200_HOST``): ``graph_launch_ms_modelled``,
  inside ``host_issue_ms``; ``host_issue_ms_measured`` is the part measured.
- ``--compile-time``: inductor's compile time for the Llama-3.1-8B shape at tiny widths
  with 1 and with 32 blocks, each in a fresh process and an empty inductor cache: repeated
  blocks share one compiled artifact, so the 32-block model should cost about the 1-block
  one (the issue's bound: 3x).

Rows: Llama-3.1-8B, Qwen3-1.7B and Qwen3-32B shapes; 1, 2, 4 and 8 GPUs; RoundPipe's
published step (16 microbatches, ``tests/data/roundpipe_simulation.json``) at 4K and
16K tokens per microbatch. CPU wall time is noisy: calls are interleaved, repeated, and
the minimum and median reported. Writes benchmarks/results/bench_issue.json; with
``--json`` the last line printed is that JSON.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn as nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import fxpipe  # noqa: E402
from bench_memory import CausalLM  # noqa: E402
from fxpipe.runtime.devices import issue_lock  # noqa: E402
from fxpipe.runtime.devices.device_graph import DeviceGraph  # noqa: E402
from fxpipe.runtime.devices.emulator import InlineDevice  # noqa: E402
from fxpipe.sim.hardware import H200_HOST  # noqa: E402

GiB = 2**30
PEAK = {"h100": 989e12, "rtx4090": 165e12}   # bf16 dense FLOP/s
MICROBATCHES = 16                             # RoundPipe's published step
MODELS = {   # transformers' configs' shapes (untied embeddings)
    "Llama-3.1-8B": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                         head_dim=128, rope_theta=500000.0, qk_norm=False),
    "Qwen3-1.7B": dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, rope_theta=1000000.0, qk_norm=True),
    "Qwen3-32B": dict(vocab_size=151936, hidden_size=5120, intermediate_size=25600,
                      num_hidden_layers=64, num_attention_heads=64, num_key_value_heads=8,
                      head_dim=128, rope_theta=1000000.0, qk_norm=True),
}
TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8)
TINY_TOKENS = 8


def config(shape: dict, **override) -> tuple[SimpleNamespace, bool]:
    c = {**shape, **override}
    qk_norm = c.pop("qk_norm")
    theta = c.pop("rope_theta")
    return SimpleNamespace(rms_norm_eps=1e-6, rope_parameters={"rope_theta": theta}, **c), qk_norm


def full_size(name: str, gpus: int, seq_len: int) -> tuple[fxpipe.ExecutePlan, float]:
    """fxpipe's plan for the full-size model on ``gpus`` 80 GiB devices, and one step's
    FLOPs (every microbatch's forward, recompute and backward; the fused tail, the first
    backward stage, is not recomputed)."""
    c, qk_norm = config(MODELS[name])
    with torch.device("meta"):
        model = CausalLM(c, qk_norm, chunked=True).to(torch.bfloat16)
    ids = torch.zeros(1, seq_len, dtype=torch.long, device="meta")
    devices = [InlineDevice(memory_limit=80 * GiB) for _ in range(gpus)]
    pipe = fxpipe.compile(model, example_inputs=(ids, ids), devices=devices)
    plan = fxpipe.ExecutePlan.auto("fused", pipe, num_microbatch=MICROBATCHES)
    tail = plan.bwd_plan[0]
    flops = sum((1 if i in tail else 2) * layer.cost.fwd_flops + layer.cost.bwd_flops
                for i, layer in enumerate(pipe.layers))
    return plan, flops * MICROBATCHES


GRAPH_LAUNCH_US = H200_HOST["host_us_per_kernel"]
"""MODELLED host cost of one graph replay's launch (module docstring)."""


class _ElidedGraph(DeviceGraph):
    """Captured (``fn`` run once); a replay returns the outputs, its kernels elided."""

    def __init__(self, fn, inputs, name: str):
        self.name, self.inputs = name, tuple(inputs)
        self.outputs = self.first = tuple(fn(*self.inputs))

    def replay(self):
        return self.outputs


class ElidedGraphs(InlineDevice):
    """An ``InlineDevice`` whose device graphs replay with their kernels elided: what the
    host does around a replay is measured, the replay's launch is not (module docstring)."""

    def capture(self, fn, inputs, name: str = "a device graph") -> _ElidedGraph:
        return _ElidedGraph(fn, inputs, name)


def tiny_pipe(name: str, gpus: int, plan: fxpipe.ExecutePlan | None, backend: str | None = None,
              **override):
    c, qk_norm = config(MODELS[name], **TINY, **override)
    torch.manual_seed(0)
    model = CausalLM(c, qk_norm, chunked=True)
    ids = torch.randint(0, c.vocab_size, (MICROBATCHES, TINY_TOKENS))
    device = ElidedGraphs if backend == "cudagraphs" else InlineDevice
    pipe = fxpipe.compile(model, example_inputs=(ids, ids),
                          devices=[device() for _ in range(gpus)], plan=plan,
                          config=fxpipe.RunConfig(num_microbatch=MICROBATCHES,
                                                  stage_backend=backend))
    return model, pipe, ids


# aten ops that launch no kernel of their own: views, metadata, allocation
NO_KERNEL = {"aten::" + n for n in (
    "view", "_unsafe_view", "reshape", "as_strided", "expand", "t", "transpose", "permute",
    "unsqueeze", "squeeze", "slice", "select", "split", "split_with_sizes", "chunk",
    "unflatten", "flatten", "alias", "detach", "detach_", "lift_fresh", "resolve_conj",
    "resolve_neg", "empty", "empty_strided", "empty_like", "_reshape_alias", "unbind",
    "contiguous", "to", "result_type", "is_nonzero", "item",
    "_local_scalar_dense", "size", "stride", "numel", "set_", "broadcast_tensors",
    "narrow", "movedim", "view_as", "expand_as", "real", "imag")}


def kernels_per_step(step) -> int:
    """The kernels one call of ``step`` runs, from the profiler: inductor's generated
    kernels (``cpp_fused_*``/``triton_*``, profiled with ``cpp.enable_kernel_profile``)
    and the outermost aten ops that compute (an aten op inside a counted one is its
    implementation, not another launch). Nesting is read from each thread's intervals
    (the profiler's raw events: building its ``EventList`` tree costs minutes here)."""
    from torch.profiler import ProfilerActivity, profile

    every_thread = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    with profile(activities=[ProfilerActivity.CPU], experimental_config=every_thread) as prof:
        step()
    ops: dict[int, list[tuple[int, int]]] = {}   # thread -> (start, -end) of each op
    count = 0
    for e in prof.profiler.kineto_results.events():
        name = e.name()
        if "cpp_fused" in name or "triton_" in name:
            count += 1
        elif name.startswith("aten::") and name not in NO_KERNEL:
            ops.setdefault(e.start_thread_id(), []).append((e.start_ns(), -e.end_ns()))
    for intervals in ops.values():
        end = None   # of the outermost counted op open now
        for start, neg_end in sorted(intervals):   # by start, the enclosing one first
            if end is None or start >= end:
                count += 1
                end = -neg_end
    return count


COMPUTE = ("Forward", "FusedBackward", "RecomputeBackward", "Checkpoint", "LayerBackward")
"""The actions whose host time is the stage code's ops (the rest move data)."""


def modelled_host_ms(eager_row: dict, kernels: float) -> float:
    """MODELLED host time of a compiled step (module docstring): the eager row's measured
    host time, its compute actions' share (of the issue time summed over every action:
    lanes overlap, so shares, not sums) scaled by the kernels the compiled code runs per
    eager op."""
    by_kind = eager_row["host_issue_us_by_kind"]
    share = sum(by_kind.get(k, 0) for k in COMPUTE) / sum(by_kind.values())
    return eager_row["host_issue_ms"] * (1 - share * (1 - kernels / eager_row["kernels_per_layer"]))


def compile_time(blocks: int) -> dict:
    """Run in a fresh process: inductor's compile seconds for a fused step of the
    Llama-3.1-8B shape at tiny widths with ``blocks`` blocks (``runtime.stages.compiled``'s
    artifacts' own clocks), and how many artifacts and signatures it compiled."""
    from fxpipe.runtime.stages.compiled import artifacts
    torch.set_num_threads(1)
    _, pipe, ids = tiny_pipe("Llama-3.1-8B", 1, None, "inductor", num_hidden_layers=blocks)
    start = time.perf_counter()
    pipe.forward_backward((ids, ids))
    first = time.perf_counter() - start
    arts = artifacts()
    pipe.close()
    return {"blocks": blocks, "layers": blocks + 2, "compile_s": sum(a.compile_s for a in arts),
            "first_step_s": first, "artifacts": len(arts),
            "signatures": sum(a.compiles for a in arts)}


def compile_times() -> dict:
    """``compile_time`` for 1 and 32 blocks, each in its own process with an empty
    inductor cache (nothing reused from an earlier compile)."""
    import subprocess
    import tempfile
    out = {}
    for blocks in (1, 32):
        with tempfile.TemporaryDirectory() as cache:
            code = (f"import json, sys; sys.path.insert(0, {str(ROOT / 'benchmarks')!r}); "
                    f"import bench_issue; print(json.dumps(bench_issue.compile_time({blocks})))")
            proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                  env={**__import__("os").environ, "TORCHINDUCTOR_CACHE_DIR": cache},
                                  cwd=str(ROOT), check=True)
            out[blocks] = json.loads(proc.stdout.strip().splitlines()[-1])
    one, many = out[1], out[32]
    return {"one_block": one, "blocks_32": many, "ratio": many["compile_s"] / one["compile_s"]}


def timed(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        out.append((time.perf_counter() - start) * 1e3)
    return out


def eager_step(model: nn.Module, ids: torch.Tensor) -> None:
    for m in range(MICROBATCHES):
        x = ids[m:m + 1]
        with torch.no_grad():
            model(x, x)
        model(x, x).backward()
    model.zero_grad(set_to_none=True)


def empty_stage_pipes(devices: int = 1) -> dict[int, tuple]:
    """Pipes of ``devices`` empty stages (one ``Linear(1, 1)`` each, one per device, one
    issue thread per device, a forward) at 1 and 16 microbatches, warmed up:
    ``{m: (pipe, input, actions per call)}``."""
    pipes = {}
    one = [range(i, i + 1) for i in range(devices)]   # a stage per layer (the tail: the last)
    plan = fxpipe.ExecutePlan(one[:-1], one[::-1]) if devices > 1 else None
    for m in (1, 16):
        pipe = fxpipe.compile(nn.Sequential(*[nn.Linear(1, 1) for _ in range(devices)]),
                              example_inputs=(torch.zeros(m, 1),),
                              devices=[InlineDevice() for _ in range(devices)],
                              config=fxpipe.RunConfig(num_microbatch=m, execute_plan=plan))
        x = torch.zeros(m, 1)
        for _ in range(20):
            pipe(x)
        pipes[m] = (pipe, x, pipe.stats()["actions"])
    return pipes


def action_calls(calls: int = 16) -> dict:
    """Python function calls per action around an empty stage (``action_cost``'s pipes;
    the caller's thread and the issue threads, whose ``Execution._issue`` is profiled
    from inside them): what an action's time is made of, counted, so it does not depend
    on the CPU. The difference between 16 and 1 microbatches over the difference in
    actions, as ``action_cost``; ``call_fixed``: what remains at 1 microbatch."""
    from fxpipe.runtime.issue.executor import Execution
    counter = itertools.count()

    def profile(frame, event, arg) -> None:
        if event == "call":
            next(counter)   # (atomic: two threads count)

    issue = Execution._issue

    def profiled(self, *args):
        sys.setprofile(profile)
        try:
            return issue(self, *args)
        finally:
            sys.setprofile(None)

    per: dict[int, float] = {}
    pipes = empty_stage_pipes()
    Execution._issue = profiled
    try:
        for m, (pipe, x, _) in pipes.items():
            start = next(counter)
            sys.setprofile(profile)
            for _ in range(calls):
                pipe(x)
            sys.setprofile(None)
            per[m] = (next(counter) - start - 1) / calls
    finally:
        Execution._issue = issue
        sys.setprofile(None)
        for pipe, _, _ in pipes.values():
            pipe.close()
    (_, _, a1), (_, _, a16) = pipes[1], pipes[16]
    each = (per[16] - per[1]) / (a16 - a1)
    return {"per_action": round(each, 1), "call_fixed": round(per[1] - a1 * each, 1),
            "per_call": per, "actions": [a1, a16]}


def action_cost(repeats: int, devices: int = 1) -> dict:
    """Host microseconds per action around an empty stage (``empty_stage_pipes``): the
    call's time at 1 and 16 microbatches; the difference over the difference in actions
    is one action's cost, what remains at 1 the call's own. ``devices=8``: eight issue
    threads taking turns at the issue lock, as eight GPUs' do."""
    pipes = empty_stage_pipes(devices)
    calls = 100
    us: dict[int, list[float]] = {1: [], 16: []}
    for _ in range(repeats):   # interleaved
        for m, (pipe, x, _) in pipes.items():
            start = time.perf_counter()
            for _ in range(calls):
                pipe(x)
            us[m].append((time.perf_counter() - start) * 1e6 / calls)
    (_, _, a1), (_, _, a16) = pipes[1], pipes[16]
    per = [(b - a) / (a16 - a1) for a, b in zip(us[1], us[16])]
    return {"actions": [a1, a16], "call_us_min": [min(us[1]), min(us[16])],
            "min_us": min(per), "median_us": statistics.median(per),
            "call_fixed_us": min(us[1]) - a1 * min(per)}


class PlainLock:
    """The issue lock before #55: a ``threading.Lock`` (whichever waiting thread the OS
    wakes takes it; one letting go and asking again at once usually wins), its waits
    timed as ``issue_lock.OrderedLock`` times them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()

    def acquire(self, step: int = 0) -> float:
        if self._lock.acquire(blocking=False):
            return 0.0
        start = time.perf_counter()
        self._lock.acquire()
        return time.perf_counter() - start

    def release(self) -> None:
        self._lock.release()

    def pass_on(self, step: int, slack: int) -> float:   # let go and ask again, as before
        self.release()
        return self.acquire(step)

    def locked(self) -> bool:
        return self._lock.locked()


class FifoLock(issue_lock.OrderedLock):
    """``OrderedLock`` handing over in the order asked, whatever the step, after every
    action."""

    def acquire(self, step: int = 0) -> float:
        return super().acquire(0)

    def pass_on(self, step: int, slack: int) -> float:
        return super().pass_on(0, EACH)


class EachLock(issue_lock.OrderedLock):
    """``OrderedLock`` handed over after every action a thread waits behind."""

    def pass_on(self, step: int, slack: int) -> float:
        return super().pass_on(step, EACH)


EACH = -(1 << 62)   # a slack no step reaches: any waiter takes the lock


def lock_ab(repeats: int, gpus: int = 8) -> dict:
    """The 8-GPU Llama-3.1-8B step at 4K (eager stage code) issued under the issue lock
    (``ordered``), a FIFO one and a plain one, interleaved: host ms per step and the
    devices' summed waits for the lock (``issue_lock_wait_us``), min and median of
    ``repeats`` x 3 steps each."""
    plan, _ = full_size("Llama-3.1-8B", gpus, 4096)
    _, pipe, ids = tiny_pipe("Llama-3.1-8B", gpus, plan)
    ordered = issue_lock._ISSUING
    locks = {"ordered": ordered, "ordered-each": EachLock(), "fifo": FifoLock(),
             "plain": PlainLock()}
    out: dict[str, dict[str, list[float]]] = {k: {"host_ms": [], "wait_ms": [], "waits": []}
                                              for k in locks}
    try:
        for lock in locks.values():   # warm up
            issue_lock._ISSUING = lock
            pipe.forward_backward((ids, ids))
        for _ in range(repeats * 3):
            for name, lock in locks.items():
                issue_lock._ISSUING = lock
                out[name]["host_ms"] += timed(lambda: pipe.forward_backward((ids, ids)), 1)
                out[name]["wait_ms"].append(pipe.stats()["issue_lock_wait_us"] / 1e3)
                out[name]["waits"].append(pipe.stats()["issue_lock_waits"])
    finally:
        issue_lock._ISSUING = ordered
        pipe.close()
    return {name: {"host_ms_min": min(v["host_ms"]),
                   "host_ms_median": statistics.median(v["host_ms"]),
                   "lock_wait_ms_min": min(v["wait_ms"]),
                   "lock_wait_ms_median": statistics.median(v["wait_ms"]),
                   "lock_waits_median": statistics.median(v["waits"])}
            for name, v in out.items()} | {"gpus": gpus, "model": "Llama-3.1-8B", "seq_len": 4096,
                                           "slack": issue_lock.SLACK}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--mfu", type=float, default=0.6)
    ap.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    ap.add_argument("--gpus", nargs="+", type=int, default=[1, 2, 4, 8])
    ap.add_argument("--tokens", nargs="+", type=int, default=[4096, 16384],
                    help="tokens per microbatch")
    ap.add_argument("--quick", action="store_true", help="Llama-3.1-8B on 1 and 8 GPUs at 4K only")
    ap.add_argument("--backends", nargs="+", choices=["eager", "inductor", "cudagraphs"],
                    default=["eager", "inductor", "cudagraphs"],
                    help="RunConfig.stage_backend of each row")
    ap.add_argument("--compile-time", action="store_true",
                    help="also measure inductor's compile time, 1 vs 32 blocks (fresh processes)")
    ap.add_argument("--json", action="store_true", help="print the result JSON as the last line")
    ap.add_argument("--lock-ab", action=argparse.BooleanOptionalAction, default=True,
                    help="the issue_lock part (--no-lock-ab: skip it, as the suite's run does)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "bench_issue.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    torch._inductor.config.cpp.enable_kernel_profile = True   # kernels show in the profiler
    if args.quick:
        args.models, args.gpus, args.tokens = ["Llama-3.1-8B"], [1, 8], [4096]
    cases = [(m, g, n) for m in args.models for g in args.gpus for n in args.tokens]
    action = action_cost(args.repeats)
    action["python_calls"] = action_calls()
    action["devices_8"] = eight = action_cost(args.repeats, devices=8)
    print(f"host cost of one action around an empty stage: {action['min_us']:.1f} us min, "
          f"{action['median_us']:.1f} us median; a call's own: {action['call_fixed_us']:.0f} us; "
          f"{action['python_calls']['per_action']} Python calls per action; "
          f"eight devices' issue threads: {eight['min_us']:.1f} us min, "
          f"{eight['median_us']:.1f} us median")
    lock = lock_ab(args.repeats) if args.lock_ab else None
    for name in ("ordered", "ordered-each", "fifo", "plain") if lock else ():
        r = lock[name]
        print(f"issue lock {name:>12}: 8-GPU 4K step {r['host_ms_min']:.1f} ms min, "
              f"{r['host_ms_median']:.1f} ms median; the devices waited for it "
              f"{r['lock_wait_ms_median']:.1f} ms, {r['lock_waits_median']:.0f} times (median)")
    head = (f"{'model':<14} {'gpus':>4} {'tokens':>6} {'backend':>8} {'stages f/b':>10} "
            f"{'actions':>7} {'kern/L':>6} {'us/L':>6} {'host ms':>8} {'eager ms':>8} "
            f"{'fxpipe+':>8} {'H100 ms':>8} {'ratio':>6} {'4090 ms':>8} {'ratio':>6}")
    print(head)
    rows = []
    for name, gpus, seq_len in cases:
        plan, flops = full_size(name, gpus, seq_len)
        pipes = {b: tiny_pipe(name, gpus, plan, None if b == "eager" else b)
                 for b in args.backends}
        model, _, ids = next(iter(pipes.values()))
        steps = {b: (lambda p=p: p.forward_backward((ids, ids))) for b, (_, p, _) in pipes.items()}
        eager = lambda: eager_step(model, ids)            # noqa: E731
        for step in steps.values():   # warm up (the first call builds the Program, compiles)
            step(), step()
        eager()
        host: dict[str, list[float]] = {b: [] for b in steps}
        base: list[float] = []
        for _ in range(args.repeats):   # interleaved
            for b, step in steps.items():
                host[b] += timed(step, 1)
            base += timed(eager, 1)
        eager_kernels = kernels_per_step(eager)
        predicted = {k: flops / (gpus * peak * args.mfu) * 1e3 for k, peak in PEAK.items()}
        for b, (_, pipe, _) in pipes.items():
            stats = pipe.stats()   # its last timed call's
            kernels = kernels_per_step(steps[b]) + stats["graph_replays"]
            per_layer = len(pipe.layers) * MICROBATCHES
            launches = stats["graph_replays"] * GRAPH_LAUNCH_US / 1e3   # MODELLED
            measured = list(host[b])
            host[b] = [t + launches for t in measured]
            row = {"model": name, "gpus": gpus, "seq_len": seq_len, "microbatches": MICROBATCHES,
                   "stage_backend": None if b == "eager" else b,
                   "plan": repr(plan), "fwd_stages": len(plan.fwd_plan),
                   "bwd_stages": len(plan.bwd_plan),
                   "actions": stats["actions"], "host_issue_ms": min(host[b]),
                   "host_issue_ms_median": statistics.median(host[b]), "eager_ms": min(base),
                   "eager_ms_median": statistics.median(base),
                   "overhead_ms": min(host[b]) - min(base),
                   "kernels_per_layer": kernels / per_layer,
                   "eager_kernels_per_layer": eager_kernels / per_layer,
                   "host_us_per_layer": min(host[b]) * 1e3 / per_layer,
                   "host_issue_us_by_kind": {k.split(".", 1)[1]: v for k, v in stats.items()
                                             if k.startswith("host_issue_us.")},
                   "step_tflop": flops / 1e12, "mfu": args.mfu,
                   "predicted_gpu_ms": predicted["h100"],
                   "ratio": min(host[b]) / predicted["h100"],
                   "predicted_gpu_ms_rtx4090": predicted["rtx4090"],
                   "ratio_rtx4090": min(host[b]) / predicted["rtx4090"]}
            if b == "cudagraphs":   # the replays' launches MODELLED (module docstring)
                row.update(host_issue_ms_measured=min(measured), graph_launch_ms_modelled=launches,
                           graph_replays=stats["graph_replays"],
                           graph_captures=stats["graph_captures"])   # 0: the timed calls replay
            if b == "inductor" and "eager" in pipes:   # MODELLED (module docstring)
                eager_row = next(r for r in rows if r["stage_backend"] is None
                                 and (r["model"], r["gpus"], r["seq_len"]) == (name, gpus, seq_len))
                modelled = modelled_host_ms(eager_row, kernels / per_layer)
                row.update(host_issue_ms_modelled=modelled,
                           ratio_modelled=modelled / predicted["h100"])
            rows.append(row)
            stages = f"{len(plan.fwd_plan):>5}/{len(plan.bwd_plan):<4}"
            print(f"{name:<14} {gpus:>4} {seq_len // 1024:>5}K {b:>8} {stages} "
                  f"{row['actions']:>7} {row['kernels_per_layer']:>6.1f} "
                  f"{row['host_us_per_layer']:>6.0f} {row['host_issue_ms']:>8.1f} "
                  f"{row['eager_ms']:>8.1f} {row['overhead_ms']:>8.1f} "
                  f"{row['predicted_gpu_ms']:>8.1f} {row['ratio']:>6.3f} "
                  f"{row['predicted_gpu_ms_rtx4090']:>8.1f} {row['ratio_rtx4090']:>6.3f}"
                  + (f"  modelled: {row['host_issue_ms_modelled']:.1f} ms, ratio "
                     f"{row['ratio_modelled']:.3f}" if "ratio_modelled" in row else "")
                  + (f"  ({row['graph_replays']} replays' launches modelled: "
                     f"{row['graph_launch_ms_modelled']:.1f} ms)" if b == "cudagraphs" else ""),
                  flush=True)
        for _, pipe, _ in pipes.values():
            pipe.close()
    result = {"torch": torch.__version__,
              "command": " ".join(["python", "benchmarks/bench_issue.py", *(argv or sys.argv[1:])]),
              "action_us": action, "issue_lock": lock, "rows": rows,
              "modelled": "host_issue_ms_modelled = the eager row's host_issue_ms x (1 - "
                          "its compute actions' share of host_issue_us_by_kind x (1 - "
                          "kernels_per_layer / the eager row's kernels_per_layer)): one launch "
                          "costing the host one eager op's dispatch (not measured)"}
    if args.compile_time:
        result["compile_time"] = ct = compile_times()
        print(f"inductor compile time, Llama-3.1-8B shape at tiny widths: 1 block "
              f"{ct['one_block']['compile_s']:.1f} s ({ct['one_block']['artifacts']} artifacts, "
              f"{ct['one_block']['signatures']} signatures), 32 blocks "
              f"{ct['blocks_32']['compile_s']:.1f} s ({ct['blocks_32']['artifacts']} artifacts, "
              f"{ct['blocks_32']['signatures']} signatures): {ct['ratio']:.2f}x")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
