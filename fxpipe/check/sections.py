"""The GPU kit's sections, in the order they run: each one's function, its share of the
time budget (kept for it while the sections before it run) and its one-line summary.
Adding a section: a function of the ``Kit`` returning a dict with ``ok``, and a line here.

>>> list(SECTIONS)[:3]
['cuda_tests', 'vs_checkpoint', 'scaling']
"""

from __future__ import annotations

from fxpipe.check import (bigger_than_device, cuda_tests, data_parallel, finetune, generate,
                          many_devices, step, traced, weights)
from fxpipe.check.harness import Section

SECTIONS: dict[str, Section] = {s.name: s for s in (
    Section("cuda_tests", cuda_tests.cuda_tests, 0.0, cuda_tests.cuda_tests_summary,
            alarm=False),   # its subprocess has its own timeout: an alarm would cut its tail off
    Section("vs_checkpoint", step.vs_checkpoint, 0.12, step.vs_checkpoint_summary),
    Section("scaling", step.scaling, 0.12, step.scaling_summary),
    Section("hidden_prefetch", traced.hidden_prefetch, 0.10, traced.hidden_prefetch_summary),
    Section("predicted_vs_measured", traced.predicted_vs_measured, 0.04,
            traced.predicted_vs_measured_summary),
    Section("stats", traced.stats, 0.01, traced.stats_summary),
    Section("bigger_than_device", bigger_than_device.bigger_than_device, 0.15,
            bigger_than_device.bigger_than_device_summary),
    Section("weights", weights.weights, 0.05, weights.weights_summary),
    Section("generate", generate.generate, 0.06, generate.generate_summary),
    Section("finetune", finetune.finetune, 0.45, finetune.finetune_summary),
    # sized for under 3 min on a GPU: ~150 s of the default budget beside every section but
    # finetune (a lent GPU's second command), all of it alone (--sections many_devices)
    Section("many_devices", many_devices.many_devices, 0.30, many_devices.many_devices_summary),
    Section("data_parallel", data_parallel.data_parallel, 0.03,
            data_parallel.data_parallel_summary),
)}
