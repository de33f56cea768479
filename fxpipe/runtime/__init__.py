"""The runtime: runs an ``Executable`` (``fxpipe.passes.stage``) and decides nothing.

Four rooms, each a package whose ``__init__`` is its map. A room imports only from the
rooms above it in this list (``tests/test_layers.py`` checks it):

``devices``
    The ``Device`` interface and its backends: a GPU (``cuda``), a GPU emulated on the
    CPU (``emulator``), events, device graphs, page-locked host memory and the issue
    lock. What a new device starts from.
``host``
    The host's memory of a model: its parameters in flat buffers (``params``), the
    slices a Program's stages upload (``param_store``), gradients accumulated into
    ``.grad``, safetensors weights and shards, data parallel's buckets and masters,
    scratch buffers (a KV cache). Imports ``devices``.
``stages``
    A lowered stage's code as it runs on a device: generated (``stage_code``), compiled
    per layer, or replayed as device graphs; the recompute's unfilled end, autocast,
    random states, measured layer times. Imports ``devices`` and ``host``.
``issue``
    One call: split into microbatches, its actions issued by threads walking the
    Program's lanes (``executor``, ``threads``), the compute handlers, the values a call
    holds, merged outputs and loss weights, eager-style autograd, traces, data
    parallel's collectives. Imports every room above.

Nothing here imports a compiler pass: only the values the passes make.
"""
