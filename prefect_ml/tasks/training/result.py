"""What a finished training run returns: :class:`TrainResult`, read from its checkpoints."""

from __future__ import annotations

import json

from pydantic import BaseModel

from prefect_ml.integrations.training import METRICS_FILE, TrainingEnd
from prefect_ml.tasks.data import PreparedData
from prefect_ml.tasks.params import ModelParams, TrainingSections


class TrainResult(BaseModel):
    """A finished training run: what :func:`train` returns, and all that
    :func:`~prefect_ml.evaluate` and :func:`~prefect_ml.register` need of it.

    Attributes:
        run_id, experiment_id: the MLflow run that holds its parameters, metrics and model.
        checkpoint_url: where its verified checkpoints are.
        final_epoch, resumed_from_epoch: the last epoch, and the epoch a resumed run started at
            (0 from scratch).
        best_epoch: the epoch whose checkpoint is evaluated and registered: with early
            stopping, the best epoch of its metric; otherwise the final epoch.
        early_stopped: where and why early stopping ended training (``"epoch 7 of 12; best
            epoch 4 (val_loss 0.123)"``); None when every epoch trained.
        epoch_metrics: the last epoch's metrics (``train_loss``, ``val_loss`` and the task's:
            ``val_accuracy``, or ``val_rmse``, ``val_mae``, ``val_r2``).
        model: the network it trained (the model section), to rebuild it from the checkpoint.
        data: the prepared dataset it trained on.
        reused: whether this is an earlier, finished and registered run of the same identity,
            returned instead of training again (``train_model`` without ``--force``).
    """

    run_id: str
    experiment_id: str
    checkpoint_url: str
    final_epoch: int
    resumed_from_epoch: int
    best_epoch: int
    epoch_metrics: dict[str, float]
    model: ModelParams
    data: PreparedData
    early_stopped: str | None = None
    reused: bool = False


def train_result(
    params: TrainingSections,
    data: PreparedData,
    end: TrainingEnd,
    *,
    run_id: str,
    experiment_id: str,
    checkpoint_url: str,
    resumed_from_epoch: int,
    reused: bool = False,
) -> TrainResult:
    """The :class:`TrainResult` of a run that ended as ``end`` says."""
    return TrainResult(
        run_id=run_id,
        experiment_id=experiment_id,
        checkpoint_url=checkpoint_url,
        final_epoch=end.final.epoch,
        resumed_from_epoch=resumed_from_epoch,
        best_epoch=end.best_epoch,
        early_stopped=end.stopped.describe(params.training.epochs) if end.stopped else None,
        epoch_metrics=json.loads(end.final.files[METRICS_FILE]),
        model=params.model,
        data=data,
        reused=reused,
    )
