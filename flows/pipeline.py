"""``ml_pipeline``: the whole job; campaign and serving steps plug in around the training chain."""

from __future__ import annotations

from prefect import flow

from flows.train import TrainingOutcome, training_chain
from tasks.params import PipelineParams


@flow(name="ml-pipeline")
def ml_pipeline(params: PipelineParams = PipelineParams()) -> TrainingOutcome:  # noqa: B008
    """Prepare data, train on Ray, evaluate, register and promote: the end-to-end pipeline."""
    return training_chain(params)
