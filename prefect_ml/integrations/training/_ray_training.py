"""Ray Train v2: the ``TorchTrainer`` that runs :mod:`integrations.training` on every
worker (DDP or FSDP over gloo or NCCL, elastic groups, restarts from the last checkpoint).

Per-epoch metrics travel in the checkpoints the workers commit, not in Ray's reports.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prefect_ml.integrations import storage
from prefect_ml.integrations.compute import (
    PLACEMENT_NOTICE_S,
    PLACEMENT_REPEAT_S,
    describe_placement,
    free_per_node,
)
from prefect_ml.integrations.config.loop import TrainLoop
from prefect_ml.integrations.errors import TrainingCodeError
from prefect_ml.integrations.settings import get_settings
from prefect_ml.integrations.training import _collectives
from prefect_ml.integrations.training._loop import train_epochs
from prefect_ml.integrations.training._trainer import EpochTrainer

if TYPE_CHECKING:
    from ray.train import RunConfig, ScalingConfig

    from prefect_ml.integrations.config.resources import Resources

# Epoch at which the latest worker group started: > 1 after a restart from a checkpoint.
STARTED_AT_TAG = "prefect_ml.worker_group_started_at_epoch"
WORLD_SIZE_TAG = "prefect_ml.worker_group_size"  # workers of the latest group (elastic runs vary)
PEAK_MEMORY_TAG = "prefect_ml.peak_memory"  # what the peak_memory_mib metric measures
WORKER_NODES_TAG = "prefect_ml.worker_nodes"  # each rank's node address, latest group, by rank
# When the latest group's workers had built the model, restored and opened their data (unix s).
WORKER_GROUP_READY_TAG = "prefect_ml.worker_group_ready_unix"
# What each worker group's rank 0 records when it starts, and the driver copies to the run's tags.
WORKER_GROUP_TAGS = (
    STARTED_AT_TAG,
    WORLD_SIZE_TAG,
    PEAK_MEMORY_TAG,
    WORKER_NODES_TAG,
    WORKER_GROUP_READY_TAG,
)


def worker_nodes() -> list[str]:
    """Every rank's node address, in rank order (one gather when the group starts)."""
    import ray

    return _collectives.gather_strings(ray.util.get_node_ip_address())


def train_loop_per_worker(config: dict[str, TrainLoop]) -> None:
    """One Ray Train worker: resume from the newest verified checkpoint (mid-epoch ones at
    the step after it), then train epochs until the last one, a stop request, or early
    stopping (``training.train_epochs``: checkpoints every epoch within the checkpoint
    budget, and at the configured step or seconds cadence)."""
    import ray.train
    import ray.train.torch

    loop = config["loop"]
    context = ray.train.get_context()
    trainer = EpochTrainer(
        loop,
        rank=context.get_world_rank(),
        world_size=context.get_world_size(),
        device=ray.train.torch.get_device(),
        prepare_model=ray.train.torch.prepare_model,
    )
    nodes = worker_nodes()
    if trainer.rank == 0:  # the driver tags the run with it: workers never import MLflow
        trainer.store.record_worker_group(
            {
                STARTED_AT_TAG: str(trainer.first_epoch),
                WORLD_SIZE_TAG: str(trainer.world_size),
                PEAK_MEMORY_TAG: trainer.peak_memory_kind,
                WORKER_NODES_TAG: ",".join(nodes),
                WORKER_GROUP_READY_TAG: str(time.time()),
            }
        )
    train_epochs(trainer)  # checkpoints every epoch within the checkpoint budget
    # Per-epoch metrics travel in the checkpoints. Ray Train v2's report() blocks until its
    # controller polls (every 2 s), which would dominate short epochs: Ray gets one final report.
    ray.train.report({"epoch": loop.training.epochs})


@contextlib.contextmanager
def placement_watch(
    request: Resources,
    logger: logging.Logger | logging.LoggerAdapter[logging.Logger],
) -> Iterator[None]:
    """While a fit runs: a worker group that Ray has not placed ``PLACEMENT_NOTICE_S`` after
    asking is logged with what it asks and what each node has free, every
    ``PLACEMENT_REPEAT_S`` until placed,
    instead of a silent ``training 0/N``. The fit's group is a placement group that appeared
    after the watch began and is pending."""
    import ray.util

    before = set(ray.util.placement_group_table())
    stop = threading.Event()

    def watch() -> None:
        pending_since: dict[str, float] = {}
        last_notice = float("-inf")
        while not stop.wait(1.0):
            now = time.monotonic()
            pending = {
                pg_id: len(info["bundles"])
                for pg_id, info in ray.util.placement_group_table().items()
                if pg_id not in before and info["state"] == "PENDING"
            }
            pending_since = {pg: pending_since.get(pg, now) for pg in pending}
            waited = [pg for pg, t in pending_since.items() if now - t >= PLACEMENT_NOTICE_S]
            if waited and now - last_notice >= PLACEMENT_REPEAT_S:
                last_notice = now
                logger.warning(
                    "Ray has not placed the training worker group for %.0f s: %s. It waits "
                    "until the resources are free (PREFECT_ML_WORKER_GROUP_START_TIMEOUT_S, "
                    "then tries again).",
                    now - pending_since[waited[0]],
                    describe_placement(request.describe(), pending[waited[0]], free_per_node()),
                )

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def loop_config(loop: TrainLoop) -> dict[str, TrainLoop]:
    """``TorchTrainer``'s ``train_loop_config``: the loop itself, which Ray pickles to every
    worker (a dict, the type Ray Train's run state records)."""
    return {"loop": loop}


def fit(
    loop: TrainLoop,
    *,
    workers: int | tuple[int, int],
    request: Resources,
    max_failures: int,
    ray_storage_url: str,
    name: str,
    logger: logging.Logger | logging.LoggerAdapter[logging.Logger] | None = None,
) -> None:
    """Run ``train_loop_per_worker`` on Ray Train workers (DDP or FSDP over gloo or NCCL).

    ``workers`` as ``(min, max)`` makes the group elastic: it starts with as many as can be
    placed (at least ``min``), after losing a worker restarts from the last checkpoint with the
    workers still placeable, and while healthy below ``max`` looks for room every
    ``training.elastic_resize_s`` seconds, restarting bigger from the last checkpoint when it
    finds some. A collective that waits longer than ``training.collective_timeout_s`` (a hung
    or lost peer) fails
    the group instead of hanging it. A group that Ray cannot place at once is reported on
    ``logger`` (:func:`placement_watch`).

    Raises:
        TrainingCodeError: a worker's code raised an error that every retry meets again, or the
            group failed to start more than PREFECT_ML_CONTROLLER_FAILURE_LIMIT times in a row
            (:mod:`integrations.training`); other failures past ``max_failures`` raise
            Ray Train's own error.
    """
    from ray.train import ControllerError
    from ray.train.torch import TorchConfig, TorchTrainer

    from prefect_ml.integrations import compute

    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config=loop_config(loop),
        torch_config=TorchConfig(
            backend=compute.collective_backend(request.gpus > 0),
            timeout_s=loop.training.collective_timeout_s,
        ),
        scaling_config=scaling_config(loop, workers, request),
        run_config=run_config(loop, request, max_failures, ray_storage_url, name),
    )
    try:
        with placement_watch(request, logger or logging.getLogger(__name__)):
            trainer.fit()
    except ControllerError as exc:
        if isinstance(exc.controller_failure, TrainingCodeError):
            raise exc.controller_failure from exc
        raise


def scaling_config(
    loop: TrainLoop, workers: int | tuple[int, int], request: Resources
) -> ScalingConfig:
    """The worker group of :func:`fit`: ``workers`` workers (or an elastic ``(min, max)``)
    that each hold ``request``."""
    from ray.train import ScalingConfig

    return ScalingConfig(  # type: ignore[call-arg]  # the stub is Ray Train v1's
        num_workers=workers,  # type: ignore[arg-type]  # Ray's stub omits the elastic tuple
        **request.scaling_options(),
        elastic_resize_monitor_interval_s=loop.training.elastic_resize_s,
    )


def run_config(
    loop: TrainLoop,
    request: Resources,
    max_failures: int,
    ray_storage_url: str,
    name: str,
) -> RunConfig:
    """The run of :func:`fit`: named ``name``, its state under ``ray_storage_url``, restarted
    up to ``max_failures`` times, failed fast by :class:`~integrations.training.FailFast`
    on an error of the model's code."""
    from ray.train import FailureConfig, RunConfig

    from prefect_ml.integrations.training._train_failures import FailFast

    storage_path, storage_filesystem = storage.ray_storage(ray_storage_url)
    return RunConfig(
        name=name,
        storage_path=storage_path,
        storage_filesystem=storage_filesystem,
        failure_config=FailureConfig(max_failures=max_failures),
        # The stub types callbacks as Ray Train v1's (Ray Tune's) Callback.
        callbacks=[
            FailFast(  # type: ignore[list-item]
                code=f"the model {loop.model.model}",
                request=request.describe(),
                start_failure_limit=get_settings().controller_failure_limit,
                max_failures=max_failures,
            )
        ],
    )
