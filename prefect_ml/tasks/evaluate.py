"""The evaluation step: held-out test metrics and a confusion matrix, logged to the run."""

from __future__ import annotations

import numpy as np
from prefect import task
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel

from prefect_ml.integrations import compute, datasets, tracking, training
from prefect_ml.integrations.errors import ConfigurationError
from prefect_ml.integrations.settings import get_settings
from prefect_ml.tasks.data import PreparedData
from prefect_ml.tasks.train import TrainResult, trained_model

__all__ = ["Evaluation", "evaluate"]


class Evaluation(BaseModel):
    """What :func:`evaluate` returns: held-out test metrics of the task, keyed without
    ``test_`` (``accuracy``, ``macro_f1``, ``loss``; for regression ``rmse``, ``mae``, ``r2``,
    ``loss``), and for classification the confusion matrix (rows: true class, columns:
    predicted)."""

    metrics: dict[str, float]
    confusion_matrix: list[list[int]] | None = None


def confusion_figure(matrix: np.ndarray, class_names: list[str]):  # type: ignore[no-untyped-def]
    """A confusion-matrix heat map with counts, as a matplotlib figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(1.2 + 0.5 * len(class_names), 1 + 0.5 * len(class_names)))
    axes.imshow(matrix, cmap="Blues")
    ticks = range(len(class_names))
    axes.set_xticks(ticks, class_names)
    axes.set_yticks(ticks, class_names)
    axes.set_xlabel("predicted")
    axes.set_ylabel("true")
    threshold = matrix.max() / 2 if matrix.size else 0
    for (row, col), count in np.ndenumerate(matrix):
        axes.text(
            col,
            row,
            str(int(count)),
            ha="center",
            va="center",
            color="white" if count > threshold else "black",
            fontsize=8,
        )
    axes.set_title("Test confusion matrix")
    figure.tight_layout()
    return figure


def predicted_figure(predictions: np.ndarray, actual: np.ndarray):  # type: ignore[no-untyped-def]
    """Predicted against actual values of a regression's test split, with the identity line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(5, 5))
    axes.plot(actual, predictions, marker=".", linestyle="none", alpha=0.6)
    low = float(min(actual.min(), predictions.min())) if actual.size else 0.0
    high = float(max(actual.max(), predictions.max())) if actual.size else 1.0
    axes.plot([low, high], [low, high], color="grey", linewidth=1, linestyle="--")
    axes.set_xlabel("actual")
    axes.set_ylabel("predicted")
    axes.set_title("Test split: predicted vs actual")
    figure.tight_layout()
    return figure


# test sums; predicted and actual; what the model's own test_step logs (test_<name>)
Scored = tuple[np.ndarray, tuple[np.ndarray, np.ndarray], dict[str, float]]


def _score_here(trained: TrainResult, scored: PreparedData) -> Scored:
    """In-memory splits (small): scored in this process."""
    import torch

    features, labels = scored.shard("test").head(scored.rows["test"])
    model = trained_model(trained)
    with torch.no_grad():
        batches = torch.from_numpy(features).split(512)
        outputs = torch.cat([model(batch) for batch in batches]).float().numpy()
    if trained.data.task == "regression":  # the model predicts standardised targets
        outputs = outputs * trained.data.target_std + trained.data.target_mean
    problem = trained.data.problem
    sums = problem.test_sums(outputs, labels, scored.num_classes)
    targets = torch.from_numpy(
        problem.targets(labels, trained.data.target_mean, trained.data.target_std)
    )
    batches = zip(torch.from_numpy(features).split(512), targets.split(512), strict=True)
    return sums, (outputs.reshape(-1), labels), training.test_step_metrics(model, batches)


def _score_on_cluster(trained: TrainResult, scored: PreparedData) -> Scored:
    """Streamed splits: scored in batches by Ray Data actors; only sums come back."""
    loop = {
        "model": trained.model.model,
        "model_options": trained.model.factory_options(),
        "input_shape": trained.data.sample_shape,
        "num_classes": trained.data.num_classes,
        "task": trained.data.task,
        "target_mean": trained.data.target_mean,
        "target_std": trained.data.target_std,
        "epoch": trained.best_epoch,  # the checkpoint evaluated and registered
    }
    files = datasets.read_manifest(scored.splits_url)["test"]
    with compute.ray_session(get_settings()):
        sums, outputs = training.score_split(scored.splits_url, files, trained.checkpoint_url, loop)
    return sums, outputs, {}  # a test_step runs on in-memory splits only


def evaluate_model(trained: TrainResult, data: PreparedData | None = None) -> Evaluation:
    """Score the run's best checkpoint (``best_epoch``: the final one without early stopping)
    on the test split (of ``data``, else of the data it trained
    on) with its task's metrics, and log them and a figure (the confusion matrix, or predicted
    against actual values) to the run."""
    scored, trained_on = data or trained.data, trained.data
    if (scored.task, scored.sample_shape, scored.class_names) != (
        trained_on.task,
        trained_on.sample_shape,
        trained_on.class_names,
    ):
        raise ConfigurationError(
            "data",
            f"{scored.task} samples of shape {scored.sample_shape} with classes "
            f"{scored.class_names} cannot score a {trained_on.task} model trained on shape "
            f"{trained_on.sample_shape} with classes {trained_on.class_names}; pass data "
            "prepared like the training data",
        )

    problem = trained_on.problem
    if scored.layout == "parquet":  # scored by Ray Data actors on the cluster
        sums, (predicted, actual), own = _score_on_cluster(trained, scored)
    else:
        sums, (predicted, actual), own = _score_here(trained, scored)
    metrics = problem.scores(sums, scored.num_classes)
    metrics.update({name.removeprefix("test_"): value for name, value in own.items()})
    matrix = None
    if problem.name == "regression":
        figure = predicted_figure(predicted, actual)
        figure_path = "evaluation/predicted_vs_actual.png"
    else:
        matrix = problem.confusion(sums, scored.num_classes)
        figure = confusion_figure(matrix, scored.class_names)
        figure_path = "evaluation/confusion_matrix.png"
    client = tracking.client_for(get_settings().resolved_tracking_uri)
    # A process killed after evaluating and before registration is evaluated again by the rerun
    # (same checkpoint, same split, same numbers): each test metric is logged once.
    logged = tracking.run_metrics(client, trained.run_id)
    fresh = {f"test_{k}": v for k, v in metrics.items() if f"test_{k}" not in logged}
    if fresh:
        tracking.log_metrics(client, trained.run_id, fresh)
    tracking.log_figure(client, trained.run_id, figure, figure_path)
    return Evaluation(metrics=metrics, confusion_matrix=None if matrix is None else matrix.tolist())


@task(name="evaluate", cache_policy=NO_CACHE)
def evaluate(trained: TrainResult, data: PreparedData | None = None) -> Evaluation:
    """Score a trained run's checkpoint (its best epoch with early stopping, else its final
    one) on a held-out test split.

    The task's metrics go to the run as ``test_<name>`` (``test_accuracy``, ``test_macro_f1``,
    ``test_loss``; for regression ``test_rmse``, ``test_mae``, ``test_r2``, ``test_loss``), each
    once also when evaluated again, with a figure: the confusion matrix, or predicted against
    actual values.

    Args:
        trained: what :func:`~prefect_ml.train` returned.
        data: a prepared dataset of the same shape and classes to score on; by default the one
            the run trained on.
    """
    return evaluate_model(trained, data)
