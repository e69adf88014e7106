"""``train_model``: preprocess -> train on Ray -> evaluate -> register, as one Prefect flow."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from prefect import flow
from pydantic import BaseModel

from prefect_ml.integrations import services, storage
from prefect_ml.integrations.compute import ray_session
from prefect_ml.integrations.settings import get_settings
from prefect_ml.tasks.data import PreparedData, inspect_data, preprocess
from prefect_ml.tasks.evaluate import Evaluation, evaluate
from prefect_ml.tasks.params import TrainingSections, TrainModelParams, section_options
from prefect_ml.tasks.placement import check_placement
from prefect_ml.tasks.quotas import apply_ray_slots, check_caps, tenant_tags
from prefect_ml.tasks.register import Registration, register
from prefect_ml.tasks.report import published_timeline
from prefect_ml.tasks.reuse import reuse_finished
from prefect_ml.tasks.train import TrainResult, train
from prefect_ml.tasks.training import training_lease

__all__ = ["TrainingOutcome", "train_model"]


class TrainingOutcome(BaseModel):
    """Everything a training chain produced, as small serialisable pieces."""

    data: PreparedData
    trained: TrainResult
    evaluation: Evaluation
    registration: Registration


@contextlib.contextmanager
def on_one_ray(params: BaseModel) -> Iterator[None]:
    """What a flow run checks first, with no Ray (its storage, whose credentials a local Ray's
    workers then inherit, and the tenant's caps), then one Ray session that every step of the
    run shares. A run outside the CLI (a deployment's, on a worker) started and stopped a local
    Ray at each step before: three times in train-model, 6-8 s each on a quiet machine."""
    settings = get_settings()
    storage.prepare_storage(settings)
    check_caps(params)
    with ray_session(settings):
        yield


def prepared_data(params: TrainingSections) -> PreparedData:
    """Check the cluster's room, set the tenant's quota, inspect the data, then prepare the
    splits (reused when already prepared for that fingerprint). Every flow runs it first,
    inside :func:`on_one_ray`, so storage problems and impossible resource requests surface
    before any compute."""
    settings = get_settings()
    check_placement(params)
    apply_ray_slots(settings)
    inspect_data(params)
    data = preprocess(**section_options(params.data))
    services.mark("data ready")
    return data


def training_chain(params: TrainModelParams) -> TrainingOutcome:
    """The steps shared by ``train_model`` and ``ml_pipeline``, from the public tasks; runs
    inside either flow. A training whose identity already has a finished, registered run is
    not done again (unless ``training.force``): that run's outcome is returned."""
    data = prepared_data(params)
    registry = params.registry
    # One driver per run from training until the run is finished by its registration: a second
    # identical command started meanwhile would otherwise reopen the RUNNING run and register again.
    with training_lease(params, data.fingerprint) as lease:
        done = None if params.training.force else reuse_finished(params, data)
        if done is not None:
            return TrainingOutcome(
                data=data,
                trained=done.trained,
                evaluation=done.evaluation,
                registration=done.registration,
            )
        with tenant_tags():  # the tenant's quota counts its Ray-occupying tasks
            trained = train(data, params)
        services.mark("trained")
        evaluation = evaluate(trained)
        services.mark("evaluated")
        lease.ensure_held()
        registration = register(
            trained,
            evaluation,
            model_name=registry.model_name,
            alias=registry.alias,
            **registry.promotion(data.problem),
        )
        services.mark("registered")
    return TrainingOutcome(
        data=data, trained=trained, evaluation=evaluation, registration=registration
    )


@flow(name="train-model")
def train_model(params: TrainModelParams = TrainModelParams()) -> TrainingOutcome:  # noqa: B008
    """Train a model on Ray, evaluate it, register it and promote it if it beats the champion.

    Args:
        params: The data, model, training and registry sections.
    """
    with published_timeline("train-model"), on_one_ray(params):
        return training_chain(params)
