"""How data parallel cuts parameters: gradient buckets (one backward stage's parameters
of one dtype as one flat tensor of N equal chunks), this rank's shard of one, and
loading a checkpoint's per-rank pieces on another number of ranks (``reshard``).

Each parameter is cut in N equal pieces whatever the plan: rank ``r`` owns ``[r*c,
(r+1)*c)``, ``c = ceil(numel / N)`` (``_piece``). Pure arithmetic on host tensors: no
collective runs here (``runtime.issue.distributed`` posts them).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class Bucket:
    """One backward stage's parameters of one gradient dtype as one flat tensor of
    ``parts`` equal chunks (``parts``: the number of ranks when sharding, else 1), a
    reduce-scatter giving each rank one chunk. Each parameter is cut the same way
    whatever the plan: rank ``r`` owns its elements ``[r * c, (r + 1) * c)``, ``c =
    chunks[i] = ceil(numel / parts)``, which sit at ``offsets[i]`` of chunk ``r`` (zero
    padded). ``names`` are the parameters' names (the same on every rank: they key the
    optimizer state and the fp32 masters of this rank's pieces, ``masters[i]``, None where
    the parameters are their own masters)."""

    layers: range | None             # None: not a stage's (DataParallel.full_masters)
    dtype: torch.dtype
    params: list[torch.Tensor]
    names: list[str]
    sizes: list[int]
    chunks: list[int]
    offsets: list[int]
    parts: int
    rank: int
    masters: list[torch.Tensor | None]

    @property
    def shard_len(self) -> int:
        """The length of one rank's chunk."""
        return sum(self.chunks)

    @property
    def padded(self) -> int:
        return self.parts * self.shard_len

    def pieces(self) -> list[tuple[int, int, int, int]]:
        """``(index, start in param, stop in param, start in shard)`` of each parameter
        that has elements in this rank's chunk."""
        out = []
        for i, (n, o) in enumerate(zip(self.sizes, self.offsets)):
            lo, hi = _piece(n, self.parts, self.rank)
            if lo < hi:
                out.append((i, lo, hi, o))
        return out

    def columns(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        """Parameter ``i``'s ``[parts, chunk]`` elements in a flat bucket tensor."""
        o = self.offsets[i]
        return flat.view(self.parts, self.shard_len)[:, o:o + self.chunks[i]]

    def pack(self, flat: torch.Tensor, i: int, *values: torch.Tensor | None) -> None:
        """Parameter ``i``'s place in ``flat`` := the sum of ``values`` (None: skipped;
        none at all: zeros), its padding zeros."""
        cols, n = self.columns(flat, i), self.sizes[i]
        values = [v.reshape(-1) for v in values if v is not None]
        if not values:
            cols.zero_()
            return
        c = cols.shape[1]
        k = n // c if c else 0          # full rows
        cols[k:].zero_()
        for j, v in enumerate(values):
            body = v[:k * c].view(k, c)
            cols[:k].copy_(body) if j == 0 else cols[:k].add_(body)
            if k * c < n:
                row = cols[k, :n - k * c]
                row.copy_(v[k * c:]) if j == 0 else row.add_(v[k * c:])

    def unpack(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        """Parameter ``i``'s value from ``flat`` (a view when ``parts == 1``)."""
        return self.columns(flat, i).reshape(-1)[:self.sizes[i]].view(self.params[i].shape)


@dataclass
class Shard:
    """This rank's part of a bucket in a sharded step: the averaged gradient of its 1/N
    (``grad``); the step updates those elements in place (the fp32 masters of them where
    this rank keeps them, else the parameters'), the all-gather sends them to every
    rank."""

    bucket: Bucket
    grad: torch.Tensor


def _by_dtype(buffers: Mapping[str, torch.Tensor]) -> dict[torch.dtype, list[torch.Tensor]]:
    """The buffers by dtype, each list in name order (the same on every rank)."""
    out: dict[torch.dtype, list[torch.Tensor]] = {}
    for name in sorted(buffers):
        out.setdefault(buffers[name].dtype, []).append(buffers[name])
    return out


def reshard(saved: Mapping[str, Any], kind: str, old_world: int, numel: Mapping[str, int],
            world: int, rank: int, states: bool) -> tuple[dict[str, torch.Tensor], Any]:
    """Load a checkpoint's per-rank pieces, saved by ``old_world`` ranks, on ``world``
    ranks (the same number or not). ``saved``: its metadata by key; the pieces are
    ``{kind}.rank{q}.{name}`` (``states``: ``{kind}.rank{q}.{name}.{state}``), each 1-D
    (rank ``q``'s elements of parameter ``name``) or a scalar (a step count, the same on
    every rank). Returns the saved keys this ``rank`` reads (into new tensors, for
    ``dcp.load``) and a function to call after the load that gives this rank's pieces
    by their keys ``{kind}.rank{rank}...``. A checkpoint that does not fit raises the same
    error on every rank, before anything is read."""
    prefix = f"{kind}.rank"
    groups: dict[tuple[str, str], dict[int, str]] = {}
    for key in saved:
        if key.startswith(prefix):
            q, _, rest = key[len(prefix):].partition(".")
            name, _, state = rest.rpartition(".") if states else (rest, "", "")
            groups.setdefault((name, state), {})[int(q)] = key
    for (name, state), by_rank in groups.items():   # the same checks on every rank
        if name not in numel:
            raise ValueError(f"the checkpoint has {kind} pieces of {name!r}, which is not a "
                             "parameter of this model")
        if all(len(saved[k].size) == 0 for k in by_rank.values()):
            continue
        for q in range(old_world):
            olo, ohi = _piece(numel[name], old_world, q)
            size = tuple(saved[by_rank[q]].size) if q in by_rank else None
            if size is None and olo < ohi:
                raise ValueError(f"the checkpoint lacks rank {q}'s {kind} piece of {name!r} "
                                 f"{state}".rstrip())
            if size is not None and size != (ohi - olo,):
                raise NotImplementedError(
                    f"loading {by_rank[q]!r}: it holds {size}, not the {ohi - olo} elements "
                    f"rank {q} of {old_world} owns of {name!r}; only elementwise state (one "
                    "value per parameter element, or a scalar) can be loaded by rank pieces")
    want: dict[str, torch.Tensor] = {}
    plans: dict[str, tuple[int, torch.dtype, list[tuple[str, int, int, int]]]] = {}
    for (name, state), by_rank in groups.items():
        lo, hi = _piece(numel[name], world, rank)
        if lo == hi:
            continue   # this rank owns none of it
        new_key = f"{prefix}{rank}.{name}" + (f".{state}" if states else "")
        first = by_rank[min(by_rank)]
        dtype = saved[first].properties.dtype
        if len(saved[first].size) == 0:   # a scalar, the same on every rank
            want[first] = torch.empty((), dtype=dtype)
            plans[new_key] = (-1, dtype, [(first, 0, 0, 0)])
            continue
        parts = []
        for q, key in sorted(by_rank.items()):
            olo, ohi = _piece(numel[name], old_world, q)
            a, b = max(lo, olo), min(hi, ohi)
            if a < b:
                want[key] = torch.empty(ohi - olo, dtype=dtype)
                parts.append((key, a - olo, a - lo, b - a))
        plans[new_key] = (hi - lo, dtype, parts)

    def stitch() -> dict[str, torch.Tensor]:
        out = {}
        for new_key, (length, dtype, parts) in plans.items():
            if length < 0:
                out[new_key] = want[parts[0][0]]
                continue
            t = torch.empty(length, dtype=dtype)
            for key, src, dst, k in parts:
                t[dst:dst + k].copy_(want[key][src:src + k])
            out[new_key] = t
        return out

    return want, stitch


def _chunk(numel: int, parts: int) -> int:
    """The length of each of the ``parts`` pieces a parameter of ``numel`` elements is cut
    into (the last ones shorter or empty)."""
    return -(-numel // parts)


def _piece(numel: int, parts: int, rank: int) -> tuple[int, int]:
    """Rank ``rank``'s elements ``[lo, hi)`` of a parameter of ``numel`` elements cut in
    ``parts`` (possibly empty)."""
    c = _chunk(numel, parts)
    return min(numel, rank * c), min(numel, (rank + 1) * c)


def first_names(params: Mapping[str, torch.Tensor]) -> dict[int, str]:
    """``id(tensor) -> its first name`` (a tied parameter has several)."""
    out: dict[int, str] = {}
    for n, t in params.items():
        out.setdefault(id(t), n)
    return out


def _unique(params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``params`` with each tensor once, under its first name."""
    return {n: params[n] for n in first_names(params).values()}


def _span(layers: range) -> tuple[int, int]:
    return layers.start, layers.stop
