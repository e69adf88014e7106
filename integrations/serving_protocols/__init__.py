"""The wire protocols the serving app speaks besides its own ``/predict``: MLflow's scoring
protocol (``/invocations``) and the Open Inference Protocol v2 (``/v2/...``).

Each protocol only translates: its body into rows in the model's feature order, the model's
outputs and the app's errors into its own shapes (:class:`WireProtocol`). Authentication,
request limits, adaptive batching, canary routing, metrics and the access log are the serving
app's (:mod:`prefect_ml.integrations.serving`), the same for every protocol. Neither FastAPI nor
Ray is imported here, so the translations are tested without a server.
"""

from prefect_ml.integrations.serving_protocols._base import (
    FiniteNumber,
    RequestError,
    Row,
    Scoring,
    WireProtocol,
    finite_outputs,
    inlined_schema,
    invalid_body,
    rows_matrix,
)
from prefect_ml.integrations.serving_protocols._mlflow import (
    MlflowScoring,
    ScoringError,
    ScoringRequest,
    ScoringResponse,
    mlflow_version,
)
from prefect_ml.integrations.serving_protocols._oip import (
    InferError,
    InferRequest,
    InferResponse,
    ModelMetadata,
    OpenInference,
    ServerMetadata,
    model_metadata,
    server_metadata,
)

__all__ = [
    "FiniteNumber",
    "InferError",
    "InferRequest",
    "InferResponse",
    "MlflowScoring",
    "ModelMetadata",
    "OpenInference",
    "RequestError",
    "Row",
    "Scoring",
    "ScoringError",
    "ScoringRequest",
    "ScoringResponse",
    "ServerMetadata",
    "WireProtocol",
    "finite_outputs",
    "inlined_schema",
    "invalid_body",
    "mlflow_version",
    "model_metadata",
    "rows_matrix",
    "server_metadata",
]
