"""The evaluation step: held-out test metrics and a confusion matrix, logged to the run."""

from __future__ import annotations

import numpy as np
from prefect import task
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel

from prefect_ml.integrations import storage, tracking
from prefect_ml.integrations.errors import ConfigurationError
from prefect_ml.integrations.settings import get_settings
from prefect_ml.tasks.data import PreparedData
from prefect_ml.tasks.train import TrainResult, trained_model

__all__ = ["METRIC_DIRECTIONS", "Evaluation", "evaluate"]

# Which way each test metric improves: what promotion compares by default.
METRIC_DIRECTIONS = {"accuracy": "maximize", "macro_f1": "maximize", "loss": "minimize"}


class Evaluation(BaseModel):
    """What :func:`evaluate` returns: held-out test metrics, keyed without ``test_``
    (``accuracy``, ``macro_f1``, ``loss``; see :data:`METRIC_DIRECTIONS`), and the confusion
    matrix (rows: true class, columns: predicted)."""

    metrics: dict[str, float]
    confusion_matrix: list[list[int]]


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


def evaluate_model(trained: TrainResult, data: PreparedData | None = None) -> Evaluation:
    """Score the final checkpoint on the test split (of ``data``, else of the data it trained
    on) and log the metrics and the confusion matrix to the run."""
    import torch
    from sklearn.metrics import confusion_matrix, f1_score

    scored, trained_on = data or trained.data, trained.data
    if (scored.sample_shape, scored.class_names) != (
        trained_on.sample_shape,
        trained_on.class_names,
    ):
        raise ConfigurationError(
            "data",
            f"samples of shape {scored.sample_shape} with classes {scored.class_names} cannot "
            f"score a model trained on shape {trained_on.sample_shape} with classes "
            f"{trained_on.class_names}; pass data prepared like the training data",
        )

    def read(name: str) -> np.ndarray:
        return storage.read_array(storage.join(scored.splits_url, name))

    model = trained_model(trained)
    features = torch.from_numpy(read("test_features.npy"))
    labels = read("test_labels.npy")
    with torch.no_grad():
        logits = torch.cat([model(batch) for batch in features.split(512)])
    predictions = logits.argmax(dim=1).numpy()
    matrix = confusion_matrix(labels, predictions, labels=range(scored.num_classes))
    metrics = {
        "accuracy": float((predictions == labels).mean()),
        "macro_f1": float(f1_score(labels, predictions, average="macro")),
        "loss": float(torch.nn.functional.cross_entropy(logits, torch.from_numpy(labels))),
    }
    client = tracking.client_for(get_settings().resolved_tracking_uri)
    # A process killed after evaluating and before registration is evaluated again by the rerun
    # (same checkpoint, same split, same numbers): each test metric is logged once.
    logged = tracking.run_metrics(client, trained.run_id)
    fresh = {f"test_{k}": v for k, v in metrics.items() if f"test_{k}" not in logged}
    if fresh:
        tracking.log_metrics(client, trained.run_id, fresh)
    figure = confusion_figure(matrix, scored.class_names)
    tracking.log_figure(client, trained.run_id, figure, "evaluation/confusion_matrix.png")
    return Evaluation(metrics=metrics, confusion_matrix=matrix.tolist())


@task(name="evaluate", cache_policy=NO_CACHE)
def evaluate(trained: TrainResult, data: PreparedData | None = None) -> Evaluation:
    """Score a trained run's final checkpoint on a held-out test split.

    The metrics go to the run as ``test_accuracy``, ``test_macro_f1`` and ``test_loss`` (each
    once, also when evaluated again) with the confusion matrix as a figure.

    Args:
        trained: what :func:`~prefect_ml.train` returned.
        data: a prepared dataset of the same shape and classes to score on; by default the one
            the run trained on.
    """
    return evaluate_model(trained, data)
