"""RunConfig: how one call runs (grad, output device, microbatches, split/merge, plan).

Every field is ``None`` when unset. A model-level config (given to ``compile``) supplies
defaults, a call-level config overrides each field it sets, and ``resolved`` fills what
is still unset with the defaults at call time.

>>> model_level = RunConfig(num_microbatch=8, recompute_grain="layer")
>>> call = RunConfig.merge(model_level, RunConfig(num_microbatch=2))
>>> call.num_microbatch, call.recompute_grain
(2, 'layer')
>>> final = call.resolved(num_devices=4)
>>> final.output_device, final.preserve_rng_state, final.num_microbatch
(device(type='cpu'), True, 2)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

import torch

from fxpipe.stage_plan import StagePlan

_GRAINS = ("stage", "layer")
STAGE_BACKENDS = ("eager", "inductor", "auto", "cudagraphs")   # fxpipe.runtime.stages.compiled, .graphs


@dataclass(frozen=True)
class RunConfig:
    """Run configuration; ``None`` means "unset" (see the module docstring).

    - ``requires_grad``: build a differentiable result (default ``torch.is_grad_enabled()``).
    - ``output_device``: where outputs land (default cpu); a str or int is converted.
    - ``preserve_rng_state``: replay dropout masks exactly on recompute (default True).
    - ``recompute_grain``: ``"stage"`` or ``"layer"`` (default ``"stage"``).
    - ``num_microbatch``: microbatches per call, >= 1 (default number of devices + 1).
    - ``split_input`` / ``split_label`` / ``merge_output``: see ``fxpipe.runtime.issue.microbatch``.
    - ``execute_plan``: an ``ExecutePlan`` (default: planned automatically).
    - ``stage_backend``: ``"auto"`` (the default, also ``None``): on GPUs (devices whose
      ``compiles_by_default`` is true: every ``CudaDevice``) inductor where it compiles,
      eager where it cannot or where a layer draws random numbers; on CPU devices
      (virtual devices) eager stage code, as ``"eager"``. ``"inductor"``: each layer
      segment of the stage code compiled by inductor, shared across repeated blocks, a
      layer it cannot compile refused (``fxpipe.runtime.stages.compiled``); or
      ``"cudagraphs"``: inductor's code, and
      each forward job and stage recompute-and-backward of a stage that can be captured
      replayed as a device graph (a CUDA graph), its parameters uploaded to the same
      device memory every round (``fxpipe.runtime.stages.graphs``; the fused tail and
      layer-grain backward run the compiled code).
    - ``sequence_chunks``: ``None`` (default), or ``K``: each sequence runs as ``K`` token
      chunks (the call's microbatches) through the stages, attention reading the earlier
      chunks' keys and values; the result equals the unchunked call; ``"auto"``: the
      fewest chunks whose plan fits the devices (``fxpipe.sequence_chunks``).
    """

    requires_grad: bool | None = None
    output_device: torch.device | None = None
    preserve_rng_state: bool | None = None
    recompute_grain: Literal["stage", "layer"] | None = None
    num_microbatch: int | None = None
    split_input: Any = None
    split_label: Any = None
    merge_output: Any = None
    execute_plan: StagePlan | None = None
    stage_backend: Literal["eager", "inductor", "auto", "cudagraphs"] | None = None
    sequence_chunks: int | Literal["auto"] | None = None

    def __post_init__(self) -> None:
        for name in ("requires_grad", "preserve_rng_state"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise TypeError(f"RunConfig.{name} must be True, False or None, got {value!r}")
        if self.output_device is not None:
            device = self.output_device
            if isinstance(device, bool) or not isinstance(device, (torch.device, str, int)):
                raise TypeError("RunConfig.output_device must be a torch.device, a str like "
                                f"'cuda:0', an int or None, got {device!r}")
            try:
                device = torch.device(device)
            except (RuntimeError, ValueError, TypeError) as e:
                raise ValueError(f"RunConfig.output_device: {device!r} is not a device ({e})") from e
            object.__setattr__(self, "output_device", device)
        if self.recompute_grain is not None and self.recompute_grain not in _GRAINS:
            raise ValueError(f"RunConfig.recompute_grain must be 'stage' or 'layer', got "
                             f"{self.recompute_grain!r}")
        n = self.num_microbatch
        if n is not None:
            if isinstance(n, bool) or not isinstance(n, int):
                raise TypeError(f"RunConfig.num_microbatch must be an int, got {n!r}")
            if n < 1:
                raise ValueError(f"RunConfig.num_microbatch must be >= 1, got {n}")
        si = self.split_input
        if si is not None and not callable(si) and not (isinstance(si, (tuple, list)) and len(si) == 2):
            raise TypeError("RunConfig.split_input must be None, (args_spec, kwargs_spec) or a "
                            f"callable (args, kwargs, n) -> (list[tuple], list[dict]); got {si!r}")
        backend = self.stage_backend
        if backend is not None and backend not in STAGE_BACKENDS:
            raise ValueError(f"RunConfig.stage_backend must be None, 'eager', 'inductor', "
                             f"'auto' or 'cudagraphs', got {backend!r}")
        k = self.sequence_chunks
        if k is not None and k != "auto" and (isinstance(k, bool) or not isinstance(k, int)):
            raise TypeError(f"RunConfig.sequence_chunks must be None, an int or 'auto', got {k!r}")
        if isinstance(k, int) and k < 1:
            raise ValueError(f"RunConfig.sequence_chunks must be >= 1, got {k}")
        if self.execute_plan is not None and not isinstance(self.execute_plan, StagePlan):
            raise TypeError("RunConfig.execute_plan must be an fxpipe.ExecutePlan or None, got "
                            f"{type(self.execute_plan).__name__}")

    @classmethod
    def merge(cls, model_level: RunConfig | None, call_level: RunConfig | None) -> RunConfig:
        """Call-level fields that are not ``None`` win over model-level ones.

        >>> RunConfig.merge(RunConfig(merge_output=True), RunConfig(merge_output=False)).merge_output
        False
        """
        for name, value in (("model_level", model_level), ("call_level", call_level)):
            if value is not None and not isinstance(value, RunConfig):
                raise TypeError(f"RunConfig.merge: {name} must be a RunConfig or None, got "
                                f"{type(value).__name__}")
        base, over = model_level or cls(), call_level or cls()
        return cls(**{f.name: getattr(over, f.name) if getattr(over, f.name) is not None
                      else getattr(base, f.name) for f in dataclasses.fields(cls)})

    def resolved(self, num_devices: int, compiles: bool = False) -> RunConfig:
        """A copy with the defaults filled in, evaluated now (``requires_grad`` follows
        ``torch.is_grad_enabled()`` at this call). ``split_input``, ``split_label``,
        ``merge_output`` and ``execute_plan`` stay ``None`` (= auto) when unset.
        ``stage_backend`` ``"auto"`` (or unset) stays ``"auto"`` where ``compiles`` (the
        devices are GPUs: ``Device.compiles_by_default``), else becomes ``"eager"``.

        >>> with torch.no_grad():
        ...     RunConfig().resolved(2).requires_grad
        False
        >>> RunConfig().resolved(2).stage_backend, RunConfig().resolved(2, compiles=True).stage_backend
        ('eager', 'auto')
        """
        if isinstance(num_devices, bool) or not isinstance(num_devices, int) or num_devices < 1:
            raise ValueError(f"RunConfig.resolved: num_devices must be an int >= 1, got "
                             f"{num_devices!r}")
        defaults = dict(requires_grad=torch.is_grad_enabled(), output_device=torch.device("cpu"),
                        preserve_rng_state=True, recompute_grain="stage",
                        num_microbatch=num_devices + 1)
        out = dataclasses.replace(self, **{k: v for k, v in defaults.items()
                                           if getattr(self, k) is None})
        if out.stage_backend in (None, "auto"):
            out = dataclasses.replace(out, stage_backend="auto" if compiles else "eager")
        return out
