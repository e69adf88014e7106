"""What one Ray-backed copy (training worker, trial, serving replica) asks for, and whether the
cluster can place it.

A request the cluster can never satisfy does not fail in Ray: the actor stays pending forever.
So every flow checks its requests against the nodes' totals at start and names the parameter
to change instead. Ray places each copy on one node, so the check packs per node, not per total.
"""

from __future__ import annotations

from collections.abc import Sequence

from prefect_ml.integrations.config.resources import (
    ACCELERATOR_PREFIX,
    GB,
    RESERVED_RESOURCES,
    RequestFields,
    Resources,
)
from prefect_ml.integrations.errors import ConfigurationError

# Ray counts resources in fixed point with four decimals; comparing in those units makes
# 0.7 GPU hold 7 copies of 0.1, as Ray does, not 6 (float division says 6.999...).
_UNITS = 10_000


def _units(amount: float) -> int:
    return round(amount * _UNITS)


def _amount(value: float) -> str:
    return f"{value:g}"


def _gb(memory_bytes: float) -> str:
    return f"{memory_bytes / GB:.3g} GB"


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


def placeable(request: Resources, nodes: Sequence[dict[str, float]]) -> int:
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
    request: Resources,
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
    kind = request.accelerator_type
    eligible = [n for n in nodes if not kind or n.get(ACCELERATOR_PREFIX + kind, 0.0) > 0]
    if kind and not eligible:
        types = ", ".join(_gpu_types(nodes)) or "none"
        raise ConfigurationError(
            fields.accelerator_type,
            f"{asked}, the cluster has 0 {kind} GPUs (node GPU types: {types}); set "
            f"{flag_of(fields.accelerator_type)} to a type the cluster has or unset it, "
            f"{_ELSEWHERE}",
        )
    field, problem = _shortage(request, count, eligible, fields, fits)
    # Each node's totals, so the user sees what one worker can have at most.
    listed = "; ".join(_node_summary(n) for n in nodes[:8]) + ("; ..." if nodes[8:] else "")
    raise ConfigurationError(
        field,
        f"{asked}, {problem}; ask for less ({flag_of(field)}, {flag_of(fields.count)}) "
        f"{_ELSEWHERE}. Each node's total: {listed or 'no node'}",
    )


# Where copies that do not fit could run instead, for :func:`check_fits`'s messages.
_ELSEWHERE = (
    "or use a cluster that has them (PREFECT_ML_RAY_ADDRESS; for an autoscaling cluster "
    "set PREFECT_ML_CHECK_RESOURCES=false)"
)


def _shortage(
    request: Resources,
    count: int,
    eligible: Sequence[dict[str, float]],
    fields: RequestFields,
    fits: int,
) -> tuple[str, str]:
    """The parameter to change and what the ``eligible`` nodes lack, when ``count`` copies of
    ``request`` do not fit on them (``fits`` do)."""
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
    if not short:  # each resource alone would do, but no node has them all together
        return fields.cpus, f"only {fits} fit at once, each on one node with all of it"
    name, field = short[0]
    on_kind = f" on {request.accelerator_type} nodes" if request.accelerator_type else ""
    return field, (
        f"the cluster has {_show(name, _total(eligible, name))} in total{on_kind}, "
        f"the largest node {_show(name, _largest(eligible, name))}"
    )


def mixed_gpu_types(request: Resources, count: int, nodes: Sequence[dict[str, float]]) -> list[str]:
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
