"""``serve_model``: a registered version (the alias's, or a number) on Ray Serve, smoke-tested."""

from __future__ import annotations

from prefect import flow

from prefect_ml.tasks.params import ServeModelParams
from prefect_ml.tasks.report import published_timeline
from prefect_ml.tasks.serve import ServingResult, serve

__all__ = ["serve_model"]


@flow(name="serve-model")
def serve_model(params: ServeModelParams = ServeModelParams()) -> ServingResult:  # noqa: B008
    """Deploy ``models:/<name>@<alias>`` (or a version) on Ray Serve; running it again after the
    alias moved rolls the application to the new version without dropping requests.

    Args:
        params: Which registered version to serve, and how (address, batching, replicas).
    """
    with published_timeline("serve-model"):
        return serve(
            params.model_name,
            alias=params.alias,
            version=params.model_version,
            serving=params.serving,
        )
