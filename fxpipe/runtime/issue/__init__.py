"""Issue: one call, from the caller's inputs to outputs and ``.grad``.

May import every other room of the runtime.

- ``pipeline``: :class:`Runner`, one call: split, run the Executable, merge.
- ``executor``: interprets a Program; ``threads``: the issue threads (one per lane) and
  what each is doing (``WHERE``), cancelling a call.
- ``compute``: the compute actions' handlers (forward, fused backward, recompute,
  checkpoint); ``values``: a call's record (``Call``, ``Stats``) and where its values
  live while it runs.
- ``microbatch``: split inputs and labels, merge outputs; ``inputs``: a call checked
  against the graph it runs; ``loss_weights``: each microbatch's weight in merged 0-dim
  outputs and the fused loss (rows, target tokens, a ``loss_fn``'s ``(sum, count)``).
- ``autograd``: eager-style ``pipe(x)`` + ``.backward()``; ``interrupts``: sections a
  Ctrl-C must not split; ``trace``: a real run's timeline.
- ``distributed``: data parallel across processes, the collectives of a Program's host
  lane; ``device_collectives``: posting them in the Program's order per process group,
  and ``data_parallel="device"``'s reduce-scatters on the devices; ``zero3``:
  ``data_parallel="zero3"``'s parameters, shared in host memory by one host's ranks.

A new action: add its dataclass in ``fxpipe/passes/actions.py`` (it prints), its handler
here (``compute.py`` for device work, ``executor.py`` for the host lane), and its
simulated cost in ``fxpipe/sim/simulate.py``.
"""
