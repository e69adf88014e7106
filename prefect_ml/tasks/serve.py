"""The serving steps: resolve the registered version (fail fast), deploy or roll, smoke-test."""

from __future__ import annotations

import datetime
import json
import time
from pathlib import Path
from typing import Any, cast

import httpx
import prefect.runtime
from prefect import get_run_logger, task
from prefect.artifacts import create_link_artifact, create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel

from prefect_ml.integrations import services, serving, tenancy, tracking
from prefect_ml.integrations.compute import cluster_nodes, ray_session
from prefect_ml.integrations.errors import ConfigurationError, DeploymentError
from prefect_ml.integrations.settings import PrefectMLSettings, get_settings
from prefect_ml.tasks.canary import CanaryReport, publish_canary, record_verdict, run_canary
from prefect_ml.tasks.params import (
    ServeModelParams,
    ServingParams,
    params_from_options,
    refuse_options_beside,
)
from prefect_ml.tasks.placement import require_fits
from prefect_ml.tasks.quotas import check_caps
from prefect_ml.tasks.training import current_flow_run_id

__all__ = ["ServingResult", "SmokeResult", "serve"]


class SmokeResult(BaseModel):
    """The example request sent after deploying and what came back."""

    request: dict[str, Any]
    response: dict[str, Any]
    latency_ms: float


class ServingResult(BaseModel):
    """What :func:`serve` returns: where the model answers (``url``: ``POST {url}/predict``),
    which registered version, whether requests need a bearer token, and the smoke request's
    outcome."""

    url: str
    app_name: str
    model_name: str
    version: str
    run_id: str
    model_uri: str
    alias: str | None
    authenticated: bool
    smoke: SmokeResult | None
    canary: CanaryReport | None = None  # the rollout's comparison, when it had a canary
    listening: str = ""  # which ports serving opens, where (serving.listening)


def resolve_served_model(
    model_name: str, alias: str, model_version: str | None
) -> serving.ServedModel:
    """The version to serve and its input schema, or a ConfigurationError before any deploy
    (also for a version no replica would load: no MLmodel, or not pt2)."""
    tracking_uri = get_settings().resolved_tracking_uri
    client = tracking.client_for(tracking_uri)
    version = tracking.registered_version(client, model_name, alias=alias, version=model_version)
    tracking.check_loadable(client, version)
    return serving.registered_model(version, tracking_uri)


MIN_TOKEN_BYTES = 32


def bearer_token(settings: PrefectMLSettings) -> str | None:
    """The operator's token: the Prefect Secret block PREFECT_ML_SERVE_TOKEN_SECRET names, else
    PREFECT_ML_SERVE_TOKEN, else None. A token that is configured but empty, missing or shorter
    than :data:`MIN_TOKEN_BYTES` (it could be guessed) is refused, never served without."""
    if settings.serve_token_secret:
        field, token = "PREFECT_ML_SERVE_TOKEN_SECRET", _secret_token(settings.serve_token_secret)
    elif settings.serve_token is not None:
        field, token = "PREFECT_ML_SERVE_TOKEN", settings.serve_token.get_secret_value()
    else:
        return None
    if len(token.encode()) < MIN_TOKEN_BYTES:
        raise ConfigurationError(
            field,
            f"the bearer token has {len(token.encode())} bytes; use at least {MIN_TOKEN_BYTES}, "
            "e.g. python3 -c 'import secrets; print(secrets.token_urlsafe(32))'",
        )
    return token


def _secret_token(block_name: str) -> str:
    from prefect.blocks.system import Secret

    try:
        secret = cast(Secret, Secret.load(block_name))
    except ValueError as exc:
        raise ConfigurationError(
            "PREFECT_ML_SERVE_TOKEN_SECRET",
            f"no Prefect Secret block {block_name!r} ({exc}); create it in the UI (Blocks > "
            "Secret) or with Secret(value=...).save(name)",
        ) from None
    return str(secret.get())


def is_loopback(host: str) -> bool:
    """Whether ``host`` is this machine's loopback interface (127.0.0.0/8, ::1, localhost)."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def in_tenant(params: ServingParams, tenant: str | None) -> ServingParams:
    """``params`` with the application, its route and the other models its requests may select
    in the tenant's namespace (``<tenant>.<app>`` at ``/<tenant><route>``): a tenant can
    neither replace nor shadow another's application, nor serve another's model, by naming
    it."""
    if tenant is None:
        return params
    route = f"/{tenant}{params.route_prefix.rstrip('/')}"
    return params.model_copy(
        update={
            "app_name": tenancy.qualify(params.app_name, tenant),
            "route_prefix": route,
            "other_models": [tenancy.qualify(name, tenant) for name in params.other_models],
        }
    )


def check_exposure(params: ServingParams, token: str | None) -> None:
    """Refuse to serve beyond loopback without a token: anyone who reached the port could call
    the model, and redeploying an application would strip its protection."""
    if token is None and not is_loopback(params.host):
        raise ConfigurationError(
            "serving.host",
            f"serving on {params.host} needs a bearer token: set PREFECT_ML_SERVE_TOKEN (or "
            "PREFECT_ML_SERVE_TOKEN_SECRET) where the flow runs, or serve on --host 127.0.0.1",
        )


def replica_options(params: ServingParams, token: str | None) -> serving.ReplicaOptions:
    """What every replica is constructed with: the serving section itself and the token's
    digest."""
    digest = serving.token_digest(token) if token else None
    return serving.ReplicaOptions(serving=params, token_sha256=digest)


def check_fits(params: ServingParams) -> None:
    """Refuse replicas the cluster can never place, instead of waiting for them forever."""
    require_fits("serving", params, params.min_replicas, cluster_nodes(), what="replica(s)")


def serving_url(params: ServingParams, tls_pair: tuple[Path, Path] | None) -> str:
    """The endpoint's base URL: https when the proxy serves a certificate."""
    return "https://" + params.url.removeprefix("http://") if tls_pair else params.url


def _endpoint_client(token: str | None, certificate: Path | None) -> httpx.Client:
    """A client of our endpoint: with the bearer token, trusting ``certificate`` over HTTPS."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    verify = services.trusting(certificate) if certificate else True
    return httpx.Client(timeout=30, headers=headers, verify=verify)


def serving_now(
    params: ServingParams, url: str, token: str | None, certificate: Path | None
) -> serving.ServedModel | None:
    """The version the application serves now, or None when it is not deployed.

    Raises:
        ConfigurationError: the application is deployed but refuses this process's token:
            someone else's, or deployed with another token; it is never replaced then.
    """
    if not serving.running_replicas(params.app_name):
        return None
    wait_answering(url, params.deploy_timeout_s, certificate)
    with _endpoint_client(token, certificate) as client:
        response = client.get(f"{url}/metadata")
    if response.status_code in (401, 403):
        raise ConfigurationError(
            "serving.app_name",
            f"the application {params.app_name!r} is deployed and refuses this process's bearer "
            "token (it was deployed with another PREFECT_ML_SERVE_TOKEN); choose another "
            "--app-name, or serve with the token it was deployed with",
        )
    if response.status_code != 200:
        return None
    identity = response.json()["model"]
    return resolve_served_model(identity["name"], "", str(identity["version"]))


def smoke_request(url: str, token: str | None, certificate: Path | None = None) -> SmokeResult:
    """Ask /metadata for the model's input example and send it to /predict; raise on any error.
    Over HTTPS the endpoint must present ``certificate`` (or one its CA signed)."""
    with _endpoint_client(token, certificate) as client:
        metadata = client.get(f"{url}/metadata")
        metadata.raise_for_status()
        example = metadata.json()["input_example"]
        started = time.perf_counter()
        response = client.post(f"{url}/predict", json=example)
        latency_ms = (time.perf_counter() - started) * 1000
        response.raise_for_status()
    return SmokeResult(request=example, response=response.json(), latency_ms=latency_ms)


def serving_markdown(result: ServingResult) -> str:
    smoke = result.smoke
    smoke_text = (
        f"""## Smoke request ({smoke.latency_ms:.1f} ms)

```json
{json.dumps(smoke.request)}
```

→ predictions `{smoke.response["predictions"]}` from v{smoke.response["model"]["version"]}
"""
        if smoke
        else "No smoke request (--no-smoke-test)."
    )
    held = f" (@{result.alias})" if result.alias else ""
    url = result.url
    token = "required" if result.authenticated else "not required"
    return f"""# Serving `{result.model_name}` v{result.version}{held}

- **Endpoint**: `POST {url}/predict` with `{{"inputs": [[...], ...]}}`
- **Docs**: {url}/docs · metadata: `GET {url}/metadata` · health: `GET {url}/healthz`
- **Ray Serve application**: `{result.app_name}`; bearer token {token}
- **Listening**: {result.listening}
- **Model**: `{result.model_uri}` from MLflow run `{result.run_id}`

{smoke_text}"""


def wait_answering(url: str, timeout_s: float, certificate: Path | None) -> None:
    """Return once ``url``'s /healthz answers 200 through Serve's proxy. The application can be
    running while the proxy in front of it is not: Serve starts one with the first application,
    and replaces one it found dead or not ready in time (its readiness check gives a starting
    HAProxy 5 s; a loaded machine takes longer). Until then the port refuses connections.

    Raises:
        DeploymentError: no 200 within ``timeout_s`` (serving.deploy_timeout_s); the message
            holds the last answer or error. The application stays deployed.
    """
    deadline = time.monotonic() + timeout_s
    with _endpoint_client(None, certificate) as client:
        while True:
            try:
                response = client.get(f"{url}/healthz", timeout=5)
                if response.status_code == 200:
                    return
                last = f"HTTP {response.status_code}"
            except httpx.TransportError as exc:
                last = f"{type(exc).__name__}: {exc}"
            if time.monotonic() >= deadline:
                raise DeploymentError(
                    f"{url}/healthz did not answer within {timeout_s:g} s "
                    f"(serving.deploy_timeout_s): {last}. The application is deployed; Ray "
                    "Serve's proxy on this port is not serving it (see the Serve controller "
                    "log under the Ray session's logs/serve)"
                )
            time.sleep(0.25)


def deploy_or_roll_back(
    served: serving.ServedModel,
    current: serving.ServedModel | None,
    options: serving.ReplicaOptions,
    tls_pair: tuple[Path, Path] | None,
) -> None:
    """Deploy ``served``; when that fails in a roll, deploy ``current`` again: Serve's target
    is then the version that serves, not the one that failed (which Serve would start again
    for any replica it replaces or adds)."""
    try:
        serving.deploy(served, options, tls=tls_pair)
    except DeploymentError as exc:
        if current is None or current.identity() == served.identity():
            raise
        serving.deploy(current, options, tls=tls_pair)
        raise DeploymentError(f"{exc}; {current.name} v{current.version} serves on") from exc


def serve_registered_model(
    model_name: str, alias: str, model_version: str | None, params: ServingParams
) -> ServingResult:
    """Resolve, check, deploy (or roll) and smoke-test; on a Ray this process started, the
    application lives until the process's Ray shuts down."""
    logger = get_run_logger()
    settings = get_settings()
    _require_lasting_ray(settings)
    token = bearer_token(settings)
    check_exposure(params, token)
    served = resolve_served_model(model_name, alias, model_version)
    serving.check_registered(
        settings.resolved_tracking_uri, params.other_models, "serving.other_models"
    )
    tls_pair = settings.serve_tls
    url = serving_url(params, tls_pair)
    certificate = tls_pair[0] if tls_pair else None
    report = None
    with ray_session(settings):
        check_fits(params)
        # The token is sent only to Serve's own proxy: one started here at host:port, or the
        # running one, which must listen there.
        serving.start_http(params.host, params.port, tls_pair)
        current = serving_now(params, url, token, certificate)
        policy = params.canary_policy()
        if (
            policy is not None
            and current is not None
            and (current.name, current.version) != (served.name, served.version)
        ):
            report = run_canary(current, served, policy, params.app_name)
            publish_canary(report)
            record_verdict(report, None if model_version else alias, settings.resolved_tracking_uri)
            if not report.promoted:
                served = current  # the application never stopped serving it
        if report is None or report.promoted:
            logger.info("Deploying %s v%s to %s", served.name, served.version, url)
            options = replica_options(params, token)
            deploy_or_roll_back(served, current, options, tls_pair)
            wait_answering(url, params.deploy_timeout_s, certificate)
            record_served(served, current, params.app_name, url)
        smoke = smoke_request(url, token, certificate) if params.smoke_test else None
    result = ServingResult(
        url=url,
        app_name=params.app_name,
        model_name=served.name,
        version=served.version,
        run_id=served.run_id,
        model_uri=served.uri,
        alias=None if model_version else alias,
        authenticated=token is not None,
        smoke=smoke,
        canary=report,
        listening=serving.listening(params.host, params.port),
    )
    logger.info("Listening: %s", result.listening)
    publish_serving(result, settings.resolved_tracking_uri)
    return result


def publish_serving(result: ServingResult, tracking_uri: str) -> None:
    """The run's artifacts: where and what it serves, the OpenAPI docs, and the served version
    in the MLflow registry."""
    create_markdown_artifact(serving_markdown(result), key="serving", description="Serving")
    create_link_artifact(f"{result.url}/docs", link_text="OpenAPI docs", key="serving-docs")
    create_link_artifact(
        tracking.model_version_url(tracking_uri, result.model_name, result.version),
        link_text=f"{result.model_name} v{result.version} in the MLflow registry",
        key="served-model",
    )


def record_served(
    served: serving.ServedModel,
    replaced: serving.ServedModel | None,
    app_name: str,
    url: str,
) -> None:
    """Lineage: ``served`` is served at ``url`` from now on; ``replaced`` was until now."""
    client = tracking.client_for(tracking.worker_uri(served.tracking_uri))
    now = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    flow_run = current_flow_run_id()
    if replaced is not None and (replaced.name, replaced.version) != (served.name, served.version):
        earlier = tracking.registered_version(
            client, replaced.name, alias="", version=replaced.version
        )
        record = tracking.serving_records(earlier).get(app_name, {"url": url})
        tracking.record_serving(
            client, replaced.name, replaced.version, app_name, {**record, "until": now}
        )
    tracking.record_serving(
        client,
        served.name,
        served.version,
        app_name,
        {"url": url, "since": now, "flow_run_id": flow_run},
    )


def _require_lasting_ray(settings: PrefectMLSettings) -> None:
    """A deployment's flow run ends when the model is deployed; a Ray it started would go down
    with it, taking the application along. Such runs need a cluster that outlives them."""
    import ray

    from_deployment = prefect.runtime.deployment.id is not None
    if from_deployment and not ray.is_initialized() and not settings.ray_address:
        raise ConfigurationError(
            "PREFECT_ML_RAY_ADDRESS",
            "a model served from a deployment run must outlive the run, so it needs a Ray "
            "cluster of its own: start one (`ray start --head`) and set "
            "PREFECT_ML_RAY_ADDRESS=auto where the deployments run, or serve from a terminal "
            "with `prefect-ml serve`",
        )


@task(name="serve", cache_policy=NO_CACHE)
def serve(
    model_name: str,
    *,
    alias: str = "champion",
    version: str | None = None,
    serving: ServingParams | None = None,
    **options: Any,
) -> ServingResult:
    """Serve a registered version on Ray Serve behind a validated HTTP API, and smoke-test it.

    Serving the same application name again rolls it to the new version without dropping
    requests. On a Ray this process started, the application lives as long as that Ray.

    Args:
        model_name: the registered model.
        alias: serve the version holding this alias...
        version: ...or this version number.
        serving: the serving section, as the flows pass it; or, instead:
        **options: any field of :class:`~prefect_ml.tasks.params.ServingParams`: ``host``,
            ``port``, ``app_name``, ``batching``, ``max_batch_size``, ``min_replicas``,
            ``max_replicas``, ``replica_cpus``, ``replica_gpus``, ...; the bearer token is the
            operator's setting (``PREFECT_ML_SERVE_TOKEN``), never an option.

    Raises:
        ConfigurationError: an unknown or invalid option, a version that does not exist, or
            replicas the cluster cannot place, before anything is deployed.
    """
    refuse_options_beside(serving, options, step="serve")
    sections = {} if serving is None else {"serving": serving}
    params = params_from_options(
        ServeModelParams,
        options,
        step="serve",
        model_name=model_name,
        alias=alias,
        model_version=version,
        **sections,
    )
    check_caps(params)
    serving_params = in_tenant(params.serving, get_settings().tenant)
    return serve_registered_model(
        params.model_name, params.alias, params.model_version, serving_params
    )
