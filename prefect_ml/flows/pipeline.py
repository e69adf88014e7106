"""``ml_pipeline``: the whole job; an optional campaign first, then the training chain, then
optionally serving the alias's version."""

from __future__ import annotations

from prefect import flow, get_run_logger

from prefect_ml.flows.sweep import hpo_campaign
from prefect_ml.flows.train import TrainingOutcome, on_one_ray, training_chain
from prefect_ml.tasks.params import PipelineParams, with_trial_values
from prefect_ml.tasks.placement import check_placement
from prefect_ml.tasks.report import published_timeline
from prefect_ml.tasks.serve import ServingResult, serve

__all__ = ["PipelineOutcome", "ml_pipeline"]


class PipelineOutcome(TrainingOutcome):
    """The training chain's outcome and, when the pipeline serves, where the model answers."""

    serving: ServingResult | None = None


@flow(name="ml-pipeline")
def ml_pipeline(params: PipelineParams = PipelineParams()) -> PipelineOutcome:  # noqa: B008
    """Prepare data, (search hyperparameters,) train on Ray, evaluate, register, promote and
    (serve).

    Args:
        params: The data, model, training and registry sections; add a sweep section to search
            hyperparameters first, and a serving section to serve the result.
    """
    with published_timeline("ml-pipeline"), on_one_ray(params):
        if params.sweep is not None:
            check_placement(params)  # the final training and serving too, not after the campaign
            result = hpo_campaign(params.campaign())
            best = result.best[0]  # with several objectives: the Pareto trial best on the first
            get_run_logger().info(
                "Training the final model with trial %d's values: %s", best.number, best.tuned
            )
            params = with_trial_values(params, best.tuned)
        outcome = training_chain(params)
        served = None
        if params.serving is not None:
            registry = params.registry
            served = serve(registry.model_name, alias=registry.alias, serving=params.serving)
        return PipelineOutcome(**dict(outcome), serving=served)
