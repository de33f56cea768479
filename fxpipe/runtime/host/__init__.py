"""Host memory: where the model lives between calls, and what moves to and from devices.

Imports ``runtime.devices`` only.

- ``params``: :class:`HostParams`, the model's parameters and buffers as views of one
  flat host buffer per dtype (pinned when asked); scratch buffers marked.
- ``param_store``: :class:`ParamStore`, an Executable's stages as slices of HostParams:
  uploaded, released, their gradients back.
- ``grad_accum``: :class:`GradAccumulator`, a call's downloaded gradients summed and
  added to ``.grad`` at once (or dropped when a call fails); which stage owns which
  final gradient.
- ``weights``: safetensors weights memory-mapped (``compile(weights=PATH)``); ``shards``:
  checkpoint shards on disk.
- ``buckets``: data parallel's gradient buckets and shards, and resharding;
  ``masters``: sharded fp32 masters under ``param_dtype``.
- ``scratch``: a call's scratch buffers (a KV cache): each microbatch's rows, the
  positions written, the buffers kept resident on devices.

A new host-memory tier (NVMe, another node's memory): start at ``params.py`` (what the
model's tensors are views of) and ``param_store.py`` (what an upload reads).
"""
