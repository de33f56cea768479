"""Stage code: a lowered stage GraphModule as it runs on a device.

Imports ``runtime.devices`` and ``runtime.host``.

- ``stage_code``: a stage's runnable code, generated from the printed GraphModule, its
  transfer nodes served from what the actions moved (``run_stage``).
- ``compiled``: stage code compiled per layer by a backend
  (``RunConfig(stage_backend="inductor" | "auto")``).
- ``graphs``: stage jobs captured as device graphs and replayed
  (``stage_backend="cudagraphs"``): parameter slots, job keys, static-address checks.
- ``unfilled``: the recompute that records nodes for autograd without computing them.
- ``amp``: autocast captured on the calling thread, re-entered in the workers.
- ``rng``: per-layer, per-microbatch random states (dropout replays in the recompute).
- ``timer``: measured per-layer times (bias-corrected moving averages).

A new stage backend: start at ``compiled.py`` (how a backend replaces a layer's code)
and ``stage_code.py`` (what every backend must keep: the transfer nodes).
"""
