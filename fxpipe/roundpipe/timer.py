"""``from roundpipe.timer import ModelTimer; ModelTimer.VERBOSE = True`` as
``fxpipe.roundpipe.timer``: per-layer forward / recompute / backward times printed to
stderr (``fxpipe.set_verbose``).

>>> from fxpipe.roundpipe.timer import ModelTimer
>>> ModelTimer.VERBOSE = True
>>> import fxpipe.verbose
>>> fxpipe.verbose.is_verbose()
True
>>> ModelTimer.VERBOSE = False
"""

from __future__ import annotations

from fxpipe.verbose import is_verbose, set_verbose

__all__ = ["ModelTimer"]


class _VerboseFlag(type):
    @property
    def VERBOSE(cls) -> bool:  # noqa: N802 — RoundPipe's name
        return is_verbose()

    @VERBOSE.setter
    def VERBOSE(cls, flag: bool) -> None:  # noqa: N802
        set_verbose(bool(flag))


class ModelTimer(metaclass=_VerboseFlag):
    """``ModelTimer.VERBOSE = True`` turns fxpipe's verbose per-layer timings on."""
