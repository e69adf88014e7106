"""The training step: one MLflow run, trained data-parallel on Ray Train, resumable.

A thin task over :mod:`tasks.training` (the pre-flight check, :class:`TrainingRun`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from prefect_ml.integrations import training
from prefect_ml.integrations.compute import ray_session
from prefect_ml.integrations.services import RAY_TAG
from prefect_ml.integrations.settings import get_settings
from prefect_ml.tasks.data import PreparedData, params_on_data
from prefect_ml.tasks.params import TrainingSections
from prefect_ml.tasks.placement import check_placement
from prefect_ml.tasks.retries import transient_retries
from prefect_ml.tasks.training import TrainingRun, TrainResult, check_model, training_lease

__all__ = ["TrainResult", "train"]

if TYPE_CHECKING:
    import torch


def train_distributed(params: TrainingSections, data: PreparedData) -> TrainResult:
    """Train on Ray Train workers, resuming the unfinished run with the same identity if any.

    The run's lease is taken first: a second driver of the same run is refused before it
    reopens the MLflow run or touches its uploads, and is released on the way out (a Prefect
    retry in this process takes it again).
    """
    probe = check_model(params, data)
    shown = tuple(sorted(probe.prog_bar)) if probe else ()
    with training_lease(params, data.fingerprint) as lease:
        return TrainingRun(params, data, lease, shown).run()


def trained_model(trained: TrainResult) -> torch.nn.Module:
    """The model of the run's best verified checkpoint (``best_epoch``), in eval mode."""
    model, _epoch = training.load_trained_model(
        trained.checkpoint_url,
        trained.model.model,
        trained.data.sample_shape,
        trained.data.num_classes,
        trained.model.factory_options(),
        epoch=trained.best_epoch,
    )
    return model


@task(name="train", cache_policy=NO_CACHE, tags=[RAY_TAG, "training"], **transient_retries())
def train(
    data: PreparedData,
    params: TrainingSections | None = None,
    *,
    experiment: str = "prefect-ml",
    **options: Any,
) -> TrainResult:
    """Train a model data-parallel on Ray Train workers, tracked as one MLflow run.

    Checkpoints are written (verified) every epoch; running the same training again (same
    experiment, data and options that shape the result) resumes that run from its last
    checkpoint instead of starting over.

    Args:
        data: what :func:`~prefect_ml.preprocess` returned.
        params: the experiment and the model and training sections, as the flows pass them
            (:class:`~prefect_ml.tasks.params.TrainingSections`); or, instead:
        experiment: the MLflow experiment.
        **options: any field of the model and training sections
            (:class:`~prefect_ml.tasks.params.ModelParams`,
            :class:`~prefect_ml.tasks.params.TrainingParams`), e.g. ``model="mlp"`` or an
            allowed ``"my_pkg.models:build"``, ``hidden``, ``epochs``, ``workers`` (a number or
            ``(min, max)``), ``lr``, ``batch_size``, ``use_gpu``, ``precision``, ``strategy``.

    Returns:
        The finished run, for :func:`~prefect_ml.evaluate` and :func:`~prefect_ml.register`.

    Raises:
        ConfigurationError: an unknown or invalid option, or a request the cluster cannot
            place, before any compute.
    """
    params = params_on_data(
        TrainingSections, data, params, options, step="train", experiment=experiment
    )
    with ray_session(get_settings()):  # one Ray for the placement check and the training
        check_placement(params)
        return train_distributed(params, data)
