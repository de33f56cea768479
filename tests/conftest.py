"""Suite-wide fixtures.

The runtime's own tests (``ON_CUDA_SIM``) run on virtual devices with a GPU's semantics
toward the host (``VirtualDevice(semantics="cuda")``, strict: copies land when their
stream reaches them, unwritten memory reads as NaN, a device op outside the device's work
is refused), so a host read of data still in flight fails here, as it would on a GPU; the
others on plain virtual devices (copies done when they return), what a CPU user runs.
``FXPIPE_TEST_DEVICE=cuda-sim`` runs every test on GPU semantics,
``FXPIPE_TEST_DEVICE=virtual`` every one on plain devices. The HF matrix runs on plain
devices, and a few of its cases again on GPU semantics (``test_hf_matrix.CUDA_SIM``).

The suite runs on two processes (``pytest -n 2 --dist worksteal``, pytest-xdist: CI has 2
cores; a worker out of tests takes half of the other's). The test that runs a suite again
in a subprocess (``test_kernel_variants.py``) is the longest by far; it is collected
first, so it starts at once instead of running alone at the end.

A test marked ``bitwise`` asserts bitwise equality between fxpipe and a reference (eager
PyTorch, or the captured program). Its reference runs on one intra-op thread, as every
fxpipe worker does: some kernels split a reduction per thread, and the claim is "the same
kernels in the same order". ``test_kernel_variants.py`` runs these tests again under other
kernel code paths, so a claim that holds on one CPU's BLAS path only fails here.
"""

from __future__ import annotations

import os

import pytest
import torch

# The suite's models are tiny: planned with the host's cost of issuing an action, most
# would run as one stage. They are planned as if issuing were free (subprocesses inherit
# it), so their pipelines keep several stages; the tests of that cost pass it explicitly.
os.environ.setdefault("FXPIPE_HOST_MS_PER_ACTION", "0")   # before fxpipe is imported
from fxpipe.runtime.devices import emulator  # noqa: E402

TEST_DEVICE = os.environ.get("FXPIPE_TEST_DEVICE")
if TEST_DEVICE not in (None, "virtual", "cuda-sim"):
    raise ValueError(f"FXPIPE_TEST_DEVICE must be 'virtual' or 'cuda-sim', got {TEST_DEVICE!r}")
if TEST_DEVICE == "cuda-sim":
    emulator.default_semantics = "cuda"
# the runtime's tests: on GPU semantics unless FXPIPE_TEST_DEVICE says otherwise
ON_CUDA_SIM = {"test_runtime.py", "test_compile.py", "test_microbatch.py",
               "test_mixed_precision.py", "test_optim.py", "test_params.py",
               "test_grad_flow.py", "test_recompute.py", "test_reliability.py",
               "test_backend.py", "test_fuzz.py", "test_artifact.py"}


@pytest.fixture(autouse=True)
def _runtime_tests_on_cuda_semantics(request, monkeypatch):
    if TEST_DEVICE is None and request.path.name in ON_CUDA_SIM:
        monkeypatch.setattr(emulator, "default_semantics", "cuda")


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


# The files holding the longest tests (`pytest --durations`), longest first: run first, so
# that no worker is left running a long test alone at the end of the suite.
_LONGEST_FIRST = ("test_kernel_variants.py", "test_check.py", "test_hf_matrix.py",
                  "test_generate.py", "test_examples.py", "test_trainer.py", "test_distributed.py",
                  "test_fuzz.py", "test_docs.py", "test_reliability.py", "test_cudagraphs.py")


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: next((k for k, f in enumerate(_LONGEST_FIRST)
                                      if item.nodeid.startswith(f"tests/{f}")), len(_LONGEST_FIRST)))

