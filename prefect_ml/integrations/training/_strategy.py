"""The strategy: a worker's model wrapped for data-parallel or model-parallel training.

``ddp`` (Ray Train's ``prepare_model``), ``fsdp`` (FSDP2's ``fully_shard``), ``tp`` and ``pp``
over a ``(dp, tp|pp)`` device mesh (:mod:`integrations.training`). A model with its own
steps (:mod:`integrations.training`) trains its step module under DDP, and its checkpoints hold
the model's own state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prefect_ml.integrations.training import _hooks, _model_parallel

if TYPE_CHECKING:
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    from prefect_ml.integrations.config import TrainingParams


def apply_strategy(
    model: torch.nn.Module,
    strategy: str,
    device: torch.device,
    prepare_ddp: Any,
    *,
    mesh: DeviceMesh | None = None,
) -> torch.nn.Module:
    """``model`` on ``device``, wrapped for data-parallel training by ``strategy``.

    ``fsdp`` shards every top-level child that holds parameters, then the root, with FSDP2's
    ``fully_shard`` over all workers (gloo on CPU, NCCL on GPUs); ``ddp`` uses ``prepare_ddp``
    (Ray Train's ``prepare_model``). ``tp`` and ``pp`` split the model over the ``(dp, tp|pp)``
    ``mesh`` (:mod:`integrations.training`): tensor-parallel layers, or this rank's
    pipeline stage, FSDP2-sharded over ``dp``. Outside a process group the model trains
    unwrapped.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return model.to(device)
    if strategy == "tp" and mesh is not None:
        return _model_parallel.parallelize_tensors(model.to(device), mesh)
    if strategy == "pp" and mesh is not None:
        return _model_parallel.pipeline_stage_module(model, mesh, device)
    if strategy == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        model = model.to(device)
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        for child in model.children():
            if next(child.parameters(), None) is not None:
                fully_shard(child, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    return prepare_ddp(model) if prepare_ddp else model.to(device)


@dataclass(frozen=True)
class Wrapped:
    """A worker's model as it trains."""

    model: torch.nn.Module  # what a training step calls (a hooked model's: its step module)
    network: torch.nn.Module  # what forward() runs: validation, evaluation and serving
    state_module: torch.nn.Module  # what checkpoints hold
    pipeline: _model_parallel.Pipeline | None  # pp: this rank's stage


def wrap(
    model: torch.nn.Module,
    training: TrainingParams,
    layout: _model_parallel.MeshLayout,
    device: torch.device,
    prepare_model: Any,
    *,
    loss: Any,
) -> Wrapped:
    """``model`` wrapped by ``training.strategy`` over ``layout`` (a hooked model: its steps
    under DDP); ``loss`` is what a pipeline's last stage computes."""
    if _hooks.is_hooked(model):  # DDP wraps the steps; checkpoints hold the network's own state
        model.to(device)  # a LightningModule's own .to() keeps its self.device right
        steps = apply_strategy(_hooks.step_module(model), "ddp", device, prepare_model)
        return Wrapped(steps, model, model, None)
    _model_parallel.check_precision(training)
    mesh = layout.build(device) if layout.model_parallel > 1 else None
    wrapped = apply_strategy(model, training.strategy, device, prepare_model, mesh=mesh)
    pipeline = None
    if training.strategy == "pp" and mesh is not None:
        pipeline = _model_parallel.Pipeline(
            wrapped,
            mesh,
            device,
            loss,
            microbatches=training.pipeline_microbatches,
            schedule=training.pipeline_schedule,
        )
    return Wrapped(wrapped, wrapped, wrapped, pipeline)
