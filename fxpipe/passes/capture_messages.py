"""What capture tells the user: the ``CaptureError`` message naming what each method
hit and what to do (:func:`failure_message`), the warning for a model captured at block
granularity because it branches on tensor values (:func:`warn_branches`), and, in verbose
mode, what was changed to capture it (:func:`say_what_changed`)."""

from __future__ import annotations

import sys

import torch.nn as nn

from fxpipe.passes import blocks as opaque
from fxpipe.passes.capture_dtypes import MixedDtypeError
from fxpipe.verbose import warn


def warn_branches(model: nn.Module, tried: dict[str, BaseException]) -> None:
    """Captured at block granularity because a block branches on tensor values (the
    whole-graph methods hit a data-dependent guard): warn, naming the line. Each
    microbatch takes that branch on its own rows, so the result equals eager only where
    the condition depends on each row alone (an MoE router's choice per token does;
    ``if x.mean() > 0:`` does not)."""
    e = tried.get("export") or tried.get("dynamo")
    if e is None or not _data_dependent(e):
        return
    where = opaque.user_line(e) or " (the line was not found)"
    warn(
        f"fxpipe: {type(model).__name__} is captured at block granularity: a block's Python "
        f"branches on tensor values{where}. Each block runs as its module on each microbatch, "
        "so that branch is taken per microbatch: results equal eager only if the condition "
        "depends on each row alone (a router's choice per token), not on the whole batch "
        "(a mean or max over rows). Make it graph-friendly (torch.where) to be exact, or "
        "use RunConfig(num_microbatch=1).")


def _data_dependent(e: BaseException) -> bool:
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
    return isinstance(e, GuardOnDataDependentSymNode) or "data-dependent" in str(e)


def say_what_changed(model: nn.Module, method: str, tried: dict[str, BaseException],
                      dropped: list[str]) -> None:
    name = type(model).__name__
    if method == "blocks":
        print(f"fxpipe: captured {name} at block granularity: the whole model could not be "
              f"one graph ({'; '.join(f'{m}: {type(e).__name__}' for m, e in tried.items())}); "
              "each block runs as its module, with all of its parameters uploaded", file=sys.stderr)
    for leaf in dropped:
        what = leaf if leaf.startswith("block ") else f"{name} returns {leaf}"
        print(f"fxpipe: {what}, which a pipeline cannot split into microbatches or carry "
              "between layers; None is used there (for a Hugging Face cache, pass "
              "use_cache=False so it is not built)", file=sys.stderr)


def failure_message(model: nn.Module, tried: dict[str, BaseException]) -> str:
    lines = [f"fxpipe could not capture {type(model).__name__} as a graph. What each method hit:"]
    for m, e in tried.items():
        first = (str(e).strip().splitlines() or [""])[0][:400]
        lines.append(f"  - {m}: {type(e).__name__}: {first}")
    if isinstance(tried.get("blocks"), opaque.EagerFailureError):
        lines.append(
            "What to do: the model fails on this example without fxpipe too (blocks ran it "
            "eagerly): call the model on the example yourself, in the same precision, and fix "
            "what fails there first (a model that fails under torch.autocast may work with "
            "fxpipe.compile(..., param_dtype=torch.bfloat16) instead).")
    elif any(isinstance(e, MixedDtypeError) for e in tried.values()):
        lines.append(
            "What to do: the model's own code computes that operation in two dtypes, so it "
            "fails in this precision without fxpipe too (under param_dtype: the model with "
            "its parameters in it, run eagerly); train it in fp32, or under torch.autocast "
            "around the call, or make its code cast the operand.")
    elif isinstance(tried.get("blocks"), opaque.OutsideBlocksError):
        lines.append(
            "What to do: with capture='blocks' each block runs as its module, so data-dependent "
            "code inside the blocks is fine; the line it names is in the model's own forward "
            "outside the blocks. Make that line graph-friendly (torch.where or torch._check "
            "instead of `if tensor:`), move it out of forward (e.g. compute the loss in loss_fn "
            "rather than passing labels=), or pass layers= naming blocks that contain it. "
            "See docs/troubleshooting.md.")
    else:
        lines.append(
            "What to do: try another capture= ('fx', 'export', 'dynamo', 'blocks'); make "
            "data-dependent Python control flow in forward() graph-friendly (e.g. torch.where "
            "instead of `if tensor:`); or pass layers='path.to.blocks' if the failure is in "
            "block detection. See docs/troubleshooting.md.")
    return "\n".join(lines)
