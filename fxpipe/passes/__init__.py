"""The compiler passes: capture → partition → costs → lower → schedule (see docs/design.md).

The runtime reads only the values they make (``layer_graph``, ``program``, ``stage``),
never a pass; ``tests/test_layers.py`` lists the layers.
"""

from __future__ import annotations

import contextlib
import gc
import operator
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector while passes build many small objects.

    The passes create tens of thousands of fx nodes and containers; with a large heap
    (torch, transformers) every generation-2 collection triggered meanwhile walks all of
    it, which made lowering a 100-layer model ~3x slower. Reference counting still frees
    everything; collection resumes afterwards.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def fetch_attr(root: Any, target: str) -> Any:
    """What a ``get_attr`` node's dotted ``target`` names in ``root`` (a GraphModule, or
    the module it was traced from): a parameter, buffer, constant or submodule."""
    return operator.attrgetter(target)(root)
