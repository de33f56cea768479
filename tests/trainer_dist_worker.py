"""One rank of ``tests/test_trainer.py::test_two_ranks_torchrun`` (run by torchrun):
FxpipeTrainer on this rank's share of every batch; rank 0 writes the loss history and
the final weights to ``argv[1]``."""

import sys

import torch

from fxpipe.integrations.transformers import FxpipeTrainer
from tests.test_trainer import Rows, args, losses, tiny_llama


def main(out: str) -> None:
    half = args(out + ".run", per_device_train_batch_size=2, gradient_accumulation_steps=2,
                train_sampling_strategy="sequential")
    trainer = FxpipeTrainer(model=tiny_llama(), args=half, train_dataset=Rows(),
                            devices=["cpu", "cpu"])
    trainer.train()
    pipe = trainer._fxpipe_train_pipe
    assert pipe is not None and pipe._dp is not None, "the training pipe is not data parallel"
    if torch.distributed.get_rank() == 0:
        torch.save({"losses": losses(trainer), "state": trainer.model.state_dict()}, out)
    trainer.close_pipes()
    torch.distributed.destroy_process_group()   # what a finished job does: exit 0


if __name__ == "__main__":
    main(sys.argv[1])
