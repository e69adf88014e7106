"""``hpo_campaign``: an Optuna campaign whose trials train in parallel on warm Ray workers."""

from __future__ import annotations

from prefect import flow

from prefect_ml.flows.train import on_one_ray, prepared_data
from prefect_ml.tasks.params import CampaignParams
from prefect_ml.tasks.quotas import tenant_tags
from prefect_ml.tasks.report import published_timeline
from prefect_ml.tasks.sweep import CampaignResult, campaign

__all__ = ["hpo_campaign"]


@flow(name="hpo-campaign")
def hpo_campaign(params: CampaignParams = CampaignParams()) -> CampaignResult:  # noqa: B008
    """Search hyperparameters with Optuna, trials in parallel on Ray; resumable by campaign name.

    Args:
        params: The data and model, the fixed training values, and the sweep: search space,
            objectives, sampler, pruner and budget.
    """
    with published_timeline("hpo-campaign"), on_one_ray(params):
        data = prepared_data(params)
        with tenant_tags():  # the tenant's quota counts its Ray-occupying tasks
            return campaign(data, params)
