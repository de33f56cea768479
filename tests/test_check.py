"""The GPU acceptance kit runs end to end without a GPU (``--dry-run``): CI keeps it
working for the day a GPU runs it. It survives its own failures: a section that raises,
runs out of time or kills the process leaves the sections before it in the JSON."""

from __future__ import annotations

import json
import math
import pathlib
import subprocess
import sys
import time

import pytest
import torch

from fxpipe.check import __main__ as check_cli
from fxpipe.check import finetune as ft_kit
from fxpipe.check.cuda_tests import run_subprocess
from fxpipe.check.harness import SectionTimeout
from fxpipe.check.sections import SECTIONS

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_check_dry_run_writes_every_figure(tmp_path):
    out = tmp_path / "check.json"
    run = subprocess.run([sys.executable, "-m", "fxpipe.check", "--dry-run", "--skip-tests",
                          "--repeats", "1", "--out", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["dry_run"] is True and len(report["devices"]) == 2
    assert set(SECTIONS) <= set(report) and "in_progress" not in report
    assert report["failed"] == []
    for name in SECTIONS:
        assert report[name]["ok"] is True, (name, report[name])
        assert "error" not in report[name] and report[name]["seconds"] >= 0
    assert report["cuda_tests"]["ran"] is False
    vs = report["vs_checkpoint"]
    assert vs["ratio_median"] > 0 and vs["timed_calls_sampled"] is False
    assert set(report["scaling"]["devices"]) == {"1", "2"}
    assert report["scaling"]["timed_calls_sampled"] is False
    hidden = report["hidden_prefetch"]["devices"]
    assert set(hidden) == {"0", "1"}
    for figures in hidden.values():
        assert figures["hidden_fraction"] is None or 0.0 <= figures["hidden_fraction"] <= 1.0
        assert figures["exposed_ms"] >= 0.0 and figures["prefetches"] >= 1
    assert report["hidden_prefetch"]["call_sampled"] is False
    pvm = report["predicted_vs_measured"]
    assert pvm["predicted_ms"] > 0 and pvm["measured_ms"] > 0
    # the end of the call and each backward stage's Accumulate of its downloads: the only
    # host actions waiting for device work (a fused step without an optimizer)
    backward = len(pvm["plan"].split("bwd=[")[1].split(","))
    assert report["stats"]["host_waits"] == 1 + backward
    fit = report["stats"]["host_fit"]   # this host's figures for fxpipe.simulate (on a GPU)
    assert fit["runs_at_issue"] is False and fit["host_us_per_action"] > 0
    assert {r["kind"] for r in fit["kinds"]} >= {"Forward", "RecomputeBackward", "Prefetch"}
    w = report["weights"]   # a frozen base read from its file map's registered windows
    assert w["ok"] and w["frozen_file_backed"] == w["frozen_params"] > 0
    assert w["registered"] is True and w["ring_bytes"] == 0 and w["max_loss_diff"] == 0.0
    big = report["bigger_than_device"]
    assert big["weights_over_limit"] >= 2.0
    assert big["peak_reserved_over_limit"] > 0 and big["tokens_per_s"] > 0
    assert len(big["losses"]) == 3 and all(math.isfinite(x) for x in big["losses"])
    assert big["losses"][-1] < big["losses"][0]
    assert big["timed_calls_sampled"] is False
    logical = report["scaling"]["logical"]   # two devices where there is one: same losses
    assert logical["ok"] and logical["max_loss_diff"] == 0.0
    ft = report["finetune"]
    assert [r["mode"] for r in ft["runs"]] == ["lora", "full", "longest"]
    for row in ft["runs"]:
        assert row["ok"] is True and "error" not in row, row
        assert FINETUNE_KEYS <= set(row), FINETUNE_KEYS - set(row)
        assert row["mfu"] is None                 # no GPU: no peak to divide by
        assert row["tokens_per_step"] == row["microbatches"] * row["seq"]
        assert row["tokens_per_s"] == pytest.approx(row["tokens_per_step"] / row["step_s"])
        assert row["hardware_tflops"] > 0 and row["model_tflops"] > 0
        # the predicted peak within 30 % of the counted one
        assert abs(row["predicted_peak_bytes"] / row["peak_device_bytes"] - 1) < 0.3
        assert row["predicted_host_bytes"] > 0 and row["host_peak_rss_bytes"] > 0
        assert row["timed_calls_sampled"] is False
        if row["mode"] == "longest":   # one sequence as long as predicted to fit: no eager
            assert row["microbatches"] == 1 and row["seq"] >= 64 and not row["eager"]["ran"]
            assert row["longest_asked"]["device_memory"] == ft_kit.DRY_RUN_DEVICE_MEMORY
            continue
        assert row["eager"]["ran"] and row["vs_eager"] > 0
        assert row["first_loss_rel_diff"] < 0.05
    lora, full, _ = ft["runs"]
    assert lora["trainable_params"] < lora["params"] / 2 and lora["host_dtype"] == "bfloat16"
    assert full["trainable_params"] == full["params"] and full["host_dtype"] == "float32"
    # LoRA downloads only the adapters' gradients; the full fine-tune every one, in fp32
    assert lora["d2h_bytes_grads"] < full["d2h_bytes_grads"]
    check_generate(report["generate"])
    check_many_devices(report["many_devices"])
    dp = report["data_parallel"]   # data_parallel="device" on one rank: gloo on a dry run
    assert dp["ok"] and dp["device_reduce_scatters"] > 0, dp
    assert dp["d2h_bytes_grads"]["device"] == dp["d2h_bytes_grads"]["plain"]   # 1/1 of them
    # after a no_sync() call every device reduce-scatter adds the accumulated .grad (sRS+)
    assert dp["accumulated_reduce_scatters"] == dp["device_reduce_scatters"] > 0, dp
    assert dp["device_all_reduces"] == dp["device_reduce_scatters"], dp   # one per stage
    # zero3 on one rank: each stage gathered after its upload (a copy), the same steps
    assert dp["zero3_all_gathers"] > 0 and dp["zero3_max_param_diff"] <= 1e-5, dp
    # data_parallel=True on (cuda-semantics) devices: each stage's sAR in a stepping call
    assert dp["true_all_reduces"] == dp["device_reduce_scatters"], dp
    assert dp["true_max_param_diff"] <= 1e-5, dp


def check_generate(gen):
    """The kit's ``generate`` at dry-run sizes: weights over twice the cap; the device's
    caches cannot all stay (``"device"`` refused before it ran), ``"auto"`` keeps some,
    ``"host"`` none; tokens/s against a bound labelled as a dry run's."""
    assert gen["weights_over_limit"] > 2 and gen["cap_bytes"] < gen["weight_bytes"] / 2
    assert gen["bound_from"].startswith("dry run") and gen["bound_tokens_per_s"] > 0
    assert list(gen["variants"]) == ["host", "auto", "device"]
    host, auto, device = gen["variants"].values()
    assert not device["ran"] and "Nothing ran" in device["refused"]
    for v in (host, auto):
        assert v["ran"] and v["ok"] and v["token_agreement"] > 0.9
        assert v["over_bound"] == pytest.approx(v["tokens_per_s"] / gen["bound_tokens_per_s"])
        assert v["peak_counted_bytes"] <= gen["cap_bytes"]
    assert host["resident_stages"] == [] and 0 < len(auto["resident_stages"]) < auto["decode_stages"]
    # a resident cache is neither streamed in nor written back
    assert auto["decode_step"]["h2d_bytes_params"] < host["decode_step"]["h2d_bytes_params"]
    assert 0 < auto["decode_step"]["d2h_bytes_cache"] < host["decode_step"]["d2h_bytes_cache"]
    # every weight crosses the link each decode step: the bound's premise
    assert host["decode_step"]["h2d_bytes_params"] >= gen["weight_bytes"]


def test_generate_section_fails_when_tokens_differ_or_a_streamed_variant_does_not_run():
    from fxpipe.check.generate import agreement, variants_ok
    ref = torch.arange(12).reshape(2, 6)
    differ = ref.clone()
    differ[:, 4:] += 1
    assert agreement(ref.clone(), ref, 2) == {"same_tokens": True, "token_agreement": 1.0,
                                              "ok": True}
    assert agreement(differ, ref, 2)["ok"] is False and agreement(ref[:, :5], ref, 2)["ok"] is False
    ran, refused = {"ran": True, "ok": True}, {"ran": False, "refused": "... Nothing ran ..."}
    assert variants_ok({"host": ran, "auto": ran, "device": refused})
    assert not variants_ok({"host": ran, "auto": ran, "device": {"ran": True, "ok": False}})
    assert not variants_ok({"host": ran, "auto": refused, "device": ran})


MANY_DEVICES_KEYS = {"steps", "captures_after_step", "plateau", "graph_captures", "graph_replays",
                     "issue", "issue_lock_wait_ms", "issue_idle", "lock_ab", "memory", "plan",
                     "seconds"}


def check_many_devices(md):
    """The kit's ``many_devices`` at dry-run sizes: eight virtual devices, eager stage code
    and ``"cudagraphs"`` (emulated graphs over the segments' own code) from the same
    weights, calls alternating two lengths: the losses agree, the captures plateau once
    each length was seen, and every figure is there."""
    assert md["logical_devices"] == 8 and md["note"].startswith("dry run")
    assert "standing in for inductor" in md["compiler"]
    L1, L2 = md["lengths"]
    assert L2 == L1 // 2 and list(md["backends"]) == ["eager", "cudagraphs"]
    assert md["losses_agree"] and md["plateau"] and md["max_loss_rel_diff"] <= md["loss_rtol"]
    eager, graphs = md["backends"].values()
    for row in (eager, graphs):
        assert row["ran"] and "error" not in row, row.get("error")
        assert MANY_DEVICES_KEYS <= set(row), MANY_DEVICES_KEYS - set(row)
        assert [s["seq"] for s in row["steps"]] == [L1, L2] * 3
        assert all(math.isfinite(s["loss"]) for s in row["steps"])
        issue = row["issue"]
        assert issue["issue_us_per_action"] > 0 and issue["issue_us_per_kernel"] > 0
        assert issue["runs_at_issue"] is False        # virtual devices: kernels off the issue
        assert issue["actions"] > issue["device_actions"] > 0   # the host lane's are not issued
        assert row["issue_lock_wait_ms"] == 0.0   # virtual devices: no work at issue, no lock
        assert row["issue_lock_waits"] == 0
        ab = row["lock_ab"]
        assert ab["slack"] > 0 and all(ab[k]["call_ms"] > 0 and ab[k]["issue_lock_waits"] == 0
                                       for k in ("kept", "each"))
        idle = row["issue_idle"]
        assert set(idle["devices"]) == {str(i) for i in range(8)}
        assert 0 <= idle["issue_idle_ms"] <= idle["idle_ms"] and idle["unstamped_gaps"] == 0
        assert idle["compute_busy_ms"] > 0
        memory = row["memory"]   # a sanity bound: the strict cuda-sim tests hold the prediction
        assert 0.5 < memory["reserved_over_predicted"] < 1.5, memory
        assert len(memory["devices"]) == 8
    assert eager["captures_after_step"] == [0] * 6 and eager["graph_replays"] == 0
    assert set(eager["issue"]["per_kernel_over"]) == {"Forward", "RecomputeBackward",
                                                      "FusedBackward"}
    after = graphs["captures_after_step"]   # L1 captures, L2 captures, then only replays
    assert 0 < after[0] < after[1] and after[1:] == [after[1]] * 5
    assert all(s["graph_replays"] > 0 for s in graphs["steps"][2:])
    assert graphs["traced_call"]["graph_captures"] == 0
    # a graph job's launches are exact; the fused tail's compiled kernels modelled
    assert graphs["issue"]["per_kernel_over"] == ["GraphForward", "GraphRecomputeBackward"]
    assert graphs["issue"]["kinds"]["FusedBackward"]["kernels_modelled"] is True


def test_many_devices_fails_when_losses_differ_or_captures_do_not_plateau():
    from fxpipe.check.many_devices import LOSS_RTOL, agreement

    def row(losses, plateau=True):
        return {"ran": True, "plateau": plateau, "steps": [{"loss": x} for x in losses]}
    same = agreement({"eager": row([2.0, 3.0]), "cudagraphs": row([2.0, 3.0 * (1 + LOSS_RTOL / 2)])})
    assert same["ok"] and same["losses_agree"] and same["plateau"]
    apart = agreement({"eager": row([2.0, 3.0]), "cudagraphs": row([2.0, 3.0 * (1 + 2 * LOSS_RTOL)])})
    assert not apart["ok"] and not apart["losses_agree"]
    growing = agreement({"eager": row([2.0]), "cudagraphs": row([2.0], plateau=False)})
    assert not growing["ok"] and not growing["plateau"]
    failed = agreement({"eager": row([2.0]), "cudagraphs": {"ran": False, "error": {}}})
    assert not failed["ok"] and failed["max_loss_rel_diff"] is None


FINETUNE_KEYS = {"model", "mode", "params", "tokens_per_step", "step_s", "tokens_per_s",
                 "model_tflops", "hardware_tflops", "mfu", "peak_device_bytes",
                 "predicted_peak_bytes", "predicted_step_s", "host_issue_ms", "compute_busy_ms",
                 "host_rss_bytes", "vs_eager", "ok"}


def _stub_sections(monkeypatch, out, **special):
    """Replace every section with a stub that returns at once (or ``special[name]``),
    and records what the JSON on disk held when it ran."""
    seen = {}

    def stub(name):
        def run(kit):
            seen[name] = json.loads(out.read_text())
            if name in special:
                return special[name]()
            return {"figure": 1.0}
        return run
    for name in SECTIONS:
        monkeypatch.setattr(SECTIONS[name], "run", stub(name))
    return seen


@pytest.fixture
def _threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_a_failing_section_is_recorded_and_the_kit_goes_on(tmp_path, monkeypatch, _threads):
    out = tmp_path / "check.json"

    def fail():
        raise ValueError("the scaling section broke")
    seen = _stub_sections(monkeypatch, out, scaling=fail)
    code = check_cli.main(["--dry-run", "--out", str(out)])
    assert code == 1
    report = json.loads(out.read_text())
    assert report["failed"] == ["scaling"]
    err = report["scaling"]["error"]
    assert report["scaling"]["ok"] is False and err["type"] == "ValueError"
    assert "the scaling section broke" in err["message"]
    assert any("the scaling section broke" in line for line in err["traceback"])
    for name in set(SECTIONS) - {"scaling"}:
        assert report[name] == {"ok": True, "figure": 1.0, "seconds": report[name]["seconds"]}
    # written after every section: the next section found the failure already on disk
    assert seen["hidden_prefetch"]["in_progress"] == "hidden_prefetch"
    assert seen["hidden_prefetch"]["scaling"]["error"]["type"] == "ValueError"
    assert seen["hidden_prefetch"]["vs_checkpoint"]["ok"] is True
    assert "scaling" not in seen["scaling"] and "cuda_tests" in seen["scaling"]


def test_a_section_past_its_share_of_the_budget_is_cut_off(tmp_path, monkeypatch, _threads):
    out = tmp_path / "check.json"

    def hang():
        time.sleep(60)
        return {}
    _stub_sections(monkeypatch, out, vs_checkpoint=hang)
    code = check_cli.main(["--dry-run", "--out", str(out), "--budget-s", "2"])
    assert code == 1
    report = json.loads(out.read_text())
    assert report["vs_checkpoint"]["error"]["type"] == "SectionTimeout"
    assert report["cuda_tests"]["ok"] is True
    assert set(SECTIONS) <= set(report)
    assert check_cli._interrupted


def test_a_crash_keeps_the_sections_before_it(tmp_path):
    out = tmp_path / "check.json"
    run = subprocess.run([sys.executable, "-m", "fxpipe.check", "--dry-run", "--skip-tests",
                          "--out", str(out), "--fail-section", "vs_checkpoint:exit"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 3, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["cuda_tests"]["ok"] is True
    assert report["in_progress"] == "vs_checkpoint" and "vs_checkpoint" not in report


def test_a_subprocess_past_its_timeout_is_killed_with_its_output_tail():
    script = "import time; print('started', flush=True); time.sleep(60)"
    result = run_subprocess([sys.executable, "-c", script], timeout=2)
    assert result["timed_out"] is True and result["returncode"] != 0
    assert result["tail"] == ["started"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible: the kit would run")
def test_check_without_a_gpu_says_what_to_do(capsys):
    # in this process: ``python -m fxpipe.check`` exits with main()'s code (the dry run and
    # the crash above run it as a process)
    assert check_cli.main([]) == 2
    assert "--dry-run" in capsys.readouterr().err


def test_sections_runs_those_in_that_order(tmp_path, monkeypatch, _threads):
    out = tmp_path / "check.json"
    seen = _stub_sections(monkeypatch, out)
    assert check_cli.main(["--dry-run", "--out", str(out), "--sections", "finetune,scaling"]) == 0
    report = json.loads(out.read_text())
    assert list(seen) == ["finetune", "scaling"] and report["sections"] == ["finetune", "scaling"]
    assert not set(SECTIONS) - {"finetune", "scaling"} & set(report)


@pytest.mark.parametrize("arg, says", [("scaling,nope", "no section named nope"),
                                       ("scaling,scaling", "list each section once"),
                                       (",", "empty")])
def test_sections_that_do_not_exist_are_refused_with_the_list(arg, says, capsys):
    assert check_cli.main(["--dry-run", "--sections", arg]) == 2
    err = capsys.readouterr().err
    assert says in err and ", ".join(SECTIONS) in err


def test_stage_backends_reach_the_finetune_runs_and_bad_ones_are_refused(tmp_path, monkeypatch,
                                                                          capsys):
    seen = {}

    def run_all(ctx, *, modes, backends, on_row, say):
        seen["backends"], seen["modes"] = backends, modes
        return [{"ok": True, "stage_backend": b} for b in backends]
    monkeypatch.setattr(ft_kit, "run_all", run_all)
    out = tmp_path / "check.json"
    assert check_cli.main(["--dry-run", "--out", str(out), "--sections", "finetune",
                       "--stage-backends", "eager,inductor,cudagraphs"]) == 0
    # "eager" as named: unset would be "auto" (compiled) on a GPU
    assert seen == {"backends": ("eager", "inductor", "cudagraphs"),
                    "modes": ("lora", "full", "longest")}
    runs = json.loads(out.read_text())["finetune"]["runs"]
    assert [r["stage_backend"] for r in runs] == ["eager", "inductor", "cudagraphs"]
    assert check_cli.main(["--dry-run", "--out", str(out), "--sections", "finetune",
                           "--finetune-modes", "full,qlora"]) == 0
    assert seen["modes"] == ("full", "qlora")
    assert check_cli.main(["--dry-run", "--sections", "finetune", "--stage-backends", "tvm"]) == 2
    assert "each must be one of eager, inductor, auto, cudagraphs" in capsys.readouterr().err
    assert check_cli.main(["--dry-run", "--sections", "finetune", "--finetune-modes", "lora,7b"]) == 2
    assert "each must be one of lora, qlora, full, longest" in capsys.readouterr().err


def test_a_sections_progress_is_on_disk_before_it_ends(tmp_path, monkeypatch, _threads):
    """The finetune section writes each run's row as it ends: a kill after the first run
    keeps it (``partial``, not ok until the section returns)."""
    out = tmp_path / "check.json"
    on_disk = {}

    def finetune(kit):
        kit.progress({"runs": [{"mode": "lora", "ok": True}]})
        on_disk.update(json.loads(out.read_text()))
        return {"runs": [{"mode": "lora", "ok": True}, {"mode": "full", "ok": True}]}
    monkeypatch.setattr(SECTIONS["finetune"], "run", finetune)
    assert check_cli.main(["--dry-run", "--out", str(out), "--sections", "finetune"]) == 0
    assert on_disk["finetune"] == {"ok": False, "partial": True,
                                   "runs": [{"mode": "lora", "ok": True}]}
    assert on_disk["in_progress"] == "finetune"
    final = json.loads(out.read_text())["finetune"]
    assert final["ok"] is True and "partial" not in final and len(final["runs"]) == 2


def test_a_section_that_fails_keeps_the_rows_it_reported(tmp_path, monkeypatch, _threads):
    """A timeout (or any failure) after the first run keeps that run's row beside the error."""
    out = tmp_path / "check.json"

    def finetune(kit):
        kit.progress({"runs": [{"mode": "lora", "ok": True}]})
        raise SectionTimeout("past its 9 s share of the time budget (--budget-s)")
    monkeypatch.setattr(SECTIONS["finetune"], "run", finetune)
    assert check_cli.main(["--dry-run", "--out", str(out), "--sections", "finetune"]) == 1
    final = json.loads(out.read_text())["finetune"]
    assert final["ok"] is False and final["runs"] == [{"mode": "lora", "ok": True}]
    assert final["error"]["type"] == "SectionTimeout"
