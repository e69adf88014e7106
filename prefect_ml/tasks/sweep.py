"""The campaign step: a thin Prefect task over :mod:`tasks.campaign` (identity, decisions,
view, results), and the campaign's summary artifact.
"""

from __future__ import annotations

from typing import Any

from prefect import task
from prefect.artifacts import create_link_artifact, create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from prefect_ml.integrations import tracking
from prefect_ml.integrations.compute import ray_session
from prefect_ml.integrations.services import RAY_TAG
from prefect_ml.integrations.settings import get_settings
from prefect_ml.tasks.campaign.results import CampaignResult, TrialSummary
from prefect_ml.tasks.campaign.run import run_campaign
from prefect_ml.tasks.campaign.view import slug
from prefect_ml.tasks.data import PreparedData, params_on_data
from prefect_ml.tasks.params import CampaignParams
from prefect_ml.tasks.placement import check_placement
from prefect_ml.tasks.retries import transient_retries

__all__ = ["CampaignResult", "TrialSummary", "campaign", "campaign_markdown"]


def campaign_markdown(result: CampaignResult, links: dict[int, str]) -> str:
    best_lines = "\n".join(
        f"- trial {b.number}: "
        + ", ".join(f"{k} = {v:.4f}" for k, v in b.values.items())
        + f" — params `{b.params}`"
        + (f" — [MLflow run]({links[b.number]})" if b.number in links else "")
        for b in result.best
    )
    title = "Pareto front" if len(result.objectives) > 1 else "Best trial"
    return f"""# Campaign `{result.campaign}`

| finished | complete | pruned | failed |
|---|---|---|---|
| {result.finished} | {result.complete} | {result.pruned} | {result.failed} |

## {title}
{best_lines}

Objectives: {", ".join(f"{k} ({v})" for k, v in result.objectives.items())}.
Plots (optimisation history, importances, parallel coordinates, intermediate values) are
artifacts of the campaign's MLflow run `{result.parent_run_id}`.
"""


@task(
    name="hpo-campaign",
    cache_policy=NO_CACHE,
    tags=[RAY_TAG, "campaign"],
    **transient_retries(),
)
def campaign(
    data: PreparedData,
    params: CampaignParams | None = None,
    *,
    experiment: str = "prefect-ml",
    **options: Any,
) -> CampaignResult:
    """Search hyperparameters with Optuna, trials in parallel on warm Ray workers, each tracked
    as a nested MLflow run; resumable by campaign name (finished trials are kept, interrupted
    ones retried).

    Args:
        data: what :func:`~prefect_ml.preprocess` returned.
        params: the experiment and the model, training and sweep sections, as the flows pass
            them (:class:`~prefect_ml.tasks.params.CampaignParams`); or, instead:
        experiment: the MLflow experiment.
        **options: any field of the sweep section
            (:class:`~prefect_ml.tasks.params.SweepParams`: ``campaign``, ``search_space``,
            ``objectives``, ``sampler``, ``pruner``, ``n_trials``, ``timeout_seconds``,
            ``concurrency``, ...) and the fixed values of every trial (model and training
            fields, as for :func:`~prefect_ml.train`). ``search_space`` may be the
            define-by-run function itself (``space(trial) -> dict``, see
            :class:`~prefect_ml.integrations.contracts.SearchSpace`).

    Returns:
        The campaign's counts, its best trial(s) with their parameters (``best_params``) and
        the trial table (``trials``, best first).

    Raises:
        ConfigurationError: an unknown or invalid option, or a search space that cannot
            run (asked for one trial first), before any trial runs.
        CampaignFailedError: the budget was spent and no trial completed.
    """
    params = params_on_data(
        CampaignParams, data, params, options, step="campaign", experiment=experiment
    )
    with ray_session(get_settings()):  # one Ray for the placement check and the trials
        check_placement(params)
        result = run_campaign(params, data)
    uri = get_settings().resolved_tracking_uri
    links = {
        row.number: tracking.run_url(uri, result.experiment_id, row.run_id)
        for row in [*result.best, *result.leaderboard]
        if row.run_id
    }
    create_markdown_artifact(
        campaign_markdown(result, links),
        key=f"campaign-{slug(result.campaign)}-summary",
        description=f"campaign {result.campaign}",
    )
    create_link_artifact(
        tracking.run_url(uri, result.experiment_id, result.parent_run_id),
        link_text=f"MLflow parent run of campaign {result.campaign} (plots, every trial)",
        key=f"campaign-{slug(result.campaign)}-mlflow",
    )
    return result
