"""Verbose mode: print per-layer timings to stderr as they are measured; and ``warn``,
a warning that points at the user's line.

``set_verbose(True)`` turns it on, ``set_verbose(False)`` off, ``set_verbose(None)`` goes
back to the environment variable ``FXPIPE_VERBOSE`` (``1``/``true``/``yes``/``on``), which
is read when ``is_verbose()`` is called, never at import.

>>> set_verbose(True); is_verbose()
True
>>> set_verbose(None)
"""

from __future__ import annotations

import os
import sys
import warnings

_verbose: bool | None = None  # None: follow FXPIPE_VERBOSE


def set_verbose(flag: bool | None = True) -> None:
    """Turn verbose timing output on or off (``None``: follow ``FXPIPE_VERBOSE``)."""
    global _verbose
    if flag is not None and not isinstance(flag, bool):
        raise TypeError(f"set_verbose expects True, False or None, got {flag!r}")
    _verbose = flag


def is_verbose() -> bool:
    """Whether verbose output is on: the last ``set_verbose`` value, else ``FXPIPE_VERBOSE``."""
    if _verbose is not None:
        return _verbose
    return os.environ.get("FXPIPE_VERBOSE", "").strip().lower() in ("1", "true", "yes", "on")


_PACKAGE = os.path.dirname(os.path.abspath(__file__))


def warn(message: str) -> None:
    """``warnings.warn(message)`` (a ``UserWarning``) attributed to the first frame outside
    fxpipe: the user's call that led to it, however deep in fxpipe it was found."""
    level, frame = 2, sys._getframe(1)   # 1: this function's own frame
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, stacklevel=level)
