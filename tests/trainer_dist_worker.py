"""One rank of ``tests/test_trainer.py::test_two_ranks_torchrun`` (run by torchrun):
FxpipeTrainer on this rank's share of every batch, then again in token chunks
(``sequence_chunks=2``) on rows without padding, then on cuda-semantics virtual devices
(``data_parallel=True`` reducing on the devices), then with ``data_parallel="device"``
(fp32; bf16 saved at step 2 and resumed) and ``"zero3"`` (fp32, bf16); rank 0 writes each run's loss history and
final weights to ``argv[1]``."""

import sys

import torch

import fxpipe
from fxpipe.integrations.transformers import FxpipeTrainer
from tests.test_trainer import Prompts, Rows, args, losses, tiny_llama


def main(out: str) -> None:
    got = {}
    for name, data, config in (("plain", Rows(), None),
                               ("chunked", Prompts(), fxpipe.RunConfig(sequence_chunks=2)),
                               ("plain on GPUs", Rows(), None)):
        # "on GPUs": cuda-semantics virtual devices, where data_parallel=True reduces on
        # the devices (each stage's sAR), the optimizer unsharded
        gpus = name.endswith("GPUs")
        half = args(f"{out}.{name}", per_device_train_batch_size=2,
                    gradient_accumulation_steps=2, train_sampling_strategy="sequential")
        devices = [fxpipe.VirtualDevice(semantics="cuda") for _ in range(2)] if gpus \
            else ["cpu", "cpu"]
        trainer = FxpipeTrainer(model=tiny_llama(), args=half, train_dataset=data,
                                devices=devices, fxpipe_config=config)
        trainer.train()
        pipe = trainer._fxpipe_train_pipe
        assert pipe is not None and pipe._dp is not None, "the training pipe is not data parallel"
        assert pipe._dp.on_devices == gpus and not pipe._dp.shard, name
        got[name] = {"losses": losses(trainer), "state": trainer.model.state_dict()}
        trainer.close_pipes()
    # data_parallel="device": in fp32 against the one process; in bf16 (sharded fp32
    # masters) saved at step 2, and resumed from there by a new trainer
    for name, bf16, resume in (("device", False, False), ("device bf16", True, False),
                               ("device bf16 resumed", True, True), ("zero3", False, False),
                               ("zero3 bf16", True, False)):
        folder = f"{out}.{name.replace(' resumed', '')}"
        half = args(folder, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                    train_sampling_strategy="sequential", bf16=bf16,
                    max_grad_norm=0.5 if bf16 else 1.0,
                    save_strategy="steps" if bf16 else "no", save_steps=2)
        trainer = FxpipeTrainer(model=tiny_llama(), args=half, train_dataset=Rows(),
                                devices=["cpu", "cpu"], data_parallel=name.split()[0])
        trainer.train(resume_from_checkpoint=f"{folder}/checkpoint-2" if resume else None)
        pipe = trainer._fxpipe_train_pipe
        assert pipe._dp.on_devices and pipe._dp.shard, "not reduced on the devices"
        got[name] = {"losses": losses(trainer), "state": pipe.full_state_dict(),
                     "norms": [h["grad_norm"] for h in trainer.state.log_history
                               if "grad_norm" in h]}
        trainer.close_pipes()
    if torch.distributed.get_rank() == 0:
        torch.save(got, out)
    torch.distributed.destroy_process_group()   # what a finished job does: exit 0


if __name__ == "__main__":
    main(sys.argv[1])
