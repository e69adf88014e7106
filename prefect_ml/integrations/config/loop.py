"""What a training worker receives: the model and training sections as the flow parameters
hold them, the prepared splits it reads, and where its run writes. One pydantic object that
Ray pickles as it is (a Ray Train worker's ``train_loop_config``, a trial's spec), so a field
added to a section reaches the workers without being named again."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from prefect_ml.integrations import problems
from prefect_ml.integrations.config.model import ModelParams
from prefect_ml.integrations.config.training import TrainingParams

Layout = Literal["arrays", "parquet"]  # how splits are stored: integrations.datasets.LAYOUTS


class Splits(BaseModel):
    """A prepared dataset as a worker reads it: where its splits are, the shape of a sample,
    the task and, for regression, the statistics the targets train standardised by."""

    splits_url: str
    sample_shape: list[int]
    num_classes: int
    task: problems.TaskType = "classification"
    target_mean: float = 0.0
    target_std: float = 1.0
    layout: Layout = "arrays"


class TrainLoop(BaseModel):
    """Everything a training worker needs: the model and training sections, the splits, and
    the run's checkpoints and stop marker (a file whose existence asks the workers to stop
    after the epoch; "" for none). No MLflow address: the driver alone writes the run."""

    model_config = ConfigDict(frozen=True)

    model: ModelParams
    training: TrainingParams
    data: Splits
    checkpoint_url: str
    stop_url: str = ""

    @classmethod
    def from_options(cls, **options: Any) -> TrainLoop:
        """A loop from flat keyword options, each a field of the model or training section, of
        the splits or of the loop itself (field names are unique across them): a convenience
        for code that trains without flow parameters (tests, benchmarks)."""
        parts: dict[str, dict[str, Any]] = {"model": {}, "training": {}, "data": {}}
        own: dict[str, Any] = {}
        for name, value in options.items():
            part = next((p for p, m in _PARTS.items() if name in m.model_fields), None)
            (own if part is None else parts[part])[name] = value
        return cls.model_validate({**parts, **own})


_PARTS: dict[str, type[BaseModel]] = {
    "model": ModelParams,
    "training": TrainingParams,
    "data": Splits,
}
