"""``fxpipe.integrations.transformers.FxpipeTrainer`` against ``transformers.Trainer``:
same seed, fp32, no dropout: the loss history and the final weights agree within fp32
tolerance (gradient accumulation, padding labels, clipping, a scheduler); evaluation
through the pipe; save and resume from a checkpoint; a peft model; options fxpipe cannot
honour fail at construction. Tiny Llama built from a config (nothing downloaded)."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch

import fxpipe

T = pytest.importorskip("transformers")
from fxpipe.integrations.transformers import FxpipeTrainer, fxpipe_trainer  # noqa: E402

V, SEQ = 64, 8
TOL = 2e-6   # fp32: microbatch losses summed in another order than one eager pass (seen 5e-7)


def tiny_llama() -> torch.nn.Module:
    torch.manual_seed(0)
    return T.LlamaForCausalLM(T.LlamaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        use_cache=False, attention_dropout=0.0))


class Rows(torch.utils.data.Dataset):
    """Token rows with padding (labels -100 and attention 0 at the end of some rows)."""

    def __init__(self, n: int = 16, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(2, V, (n, SEQ), generator=g)
        self.pad = torch.randint(0, 4, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        ids, mask = self.ids[i].clone(), torch.ones(SEQ, dtype=torch.long)
        labels = ids.clone()
        if self.pad[i]:
            mask[-self.pad[i]:] = 0
            labels[-self.pad[i]:] = -100
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def args(tmp_path, **kw) -> "T.TrainingArguments":
    base = dict(output_dir=str(tmp_path), per_device_train_batch_size=4,
                per_device_eval_batch_size=4, max_steps=4, learning_rate=1e-2,
                logging_steps=1, report_to=[], save_strategy="no", seed=0,
                use_cpu=True, dataloader_num_workers=0, disable_tqdm=True,
                lr_scheduler_type="linear", warmup_steps=1)
    base.update(kw)
    return T.TrainingArguments(**base)


def losses(trainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def max_weight_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    return max((sa[k].float() - sb[k].float()).abs().max().item() for k in sa)


def run_pair(tmp_path, trainer_kw=None, **kw):
    ref_model, model = tiny_llama(), tiny_llama()
    ds = Rows()
    ref = T.Trainer(model=ref_model, args=args(tmp_path / "ref", **kw), train_dataset=ds)
    ref.train()
    ours = FxpipeTrainer(model=model, args=args(tmp_path / "fx", **kw), train_dataset=ds,
                         devices=["cpu", "cpu"], **(trainer_kw or {}))
    ours.train()
    return ref, ours


@pytest.mark.parametrize("ga,clip,stream", [(1, 1.0, None), (2, 0.0, None), (2, 0.5, False),
                                            (1, 0.5, True)])
def test_equals_trainer(tmp_path, ga, clip, stream):
    """``stream``: None (default: the optimizer streamed into the backward, as it allows),
    False (the Trainer steps after the call); clip 0.5 clips every step (the speculative
    streamed step is redone), 1.0 some."""
    ref, ours = run_pair(tmp_path, gradient_accumulation_steps=ga, max_grad_norm=clip,
                         trainer_kw={"fxpipe_config": fxpipe.RunConfig(num_microbatch=2),
                                     "stream_optimizer": stream})
    inner = ours.optimizer.optimizer
    assert ("_fxpipe_trainer_step" in inner.__dict__) == (stream is not False)
    a, b = losses(ref), losses(ours)
    assert len(a) == len(b) == 4
    loss_err = max(abs(x - y) for x, y in zip(a, b))
    w_err = max_weight_diff(ref.model, ours.model)
    print(f"ga={ga} clip={clip}: max |loss diff| {loss_err:.3g}, max |weight diff| {w_err:.3g}")
    assert loss_err <= TOL, (a, b)
    assert w_err <= TOL
    gn_a = [h["grad_norm"] for h in ref.state.log_history if "grad_norm" in h]
    gn_b = [h["grad_norm"] for h in ours.state.log_history if "grad_norm" in h]
    # the norm before clipping, as the plain Trainer logs it (streamed too)
    assert max(abs(x - y) for x, y in zip(gn_a, gn_b)) <= 1e-4 * max(gn_a), (gn_a, gn_b)
    ours.close_pipes()


def test_evaluate_through_the_pipe(tmp_path):
    ref_model, model = tiny_llama(), tiny_llama()
    eval_ds = Rows(8, seed=3)
    ref = T.Trainer(model=ref_model, args=args(tmp_path / "ref"), eval_dataset=eval_ds)
    ours = FxpipeTrainer(model=model, args=args(tmp_path / "fx"), eval_dataset=eval_ds,
                         devices=["cpu", "cpu"], fxpipe_config=fxpipe.RunConfig(num_microbatch=2))
    a, b = ref.evaluate(), ours.evaluate()
    assert abs(a["eval_loss"] - b["eval_loss"]) <= 1e-5, (a, b)
    assert ours._fxpipe_pipes, "evaluate() did not run through a pipe"
    p = ours.predict(eval_ds)
    assert p.predictions.shape == (8, SEQ, V)
    ref_logits = ref.predict(eval_ds).predictions
    assert abs(p.predictions - ref_logits).max() <= 1e-5
    ours.close_pipes()


def test_checkpoint_and_resume(tmp_path):
    """Checkpoints every 2 steps; a fresh trainer resumed from checkpoint-2 ends where the
    uninterrupted run ends; save_model writes weights a plain model loads."""
    kw = dict(save_strategy="steps", save_steps=2, fxpipe_config=None)
    kw.pop("fxpipe_config")
    full = FxpipeTrainer(model=tiny_llama(), args=args(tmp_path / "full", **kw),
                         train_dataset=Rows(), devices=["cpu", "cpu"])
    full.train()
    resumed = FxpipeTrainer(model=tiny_llama(), args=args(tmp_path / "res", **kw),
                            train_dataset=Rows(), devices=["cpu", "cpu"])
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-2"))
    assert max_weight_diff(full.model, resumed.model) <= TOL
    assert losses(resumed)[-1] == pytest.approx(losses(full)[-1], abs=TOL)
    full.save_model(str(tmp_path / "saved"))
    loaded = T.LlamaForCausalLM.from_pretrained(str(tmp_path / "saved"))
    assert max_weight_diff(full.model, loaded) == 0.0
    full.close_pipes()
    resumed.close_pipes()


def lora_llama():
    peft = pytest.importorskip("peft")
    return peft.get_peft_model(tiny_llama(), peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
        init_lora_weights="gaussian"))


def test_peft_lora(tmp_path):
    ref_model, model = lora_llama(), lora_llama()
    ds = Rows()
    ref = T.Trainer(model=ref_model, args=args(tmp_path / "ref"), train_dataset=ds)
    ref.train()
    ours = FxpipeTrainer(model=model, args=args(tmp_path / "fx"), train_dataset=ds,
                         devices=["cpu", "cpu"])
    ours.train()
    loss_err = max(abs(x - y) for x, y in zip(losses(ref), losses(ours)))
    w_err = max_weight_diff(ref.model, ours.model)
    print(f"peft: max |loss diff| {loss_err:.3g}, max |weight diff| {w_err:.3g}")
    assert loss_err <= TOL and w_err <= TOL
    frozen = dict(tiny_llama().named_parameters())
    base = {n.replace("base_model.model.", "").replace(".base_layer", ""): p
            for n, p in ours.model.named_parameters() if "lora_" not in n}
    assert all(torch.equal(base[n], p) for n, p in frozen.items())   # only LoRA trained
    ours.close_pipes()


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_bf16_trains_a_llama_within_5_percent_of_trainer_bf16(tmp_path, lora):
    """``TrainingArguments(bf16=True)`` on an HF Llama (and a peft LoRA of it): the plain
    Trainer autocasts; FxpipeTrainer's devices compute in bfloat16 copies of the fp32
    masters (``param_dtype``, its default). Three steps: each loss within 5 % of the
    Trainer's; the masters stay fp32 and train."""
    make = lora_llama if lora else tiny_llama
    kw = dict(bf16=True, max_steps=3, learning_rate=1e-3)
    ref = T.Trainer(model=make(), args=args(tmp_path / "ref", **kw), train_dataset=Rows())
    ref.train()
    ours = FxpipeTrainer(model=make(), args=args(tmp_path / "fx", **kw), train_dataset=Rows(),
                         devices=["cpu", "cpu"])
    before = {n: p.detach().clone() for n, p in ours.model.named_parameters()}
    ours.train()
    (pipe,) = ours._fxpipe_pipes.values()
    assert pipe.param_dtype == torch.bfloat16
    a, b = losses(ref), losses(ours)
    assert len(a) == len(b) == 3
    assert all(abs(x - y) <= 0.05 * abs(x) for x, y in zip(a, b)), (a, b)
    trained = [n for n, p in ours.model.named_parameters() if not torch.equal(p, before[n])]
    assert all(p.dtype == torch.float32 for p in ours.model.parameters())
    assert trained and (not lora or all("lora_" in n for n in trained))
    ours.close_pipes()


def test_bf16_with_fp32_parameters_autocasts_never_fp32(tmp_path):
    """``bf16=True`` with ``param_dtype=torch.float32``: the parameters stay fp32 on the
    devices and each call runs under ``torch.autocast(..., torch.bfloat16)``, as the plain
    Trainer's model does; never silently fp32 (the losses are not ``bf16=False``'s)."""
    kw = dict(max_steps=3, learning_rate=1e-3)
    ref = T.Trainer(model=tiny_llama(), args=args(tmp_path / "ref", bf16=True, **kw),
                    train_dataset=Rows())
    ref.train()
    fp32 = T.Trainer(model=tiny_llama(), args=args(tmp_path / "fp32", **kw), train_dataset=Rows())
    fp32.train()
    ours = FxpipeTrainer(model=tiny_llama(), args=args(tmp_path / "fx", bf16=True, **kw),
                         train_dataset=Rows(), devices=["cpu", "cpu"],
                         param_dtype=torch.float32)
    ours.train()
    (pipe,) = ours._fxpipe_pipes.values()
    assert pipe.param_dtype == torch.float32
    assert pipe.layers.autocast == (("cpu", torch.bfloat16, True),)   # captured under it
    a, b, c = losses(ref), losses(ours), losses(fp32)
    assert all(abs(x - y) <= 0.01 * abs(x) for x, y in zip(a, b)), (a, b)
    assert all(abs(x - y) > 1e-6 for x, y in zip(b, c)), (b, c)   # not fp32
    with pytest.raises(ValueError, match=r"bf16=True\) with param_dtype=torch.float16"):
        FxpipeTrainer(model=tiny_llama(), args=args(tmp_path / "fp16", bf16=True, **kw),
                      train_dataset=Rows(), devices=["cpu", "cpu"], param_dtype=torch.float16)
    ours.close_pipes()


@pytest.mark.parametrize("option,message", [
    ({"fsdp": "full_shard"}, "fsdp=...) cannot be honoured"),
    ({"fp16": True}, "fp16=True): fp16 needs loss scaling"),
])
def test_options_fxpipe_cannot_honour(tmp_path, option, message):
    try:
        a = args(tmp_path, **option)
    except (ValueError, ImportError) as e:   # TrainingArguments itself refused it here
        pytest.skip(f"TrainingArguments({option}) not constructible on this host: {e}")
    with pytest.raises((ValueError, NotImplementedError), match=message.replace("(", r"\(")
                       .replace(")", r"\)").replace(".", r"\.")):
        FxpipeTrainer(model=tiny_llama(), args=a, train_dataset=Rows())


def test_torch_compile_compiles_the_stage_code(tmp_path):
    """``TrainingArguments(torch_compile=True)``: the pipes run inductor's stage code
    (``RunConfig(stage_backend="inductor")``), and transformers does not wrap the model
    in ``torch.compile`` too; ``torch_compile_mode="reduce-overhead"`` (CUDA graphs) runs
    ``"cudagraphs"``; another backend or mode is refused, saying why."""
    ours = FxpipeTrainer(model=tiny_llama(), args=args(tmp_path, torch_compile=True),
                         train_dataset=Rows(), devices=["cpu", "cpu"],
                         fxpipe_config=fxpipe.RunConfig(num_microbatch=2))
    assert ours._fxpipe_config.stage_backend == "inductor"
    assert ours._fxpipe_config.num_microbatch == 2 and ours.args.torch_compile is False
    with pytest.raises(ValueError, match=r"torch_compile_backend='aot_eager'\) cannot be honoured"):
        FxpipeTrainer(model=tiny_llama(), args=args(tmp_path, torch_compile_backend="aot_eager"),
                      train_dataset=Rows())
    # torch.compile's CUDA graphs: the stage jobs replay device graphs; bf16 trains as
    # the plain Trainer's bf16 does (each loss within 5 %). What is checked is the
    # trainer's mapping and its graphs: each segment's own graph stands in for inductor's
    # code (the kit's dry run's stand_in_compiler; inductor's compiles were most of the
    # test's time, a minute with its cache cold), which tests/test_cudagraphs.py runs
    # as device graphs
    from fxpipe.check.many_devices import stand_in_compiler
    kw = dict(bf16=True, max_steps=2, learning_rate=1e-3)
    ref = T.Trainer(model=tiny_llama(), args=args(tmp_path / "ref", **kw), train_dataset=Rows())
    ref.train()
    graphs = FxpipeTrainer(model=tiny_llama(), train_dataset=Rows(), devices=["cpu", "cpu"],
                           args=args(tmp_path / "graphs", torch_compile=True,
                                     torch_compile_mode="reduce-overhead", **kw))
    assert graphs._fxpipe_config.stage_backend == "cudagraphs"
    with stand_in_compiler(True):
        graphs.train()
        stats = [p.stats() for p in graphs._fxpipe_pipes.values()]
        graphs.close_pipes()
    for mine, theirs in zip(losses(graphs), losses(ref), strict=True):
        assert abs(mine - theirs) <= 0.05 * abs(theirs), (losses(graphs), losses(ref))
    assert sum(s["graph_replays"] for s in stats) > 0, stats
    with pytest.raises(NotImplementedError, match="autotuning modes are not built"):
        FxpipeTrainer(model=tiny_llama(), args=args(tmp_path, torch_compile_mode="max-autotune"),
                      train_dataset=Rows())


def test_deepspeed_config_refused(tmp_path):
    a = args(tmp_path)
    a.deepspeed = {"zero_optimization": {"stage": 2}}   # as TrainingArguments stores it
    with pytest.raises(ValueError, match=r"deepspeed=\.\.\.\) cannot be honoured"):
        FxpipeTrainer(model=tiny_llama(), args=a, train_dataset=Rows())


def test_bad_fxpipe_arguments(tmp_path):
    with pytest.raises(TypeError, match="fxpipe_config must be an fxpipe.RunConfig"):
        FxpipeTrainer(model=tiny_llama(), args=args(tmp_path), fxpipe_config={"num_microbatch": 2})
    with pytest.raises(TypeError, match="expects a transformers.Trainer subclass"):
        fxpipe_trainer(object)
    with pytest.raises(ValueError, match="data_parallel must be True, 'host', 'device' or 'zero3'"):
        FxpipeTrainer(model=tiny_llama(), args=args(tmp_path), data_parallel="zero4")
    with pytest.raises(ValueError, match="data_parallel='device'.*leave stream_optimizer on"):
        FxpipeTrainer(model=tiny_llama(), args=args(tmp_path), data_parallel="device",
                      stream_optimizer=False)
    # a checkpoint holding optimizer shards resumes only into data_parallel="device"/"zero3"
    (tmp_path / "checkpoint-2" / "fxpipe_shards").mkdir(parents=True)
    trainer = FxpipeTrainer(model=tiny_llama(), args=args(tmp_path), train_dataset=Rows())
    trainer.create_optimizer_and_scheduler(4)
    with pytest.raises(ValueError, match="holds optimizer shards.*data_parallel='device'"):
        trainer._load_optimizer_and_scheduler(str(tmp_path / "checkpoint-2"))


def test_import_fxpipe_imports_no_hf():
    """``import fxpipe`` (a fresh interpreter) never imports transformers, trl, accelerate."""
    code = ("import sys, fxpipe, fxpipe.roundpipe; "
            "bad = [m for m in ('transformers', 'trl', 'accelerate', 'peft') if m in sys.modules]; "
            "print(bad); assert not bad, bad")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr + out.stdout


@pytest.mark.parametrize("bf16,completion", [(False, False), (True, False), (False, True)],
                         ids=["fp32", "bf16", "completion_only"])
def test_trl_sft_trainer(tmp_path, bf16, completion):
    """TRL's SFTTrainer through fxpipe (``fxpipe_trainer(SFTTrainer)``) equals SFTTrainer:
    its defaults (gradient checkpointing, ``loss_type="chunked_nll"``) map onto fxpipe's
    recompute and the same "nll" math; its metrics are computed per microbatch. In bf16
    (SFTConfig's default): each loss within 5 % of SFTTrainer's (which autocasts; fxpipe
    computes in bfloat16 copies of the fp32 masters). ``completion``: a prompt-completion
    dataset of uneven lengths, the prompts masked (``completion_only_loss``: labels -100
    on the prompt and the padding), microbatches of different target counts."""
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({f"t{i}": i for i in range(V)},
                                                           unk_token="t1"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    ptok = T.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", eos_token="t2",
                                     unk_token="t1")
    g = torch.Generator().manual_seed(0)
    ds = datasets.Dataset.from_dict({"input_ids": torch.randint(3, V, (16, SEQ - 1),
                                                                generator=g).tolist()})
    if completion:
        words = [[f"t{int(t)}" for t in row] for row in torch.randint(3, V, (16, SEQ), generator=g)]
        cut = torch.randint(1, SEQ - 2, (16,), generator=g).tolist()
        end = torch.randint(2, SEQ, (16,), generator=g).tolist()
        ds = datasets.Dataset.from_dict({
            "prompt": [" ".join(w[:c]) for w, c in zip(words, cut)],
            "completion": [" ".join(w[c:max(e, c + 1)]) for w, c, e in zip(words, cut, end)]})

    def config(name):
        return trl.SFTConfig(output_dir=str(tmp_path / name), per_device_train_batch_size=4,
                             max_steps=4, learning_rate=1e-3, logging_steps=1, report_to=[],
                             save_strategy="no", seed=0, use_cpu=True, disable_tqdm=True,
                             bf16=bf16)

    ref = trl.SFTTrainer(model=tiny_llama(), args=config("ref"), train_dataset=ds,
                         processing_class=ptok)
    ref.train()
    ours = fxpipe_trainer(trl.SFTTrainer)(model=tiny_llama(), args=config("fx"), train_dataset=ds,
                                          processing_class=ptok, devices=["cpu", "cpu"])
    ours.train()
    assert ours.args.loss_type == "nll"
    assert ours.completion_only_loss == completion
    a, b = losses(ref), losses(ours)
    assert len(a) == len(b) == 4
    loss_err, w_err = max(abs(x - y) for x, y in zip(a, b)), max_weight_diff(ref.model, ours.model)
    print(f"trl: max |loss diff| {loss_err:.3g}, max |weight diff| {w_err:.3g}")
    if bf16:
        assert all(abs(x - y) <= 0.05 * abs(x) for x, y in zip(a, b)), (a, b)
        assert next(iter(ours._fxpipe_pipes.values())).param_dtype == torch.bfloat16
    else:
        # masked prompts: microbatches of uneven target counts, each weighted by its count
        # (the weights after 4 AdamW steps: seen 2.5e-6 apart, Adam's normalization of
        # gradients whose rounding differs; the losses 5e-7)
        assert loss_err <= TOL and w_err <= (1e-5 if completion else TOL), (a, b)
    entropy = [h["entropy"] for h in ours.state.log_history if "entropy" in h]
    assert len(entropy) == 4 and all(e > 0 for e in entropy)
    ours.close_pipes()


def test_two_ranks_torchrun(tmp_path):
    """``torchrun --nproc_per_node 2`` (gloo): each rank trains half of every batch through
    a data-parallel pipe (non-final accumulation steps under ``no_sync``); the loss
    history and weights equal one process on the whole batch. So does a run in token
    chunks (``sequence_chunks=2``: the chunk step's gradients averaged across ranks), one
    on cuda-semantics devices (``data_parallel=True`` all-reducing on them), and one with ``data_parallel="device"`` (reduce-scattered on the devices, the optimizer
    sharded, clipped). In bf16 with ``"device"`` (the fp32 masters sharded too) a run
    saved at step 2 and resumed from there by a new trainer ends where the uninterrupted
    run does (clipping redone at some steps: max_grad_norm 0.5). ``"zero3"`` trains as
    ``"device"`` does, bit for bit, fp32 and bf16."""
    out = tmp_path / "rank0.pt"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(pathlib.Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc_per_node", "2", "-m", "tests.trainer_dist_worker", str(out)],
                          capture_output=True, text=True, timeout=300, env=env,
                          cwd=str(pathlib.Path(__file__).resolve().parents[1]))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    runs = torch.load(out)
    for name, data, config in (("plain", Rows(), None),
                               ("chunked", Prompts(), fxpipe.RunConfig(sequence_chunks=2))):
        got = runs[name]
        whole = args(tmp_path / name, per_device_train_batch_size=4,
                     gradient_accumulation_steps=2, train_sampling_strategy="sequential")
        one = FxpipeTrainer(model=tiny_llama(), args=whole, train_dataset=data,
                            devices=["cpu", "cpu"], fxpipe_config=config)
        one.train()
        assert len(got["losses"]) == len(losses(one)) == 4
        loss_err = max(abs(x - y) for x, y in zip(got["losses"], losses(one)))
        state = one.model.state_dict()
        w_err = max((state[k] - got["state"][k]).abs().max().item() for k in state)
        print(f"{name}, 2 ranks vs 1: max |loss diff| {loss_err:.3g}, max |weight diff| "
              f"{w_err:.3g}")
        assert loss_err <= TOL and w_err <= TOL, (name, got["losses"], losses(one))
        if name == "plain":
            dev = runs["device"]
            loss_err = max(abs(x - y) for x, y in zip(dev["losses"], losses(one)))
            w_err = max((state[k] - dev["state"][k]).abs().max().item() for k in state)
            norms = [h["grad_norm"] for h in one.state.log_history if "grad_norm" in h]
            norm_err = max(abs(x - y) for x, y in zip(dev["norms"], norms))
            print(f"device, 2 ranks vs 1: max |loss diff| {loss_err:.3g}, max |weight diff| "
                  f"{w_err:.3g}, max |grad_norm diff| {norm_err:.3g}")
            assert loss_err <= TOL and w_err <= TOL and norm_err <= 1e-5, (dev["norms"], norms)
            # zero3 (one host copy of the parameters, 1/N uploaded and gathered on the
            # devices) steps as "device" does: the same losses, weights and norms
            z3 = runs["zero3"]
            assert z3["losses"] == dev["losses"] and z3["norms"] == dev["norms"], z3
            for k, v in dev["state"].items():
                assert torch.equal(v, z3["state"][k]), k
            # data_parallel=True where the devices are GPUs: all-reduced on them (sAR)
            gpus = runs["plain on GPUs"]
            loss_err = max(abs(x - y) for x, y in zip(gpus["losses"], losses(one)))
            w_err = max((state[k] - gpus["state"][k]).abs().max().item() for k in state)
            print(f"plain on GPUs, 2 ranks vs 1: max |loss diff| {loss_err:.3g}, max |weight "
                  f"diff| {w_err:.3g}")
            assert loss_err <= TOL and w_err <= TOL, (gpus["losses"], losses(one))
        one.close_pipes()
    whole, resumed = runs["device bf16"], runs["device bf16 resumed"]
    z3 = runs["zero3 bf16"]   # the bf16 parameters shared, the fp32 masters sharded
    assert z3["losses"] == whole["losses"], (z3["losses"], whole["losses"])
    for k, v in whole["state"].items():
        assert torch.equal(v, z3["state"][k]), k
    assert any(n > 0.5 for n in whole["norms"]), whole["norms"]   # some steps redone clipped
    assert len(resumed["losses"]) == 4 and resumed["losses"] == whole["losses"], \
        (resumed["losses"], whole["losses"])
    for k, v in whole["state"].items():   # the fp32 masters gathered
        assert v.dtype == resumed["state"][k].dtype and torch.equal(v, resumed["state"][k]), k
    # the saved model is the fp32 masters, not their bf16 copies
    from safetensors.torch import load_file
    saved = load_file(f"{out}.device bf16/checkpoint-4/model.safetensors")
    for k, v in saved.items():
        assert v.dtype == torch.float32 and torch.equal(v, whole["state"][k]), k


class Prompts(torch.utils.data.Dataset):
    """Rows of 16 tokens, none padded in attention (what a chunked step takes): a prompt
    masked out of the loss (``-100``) at the start of each row, and ``-100`` after the
    row's end in some (right padding, which a causal LM's earlier tokens never see)."""

    def __init__(self, n: int = 16, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(2, V, (n, 16), generator=g)
        self.prompt = torch.randint(1, 8, (n,), generator=g)
        self.pad = torch.randint(0, 4, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        ids = self.ids[i].clone()
        labels = ids.clone()
        labels[:self.prompt[i]] = -100
        if self.pad[i]:
            labels[-self.pad[i]:] = -100
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


def test_sequence_chunks_equal_trainer(tmp_path):
    """``fxpipe_config=RunConfig(sequence_chunks=2)``: each step's rows run as two token
    chunks through the stages (``fxpipe.sequence_chunks``), the model's own loss counted
    over the accumulated batch (``num_items_in_batch``); with masked prompts, gradient
    accumulation, clipping and evaluation, the losses and weights equal the plain
    Trainer's."""
    kw = dict(gradient_accumulation_steps=2, max_grad_norm=1.0, eval_strategy="steps",
              eval_steps=2)
    ref = T.Trainer(model=tiny_llama(), args=args(tmp_path / "ref", **kw),
                    train_dataset=Prompts(), eval_dataset=Prompts(8, seed=3))
    ref.train()
    ours = FxpipeTrainer(model=tiny_llama(), args=args(tmp_path / "fx", **kw),
                         train_dataset=Prompts(), eval_dataset=Prompts(8, seed=3),
                         devices=["cpu", "cpu"],
                         fxpipe_config=fxpipe.RunConfig(sequence_chunks=2))
    ours.train()
    assert ours._fxpipe_train_pipe.stats()["d2h_bytes_kv"] > 0   # the step ran chunked
    evals = [[h["eval_loss"] for h in t.state.log_history if "eval_loss" in h] for t in (ref, ours)]
    assert len(evals[0]) == len(evals[1]) == 2
    assert max(abs(x - y) for x, y in zip(*evals)) <= 1e-5, evals
    a, b = losses(ref), losses(ours)
    assert len(a) == len(b) == 4
    assert max(abs(x - y) for x, y in zip(a, b)) <= TOL, (a, b)
    assert max_weight_diff(ref.model, ours.model) <= TOL
    ours.close_pipes()


class _OwnLoss(T.Trainer):
    def compute_loss(self, model, inputs, **kw):
        return super().compute_loss(model, inputs, **kw)


@pytest.mark.parametrize("trainer_kw,message", [
    ({"compute_loss_func": lambda out, labels, num_items_in_batch=None: out.logits.mean()},
     "compute_loss_func need the whole logits"),
    ({"args_kw": {"torch_compile": True, "torch_compile_mode": "reduce-overhead"}},
     "stage_backend='cudagraphs'"),
    ({"cls": fxpipe_trainer(_OwnLoss)}, "_OwnLoss.compute_loss overrides Trainer.compute_loss"),
])
def test_what_a_chunked_trainer_cannot_run_is_refused_at_construction(tmp_path, trainer_kw,
                                                                     message):
    kw = dict(trainer_kw)
    cls, args_kw = kw.pop("cls", FxpipeTrainer), kw.pop("args_kw", {})
    with pytest.raises(NotImplementedError, match=re.escape(message)):
        cls(model=tiny_llama(), args=args(tmp_path, **args_kw), train_dataset=Prompts(),
            devices=["cpu", "cpu"], fxpipe_config=fxpipe.RunConfig(sequence_chunks=2), **kw)


def test_eval_during_training_and_a_short_last_batch(tmp_path):
    """Evaluation every 2 steps interleaved with training (a train and an eval pipe on
    one model); 18 rows in batches of 4: the epoch's last batch has 2 rows, fewer than
    the default 3 microbatches."""
    kw = dict(eval_strategy="steps", eval_steps=2, max_steps=5)
    ref = T.Trainer(model=tiny_llama(), args=args(tmp_path / "ref", **kw),
                    train_dataset=Rows(18), eval_dataset=Rows(8, seed=3))
    ref.train()
    ours = FxpipeTrainer(model=tiny_llama(), args=args(tmp_path / "fx", **kw),
                         train_dataset=Rows(18), eval_dataset=Rows(8, seed=3),
                         devices=["cpu", "cpu"])
    ours.train()
    evals = [[h["eval_loss"] for h in t.state.log_history if "eval_loss" in h] for t in (ref, ours)]
    assert len(evals[0]) == len(evals[1]) == 3
    assert max(abs(x - y) for x, y in zip(*evals)) <= 1e-5, evals
    assert max(abs(x - y) for x, y in zip(losses(ref), losses(ours))) <= TOL
    assert max_weight_diff(ref.model, ours.model) <= TOL
    ours.close_pipes()
