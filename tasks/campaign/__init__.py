"""A hyperparameter campaign in small parts: its identity, the coordinator's decisions, the
live view and the results; :func:`run_campaign` wires them to Ray, Optuna and MLflow."""

from tasks.campaign.coordinator import CampaignRules, Coordinator, Tally
from tasks.campaign.identity import CampaignIdentity
from tasks.campaign.results import CampaignResult, TrialSummary
from tasks.campaign.run import run_campaign

__all__ = [
    "CampaignIdentity",
    "CampaignResult",
    "CampaignRules",
    "Coordinator",
    "Tally",
    "TrialSummary",
    "run_campaign",
]
