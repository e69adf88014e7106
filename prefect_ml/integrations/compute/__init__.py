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
"""

from prefect_ml.integrations.compute._code_shipping import (
    EXCLUDES,
    decide_shipping,
    needs_probe,
    plan_code,
)
from prefect_ml.integrations.compute._devices import (
    collective_backend,
    describe,
    detect_runtime,
    mismatch_warnings,
    peak_memory_bytes,
    peak_memory_kind,
    reset_peak_memory,
    training_device,
)
from prefect_ml.integrations.compute._node_probe import code_on_node
from prefect_ml.integrations.compute._node_report import (
    NodeReport,
    imported_versions,
    probe_nodes,
    version_differences,
)
from prefect_ml.integrations.compute._ray_cluster import (
    on_each_node,
    ray_session,
    shipped_code,
    ships_project,
)
from prefect_ml.integrations.compute._resources import (
    PLACEMENT_NOTICE_S,
    PLACEMENT_REPEAT_S,
    check_fits,
    cluster_nodes,
    describe_placement,
    flag_of,
    free_per_node,
    mixed_gpu_types,
    placeable,
)
from prefect_ml.integrations.compute._worker_setup import (
    CodeMismatchError,
    ExpectedCode,
    content_hash,
    project_difference,
    setup_hook,
    use_shipped_code,
)

__all__ = [
    "EXCLUDES",
    "PLACEMENT_NOTICE_S",
    "PLACEMENT_REPEAT_S",
    "CodeMismatchError",
    "ExpectedCode",
    "NodeReport",
    "check_fits",
    "cluster_nodes",
    "code_on_node",
    "collective_backend",
    "content_hash",
    "decide_shipping",
    "describe",
    "describe_placement",
    "detect_runtime",
    "flag_of",
    "free_per_node",
    "imported_versions",
    "mismatch_warnings",
    "mixed_gpu_types",
    "needs_probe",
    "on_each_node",
    "peak_memory_bytes",
    "peak_memory_kind",
    "placeable",
    "plan_code",
    "probe_nodes",
    "project_difference",
    "ray_session",
    "reset_peak_memory",
    "setup_hook",
    "shipped_code",
    "ships_project",
    "training_device",
    "use_shipped_code",
    "version_differences",
]
