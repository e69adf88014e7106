"""The Open Inference Protocol v2 over REST (KServe, Triton, MLServer; ``tritonclient``):
health, server and model metadata, and ``POST /v2/models/{name}[/versions/{v}]/infer``.

The model takes one input, ``input``, shaped ``[-1, *sample_shape]`` (``-1``: the batch);
a model of named columns also takes one input per column, shaped ``[-1]`` or ``[-1, 1]``,
matched by name. FP32, FP64, INT32 and INT64 data, row-major, flat or nested, in JSON or as
Triton's binary extension (``Inference-Header-Content-Length``: the JSON header, then each
input's raw little-endian bytes). A classifier answers ``label`` (BYTES, the class) and
``probabilities`` (FP32, ``[-1, classes]``); a regressor answers ``value`` (FP64). The
request's ``outputs`` picks among them; its ``id`` comes back. Errors are ``{"error": ...}``.
"""

from __future__ import annotations

import json
import math
from importlib.metadata import version
from typing import Any

import numpy as np
from pydantic import BaseModel, Field, ValidationError

from prefect_ml.integrations.serving._models import ServedModel, labelled_outputs
from prefect_ml.integrations.serving._protocol import (
    FLOAT32_MAX,
    FiniteNumber,
    RequestError,
    Scoring,
    check_columns,
    finite_outputs,
    invalid_body,
)

INPUT = "input"
DATATYPES: dict[str, type[np.number[Any]]] = {
    "FP32": np.float32,
    "FP64": np.float64,
    "INT32": np.int32,
    "INT64": np.int64,
}
BINARY_HEADER = "inference-header-content-length"
# Row-major data, flat or nested as deep as a batch of 3-dimensional samples.
TensorData = (
    list[FiniteNumber]
    | list[list[FiniteNumber]]
    | list[list[list[FiniteNumber]]]
    | list[list[list[list[FiniteNumber]]]]
)


class TensorMetadata(BaseModel):
    name: str
    datatype: str
    shape: list[int] = Field(description="-1 for a dimension of any size (the batch).")


class ModelMetadata(BaseModel):
    name: str
    versions: list[str]
    platform: str
    inputs: list[TensorMetadata]
    outputs: list[TensorMetadata]


class ServerMetadata(BaseModel):
    name: str
    version: str
    extensions: list[str]


class InferInput(BaseModel):
    name: str
    shape: list[int] = Field(min_length=1, description="[rows, *sample shape]")
    datatype: str = Field(description="FP32, FP64, INT32 or INT64")
    parameters: dict[str, Any] | None = None
    data: TensorData | None = Field(
        None, description="Row-major values, flat or nested (absent with binary_data_size)."
    )


class RequestedOutput(BaseModel):
    name: str
    parameters: dict[str, Any] | None = None


class InferRequest(BaseModel):
    id: str | None = None
    parameters: dict[str, Any] | None = None
    inputs: list[InferInput] = Field(min_length=1)
    outputs: list[RequestedOutput] | None = None


class InferOutput(BaseModel):
    name: str
    shape: list[int]
    datatype: str
    data: list[str] | list[float]


class InferResponse(BaseModel):
    model_name: str
    model_version: str
    id: str | None = None
    outputs: list[InferOutput]


class InferError(BaseModel):
    error: str


def server_metadata() -> dict[str, Any]:
    """What ``GET /v2`` says about the server."""
    server = ServerMetadata(name="prefect-ml", version=version("prefect-ml"), extensions=[])
    return server.model_dump()


def model_metadata(served: ServedModel) -> dict[str, Any]:
    """The model's inputs and outputs, as ``GET /v2/models/{name}`` describes them."""
    datatype = "FP64" if served.input_dtype == "float64" else "FP32"
    inputs = [TensorMetadata(name=INPUT, datatype=datatype, shape=[-1, *served.sample_shape])]
    inputs += [
        TensorMetadata(name=name, datatype=datatype, shape=[-1])
        for name in served.feature_names or ()
    ]
    return ModelMetadata(
        name=served.name,
        versions=[served.version],
        platform="pytorch_torchexport",
        inputs=inputs,
        outputs=_outputs(served),
    ).model_dump()


def _output_names(served: ServedModel) -> tuple[str, ...]:
    return ("value",) if served.task == "regression" else ("label", "probabilities")


def _outputs(served: ServedModel) -> list[TensorMetadata]:
    if served.task == "regression":
        return [TensorMetadata(name="value", datatype="FP64", shape=[-1])]
    classes = len(served.class_names or ()) or -1
    return [
        TensorMetadata(name="label", datatype="BYTES", shape=[-1]),
        TensorMetadata(name="probabilities", datatype="FP32", shape=[-1, classes]),
    ]


class OpenInference:
    """:class:`~prefect_ml.integrations.serving.WireProtocol` of ``…/infer``.

    ``binary_header``: the request's ``Inference-Header-Content-Length`` (Triton's binary
    extension), or None for a JSON body."""

    def __init__(self, binary_header: str | None = None) -> None:
        self.binary_header = binary_header

    def parse(self, body: bytes, content_type: str, served: ServedModel) -> Scoring:
        header, binary = self._split(body)
        try:
            request = InferRequest.model_validate_json(header)
        except ValidationError as exc:
            raise _named(invalid_body(exc, 400, "an inference request"), header) from None
        known = _output_names(served)
        wanted = [output.name for output in request.outputs or ()]
        unknown = [name for name in wanted if name not in known]
        if unknown:
            raise RequestError(
                400, f"unknown output(s) {unknown}; this model answers {sorted(known)}"
            )
        arrays = {}
        for tensor in request.inputs:
            binary, values = _tensor(tensor, binary)
            arrays[tensor.name] = values
        if binary:
            raise RequestError(400, f"{len(binary)} bytes of binary data follow the inputs")
        matrix = _matrix(arrays, served)
        return Scoring(matrix, context={"id": request.id, "outputs": wanted or None})

    def _split(self, body: bytes) -> tuple[bytes, bytes]:
        if self.binary_header is None:
            return body, b""
        if not self.binary_header.isdigit() or int(self.binary_header) > len(body):
            raise RequestError(
                400,
                f"Inference-Header-Content-Length {self.binary_header!r} is not the length of "
                f"the JSON header of this {len(body)}-byte body",
            )
        size = int(self.binary_header)
        return body[:size], body[size:]

    def render(
        self, outputs: np.ndarray, served: ServedModel, identity: dict[str, Any], scoring: Scoring
    ) -> str:
        """An :class:`InferResponse`, written with json: building the pydantic models for each
        answer cost as much as the rest of the request's translation."""
        finite_outputs(outputs)
        rows = len(outputs)
        if served.task == "regression":
            values = labelled_outputs(outputs, None, "regression").tolist()
            answers = [{"name": "value", "shape": [rows], "datatype": "FP64", "data": values}]
        else:
            labels = labelled_outputs(outputs, served.class_names, served.task).tolist()
            probabilities = outputs.astype(np.float64).round(6).reshape(-1).tolist()
            answers = [
                {"name": "label", "shape": [rows], "datatype": "BYTES", "data": labels},
                {
                    "name": "probabilities",
                    "shape": list(outputs.shape),
                    "datatype": "FP32",
                    "data": probabilities,
                },
            ]
        wanted = scoring.context.get("outputs")
        response: dict[str, Any] = {
            "model_name": identity["name"],
            "model_version": identity["version"],
        }
        if scoring.context.get("id") is not None:
            response["id"] = scoring.context["id"]
        response["outputs"] = [a for a in answers if wanted is None or a["name"] in wanted]
        return json.dumps(response, allow_nan=False)

    def error(self, problem: RequestError) -> tuple[int, str, str]:
        status = 400 if problem.status in (415, 422) else problem.status
        return status, json.dumps({"error": problem.message}), "application/json"


def _named(problem: RequestError, header: bytes) -> RequestError:
    """``problem`` with the input's name for its ``inputs.<i>`` (the request names inputs)."""
    field = problem.errors[0]["field"] if problem.errors else ""
    parts = field.split(".")
    if len(parts) < 2 or parts[0] != "inputs" or not parts[1].isdigit():
        return problem
    try:
        name = json.loads(header)["inputs"][int(parts[1])]["name"]
    except (ValueError, LookupError, TypeError):
        return problem
    problem.message = f"input {name!r}: {problem.message}"
    return problem


def _tensor(tensor: InferInput, binary: bytes) -> tuple[bytes, np.ndarray]:
    """The input's values as float64, shaped as it says; and the binary data after its own."""
    name, shape = tensor.name, tensor.shape
    dtype = DATATYPES.get(tensor.datatype)
    if dtype is None:
        raise RequestError(
            400, f"input {name!r}: datatype {tensor.datatype!r}; send one of {list(DATATYPES)}"
        )
    if any(size < 0 for size in shape):
        raise RequestError(400, f"input {name!r}: shape {shape} has a negative dimension")
    size = (tensor.parameters or {}).get("binary_data_size")
    if size is not None:
        if not isinstance(size, int) or size < 0 or size > len(binary):
            raise RequestError(400, f"input {name!r}: binary_data_size {size!r} is not in the body")
        chunk, binary = binary[:size], binary[size:]
        if size % np.dtype(dtype).itemsize:
            raise RequestError(
                400,
                f"input {name!r}: {size} bytes is not a whole number of {tensor.datatype} values",
            )
        values = np.frombuffer(chunk, dtype=np.dtype(dtype).newbyteorder("<")).astype(np.float64)
        if not (np.abs(values) <= FLOAT32_MAX).all():  # JSON data was checked as it was read
            raise RequestError(400, f"input {name!r}: a value is not a finite float32")
    elif tensor.data is None:
        raise RequestError(400, f"input {name!r}: no data (nor binary_data_size)")
    else:
        try:
            nested = np.asarray(tensor.data, dtype=np.float64)
        except ValueError:
            raise RequestError(
                400, f"input {name!r}: the nested data has rows of different lengths"
            ) from None
        if nested.ndim > 1 and list(nested.shape) != shape:
            raise RequestError(
                400, f"input {name!r}: nested data of shape {list(nested.shape)}, not {shape}"
            )
        values = nested.reshape(-1)
    if values.size != math.prod(shape):
        raise RequestError(
            400, f"input {name!r}: {values.size} values for shape {shape} ({math.prod(shape)})"
        )
    if dtype in (np.int32, np.int64) and not (values == np.round(values)).all():
        raise RequestError(400, f"input {name!r}: {tensor.datatype} data holds a fraction")
    if dtype is np.int32 and not (np.abs(values) <= np.iinfo(np.int32).max).all():
        raise RequestError(400, f"input {name!r}: a value is out of the INT32 range")
    return binary, values.reshape(shape)


def _matrix(arrays: dict[str, np.ndarray], served: ServedModel) -> np.ndarray:
    """The inputs as the model's float32 matrix: the one ``input``, or one input per column."""
    width, names = served.width, served.feature_names
    if INPUT in arrays and len(arrays) == 1:
        values = arrays[INPUT]
        if values.ndim < 2 or math.prod(values.shape[1:]) != width:
            raise RequestError(
                400,
                f"input {INPUT!r}: shape {list(values.shape)}; this model takes "
                f"[-1, {', '.join(map(str, served.sample_shape))}] ({width} values per row)",
            )
        return values.reshape(len(values), width).astype(np.float32)
    if names is None or INPUT in arrays:
        expected = f"one input {INPUT!r}" + (" or one input per column" if names else "")
        raise RequestError(400, f"inputs {sorted(arrays)}; this model takes {expected}")
    check_columns(arrays, names, frozenset(names), "inputs")
    columns = [arrays[name] for name in names]
    rows = {len(column) for column in columns}
    if len(rows) != 1 or any(column.size != len(column) for column in columns):
        raise RequestError(400, "inputs: each column's shape must be [rows] or [rows, 1], alike")
    return np.column_stack([column.reshape(-1) for column in columns]).astype(np.float32)
