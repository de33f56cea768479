"""The GPU acceptance kit: ``python -m fxpipe.check [--dry-run] [--out FILE] [--budget-s S]``.

On whatever GPUs are visible it runs these sections, printing each with the elapsed time,
and writes the JSON file again after every one (atomically), so a crash or a kill keeps
what came before (``in_progress`` names the section that was running):

1. ``cuda_tests``: ``pytest`` over the CUDA tests, in a subprocess;
2. ``vs_checkpoint``: the fused training step against eager PyTorch with
   ``torch.utils.checkpoint`` per block, both on one GPU (min and median ratio over
   interleaved repeats);
3. ``scaling``: the fused step on 1, 2, ... N GPUs (speed-up over one); with one GPU,
   also on two logical devices over it (two ``CudaDevice`` objects, each with its own streams,
   events and copies, half the memory each): not for speed, but to run the
   cross-device ordering code on real CUDA, its losses against one device;
4. ``hidden_prefetch``: per device, the share of parameter-prefetch time that overlapped
   compute and ``exposed_ms``, the time the compute stream waited for parameters, from
   the CUDA-event timeline (``pipe.trace()``) of a step the layer timer does not sample;
5. ``predicted_vs_measured``: ``fxpipe.simulate`` with the layer times measured in a
   traced, sampled step and the host links' measured bandwidth, against its makespan;
6. ``stats``: ``pipe.stats()`` of the unsampled step (host waits, bytes moved by kind);
7. ``bigger_than_device``: cuda:0 capped (``torch.cuda.set_per_process_memory_fraction``)
   below half of the model's bf16 weights; three steps of bf16 training with AdamW streamed
   in the call (``forward_backward(optimizer=...)``): weights and peak reserved memory
   over the cap, tokens/s, losses;
8. ``weights``: ``compile(weights=DIR)`` on a model built on ``meta`` with a frozen base:
   how many frozen parameters stayed file-backed, whether their pages were registered
   for DMA (else the bounded pinned ring carried them: ``ring_bytes``), the host stalls,
   and the losses against the same model loaded in memory;
9. ``generate``: ``pipe.generate`` (KV cache) of a Hugging Face Llama from a config whose
   weights are 2.2x a capped device's memory (as ``bigger_than_device``), greedy over
   left-padded prompts, with ``kv_cache`` ``"host"``, ``"auto"`` and ``"device"`` (a
   refusal recorded as such), against ``transformers``' ``model.generate`` with every
   weight resident on the same GPU: the tokens, the tokens per second against the
   weights-over-link bound (``batch x`` the measured pinned host->device bandwidth
   ``/ weight bytes``), a decode step's bytes and the stages whose cache stayed resident;
10. ``finetune``: bf16 fine-tuning of Hugging Face models from host memory (LoRA on the
    Llama-3.1-8B shape, a full fine-tune of the Qwen3-4B shape, 16 x 4,096 tokens per
    step) against eager ``transformers`` with gradient checkpointing on the same GPU:
    tokens/s, model and hardware TFLOP/s, MFU, peaks predicted and measured, the
    simulator's step against the measured one (``fxpipe.check.finetune``); the JSON is
    written after each run. Each run's model is built once and eager timed once; fxpipe's
    side runs once per ``RunConfig.stage_backend`` of ``--stage-backends`` (default on a
    GPU ``cudagraphs,inductor,eager``: the backends with the fewest GPU runs first; in a
    dry run ``eager``), from the same weights: each row's ``stage_backend``, its
    ``vs_eager``, ``mfu``, ``first_loss_rel_diff`` (against eager's first loss),
    ``compile_s`` / ``warmup_s`` / ``stage_compile_s``, and ``host_issue_ms`` against
    ``compute_busy_ms``. ``--finetune-modes`` picks its runs (of ``lora``, ``qlora``,
    ``full``, ``longest``; default ``lora,full,longest``): a section cut off by its share
    of the budget keeps the rows it finished;
11. ``many_devices``: eight logical devices on one GPU (``CudaDevice(0, memory_limit=
    total // 8, name="cuda:0/i")``, as ``scaling``'s two), the kit's model at most 16 blocks
    deep with bf16 device copies, under ``stage_backend`` ``"eager"`` and
    ``"cudagraphs"`` from the same weights, over calls alternating two lengths (L1, L2,
    L1, ...): per backend the host's issue µs per device action and per kernel
    (``issue``: per action kind, kernels as the cost pass counts them and a graph job's
    launches), ``issue_lock_wait_ms``, the GPU idle time attributable to issue from a
    traced call (``issue_idle``: compute-stream gaps before the host began issuing the
    next compute action), ``graph_captures`` after each call (``captures_after_step``:
    they must plateau once each length was seen) and ``memory``
    (``torch.cuda.max_memory_reserved`` against ``predict_memory``'s peaks with the
    graphs); ``ok`` when the losses agree within bf16's tolerance and the captures
    plateau (``fxpipe.check.many_devices``). Its dry run: eight virtual devices, 4 blocks,
    and the segments' own graphs standing in for inductor's CPU compile;
12. ``data_parallel``: ``data_parallel="device"`` in a one-rank job on up to two GPUs
    (the device reduce-scatters through the NCCL groups ``compile`` makes, on the
    runtime's ``collective`` streams; a dry run: gloo on the virtual devices' tensors),
    two SGD steps, a step after a ``no_sync()`` call (``sRS+``) and one by the optimizer
    after a call without it (``sAR``) against the same pipe without data parallel:
    ``max_loss_rel_diff``, ``max_param_diff``, ``device_reduce_scatters`` a step,
    ``accumulated_reduce_scatters``, ``device_all_reduces``, ``d2h_bytes_grads``,
    ``h2d_bytes_grads``; then ``data_parallel="zero3"``'s two steps (its parameters in
    a shared host file, page-locked, each stage's ``sAG``): ``zero3_max_loss_rel_diff``,
    ``zero3_max_param_diff``, ``zero3_all_gathers``; then ``data_parallel=True``'s (each
    stage's ``sAR`` on the GPUs, the optimizer unsharded): ``true_max_loss_rel_diff``,
    ``true_max_param_diff``, ``true_all_reduces``; ``ok`` when they agree within 1e-5
    (``fxpipe.check.data_parallel``). Several ranks need a GPU each: the CPU suite runs 2
    and 4.

``--sections NAME,...`` runs those sections, in that order (the kit no longer fits one
10-minute command: a lent GPU runs it as two).

Each section runs in ``try``/``except``: a failure is recorded as that section's
``error`` (type, message, last traceback lines) with ``"ok": false`` and the kit goes on;
the exit code is 1 when any section failed. Every section has ``ok`` and ``seconds``.

Time: the kit fits ``--budget-s`` (default 540 s, inside a 10-minute slot). Each section
may use what is left of it less a reserve for the sections after it; the CUDA tests'
subprocess gets that as its timeout, other sections get an alarm; a section past it is
recorded as a timeout error (the tests' with the tail of their output), a section with no
time left as ``BudgetSpent``.

Measuring: ``gc.collect()`` and, on GPUs, ``torch.cuda.synchronize()`` and
``torch.cuda.empty_cache()`` run between sections and before each variant's (warm-up,
timed) pair of calls, so eager and fxpipe never time inside each other's allocator state.
The pipe's layer timer (``pipe.timings``) times some calls layer by layer (an event at
each layer boundary of the stage code); it is switched off for the calls
``vs_checkpoint``, ``scaling`` and ``bigger_than_device`` time, and
``timed_calls_sampled`` says whether any was timed anyway (always, in verbose mode).

The model is a Llama-style decoder (``fxpipe.demo.TinyLlama``) sized to the GPU: its fp32
parameters about a quarter of one GPU's memory (at most 8% of host RAM). ``--dry-run``
runs the same code on two CPU virtual devices with a GPU's semantics
(``VirtualDevice(semantics="cuda")``, ``memory_limit`` as the cap of
``bigger_than_device`` and ``generate``) and tiny models: what CI runs, so the kit cannot
rot without a GPU.

The package: ``harness`` runs the sections (the time budget, the alarm, the JSON written
after each, failures recorded), ``sections`` lists them in order with their share of the
budget and their one-line summary, ``__main__`` is the command line; the sections are
``cuda_tests``, ``step`` (``vs_checkpoint``, ``scaling``), ``traced`` (``hidden_prefetch``,
``predicted_vs_measured``, ``stats``: one traced step, its figures from
``fxpipe.runtime.issue.trace``), ``bigger_than_device``, ``weights``, ``generate``,
``finetune`` (also ``benchmarks/bench_finetune.py``'s measurement), ``many_devices`` and
``data_parallel``;
``common`` is what they share (timing, the kit's model and devices, JSON-safe records).
"""
