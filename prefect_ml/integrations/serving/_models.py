"""A registered model version as the processes that run it load it: its identity, the input
and output schema, and its model on a device, ready for :class:`~_inference.Predictor`.

Both the serving replicas (:mod:`_app`) and the batch scorers (:mod:`batch_scoring`) use it.
It imports neither FastAPI nor Ray Serve (a batch scoring actor would pay about a second to
import them), and torch and MLflow only when a model is loaded.
"""

from __future__ import annotations

import functools
import json
import math
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from pydantic import BaseModel, Field

from prefect_ml.integrations import tracking
from prefect_ml.integrations.errors import ConfigurationError
from prefect_ml.integrations.redaction import masked
from prefect_ml.integrations.serving._inference import InferencePrecision, Predictor, serving_device

if TYPE_CHECKING:
    from mlflow.entities.model_registry import ModelVersion


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
        return math.prod(self.sample_shape)

    @functools.cached_property
    def column_names(self) -> list[str]:
        """The model's columns in its signature's order: its feature names, or for a model of
        feature vectors the positions "0", "1", ... (a pandas frame of a matrix names them so).
        Worked out once: a request that names no column never pays for them."""
        return self.feature_names or [str(i) for i in range(self.width)]

    def identity(self) -> dict[str, Any]:
        return ModelIdentity(name=self.name, version=self.version, run_id=self.run_id).model_dump()

    def io_schema(self) -> dict[str, Any]:
        """What requests and answers look like: two versions with the same schema can share
        an endpoint."""
        return self.model_dump(
            include={"sample_shape", "feature_names", "class_names", "task", "input_dtype"}
        )


def registered_model(version: ModelVersion, tracking_uri: str) -> ServedModel:
    """The registry's ``version`` as a :class:`ServedModel`: its schema from our tags, or the
    input signature of any MLflow model; ``tracking_uri`` is shipped masked."""
    return ServedModel(
        name=str(version.name),  # the registry's own name: in the tenant's namespace
        version=str(version.version),
        run_id=str(version.run_id),
        tracking_uri=tracking.shipped_uri(tracking_uri),  # Ray shows actor arguments
        sample_shape=_sample_shape(version),
        feature_names=_json_tag(version, tracking.FEATURE_NAMES_TAG),
        class_names=_json_tag(version, tracking.CLASS_NAMES_TAG),
        dataset_fingerprint=version.tags.get(tracking.FINGERPRINT_TAG),
        task=version.tags.get(tracking.TASK_TAG, "classification"),
        input_dtype=version.tags.get(tracking.INPUT_DTYPE_TAG, "float32"),
    )


class NotRegistered(LookupError):
    """The registry has no such version or alias (or cannot have: a malformed one)."""


# What MLflow's registry answers for a version or alias it does not have (or cannot have).
MISSING = ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE")


def version_by_reference(tracking_uri: str, name: str, reference: str, alias: bool) -> ServedModel:
    """Version ``reference`` (a number, or with ``alias`` an alias) of ``name``, read from the
    registry; raises :class:`NotRegistered` when it has none such, MLflow's errors otherwise."""
    import mlflow
    from mlflow.exceptions import MlflowException

    mlflow.set_tracking_uri(tracking_uri)  # a signature is read through the global one
    mlflow.set_registry_uri(tracking_uri)
    client = tracking.client_for(tracking_uri)
    try:
        if alias:
            version = client.get_model_version_by_alias(name, reference)
        else:
            version = client.get_model_version(name, reference)
    except MlflowException as exc:
        if exc.error_code in MISSING:
            raise NotRegistered(name, reference) from None
        raise
    return registered_model(version, tracking_uri)


def check_registered(tracking_uri: str, names: list[str], field: str) -> None:
    """A ConfigurationError naming ``field`` unless each of ``names`` is a registered model."""
    from mlflow.exceptions import MlflowException

    client = tracking.client_for(tracking_uri)
    for name in names:
        try:
            client.get_registered_model(name)
        except MlflowException:
            raise ConfigurationError(
                field,
                f"no registered model {name!r} in {masked(tracking_uri)}; name "
                "registered models, or train and register one first",
            ) from None


def _sample_shape(version: ModelVersion) -> list[int]:
    """The model's input shape per sample: our tag, or the logged signature of any MLflow model."""
    if tracking.SAMPLE_SHAPE_TAG in version.tags:
        return [int(d) for d in json.loads(version.tags[tracking.SAMPLE_SHAPE_TAG])]
    from mlflow.models import get_model_info

    signature = get_model_info(f"models:/{version.name}/{version.version}").signature
    if signature is None or not signature.inputs.inputs:
        raise ConfigurationError(
            "model_name",
            f"{version.name} v{version.version} was logged without an input signature; "
            "log it with one (mlflow.pytorch.log_model(..., signature=...))",
        )
    shape = signature.inputs.inputs[0].shape
    return [int(d) for d in (shape or ())[1:]]


def _json_tag(version: ModelVersion, key: str) -> list[str] | None:
    value = version.tags.get(key)
    return [str(v) for v in json.loads(value)] if value else None


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
