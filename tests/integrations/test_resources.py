"""Resource requests: Ray's form of them, per-node packing, and errors that name the parameter."""

from __future__ import annotations

from typing import Annotated

import pytest

from prefect_ml.integrations.compute import check_fits, cluster_nodes, placeable
from prefect_ml.integrations.config import ServingParams, SweepParams, TrainingParams
from prefect_ml.integrations.config.resources import (
    GB,
    RequestFields,
    Reserve,
    Reserving,
    Resources,
    custom_resources,
)
from prefect_ml.integrations.errors import ConfigurationError

FIELDS = RequestFields.of("training", TrainingParams)
A10G_NODE = {"CPU": 8.0, "GPU": 1.0, "accelerator_type:A10G": 1.0, "memory": 32.0 * GB}
L4_NODE = {"CPU": 4.0, "GPU": 2.0, "accelerator_type:L4": 1.0, "memory": 16.0 * GB}
CPU_NODE = {"CPU": 2.0, "memory": 8.0 * GB}


def _fits(request: Resources, count: int, nodes: list[dict[str, float]]) -> int:
    return check_fits(request, count, nodes, what="worker(s)", fields=FIELDS)


def test_a_request_reads_as_ray_writes_it() -> None:
    request = Resources(cpus=2, gpus=0.5, accelerator_type="H100", memory=4)
    # The 0.001 share of accelerator_type:<T> is what Ray itself asks (ScalingConfig, options).
    assert request.ray_resources() == {
        "CPU": 2,
        "GPU": 0.5,
        "memory": 4 * GB,
        "accelerator_type:H100": 0.001,
    }
    assert request.actor_options() == {
        "num_cpus": 2,
        "num_gpus": 0.5,
        "memory": 4 * GB,
        "accelerator_type": "H100",
    }
    assert request.describe() == "2 CPU, 0.5 GPU (H100), 4 GB"
    assert Resources(cpus=1).describe() == "1 CPU"
    assert Resources(cpus=1).ray_resources() == {"CPU": 1.0}


# The parameters users set for each part of a request (count, CPUs, GPUs, GPU type, memory,
# custom resources), as errors and CLI flags name them.
REQUEST_PARAMETERS: list[tuple[str, type[Reserving], tuple[str, ...]]] = [
    (
        "training",
        TrainingParams,
        (
            "workers",
            "cpus_per_worker",
            "use_gpu",
            "accelerator_type",
            "memory_per_worker_gb",
            "worker_resources",
        ),
    ),
    (
        "sweep",
        SweepParams,
        (
            "trial_workers",
            "trial_cpus",
            "trial_gpus",
            "trial_accelerator_type",
            "trial_memory_gb",
            "trial_resources",
        ),
    ),
    (
        "serving",
        ServingParams,
        (
            "min_replicas",
            "replica_cpus",
            "replica_gpus",
            "replica_accelerator_type",
            "replica_memory_gb",
            "replica_resources",
        ),
    ),
]


@pytest.mark.parametrize(("name", "section", "parameters"), REQUEST_PARAMETERS)
def test_each_section_names_the_parameters_that_set_its_request_by_their_marks(
    name: str, section: type[Reserving], parameters: tuple[str, ...]
) -> None:
    """Errors name the flow parameters users set, read from the fields' Reserve marks."""
    expected = RequestFields(*(f"{name}.{parameter}" for parameter in parameters))
    assert RequestFields.of(name, section) == expected


def test_a_section_builds_its_request_from_its_marked_fields() -> None:
    serving = ServingParams(
        replica_cpus=0.5, replica_memory_gb=2, replica_resources={"nvme": 2, "fast_disk": 1}
    )
    assert serving.resources() == Resources(
        cpus=0.5, memory=2, custom=(("fast_disk", 1.0), ("nvme", 2.0))
    )
    assert TrainingParams(use_gpu=True).resources().gpus == 1.0  # a flag: one GPU or none
    assert SweepParams(trial_gpus=0.25).resources().gpus == 0.25

    class Twice(Reserving):
        cpus: Annotated[float, Reserve.CPUS] = 1.0
        threads: Annotated[float, Reserve.CPUS] = 2.0

    with pytest.raises(TypeError, match="cpus and threads both set Reserve.CPUS"):
        Twice().resources()


def test_copies_are_packed_per_node_and_pinned_to_their_gpu_type() -> None:
    nodes = [A10G_NODE, L4_NODE, CPU_NODE]
    assert placeable(Resources(cpus=1), nodes) == 8 + 4 + 2
    assert placeable(Resources(cpus=1, gpus=1), nodes) == 1 + 2
    assert placeable(Resources(cpus=1, gpus=1, accelerator_type="L4"), nodes) == 2
    assert placeable(Resources(cpus=1, gpus=1, accelerator_type="A10G"), nodes) == 1
    assert placeable(Resources(cpus=1, gpus=1, accelerator_type="H100"), nodes) == 0
    # Two 1-GPU nodes hold two 1-GPU workers, but not one 2-GPU worker.
    two_single_gpu_nodes = [A10G_NODE, A10G_NODE]
    assert placeable(Resources(cpus=1, gpus=1), two_single_gpu_nodes) == 2
    assert placeable(Resources(cpus=1, gpus=2), two_single_gpu_nodes) == 0


def test_fractional_gpus_share_a_gpu_counted_as_ray_counts_them() -> None:
    node = {"CPU": 16.0, "GPU": 0.7}
    # 0.7 / 0.1 is 6.999... in floats; Ray's fixed point holds 7 copies.
    assert placeable(Resources(cpus=0.5, gpus=0.1), [node]) == 7
    assert placeable(Resources(cpus=0.5, gpus=0.25), [{"CPU": 16.0, "GPU": 1.0}]) == 4
    assert placeable(Resources(cpus=0), [node]) > 10**9  # asks for nothing


def test_memory_limits_copies_per_node() -> None:
    request = Resources(cpus=1, memory=10)
    assert placeable(request, [A10G_NODE, L4_NODE, CPU_NODE]) == 3 + 1 + 0
    assert _fits(request, 4, [A10G_NODE, L4_NODE, CPU_NODE]) == 4


def test_a_missing_gpu_type_names_the_type_and_the_types_there_are() -> None:
    request = Resources(cpus=1, gpus=1, accelerator_type="H100")
    with pytest.raises(ConfigurationError) as caught:
        _fits(request, 4, [A10G_NODE, L4_NODE, CPU_NODE])
    assert caught.value.field == "training.accelerator_type"
    message = str(caught.value)
    assert "4 worker(s) x (1 CPU, 1 GPU (H100)) asked" in message
    assert "the cluster has 0 H100 GPUs (node GPU types: A10G, L4)" in message
    assert "--accelerator-type" in message


def test_too_few_gpus_name_the_gpu_field_with_totals_and_the_largest_node() -> None:
    with pytest.raises(ConfigurationError) as caught:
        _fits(Resources(cpus=1, gpus=2), 1, [A10G_NODE, A10G_NODE])
    assert caught.value.field == "training.use_gpu"
    assert "the cluster has 2 GPU in total, the largest node 1 GPU" in str(caught.value)
    with pytest.raises(ConfigurationError) as caught:
        _fits(Resources(cpus=1, gpus=1, accelerator_type="L4"), 3, [A10G_NODE, L4_NODE])
    assert caught.value.field == "training.use_gpu"
    assert "2 GPU in total on L4 nodes" in str(caught.value)


def test_too_little_memory_or_cpu_names_that_field() -> None:
    with pytest.raises(ConfigurationError) as caught:
        _fits(Resources(cpus=1, memory=20), 1, [L4_NODE, CPU_NODE])
    assert caught.value.field == "training.memory_per_worker_gb"
    assert "the cluster has 24 GB memory in total, the largest node 16 GB memory" in str(
        caught.value
    )
    assert "(--memory-per-worker-gb, --workers)" in str(caught.value)
    with pytest.raises(ConfigurationError) as caught:
        _fits(Resources(cpus=2), 2, [CPU_NODE])
    assert caught.value.field == "training.cpus_per_worker"
    assert (
        "2 worker(s) x (2 CPU) asked, the cluster has 2 CPU in total, the largest node 2 CPU;"
        in str(caught.value)
    )


def test_resources_on_different_nodes_do_not_add_up_to_one_copy() -> None:
    """A node with the CPUs and another with the GPU: each alone suffices, together they don't."""
    nodes = [{"CPU": 8.0}, {"CPU": 1.0, "GPU": 1.0}]
    with pytest.raises(ConfigurationError) as caught:
        _fits(Resources(cpus=4, gpus=1), 1, nodes)
    assert caught.value.field == "training.cpus_per_worker"
    assert "only 0 fit at once" in str(caught.value)
    assert _fits(Resources(cpus=1, gpus=1), 1, nodes) == 1


def test_custom_resources_pin_copies_to_the_nodes_that_declare_them() -> None:
    fast = {"CPU": 4.0, "fast_disk": 1.0}
    request = Resources(cpus=1, custom={"fast_disk": 0.5})
    assert request.ray_resources() == {"CPU": 1.0, "fast_disk": 0.5}
    assert request.actor_options()["resources"] == {"fast_disk": 0.5}
    assert _fits(request, 2, [CPU_NODE, fast, CPU_NODE]) == 2  # two halves on the one node
    with pytest.raises(ConfigurationError) as refused:
        _fits(request, 3, [CPU_NODE, fast])
    assert refused.value.field == "training.worker_resources"
    assert "1 fast_disk in total" in refused.value.message
    assert "--worker-resources" in refused.value.message
    with pytest.raises(ConfigurationError, match="0 fast_disk in total"):
        _fits(request, 1, [CPU_NODE])


def test_a_refusal_lists_each_nodes_totals_custom_resources_too() -> None:
    """What one worker can have at most, node by node (issue 37: checked against totals)."""
    fast = {"CPU": 1.0, "fast_disk": 1.0, "node:10.0.0.2": 1.0, "object_store_memory": 1e9}
    with pytest.raises(ConfigurationError) as refused:
        _fits(Resources(cpus=2), 3, [CPU_NODE, fast])
    assert refused.value.message.endswith(
        "Each node's total: 2 CPU, 0 GPU, 8 GB; 1 CPU, 0 GPU, 1 fast_disk"
    )


def test_a_custom_resource_mapping_may_not_name_resources_with_their_own_fields() -> None:
    for reserved in ({"CPU": 1.0}, {"GPU": 1.0}, {"accelerator_type:A10G": 1.0}):
        with pytest.raises(ValueError, match="own parameters"):
            custom_resources(reserved)
    with pytest.raises(ValueError, match="positive"):
        custom_resources({"fast_disk": 0.0})


def test_the_local_ray_reports_its_nodes(ray_cluster: None) -> None:
    nodes = cluster_nodes()
    assert len(nodes) == 1
    assert nodes[0]["CPU"] == 2.0
    assert placeable(Resources(cpus=0.5), nodes) == 4
    with pytest.raises(ConfigurationError, match="the cluster has 0 GPU in total"):
        _fits(Resources(cpus=1, gpus=1), 1, nodes)
