"""Integrations with the stacks people already train with.

- ``fxpipe.integrations.transformers``: ``FxpipeTrainer``, a ``transformers.Trainer``
  subclass training through a pipe (TRL's trainers on top: ``fxpipe_trainer``).

Nothing here is imported by ``import fxpipe``: each submodule imports its library
(``transformers``, ``trl``) when it is imported itself (``pip install fxpipe[hf]``).
"""
