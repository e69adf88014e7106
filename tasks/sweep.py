"""The campaign step: a thin Prefect task over :mod:`tasks.campaign` (identity, decisions,
view, results), and the campaign's summary artifact.
"""

from __future__ import annotations

from prefect import task
from prefect.artifacts import create_link_artifact, create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from integrations import tracking
from integrations.prefect_server import RAY_TAG
from integrations.settings import get_settings
from tasks.campaign.results import CampaignResult, TrialSummary
from tasks.campaign.run import run_campaign
from tasks.campaign.view import slug
from tasks.data import PreparedData
from tasks.params import CampaignParams
from tasks.retries import transient_retries

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
def campaign(params: CampaignParams, data: PreparedData) -> CampaignResult:
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
