"""The commands that run a flow and print its summary: ``run``, ``train``, ``sweep``,
``predict``."""

from __future__ import annotations

from typing import Any

import click

from prefect_ml.flows.cli._flags import (
    nested_parameters,
    parameter_flags,
    parse_parameters,
    validated,
)
from prefect_ml.flows.cli._flow_runs import run_flow, stop_on_signals
from prefect_ml.flows.cli._output import print_campaign, print_outcome, print_predictions
from prefect_ml.flows.cli._serve import check_serving_ports, serve_in_foreground
from prefect_ml.integrations.settings import get_settings
from prefect_ml.tasks.params import (
    CampaignParams,
    PipelineParams,
    PredictParams,
    TrainModelParams,
)


@click.command()
@parameter_flags(PipelineParams)
@click.option(
    "--serve",
    "serve_after",
    is_flag=True,
    help="End by serving the alias's version on Ray Serve, in the foreground until Ctrl-C.",
)
def run(serve_after: bool, **flags: Any) -> None:
    """Run the whole pipeline (ml_pipeline); any sweep flag (--campaign, --n-trials, ...) adds
    a campaign whose best values train the final model; --serve (or any serving flag) serves it."""
    nested = nested_parameters(PipelineParams, flags)
    if serve_after:
        nested.setdefault("serving", {})
    params = validated(PipelineParams, nested)
    if params.serving is None:
        print_outcome(run_flow("ml_pipeline", params))
        return
    from prefect_ml.integrations.compute import ray_session

    stop_on_signals()
    check_serving_ports()
    with ray_session(get_settings()):  # the flow's steps share it; it outlives the flow
        outcome = run_flow("ml_pipeline", params)
        print_outcome(outcome)
        serve_in_foreground(outcome.serving.app_name, None, 0)  # its name in the tenant's


@click.command()
@parameter_flags(TrainModelParams)
def train(**flags: Any) -> None:
    """Train, evaluate and register one model (train_model)."""
    print_outcome(run_flow("train_model", parse_parameters(TrainModelParams, flags)))


@click.command()
@parameter_flags(CampaignParams)
def sweep(**flags: Any) -> None:
    """Run or continue a hyperparameter campaign (hpo_campaign); same name = same study."""
    print_campaign(run_flow("hpo_campaign", parse_parameters(CampaignParams, flags)))


@click.command()
@parameter_flags(PredictParams)
def predict(**flags: Any) -> None:
    """Score a dataset's files with a registered version (batch_predict) into Parquet."""
    print_predictions(run_flow("batch_predict", parse_parameters(PredictParams, flags)))
