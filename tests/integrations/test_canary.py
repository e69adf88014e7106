"""The canary verdict: errors end the window early, too little traffic or a slower or worse
canary rolls back, and a canary no worse than the serving version is promoted; a rollout that
has ended leaves no replica answering with the canary."""

from __future__ import annotations

import numpy as np
import pytest

from prefect_ml.integrations.config.serving import CanaryPolicy
from prefect_ml.integrations.serving import (
    CanaryRoute,
    Rollout,
    VersionStats,
    judge,
    label_outcome,
)

POLICY = CanaryPolicy(
    share=0.1,
    window_s=60,
    min_requests=20,
    max_error_increase=0.01,
    max_latency_ratio=1.5,
    max_metric_drop=0.02,
)


def _stats(
    requests: int, errors: int = 0, latency_ms: float = 5.0, **labels: float
) -> VersionStats:
    return VersionStats(
        requests=requests,
        errors=errors,
        latencies_ms=[latency_ms] * (requests - errors),
        **labels,  # type: ignore[arg-type]
    )


def test_errors_past_the_threshold_end_the_window_early_once_there_are_enough_requests() -> None:
    stable = _stats(200)
    assert judge(stable, _stats(19, errors=19), POLICY, "classification", window_over=False) is None
    verdict = judge(stable, _stats(20, errors=2), POLICY, "classification", window_over=False)
    assert verdict is not None and not verdict.promote
    assert "error rate 10.0% against 0.0%" in verdict.reason


def test_the_error_threshold_is_an_increase_over_the_serving_versions_rate() -> None:
    stable = _stats(1000, errors=50)  # 5%: the inputs fail on both versions
    verdict = judge(stable, _stats(100, errors=5), POLICY, "classification", window_over=True)
    assert verdict is not None and verdict.promote, verdict


def test_too_few_canary_requests_by_the_end_of_the_window_roll_back() -> None:
    verdict = judge(_stats(100), _stats(3), POLICY, "classification", window_over=True)
    assert verdict is not None and not verdict.promote
    assert "only 3 canary request(s)" in verdict.reason


@pytest.mark.parametrize(
    ("canary_ms", "promoted"), [(7.0, True), (9.4, True), (9.6, False), (30.0, False)]
)
def test_latency_is_judged_on_p95_with_a_ratio_and_a_small_absolute_slack(
    canary_ms: float, promoted: bool
) -> None:
    # 5 ms serving: the canary may take 1.5 x 5 + 2 = 9.5 ms.
    verdict = judge(_stats(100), _stats(50, latency_ms=canary_ms), POLICY, "x", window_over=True)
    assert verdict is not None and verdict.promote is promoted, verdict


def test_labelled_requests_compare_accuracy_and_rmse_in_their_directions() -> None:
    stable = _stats(100, labelled=100, correct=95)
    worse = _stats(50, labelled=50, correct=45)  # 0.90: 0.05 worse
    verdict = judge(stable, worse, POLICY, "classification", window_over=True)
    assert verdict is not None and not verdict.promote and "accuracy 0.9000" in verdict.reason
    better = judge(stable, _stats(50, labelled=50, correct=49), POLICY, "c", window_over=True)
    assert better is not None and better.promote and "accuracy 0.9800" in better.reason

    stable_rmse = _stats(100, labelled=100, squared_error=100.0)  # rmse 1.0
    higher = _stats(50, labelled=50, squared_error=50 * 1.1**2)  # rmse 1.1
    verdict = judge(stable_rmse, higher, POLICY, "regression", window_over=True)
    assert verdict is not None and not verdict.promote and "rmse 1.1000" in verdict.reason
    lower = _stats(50, labelled=50, squared_error=50 * 0.9**2)
    assert judge(stable_rmse, lower, POLICY, "regression", window_over=True).promote  # type: ignore[union-attr]


def test_label_outcomes_count_correct_classes_and_squared_errors() -> None:
    classes = label_outcome(np.array(["3", "1", "4"]), [3, "1", "5"], "classification")
    assert (classes.labelled, classes.correct) == (3, 2)
    values = label_outcome(np.array([1.0, 2.0]), [1.5, 0.0], "regression")
    assert values.labelled == 2 and values.squared_error == pytest.approx(0.25 + 4.0)


def test_stats_from_replicas_add_up() -> None:
    total = VersionStats()
    total.add(_stats(10, errors=1, latency_ms=2.0))
    total.add(_stats(30, errors=0, latency_ms=4.0))
    assert (total.requests, total.errors) == (40, 1)
    assert total.error_rate == pytest.approx(1 / 40)
    assert total.latency_ms(0.5) == 4.0 and len(total.latencies_ms) == 39


@pytest.mark.usefixtures("ray_cluster")
def test_a_closed_rollout_returns_only_once_the_replicas_have_dropped_the_canary() -> None:
    """A verdict is final: once ``close`` returns, no replica answers with the canary (before,
    a replica kept it until its next sync, up to a second, and answered its share with it)."""
    loaded: list[str] = []
    route = CanaryRoute(
        "closing-app", "replica-1", lambda served: loaded.append(served["version"]) or object()
    )
    rollout = Rollout("closing-app", {"version": "7"}, share=1.0)
    rollout.wait_loaded(lambda: 1, timeout_s=30)
    assert loaded == ["7"] and route.takes_request()

    rollout.close()

    assert route.predictor is None and not route.takes_request()
