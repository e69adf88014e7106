"""The Ray cluster that runs training, trials, serving replicas and batch scoring: joining it or
starting a local one, the code its nodes import, what a node has, and what fits on it.

A job's workers import exactly the code the driver has: prefect-ml and the user's modules are
shipped with the job (Ray's ``runtime_env`` ``py_modules``) unless a probe finds them installed
on every node, and every worker process runs the setup hook first, which refuses to run code
that is not the driver's. What one copy of a job (a training worker, a trial, a replica) asks
for is checked against the nodes before anything starts, with the shortage named.

Behind this face: ``_ray_cluster`` (connecting, or a local Ray owned here), ``_code_shipping``
(what to ship), ``_worker_setup`` (the worker's setup hook; it travels by value),
``_node_probe`` (what code a node has; pickled by value, so nodes need not import prefect-ml),
``_node_report`` (what ``prefect-ml doctor`` measures on each node), ``_devices`` (the
accelerator, its collective backend, peak memory) and ``_resources`` (the fit check and where
a request could be placed).

Names load on first use: the GPU check's torch-only machine imports the accelerator's
functions (``_devices``) without Ray, and the flows pay for Ray only when they reach it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prefect_ml.integrations.libraries import lazy_exports

# Public name -> the private module that defines it.
_EXPORTS = {
    "EXCLUDES": "_code_shipping",
    "decide_shipping": "_code_shipping",
    "needs_probe": "_code_shipping",
    "plan_code": "_code_shipping",
    "collective_backend": "_devices",
    "describe_devices": "_devices",
    "detect_runtime": "_devices",
    "mismatch_warnings": "_devices",
    "peak_memory_bytes": "_devices",
    "peak_memory_kind": "_devices",
    "reset_peak_memory": "_devices",
    "seed_rngs": "_devices",
    "training_device": "_devices",
    "code_on_node": "_node_probe",
    "NodeReport": "_node_report",
    "imported_versions": "_node_report",
    "probe_nodes": "_node_report",
    "version_differences": "_node_report",
    "on_each_node": "_ray_cluster",
    "ray_session": "_ray_cluster",
    "shipped_code": "_ray_cluster",
    "ships_project": "_ray_cluster",
    "PLACEMENT_NOTICE_S": "_resources",
    "PLACEMENT_REPEAT_S": "_resources",
    "check_fits": "_resources",
    "cluster_nodes": "_resources",
    "describe_placement": "_resources",
    "flag_of": "_resources",
    "free_per_node": "_resources",
    "mixed_gpu_types": "_resources",
    "placeable": "_resources",
    "CodeMismatchError": "_worker_setup",
    "ExpectedCode": "_worker_setup",
    "content_hash": "_worker_setup",
    "project_difference": "_worker_setup",
    "setup_hook": "_worker_setup",
    "use_shipped_code": "_worker_setup",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:  # for type checkers and editors; at run time __getattr__ loads them
    from prefect_ml.integrations.compute._code_shipping import EXCLUDES as EXCLUDES
    from prefect_ml.integrations.compute._code_shipping import decide_shipping as decide_shipping
    from prefect_ml.integrations.compute._code_shipping import needs_probe as needs_probe
    from prefect_ml.integrations.compute._code_shipping import plan_code as plan_code
    from prefect_ml.integrations.compute._devices import collective_backend as collective_backend
    from prefect_ml.integrations.compute._devices import describe_devices as describe_devices
    from prefect_ml.integrations.compute._devices import detect_runtime as detect_runtime
    from prefect_ml.integrations.compute._devices import mismatch_warnings as mismatch_warnings
    from prefect_ml.integrations.compute._devices import peak_memory_bytes as peak_memory_bytes
    from prefect_ml.integrations.compute._devices import peak_memory_kind as peak_memory_kind
    from prefect_ml.integrations.compute._devices import reset_peak_memory as reset_peak_memory
    from prefect_ml.integrations.compute._devices import seed_rngs as seed_rngs
    from prefect_ml.integrations.compute._devices import training_device as training_device
    from prefect_ml.integrations.compute._node_probe import code_on_node as code_on_node
    from prefect_ml.integrations.compute._node_report import NodeReport as NodeReport
    from prefect_ml.integrations.compute._node_report import imported_versions as imported_versions
    from prefect_ml.integrations.compute._node_report import probe_nodes as probe_nodes
    from prefect_ml.integrations.compute._node_report import (
        version_differences as version_differences,
    )
    from prefect_ml.integrations.compute._ray_cluster import on_each_node as on_each_node
    from prefect_ml.integrations.compute._ray_cluster import ray_session as ray_session
    from prefect_ml.integrations.compute._ray_cluster import shipped_code as shipped_code
    from prefect_ml.integrations.compute._ray_cluster import ships_project as ships_project
    from prefect_ml.integrations.compute._resources import PLACEMENT_NOTICE_S as PLACEMENT_NOTICE_S
    from prefect_ml.integrations.compute._resources import PLACEMENT_REPEAT_S as PLACEMENT_REPEAT_S
    from prefect_ml.integrations.compute._resources import check_fits as check_fits
    from prefect_ml.integrations.compute._resources import cluster_nodes as cluster_nodes
    from prefect_ml.integrations.compute._resources import describe_placement as describe_placement
    from prefect_ml.integrations.compute._resources import flag_of as flag_of
    from prefect_ml.integrations.compute._resources import free_per_node as free_per_node
    from prefect_ml.integrations.compute._resources import mixed_gpu_types as mixed_gpu_types
    from prefect_ml.integrations.compute._resources import placeable as placeable
    from prefect_ml.integrations.compute._worker_setup import CodeMismatchError as CodeMismatchError
    from prefect_ml.integrations.compute._worker_setup import ExpectedCode as ExpectedCode
    from prefect_ml.integrations.compute._worker_setup import content_hash as content_hash
    from prefect_ml.integrations.compute._worker_setup import (
        project_difference as project_difference,
    )
    from prefect_ml.integrations.compute._worker_setup import setup_hook as setup_hook
    from prefect_ml.integrations.compute._worker_setup import use_shipped_code as use_shipped_code


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
