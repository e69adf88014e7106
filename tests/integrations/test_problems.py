"""The task types' metrics: per-epoch validation from summed statistics (as workers add them
up) equals the metrics computed at once; test scores match scikit-learn's."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sklearn.metrics import accuracy_score, f1_score, log_loss, mean_absolute_error, r2_score

from prefect_ml.integrations.problems import EPOCH_METRICS, PROBLEMS, TEST_METRICS, Problem


def _summed_over_two_workers(
    problem: Problem, outputs: torch.Tensor, targets: torch.Tensor
) -> list[float]:
    """What two workers' validation sums add up to."""
    shards = zip(outputs.chunk(2), targets.chunk(2), strict=True)
    halves = [problem.validation_sums(o, t) for o, t in shards]
    return [float(a + b) for a, b in zip(*halves, strict=True)]


def test_regression_validation_metrics_from_worker_sums_are_in_the_targets_units() -> None:
    generator = np.random.default_rng(0)
    actual = generator.normal(150.0, 70.0, size=200)
    predicted = actual + generator.normal(0.0, 30.0, size=200)
    mean, std = 150.0, 70.0
    problem = PROBLEMS["regression"]
    standardised = problem.targets(actual, mean, std)
    outputs = torch.from_numpy(((predicted - mean) / std).astype(np.float32)).reshape(-1, 1)
    sums = _summed_over_two_workers(problem, outputs, torch.from_numpy(standardised))
    assert len(sums) == problem.validation_width
    metrics = problem.validation_metrics(sums, 200.0, std)
    assert metrics["val_rmse"] == pytest.approx(
        np.sqrt(((predicted - actual) ** 2).mean()), rel=1e-5
    )
    assert metrics["val_mae"] == pytest.approx(mean_absolute_error(actual, predicted), rel=1e-5)
    assert metrics["val_r2"] == pytest.approx(r2_score(actual, predicted), rel=1e-5)
    assert metrics["val_loss"] == pytest.approx(metrics["val_rmse"] ** 2 / std**2, rel=1e-5)
    scores = problem.scores(_test_sums_in_batches(problem, predicted.reshape(-1, 1), actual), 1)
    assert scores["r2"] == pytest.approx(r2_score(actual, predicted))
    assert scores["mae"] == pytest.approx(mean_absolute_error(actual, predicted))
    assert scores["loss"] == pytest.approx(scores["rmse"] ** 2)


def test_classification_metrics_are_the_ones_it_always_had() -> None:
    generator = np.random.default_rng(1)
    logits = generator.normal(size=(120, 4)).astype(np.float32)
    labels = generator.integers(0, 4, size=120)
    problem = PROBLEMS["classification"]
    sums = _summed_over_two_workers(problem, torch.from_numpy(logits), torch.from_numpy(labels))
    metrics = problem.validation_metrics(sums, 120.0, 1.0)
    probabilities = torch.softmax(torch.from_numpy(logits), dim=1).numpy()
    assert metrics["val_accuracy"] == pytest.approx(accuracy_score(labels, logits.argmax(1)))
    assert metrics["val_loss"] == pytest.approx(log_loss(labels, probabilities), rel=1e-5)
    sums = _test_sums_in_batches(problem, logits, labels, num_classes=5)  # class 4: never seen
    scores = problem.scores(sums, 5)
    assert scores["accuracy"] == pytest.approx(accuracy_score(labels, logits.argmax(1)))
    assert scores["macro_f1"] == pytest.approx(f1_score(labels, logits.argmax(1), average="macro"))
    assert scores["loss"] == pytest.approx(metrics["val_loss"], rel=1e-5)
    matrix = problem.confusion(sums, 5)
    assert matrix.sum() == 120 and matrix[4].sum() == 0
    assert np.trace(matrix) == pytest.approx(scores["accuracy"] * 120)


def _test_sums_in_batches(
    problem: Problem, outputs: np.ndarray, labels: np.ndarray, num_classes: int = 1
) -> np.ndarray:
    """Test sums added over uneven batches, as Ray Data's scorers return them."""
    edges = [0, 7, 50, len(labels)]
    return np.sum(
        [
            problem.test_sums(outputs[a:b], labels[a:b], num_classes)
            for a, b in zip(edges, edges[1:], strict=False)
        ],
        axis=0,
    )


def test_every_metric_has_one_direction_across_task_types() -> None:
    for problem in PROBLEMS.values():
        for name, direction in problem.epoch_metrics.items():
            assert EPOCH_METRICS[name] == direction
        for name, direction in problem.test_metrics.items():
            assert TEST_METRICS[name] == direction
        assert problem.headline in problem.epoch_metrics
        assert problem.promotion in problem.test_metrics
    assert TEST_METRICS["rmse"] == "minimize" and TEST_METRICS["r2"] == "maximize"
