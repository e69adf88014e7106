"""prefect-ml's own protocol, ``/predict``: ``{"inputs": [...]}`` (and optional ``labels``) in,
classes and their probabilities, or for regression the values, out; FastAPI's error shape.

Like the other protocols (:mod:`_mlflow_scoring`, :mod:`_open_inference`) it only translates;
the app authenticates, bounds, batches and routes its requests."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
from pydantic import BaseModel, Field, ValidationError

from prefect_ml.integrations.serving._models import ModelIdentity, ServedModel, labelled_outputs
from prefect_ml.integrations.serving._protocol import (
    FiniteNumber,
    RequestError,
    Row,
    Scoring,
    finite_outputs,
    invalid_body,
    rows_matrix,
)


class PredictRequest(BaseModel):
    """Rows to score: each a feature vector, or an object of named columns (tabular models)."""

    inputs: list[Row] = Field(
        min_length=1,
        description='Rows of raw features, e.g. [[0.0, 3.0, ...]] or [{"age": 41.0, ...}].',
    )
    labels: list[str | FiniteNumber] | None = Field(
        None,
        description="Optional: each row's true class or value, where it is known when the "
        "request is made; a canary rollout compares the versions' accuracy (or RMSE) on them.",
    )


class PredictProblem(BaseModel):
    message: str
    errors: list[dict[str, Any]] = Field(description="Per field, what is wrong.")


class PredictError(BaseModel):
    detail: PredictProblem


class PredictResponse(BaseModel):
    predictions: list[str] | list[float] = Field(
        description="Per row: the predicted class, or for a regression model the value."
    )
    probabilities: list[list[float]] | None = Field(
        None, description="Classification: per row, the probability of each class."
    )
    model: ModelIdentity


def predictions_body(
    outputs: np.ndarray,
    class_names: list[str] | None,
    identity: dict[str, Any],
    task: str = "classification",
) -> str:
    """The JSON of a ``/predict`` answer: classes and their probabilities, or for regression
    the values; a model that returned NaN or infinity gets a 500 that says so, never a body
    that is not JSON."""
    finite_outputs(outputs)
    content: dict[str, Any] = {"predictions": labelled_outputs(outputs, class_names, task).tolist()}
    if task != "regression":
        content["probabilities"] = outputs.astype(np.float64).round(6).tolist()
    return json.dumps({**content, "model": identity}, allow_nan=False)


class PredictProtocol:
    """:class:`~_protocol.WireProtocol` of ``/predict``: ``{"inputs": [...]}`` (and
    optional ``labels``) in, classes and probabilities or values out; FastAPI's error shape,
    ``{"detail": {"message": ..., "errors": [...]}}``."""

    def parse(self, body: bytes, content_type: str, served: ServedModel) -> Scoring:
        if content_type.split(";")[0].strip().lower() != "application/json":
            raise RequestError(415, f"content type must be application/json, got {content_type!r}")
        try:
            parsed = PredictRequest.model_validate_json(body)
        except ValidationError as exc:
            raise invalid_body(exc, 422, "{'inputs': [[number, ...], ...]}") from None
        if parsed.labels is not None and len(parsed.labels) != len(parsed.inputs):
            raise RequestError(
                422, f"{len(parsed.labels)} labels for {len(parsed.inputs)} rows; send one per row"
            )
        return Scoring(rows_matrix(parsed.inputs, served, served.feature_names), parsed.labels)

    def render(
        self, outputs: np.ndarray, served: ServedModel, identity: dict[str, Any], scoring: Scoring
    ) -> str:
        return predictions_body(outputs, served.class_names, identity, served.task)

    def error(self, problem: RequestError) -> tuple[int, str, str]:
        detail = {"message": problem.message, "errors": problem.errors}
        return problem.status, json.dumps({"detail": detail}), "application/json"


PREDICT = PredictProtocol()
