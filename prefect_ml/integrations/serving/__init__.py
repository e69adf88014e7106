"""Serving a registered model version: the Ray Serve application that answers predictions over
HTTP, the wire protocols it speaks, canary rollouts, several versions on one endpoint, the
loaded model that the replicas and the batch scorers run, and batch scoring itself (a dataset's
files scored by Ray Data actors, written next to them once).

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
``_predict``, ``_mlflow_scoring`` and ``_open_inference`` (the three protocols), ``_canary``
(the rollout's control actor, each replica's route, the verdict), ``_versions`` (other versions
selected per request), ``_replica`` (what a replica is constructed with and the versions it
holds), ``_openapi`` (what /openapi.json says of the routes), ``_app`` (the FastAPI app and the
:class:`ModelServer` deployment), ``_deploy`` (the driver's side: the proxy, deploying or
rolling, what runs) and ``_batch_scoring`` (the files' columns, Ray Data's scoring actors,
the output written all-or-nothing and found again by its fingerprint).

Names load on first use (as ``prefect_ml``'s own do): the app's module builds the FastAPI app
and Serve's deployment when it is imported, and a batch scoring actor, the flows and the GPU
check import this package without paying for FastAPI or Ray Serve.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prefect_ml.integrations.libraries import lazy_exports

# Public name -> the private module that defines it.
_EXPORTS = {
    "check_registered": "_models",
    "labelled_outputs": "_models",
    "load_predictor": "_models",
    "non_finite_rows": "_models",
    "registered_model": "_models",
    "ServedModel": "_models",
    "serving_device": "_inference",
    "InferencePrecision": "_inference",
    "Predictor": "_inference",
    "AdaptiveBatcher": "_batching",
    "RequestError": "_protocol",
    "Scoring": "_protocol",
    "WireProtocol": "_protocol",
    "predictions_body": "_predict",
    "MlflowScoring": "_mlflow_scoring",
    "model_metadata": "_open_inference",
    "OpenInference": "_open_inference",
    "judge": "_canary",
    "label_outcome": "_canary",
    "metric_name": "_canary",
    "CanaryRoute": "_canary",
    "Rollout": "_canary",
    "Verdict": "_canary",
    "VersionStats": "_canary",
    "chosen": "_versions",
    "parse_model_id": "_versions",
    "Selection": "_versions",
    "VersionCatalog": "_versions",
    "token_digest": "_replica",
    "ReplicaOptions": "_replica",
    "api": "_app",
    "ModelServer": "_app",
    "deploy": "_deploy",
    "deployment_options": "_deploy",
    "listening": "_deploy",
    "replica_arguments": "_deploy",
    "running_replicas": "_deploy",
    "start_http": "_deploy",
    "PendingWrite": "_batch_scoring",
    "PredictionManifest": "_batch_scoring",
    "ScoringColumns": "_batch_scoring",
    "check_output": "_batch_scoring",
    "clear_output": "_batch_scoring",
    "completed": "_batch_scoring",
    "fingerprint": "_batch_scoring",
    "score": "_batch_scoring",
    "scorer_arguments": "_batch_scoring",
    "scoring_columns": "_batch_scoring",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:  # for type checkers and editors; at run time __getattr__ loads them
    from prefect_ml.integrations.serving._app import (
        ModelServer as ModelServer,
    )
    from prefect_ml.integrations.serving._app import api as api
    from prefect_ml.integrations.serving._batch_scoring import PendingWrite as PendingWrite
    from prefect_ml.integrations.serving._batch_scoring import (
        PredictionManifest as PredictionManifest,
    )
    from prefect_ml.integrations.serving._batch_scoring import ScoringColumns as ScoringColumns
    from prefect_ml.integrations.serving._batch_scoring import check_output as check_output
    from prefect_ml.integrations.serving._batch_scoring import clear_output as clear_output
    from prefect_ml.integrations.serving._batch_scoring import completed as completed
    from prefect_ml.integrations.serving._batch_scoring import fingerprint as fingerprint
    from prefect_ml.integrations.serving._batch_scoring import score as score
    from prefect_ml.integrations.serving._batch_scoring import scorer_arguments as scorer_arguments
    from prefect_ml.integrations.serving._batch_scoring import scoring_columns as scoring_columns
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
    from prefect_ml.integrations.serving._deploy import deploy as deploy
    from prefect_ml.integrations.serving._deploy import (
        deployment_options as deployment_options,
    )
    from prefect_ml.integrations.serving._deploy import listening as listening
    from prefect_ml.integrations.serving._deploy import (
        replica_arguments as replica_arguments,
    )
    from prefect_ml.integrations.serving._deploy import (
        running_replicas as running_replicas,
    )
    from prefect_ml.integrations.serving._deploy import start_http as start_http
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
    from prefect_ml.integrations.serving._predict import (
        predictions_body as predictions_body,
    )
    from prefect_ml.integrations.serving._protocol import RequestError as RequestError
    from prefect_ml.integrations.serving._protocol import Scoring as Scoring
    from prefect_ml.integrations.serving._protocol import WireProtocol as WireProtocol
    from prefect_ml.integrations.serving._replica import (
        ReplicaOptions as ReplicaOptions,
    )
    from prefect_ml.integrations.serving._replica import token_digest as token_digest
    from prefect_ml.integrations.serving._versions import Selection as Selection
    from prefect_ml.integrations.serving._versions import (
        VersionCatalog as VersionCatalog,
    )
    from prefect_ml.integrations.serving._versions import chosen as chosen
    from prefect_ml.integrations.serving._versions import (
        parse_model_id as parse_model_id,
    )


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
