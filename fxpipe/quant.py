"""Frozen weights held, moved and streamed quantized (QLoRA-class): ``frozen_dtype=``.

``fxpipe.compile(model, ..., frozen_dtype="nf4" | "int8" | "fp8")`` (or
:func:`quantize_frozen` before it) replaces, in place, the weight of each frozen
``nn.Linear`` (``requires_grad=False``: a LoRA base) by one ``uint8`` parameter holding it
quantized, as ``torchao.quantize_`` and bitsandbytes' ``Linear4bit`` do. The host keeps
that and nothing else (the bf16 or fp32 original is freed), the stage's upload carries
those bytes, and the stage code dequantizes on the device right before the product:

    weight = torch.ops.fxpipe.dequantize.default(q_proj_weight_nf4, 'nf4', [64, 64], torch.bfloat16)
    linear = torch._C._nn.linear(x, weight)

Formats, in blocks of 64 consecutive elements, each with its fp32 scale (the absmax):

========  ===========================================================  ==============
format    codes                                                        bytes / weight
========  ===========================================================  ==============
``nf4``   4-bit NormalFloat (QLoRA's 16 levels), two per byte,          0.5625
          the first in the high nibble (bitsandbytes' layout)
``int8``  symmetric ``round(x / absmax * 127)``                         1.0625
``fp8``   ``float8_e4m3fn`` of ``x / absmax * 448``                     1.0625
========  ===========================================================  ==============

The blob is ``[codes | scales]``: the scales ride as the blob's bytes, so nothing that
converts floating parameters (``param_dtype``, ``HostParams``' per-dtype buffers) ever
touches them. Dequantizing computes ``code value × scale`` in fp32 and casts to the
dtype the devices compute in (``param_dtype``, else the weight's own): elementwise, so a
device and the host give the same bits, and a step equals eager on the model whose
weights were dequantized once on the host (:func:`dequantized_copy`).

Why fxpipe's own codes rather than torchao's or bitsandbytes' tensors: the dequantize
must be an op of the stage graph that every stage backend (eager, inductor, CUDA graphs)
and the CPU's virtual devices run, on a GPU machine that may have neither library; it is
twenty lines of torch. A model a user loaded quantized with bitsandbytes (NF4
``Linear4bit``) is converted byte for byte, without dequantizing its weights
(:func:`adopt_quantized`); other quantized tensors are refused with the route that works.

Embeddings and the output head stay in their dtype by default (QLoRA's default): the
head is ``get_output_embeddings()`` of a Hugging Face model; ``skip=`` names others.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Collection, Iterator
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
from torch import Tensor

BLOCK = 64    # elements per scale
FORMATS = ("nf4", "int8", "fp8")
# QLoRA's NormalFloat-4 levels (bitsandbytes' ``code`` for quant_type="nf4")
NF4_LEVELS = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
              -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
              0.07958029955625534, 0.16093020141124725, 0.24611230194568634,
              0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
              0.7229568362236023, 1.0)
_CODE_MAX = {"int8": 127.0, "fp8": 448.0}
_CHUNK = 1 << 22   # elements quantized at once (bounds the host's transient memory)
# device memory traffic of one dequantize, bytes per weight element besides the output's
# (:func:`dequantize`, as it runs eagerly): nf4 reads its code byte (0.5), writes and reads
# the int32 byte indices (2 + 2), writes and reads the fp32 level pairs (4 + 4); int8
# and fp8 read their code (1) and write and read its fp32 value (4 + 4)
TRAFFIC = {"nf4": 12.5, "int8": 9.0, "fp8": 9.0}


def code_bytes(fmt: str, numel: int) -> int:
    return numel // 2 if fmt == "nf4" else numel


def blob_bytes(fmt: str, numel: int) -> int:
    """Bytes one weight of ``numel`` elements takes in ``fmt``, scales included."""
    return code_bytes(fmt, numel) + 4 * (numel // BLOCK)


_TABLES: dict[torch.device, Tensor] = {}


def _nf4_pairs(device: torch.device) -> Tensor:
    """``[256, 2]``: the two NF4 levels each byte holds (high nibble first), fp32."""
    table = _TABLES.get(device)
    if table is None:
        levels = torch.tensor(NF4_LEVELS, dtype=torch.float32)
        table = torch.stack([levels.repeat_interleave(16), levels.repeat(16)], 1)
        table = _TABLES[device] = table.to(device)
        if device.type == "cuda":   # written on this stream, read from any stream later
            torch.cuda.current_stream(device).synchronize()
    return table


def _values(codes: Tensor, fmt: str) -> Tensor:
    """The fp32 code values of ``codes`` (uint8), one per element."""
    if fmt == "nf4":
        return _nf4_pairs(codes.device)[codes.int()]
    return codes.view(torch.int8 if fmt == "int8" else torch.float8_e4m3fn).float()


@torch.library.custom_op("fxpipe::dequantize", mutates_args=())
def dequantize(blob: Tensor, fmt: str, shape: list[int], dtype: torch.dtype) -> Tensor:
    """The weight ``blob`` holds in ``fmt`` (see the module), of ``shape``, in ``dtype``:
    code value × its block's scale in fp32, rounded once to ``dtype``."""
    numel = math.prod(shape)
    n = code_bytes(fmt, numel)
    scales = blob[n:].view(torch.float32)
    out = torch.empty(shape, dtype=dtype, device=blob.device)
    torch.mul(_values(blob[:n], fmt).view(-1, BLOCK), scales[:, None], out=out.view(-1, BLOCK))
    return out


@dequantize.register_fake
def _(blob, fmt, shape, dtype):
    return blob.new_empty(shape, dtype=dtype)


def dequantize_traffic(gm: torch.fx.GraphModule) -> int:
    """Device memory bytes the dequantizes of ``gm`` move per run (:data:`TRAFFIC`, plus
    each output's bytes): what ``fxpipe.simulate`` and the planner price at the device's
    memory bandwidth (``Hardware.device_bytes_per_s``)."""
    total = 0
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target in (torch.ops.fxpipe.dequantize.default,
                                                    torch.ops.fxpipe.dequantize):
            _, fmt, shape, dtype = n.args
            total += int(math.prod(shape) * (TRAFFIC[fmt] + dtype.itemsize))
    return total


def quantize(w: Tensor, fmt: str) -> Tensor:
    """``w`` as one ``uint8`` blob in ``fmt`` (``w.numel()`` a multiple of 64). A ``meta``
    tensor gives a ``meta`` blob of the right size. Quantizes ``_CHUNK`` elements at a time,
    so a weight read from a memory-mapped checkpoint is never held whole in fp32."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown quantized format {fmt!r}; one of {', '.join(FORMATS)}")
    numel = w.numel()
    if numel % BLOCK:
        raise ValueError(f"a {tuple(w.shape)} weight cannot be quantized in blocks of {BLOCK}")
    blob = torch.empty(blob_bytes(fmt, numel), dtype=torch.uint8, device=w.device)
    if w.device.type == "meta":
        return blob
    n = code_bytes(fmt, numel)
    codes, scales = blob[:n], blob[n:].view(torch.float32)
    flat = w.detach().reshape(-1)
    per_code = numel // n
    levels = torch.tensor(NF4_LEVELS, device=w.device)
    midpoints = (levels[1:] + levels[:-1]) / 2
    for start in range(0, numel, _CHUNK):
        x = flat[start:start + _CHUNK].float().view(-1, BLOCK)
        absmax = x.abs().amax(1)
        blocks = slice(start // BLOCK, start // BLOCK + x.shape[0])
        if fmt == "nf4":
            scales[blocks] = absmax
            unit = x / torch.where(absmax > 0, absmax, 1.0)[:, None]
            idx = torch.bucketize(unit, midpoints).to(torch.uint8).view(-1, 2)
            c = (idx[:, 0] << 4) | idx[:, 1]
        else:
            scale = torch.where(absmax > 0, absmax / _CODE_MAX[fmt], 1.0)
            scales[blocks] = scale
            y = x / scale[:, None]
            c = (y.round().clamp_(-127, 127).to(torch.int8) if fmt == "int8"
                 else y.to(torch.float8_e4m3fn)).view(torch.uint8)
        codes[start // per_code:(start + x.numel()) // per_code] = c.view(-1)
    return blob


# -- the quantized linear --------------------------------------------------------------

@dataclass(frozen=True)
class QuantizedWeight:
    """What a quantized module's ``weight`` dequantizes from: the parameter holding the
    blob (``name``), its format, the weight's shape and the dtype it dequantizes to."""

    name: str
    fmt: str
    shape: tuple[int, ...]
    dtype: torch.dtype


def _weight(self) -> Tensor:
    q: QuantizedWeight = self._fxpipe_quantized
    return torch.ops.fxpipe.dequantize(getattr(self, q.name), q.fmt, list(q.shape), q.dtype)


_CLASSES: dict[type, type] = {}


def _quantized_class(cls: type) -> type:
    """``cls`` with a ``weight`` property that dequantizes (one class per linear class,
    named as it is, a subclass of it: ``isinstance(m, nn.Linear)`` still holds)."""
    if getattr(cls, "_fxpipe_quantized_class", False):
        return cls
    if cls not in _CLASSES:
        def extra_repr(self) -> str:
            return f"{cls.extra_repr(self)}, weight={self._fxpipe_quantized.fmt}"
        _CLASSES[cls] = type(cls.__name__, (cls,), {
            "weight": property(_weight), "extra_repr": extra_repr,
            "_fxpipe_quantized_class": True, "__module__": cls.__module__,
            "__qualname__": cls.__qualname__})
    return _CLASSES[cls]


def quantized_weight(module: nn.Module) -> QuantizedWeight | None:
    return module.__dict__.get("_fxpipe_quantized")


def _install(module: nn.Linear, fmt: str, blob: Tensor, shape: tuple[int, ...],
             dtype: torch.dtype, cls: type) -> None:
    """``module``'s weight replaced by ``blob`` (its ``weight_{fmt}``), ``module`` made the
    quantized class of ``cls``."""
    name = f"weight_{fmt}"
    module._parameters.pop("weight", None)
    module.register_parameter(name, nn.Parameter(blob, requires_grad=False))
    module._fxpipe_quantized = QuantizedWeight(name, fmt, tuple(shape), dtype)
    module.__class__ = _quantized_class(cls)


def _skipped(model: nn.Module, skip: Collection[str] | None) -> set[int]:
    """ids of the modules left unquantized: ``skip``'s names, by default the output head."""
    modules = dict(model.named_modules())
    if skip is not None:
        unknown = sorted(set(skip) - set(modules))
        if unknown:
            raise ValueError(f"skip names modules the model does not have: {unknown[:5]}")
        return {id(modules[s]) for s in skip}
    head = getattr(model, "get_output_embeddings", None)
    with contextlib.suppress(Exception):
        head = head() if callable(head) else None
    return {id(head)} if isinstance(head, nn.Module) else set()


def quantize_frozen(model: nn.Module, fmt: str, *, skip: Collection[str] | None = None,
                    dtype: torch.dtype | None = None) -> list[str]:
    """Quantize, in place, the weight of every frozen ``nn.Linear`` of ``model`` to ``fmt``
    (``"nf4"``, ``"int8"``, ``"fp8"``); returns the names of the modules quantized.

    Left as they are: trainable weights, non-floating or tied ones (an embedding's table
    the head shares), weights whose size is not a multiple of 64, the modules named in
    ``skip`` (default: the output head, ``get_output_embeddings()``), and modules
    already quantized in ``fmt``. ``dtype``: what the weights dequantize to outside a
    pipe (default: their own dtype); a pipe dequantizes to its ``param_dtype``.

    >>> m = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8)).requires_grad_(False)
    >>> quantize_frozen(m, "nf4", skip=["1"])
    ['0']
    >>> m[0]
    Linear(in_features=64, out_features=64, bias=True, weight=nf4)
    >>> m[0].weight_nf4.dtype, m[0].weight_nf4.numel(), m[0].weight.shape
    (torch.uint8, 2304, torch.Size([64, 64]))
    """
    if fmt not in FORMATS:
        raise ValueError(f"frozen_dtype={fmt!r} is not a quantized format fxpipe has: "
                         f"{', '.join(map(repr, FORMATS))} (or None for the weights' own dtype)")
    skipped = _skipped(model, skip)
    uses: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        uses[id(p)] = uses.get(id(p), 0) + 1
    done = []
    for name, module in model.named_modules():
        q = quantized_weight(module)
        if q is not None:
            if q.fmt != fmt:
                raise ValueError(f"{name or 'the model'} is already quantized to {q.fmt}; "
                                 f"frozen_dtype={fmt!r} cannot quantize it again (load the "
                                 f"model again, or pass frozen_dtype={q.fmt!r})")
            continue
        w = module._parameters.get("weight") if isinstance(module, nn.Linear) else None
        if (w is None or id(module) in skipped or w.requires_grad or not w.is_floating_point()
                or uses[id(w)] > 1 or w.numel() % BLOCK):
            continue
        _install(module, fmt, quantize(w, fmt), w.shape, dtype or w.dtype, type(module))
        done.append(name)
    return done


@contextlib.contextmanager
def dequantizing_to(model: nn.Module, dtype: torch.dtype | None) -> Iterator[None]:
    """Within the block, every quantized weight of ``model`` dequantizes to ``dtype`` (a
    capture under ``param_dtype``: the devices compute in it)."""
    if dtype is None:
        yield
        return
    saved = [(m, q) for m in model.modules() if (q := quantized_weight(m)) is not None]
    for m, q in saved:
        m._fxpipe_quantized = replace(q, dtype=dtype)
    try:
        yield
    finally:
        for m, q in saved:
            m._fxpipe_quantized = q


def dequantized_copy(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` whose quantized weights are plain parameters again, holding
    their dequantized values (the reference a quantized pipe equals)."""
    ref = copy.deepcopy(model)
    for m in ref.modules():
        q = quantized_weight(m)
        if q is None:
            continue
        blob = m._parameters.pop(q.name)
        m.__class__ = type(m).__mro__[1]
        del m._fxpipe_quantized
        w = dequantize(blob.detach(), q.fmt, list(q.shape), q.dtype)
        m.weight = nn.Parameter(w, requires_grad=False)
    return ref


def quantized_bytes(model: nn.Module) -> tuple[int, int]:
    """``(bytes the quantized blobs take, bytes their weights took)``."""
    held = orig = 0
    for m in model.modules():
        q = quantized_weight(m)
        if q is not None:
            held += getattr(m, q.name).nbytes
            orig += math.prod(q.shape) * q.dtype.itemsize
    return held, orig


# -- models users bring quantized ------------------------------------------------------

_ROUTE = ("load the model unquantized instead (from_pretrained(..., dtype=torch.bfloat16) "
          "with no quantization_config, or on the meta device with compile(..., weights=PATH)) "
          "and pass fxpipe.compile(..., frozen_dtype='nf4'), which quantizes the frozen "
          "weights on the host as they are read (or 'int8', 'fp8')")


def _library(t: torch.Tensor) -> str | None:
    root = type(t).__module__.split(".")[0]
    return root if root in ("bitsandbytes", "torchao") else None


def _bnb_nf4_blob(w: Tensor) -> tuple[Tensor, torch.dtype]:
    """The blob of a bitsandbytes ``Params4bit`` (NF4, blocks of 64): its codes as they are
    (the same layout) and its absmax, dequantized from 8 bits where it was nested; and
    the dtype it dequantizes to. A weight bitsandbytes repacked for its AVX512-BF16 CPU
    kernel (its first eval forward without grad on such a CPU: codes interleaved, absmax
    rounded to bf16, transposed) is read back in bitsandbytes' own layout first, its
    absmax as bitsandbytes now holds it."""
    import bitsandbytes.functional as bnbf
    qs, codes = w.quant_state, w.data
    if getattr(qs, "packing_format_for_cpu", False):
        absmax = qs.absmax.T.reshape(-1)
        codes, _ = bnbf._convert_weight_packed_for_cpu_inverse(codes, copy.copy(qs))
        dtype = qs.original_dtype
    else:
        absmax, dtype = qs.absmax, qs.dtype
        if qs.nested:
            absmax = bnbf.dequantize_blockwise(qs.absmax, qs.state2) + qs.offset
    return torch.cat([codes.reshape(-1).view(torch.uint8),
                      absmax.float().reshape(-1).view(torch.uint8)]), dtype


def adopt_quantized(model: nn.Module) -> list[str]:
    """Convert, in place, a model a user loaded quantized: each bitsandbytes NF4
    ``Linear4bit`` (``BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")``)
    becomes fxpipe's NF4 linear holding the same bytes (nothing is dequantized; outside a
    pipe it dequantizes to the dtype bitsandbytes recorded for the weight).
    Returns the names converted. Any other bitsandbytes or torchao tensor (8-bit, FP4,
    torchao's layouts) raises ``NotImplementedError`` naming the route that works here."""
    done = []
    for name, module in model.named_modules():
        for pname, p in list(module._parameters.items()):
            lib = p is not None and _library(p)
            if not lib:
                continue
            qs = getattr(p, "quant_state", None)
            if (type(p).__name__ == "Params4bit" and pname == "weight" and qs is not None
                    and qs.quant_type == "nf4" and qs.blocksize == BLOCK
                    and isinstance(module, nn.Linear)):
                blob, dtype = _bnb_nf4_blob(p)
                _install(module, "nf4", blob, qs.shape, dtype, nn.Linear)
                done.append(name)
                continue
            what = f"{type(p).__name__}" + (f" ({qs.quant_type}, blocks of {qs.blocksize})"
                                             if qs is not None else "")
            raise NotImplementedError(
                f"{name}.{pname} is a {lib} {what} tensor, which fxpipe cannot stream as it "
                f"is (it adopts bitsandbytes' NF4 Linear4bit with blocks of {BLOCK} only): "
                + _ROUTE)
    return done


def prepare(model: nn.Module, frozen_dtype: str | None) -> None:
    """What ``fxpipe.compile`` does before capture: adopt a model loaded quantized
    (:func:`adopt_quantized`), then quantize its frozen linears to ``frozen_dtype``."""
    adopt_quantized(model)
    if frozen_dtype is None:
        return
    quantize_frozen(model, frozen_dtype)
    if not any(quantized_weight(m) for m in model.modules()):
        raise ValueError(
            f"frozen_dtype={frozen_dtype!r} found no frozen nn.Linear weight to quantize: it "
            "quantizes the weights that do not train (requires_grad=False, as peft's "
            "get_peft_model leaves a LoRA base); freeze them first, or leave frozen_dtype=None")


def weight_numel(module: nn.Module) -> int:
    """The elements of ``module.weight``, read without dequantizing a quantized one."""
    q = quantized_weight(module)
    return math.prod(q.shape) if q is not None else module.weight.numel()


def parameter_count(model: nn.Module) -> int:
    """The elements of ``model``'s parameters, each quantized weight counted as the
    weight's (not its blob's bytes)."""
    blobs = {id(getattr(m, q.name)): math.prod(q.shape) for m in model.modules()
             if (q := quantized_weight(m)) is not None}
    return sum(blobs.get(id(p), p.numel()) for p in model.parameters())
