"""The ``devices=`` argument of ``fxpipe.compile`` as :class:`~fxpipe.runtime.devices.device.Device`
objects (:func:`resolve_devices`), and the GPUs ``devices=None`` takes under torchrun
(:func:`local_gpus`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import torch

from fxpipe.runtime.devices.cuda import CudaDevice
from fxpipe.runtime.devices.device import Device
from fxpipe.runtime.devices.emulator import VirtualDevice


def resolve_devices(devices: Sequence[str | torch.device | Device] | str | torch.device | Device
                    | None = None) -> list[Device]:
    """Turn the ``devices=`` argument of ``fxpipe.compile`` into Device objects.

    ``None``: the visible GPUs (under torchrun with several ranks on the node, this rank's
    share: :func:`local_gpus`), or two VirtualDevices without one. ``"cpu"``: one
    VirtualDevice (per entry). ``"cuda:1"`` / ``torch.device``: a CudaDevice. Device
    instances pass through.

    >>> [d.name for d in resolve_devices(["cpu", "cpu"])]
    ['vcpu:0', 'vcpu:1']
    """
    if devices is None:
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count:
            return [CudaDevice(i) for i in local_gpus(count)]
        return [VirtualDevice(name="vcpu:0"), VirtualDevice(name="vcpu:1")]
    if isinstance(devices, (str, torch.device, Device)):
        devices = [devices]
    if isinstance(devices, int):   # a count is not a list of devices
        raise TypeError(f"devices={devices!r}: pass the devices, not their number: "
                        f"[f'cuda:{{i}}' for i in range({devices})] for GPUs, ['cpu'] * {devices} "
                        "for virtual devices, or None for every visible GPU")
    out: list[Device] = []
    for i, entry in enumerate(devices):
        where = f"devices[{i}]={entry!r}"
        if isinstance(entry, Device):
            device = entry
        elif isinstance(entry, (str, torch.device)):
            try:
                spec = torch.device(entry)
            except RuntimeError as e:
                raise ValueError(f"{where} is not a device string: use 'cpu' or 'cuda:N' ({e})") from None
            if spec.type == "cpu":
                device = VirtualDevice(name=f"vcpu:{sum(isinstance(d, VirtualDevice) for d in out)}")
            elif spec.type == "cuda":
                device = CudaDevice(spec.index)
            else:
                raise ValueError(f"{where}: fxpipe runs on 'cpu' (virtual devices) or 'cuda:N', "
                                 f"not {spec.type!r}")
        else:
            raise ValueError(f"{where}: expected 'cpu', 'cuda:N', a torch.device or an "
                             f"fxpipe.Device, got {type(entry).__name__}")
        if any(d is device or (isinstance(d, CudaDevice) and d.name == device.name) for d in out):
            raise ValueError(f"{where}: {device.name} is listed twice; list each device once")
        out.append(device)
    if not out:
        raise ValueError("devices is empty: pass None (auto), ['cpu'], or a list of 'cuda:N'")
    return out


def local_gpus(count: int, env: Mapping[str, str] | None = None) -> list[int]:
    """The GPU indices ``devices=None`` takes of ``count`` visible ones: all of them, or
    under torchrun with ``LOCAL_WORLD_SIZE`` ranks on this node (``env``: the process's
    environment) rank ``LOCAL_RANK``'s contiguous share, ``count // LOCAL_WORLD_SIZE``
    each (DDP's habit ``--nproc-per-node=8`` on 8 GPUs: one each, not eight ranks on
    every GPU with eight host copies of the model).

    >>> local_gpus(8, {}), local_gpus(8, {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"})
    ([0, 1, 2, 3, 4, 5, 6, 7], [4, 5, 6, 7])
    """
    env = os.environ if env is None else env
    ranks = int(env.get("LOCAL_WORLD_SIZE", "1") or 1)
    if ranks <= 1 or "LOCAL_RANK" not in env:
        return list(range(count))
    rank = int(env["LOCAL_RANK"])
    if count < ranks:
        raise ValueError(
            f"{ranks} ranks on this node (LOCAL_WORLD_SIZE) share {count} visible GPU(s): "
            f"devices=None gives each rank GPUs of its own. Start at most {count} rank(s) per "
            "node (torchrun --nproc-per-node), or pass devices= explicitly (each rank its own)")
    per = count // ranks
    return list(range(rank * per, (rank + 1) * per))
