"""Safetensors checkpoints on disk: reading headers and index files, writing shards.

:func:`read_checkpoint` lists a checkpoint's tensors (a ``.safetensors`` file, a
directory of shards with its ``model.safetensors.index.json``, or a Hugging Face model
directory) from the files' headers alone, as :class:`Entry` values (file, dtype, shape,
byte range); ``fxpipe.runtime.host.weights`` maps them. :func:`save_pretrained` writes a
model's state dict as Hugging Face shards, tensor by tensor from where each lives.

>>> import tempfile, torch.nn as nn
>>> d = tempfile.mkdtemp()
>>> _ = save_pretrained(nn.Linear(4, 2), d)
>>> sorted((k, e.shape) for k, e in read_checkpoint(d).items())
[('bias', (2,)), ('weight', (2, 4))]
"""

from __future__ import annotations

import json
import os
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn as nn

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
_NAMES = {v: k for k, v in DTYPES.items()}
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"

@dataclass(frozen=True)
class Entry:
    """One tensor of a safetensors file: bytes ``[start, stop)`` of ``path``."""

    path: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    stop: int


def read_header(path: str) -> dict[str, Entry]:
    """The entries of the safetensors file ``path`` (its header only is read)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        n = struct.unpack("<Q", raw)[0] if len(raw) == 8 else -1
        if n < 2 or 8 + n > size:
            raise ValueError(f"{path} is not a safetensors file (its header length "
                             f"{n} does not fit its {size} bytes)")
        header = json.loads(f.read(n))
    entries = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        dtype = DTYPES.get(info["dtype"])
        if dtype is None:
            raise ValueError(f"{path}: {key!r} has dtype {info['dtype']}, which fxpipe does not "
                             f"read (it reads {', '.join(DTYPES)})")
        shape = tuple(info["shape"])
        begin, end = info["data_offsets"]
        numel = 1
        for s in shape:
            numel *= s
        if end - begin != numel * dtype.itemsize or 8 + n + end > size:
            raise ValueError(f"{path}: {key!r} claims bytes {begin}..{end} for {shape} "
                             f"{info['dtype']}, which do not fit the file")
        entries[key] = Entry(path, dtype, shape, 8 + n + begin, 8 + n + end)
    return entries


def checkpoint_files(path: str | os.PathLike) -> tuple[list[str], dict[str, str] | None]:
    """The safetensors files of ``path`` and its index's ``weight_map`` (None without one).

    ``path``: a ``.safetensors`` file, an ``*.index.json`` file, or a directory holding
    ``model.safetensors.index.json``, ``model.safetensors`` or other ``*.safetensors``."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"weights={path!r}: no such file or directory")
    index = None
    if os.path.isdir(path):
        names = sorted(os.listdir(path))
        if INDEX in names:
            index = os.path.join(path, INDEX)
        elif SINGLE in names:
            return [os.path.join(path, SINGLE)], None
        else:
            indexes = [n for n in names if n.endswith(".safetensors.index.json")]
            files = [n for n in names if n.endswith(".safetensors")]
            if len(indexes) == 1:
                index = os.path.join(path, indexes[0])
            elif files:
                return [os.path.join(path, n) for n in files], None
            else:
                shown = ", ".join(names[:10]) + (" ..." if len(names) > 10 else "")
                raise FileNotFoundError(
                    f"weights={path!r} holds no safetensors checkpoint ({INDEX}, {SINGLE} or "
                    f"*.safetensors); it has: {shown or 'nothing'}. Convert the checkpoint first "
                    "(e.g. load it once and save it with save_pretrained(..., "
                    "safe_serialization=True))")
    elif path.endswith(".json"):
        index = path
    if index is None:
        return [path], None
    with open(index) as f:
        weight_map = json.load(f).get("weight_map")
    if not isinstance(weight_map, dict):
        raise ValueError(f"{index} has no weight_map: it is not a safetensors index")
    folder = os.path.dirname(index)
    files = {name: os.path.join(folder, name) for name in weight_map.values()}
    absent = sorted(n for n, p in files.items() if not os.path.isfile(p))
    if absent:
        raise FileNotFoundError(f"{index} names shards that are not in {folder}: {absent}")
    return sorted(files.values()), {k: files[v] for k, v in weight_map.items()}


def read_checkpoint(path: str | os.PathLike) -> dict[str, Entry]:
    """Every entry of the checkpoint at ``path`` (headers only)."""
    files, weight_map = checkpoint_files(path)
    entries: dict[str, Entry] = {}
    for f in files:
        for key, e in read_header(f).items():
            if weight_map is not None and weight_map.get(key) != f:
                continue   # the index says another shard holds it
            entries.setdefault(key, e)
    if weight_map is not None:
        lost = sorted(k for k in weight_map if k not in entries)
        if lost:
            raise ValueError(f"the index of {path} names keys its shards do not hold: "
                             f"{lost[:12]}{' ...' if len(lost) > 12 else ''}")
    return entries


# ------------------------------------------------------------------------------ saving

def save_pretrained(model: nn.Module, directory: str | os.PathLike,
                    max_shard_size: int = 5 * 10**9,
                    state_dict: Mapping[str, torch.Tensor] | None = None) -> list[str]:
    """Write ``model``'s state dict into ``directory`` as safetensors shards of at most
    ``max_shard_size`` bytes (a tensor larger than that gets a shard of its own), with
    ``model.safetensors.index.json`` when there are several (one: ``model.safetensors``),
    and the model's ``config`` when it has a Hugging Face one. Each tensor is written from
    its own memory (the host buffers, a file map), one at a time; a tensor several names
    share (tied weights) is written once, under its first name. Returns the files written."""
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    state = model.state_dict() if state_dict is None else state_dict
    seen: dict[tuple[int, int, tuple], str] = {}
    items: list[tuple[str, torch.Tensor]] = []
    for name, t in state.items():
        if t.is_meta:
            raise ValueError(f"save_pretrained: {name!r} is on the meta device (no values); "
                             "compile with weights= or load the model first")
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape)) \
            if t.numel() else (id(t), 0, ())
        if key in seen:
            continue
        seen[key] = name
        items.append((name, t.detach()))
    shards: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for name, t in items:
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append((name, t))
        size += n
    many = len(shards) > 1
    files, weight_map, total = [], {}, 0
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" if many else SINGLE
        total += _write_shard(os.path.join(directory, fname), shard)
        files.append(os.path.join(directory, fname))
        weight_map.update({name: fname for name, _ in shard})
    if many:
        with open(os.path.join(directory, INDEX), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        files.append(os.path.join(directory, INDEX))
    written = {os.path.basename(f) for f in files}
    for name in os.listdir(directory):   # what an earlier save left (other shard counts)
        if name not in written and (name == INDEX or name == SINGLE
                                    or re.fullmatch(r"model-\d{5}-of-\d{5}\.safetensors", name)):
            os.remove(os.path.join(directory, name))
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "save_pretrained"):
        config.save_pretrained(directory)
    return files


def _write_shard(path: str, items: list[tuple[str, torch.Tensor]]) -> int:
    """One safetensors file of ``items``; returns the bytes of tensor data written."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    # widest dtypes first: every tensor starts aligned to its element size
    items = sorted(items, key=lambda it: -it[1].element_size())
    for name, t in items:
        if t.dtype not in _NAMES:
            raise ValueError(f"save_pretrained: {name!r} is {t.dtype}, which safetensors "
                             "cannot hold")
        n = t.numel() * t.element_size()
        header[name] = {"dtype": _NAMES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)   # tensor data 8-byte aligned, as safetensors writes it
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for _, t in items:
            if t.numel():
                f.write(_bytes(t))
    os.replace(tmp, path)
    return offset


def _bytes(t: torch.Tensor) -> memoryview:
    """``t``'s bytes, without a copy when it is contiguous on the host."""
    t = t.contiguous().reshape(-1).view(torch.uint8)
    return memoryview(t.numpy())
