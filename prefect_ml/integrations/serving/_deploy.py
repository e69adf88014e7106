"""The driver's side of Ray Serve: the proxy started (or checked) at the serving address, the
application deployed or rolled with its replicas' options, and what runs now.

The driver resolves ``models:/<name>@<alias>`` to a version (:class:`~_models.ServedModel`) and
deploys :class:`~_app.ModelServer` with it. A new version is new constructor arguments, so Ray
Serve replaces the replicas; with a surge allowance the new replicas load the model and pass
their health check before the old ones drain, so requests never meet an empty deployment."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, NamedTuple, cast

from ray import serve
from ray.serve import Deployment

from prefect_ml.integrations.compute import placeable
from prefect_ml.integrations.config import ServingParams
from prefect_ml.integrations.errors import ConfigurationError, DeploymentError
from prefect_ml.integrations.services import check_port_free, haproxy_on_loopback
from prefect_ml.integrations.serving._app import DEPLOYMENT_NAME, ModelServer
from prefect_ml.integrations.serving._models import ServedModel
from prefect_ml.integrations.serving._replica import ReplicaOptions


def deployment_options(serving: ServingParams, allow_surge: bool) -> dict[str, Any]:
    """Serve's options of the deployment: its replicas (fixed or autoscaled), their resources
    and queue, and how a roll and a failing constructor go."""
    scaling: dict[str, Any] = (
        {"num_replicas": serving.min_replicas}
        if serving.max_replicas == serving.min_replicas
        else {
            "autoscaling_config": {
                "min_replicas": serving.min_replicas,
                "max_replicas": serving.max_replicas,
                "target_ongoing_requests": serving.target_ongoing_requests,
            }
        }
    )
    return {
        **scaling,
        "max_ongoing_requests": serving.max_ongoing_requests,
        # Past the queue, a request is answered 503 with Retry-After, not left to time out.
        "max_queued_requests": serving.max_queued_requests,
        "backpressure_config": {"status_code": 503, "retry_after_s": serving.retry_after_s},
        "ray_actor_options": serving.resources().actor_options(),
        "max_surge_percent": 100 if allow_surge else 0,
        "logging_config": {"enable_access_log": serving.access_log},
        # A model that does not load will not load on the 20th try (Ray's default) either;
        # three covers a flaky artifact store and fails a bad version within seconds.
        "max_constructor_retry_count": 3,
    }


def replica_arguments(served: ServedModel, options: ReplicaOptions) -> tuple[Any, ...]:
    """The replica's constructor arguments, as Serve records and pickles them."""
    return served.model_dump(), options.model_dump()


class HTTPAddress(NamedTuple):
    """Where Serve's HTTP proxy listens and whether it speaks HTTPS."""

    host: str
    port: int
    tls: bool


def running_http_address() -> HTTPAddress | None:
    """Where the running Serve proxy listens, or None when Serve is not running."""
    from ray.serve.context import _get_global_client

    client = _get_global_client(raise_if_no_controller_running=False)
    if client is None:
        return None
    config = client.get_serve_details().get("http_options", {})
    return HTTPAddress(
        str(config.get("host")), int(config.get("port", 0)), bool(config.get("ssl_certfile"))
    )


def listening(host: str, port: int) -> str:
    """Which ports serving opens, in words: HAProxy ingress opens its stats and Prometheus
    ports too, on loopback when it starts through prefect-ml's script, otherwise on every
    interface whatever ``host`` is (Ray 2.60's template has no setting for their address).
    Read from this process's environment, which a Ray started here inherits."""
    if os.environ.get("RAY_SERVE_ENABLE_HA_PROXY") != "1":
        return f"Serve's proxy on {host}:{port} only"
    stats = os.environ.get("RAY_SERVE_HAPROXY_STATS_PORT", "8404")
    metrics = os.environ.get("RAY_SERVE_HAPROXY_METRICS_PORT", "9101")
    if haproxy_on_loopback():
        return (
            f"HAProxy on {host}:{port}, its stats on 127.0.0.1:{stats} and Prometheus metrics "
            f"on 127.0.0.1:{metrics}"
        )
    return (
        f"HAProxy on {host}:{port}, and its stats (*:{stats}) and Prometheus metrics "
        f"(*:{metrics}) on every interface (RAY_SERVE_HAPROXY_BINARY_PATH is not prefect-ml's "
        f"script); PREFECT_ML_SERVE_INGRESS=proxy listens on {host}:{port} only"
    )


def start_http(host: str, port: int, tls: tuple[Path, Path] | None = None) -> None:
    """Start Serve's HTTP proxy on host:port (HTTPS with ``tls``, a certificate and key), or
    check that the running one listens there the same way."""
    running = running_http_address()
    if running is None:
        check_port_free(host, port, "serving.port")
        options: dict[str, Any] = {"host": host, "port": port}
        if tls is not None:
            if os.environ.get("RAY_SERVE_ENABLE_HA_PROXY") == "1":
                raise ConfigurationError(
                    "PREFECT_ML_SERVE_TLS_CERT",
                    "Ray Serve's HAProxy ingress serves plain HTTP only; unset "
                    "RAY_SERVE_ENABLE_HA_PROXY (prefect-ml leaves it unset when serving HTTPS)",
                )
            options.update(ssl_certfile=str(tls[0]), ssl_keyfile=str(tls[1]))
        serve.start(http_options=options)
    elif running != (host, port, tls is not None):
        scheme = "HTTPS" if running.tls else "plain HTTP"
        raise ConfigurationError(
            "serving.port",
            f"Ray Serve already listens on {running.host}:{running.port} ({scheme}) in this "
            f"cluster; use --host {running.host} --port {running.port} with "
            f"PREFECT_ML_SERVE_TLS_* {'set' if running.tls else 'unset'}, "
            "or `serve shutdown` first",
        )


def deploy(
    served: ServedModel,
    options: ReplicaOptions,
    *,
    tls: tuple[Path, Path] | None = None,
) -> None:
    """Deploy (or roll) the application; returns once every replica serves ``served``.

    A roll starts the new replicas next to the old ones when the cluster has room for one more;
    otherwise (a full cluster) old replicas stop first and requests queue meanwhile. With ``tls``
    (certificate, key) the proxy serves HTTPS only.

    Raises:
        DeploymentError: a replica failed to start (Serve gives up after
            ``max_constructor_retry_count`` tries) or the replicas were not all ready within
            ``serving.deploy_timeout_s`` (a replica that hangs while it loads, or that Ray
            cannot place: Serve would wait for ever). A new application is deleted then; a
            roll's old replicas serve on, and the caller deploys the old version again.
    """
    import ray

    placement = options.serving
    start_http(placement.host, placement.port, tls)
    existed = placement.app_name in serve.status().applications
    # Free resources summed over the cluster: a surge replica that still finds no single node
    # with room waits a moment for an old replica to drain, as without surge.
    allow_surge = placeable(placement.resources(), [ray.available_resources()]) >= 1
    server = cast(Deployment, ModelServer)  # the decorator made the class a Deployment
    deployment = server.options(**deployment_options(placement, allow_surge))
    target = serve.RunTarget(
        target=deployment.bind(*replica_arguments(served, options)),
        name=placement.app_name,
        route_prefix=placement.route_prefix,
    )
    # Not serve.run: it waits for the application without a bound.
    serve.run_many([target], wait_for_applications_running=False)
    failure = _wait_running(placement.app_name, placement.deploy_timeout_s)
    if failure is None:
        return
    if not existed:
        serve.delete(placement.app_name)  # nothing left deployed half-way
    raise DeploymentError(f"{served.uri} did not deploy as {placement.app_name!r}: {failure}")


def _wait_running(app_name: str, timeout_s: float) -> str | None:
    """None once the application runs; otherwise why it does not: the replica's error when
    Serve gave up on it, or what Serve says about the replicas still starting at the bound."""
    from ray.serve.schema import ApplicationStatus

    deadline = time.monotonic() + timeout_s
    while True:
        app = serve.status().applications.get(app_name)
        status = app.status if app else ApplicationStatus.DEPLOYING
        if status == ApplicationStatus.RUNNING:
            return None
        lines = _deployment_message(app_name)
        if status == ApplicationStatus.DEPLOY_FAILED:  # the last line of the replica's error
            return lines[-1] if lines else "see the Ray Serve controller log"
        if time.monotonic() >= deadline:
            said = " ".join(lines) or "no replica reported (see the Ray Serve controller log)"
            bound = f"{timeout_s:g} s (serving.deploy_timeout_s)"
            return f"its replicas were not ready within {bound}: {said}"
        time.sleep(0.5)


def _deployment_message(app_name: str) -> list[str]:
    """The lines Serve keeps in the deployment's status: a replica's error, or why replicas
    are still starting (not placed, or a slow constructor)."""
    app = serve.status().applications.get(app_name)
    deployment = app.deployments.get(DEPLOYMENT_NAME) if app else None
    message = deployment.message if deployment else ""
    return [line.strip() for line in message.splitlines() if line.strip()]


def running_replicas(app_name: str) -> int:
    """How many of the application's replicas are up now (0: it is not deployed)."""
    if running_http_address() is None:
        return 0
    app = serve.status().applications.get(app_name)
    deployment = app.deployments.get(DEPLOYMENT_NAME) if app else None
    if deployment is None:
        return 0
    return sum(n for state, n in deployment.replica_states.items() if state == "RUNNING")
