"""RunConfig: unset fields, model-level / call-level precedence, defaults, validation."""

import dataclasses

import pytest
import torch

from fxpipe.config import RunConfig
from fxpipe.plan import ExecutePlan
from fxpipe.runtime.issue.microbatch import TensorChunkSpec


def test_every_field_defaults_to_unset():
    cfg = RunConfig()
    names = [f.name for f in dataclasses.fields(RunConfig)]
    assert names == ["requires_grad", "output_device", "preserve_rng_state", "recompute_grain",
                     "num_microbatch", "split_input", "split_label", "merge_output", "execute_plan",
                     "stage_backend", "sequence_chunks"]
    assert all(getattr(cfg, n) is None for n in names)


def test_call_level_wins_when_set_model_level_fills_the_rest():
    plan = ExecutePlan([range(0, 1)], [range(0, 1)])
    model = RunConfig(num_microbatch=8, recompute_grain="layer", merge_output=True, execute_plan=plan)
    call = RunConfig(num_microbatch=2, merge_output=False, requires_grad=False)
    merged = RunConfig.merge(model, call)
    assert merged.num_microbatch == 2 and merged.merge_output is False and merged.requires_grad is False
    assert merged.recompute_grain == "layer" and merged.execute_plan is plan
    assert merged.output_device is None  # unset on both levels stays unset
    assert RunConfig.merge(None, call) == call and RunConfig.merge(model, None) == model
    assert RunConfig.merge(None, None) == RunConfig()
    with pytest.raises(TypeError, match="call_level must be a RunConfig"):
        RunConfig.merge(model, {"num_microbatch": 2})


def test_resolved_fills_defaults_at_call_time():
    cfg = RunConfig(split_label=TensorChunkSpec(1))
    with torch.no_grad():
        off = cfg.resolved(num_devices=3)
    on = cfg.resolved(num_devices=3)
    assert off.requires_grad is False and on.requires_grad is True
    assert on.output_device == torch.device("cpu") and on.preserve_rng_state is True
    assert on.recompute_grain == "stage" and on.num_microbatch == 4
    assert on.split_input is None and on.merge_output is None and on.execute_plan is None
    assert isinstance(on.split_label, TensorChunkSpec)
    explicit = RunConfig(requires_grad=False, num_microbatch=1, preserve_rng_state=False).resolved(8)
    assert (explicit.requires_grad, explicit.num_microbatch, explicit.preserve_rng_state) == (False, 1, False)
    with pytest.raises(ValueError, match="num_devices must be an int >= 1"):
        RunConfig().resolved(0)


def test_output_device_is_normalized():
    assert RunConfig(output_device="cuda:1").output_device == torch.device("cuda", 1)
    assert RunConfig(output_device=torch.device("cpu")).output_device == torch.device("cpu")
    with pytest.raises(ValueError, match="RunConfig.output_device: 'nowhere' is not a device"):
        RunConfig(output_device="nowhere")
    with pytest.raises(TypeError, match="RunConfig.output_device must be"):
        RunConfig(output_device=1.5)


@pytest.mark.parametrize("kwargs, error, field", [
    (dict(recompute_grain="block"), ValueError, "recompute_grain"),
    (dict(num_microbatch=0), ValueError, "num_microbatch must be >= 1"),
    (dict(num_microbatch=2.0), TypeError, "num_microbatch must be an int"),
    (dict(num_microbatch=True), TypeError, "num_microbatch must be an int"),
    (dict(requires_grad=1), TypeError, "requires_grad"),
    (dict(preserve_rng_state="yes"), TypeError, "preserve_rng_state"),
    (dict(split_input="dim0"), TypeError, "split_input"),
    (dict(split_input=(None, None, None)), TypeError, "split_input"),
    (dict(execute_plan=[range(0, 2)]), TypeError, "execute_plan"),
])
def test_bad_values_name_the_field(kwargs, error, field):
    with pytest.raises(error, match=f"RunConfig.{field}"):
        RunConfig(**kwargs)


def test_accepted_split_forms_and_frozen():
    assert RunConfig(split_input=lambda a, k, n: ([a] * n, [k] * n)).split_input is not None
    assert RunConfig(split_input=[None, None]).split_input == [None, None]
    with pytest.raises(dataclasses.FrozenInstanceError):
        RunConfig().num_microbatch = 3
