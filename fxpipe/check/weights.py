"""The kit's ``weights`` section: ``compile(weights=DIR)`` on a model built on ``meta``
with a frozen base, against the same model loaded in memory."""

from __future__ import annotations

from typing import Any

import torch

import fxpipe
from fxpipe.check.common import build_model, devices, loss_fn, model_and_batch
from fxpipe.check.harness import Kit


def weights(kit: Kit, steps: int = 2) -> dict[str, Any]:
    """``compile(weights=DIR)`` on a model built on ``meta`` whose base is frozen (only
    its norms train, as a LoRA-style fine-tune): the frozen parameters stay file-backed
    read-only maps; uploads read the windows of the map registered for DMA
    (``pinned.register_window``: where the driver allows, within the budget; emulated on
    a dry run) (``registered``), else go through the bounded pinned ring (``ring_bytes``).
    Losses against the same model loaded in memory."""
    import tempfile

    from safetensors.torch import save_file

    from fxpipe.runtime.devices import pinned
    from fxpipe.runtime.host.weights import file_backed

    shape = kit.shape

    def frozen_base(m: torch.nn.Module) -> torch.nn.Module:
        for name, p in m.named_parameters():
            p.requires_grad_("norm" in name)
        return m

    model, ids, target = model_and_batch(shape)
    out: dict[str, Any] = {"model": shape, "steps": steps, "trains": "the norms (a frozen base)"}
    losses: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as d:
        save_file({k: v.detach().contiguous().clone() for k, v in model.state_dict().items()},
                  f"{d}/model.safetensors")
        with torch.device("meta"):
            meta = build_model(shape)
        for name, m, kw in (("in_memory", frozen_base(model), {}),
                            ("weights", frozen_base(meta), {"weights": d})):
            pipe = fxpipe.compile(m, example_inputs=(ids,), devices=devices(1, kit.dry_run),
                                  pin_memory=True, **kw)
            try:
                opt = torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.1)
                losses[name] = []
                for _ in range(steps):
                    loss = pipe.forward_backward((ids,), label=target, loss_fn=loss_fn,
                                                 optimizer=opt)
                    losses[name].append(float(loss))
                if name == "weights":
                    frozen = [p for p in m.parameters() if not p.requires_grad]
                    host = pipe._current.runners[next(iter(pipe._current.runners))].host()
                    out.update({
                        "frozen_bytes": sum(p.numel() * p.element_size() for p in frozen),
                        "frozen_file_backed": sum(file_backed(p) is not None for p in frozen),
                        "frozen_params": len(frozen),
                        "registered": any(pinned.is_pinned(p) for p in frozen
                                          if file_backed(p) is not None),
                        "ring_bytes": host.ring.nbytes if host.ring is not None else 0,
                        "host_stalls": pipe.stats().get("host_stalls")})
            finally:
                pipe.close()
    out.update({"losses": losses, "max_loss_diff": max(
        abs(a - b) for a, b in zip(losses["weights"], losses["in_memory"]))})
    out["ok"] = (out["frozen_file_backed"] == out["frozen_params"] > 0
                 and out["max_loss_diff"] <= 1e-5 * max(1.0, abs(losses["in_memory"][0])))
    return out


def weights_summary(r: dict[str, Any]) -> str:
    return (f"{r['frozen_file_backed']}/{r['frozen_params']} frozen parameters file-backed, "
            f"{'registered for DMA' if r['registered'] else 'through the pinned ring'}, "
            f"loss difference {r['max_loss_diff']:.1e}")
