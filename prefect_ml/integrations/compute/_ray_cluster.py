"""Connecting to Ray: a cluster at an address, or a local Ray started (and owned) here."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from prefect_ml.integrations import services
from prefect_ml.integrations.compute import _code_shipping, _node_probe
from prefect_ml.integrations.compute._worker_setup import setup_hook
from prefect_ml.integrations.errors import ConfigurationError, EnvironmentCheckError
from prefect_ml.integrations.libraries import installed_version
from prefect_ml.integrations.services import run_logger
from prefect_ml.integrations.settings import PrefectMLSettings, worker_environment

T = TypeVar("T")


@contextlib.contextmanager
def ray_session(settings: PrefectMLSettings) -> Iterator[dict[str, float]]:
    """Yield the cluster's resources, connecting to Ray for the duration of the block.

    Reuses a Ray already initialised in this process (a test fixture, a notebook); otherwise
    connects to ``settings.ray_address`` or starts a local Ray, with Ray's TLS when
    ``settings.ray_tls_dir`` is set. It shuts down only what it started.
    """
    import ray

    owns_ray = not ray.is_initialized()
    if owns_ray:
        if settings.ray_tls_dir is not None:
            _use_tls(settings.ray_tls_dir)
        shipped = worker_environment(settings)
        try:
            if settings.ray_address:
                _connect(settings, shipped)
            else:
                _start_local_ray(settings, shipped)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            if isinstance(exc, ConfigurationError):
                raise
            where = settings.ray_address or "a local Ray"
            raise EnvironmentCheckError(
                f"could not start or reach {where}: {exc}. Check PREFECT_ML_RAY_ADDRESS "
                "(unset it to start a local Ray) and that `ray status` works."
            ) from exc
        services.mark("Ray connected" if settings.ray_address else "local Ray started")
    try:
        yield dict(ray.cluster_resources())
    finally:
        if owns_ray:
            ray.shutdown()
            _SHIPPING.clear()


# Ray gives a new local node a fixed 30 s (``raylet_start_wait_time_s`` in ray/_private/node.py,
# not a setting) to register with its GCS, then raises a bare Exception with this text. A machine
# too busy for that (a Prefect worker's flow run at load 18 on 2 CPUs, 2026-12-07) gets
# LOCAL_RAY_STARTS tries, each one's processes ended before the next.
_NODE_START_TIMEOUT = "timed out during startup"
LOCAL_RAY_STARTS = 2


def _start_local_ray(settings: PrefectMLSettings, env_vars: dict[str, str]) -> None:
    """Start a local Ray whose workers import user code (``module:factory``) the way the driver
    does; a node that timed out registering is started again, once."""
    import ray

    env_vars["PYTHONPATH"] = os.pathsep.join(sys.path)
    earlier_children = services.descendant_pids()
    for start in range(1, LOCAL_RAY_STARTS + 1):
        try:
            ray.init(
                # "local": a new Ray, even when a `ray start` cluster runs on this machine (which
                # Ray would otherwise join).
                address="local",
                num_cpus=settings.local_ray_cpus,
                runtime_env={"env_vars": env_vars, **setup_hook()},
                # The dashboard serves Ray's state API, which Ray Train v2 polls; loopback only.
                include_dashboard=True,
                dashboard_host="127.0.0.1",
                logging_level=logging.WARNING,
            )
            return
        except Exception as exc:
            if _NODE_START_TIMEOUT not in str(exc):
                raise
            # The half-started node's GCS, raylet and agents: nothing else would end them.
            services.stop_descendants(spare=earlier_children)
            load = ", ".join(f"{value:.1f}" for value in os.getloadavg())
            if start == LOCAL_RAY_STARTS:
                raise EnvironmentCheckError(
                    f"a local Ray did not start: its node did not register within Ray's 30 s, "
                    f"{LOCAL_RAY_STARTS} times (load average {load} on {os.cpu_count()} CPUs). "
                    "Run it when the machine is less busy, or start Ray once (`ray start "
                    "--head`) and set PREFECT_ML_RAY_ADDRESS=auto so that runs join it."
                ) from exc
            run_logger().warning(
                "A local Ray's node did not register within Ray's 30 s (load average %s on %s "
                "CPUs); its processes were ended and Ray starts again (%d of %d).",
                load,
                os.cpu_count(),
                start + 1,
                LOCAL_RAY_STARTS,
            )


def _connect(settings: PrefectMLSettings, env_vars: dict[str, str]) -> None:
    """Join the cluster at ``settings.ray_address`` with the code its workers need
    (:mod:`integrations.compute`), using the cluster's token when one is found."""
    import ray

    _use_cluster_token()
    plan = _code_shipping.plan_code(settings)  # size checks before any upload
    mode = settings.ship_code

    # Not through Ray Client (ray://): the hook, a function, would travel through the client
    # server, a path no test here runs; those jobs keep Ray's own address lookup and sys.path.
    ray_client = str(settings.ray_address).startswith("ray://")

    def join(ship_project: bool) -> None:
        expected = plan.expected_code(ship_project=ship_project, version=_driver_version())
        runtime_env = {
            # A copy: Ray adds the hook's key to it, and a second join has another hook.
            "env_vars": dict(env_vars),
            **({} if ray_client else setup_hook(expected)),
            **plan.runtime_env(ship_project=ship_project),
        }
        ray.init(
            address=settings.ray_address,
            runtime_env=runtime_env,
            logging_level=logging.WARNING,
        )

    ship_project = not _code_shipping.needs_probe(mode, plan)
    join(ship_project)
    if not ship_project:
        _node_probe.by_value()
        nodes = []
        for node, report in on_each_node(_node_probe.code_on_node):
            if isinstance(report, BaseException):
                raise EnvironmentCheckError(
                    f"node {node['NodeManagerAddress']} did not answer the code probe: {report}"
                )
            nodes.append(report)
        ship_project = _code_shipping.decide_shipping(mode, plan, _driver_version(), nodes)
        if ship_project:  # a job's runtime_env is fixed when it connects
            ray.shutdown()
            join(True)
    _SHIPPING[:] = [(plan.describe(ship_project=ship_project), ship_project)]
    run_logger().info("Ray cluster %s: %s", settings.ray_address, _SHIPPING[0][0])


# What this process's cluster connection ships (for run tags and doctor) and whether that
# includes prefect-ml itself; empty on a local Ray and once the connection is closed.
_SHIPPING: list[tuple[str, bool]] = []


def shipped_code() -> str | None:
    """What the current cluster connection ships (:meth:`CodePlan.describe`); None on a local
    Ray, whose workers import what this process imports."""
    import ray

    return _SHIPPING[0][0] if _SHIPPING and ray.is_initialized() else None


def ships_project() -> bool | None:
    """Whether the current cluster connection ships prefect-ml (False: the nodes' installed
    prefect-ml runs); None on a local Ray, whose workers import what this process imports."""
    return _SHIPPING[0][1] if shipped_code() is not None else None


def _driver_version() -> str:
    return installed_version()


def _use_cluster_token() -> None:
    """Turn Ray's token authentication on for this driver when the cluster's token is found
    (``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH`` or ``~/.ray/auth_token``) and ``RAY_AUTH_MODE``
    is unset: ``ray start --head`` turns it on for the cluster, but a driver joining it by
    address does not look for the token by itself."""
    from ray._private.authentication.authentication_token_setup import (
        maybe_enable_token_auth_if_token_available,
    )

    maybe_enable_token_auth_if_token_available(warn_if_disabled=False)


def on_each_node(
    function: Callable[..., T], *args: Any, timeout_s: float = 120.0
) -> list[tuple[dict[str, Any], T | BaseException]]:
    """Run ``function(*args)`` once on every alive node (pinned, 0 CPUs, no retry) and return
    each node's record (``ray.nodes()``) with its result or the exception it raised; a node
    that does not answer within ``timeout_s`` gets a TimeoutError. Ray must be initialised."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes = [node for node in ray.nodes() if node.get("Alive")]
    remote = ray.remote(num_cpus=0, max_retries=0)(function)
    refs = [
        remote.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)
        ).remote(*args)
        for node in nodes
    ]
    ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    results: list[tuple[dict[str, Any], T | BaseException]] = []
    for node, ref in zip(nodes, refs, strict=True):
        try:
            results.append((node, ray.get(ref, timeout=0)))
        except ray.exceptions.GetTimeoutError:
            ray.cancel(ref, force=True)
            results.append((node, TimeoutError(f"no answer within {timeout_s:g}s")))
        except Exception as exc:  # each node's failure is its own result
            results.append((node, exc))
    return results


def _use_tls(folder: Path) -> None:
    """Ray's TLS for this driver and the local Ray it may start (whose processes inherit the
    variables). Ray's core reads them when ``ray`` is imported, which may have happened already,
    so its config is reloaded, as Ray itself does when it turns token authentication on."""
    from ray._raylet import Config  # type: ignore[attr-defined]

    os.environ.update(services.ray_environment(folder))
    Config.initialize("")
