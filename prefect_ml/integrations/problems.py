"""What a task type computes: its loss, its per-epoch validation metrics and its test metrics.

Classification trains on cross-entropy over class logits and is scored by accuracy and macro-F1;
regression trains on the mean squared error of one output (on standardised targets, when the
data was prepared so) and is scored by RMSE, MAE and R² in the target's own units. Everything
downstream (the training loop, evaluation, promotion, campaign objectives, serving) asks the
task's :class:`Problem` instead of assuming accuracy.

Validation runs as sums on the device (no host sync per batch) that the epoch's one all-reduce
adds up over the workers; the metrics are computed from those totals. Only torch and numpy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import numpy as np

if TYPE_CHECKING:
    import torch

TaskType = Literal["classification", "regression"]
Direction = Literal["maximize", "minimize"]


@dataclass(frozen=True)
class Problem:
    """One task type.

    Attributes:
        name: ``classification`` or ``regression``.
        epoch_metrics: validation metrics of every epoch with their directions (``train_loss``
            and ``val_loss`` included): what campaigns optimise and retention keeps.
        test_metrics: held-out test metrics (logged as ``test_<name>``) with their directions:
            what promotion compares.
        headline: the epoch metric shown first and optimised by default.
        promotion: the test metric promotion compares by default.
    """

    name: TaskType
    epoch_metrics: dict[str, Direction]
    test_metrics: dict[str, Direction]
    headline: str
    promotion: str

    def outputs(self, num_classes: int) -> int:
        """The model's output width: one logit per class, or one value."""
        return num_classes if self.name == "classification" else 1

    def targets(self, labels: np.ndarray, mean: float, std: float) -> np.ndarray:
        """Stored labels as training targets: class ids, or values standardised by the
        training split's ``mean`` and ``std`` (0 and 1 when not standardised)."""
        if self.name == "classification":
            return labels.astype(np.int64)
        return ((labels.astype(np.float64) - mean) / std).astype(np.float32)

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The training loss of a batch (a mean), in float32 whatever the autocast dtype."""
        import torch.nn.functional as F

        if self.name == "classification":
            return F.cross_entropy(outputs.float(), targets)
        return F.mse_loss(outputs.float().reshape(-1), targets)

    def validation_sums(self, outputs: torch.Tensor, targets: torch.Tensor) -> list[torch.Tensor]:
        """A batch's additive validation statistics, on the device."""
        import torch.nn.functional as F

        outputs = outputs.float()
        if self.name == "classification":
            loss = F.cross_entropy(outputs, targets, reduction="sum").double()
            return [loss, (outputs.argmax(dim=1) == targets).sum().double()]
        error = outputs.reshape(-1).double() - targets.double()
        y = targets.double()
        return [(error**2).sum(), error.abs().sum(), y.sum(), (y**2).sum()]

    @property
    def validation_width(self) -> int:
        """How many statistics :meth:`validation_sums` returns."""
        return 2 if self.name == "classification" else 4

    def validation_metrics(self, sums: list[float], rows: float, std: float) -> dict[str, float]:
        """The epoch's validation metrics from the summed statistics of ``rows`` rows; ``std``
        turns standardised errors back into the target's units."""
        if self.name == "classification":
            return {"val_loss": sums[0] / rows, "val_accuracy": sums[1] / rows}
        sse, sae, total, squares = sums[0], sums[1], sums[2], sums[3]
        variance = squares - total * total / rows
        return {
            "val_loss": sse / rows,
            "val_rmse": float(np.sqrt(sse / rows)) * std,
            "val_mae": sae / rows * std,
            "val_r2": 1.0 - sse / variance if variance > 0 else 0.0,
        }

    def test_sums(self, outputs: np.ndarray, labels: np.ndarray, num_classes: int) -> np.ndarray:
        """A batch's additive test statistics: of ``outputs`` (logits, or predictions in the
        target's units) against the stored ``labels``; summed over batches, they give
        :meth:`scores`. Classification: the confusion matrix, flattened, then the summed loss;
        regression: rows, the sums of squared and absolute errors, of targets and of their
        squares."""
        if self.name == "classification":
            shifted = outputs - outputs.max(axis=1, keepdims=True)
            log_probabilities = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
            loss = -log_probabilities[np.arange(len(labels)), labels].sum()
            cells = labels.astype(np.int64) * num_classes + outputs.argmax(axis=1)
            matrix = np.bincount(cells, minlength=num_classes * num_classes)
            return np.append(matrix.astype(np.float64), loss)
        actual = labels.astype(np.float64)
        error = outputs.reshape(-1).astype(np.float64) - actual
        return np.array(
            [len(actual), (error**2).sum(), np.abs(error).sum(), actual.sum(), (actual**2).sum()]
        )

    def scores(self, sums: np.ndarray, num_classes: int) -> dict[str, float]:
        """Test metrics from summed :meth:`test_sums`."""
        if self.name == "classification":
            matrix = self.confusion(sums, num_classes).astype(np.float64)
            rows = matrix.sum()
            hits = np.diag(matrix)
            seen = (matrix.sum(axis=0) + matrix.sum(axis=1)) > 0  # as scikit-learn's macro F1
            f1 = 2 * hits / np.maximum(matrix.sum(axis=0) + matrix.sum(axis=1), 1)
            return {
                "accuracy": float(hits.sum() / rows),
                "macro_f1": float(f1[seen].mean()),
                "loss": float(sums[-1] / rows),
            }
        rows, sse, sae, total, squares = (float(v) for v in sums)
        variance = squares - total * total / rows
        return {
            "rmse": float(np.sqrt(sse / rows)),
            "mae": sae / rows,
            "r2": 1.0 - sse / variance if variance > 0 else 0.0,
            "loss": sse / rows,
        }

    @staticmethod
    def confusion(sums: np.ndarray, num_classes: int) -> np.ndarray:
        """The confusion matrix (rows: true class) of summed classification test sums."""
        return sums[:-1].reshape(num_classes, num_classes).astype(np.int64)


PROBLEMS: dict[str, Problem] = {
    "classification": Problem(
        name="classification",
        epoch_metrics={
            "val_accuracy": "maximize",
            "val_loss": "minimize",
            "train_loss": "minimize",
        },
        test_metrics={"accuracy": "maximize", "macro_f1": "maximize", "loss": "minimize"},
        headline="val_accuracy",
        promotion="accuracy",
    ),
    "regression": Problem(
        name="regression",
        epoch_metrics={
            "val_rmse": "minimize",
            "val_mae": "minimize",
            "val_r2": "maximize",
            "val_loss": "minimize",
            "train_loss": "minimize",
        },
        test_metrics={"rmse": "minimize", "mae": "minimize", "r2": "maximize", "loss": "minimize"},
        headline="val_rmse",
        promotion="rmse",
    ),
}

# Every metric some task produces, with its direction (the same name means the same thing).
EPOCH_METRICS: dict[str, Direction] = {
    k: v for p in PROBLEMS.values() for k, v in p.epoch_metrics.items()
}
TEST_METRICS: dict[str, Direction] = {
    k: v for p in PROBLEMS.values() for k, v in p.test_metrics.items()
}


def problem(task: str) -> Problem:
    return PROBLEMS[task]
