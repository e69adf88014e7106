"""Connecting to Ray: a cluster at an address, or a local Ray started (and owned) here."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path

from prefect_ml.integrations import tls
from prefect_ml.integrations.errors import EnvironmentCheckError
from prefect_ml.integrations.settings import PrefectMLSettings, worker_environment

logger = logging.getLogger(__name__)


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
                ray.init(
                    address=settings.ray_address,
                    runtime_env={"env_vars": shipped},
                    logging_level=logging.WARNING,
                )
            else:
                # Local workers import user code (``module:factory``) the way the driver does.
                shipped["PYTHONPATH"] = os.pathsep.join(sys.path)
                ray.init(
                    num_cpus=settings.local_ray_cpus,
                    runtime_env={"env_vars": shipped},
                    # The dashboard serves Ray's state API, which Ray Train v2 polls; loopback only.
                    include_dashboard=True,
                    dashboard_host="127.0.0.1",
                    logging_level=logging.WARNING,
                )
        except (ConnectionError, RuntimeError, ValueError) as exc:
            where = settings.ray_address or "a local Ray"
            raise EnvironmentCheckError(
                f"could not start or reach {where}: {exc}. Check PREFECT_ML_RAY_ADDRESS "
                "(unset it to start a local Ray) and that `ray status` works."
            ) from exc
    try:
        yield dict(ray.cluster_resources())
    finally:
        if owns_ray:
            ray.shutdown()


def _use_tls(folder: Path) -> None:
    """Ray's TLS for this driver and the local Ray it may start (whose processes inherit the
    variables). Ray's core reads them when ``ray`` is imported, which may have happened already,
    so its config is reloaded, as Ray itself does when it turns token authentication on."""
    from ray._raylet import Config  # type: ignore[attr-defined]

    os.environ.update(tls.ray_environment(folder))
    Config.initialize("")
