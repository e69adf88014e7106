"""Serving a registered model version: the Ray Serve application that answers predictions over
HTTP, the wire protocols it speaks, canary rollouts, several versions on one endpoint, and the
loaded model that the replicas and the batch scorers run.

The driver resolves ``models:/<name>@<alias>`` to a version (:class:`ServedModel`) and deploys
:class:`ModelServer` with it (:func:`deploy`); every replica loads it through the one pt2 loader
(:func:`load_predictor`), which the batch scoring actors use as well. Besides its own
``/predict``, the app speaks MLflow's scoring protocol (``/invocations``) and the Open Inference
Protocol v2 (``/v2/...``): each protocol only translates bodies into rows and outputs and
errors into its own shapes (:class:`WireProtocol`); authentication, request limits, adaptive
batching, canary routing and the access log are the app's, the same for every protocol.

Behind this face: ``_models`` (a registered version: identity, schema, the loader),
``_inference`` (the forward pass on the replica's device; only torch and numpy),
``_batching`` (:class:`AdaptiveBatcher`), ``_protocol`` (what every wire protocol shares),
``_mlflow_scoring`` and ``_open_inference`` (the two protocols), ``_canary`` (the rollout's
control actor, each replica's route, the verdict), ``_versions`` (other versions selected per
request), ``_app`` (the FastAPI app and the :class:`ModelServer` deployment) and the driver's
side of Ray Serve (starting the proxy, deploying, what runs).

Names load on first use (as ``prefect_ml``'s own do): the app's module builds the FastAPI app
and Serve's deployment when it is imported, and a batch scoring actor, the flows and the GPU
check import this package without paying for FastAPI or Ray Serve.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

# Public name -> the private module that defines it.
_EXPORTS = {
    "ServedModel": "_models",
    "check_registered": "_models",
    "labelled_outputs": "_models",
    "load_predictor": "_models",
    "non_finite_rows": "_models",
    "registered_model": "_models",
    "InferencePrecision": "_inference",
    "Predictor": "_inference",
    "serving_device": "_inference",
    "AdaptiveBatcher": "_batching",
    "RequestError": "_protocol",
    "Scoring": "_protocol",
    "WireProtocol": "_protocol",
    "MlflowScoring": "_mlflow_scoring",
    "OpenInference": "_open_inference",
    "model_metadata": "_open_inference",
    "CanaryRoute": "_canary",
    "Rollout": "_canary",
    "Verdict": "_canary",
    "VersionStats": "_canary",
    "judge": "_canary",
    "label_outcome": "_canary",
    "metric_name": "_canary",
    "Selection": "_versions",
    "VersionCatalog": "_versions",
    "chosen": "_versions",
    "parse_model_id": "_versions",
    "ModelServer": "_app",
    "ReplicaOptions": "_app",
    "api": "_app",
    "deploy": "_app",
    "deployment_options": "_app",
    "listening": "_app",
    "predictions_body": "_app",
    "replica_arguments": "_app",
    "running_replicas": "_app",
    "start_http": "_app",
    "token_digest": "_app",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:  # for type checkers and editors; at run time __getattr__ loads them
    from prefect_ml.integrations.serving._app import (
        ModelServer as ModelServer,
    )
    from prefect_ml.integrations.serving._app import (
        ReplicaOptions as ReplicaOptions,
    )
    from prefect_ml.integrations.serving._app import api as api
    from prefect_ml.integrations.serving._app import deploy as deploy
    from prefect_ml.integrations.serving._app import (
        deployment_options as deployment_options,
    )
    from prefect_ml.integrations.serving._app import listening as listening
    from prefect_ml.integrations.serving._app import (
        predictions_body as predictions_body,
    )
    from prefect_ml.integrations.serving._app import (
        replica_arguments as replica_arguments,
    )
    from prefect_ml.integrations.serving._app import (
        running_replicas as running_replicas,
    )
    from prefect_ml.integrations.serving._app import start_http as start_http
    from prefect_ml.integrations.serving._app import token_digest as token_digest
    from prefect_ml.integrations.serving._batching import (
        AdaptiveBatcher as AdaptiveBatcher,
    )
    from prefect_ml.integrations.serving._canary import CanaryRoute as CanaryRoute
    from prefect_ml.integrations.serving._canary import Rollout as Rollout
    from prefect_ml.integrations.serving._canary import Verdict as Verdict
    from prefect_ml.integrations.serving._canary import VersionStats as VersionStats
    from prefect_ml.integrations.serving._canary import judge as judge
    from prefect_ml.integrations.serving._canary import label_outcome as label_outcome
    from prefect_ml.integrations.serving._canary import metric_name as metric_name
    from prefect_ml.integrations.serving._inference import (
        InferencePrecision as InferencePrecision,
    )
    from prefect_ml.integrations.serving._inference import Predictor as Predictor
    from prefect_ml.integrations.serving._inference import (
        serving_device as serving_device,
    )
    from prefect_ml.integrations.serving._mlflow_scoring import (
        MlflowScoring as MlflowScoring,
    )
    from prefect_ml.integrations.serving._models import ServedModel as ServedModel
    from prefect_ml.integrations.serving._models import (
        check_registered as check_registered,
    )
    from prefect_ml.integrations.serving._models import (
        labelled_outputs as labelled_outputs,
    )
    from prefect_ml.integrations.serving._models import (
        load_predictor as load_predictor,
    )
    from prefect_ml.integrations.serving._models import (
        non_finite_rows as non_finite_rows,
    )
    from prefect_ml.integrations.serving._models import (
        registered_model as registered_model,
    )
    from prefect_ml.integrations.serving._open_inference import (
        OpenInference as OpenInference,
    )
    from prefect_ml.integrations.serving._open_inference import (
        model_metadata as model_metadata,
    )
    from prefect_ml.integrations.serving._protocol import RequestError as RequestError
    from prefect_ml.integrations.serving._protocol import Scoring as Scoring
    from prefect_ml.integrations.serving._protocol import WireProtocol as WireProtocol
    from prefect_ml.integrations.serving._versions import Selection as Selection
    from prefect_ml.integrations.serving._versions import (
        VersionCatalog as VersionCatalog,
    )
    from prefect_ml.integrations.serving._versions import chosen as chosen
    from prefect_ml.integrations.serving._versions import (
        parse_model_id as parse_model_id,
    )


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value  # the next access skips this hook
    return value


def __dir__() -> list[str]:
    return __all__
