"""The evaluation step: held-out test metrics and a confusion matrix, logged to the run."""

from __future__ import annotations

import numpy as np
from prefect import task
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel

from integrations import storage, tracking
from integrations.settings import get_settings
from tasks.data import PreparedData
from tasks.params import TrainModelParams
from tasks.train import TrainResult, trained_model


class Evaluation(BaseModel):
    """Test-set metrics, keyed without ``test_``: ``accuracy``, ``macro_f1``, ``loss``."""

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


def evaluate_model(
    params: TrainModelParams, data: PreparedData, trained: TrainResult
) -> Evaluation:
    """Score the final checkpoint on the test split and log metrics and the figure to MLflow."""
    import torch
    from sklearn.metrics import confusion_matrix, f1_score

    def read(name: str) -> np.ndarray:
        return storage.read_array(storage.join(data.splits_url, name))

    model = trained_model(params, data, trained)
    features = torch.from_numpy(read("test_features.npy"))
    labels = read("test_labels.npy")
    with torch.no_grad():
        logits = torch.cat([model(batch) for batch in features.split(512)])
    predictions = logits.argmax(dim=1).numpy()
    matrix = confusion_matrix(labels, predictions, labels=range(data.num_classes))
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
    figure = confusion_figure(matrix, data.class_names)
    tracking.log_figure(client, trained.run_id, figure, "evaluation/confusion_matrix.png")
    return Evaluation(metrics=metrics, confusion_matrix=matrix.tolist())


@task(name="evaluate", cache_policy=NO_CACHE)
def evaluate(params: TrainModelParams, data: PreparedData, trained: TrainResult) -> Evaluation:
    return evaluate_model(params, data, trained)
