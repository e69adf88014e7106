"""Ray Train v2: the ``TorchTrainer`` that runs :mod:`integrations.epoch_trainer` on every
worker (DDP or FSDP over gloo or NCCL, elastic groups, restarts from the last checkpoint).

Per-epoch metrics travel in the checkpoints the workers commit, not in Ray's reports.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from prefect_ml.integrations import collectives, storage, tracking
from prefect_ml.integrations.epoch_trainer import EpochTrainer, TrainLoopConfig, train_epochs

if TYPE_CHECKING:
    from prefect_ml.integrations.resources import ResourceRequest

# Epoch at which the latest worker group started: > 1 after a restart from a checkpoint.
STARTED_AT_TAG = "prefect_ml.worker_group_started_at_epoch"
WORLD_SIZE_TAG = "prefect_ml.worker_group_size"  # workers of the latest group (elastic runs vary)
PEAK_MEMORY_TAG = "prefect_ml.peak_memory"  # what the peak_memory_mib metric measures
WORKER_NODES_TAG = "prefect_ml.worker_nodes"  # each rank's node address, latest group, by rank
# When the latest group's workers had built the model, restored and opened their data (unix s).
WORKER_GROUP_READY_TAG = "prefect_ml.worker_group_ready_unix"


def worker_nodes() -> list[str]:
    """Every rank's node address, in rank order (one gather when the group starts)."""
    import ray

    return collectives.gather_strings(ray.util.get_node_ip_address())


def train_loop_per_worker(config_dict: dict[str, Any]) -> None:
    """One Ray Train worker: resume from the newest verified checkpoint (mid-epoch ones at
    the step after it), then train epochs until the last one, a stop request, or early
    stopping (``epoch_trainer.train_epochs``: checkpoints every epoch within the checkpoint
    budget, and at the configured step or seconds cadence)."""
    import ray.train
    import ray.train.torch

    config = TrainLoopConfig(**config_dict)
    context = ray.train.get_context()
    trainer = EpochTrainer(
        config,
        rank=context.get_world_rank(),
        world_size=context.get_world_size(),
        device=ray.train.torch.get_device(),
        prepare_model=ray.train.torch.prepare_model,
    )
    nodes = worker_nodes()
    if trainer.rank == 0 and config.run_id:
        tracking.set_tags(
            tracking.client_for(tracking.worker_uri(config.tracking_uri)),
            config.run_id,
            {
                STARTED_AT_TAG: str(trainer.first_epoch),
                WORLD_SIZE_TAG: str(trainer.world_size),
                PEAK_MEMORY_TAG: trainer.peak_memory_kind,
                WORKER_NODES_TAG: ",".join(nodes),
                WORKER_GROUP_READY_TAG: str(time.time()),
            },
        )
    train_epochs(trainer)  # checkpoints every epoch within the checkpoint budget
    # Per-epoch metrics travel in the checkpoints. Ray Train v2's report() blocks until its
    # controller polls (every 2 s), which would dominate short epochs: Ray gets one final report.
    ray.train.report({"epoch": config.epochs})


def fit(
    config: TrainLoopConfig,
    *,
    workers: int | tuple[int, int],
    request: ResourceRequest,
    max_failures: int,
    ray_storage_url: str,
    name: str,
    collective_timeout_s: int = 1800,
    elastic_resize_s: float = 60.0,
) -> None:
    """Run ``train_loop_per_worker`` on Ray Train workers (DDP or FSDP over gloo or NCCL).

    ``workers`` as ``(min, max)`` makes the group elastic: it starts with as many as can be
    placed (at least ``min``), after losing a worker restarts from the last checkpoint with the
    workers still placeable, and while healthy below ``max`` looks for room every
    ``elastic_resize_s`` seconds, restarting bigger from the last checkpoint when it finds some.
    A collective that waits longer than ``collective_timeout_s`` (a hung or lost peer) fails
    the group instead of hanging it.
    """
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from prefect_ml.integrations import devices

    use_gpu = request.gpus > 0
    # Ray Train adds the accelerator resource itself from ``accelerator_type``.
    resources = {
        k: v
        for k, v in request.ray_resources().items()
        if v and not k.startswith("accelerator_type:")
    }
    storage_path, storage_filesystem = storage.ray_storage(ray_storage_url)
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config=asdict(config),
        torch_config=TorchConfig(
            backend=devices.collective_backend(use_gpu), timeout_s=collective_timeout_s
        ),
        scaling_config=ScalingConfig(  # type: ignore[call-arg]  # the stub is Ray Train v1's
            num_workers=workers,  # type: ignore[arg-type]  # Ray's stub omits the elastic tuple
            use_gpu=use_gpu,
            resources_per_worker=resources,
            accelerator_type=request.accelerator_type,
            elastic_resize_monitor_interval_s=elastic_resize_s,
        ),
        run_config=RunConfig(
            name=name,
            storage_path=storage_path,
            storage_filesystem=storage_filesystem,
            failure_config=FailureConfig(max_failures=max_failures),
        ),
    )
    trainer.fit()
