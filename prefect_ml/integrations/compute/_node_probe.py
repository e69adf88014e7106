"""What code one Ray node has: the probe that decides whether prefect-ml must be shipped to it.

It runs on nodes that may not be able to import prefect-ml, so Ray pickles this module by value
(:func:`by_value`) and its function imports nothing of the project.
"""

from __future__ import annotations

import importlib.util
import platform
import socket
from importlib import metadata
from typing import Any

PACKAGES = ("torch", "ray", "prefect", "mlflow", "optuna", "prefect-ml")


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def code_on_node() -> dict[str, Any]:
    """The node's id and address, Python and package versions, and where ``prefect_ml.flows``
    imports from in a worker of this job (None when it does not import)."""
    import ray

    try:
        spec = importlib.util.find_spec("prefect_ml.flows")
    except ImportError:
        spec = None
    origin = None
    if spec is not None and spec.submodule_search_locations:
        origin = list(spec.submodule_search_locations)[0]
    return {
        "node_id": ray.get_runtime_context().get_node_id(),
        "host": socket.gethostname(),
        "ip": ray.util.get_node_ip_address(),
        "python": platform.python_version(),
        "versions": {package: _version(package) for package in PACKAGES},
        "prefect_ml_from": origin,
    }


def by_value() -> None:
    """Have Ray pickle this module's functions by value, so nodes need not import it."""
    import sys

    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
