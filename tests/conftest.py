"""Suite-wide fixtures.

A test marked ``bitwise`` asserts bitwise equality between fxpipe and a reference (eager
PyTorch, or the captured program). Its reference runs on one intra-op thread, as every
fxpipe worker does: some kernels split a reduction per thread, and the claim is "the same
kernels in the same order". ``test_kernel_variants.py`` runs these tests again under other
kernel code paths, so a claim that holds on one CPU's BLAS path only fails here.
"""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread_for_bitwise(request):
    if request.node.get_closest_marker("bitwise") is None:
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
