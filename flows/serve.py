"""``serve_model``: a registered version (the alias's, or a number) on Ray Serve, smoke-tested."""

from __future__ import annotations

from prefect import flow

from tasks.params import ServeModelParams
from tasks.quotas import check_caps
from tasks.serve import ServingResult, serve


@flow(name="serve-model")
def serve_model(params: ServeModelParams = ServeModelParams()) -> ServingResult:  # noqa: B008
    """Deploy ``models:/<name>@<alias>`` (or a version) on Ray Serve; running it again after the
    alias moved rolls the application to the new version without dropping requests.

    Args:
        params: Which registered version to serve, and how (address, batching, replicas).
    """
    check_caps(params)
    return serve(params.model_name, params.alias, params.model_version, params.serving)
