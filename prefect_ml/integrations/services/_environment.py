"""What every prefect-ml process sets before Prefect loads: Prefect's state under the project
home (and the home's own server, with its credentials, when ``prefect-ml ui`` runs one),
telemetry off, pickled models refused, and Serve's HAProxy ingress turned on where it can run.

It lives beside the services it points at, not in :mod:`integrations.settings`: the settings
are read by every package, including this one, and must import none of them.
"""

from __future__ import annotations

import os

from prefect_ml.integrations.services._serve_ingress import (
    SERVE_INGRESS_ENVIRONMENT,
    haproxy_private_paths,
)
from prefect_ml.integrations.settings import (
    ENFORCED_ENVIRONMENT,
    PrefectMLSettings,
    get_settings,
    local_server_auth_string,
    running_local_server,
)


def prepare_process_environment(settings: PrefectMLSettings | None = None) -> PrefectMLSettings:
    """Point Prefect's own state at the project home, silence telemetry, forbid pickled models.

    Must run before ``prefect`` is imported: Prefect reads its settings at import time.
    Variables the user already set are left alone, except those of
    :data:`ENFORCED_ENVIRONMENT`, which every process we start gets as they are.
    """
    settings = settings or get_settings()
    settings.prefect_home.mkdir(parents=True, exist_ok=True)
    local_server = running_local_server(settings)
    # `prefect-ml ui` runs a server for this home: runs go there, not to an ephemeral API, with
    # its credentials; never to a server the user chose instead.
    if local_server and os.environ.setdefault("PREFECT_API_URL", local_server) == local_server:
        auth_string = local_server_auth_string(settings)
        if auth_string:
            os.environ.setdefault("PREFECT_API_AUTH_STRING", auth_string)
    os.environ.setdefault("PREFECT_HOME", str(settings.prefect_home))
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    # Serve's HAProxy ingress speaks plain HTTP only.
    if settings.serve_ingress == "haproxy" and settings.serve_tls_cert is None:
        for variable, value in {**SERVE_INGRESS_ENVIRONMENT, **haproxy_private_paths()}.items():
            os.environ.setdefault(variable, value)
    os.environ.update(ENFORCED_ENVIRONMENT)
    return settings
