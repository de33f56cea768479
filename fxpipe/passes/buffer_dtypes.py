"""Which floating buffers the devices hold in ``param_dtype`` (mixed precision).

The reference is the model as a user loads it in that dtype. A Hugging Face model
(``from_pretrained(..., dtype=torch.bfloat16)``) is built under that default dtype: a
buffer its code makes in the default dtype is bf16 (XGLM's sinusoidal positions,
BatchNorm's running statistics), one it makes in fp32 explicitly stays fp32 (Llama's
rotary ``inv_freq``). Which is which is read off the same model class built from a copy
of its config under that default dtype on the ``meta`` device (nothing allocated; what
``from_pretrained`` builds before loading). Any other module is taken as
``module.to(torch.bfloat16)`` would hold it: every floating buffer in it. A generation's
KV cache (``runtime.host.params.mark_scratch``) is left as it is made.

Devices hold the buffers found here in ``param_dtype`` and the capture traces them so
(``capture_dtypes.parameters_in``); the host keeps the model's own tensors (a BatchNorm's
statistics written back are cast into them).

>>> import torch.nn as nn
>>> sorted(buffers_in_param_dtype(nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)),
...                               torch.bfloat16))
['1.running_mean', '1.running_var']
"""

from __future__ import annotations

import contextlib
import copy
import sys
import warnings

import torch
import torch.nn as nn

from fxpipe.passes.layer_graph import mark_in_param_dtype
from fxpipe.runtime.host.params import is_scratch
from fxpipe.verbose import warn


def buffers_in_param_dtype(model: nn.Module, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """``{fqn: buffer}`` of ``model``'s floating buffers a device holds in ``dtype`` (the
    module docstring's rule); empty without ``dtype``."""
    if dtype is None:
        return {}
    kept: set[int] = set()   # buffers the model keeps in another floating dtype
    for path, module in _hugging_face_models(model):
        made = _dtypes_when_built_in(module, dtype)
        if made is None:
            continue
        kept.update(id(b) for name, b in module.named_buffers(remove_duplicate=False)
                    if made.get(name, dtype) != dtype)
    return {fqn: b for fqn, b in model.named_buffers()
            if b.is_floating_point() and b.dtype != dtype and id(b) not in kept
            and not is_scratch(b)}


def mark(model: nn.Module, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """:func:`buffers_in_param_dtype`, each marked so for the costs and the runtime's
    uploads (``layer_graph.in_param_dtype``, ``LayerGraph.device_dtype``)."""
    found = buffers_in_param_dtype(model, dtype)
    mark_in_param_dtype(*found.values())
    return found


def _hugging_face_models(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The outermost ``PreTrainedModel`` modules in ``model`` (itself, or e.g. the one a
    peft model or a generation step wraps), with their paths."""
    hf = sys.modules.get("transformers.modeling_utils")
    if hf is None:   # no Hugging Face model can exist without it imported
        return []
    found: list[tuple[str, nn.Module]] = []
    for path, module in model.named_modules():
        if isinstance(module, hf.PreTrainedModel) and not any(
                p == "" or path.startswith(p + ".") for p, _ in found):
            found.append((path, module))
    return found


def _dtypes_when_built_in(module: nn.Module, dtype: torch.dtype) -> dict[str, torch.dtype] | None:
    """``{name: dtype}`` of the buffers of ``module``'s class built from a copy of its
    config under the default dtype ``dtype``, on the meta device; None (with a warning)
    when it cannot be built so."""
    cls = type(module)
    try:
        from transformers import initialization
        safe = getattr(initialization, "meta_device_safe_creation_ops", contextlib.nullcontext)
        with warnings.catch_warnings(), torch.device("meta"), safe():
            warnings.simplefilter("ignore")
            twin = cls._from_config(copy.deepcopy(module.config), dtype=dtype)
    except Exception as e:  # noqa: BLE001 — any failure: fall back to module.to(dtype)
        warn(f"fxpipe: param_dtype={dtype}: could not build {cls.__name__} from its config "
             f"under that default dtype to see which buffers it keeps in fp32 "
             f"({type(e).__name__}: {str(e)[:200]}); the devices hold all its floating buffers "
             f"in {dtype}, as {cls.__name__}.to({dtype}) would")
        return None
    return {name: b.dtype for name, b in twin.named_buffers(remove_duplicate=False)}
