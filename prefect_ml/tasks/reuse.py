"""Skip what is already done: a training whose identity (``TrainingSections.run_key``: data
fingerprint, recipe, model, training values) already has a FINISHED MLflow run with a registered
version is not trained, evaluated or registered again; its outcome is returned instead.
``--force`` (``TrainingParams.force``) trains a new run."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel

from prefect_ml.integrations import storage, tracking
from prefect_ml.integrations.settings import get_settings
from prefect_ml.integrations.storage import CheckpointStore
from prefect_ml.integrations.training import training_end
from prefect_ml.tasks.data import PreparedData
from prefect_ml.tasks.evaluate import Evaluation
from prefect_ml.tasks.params import TrainModelParams
from prefect_ml.tasks.register import Registration, publish_summary_artifacts
from prefect_ml.tasks.training import (
    RESUMED_FROM_TAG,
    TrainResult,
    current_flow_run_id,
    train_result,
)

__all__ = ["FinishedTraining", "finished_training", "reuse_finished"]


class FinishedTraining(BaseModel):
    """An earlier run's outcome, as the training chain would have produced it."""

    trained: TrainResult
    evaluation: Evaluation
    registration: Registration


def _trained(
    params: TrainModelParams, data: PreparedData, run: tracking.RegisteredRun
) -> TrainResult | None:
    """The run's :class:`TrainResult`, read from its verified checkpoints; None if they are gone."""
    settings = get_settings()
    checkpoint_url = storage.run_checkpoint_url(
        storage.root_url(settings), run.experiment_id, run.run_id
    )
    store = CheckpointStore(checkpoint_url)
    training = params.training
    end = training_end(store, store.latest(), training.early_stopping(), training.epochs)
    if end is None:
        return None
    return train_result(
        params,
        data,
        end,
        run_id=run.run_id,
        experiment_id=run.experiment_id,
        checkpoint_url=checkpoint_url,
        resumed_from_epoch=int(run.tags.get(RESUMED_FROM_TAG, "0")),
        reused=True,
    )


def _registration(run: tracking.RegisteredRun, model_name: str, alias: str) -> Registration:
    """The run's registered version, and where the alias is now; nothing was promoted."""
    client = tracking.client_for(get_settings().resolved_tracking_uri)
    current = tracking.champion(client, model_name, alias)
    holder = current[0] if current else None
    where = (
        f"v{run.version} holds @{alias}"
        if holder == run.version
        else (f"@{alias} is on v{holder}" if holder else f"no version holds @{alias}")
    )
    return Registration(
        model_name=run.model_name,
        version=run.version,
        model_uri=f"models:/{run.model_name}/{run.version}",
        alias=alias,
        promoted=False,
        reason=f"reused MLflow run {run.run_id}, which already trained this identity and "
        f"registered v{run.version}; nothing was trained, evaluated or registered again "
        f"(pass --force to train a new run); {where}",
        previous_champion=holder,
    )


def finished_training(params: TrainModelParams, data: PreparedData) -> FinishedTraining | None:
    """The outcome of the newest FINISHED run of this training's identity that registered a
    version of the registry's model, or None when there is none (or its checkpoints are gone).

    The evaluation is the run's logged test metrics (no confusion matrix: it is an artifact
    of the run), the registration the version it registered.
    """
    settings = get_settings()
    client = tracking.client_for(settings.resolved_tracking_uri)
    registry = params.registry
    run_key = params.run_key(data.fingerprint)
    run = tracking.registered_run(client, params.experiment, run_key, registry.model_name)
    if run is None:
        return None
    trained = _trained(params, data, run)
    if trained is None:
        get_run_logger().warning(
            "MLflow run %s registered %s v%s, but its checkpoints are gone: training again",
            run.run_id,
            run.model_name,
            run.version,
        )
        return None
    test_metrics = {
        name: run.metrics[f"test_{name}"]
        for name in data.problem.test_metrics
        if f"test_{name}" in run.metrics
    }
    return FinishedTraining(
        trained=trained,
        evaluation=Evaluation(metrics=test_metrics),
        registration=_registration(run, registry.model_name, registry.alias),
    )


@task(name="reuse-finished-run", cache_policy=NO_CACHE)
def reuse_finished(params: TrainModelParams, data: PreparedData) -> FinishedTraining | None:
    """The outcome of the finished, registered run of this training's identity, if any, with
    the flow run's summary artifacts saying which run and version it reused."""
    done = finished_training(params, data)
    if done is not None:
        registration = done.registration
        get_run_logger().info(
            "Reusing MLflow run %s and %s v%s (already trained and registered; --force trains "
            "a new run)",
            done.trained.run_id,
            registration.model_name,
            registration.version,
        )
        publish_summary_artifacts(done.trained, done.evaluation, registration)
        client = tracking.client_for(get_settings().resolved_tracking_uri)
        tracking.record_flow_run(client, done.trained.run_id, current_flow_run_id(), "reuse")
    return done
