"""The fields that say what one Ray-backed copy (training worker, campaign trial, serving
replica) reserves."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, Field

from prefect_ml.integrations.resources import GB, custom_resources


def accelerator_field(title: str, placed: str, gpus_field: str) -> Any:
    return Field(
        None,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$",
        title=title,
        description=f"Place {placed} only on nodes with this accelerator (Ray's "
        f"accelerator_type, e.g. H100, A10G, L4); needs {gpus_field}.",
    )


def resources_field(title: str, placed: str) -> Any:
    return Field(
        default_factory=dict,
        title=title,
        description=f"Custom Ray resources each of the {placed} reserves, e.g. "
        '{"fast_disk": 1}: they land only on nodes started with them (ray start --resources).',
    )


def _check_custom(resources: dict[str, float]) -> dict[str, float]:
    custom_resources(resources)
    return resources


# A mapping of custom Ray resources, each a name nodes declare and a positive amount.
CustomResources = Annotated[dict[str, float], AfterValidator(_check_custom)]


def memory_field(title: str, reserved_for: str) -> Any:
    return Field(
        None, gt=0, title=title, description=f"Heap memory Ray reserves for {reserved_for}."
    )


def to_bytes(gigabytes: float | None) -> int | None:
    return None if gigabytes is None else int(gigabytes * GB)
