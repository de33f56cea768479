"""The ``>>>`` examples in fxpipe's docstrings run and print what they show.

One test per fxpipe module that has examples, run as ``doctest.testmod`` would (the
module's globals, ``ELLIPSIS | NORMALIZE_WHITESPACE``), with the failure report in the
assertion message. Process-wide state the examples may change is put back afterwards.
"""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest
import torch

import fxpipe
import fxpipe.verbose

OPTIONFLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
NEEDS_CUDA: frozenset[str] = frozenset()  # modules whose examples need a GPU (none yet)


def _module_names() -> list[str]:
    names = ["fxpipe"] + [m.name for m in pkgutil.walk_packages(fxpipe.__path__, "fxpipe.")]
    keep = []
    for name in names:
        try:
            module = importlib.import_module(name)
        except Exception:  # noqa: BLE001 — kept, so its test reports the import error
            keep.append(name)
            continue
        if any(t.examples for t in doctest.DocTestFinder().find(module)):
            keep.append(name)
    return sorted(keep)


MODULES = _module_names()


@pytest.fixture
def _restore_global_state():
    threads = torch.get_num_threads()
    rng = torch.random.get_rng_state()
    dtype = torch.get_default_dtype()
    grad = torch.is_grad_enabled()
    verbose = fxpipe.verbose._verbose
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        torch.random.set_rng_state(rng)
        torch.set_default_dtype(dtype)
        torch.set_grad_enabled(grad)
        fxpipe.verbose._verbose = verbose
        torch._dynamo.reset()  # fxpipe.backend's example torch.compiles a model


def test_modules_with_examples_were_found():
    assert {"fxpipe", "fxpipe.api", "fxpipe.passes.costs", "fxpipe.runtime.issue.trace"} <= set(MODULES)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name: str, _restore_global_state):
    if name in NEEDS_CUDA and not torch.cuda.is_available():
        pytest.skip("the examples need CUDA")
    module = importlib.import_module(name)
    runner = doctest.DocTestRunner(optionflags=OPTIONFLAGS)
    report: list[str] = []
    for test in doctest.DocTestFinder().find(module):
        runner.run(test, out=report.append)
    assert runner.tries > 0, f"{name} has no examples"
    assert runner.failures == 0, (f"{runner.failures} of {runner.tries} examples failed in "
                                  f"{name}:\n" + "".join(report))
