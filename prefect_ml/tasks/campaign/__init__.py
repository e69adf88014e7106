"""A hyperparameter campaign in small parts: its identity, the coordinator's decisions, the
live view and the results; :func:`run_campaign` wires them to Ray, Optuna and MLflow."""

from prefect_ml.tasks.campaign.coordinator import CampaignRules, Coordinator, Tally
from prefect_ml.tasks.campaign.identity import CampaignIdentity
from prefect_ml.tasks.campaign.results import CampaignResult, TrialSummary
from prefect_ml.tasks.campaign.run import run_campaign

__all__ = [
    "CampaignIdentity",
    "CampaignResult",
    "CampaignRules",
    "Coordinator",
    "Tally",
    "TrialSummary",
    "run_campaign",
]
