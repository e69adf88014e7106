from __future__ import annotations

import pytest

from integrations import tracking
from integrations.settings import PrefectMLSettings


@pytest.mark.parametrize(
    ("new", "champion", "direction", "delta", "promoted"),
    [
        (0.95, None, "maximize", 0.0, True),
        (0.96, 0.95, "maximize", 0.0, True),
        (0.955, 0.95, "maximize", 0.01, False),
        (0.95, 0.95, "maximize", 0.0, False),
        (0.20, 0.30, "minimize", 0.05, True),
        (0.29, 0.30, "minimize", 0.05, False),
    ],
)
def test_promotion_decision(
    new: float, champion: float | None, direction: str, delta: float, promoted: bool
) -> None:
    decision = tracking.decide_promotion(
        new,
        champion,
        metric="test_accuracy",
        direction=direction,
        min_delta=delta,
        champion_version="3" if champion is not None else None,
    )
    assert decision.promoted is promoted
    assert "test_accuracy" in decision.reason
    if champion is not None:
        assert "v3" in decision.reason and decision.previous_value == champion


def test_unfinished_runs_are_resumed_finished_ones_are_not(home: PrefectMLSettings) -> None:
    client = tracking.client_for(home.resolved_tracking_uri)
    experiment = tracking.ensure_experiment(client, "exp", home.mlflow_artifact_root)
    first, _ = tracking.start_or_resume_run(
        client, experiment, "k", run_name="r", params={}, tags={}
    )
    again, resumed = tracking.start_or_resume_run(
        client, experiment, "k", run_name="r", params={}, tags={"t": "v"}
    )
    assert (again, resumed) == (first, True)
    tracking.finish_run(client, first)
    fresh, resumed = tracking.start_or_resume_run(
        client, experiment, "k", run_name="r", params={}, tags={}
    )
    assert fresh != first and not resumed
    other, resumed = tracking.start_or_resume_run(
        client, experiment, "other-key", run_name="r", params={}, tags={}
    )
    assert other not in (first, fresh) and not resumed
