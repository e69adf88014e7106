"""Early stopping: whether a run's monitored validation metric stopped improving.

The decision is a pure function of the metrics of the run's committed epochs (every epoch's
metrics file survives retention), never of in-memory state. So every worker of a group, a
worker group restarted from a checkpoint, a driver killed and run again and the driver that
reports the outcome all reach the same decision, and a run that already stopped trains no
further when it is resumed.

An epoch *improves* when its value beats the best so far by more than ``min_delta``; the best
epoch is the last one that improved. Training stops after the first epoch that is
``patience`` epochs past the best epoch. Epochs are counted by number, so an epoch whose
checkpoint does not verify (missing from the history) still counts as one that did not improve.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from prefect_ml.integrations import problems

History = Mapping[int, Mapping[str, float]]  # epoch -> that epoch's committed metrics


@dataclass(frozen=True)
class BestEpoch:
    """The best epoch of the monitored metric so far, and its value."""

    epoch: int
    value: float


@dataclass(frozen=True)
class StopDecision:
    """A run that stopped early: after ``epoch``, because ``best`` was ``patience`` epochs ago."""

    epoch: int
    best: BestEpoch
    metric: str

    def describe(self, epochs: int) -> str:
        """``"epoch 7 of 12; best epoch 4 (val_loss 0.1230)"``: what a person reads."""
        return (
            f"epoch {self.epoch} of {epochs}; best epoch {self.best.epoch} "
            f"({self.metric} {self.best.value:.4g})"
        )


@dataclass(frozen=True)
class EarlyStopping:
    """Stop once ``metric`` has not improved by more than ``min_delta`` for ``patience`` epochs.

    ``mode`` is the metric's direction: ``min`` for losses and errors, ``max`` for accuracy
    and R²; :meth:`for_metric` takes it from the task types' metrics.
    """

    metric: str
    patience: int
    min_delta: float = 0.0
    mode: Literal["min", "max"] = "min"

    def __post_init__(self) -> None:
        if self.patience < 1:
            raise ValueError("patience must be at least 1 epoch (0 turns early stopping off)")
        if self.min_delta < 0:
            raise ValueError(f"min_delta must be >= 0, not {self.min_delta}")

    @classmethod
    def for_metric(
        cls,
        metric: str,
        patience: int,
        min_delta: float = 0.0,
        mode: Literal["auto", "min", "max"] = "auto",
    ) -> EarlyStopping:
        """``mode`` auto: the task metric's direction, min for a metric of the model's own
        (as Lightning's EarlyStopping)."""
        if mode == "auto":
            mode = "max" if problems.EPOCH_METRICS.get(metric) == "maximize" else "min"
        return cls(metric, patience, min_delta, mode)

    def _improves(self, value: float, best: BestEpoch | None) -> bool:
        if value != value:  # NaN never improves
            return False
        if best is None:
            return True
        gain = best.value - value if self.mode == "min" else value - best.value
        return gain > self.min_delta

    def _walk(self, history: History) -> tuple[BestEpoch | None, StopDecision | None]:
        """The best epoch, and the stop decision, of the history's epochs in order."""
        best: BestEpoch | None = None
        for epoch in sorted(history):
            value = history[epoch].get(self.metric)
            if value is not None and self._improves(float(value), best):
                best = BestEpoch(epoch, float(value))
            if best is not None and epoch - best.epoch >= self.patience:
                return best, StopDecision(epoch, best, self.metric)
        return best, None

    def best(self, history: History) -> BestEpoch | None:
        """The best epoch of ``history`` (the last one that improved) up to where training
        stopped, if any epoch has the metric."""
        return self._walk(history)[0]

    def decide(self, history: History) -> StopDecision | None:
        """Where training stopped (or must stop now), or None while it goes on."""
        return self._walk(history)[1]
