"""Weights from safetensors checkpoints, memory-mapped (``fxpipe.compile(..., weights=PATH)``).

:func:`load` binds a model's parameters and buffers (the model may be on the ``meta``
device) to the entries of a checkpoint: a ``.safetensors`` file, a directory of shards
with its ``model.safetensors.index.json``, or a Hugging Face model directory. Only the
headers are read up front; every key is matched (Hugging Face's names: the
``base_model_prefix`` added or dropped, a PEFT wrapper's ``base_model.model.`` and
``.base_layer``), and missing, unexpected and mis-shaped keys raise one
:class:`WeightsError` listing them all, before any tensor is bound.

- A frozen parameter (``requires_grad=False``, e.g. a LoRA base) becomes a read-only
  memory map of its bytes in the file (``torch.frombuffer`` over ``mmap``): its pages are
  the page cache's, never anonymous memory; :func:`file_backed` tells them apart, and
  ``HostParams`` leaves them where they are (uploads read them from the map, converting
  to ``param_dtype`` on the way). Writing one in place crashes the process (the mapping is
  read-only): set ``requires_grad`` before compiling to train it.
- Trainable parameters and buffers become copy-on-write (private) maps: writable, and
  still the page cache's until written; ``HostParams`` copies them into its flat buffers
  at the first call.
- A file dtype other than the model's is converted when binding (that tensor is then
  materialized in ordinary memory: ``Loaded.converted`` names it).

:func:`save_pretrained` (``fxpipe.runtime.host.shards``, which also reads the headers) writes
the model's state dict as sharded safetensors (the Hugging Face layout and index),
tensor by tensor straight from the host buffers.

>>> import os, tempfile, torch.nn as nn
>>> d = tempfile.mkdtemp()
>>> src = nn.Linear(4, 2)
>>> _ = save_pretrained(src, d)
>>> sorted(os.listdir(d))
['model.safetensors']
>>> with torch.device("meta"):
...     model = nn.Linear(4, 2)
>>> _ = model.weight.requires_grad_(False)   # frozen: stays a read-only map of the file
>>> loaded = load(model, d)
>>> file_backed(model.weight) is not None, file_backed(model.bias) is None
(True, True)
>>> torch.equal(model.weight, src.weight)
True
"""

from __future__ import annotations

import mmap
import os
import re
import warnings
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from fxpipe.runtime.devices import pinned
from fxpipe.runtime.host.shards import Entry, read_checkpoint, save_pretrained

__all__ = ["FileMap", "Loaded", "WeightsError", "file_backed", "load", "read_checkpoint",
           "save_pretrained"]

_LISTED = 12   # keys an error lists per kind


class WeightsError(ValueError):
    """The checkpoint does not fit the model: every missing, unexpected and mis-shaped
    key at once (nothing was bound)."""


@dataclass(frozen=True)
class FileMap:
    """A memory map of a checkpoint file: ``base`` is its address, ``size`` its length."""

    path: str
    map: mmap.mmap
    base: int
    size: int


# storage data_ptr of a frozen tensor bound by ``load`` -> the map it reads
_FILE_BACKED: dict[int, FileMap] = {}


def file_backed(t: torch.Tensor) -> FileMap | None:
    """The read-only file map ``t``'s memory is (``load`` made it), or None."""
    if t.device.type != "cpu" or t.numel() == 0:
        return None
    return _FILE_BACKED.get(t.untyped_storage().data_ptr())


# ----------------------------------------------------------------------------- binding

@dataclass
class Loaded:
    """What :func:`load` bound: counts and bytes, by how each tensor is held."""

    path: str
    file_backed: list[str] = field(default_factory=list)   # frozen: read-only maps
    mapped: list[str] = field(default_factory=list)        # trainable / buffers: private maps
    converted: list[str] = field(default_factory=list)     # another dtype: materialized
    kept: list[str] = field(default_factory=list)          # not in the file, not meta: as they were
    ignored: list[str] = field(default_factory=list)       # checkpoint keys outside the model
    file_backed_bytes: int = 0


def _hf_prefix(model: nn.Module) -> str:
    """The Hugging Face ``base_model_prefix`` of the model (or of the model a PEFT wrapper
    holds), '' if none."""
    for m in model.modules():
        prefix = getattr(m, "base_model_prefix", "")
        if isinstance(prefix, str) and prefix:
            return prefix
    return ""


def _candidates(name: str, prefix: str, renames: list[tuple[str, str]] = ()) -> list[str]:
    """The checkpoint keys a model name may have been saved under, most likely first."""
    names = [name]
    if name.startswith("base_model.model."):   # PEFT: the wrapped model's own names
        names.append(name[len("base_model.model."):].replace(".base_layer.", "."))
    for old, new in renames:   # an older layout's names
        names += [n.replace(new, old) for n in names if new in n]
    out = []
    for n in names:
        out.append(n)
        if prefix:
            out.append(n[len(prefix) + 1:] if n.startswith(prefix + ".") else f"{prefix}.{n}")
    return out


def _ignore_patterns(model: nn.Module) -> list[str]:
    pats: list[str] = []
    for m in model.modules():
        pats += list(getattr(m, "_keys_to_ignore_on_load_unexpected", None) or [])
    return pats


def load(model: nn.Module, path: str | os.PathLike) -> Loaded:
    """Bind ``model``'s parameters and buffers to the checkpoint at ``path`` (module
    docstring). The parameter objects stay the same (``torch.utils.swap_tensors``), so
    tied weights stay one tensor and references to them stay valid. Raises
    :class:`WeightsError` (nothing bound) when keys are missing, unexpected or mis-shaped."""
    entries = read_checkpoint(path)
    state = model.state_dict(keep_vars=True)
    tensors: dict[int, tuple[torch.Tensor, list[str]]] = {}
    for name, t in state.items():
        tensors.setdefault(id(t), (t, []))[1].append(name)
    loose = _init_loose_buffers(model, {id(t) for t in state.values()})
    _init_peft_adapters(model)
    prefix = _hf_prefix(model)
    renames, converters = _hf_conversions(model)
    base_from_head = bool(prefix) and not any(n.startswith(prefix + ".") for n in state) \
        and any(k.startswith(prefix + ".") for k in entries)
    loaded = Loaded(str(path))
    missing, shapes, plan, used = [], [], [], set()
    for t, names in tensors.values():
        keys = [k for n in names for k in _candidates(n, prefix, renames) if k in entries]
        if keys:
            parts, shape, what = entries[keys[0]], entries[keys[0]].shape, repr(keys[0])
            keys = keys[:1] + [k for k in keys[1:] if entries[k].shape == shape]
        else:
            found = next((c for n in names for c in [_converted(n, entries, prefix, renames,
                                                                converters)] if c), None)
            if found is None:
                (missing if t.is_meta else loaded.kept).append(names[0])
                continue
            keys, parts, shape = found
            what = f"{keys[0]!r} and {len(keys) - 1} more, converted"
        used.update(keys)
        if shape != tuple(t.shape):
            where = os.path.basename(entries[keys[0]].path)
            shapes.append(f"{names[0]}: the model has {tuple(t.shape)}, {what} in {where} "
                          f"is {shape}")
            continue
        plan.append((t, names[0], parts))
    patterns = _ignore_patterns(model)
    unexpected = []
    for k in entries:
        if k in used or any(re.search(p, k) for p in patterns):
            continue
        if base_from_head and not k.startswith(prefix + "."):
            loaded.ignored.append(k)   # a head the base model does not have
            continue
        unexpected.append(k)
    if missing or shapes or unexpected or loose:
        parts = [f"weights={os.fspath(path)!r} does not fit the model "
                 f"({type(model).__name__}); nothing was loaded:"]
        if missing:
            parts.append(f"- {len(missing)} missing (on the meta device, not in the "
                         f"checkpoint): {_listed(missing)}")
        if unexpected:
            parts.append(f"- {len(unexpected)} unexpected (in the checkpoint, not in the "
                         f"model): {_listed(unexpected)}")
        if shapes:
            parts.append(f"- {len(shapes)} of another shape: {_listed(shapes)}")
        if loose:
            parts.append(f"- {len(loose)} non-persistent buffers on the meta device (no "
                         f"checkpoint holds them): {_listed(loose)}; build the model under "
                         "accelerate.init_empty_weights() (buffers stay real) or set them "
                         "before compiling")
        parts.append("Compile the model the checkpoint was saved from (same config), or "
                     "initialize parameters the checkpoint lacks on the CPU before compiling.")
        raise WeightsError("\n".join(parts))
    maps: dict[tuple[str, int], FileMap] = {}
    with torch.no_grad():
        for t, name, parts in plan:
            frozen = isinstance(t, nn.Parameter) and not t.requires_grad
            if isinstance(parts, Entry):
                e = parts
                src = _map_tensor(e, maps, frozen and e.dtype == t.dtype)
                if e.dtype != t.dtype:
                    src = src.to(t.dtype)
                    loaded.converted.append(name)
                elif frozen:
                    loaded.file_backed.append(name)
                    loaded.file_backed_bytes += e.stop - e.start
                else:
                    loaded.mapped.append(name)
            else:   # several entries in the checkpoint's layout: materialized
                src = _convert(parts, lambda e: _map_tensor(e, maps, False)).to(t.dtype)
                loaded.converted.append(name)
            new = nn.Parameter(src, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) \
                else src
            torch.utils.swap_tensors(t, new)
    return loaded


def _hf_conversions(model: nn.Module) -> tuple[list[tuple[str, str]], list]:
    """The Hugging Face model's checkpoint conversions (transformers 5 loads some
    architectures from an older layout, e.g. Mixtral's experts one by one): the plain
    renamings ``(checkpoint text, model text)`` and the converters."""
    hf = next((m for m in model.modules() if hasattr(m, "config")
               and hasattr(m, "base_model_prefix")), None)
    if hf is None:    # not a Hugging Face model: transformers (seconds to import) is not asked
        return [], []
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    except ImportError:
        return [], []
    convs = get_checkpoint_conversion_mapping(type(hf).__name__) or \
        get_checkpoint_conversion_mapping(getattr(hf.config, "model_type", "")) or []
    renames, converters = [], []
    for c in convs:
        src, dst = list(c.source_patterns), list(c.target_patterns)
        if type(c).__name__ == "WeightRenaming":
            if len(src) == 1 and len(dst) == 1 and re.escape(src[0]) == src[0].replace(".", "\\."):
                renames.append((src[0], dst[0]))
        elif len(dst) == 1:
            converters.append(c)
    return renames, converters


def _converted(name: str, entries: Mapping[str, Entry], prefix: str, renames: list,
               converters: list) -> tuple[list[str], tuple, tuple[int, ...]] | None:
    """The checkpoint keys a model tensor is converted from (``_hf_conversions``), how,
    and the shape that makes: ``(keys, (ops, [[entries per source]]), shape)``."""
    for c in converters:
        target = c.target_patterns[0]
        if not name.endswith(target):
            continue
        for cand in _candidates(name, prefix, renames):
            if not cand.endswith(target):
                continue
            head = cand[:-len(target)]
            lists = []
            for source in c.source_patterns:
                pat = re.compile(re.escape(head + source).replace(r"\*", r"(\d+)") + "$")
                hits = sorted((int(m.group(1)), k) for k in entries
                              if (m := pat.match(k)) is not None)
                lists.append([k for _, k in hits])
            if not all(lists) or len({len(x) for x in lists}) != 1:
                continue
            parts = (list(c.operations), [[entries[k] for k in x] for x in lists])
            meta = _convert(parts, lambda e: torch.empty(e.shape, dtype=e.dtype, device="meta"))
            return [k for x in lists for k in x], parts, tuple(meta.shape)
    return None


def _convert(parts: tuple[list, list[list[Entry]]], read) -> torch.Tensor:
    """Apply a converter's operations to the entries (read with ``read``): per source a
    list of tensors, stacked (``MergeModulelist``), then joined (``Concatenate``)."""
    ops, lists = parts
    values: list = [[read(e) for e in x] for x in lists]
    for op in ops:
        kind = type(op).__name__
        if kind == "MergeModulelist":
            values = [torch.stack(v, dim=op.dim) for v in values]
        elif kind == "Concatenate":
            values = [torch.cat(values, dim=op.dim)]
        else:
            raise NotImplementedError(
                f"the checkpoint is in an older layout that transformers converts with {kind}, "
                "which fxpipe's weights= does not apply yet: load it once with "
                "from_pretrained and save it with save_pretrained(...) (the model's layout)")
    if len(values) != 1 or not isinstance(values[0], torch.Tensor):
        raise NotImplementedError("a checkpoint conversion that does not make one tensor")
    return values[0]


def _init_peft_adapters(model: nn.Module) -> None:
    """Initialize PEFT LoRA adapters that were made on a meta-device base (no checkpoint
    of the base holds them) as ``get_peft_model`` does on a real one: ``nn.Linear``'s
    init, then ``reset_lora_parameters`` for ``init_lora_weights`` True or
    ``"gaussian"``."""
    configs = getattr(model, "peft_config", None)
    if not isinstance(configs, dict):
        return
    for module in model.modules():
        if not (hasattr(module, "reset_lora_parameters") and hasattr(module, "lora_A")):
            continue
        for adapter, a in module.lora_A.items():
            b = module.lora_B[adapter]
            if not any(p.is_meta for p in (*a.parameters(), *b.parameters())):
                continue
            init = getattr(configs.get(adapter), "init_lora_weights", True)
            if init not in (True, False, "gaussian"):
                raise NotImplementedError(
                    f"LoRA adapter {adapter!r} with init_lora_weights={init!r} is initialized "
                    "from the base weights, which are on the meta device here: load the base "
                    "first (compile the base with weights= and then add the adapter), or use "
                    "init_lora_weights=True, False or 'gaussian'")
            with torch.no_grad():
                for sub in (a, b):
                    for p in list(sub.parameters(recurse=False)):
                        torch.utils.swap_tensors(p, nn.Parameter(
                            torch.empty_like(p, device="cpu"), requires_grad=p.requires_grad))
                    sub.reset_parameters()
                module.reset_lora_parameters(adapter, init)


def _init_loose_buffers(model: nn.Module, persistent: set[int]) -> list[str]:
    """Give the non-persistent buffers on the meta device (no checkpoint holds them:
    rotary tables) their values as Hugging Face's ``from_pretrained`` does: a module
    holding such buffers and no parameters of its own is initialized by the model's
    ``_init_weights``. Returns the names of those it could not initialize."""
    hf = next((m for m in model.modules() if hasattr(m, "_init_weights")
               and hasattr(m, "config")), None)
    left = []
    for mname, module in model.named_modules(remove_duplicate=False):
        loose = [(n, b) for n, b in module.named_buffers(recurse=False)
                 if id(b) not in persistent and b.is_meta]
        if not loose:
            continue
        if hf is None or any(True for _ in module.parameters(recurse=False)):
            left += [f"{mname}.{n}" if mname else n for n, _ in loose]
            continue
        with torch.no_grad():
            for _, b in loose:
                torch.utils.swap_tensors(b, torch.empty_like(b, device="cpu"))
            hf._init_weights(module)
    return left


def _map_tensor(e: Entry, maps: dict[tuple[str, int], FileMap], read_only: bool) -> torch.Tensor:
    """``e``'s bytes as a tensor over a memory map of its file: read-only and recorded as
    file-backed, or private (copy-on-write)."""
    numel = (e.stop - e.start) // e.dtype.itemsize
    if numel == 0:
        return torch.empty(e.shape, dtype=e.dtype)
    access = mmap.ACCESS_READ if read_only else mmap.ACCESS_COPY
    key = (e.path, access)
    m = maps.get(key)
    if m is None:
        with open(e.path, "rb") as f:
            mm = mmap.mmap(f.fileno(), 0, access=access)
        m = maps[key] = FileMap(e.path, mm, _address(mm), len(mm))
        # its windows registered for uploads go with it (``pinned.register_window``)
        weakref.finalize(mm, pinned.forget_file, m.base, m.size).atexit = False
    with warnings.catch_warnings():   # read-only by design: only a frozen tensor reads it
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        t = torch.frombuffer(m.map, dtype=e.dtype, count=numel, offset=e.start)
    if read_only:
        storage = t.untyped_storage()
        key_ptr = storage.data_ptr()
        _FILE_BACKED[key_ptr] = m
        weakref.finalize(storage, _FILE_BACKED.pop, key_ptr, None).atexit = False
    return t.view(e.shape)


def _address(mm: mmap.mmap) -> int:
    """Where ``mm`` starts in memory."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(mm, dtype=torch.uint8, count=1).data_ptr()


def _listed(items: list[str]) -> str:
    shown = ", ".join(repr(i) if "'" not in i else i for i in items[:_LISTED])
    return shown + (f" ... ({len(items) - _LISTED} more)" if len(items) > _LISTED else "")
