"""MLflow's scoring protocol (``mlflow models serve``): ``POST /invocations`` with one of
``dataframe_split``, ``dataframe_records``, ``instances`` or ``inputs`` (and optional
``params``), or a CSV table; ``{"predictions": [...]}`` back.

Columns are matched by name to the model's own order (its feature names, or the positions
"0", "1", ... of a model of feature vectors, as pandas names a matrix's columns), never taken
in the client's key order. The answer is one prediction per row: the class for a classifier,
the value for a regressor, as ``/predict``'s ``predictions``; ``mlflow models serve`` of the
same pt2 version answers the network's raw outputs (logits), whose argmax is that class.
Errors are MLflow's: ``{"error_code": "BAD_REQUEST", "message": ...}``, and a plain-text 415
for a content type or charset it does not take.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Sequence
from importlib.metadata import version
from typing import Annotated, Any

import numpy as np
from pydantic import BaseModel, Discriminator, Field, Tag, ValidationError, model_validator

from prefect_ml.integrations.serving._models import ServedModel, labelled_outputs
from prefect_ml.integrations.serving._protocol import (
    FLOAT32_MAX,
    FiniteNumber,
    RequestError,
    Scoring,
    check_columns,
    finite_outputs,
    invalid_body,
    rows_matrix,
)

FORMATS = ("dataframe_split", "dataframe_records", "instances", "inputs")

# A row of ``instances``/``inputs``: a feature vector, a sample of up to 3 dimensions (e.g.
# channels x height x width), or an object of named columns.
Sample = list[FiniteNumber] | list[list[FiniteNumber]] | list[list[list[FiniteNumber]]]
InstanceRow = Annotated[
    Annotated[Sample, Tag("values")] | Annotated[dict[str, FiniteNumber], Tag("columns")],
    Discriminator(lambda row: "columns" if isinstance(row, dict) else "values"),
]
Instances = Annotated[
    Annotated[list[InstanceRow], Tag("rows")]
    | Annotated[dict[str, list[FiniteNumber]], Tag("columns")],
    Discriminator(lambda value: "columns" if isinstance(value, dict) else "rows"),
]


class DataframeSplit(BaseModel):
    """pandas' ``DataFrame.to_dict(orient="split")``."""

    columns: list[str | int] | None = Field(
        None, description="Column names; without them the values are in the model's order."
    )
    index: list[Any] | None = Field(None, description="Row labels (ignored).")
    data: list[list[FiniteNumber]] = Field(description="Rows of values, one per column.")


class ScoringRequest(BaseModel):
    """Exactly one of the four input formats of MLflow's scoring server."""

    dataframe_split: DataframeSplit | None = Field(
        None, description='{"columns": [...], "data": [[...], ...]}'
    )
    dataframe_records: list[dict[str, FiniteNumber]] | None = Field(
        None, description='[{"column": value, ...}, ...]'
    )
    instances: Instances | None = Field(
        None, description="TF-serving rows: [[...], ...] or [{column: value}, ...]"
    )
    inputs: Instances | None = Field(
        None, description="TF-serving tensor: [[...], ...], or columns {column: [values]}"
    )
    params: dict[str, Any] | None = Field(
        None, description="Inference parameters (this model takes none: ignored)."
    )

    @model_validator(mode="after")
    def _one_format(self) -> ScoringRequest:
        given = [name for name in FORMATS if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(
                f"give exactly one of the input fields {list(FORMATS)}; got {given or 'none'}"
            )
        return self


class ScoringResponse(BaseModel):
    predictions: list[str] | list[float] = Field(
        description="Per row: the predicted class, or for a regression model the value."
    )


class ScoringError(BaseModel):
    error_code: str = Field(description="MLflow's error code, e.g. BAD_REQUEST.")
    message: str


# MLflow's error codes (mlflow.protos.databricks_pb2) for our statuses.
ERROR_CODES = {
    400: "BAD_REQUEST",
    401: "UNAUTHENTICATED",
    404: "RESOURCE_DOES_NOT_EXIST",
    408: "DEADLINE_EXCEEDED",
    413: "REQUEST_LIMIT_EXCEEDED",
    500: "INTERNAL_ERROR",
    503: "TEMPORARILY_UNAVAILABLE",
}
SHAPE = "{'dataframe_split' | 'dataframe_records' | 'instances' | 'inputs': ...}"


def mlflow_version() -> str:
    """What ``GET /version`` says: the MLflow that the replica loads models with."""
    return version("mlflow")


class MlflowScoring:
    """:class:`~prefect_ml.integrations.serving.WireProtocol` of ``/invocations``."""

    def parse(self, body: bytes, content_type: str, served: ServedModel) -> Scoring:
        if _media_type(content_type) == "text/csv":
            matrix = _csv_matrix(body, served)
        else:
            try:
                request = ScoringRequest.model_validate_json(body)
            except ValidationError as exc:
                raise invalid_body(exc, 400, SHAPE) from None
            matrix = _request_matrix(request, served)
        if not len(matrix):
            raise RequestError(400, "no rows to score")
        return Scoring(matrix)

    def render(
        self, outputs: np.ndarray, served: ServedModel, identity: dict[str, Any], scoring: Scoring
    ) -> str:
        predicted = labelled_outputs(finite_outputs(outputs), served.class_names, served.task)
        return json.dumps({"predictions": predicted.tolist()}, allow_nan=False)

    def error(self, problem: RequestError) -> tuple[int, str, str]:
        if problem.status == 415:  # as MLflow's server: plain text
            return 415, problem.message, "text/plain"
        status = 400 if problem.status == 422 else problem.status
        code = ERROR_CODES.get(status, "BAD_REQUEST")
        return (
            status,
            json.dumps({"error_code": code, "message": problem.message}),
            "application/json",
        )


def _media_type(content_type: str) -> str:
    """``application/json`` or ``text/csv``, or a 415 as MLflow's: other types, a charset
    other than UTF-8, or other parameters."""
    media, *parameters = [part.strip() for part in content_type.split(";")]
    values = dict(parameter.partition("=")[::2] for parameter in parameters)
    if values.get("charset", "utf-8").strip('"').lower() != "utf-8":
        raise RequestError(415, "The scoring server only supports UTF-8")
    if set(values) - {"charset"}:
        raise RequestError(
            415, f"Unrecognized content type parameters: {sorted(set(values) - {'charset'})}"
        )
    if media.lower() not in ("application/json", "text/csv"):
        raise RequestError(
            415,
            "This predictor only supports the following content types: "
            f"['text/csv', 'application/json']. Got {content_type!r}.",
        )
    return media.lower()


def _request_matrix(request: ScoringRequest, served: ServedModel) -> np.ndarray:
    names = served.column_names
    if request.dataframe_split is not None:
        split = request.dataframe_split
        columns = None if split.columns is None else [str(c) for c in split.columns]
        return _table_matrix(columns, split.data, served, "dataframe_split")
    if request.dataframe_records is not None:
        return rows_matrix(request.dataframe_records, served, names, "dataframe_records")
    where = "instances" if request.instances is not None else "inputs"
    value = request.instances if request.instances is not None else request.inputs
    if isinstance(value, dict):  # columns: {name: [values]}
        check_columns(value, names, frozenset(names), where)
        lengths = {len(column) for column in value.values()}
        if len(lengths) != 1:
            raise RequestError(422, f"{where}: the columns hold different numbers of values")
        return np.column_stack([value[name] for name in names]).astype(np.float32)
    assert value is not None
    return rows_matrix(
        [_flat(row, f"{where}.{i}") for i, row in enumerate(value)], served, names, where
    )


def _flat(row: Any, where: str) -> Any:
    """A sample of several dimensions as one feature vector, row-major."""
    if isinstance(row, list) and row and isinstance(row[0], list):
        try:
            return np.asarray(row, dtype=np.float64).reshape(-1)
        except ValueError:
            raise RequestError(422, f"{where}: the nested lists have different lengths") from None
    return row


def _table_matrix(
    columns: list[str] | None, data: Sequence[Sequence[float]], served: ServedModel, where: str
) -> np.ndarray:
    """Rows of values under ``columns`` (None: the model's order) as the model's matrix."""
    if columns is None:
        return rows_matrix(data, served, None, where)
    names = served.column_names
    if len(set(columns)) != len(columns):
        raise RequestError(422, f"{where}: a column is named twice in {columns}")
    check_columns(set(columns), names, frozenset(names), f"{where}.columns")
    for index, row in enumerate(data):
        if len(row) != len(columns):
            raise RequestError(
                422, f"{where}.data.{index}: {len(row)} values for {len(columns)} columns"
            )
    order = [columns.index(name) for name in names]
    return (
        np.asarray(data, dtype=np.float64)
        .reshape(len(data), len(columns))[:, order]
        .astype(np.float32)
    )


def _csv_matrix(body: bytes, served: ServedModel) -> np.ndarray:
    """A CSV table with a header row (``DataFrame.to_csv(index=False)``)."""
    try:
        lines = [line for line in csv.reader(io.StringIO(body.decode("utf-8"))) if line]
    except (UnicodeDecodeError, csv.Error) as exc:
        raise RequestError(400, f"the body is not a UTF-8 CSV table: {exc}") from None
    if not lines:
        raise RequestError(400, "the CSV table is empty; send a header row and rows of values")
    header, rows = [name.strip() for name in lines[0]], lines[1:]
    values = []
    for index, row in enumerate(rows):
        try:
            numbers = [float(value) for value in row]
        except ValueError:
            raise RequestError(400, f"CSV row {index + 1}: a value is not a number") from None
        if not all(abs(number) <= FLOAT32_MAX for number in numbers):  # NaN fails it too
            raise RequestError(400, f"CSV row {index + 1}: a value is not a finite float32")
        values.append(numbers)
    return _table_matrix(header, values, served, "csv")
