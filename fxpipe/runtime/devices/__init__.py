"""Devices: where work runs, and the host memory a device copies from without blocking.

Imports no other room of the runtime.

- ``device``: :class:`Device`, the interface every backend implements (streams, submit,
  copies, byte accounting, a memory limit); ``InlineDevice``'s base.
- ``events``: :class:`Event`, one piece of submitted work's completion.
- ``cuda``: :class:`CudaDevice`, a GPU's streams, events and copies (short enough to
  audit in one sitting).
- ``emulator``: :class:`VirtualDevice` (a GPU emulated on the CPU, ``semantics="cuda"``:
  the strict emulator) and :class:`InlineDevice`; ``emulator_alloc``: its caching
  allocator; ``emulator_threads``: its worker threads and counting mode.
- ``device_graph``: a function recorded once and replayed (``Device.capture``).
- ``pinned``: page-locked host memory at its exact size (the pools copies use).
- ``issue_lock``: the lock one issue thread holds to run an action's Python, and
  ``blocking`` for host work that lets go of it.
- ``resolve``: ``compile``'s ``devices=`` as Device objects; a torchrun rank's GPUs.

A new device: implement :class:`~fxpipe.runtime.devices.device.Device` (read
``cuda.py`` for the smallest real one, ``emulator.py`` for the rules it must keep), and
accept it in ``resolve.py``.
"""
