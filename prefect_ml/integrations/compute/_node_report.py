"""What ``prefect-ml doctor`` measures on each Ray node, and how a node's versions may differ
from the driver's.

On every alive node one worker of the job reports the versions it imports, its devices, and
whether it reaches the driver's storage: it writes, reads back and deletes a probe object, then
reads an object the driver wrote, which a node writing to its own disk (a ``file://`` path that
is not a shared mount) or to another endpoint does not see. Unlike :mod:`node_probe` the probe
imports the project: it runs inside a job that ships prefect-ml
(:func:`ray_cluster.ray_session`) or on nodes that have it installed.
"""

from __future__ import annotations

import platform
import socket
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefect_ml.integrations import storage
from prefect_ml.integrations.compute import _devices
from prefect_ml.integrations.compute._code_shipping import EXCLUDES
from prefect_ml.integrations.compute._worker_setup import content_hash
from prefect_ml.integrations.libraries import installed_version

# Compared between the driver and each node, in this order.
# The prefect_ml this process imports (the folder of this module's package, three levels up).
PACKAGE_FOLDER = Path(__file__).parents[2]
COMPARED = ("python", "ray", "torch", "prefect-ml", "prefect-ml content")


def imported_versions() -> dict[str, str]:
    """The Python of this process, the versions of ray, torch and prefect-ml it imports, and
    the content hash of that prefect_ml (:func:`content_hash`, 12 digits): the
    same version may be other code (a checkout, a partial copy)."""
    import ray
    import torch

    return {
        "python": platform.python_version(),
        "ray": ray.__version__,
        "torch": torch.__version__,
        "prefect-ml": installed_version(),
        "prefect-ml content": content_hash(PACKAGE_FOLDER, EXCLUDES)[:12],
    }


@dataclass(frozen=True)
class NodeReport:
    """What one node's worker measured; plain fields, as it crosses processes."""

    host: str
    versions: dict[str, str]
    prefect_ml_from: str  # the folder the worker imports prefect_ml from
    devices: str  # _devices.describe() of the node's runtime
    device_warnings: list[str]
    storage_ok: bool
    storage: str  # what the storage probe did, or why it failed


def probe_node(root_url: str, driver_object: tuple[str, bytes] | None) -> NodeReport:
    """Run on a node: versions, devices and storage access there. ``driver_object`` is the URL
    and content of an object the driver wrote (None when it could not write one)."""
    import ray

    runtime = _devices.detect_runtime()
    node_id = ray.get_runtime_context().get_node_id()
    storage_ok, outcome = _storage_access(root_url, node_id, driver_object)
    return NodeReport(
        host=socket.gethostname(),
        versions=imported_versions(),
        prefect_ml_from=str(PACKAGE_FOLDER),
        devices=_devices.describe_devices(runtime),
        device_warnings=list(runtime.warnings),
        storage_ok=storage_ok,
        storage=outcome,
    )


def _storage_access(
    root_url: str, node_id: str, driver_object: tuple[str, bytes] | None
) -> tuple[bool, str]:
    try:
        storage.check_writable(storage.doctor_url(root_url, node_id))
    except Exception as exc:  # the node's row reports it; its other measurements still count
        return False, f"{type(exc).__name__}: {exc}"
    done = "written, read back and deleted"
    if driver_object is None:
        return True, f"{done}; the driver could not write its probe object (see the storage row)"
    url, content = driver_object
    try:
        seen = storage.read_bytes(url) == content
    except FileNotFoundError:
        seen = False
    except Exception as exc:
        return False, f"{done}, but reading the driver's {url} failed: {type(exc).__name__}: {exc}"
    if not seen:
        return False, (
            f"{done}, but the object the driver wrote ({url}) is not there: this node reaches "
            "other storage than the driver (its own disk, another endpoint); give the driver and "
            "every node the same PREFECT_ML_STORAGE_URL on shared storage (s3://...)"
        )
    return True, f"{done}; sees the driver's probe object"


def probe_nodes(
    root_url: str, *, timeout_s: float
) -> list[tuple[dict[str, Any], NodeReport | BaseException]]:
    """Probe every alive node at once (:func:`ray_cluster.on_each_node`): each node's record
    with its report, or the exception it raised (a TimeoutError after ``timeout_s``)."""
    # Imported here: nodes import this module for probe_node, and need none of Ray's set-up.
    from prefect_ml.integrations.compute import _ray_cluster

    url = storage.doctor_url(root_url, f"driver-{uuid.uuid4().hex}")
    content = uuid.uuid4().bytes
    driver_object: tuple[str, bytes] | None = (url, content)
    try:
        storage.write_bytes(url, content)
    except Exception:  # the doctor's storage row says why; the nodes are probed without it
        driver_object = None
    try:
        return _ray_cluster.on_each_node(probe_node, root_url, driver_object, timeout_s=timeout_s)
    finally:
        if driver_object is not None:
            storage.remove(url)


@dataclass(frozen=True)
class VersionDifference:
    """A package whose version on a node is not the driver's, and whether jobs break on it."""

    package: str
    driver: str
    node: str
    fatal: bool
    consequence: str

    def describe(self) -> str:
        return (
            f"{self.package} {self.node} on the node, {self.driver} on the driver: "
            f"{self.consequence}"
        )


def version_differences(
    driver: Mapping[str, str], node: Mapping[str, str], *, prefect_ml_shipped: bool | None
) -> list[VersionDifference]:
    """How a node's :func:`imported_versions` differ from the driver's.

    Fatal: another ray or another Python minor version (Ray and cloudpickle need them equal),
    another prefect-ml when the node's installed one runs (``prefect_ml_shipped`` False), and
    other prefect_ml content whatever the version (the node's workers run other code).
    Warnings: another Python patch release, and another torch, with which jobs may still run.
    prefect-ml shipped with the job (True), or a local Ray's (None), is the driver's own code.
    """
    found = []
    for package in COMPARED:
        mine, theirs = driver[package], node[package]
        if mine == theirs or (package == "prefect-ml" and prefect_ml_shipped is not False):
            continue
        fatal, consequence = _consequence(package, mine, theirs)
        found.append(VersionDifference(package, mine, theirs, fatal, consequence))
    return found


def _consequence(package: str, driver: str, node: str) -> tuple[bool, str]:
    if package == "ray":
        return True, f"Ray needs one version on the driver and every node; install ray {driver}"
    if package == "python" and driver.split(".")[:2] != node.split(".")[:2]:
        return True, "what the driver pickles may not load there; use one Python on every node"
    if package == "python":
        return False, "usually harmless, but Ray compares Python versions to the patch release"
    if package == "prefect-ml content":
        return True, (
            "the node's workers import other prefect_ml code than the driver's (from the folder "
            "in its row); remove that copy from the node's Python path, set "
            "PREFECT_ML_SHIP_CODE=always to ship the driver's code, or install the driver's "
            "prefect-ml there"
        )
    if package == "torch":
        return False, (
            "jobs may still run, but collectives and checkpoints across torch versions are not "
            f"guaranteed; install torch {driver} on the node to be sure"
        )
    return True, (
        "the node runs other prefect-ml code than the driver; install prefect-ml "
        f"{driver} there or set PREFECT_ML_SHIP_CODE=always to ship it with each job"
    )
