"""What /openapi.json says about the routes that read their own bodies and path: each
route's request body, its error answers, its path parameters and the header that selects a
version."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from prefect_ml.integrations.serving._mlflow_scoring import ScoringError, ScoringRequest
from prefect_ml.integrations.serving._protocol import inlined_schema
from prefect_ml.integrations.serving._versions import MODEL_ID_HEADER


def route_openapi(
    body: type[BaseModel] | None,
    errors: type[BaseModel],
    statuses: tuple[int, ...],
    *,
    media: dict[str, Any] | None = None,
    path: tuple[str, ...] = (),
    selectable: bool = True,
) -> dict[str, Any]:
    """A route's request body (JSON of ``body``, plus other ``media`` types), error answers,
    ``path`` parameters and (``selectable``) the header that selects a version, for
    /openapi.json (the routes read their bodies and these parameters themselves)."""
    extra: dict[str, Any] = {
        "responses": {
            str(status): {
                "description": "refused",
                "content": {"application/json": {"schema": inlined_schema(errors)}},
            }
            for status in statuses
        }
    }
    parameters = [
        {"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
        for name in path
    ]
    if selectable and "version" not in path:
        parameters.append(SELECTION_HEADER)
    if parameters:
        extra["parameters"] = parameters
    if body is not None:
        json_body = {"application/json": {"schema": inlined_schema(body)}}
        extra["requestBody"] = {"required": True, "content": {**json_body, **(media or {})}}
    return extra


SELECTION_HEADER = {
    "name": MODEL_ID_HEADER,
    "in": "header",
    "required": False,
    "description": "Another registered version to answer: <name>/<version> or <name>@<alias> "
    "(the served model's, or one of serving.other_models); without it, the served version.",
    "schema": {"type": "string"},
}
SCORING_ERRORS = (400, 401, 404, 408, 413, 500, 503)
INFER_ERRORS = (400, 401, 404, 408, 413, 500, 503)
PREDICT_ERRORS = (401, 404, 408, 413, 415, 422, 500, 503)


def scoring_openapi(path: tuple[str, ...] = ()) -> dict[str, Any]:
    """``/invocations``' request body (JSON or CSV) and MLflow's errors, for /openapi.json."""
    csv = {"text/csv": {"schema": {"type": "string"}}}
    return route_openapi(ScoringRequest, ScoringError, SCORING_ERRORS, media=csv, path=path)
