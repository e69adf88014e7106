"""What one Ray-backed copy (training worker, trial, serving replica) asks for, and whether the
cluster can place it.

A request the cluster can never satisfy does not fail in Ray: the actor stays pending forever.
So every flow checks its requests against the nodes' totals at start and names the parameter
to change instead. Ray places each copy on one node, so the check packs per node, not per total.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from prefect_ml.integrations.errors import ConfigurationError

# Ray's own names: a node with GPUs of type T carries the resource "accelerator_type:T" (value 1),
# and Ray (``ray._common.utils.resources_from_ray_options``, ``ScalingConfig.accelerator_type``)
# turns ``accelerator_type=T`` into a request of 0.001 of it, which pins a copy to such a node.
ACCELERATOR_PREFIX = "accelerator_type:"
ACCELERATOR_SHARE = 0.001
# Ray counts resources in fixed point with four decimals; comparing in those units makes
# 0.7 GPU hold 7 copies of 0.1, as Ray does, not 6 (float division says 6.999...).
_UNITS = 10_000
GB = 10**9  # memory parameters (``*_memory_gb``, ``memory_per_worker_gb``) are decimal GB


def _units(amount: float) -> int:
    return round(amount * _UNITS)


def _amount(value: float) -> str:
    return f"{value:g}"


def _gb(memory_bytes: float) -> str:
    return f"{memory_bytes / GB:.3g} GB"


@dataclass(frozen=True)
class ResourceRequest:
    """What one copy of a Ray-backed step reserves: CPUs, GPUs (fractions share a GPU), the GPU
    type and memory."""

    cpus: float = 1.0
    gpus: float = 0.0
    accelerator_type: str | None = None  # e.g. "H100", "A10G": Ray's accelerator_type:<T>
    memory_bytes: int | None = None
    # Custom resources the nodes declare (``ray start --resources '{"fast_disk": 1}'``).
    custom: tuple[tuple[str, float], ...] = ()

    def __post_init__(self) -> None:
        amounts = [self.cpus, self.gpus, self.memory_bytes or 0, *(a for _, a in self.custom)]
        if any(amount < 0 for amount in amounts):
            raise ValueError(f"a resource request cannot be negative: {self}")

    def ray_resources(self) -> dict[str, float]:
        """The request as Ray's resource dict, the form node totals and placement groups use."""
        resources: dict[str, float] = {}
        if self.cpus:
            resources["CPU"] = self.cpus
        if self.gpus:
            resources["GPU"] = self.gpus
        if self.memory_bytes:
            resources["memory"] = float(self.memory_bytes)
        if self.accelerator_type:
            resources[ACCELERATOR_PREFIX + self.accelerator_type] = ACCELERATOR_SHARE
        resources.update(self.custom)
        return resources

    def actor_options(self) -> dict[str, Any]:
        """Keyword arguments for ``ray.remote(...).options`` and Serve's ``ray_actor_options``."""
        options: dict[str, Any] = {"num_cpus": self.cpus, "num_gpus": self.gpus}
        if self.memory_bytes:
            options["memory"] = self.memory_bytes
        if self.accelerator_type:
            options["accelerator_type"] = self.accelerator_type
        if self.custom:
            options["resources"] = dict(self.custom)
        return options

    def describe(self) -> str:
        """For messages: ``1 CPU, 1 GPU (H100), 4 GB``."""
        parts = [f"{_amount(self.cpus)} CPU"]
        if self.gpus or self.accelerator_type:
            kind = f" ({self.accelerator_type})" if self.accelerator_type else ""
            parts.append(f"{_amount(self.gpus)} GPU{kind}")
        if self.memory_bytes:
            parts.append(_gb(self.memory_bytes))
        parts.extend(f"{_amount(amount)} {name}" for name, amount in self.custom)
        return ", ".join(parts)


# Resources with fields of their own, which a custom-resource mapping may not name.
RESERVED_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")


def custom_resources(resources: dict[str, float]) -> tuple[tuple[str, float], ...]:
    """A validated custom-resource mapping as :attr:`ResourceRequest.custom` (sorted pairs);
    a ValueError names what is wrong."""
    for name, amount in resources.items():
        if name in RESERVED_RESOURCES or name.startswith((ACCELERATOR_PREFIX, "node:")):
            raise ValueError(
                f"{name!r} is not a custom resource; CPUs, GPUs, memory and the accelerator "
                "type have their own parameters"
            )
        if not amount > 0:
            raise ValueError(f"{name!r} must be a positive amount, got {amount}")
    return tuple(sorted((name, float(amount)) for name, amount in resources.items()))


@dataclass(frozen=True)
class RequestFields:
    """The parameters (dotted names) that set each part of a request, so that an error names
    the one to change; CLI flags mirror the last part."""

    count: str
    cpus: str
    gpus: str
    accelerator_type: str
    memory: str
    custom: str  # the custom-resource mapping


def cluster_nodes() -> list[dict[str, float]]:
    """Total resources of each alive node; Ray must be initialised."""
    import ray

    return [
        {name: float(value) for name, value in node["Resources"].items()}
        for node in ray.nodes()
        if node.get("Alive")
    ]


def free_per_node() -> dict[str, dict[str, tuple[float, float]]]:
    """Each alive node's CPUs, GPUs and custom resources as (free now, total), by IP address;
    Ray must be initialised."""
    import ray
    from ray._private.state import available_resources_per_node  # Ray's DeveloperAPI

    free = available_resources_per_node()  # a resource all in use is left out
    return {
        node["NodeManagerAddress"]: {
            name: (float(free.get(node["NodeID"], {}).get(name, 0.0)), float(total))
            for name, total in node["Resources"].items()
            if not name.startswith(("node:", ACCELERATOR_PREFIX))
            and name not in ("memory", "object_store_memory")
        }
        for node in ray.nodes()
        if node.get("Alive")
    }


# Work that Ray has not placed this long after it was asked for (a training's worker group, a
# campaign's trial workers) is reported with what it asks and what each node has free, and again
# every PLACEMENT_REPEAT_S while it waits: a user sees why nothing moves.
PLACEMENT_NOTICE_S = 5.0
PLACEMENT_REPEAT_S = 30.0


def describe_placement(
    request: str,
    count: int,
    nodes: dict[str, dict[str, tuple[float, float]]],
    what: str = "worker(s)",
) -> str:
    """``"2 worker(s) x (1 CPU) asked; free now: node 10.0.0.1: 0 of 2 CPU; ..."``."""
    shown = "; ".join(
        f"node {node}: "
        + ", ".join(
            f"{_amount(free)} of {_amount(total)} {name}"
            for name, (free, total) in sorted(resources.items())
        )
        for node, resources in sorted(nodes.items())
    )
    return f"{count} {what} x ({request}) asked; free now: {shown or 'no node alive'}"


def _per_node(resources: dict[str, float], node: dict[str, float]) -> int | None:
    """Copies of ``resources`` one node holds at once; None when it asks for nothing."""
    fits = [
        _units(node.get(name, 0.0)) // _units(need)
        for name, need in resources.items()
        if _units(need) > 0
    ]
    return min(fits) if fits else None


def placeable(request: ResourceRequest, nodes: Sequence[dict[str, float]]) -> int:
    """How many copies of ``request`` the nodes hold at once, each copy on one node.

    A request that asks for nothing fits without bound (:data:`UNBOUNDED`).
    """
    resources = request.ray_resources()
    if not any(_units(need) > 0 for need in resources.values()):
        return UNBOUNDED
    return sum(
        min(_units(node.get(name, 0.0)) // _units(need) for name, need in resources.items())
        for node in nodes
    )


UNBOUNDED = 2**62


def _total(nodes: Sequence[dict[str, float]], name: str) -> float:
    return sum(node.get(name, 0.0) for node in nodes)


def _largest(nodes: Sequence[dict[str, float]], name: str) -> float:
    return max((node.get(name, 0.0) for node in nodes), default=0.0)


def _gpu_types(nodes: Sequence[dict[str, float]]) -> list[str]:
    names = {name for node in nodes for name in node if name.startswith(ACCELERATOR_PREFIX)}
    return sorted(name.removeprefix(ACCELERATOR_PREFIX) for name in names)


def flag_of(field: str) -> str:
    """The CLI flag of a parameter (``training.accelerator_type`` -> ``--accelerator-type``)."""
    return "--" + field.rsplit(".", 1)[-1].replace("_", "-")


def _show(name: str, value: float) -> str:
    return f"{_gb(value)} memory" if name == "memory" else f"{_amount(value)} {name}"


def check_fits(
    request: ResourceRequest,
    count: int,
    nodes: Sequence[dict[str, float]],
    *,
    what: str,
    fields: RequestFields,
) -> int:
    """Raise a ConfigurationError naming the parameter to change when fewer than ``count``
    copies of ``request`` fit at once; else return how many fit.

    Args:
        request: one copy's resources.
        count: copies that must run at the same time (workers of one run, minimum replicas).
        nodes: each node's total resources (:func:`cluster_nodes`).
        what: the copies' noun for the message, e.g. ``"worker(s)"``.
        fields: the parameters that set the request.
    """
    fits = placeable(request, nodes)
    if fits >= count:
        return fits
    asked = f"{count} {what} x ({request.describe()}) asked"
    elsewhere = (
        "or use a cluster that has them (PREFECT_ML_RAY_ADDRESS; for an autoscaling cluster "
        "set PREFECT_ML_CHECK_RESOURCES=false)"
    )
    kind = request.accelerator_type
    eligible = [n for n in nodes if not kind or n.get(ACCELERATOR_PREFIX + kind, 0.0) > 0]
    if kind and not eligible:
        types = ", ".join(_gpu_types(nodes)) or "none"
        raise ConfigurationError(
            fields.accelerator_type,
            f"{asked}, the cluster has 0 {kind} GPUs (node GPU types: {types}); set "
            f"{flag_of(fields.accelerator_type)} to a type the cluster has or unset it, "
            f"{elsewhere}",
        )
    # Each node's totals, so the user sees what one worker can have at most.
    listed = "; ".join(_node_summary(n) for n in nodes[:8]) + ("; ..." if nodes[8:] else "")
    # The first resource that alone cannot hold ``count`` copies is the one to name.
    short = [
        (name, field)
        for name, need, field in (
            ("GPU", request.gpus, fields.gpus),
            *((name, amount, fields.custom) for name, amount in request.custom),
            ("memory", request.memory_bytes or 0, fields.memory),
            ("CPU", request.cpus, fields.cpus),
        )
        if _units(need) > 0
        and sum(_units(n.get(name, 0.0)) // _units(need) for n in eligible) < count
    ]
    if short:
        name, field = short[0]
        on_kind = f" on {kind} nodes" if kind else ""
        problem = (
            f"the cluster has {_show(name, _total(eligible, name))} in total{on_kind}, "
            f"the largest node {_show(name, _largest(eligible, name))}"
        )
    else:  # each resource alone would do, but no node has them all together
        field = fields.cpus
        problem = f"only {fits} fit at once, each on one node with all of it"
    raise ConfigurationError(
        field,
        f"{asked}, {problem}; ask for less ({flag_of(field)}, {flag_of(fields.count)}) "
        f"{elsewhere}. Each node's total: {listed or 'no node'}",
    )


def mixed_gpu_types(
    request: ResourceRequest, count: int, nodes: Sequence[dict[str, float]]
) -> list[str]:
    """The GPU types a group of ``count`` copies of ``request`` could be spread over, when that
    is more than one; else ``[]``.

    A data-parallel group steps together, at the pace of its slowest GPU: on a cluster of H100
    and T4 nodes, unpinned workers land on both. A request pinned to one type, a single copy and
    a CPU request cannot mix.
    """
    if count < 2 or request.gpus <= 0 or request.accelerator_type:
        return []
    types = _gpu_types([node for node in nodes if node.get("GPU", 0.0) > 0])
    return types if len(types) > 1 else []


def _node_summary(node: dict[str, float]) -> str:
    parts = [f"{_amount(node.get('CPU', 0.0))} CPU", f"{_amount(node.get('GPU', 0.0))} GPU"]
    types = _gpu_types([node])
    if types:
        parts[-1] += f" ({', '.join(types)})"
    if node.get("memory"):
        parts.append(_gb(node["memory"]))
    parts.extend(
        f"{_amount(amount)} {name}"
        for name, amount in sorted(node.items())
        if name not in RESERVED_RESOURCES and not name.startswith((ACCELERATOR_PREFIX, "node:"))
    )
    return ", ".join(parts)
