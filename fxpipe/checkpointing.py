"""A pipe's state: checkpoints with ``torch.distributed.checkpoint`` (model, fp32 masters,
optimizer, sharded or not, resharded to another number of ranks) and the model's state
dict (at full precision under sharded masters). ``PipelineModule`` (``fxpipe.api``) is a
``Checkpointing``.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch

from fxpipe.optim import as_overlapped
from fxpipe.runtime.host.buckets import reshard
from fxpipe.runtime.host.shards import save_pretrained


class Checkpointing:
    """The state methods of ``PipelineModule``. Reads its ``module``, ``_dp`` (data
    parallel or None) and ``_current`` (the layer graph's parameters)."""

    def save_checkpoint(self, path: str, optimizer: torch.optim.Optimizer | Any = None) -> None:
        """Save the model's state and ``optimizer``'s with ``torch.distributed.checkpoint``
        into the folder ``path``, replacing a checkpoint there (every rank calls it;
        parameters are written once, each rank writes its own optimizer shards under
        ``shard_optimizer=True``, and its fp32 masters with ``param_dtype``). Also without
        data parallel. :meth:`load_checkpoint` resumes exactly."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        from fxpipe.optim import shard_items
        if self._dp is not None:
            self._dp.check_alive()     # after a failure: resume from the last checkpoint
            self._dp.check_masters()   # parameters edited since the last step
        items: dict[str, Any] = {"model": self.module.state_dict()}
        if self._dp is not None and self._dp.masters:
            items["master.world"] = self._dp.world
            items.update({f"master.rank{self._dp.rank}.{n}": m
                          for n, m in self._dp.masters.items() if m.numel()})
        if optimizer is not None:
            ov = as_overlapped(optimizer)
            if self._dp is not None and self._dp.shard:
                items.update(shard_items(ov, self._dp.rank, self._dp.world))
            else:
                items["optim"] = get_optimizer_state_dict(self.module, ov.optimizer)
        with warnings.catch_warnings():   # replacing is what this method says it does
            warnings.filterwarnings("ignore", message="Detected an existing checkpoint")
            dcp.save(items, storage_writer=dcp.FileSystemWriter(path, overwrite=True),
                     process_group=self._group())

    def load_checkpoint(self, path: str, optimizer: torch.optim.Optimizer | Any = None) -> None:
        """Load what :meth:`save_checkpoint` saved into the model (in place: the
        parameters stay views of the host buffers), its fp32 masters and ``optimizer``,
        with the same ``shard_optimizer`` and ``param_dtype``. Sharded optimizer state and
        masters saved by another number of ranks are resharded: each rank reads the
        pieces of the old ranks that overlap its own (``runtime.host.buckets.reshard``)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (get_optimizer_state_dict,
                                                             set_optimizer_state_dict)

        from fxpipe.optim import load_shard_items, shard_items
        dp = self._dp
        if dp is not None:
            dp.check_alive()   # after a failure: restart every rank, then load
        items: dict[str, Any] = {"model": self.module.state_dict()}
        sharded = dp is not None and dp.shard
        saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
        masters = dp is not None and bool(dp.masters)
        if masters != ("master.world" in saved):
            raise ValueError(f"{path} was saved {'without' if masters else 'with'} sharded fp32 "
                             "masters (shard_optimizer=True with param_dtype); load it into a "
                             "pipe compiled the same way")
        ov = as_overlapped(optimizer) if optimizer is not None else None
        if ov is not None and sharded != ("optim.world" in saved):
            raise ValueError(f"{path} was saved with{'out' if sharded else ''} "
                             "shard_optimizer; load it into a pipe compiled the same way")
        pieces = [kind for kind, used in (("master", masters), ("optim", sharded and ov))
                  if used]
        stitches = []
        if pieces:   # the number of ranks that saved them first
            worlds = {f"{kind}.world": 0 for kind in pieces}
            dcp.load(worlds, checkpoint_id=path, process_group=self._group())
            numel = {n: t.numel() for n, t in self._current.layers.params.items()}
            for kind in pieces:
                want, stitch = reshard(saved, kind, worlds[f"{kind}.world"], numel, dp.world,
                                       dp.rank, states=kind == "optim")
                items.update(want)
                stitches.append(stitch)
        if ov is not None:
            if sharded:   # the param groups' settings (DCP flattens the list per key)
                items.update({k: v for k, v in shard_items(ov, 0, 0).items()
                              if not k.startswith("optim.rank")})
            else:
                items["optim"] = get_optimizer_state_dict(self.module, ov.optimizer)
        dcp.load(items, checkpoint_id=path, process_group=self._group())
        loaded = {k: v for stitch in stitches for k, v in stitch().items()}
        if masters:   # the parameters as loaded hold them already
            mine = f"master.rank{dp.rank}."
            dp.set_pieces({k[len(mine):]: v for k, v in loaded.items() if k.startswith(mine)})
        if ov is None:
            return
        if sharded:
            load_shard_items(ov, dp.rank, {"optim.param_groups": items["optim.param_groups"],
                                           **loaded})
        else:
            set_optimizer_state_dict(self.module, ov.optimizer, items["optim"])

    def _group(self) -> Any:
        return self._dp.group if self._dp is not None else None

    def save_pretrained(self, directory: str | os.PathLike,
                        max_shard_size: int = 5 * 10**9) -> list[str]:
        """Write the model's state dict into ``directory`` as Hugging Face safetensors:
        shards of at most ``max_shard_size`` bytes and ``model.safetensors.index.json``
        (one shard: ``model.safetensors``), and the model's config when it has one. Each
        tensor is written straight from the host buffers (or its file map), one at a time;
        tied weights once. Loads back with ``compile(..., weights=directory)`` or
        ``from_pretrained``. Returns the files written."""
        if self._dp is not None and self._dp.masters:
            raise NotImplementedError(
                "save_pretrained with sharded fp32 masters (shard_optimizer=True with "
                "param_dtype) would gather the whole model on each rank: use "
                "save_checkpoint, or full_state_dict() on rank 0")
        return save_pretrained(self.module, directory, max_shard_size)

    # -- the model's own state ---------------------------------------------------------
    def state_dict(self, *args, **kwargs):
        """``module.state_dict()``: under sharded fp32 masters (``shard_optimizer=True``
        with ``param_dtype``) the parameters are their ``param_dtype`` copies; the full
        precision values: :meth:`full_state_dict`."""
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """``module.load_state_dict``; under sharded fp32 masters (``shard_optimizer=True``
        with ``param_dtype``) this rank's masters are set from ``state_dict``'s values
        at their full precision too."""
        dp = self._dp
        if dp is None or not dp.masters:
            return self.module.load_state_dict(state_dict, strict=strict, assign=assign)
        if assign:
            raise NotImplementedError("load_state_dict(assign=True) would replace the parameters "
                                      "whose fp32 masters fxpipe shards (shard_optimizer=True with "
                                      "param_dtype): load with assign=False")
        dp.check_masters()   # parameters edited since the last step (and not loaded here)
        result = self.module.load_state_dict(state_dict, strict=strict)
        keys = dp.master_keys(self.module.state_dict(keep_vars=True))
        dp.set_masters({n: state_dict[k] for k, n in keys.items() if k in state_dict},
                       params=False)
        return result

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's state dict at full precision: under sharded fp32 masters
        (``shard_optimizer=True`` with ``param_dtype``), the parameters hold their
        ``param_dtype`` copies and each rank 1/N of the masters, which this gathers (a
        collective: call it on every rank, between training calls); otherwise
        ``state_dict()``. A sharded checkpoint loads only into a pipe compiled the same
        way: to evaluate elsewhere, save this (``torch.save`` on rank 0)."""
        dp = self._dp
        if dp is None or not dp.masters:
            return self.module.state_dict()
        full = dp.full_masters()
        own = self.module.state_dict(keep_vars=True)
        keys = dp.master_keys(own)
        return {k: full[keys[k]] if k in keys else t.detach() for k, t in own.items()}
