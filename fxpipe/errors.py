"""The exceptions fxpipe raises. Each message says what was wrong, where, and what to do."""

from __future__ import annotations

import os
import sys
import warnings

import torch

_INTERNAL = (os.path.dirname(os.path.abspath(__file__)), os.path.dirname(torch.__file__))


def warn_user(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn`` attributed to the first caller outside fxpipe and torch (the
    user's line that made the call), whichever path led here."""
    frame, level = sys._getframe(1), 2
    while frame is not None and frame.f_code.co_filename.startswith(_INTERNAL):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)


class CaptureError(RuntimeError):
    """No capture method could turn the model into a graph.

    ``attempts`` maps each method tried (``"fx"``, ``"export"``, ``"dynamo"``) to the
    exception it hit.
    """

    def __init__(self, message: str, attempts: dict[str, BaseException] | None = None):
        super().__init__(message)
        self.attempts = dict(attempts or {})


class PlanError(ValueError):
    """An ExecutePlan breaks a rule (message names the range and the rule), or no plan fits."""


class StageError(RuntimeError):
    """A failure inside a stage: names the stage, its layers, the device and the microbatch.

    The original exception is chained as ``__cause__``.
    """

    def __init__(self, message: str, *, stage: int | None = None, layers: range | None = None,
                 device: str | None = None, microbatch: int | None = None, action: str | None = None):
        super().__init__(message)
        self.stage = stage
        self.layers = layers
        self.device = device
        self.microbatch = microbatch
        self.action = action


class DeviceMemoryError(torch.OutOfMemoryError):
    """A device's memory limit would be exceeded (names the stage and the bytes)."""


class DistributedError(RuntimeError):
    """Data parallel: a collective failed or timed out, or another rank failed (``rank``:
    the rank whose failure caused it, when known). The process group fxpipe made for the
    pipe cannot be used again: restart every rank and resume from a checkpoint."""

    def __init__(self, message: str, *, rank: int | None = None):
        super().__init__(message)
        self.rank = rank
