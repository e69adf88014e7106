"""The Ray Serve application that answers predictions for one registered model version: the
FastAPI app and :class:`ModelServer`, one replica's routes.

Every request is validated before it reaches the model: content type, body size, JSON, shape,
dtype, finiteness and batch size each get a 4xx with a message, never a 5xx. Besides its own
``/predict`` (:mod:`_predict`), the app speaks MLflow's scoring protocol (``/invocations``) and
the Open Inference Protocol v2 (``/v2/...``): :mod:`_mlflow_scoring` and
:mod:`_open_inference` translate their bodies and answers, and every protocol's requests go
through the same authentication, limits, batches, canary and log. A request may select another
registered version, which the replica loads on demand (:mod:`_versions`); each version it holds
has its own batcher. The driver deploys it (:mod:`_deploy`).
"""

# No ``from __future__ import annotations``: FastAPI reads the route signatures at runtime, and
# Serve's ingress wrapper hides this module's names from string annotations.
import asyncio
import hmac
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from typing import Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from ray import serve

from prefect_ml.integrations.errors import ConfigurationError
from prefect_ml.integrations.serving._batching import AdaptiveBatcher
from prefect_ml.integrations.serving._canary import CanaryRoute, VersionStats, label_outcome
from prefect_ml.integrations.serving._mlflow_scoring import (
    MlflowScoring,
    ScoringResponse,
    mlflow_version,
)
from prefect_ml.integrations.serving._models import ServedModel, labelled_outputs
from prefect_ml.integrations.serving._open_inference import (
    InferError,
    InferRequest,
    InferResponse,
    ModelMetadata,
    OpenInference,
    ServerMetadata,
    model_metadata,
    server_metadata,
)
from prefect_ml.integrations.serving._openapi import (
    INFER_ERRORS,
    PREDICT_ERRORS,
    route_openapi,
    scoring_openapi,
)
from prefect_ml.integrations.serving._predict import (
    PREDICT,
    PredictError,
    PredictRequest,
    PredictResponse,
)
from prefect_ml.integrations.serving._protocol import RequestError, Scoring, WireProtocol
from prefect_ml.integrations.serving._replica import (
    LoadedVersion,
    Pinned,
    ReplicaOptions,
    batched_outputs,
    load_version,
    token_digest,
)
from prefect_ml.integrations.serving._versions import (
    MODEL_ID_HEADER,
    PinnedVersions,
    Selection,
    VersionCatalog,
    chosen,
)

DEPLOYMENT_NAME = "ModelServer"


def _problem(status: int, message: str, errors: list[dict[str, Any]] | None = None) -> None:
    raise RequestError(status, message, errors)


def _too_large(limit: int) -> None:
    _problem(413, f"request body over the {limit}-byte limit; send fewer rows per request")


def _checked_body_size(request: Request, limit: int) -> None:
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > limit):
        _too_large(limit)


async def _read_body(request: Request, limit: int, timeout_s: float) -> bytes:
    """The body, or a 413 past ``limit`` bytes, or a 408 when it has not all arrived within
    ``timeout_s`` (a slow client holds a connection and a slot of the replica meanwhile)."""
    _checked_body_size(request, limit)
    chunks, size = [], 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    _too_large(limit)
                chunks.append(chunk)
    except TimeoutError:
        _problem(408, f"the request body did not arrive within {timeout_s:g} s")
    return b"".join(chunks)


MLFLOW = MlflowScoring()


def _error_response(protocol: WireProtocol, problem: RequestError) -> Response:
    status, content, media_type = protocol.error(problem)
    return Response(content, status, headers=problem.headers, media_type=media_type)


api = FastAPI(
    title="prefect-ml model server",
    description="Predictions from a model version of the MLflow registry, served by Ray Serve: "
    "its own /predict, MLflow's scoring protocol (/invocations) and the Open Inference "
    "Protocol v2 (/v2).",
)


@api.exception_handler(RequestError)
async def _request_error(request: Request, problem: RequestError) -> Response:
    """A refused request of a route without a protocol of its own (``/metadata``)."""
    return _error_response(PREDICT, problem)


PINNED = "pinned"  # the role of a selected version's answers: not counted by a canary


def _path(request: Request) -> tuple[str, str | None]:
    """The model and version (None: none) a route's path names."""
    return request.path_params["name"], request.path_params.get("version")


async def _described(served: ServedModel) -> dict[str, Any]:
    return model_metadata(served)


def _retire(pinned: Pinned) -> None:
    """A selected version unloaded: its batcher ends once its queued requests are answered."""
    pinned.batcher.retire()


# Defined above the class: Serve's decorators capture the names it uses when they run.
@serve.deployment(name=DEPLOYMENT_NAME, max_surge_percent=100)
@serve.ingress(api)
class ModelServer:
    """One replica: the model version in memory, a request validator and a batcher per
    version (the serving one, during a rollout the canary, and each selected version it
    holds)."""

    def __init__(self, served: dict[str, Any], options: dict[str, Any]) -> None:
        import torch

        self.served = ServedModel.model_validate(served)
        replica = ReplicaOptions.model_validate(options)
        self.limits, self.token_sha256 = replica.serving, replica.token_sha256
        torch.set_num_threads(replica.torch_threads)
        self.stable = load_version(self.served, self.limits)
        self.batchers = {
            "stable": self._batcher("stable", lambda: self.stable),
            "canary": self._batcher("canary", lambda: self.canary.predictor),
        }
        context = serve.get_replica_context()
        self.canary = CanaryRoute(context.app_name, context.replica_id.unique_id, self._load_canary)
        self.catalog = VersionCatalog(self.served, self.limits.other_models)
        most = self.limits.max_models_per_replica
        self.pinned = PinnedVersions(most, self._load_pinned, _retire) if most else None

    def _load_pinned(self, served: ServedModel) -> Pinned:
        """A selected version, loaded (in a thread) with a batcher of its own."""
        version = load_version(served, self.limits)
        return Pinned(version, self._batcher(f"v{served.version}", lambda: version))

    def _load_canary(self, served: dict[str, Any]) -> LoadedVersion:
        candidate = ServedModel.model_validate(served)
        if candidate.io_schema() != self.served.io_schema():
            raise ConfigurationError(
                "serving.canary_share",
                f"{candidate.uri} takes other inputs than {self.served.uri}",
            )
        return load_version(candidate, self.limits)

    def _is_authorized(self, request: Request) -> bool:
        expected = self.token_sha256
        if expected is None:
            return True
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token_digest(token), expected)

    def _authorize(self, request: Request) -> None:
        if not self._is_authorized(request):
            raise RequestError(
                401, "missing or wrong bearer token", headers={"WWW-Authenticate": "Bearer"}
            )

    def _batcher(
        self, role: str, version: Callable[[], LoadedVersion | None]
    ) -> AdaptiveBatcher[np.ndarray, np.ndarray]:
        """Requests that queue while ``role``'s model runs go through it as one matrix; the
        version is read when the batch runs (a canary can be dropped while its batch waits)."""
        return AdaptiveBatcher(
            lambda matrices: batched_outputs(version(), matrices),
            max_batch_size=self.limits.max_batch_size,
            max_wait_s=self.limits.batch_wait_timeout_s,
            inline_below_s=self.limits.batch_inline_below_s,
            name=f"{role}-batch",
        )

    # The routes requests take most come first: FastAPI tries a request's path on the routes in
    # order (an OIP infer request after 14 others cost it a fifth of /predict's time), and the
    # infer routes read their path themselves (a declared path parameter is validated per
    # request; _openapi documents it).

    @api.post(
        "/predict",
        summary="Predictions for a batch of rows: classes and probabilities, or values",
        response_model=PredictResponse,
        openapi_extra=route_openapi(PredictRequest, PredictError, PREDICT_ERRORS),
    )
    async def predict(self, request: Request) -> Response:
        return await self._serve(request, PREDICT)

    @api.post(
        "/v2/models/{name}/infer",
        summary="Open Inference Protocol: inference (the serving version, or its canary)",
        response_model=InferResponse,
        openapi_extra=route_openapi(InferRequest, InferError, INFER_ERRORS, path=("name",)),
    )
    async def oip_infer(self, request: Request) -> Response:
        return await self._serve(request, self._oip(request), _path(request))

    @api.post(
        "/v2/models/{name}/versions/{version}/infer",
        summary="Open Inference Protocol: inference by this version",
        response_model=InferResponse,
        openapi_extra=route_openapi(
            InferRequest, InferError, INFER_ERRORS, path=("name", "version")
        ),
    )
    async def oip_infer_version(self, request: Request) -> Response:
        return await self._serve(request, self._oip(request), _path(request))

    @api.post(
        "/invocations",
        summary="MLflow's scoring protocol: dataframe_split, dataframe_records, instances, "
        "inputs or CSV in; one prediction per row out (mlflow models serve's route)",
        response_model=ScoringResponse,
        openapi_extra=scoring_openapi(),
    )
    async def invocations(self, request: Request) -> Response:
        return await self._serve(request, MLFLOW)

    @api.post(
        "/models/{name}/versions/{version}/predict",
        summary="/predict answered by this version (a number, or an alias)",
        response_model=PredictResponse,
        openapi_extra=route_openapi(
            PredictRequest, PredictError, PREDICT_ERRORS, path=("name", "version")
        ),
    )
    async def predict_version(self, request: Request) -> Response:
        return await self._serve(request, PREDICT, _path(request))

    @api.post(
        "/models/{name}/versions/{version}/invocations",
        summary="MLflow's scoring protocol answered by this version (a number, or an alias)",
        response_model=ScoringResponse,
        openapi_extra=scoring_openapi(path=("name", "version")),
    )
    async def invocations_version(self, request: Request) -> Response:
        return await self._serve(request, MLFLOW, _path(request))

    @api.get("/healthz", summary="Liveness: the replica is up and its model is loaded")
    async def healthz(self, request: Request) -> dict[str, Any]:
        """Never needs the token; which model is served is shown only to those who have it."""
        if self._is_authorized(request):
            return {"status": "ok", "model": self.stable.identity}
        return {"status": "ok"}

    @api.get("/metadata", summary="The served model version, its input schema and an example")
    async def metadata(self, request: Request) -> dict[str, Any]:
        self._authorize(request)
        served = self.served
        return {
            "model": self.stable.identity,
            "model_uri": served.uri,
            "dataset_fingerprint": served.dataset_fingerprint,
            "input_schema": {
                "type": served.input_dtype,
                "features": served.width,
                "sample_shape": served.sample_shape,
                "feature_names": served.feature_names,
            },
            "task": served.task,
            "classes": served.class_names,
            "limits": {
                "max_rows": self.limits.max_rows,
                "max_body_bytes": self.limits.max_body_bytes,
            },
            "batching": {
                "enabled": self.limits.batching,
                "max_batch_size": self.limits.max_batch_size,
                "batch_wait_timeout_s": self.limits.batch_wait_timeout_s,
                "batch_inline_below_s": self.limits.batch_inline_below_s,
                # this replica's, since it started: how well requests share model calls
                **asdict(self.batchers["stable"].stats),
            },
            "device": asdict(self.stable.predictor.describe()),
            "input_example": {"inputs": self.stable.input_example},
            "versions": {
                "models": sorted(self.catalog.names),
                "max_models_per_replica": self.limits.max_models_per_replica,
                # this replica's selected versions in memory (the earliest loaded first) and
                # what each one's batcher has run
                "loaded": {
                    name: asdict(pinned.batcher.stats)
                    for name, pinned in (self.pinned.loaded if self.pinned else {}).items()
                },
            },
        }

    @api.get("/ping", summary="MLflow's health check: the replica is up (no token needed)")
    async def scoring_ping(self) -> Response:
        return Response("\n", media_type="application/json")

    @api.get("/health", summary="MLflow's health check, as /ping")
    async def scoring_health(self) -> Response:
        return await self.scoring_ping()

    @api.get("/version", summary="The MLflow version the replica loads models with")
    async def scoring_version(self) -> Response:
        return Response(mlflow_version(), media_type="application/json")

    @api.get("/v2/health/live", summary="Open Inference Protocol: the server is live")
    async def oip_live(self) -> dict[str, bool]:
        return {"live": True}

    @api.get("/v2/health/ready", summary="Open Inference Protocol: the server is ready")
    async def oip_ready(self) -> dict[str, bool]:
        return {"ready": True}  # a replica takes requests once its model has loaded

    @api.get(
        "/v2", summary="Open Inference Protocol: server metadata", response_model=ServerMetadata
    )
    async def oip_server(self) -> dict[str, Any]:
        return server_metadata()

    @api.get(
        "/v2/models/{name}",
        summary="Open Inference Protocol: the model's inputs and outputs",
        response_model=ModelMetadata,
        openapi_extra=route_openapi(None, InferError, (401, 404), selectable=False),
    )
    async def oip_model(self, name: str, request: Request) -> Response:
        return await self._oip_model(request, (name, None), _described)

    @api.get(
        "/v2/models/{name}/versions/{version}",
        summary="Open Inference Protocol: the version's inputs and outputs",
        response_model=ModelMetadata,
        openapi_extra=route_openapi(None, InferError, (401, 404), selectable=False),
    )
    async def oip_model_version(self, name: str, version: str, request: Request) -> Response:
        return await self._oip_model(request, (name, version), _described)

    @api.get(
        "/v2/models/{name}/ready",
        summary="Open Inference Protocol: the model is ready",
        openapi_extra=route_openapi(None, InferError, (401, 404), selectable=False),
    )
    async def oip_model_ready(self, name: str, request: Request) -> Response:
        return await self._oip_model(request, (name, None), self._ready)

    @api.get(
        "/v2/models/{name}/versions/{version}/ready",
        summary="Open Inference Protocol: the version is ready (loading it if need be)",
        openapi_extra=route_openapi(None, InferError, (401, 404, 503), selectable=False),
    )
    async def oip_version_ready(self, name: str, version: str, request: Request) -> Response:
        return await self._oip_model(request, (name, version), self._ready)

    @staticmethod
    def _oip(request: Request) -> OpenInference:
        return OpenInference(request.headers.get("inference-header-content-length"))

    async def _ready(self, served: ServedModel) -> dict[str, Any]:
        """Ready: the serving version always; a selected one once it is loaded (now)."""
        if served is not self.served:
            await self._pinned_version(served)
        return {"name": served.name, "ready": True}

    async def _oip_model(
        self,
        request: Request,
        path: tuple[str, str | None],
        answer: Callable[[ServedModel], Awaitable[dict[str, Any]]],
    ) -> Response:
        """``answer`` about the version the path names, for a caller with the token."""
        try:
            self._authorize(request)
            content = await answer(await self._selected(path, ""))
        except RequestError as problem:
            return _error_response(OpenInference(), problem)
        return JSONResponse(content)

    async def _selected(self, path: tuple[str, str | None] | None, header: str) -> ServedModel:
        """The version a request selects by its path (name, version or None) or its
        ``serve_multiplexed_model_id`` header (``header``, "" without one): the served one
        (``self.served``, also without any selection) or another that may be loaded here;
        a 400, 404 or 503 otherwise."""
        named = None if path is None or path[1] is None else Selection(path[0], path[1])
        selection = chosen(header, named)
        if path is not None and path[1] is None:  # /v2/models/{name}/...: a model, no version
            self.catalog.check_name(path[0])
            if selection is not None and selection.name != path[0]:
                raise RequestError(
                    400, f"the path names {path[0]} and the {MODEL_ID_HEADER} header {selection}"
                )
            if selection is None and path[0] != self.served.name:
                raise RequestError(
                    404, f"select a version of {path[0]}: /v2/models/{path[0]}/versions/<version>"
                )
        if selection is None:
            return self.served
        catalog = self.catalog
        served = catalog.cached(selection)
        if served is None:
            served = await asyncio.to_thread(catalog.resolve, selection)
        if (served.name, served.version) == (self.served.name, self.served.version):
            return self.served
        if self.pinned is None:
            raise RequestError(
                404,
                f"{selection} is not served here: only {self.served.name} v{self.served.version} "
                "is (serving.max_models_per_replica is 0)",
            )
        catalog.failure(served)
        return served

    async def _pinned_version(self, served: ServedModel) -> Pinned:
        """``served`` loaded in this replica (now, if need be); a 503 when it cannot be."""
        assert self.pinned is not None  # _selected returns other versions only with it
        try:
            return await self.pinned.get(served)
        except Exception as exc:
            raise self.catalog.record_failure(served, exc) from None

    async def _serve(
        self,
        request: Request,
        protocol: WireProtocol,
        path: tuple[str, str | None] | None = None,
    ) -> Response:
        """One request of any protocol: authenticated, its body read within the limits, parsed
        by ``protocol`` for the version it selects (by ``path``, the model and version its
        path names, or by header), answered by that version, or else by the canary for its
        share or by the serving version, batched with the other requests of the same version,
        and answered or refused in the protocol's shape."""
        try:
            self._authorize(request)
            header = serve.get_multiplexed_model_id()
            selected = await self._selected(path, header)
            body = await _read_body(
                request, self.limits.max_body_bytes, self.limits.request_timeout_s
            )
            scoring = protocol.parse(body, request.headers.get("content-type", ""), selected)
            if len(scoring.matrix) > self.limits.max_rows:
                _problem(
                    413,
                    f"{len(scoring.matrix)} rows in one request; the limit is "
                    f"{self.limits.max_rows}",
                )
            if selected is not self.served:
                pinned = await self._pinned_version(selected)
                return await self._answer(PINNED, pinned.version, pinned.batcher, scoring, protocol)
            chose = bool(header) or (path is not None and path[1] is not None)
            candidate = self.canary.predictor  # read once: the sync thread may drop it meanwhile
            if not chose and candidate is not None and self.canary.takes_request():
                try:
                    batcher = self.batchers["canary"]
                    return await self._answer("canary", candidate, batcher, scoring, protocol)
                except Exception:  # answered by the serving version below, counted as the canary's
                    self.canary.record("canary", VersionStats(requests=1, errors=1))
            batcher = self.batchers["stable"]
            return await self._answer("stable", self.stable, batcher, scoring, protocol)
        except RequestError as problem:
            return _error_response(protocol, problem)

    async def _answer(
        self,
        role: str,
        version: LoadedVersion,
        batcher: AdaptiveBatcher[np.ndarray, np.ndarray],
        scoring: Scoring,
        protocol: WireProtocol,
    ) -> Response:
        """``version``'s answer in ``protocol``'s shape, through its ``batcher``, timed and
        (during a canary rollout, unless a request selected it) recorded as ``role``'s."""
        started = time.perf_counter()
        served = version.served
        try:
            if self.limits.batching:
                outputs = await batcher.submit(scoring.matrix)
            else:
                outputs = version.predictor.outputs(scoring.matrix)
            body = protocol.render(outputs, served, version.identity, scoring)
        except Exception:
            if role == "stable":
                self.canary.record(role, VersionStats(requests=1, errors=1))
            raise
        if self.canary.active and role != PINNED:
            labels = scoring.labels
            outcome = (
                label_outcome(
                    labelled_outputs(outputs, served.class_names, served.task), labels, served.task
                )
                if labels
                else VersionStats()
            )
            outcome.requests = 1
            outcome.latencies_ms = [(time.perf_counter() - started) * 1000]
            self.canary.record(role, outcome)
        return Response(body, media_type="application/json")
