"""A registered model version as the processes that run it load it: its identity, the input
and output schema, and its model on a device, ready for :class:`~inference.Predictor`.

Both the serving replicas (:mod:`serving`) and the batch scorers (:mod:`batch_scoring`) use it.
It imports neither FastAPI nor Ray Serve (a batch scoring actor would pay about a second to
import them), and torch and MLflow only when a model is loaded.
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, Field

from prefect_ml.integrations import tracking
from prefect_ml.integrations.inference import InferencePrecision, Predictor, serving_device


class ModelIdentity(BaseModel):
    name: str
    version: str
    run_id: str


class ServedModel(BaseModel):
    """One registered model version and what a replica needs to load and check inputs for it."""

    name: str
    version: str
    run_id: str
    tracking_uri: str = Field(description="masked: see tracking.shipped_uri")
    sample_shape: list[int]
    feature_names: list[str] | None = None
    class_names: list[str] | None = None
    dataset_fingerprint: str | None = None
    task: Literal["classification", "regression"] = "classification"
    input_dtype: Literal["float32", "float64"] = "float32"

    @property
    def uri(self) -> str:
        return f"models:/{self.name}/{self.version}"

    @property
    def width(self) -> int:
        return int(np.prod(self.sample_shape))

    def identity(self) -> dict[str, Any]:
        return ModelIdentity(name=self.name, version=self.version, run_id=self.run_id).model_dump()

    def io_schema(self) -> dict[str, Any]:
        """What requests and answers look like: two versions with the same schema can share
        an endpoint."""
        return self.model_dump(
            include={"sample_shape", "feature_names", "class_names", "task", "input_dtype"}
        )


def load_predictor(
    served: ServedModel, gpus: float = 0.0, precision: InferencePrecision = "fp32"
) -> tuple[Predictor, str]:
    """The version's model (pt2 only, see :func:`tracking.load_pt2_model`) in eval mode on
    the device that ``gpus`` reserved, and the folder it was downloaded to."""
    import mlflow
    import torch

    tracking_uri = tracking.worker_uri(served.tracking_uri)
    mlflow.set_tracking_uri(tracking_uri)
    mlflow.set_registry_uri(tracking_uri)
    local = mlflow.artifacts.download_artifacts(served.uri)
    loaded = tracking.load_pt2_model(local, what=f"{served.name} v{served.version}")
    if isinstance(loaded, torch.export.ExportedProgram):
        loaded = loaded.module()
    try:
        loaded.eval()
    except NotImplementedError:
        pass  # MLflow 3's default pt2 format: an exported module, fixed in eval mode already
    predictor = Predictor(
        loaded,
        served.sample_shape,
        serving_device(gpus, torch.cuda.is_available()),
        precision,
        task=served.task,
        input_dtype=served.input_dtype,
    )
    return predictor, local


def non_finite_rows(values: np.ndarray) -> list[int]:
    """The indices of the rows of ``values`` holding NaN or infinity."""
    return np.flatnonzero(~np.isfinite(values).all(axis=1)).tolist()


def labelled_outputs(
    outputs: np.ndarray, class_names: list[str] | None, task: str = "classification"
) -> np.ndarray:
    """Per row what the model predicts: the class name (a string array) for classification,
    the value (float64) for regression."""
    if task == "regression":
        return outputs[:, 0].astype(np.float64)
    names = np.asarray(class_names if class_names else [str(i) for i in range(outputs.shape[1])])
    return names[outputs.argmax(axis=1)]
