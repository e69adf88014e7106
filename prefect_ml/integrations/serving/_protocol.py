"""What every wire protocol of the serving app shares: the numbers a request may hold, the rows
it becomes, the error that answers a bad request, and the contract a protocol fulfils."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Annotated, Any, NamedTuple, Protocol

import numpy as np
from pydantic import BaseModel, Discriminator, Field, Tag, ValidationError

from prefect_ml.integrations.serving._models import ServedModel, non_finite_rows

# Rows become float32: a number finite in JSON's float64 but beyond float32 would become inf.
FLOAT32_MAX = float(np.finfo(np.float32).max)
FiniteNumber = Annotated[
    float, Field(strict=True, allow_inf_nan=False, ge=-FLOAT32_MAX, le=FLOAT32_MAX)
]
Row = Annotated[
    Annotated[list[FiniteNumber], Tag("values")]
    | Annotated[dict[str, FiniteNumber], Tag("columns")],
    Discriminator(lambda row: "columns" if isinstance(row, dict) else "values"),
]


class RequestError(Exception):
    """A request the app answers with a 4xx (or a model's non-finite output, a 500); each
    protocol renders it in its own shape. ``errors``: per field, what is wrong."""

    def __init__(
        self,
        status: int,
        message: str,
        errors: list[dict[str, Any]] | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message = status, message
        self.errors, self.headers = errors or [], headers


class Scoring(NamedTuple):
    """A parsed request: its rows in the model's feature order, the labels a ``/predict``
    request may carry (a canary compares the versions on them), and what the protocol needs
    to answer (e.g. the request's id)."""

    matrix: np.ndarray
    labels: list[str | float] | None = None
    context: Mapping[str, Any] = {}


class WireProtocol(Protocol):
    """A way of asking for predictions. The serving app authenticates, limits, batches, routes
    (canary) and logs every protocol's requests the same way; a protocol only reads its body
    into rows and writes the model's outputs and the app's errors in its own shape."""

    def parse(self, body: bytes, content_type: str, served: ServedModel) -> Scoring:
        """The request's rows; raises :class:`RequestError` (4xx) for a malformed one."""
        ...

    def render(
        self, outputs: np.ndarray, served: ServedModel, identity: dict[str, Any], scoring: Scoring
    ) -> str:
        """The JSON answer for the outputs of ``served`` (class probabilities or values)."""
        ...

    def error(self, problem: RequestError) -> tuple[int, str, str]:
        """The status, body and media type that tell this protocol's clients about
        ``problem``."""
        ...


def inlined_schema(model: type[BaseModel]) -> dict[str, Any]:
    """``model``'s JSON schema with its ``$defs`` written in place: an OpenAPI document's
    request body cannot refer to a model's own ``#/$defs`` (the models here are not recursive)."""
    schema = model.model_json_schema()
    definitions = schema.pop("$defs", {})

    def inline(node: Any) -> Any:
        if isinstance(node, dict):
            if "$ref" in node:
                return inline(definitions[node["$ref"].rsplit("/", 1)[-1]])
            return {key: inline(value) for key, value in node.items()}
        if isinstance(node, list):
            return [inline(value) for value in node]
        return node

    return inline(schema)  # type: ignore[no-any-return]


def validation_problems(error: ValidationError) -> list[dict[str, Any]]:
    """Pydantic's errors as ``{"field": "inputs.0.3", "message": ...}``, without the row
    variant's tag in the path."""
    problems = []
    for item in error.errors(include_url=False, include_context=False, include_input=False):
        location = [str(p) for p in item["loc"] if p not in ("values", "columns")]
        problems.append({"field": ".".join(location), "message": item["msg"]})
    return problems


def invalid_body(error: ValidationError, status: int, shape: str) -> RequestError:
    """A 400 for a body that is not JSON, else ``status`` saying which ``shape`` it misses."""
    problems = validation_problems(error)
    if problems and problems[0]["message"].startswith("Invalid JSON"):
        return RequestError(400, "the body is not valid JSON", problems)
    first = ""
    if problems:
        field, message = problems[0]["field"], problems[0]["message"]
        first = f" ({field}: {message})" if field else f" ({message})"
    return RequestError(status, f"the body does not match {shape}{first}", problems)


def rows_matrix(
    rows: Sequence[Sequence[float] | Mapping[str, float]],
    served: ServedModel,
    names: list[str] | None,
    where: str = "inputs",
) -> np.ndarray:
    """``rows`` (feature vectors, or objects of named columns when ``names`` is given) as a
    float32 matrix in the model's feature order; a 422 names the first bad row."""
    width = served.width
    known: frozenset[str] = frozenset()  # once per request, at the first row of named columns
    matrix = np.empty((len(rows), width), dtype=np.float32)
    for index, row in enumerate(rows):
        if isinstance(row, Mapping):
            if names is None:
                raise RequestError(
                    422,
                    f"{where}.{index}: this model takes feature vectors of {width} numbers, "
                    "not named columns",
                )
            known = known or frozenset(names)
            check_columns(row, names, known, f"{where}.{index}")
            values: Sequence[float] = [row[name] for name in names]
        else:
            values = row
        if len(values) != width:
            raise RequestError(
                422, f"{where}.{index}: expected {width} features, got {len(values)}"
            )
        matrix[index] = values
    return matrix


def check_columns(
    given: Collection[str], names: list[str], known: frozenset[str], where: str
) -> None:
    """A 422 unless ``given`` (a row's keys, a header) are the model's columns ``names``, in
    any order; ``known`` is ``frozenset(names)``."""
    missing = [n for n in names if n not in given]
    extra = [n for n in given if n not in known]
    if missing or extra:
        raise RequestError(
            422,
            f"{where}: columns do not match the model's; missing {missing}, unexpected {extra}",
        )


def finite_outputs(outputs: np.ndarray) -> np.ndarray:
    """``outputs``, or a 500 that names the rows for which the model returned NaN or infinity
    (an answer that is not JSON is worse than an error)."""
    if not np.isfinite(outputs).all():
        rows = non_finite_rows(outputs)
        raise RequestError(500, f"the model returned non-finite outputs for rows {rows[:10]}")
    return outputs
