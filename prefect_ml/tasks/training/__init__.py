"""A training run on the driver in small parts: its result, the pre-flight check of the model,
the recorder that logs committed epochs to MLflow, and :class:`TrainingRun`, which wires them
to the MLflow run, the lease, the checkpoint store and Ray Train (the ``train`` task is a thin
task over it)."""

from prefect_ml.tasks.training.preflight import check_model
from prefect_ml.tasks.training.recorder import EpochRecorder
from prefect_ml.tasks.training.result import TrainResult, train_result
from prefect_ml.tasks.training.run import (
    RESUMED_FROM_TAG,
    TrainingRun,
    current_flow_run_id,
    flatten,
    train_loop,
    training_lease,
)

__all__ = [
    "RESUMED_FROM_TAG",
    "EpochRecorder",
    "TrainResult",
    "TrainingRun",
    "check_model",
    "current_flow_run_id",
    "flatten",
    "train_loop",
    "train_result",
    "training_lease",
]
