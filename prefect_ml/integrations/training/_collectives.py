"""Every ``torch.distributed`` collective of the project, on the device its process group serves.

A backend serves certain device types: NCCL only CUDA tensors, gloo CPU (and CUDA) tensors. A
collective on a tensor of another device fails ("No backend type associated with device type
cpu") — on a GPU cluster, at the end of the first epoch, after the work is done. So the device
is checked once, when a worker joins its group, and every collective builds its tensor on the
worker's device. Outside a process group the functions compute the one-worker answer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

from prefect_ml.integrations.errors import ConfigurationError

if TYPE_CHECKING:
    import torch


def in_process_group() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def served_device_types(backend_config: str) -> set[str]:
    """Device types of a backend configuration as torch writes it (``"cpu:gloo,cuda:nccl"``);
    a bare backend name (``"nccl"``) serves the devices torch registers it for."""
    import torch.distributed as dist

    served = set()
    for entry in backend_config.split(","):
        device_type, _, backend = entry.strip().rpartition(":")
        if device_type:
            served.add(device_type)
        else:
            served.update(dist.Backend.backend_capability.get(backend.lower(), []))
    return served


def check_group_device(device: torch.device) -> None:
    """Refuse, before any compute, a worker whose device its process group cannot reduce on."""
    import torch.distributed as dist

    if not in_process_group():
        return
    config = dist.get_backend_config()
    if device.type not in served_device_types(config):
        raise ConfigurationError(
            "training.use_gpu",
            f"this worker trains on {device} but its process group ({config}) reduces only "
            f"{sorted(served_device_types(config))} tensors; GPU workers need --use-gpu with "
            "a CUDA build of torch (NCCL), CPU workers gloo",
        )


def all_reduce(
    values: Sequence[float | torch.Tensor],
    device: torch.device,
    op: Literal["sum", "max"] = "sum",
) -> list[float]:
    """``values`` (numbers or scalar tensors on ``device``) summed or maxed over all workers.

    The values travel as one float64 tensor on ``device``: one collective and one host sync,
    whatever their number.
    """
    import torch
    import torch.distributed as dist

    tensor = torch.stack(
        [torch.as_tensor(value, dtype=torch.float64, device=device) for value in values]
    )
    if in_process_group():
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
    return tensor.tolist()  # type: ignore[no-any-return]


def all_gather(values: Sequence[float | torch.Tensor], device: torch.device) -> list[list[float]]:
    """Every worker's ``values`` (the same count on each), in rank order: one collective and
    one host sync, whatever their number; ``[values]`` outside a process group."""
    import torch
    import torch.distributed as dist

    tensor = torch.stack(
        [torch.as_tensor(value, dtype=torch.float64, device=device) for value in values]
    )
    if not in_process_group():
        return [tensor.tolist()]
    gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, tensor)
    return torch.stack(gathered).tolist()  # type: ignore[no-any-return]


def any_worker(flag: bool, device: torch.device) -> bool:
    """Whether ``flag`` is true on at least one worker; every worker gets the same answer."""
    return all_reduce([1.0 if flag else 0.0], device, op="max")[0] > 0


def gather_strings(value: str) -> list[str]:
    """Every worker's ``value``, in rank order (objects travel pickled, on the CPU; gloo and
    NCCL groups both carry them); ``[value]`` outside a process group."""
    import torch.distributed as dist

    if not in_process_group():
        return [value]
    gathered: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return [str(item) for item in gathered]


def gather_to_first(value: Any, group: Any) -> list[Any] | None:
    """Every rank's ``value`` (any picklable object) on rank 0 of ``group``, in rank order;
    None on the other ranks. Objects travel pickled on the CPU: ``group`` is a gloo group
    (the checkpoint group of ``integrations.training``)."""
    import torch.distributed as dist

    gathered = [None] * dist.get_world_size(group) if dist.get_rank(group) == 0 else None
    dist.gather_object(value, gathered, group=group, group_dst=0)
    return gathered
