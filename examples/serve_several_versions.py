"""Serve digits-classifier@champion with room for two more versions per replica, of it or of
the registered model "wine", each selected per request (docs/how-to/several-versions.md). In
your own flow or script, on a Ray that outlives it; the command line's equivalent:

    prefect-ml serve --model-name digits-classifier --max-models-per-replica 2 --other-models wine
"""

from typing import Any

from prefect_ml import ServingResult, serve_model
from prefect_ml.tasks.params import ServeModelParams


def serve_several_versions(**serving: Any) -> ServingResult:
    """``serving``: any other serving setting (``port``, ``host``, ``replica_cpus``, ...)."""
    settings = {"max_models_per_replica": 2, "other_models": ["wine"], **serving}
    return serve_model(ServeModelParams(serving=settings))
