"""What a campaign reports: its trials as summaries, the leaderboard and the result."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from prefect_ml.integrations.campaign import ERROR_ATTR, TUNED_ATTR, counts_toward_budget

if TYPE_CHECKING:
    import optuna

LEADERBOARD_SIZE = 10


class TrialSummary(BaseModel):
    """One finished trial as the leaderboard and the pipeline see it."""

    number: int
    state: str
    values: dict[str, float]
    params: dict[str, Any]  # what it drew, by Optuna's names
    # What its search space set, by the sections' names (``lr``, ``model_options.blocks``):
    # the values to train with (for a declared space without conditions, ``params``).
    tuned: dict[str, Any] = {}
    run_id: str | None = None
    error: str | None = None


class CampaignResult(BaseModel):
    """A campaign's outcome: counts, the best trial(s), every finished trial and where the
    record lives (the MLflow parent run, whose nested runs are the trials)."""

    campaign: str
    experiment_id: str
    parent_run_id: str
    finished: int
    complete: int
    pruned: int
    failed: int
    best: list[TrialSummary]  # one trial, or the Pareto front for several objectives
    trials: list[TrialSummary]  # every finished trial, best first; failed ones last
    objectives: dict[str, str]
    # Seconds spent: setup (study, MLflow, workers), trials, conclusion (plots, records).
    timings: dict[str, float]
    target_reached_at: float | None = None  # Unix time an epoch first reached stop_at

    @property
    def best_params(self) -> dict[str, Any]:
        """The tuned values of the best trial (the first of a Pareto front), by the sections'
        names: what ``with_trial_values`` takes."""
        return dict(self.best[0].tuned) if self.best else {}

    @property
    def leaderboard(self) -> list[TrialSummary]:
        """The best finished trials, at most ``LEADERBOARD_SIZE``."""
        return self.trials[:LEADERBOARD_SIZE]


def trial_values(trial: optuna.trial.FrozenTrial, objectives: list[str]) -> dict[str, float]:
    """A trial's values by objective; a pruned trial's is its last reported value."""
    values = dict(zip(objectives, trial.values or [], strict=False))
    if not values and trial.intermediate_values:
        last = max(trial.intermediate_values)
        values = {objectives[0]: trial.intermediate_values[last]}
    return values


def trial_summary(
    trial: optuna.trial.FrozenTrial, objectives: list[str], run_ids: dict[int, str]
) -> TrialSummary:
    return TrialSummary(
        number=trial.number,
        state=trial.state.name,
        values=trial_values(trial, objectives),
        params=trial.params,
        tuned=trial.user_attrs.get(TUNED_ATTR, trial.params),
        run_id=run_ids.get(trial.number),
        error=trial.user_attrs.get(ERROR_ATTR),
    )


def leaderboard(
    study: optuna.Study, objectives: dict[str, str], run_ids: dict[int, str]
) -> list[TrialSummary]:
    """Finished trials, best first by the first objective; failed ones last."""
    names, direction = list(objectives), next(iter(objectives.values()))
    finished = [t for t in study.get_trials(deepcopy=False) if counts_toward_budget(t)]
    summaries = [trial_summary(t, names, run_ids) for t in finished]
    sign = -1.0 if direction == "maximize" else 1.0

    def rank(summary: TrialSummary) -> tuple[int, int, float]:
        value = summary.values.get(names[0], math.nan)
        order = {"COMPLETE": 0, "PRUNED": 1}.get(summary.state, 2)
        return (
            order,
            0 if math.isfinite(value) else 1,
            sign * value if math.isfinite(value) else 0,
        )

    return sorted(summaries, key=rank)
