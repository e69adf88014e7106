"""What one Ray-backed copy (a training worker, a campaign trial, a serving replica) reserves:
one model, :class:`Resources`, built from the section that asks for it, and the one
conversion to what Ray takes (placement resources, actor options, Ray Train's worker group).

The sections keep their flat fields (``cpus_per_worker``, ``trial_cpus``, ``replica_cpus``,
...): those are the flow parameters' public names, in the UI form, the CLI flags, the tasks'
keyword options and stored deployments. Each such field says on itself which part of the
request it sets (``Annotated[float, Reserve.CPUS]``, as a field's :class:`Role` is marked), and
:meth:`Resources.of` builds the request from those marks: no section converts by hand and no
map of names is kept beside the fields.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field

from prefect_ml.integrations.config._base import Section

# Ray's own names: a node with GPUs of type T carries the resource "accelerator_type:T" (value 1),
# and Ray (``ray._common.utils.resources_from_ray_options``, ``ScalingConfig.accelerator_type``)
# turns ``accelerator_type=T`` into a request of 0.001 of it, which pins a copy to such a node.
ACCELERATOR_PREFIX = "accelerator_type:"
ACCELERATOR_SHARE = 0.001
GB = 10**9  # memory parameters (``*_memory_gb``, ``memory_per_worker_gb``) are decimal GB
# Resources with fields of their own, which a custom-resource mapping may not name.
RESERVED_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")


def custom_resources(resources: dict[str, float]) -> tuple[tuple[str, float], ...]:
    """A validated custom-resource mapping as :attr:`Resources.custom` (sorted pairs);
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


def _check_custom(resources: dict[str, float]) -> dict[str, float]:
    custom_resources(resources)
    return resources


# A mapping of custom Ray resources, each a name nodes declare and a positive amount.
CustomResources = Annotated[dict[str, float], AfterValidator(_check_custom)]


def _pairs(custom: Any) -> Any:
    """A mapping (as parameters give it) or pairs, validated, as sorted pairs."""
    return custom_resources(dict(custom)) if isinstance(custom, dict | tuple | list) else custom


def _amount(value: float) -> str:
    return f"{value:g}"


class Resources(BaseModel):
    """What one copy of a Ray-backed step reserves: CPUs, GPUs (fractions share a GPU), the GPU
    type, memory and custom resources. Beyond the CPUs, what is not given is not asked for:
    the sections' own defaults are the only ones."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    cpus: float = Field(ge=0)
    gpus: float = Field(0.0, ge=0)  # a training section's use_gpu: one GPU, or none
    accelerator_type: str | None = None  # e.g. "H100", "A10G": Ray's accelerator_type:<T>
    memory: float | None = Field(None, ge=0)  # decimal GB, as the parameters give it
    # Custom resources the nodes declare (``ray start --resources '{"fast_disk": 1}'``).
    custom: Annotated[tuple[tuple[str, float], ...], BeforeValidator(_pairs)] = ()

    @classmethod
    def of(cls, section: BaseModel) -> Resources:
        """The request ``section``'s fields marked with a :class:`Reserve` part make."""
        marked = reserving_fields(type(section))
        return cls.model_validate(
            {
                part.value: getattr(section, name)
                for part, name in marked.items()
                if part is not Reserve.COUNT
            }
        )

    @property
    def memory_bytes(self) -> int | None:
        return None if self.memory is None else int(self.memory * GB)

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

    def scaling_options(self) -> dict[str, Any]:
        """Keyword arguments for Ray Train's ``ScalingConfig``: what each worker holds."""
        # Ray Train adds the accelerator resource itself from ``accelerator_type``.
        per_worker = {
            name: amount
            for name, amount in self.ray_resources().items()
            if amount and not name.startswith(ACCELERATOR_PREFIX)
        }
        return {
            "use_gpu": self.gpus > 0,
            "resources_per_worker": per_worker,
            "accelerator_type": self.accelerator_type,
        }

    def describe(self) -> str:
        """For messages: ``1 CPU, 1 GPU (H100), 4 GB``."""
        parts = [f"{_amount(self.cpus)} CPU"]
        if self.gpus or self.accelerator_type:
            kind = f" ({self.accelerator_type})" if self.accelerator_type else ""
            parts.append(f"{_amount(self.gpus)} GPU{kind}")
        if self.memory_bytes:
            parts.append(f"{self.memory_bytes / GB:.3g} GB")
        parts.extend(f"{_amount(amount)} {name}" for name, amount in self.custom)
        return ", ".join(parts)


class Reserve(enum.Enum):
    """The part of a request a section's field sets, marked on it:
    ``replica_cpus: Annotated[float, Reserve.CPUS]``. The values are :class:`Resources`'s
    fields, and :class:`RequestFields`'s."""

    COUNT = "count"  # how many copies must hold it at once (workers, trial workers, replicas)
    CPUS = "cpus"
    GPUS = "gpus"
    ACCELERATOR_TYPE = "accelerator_type"
    MEMORY = "memory"
    CUSTOM = "custom"


def reserving_fields(model: type[BaseModel]) -> dict[Reserve, str]:
    """The field of ``model`` that sets each part of its request, read from the marks."""
    marked: dict[Reserve, str] = {}
    for name, field in model.model_fields.items():
        for part in (m for m in field.metadata if isinstance(m, Reserve)):
            if part in marked:
                raise TypeError(f"{model.__name__}: {marked[part]} and {name} both set {part}")
            marked[part] = name
    return marked


class Reserving(Section):
    """A section that asks Ray for copies of something (training workers, campaign trials,
    serving replicas): its fields marked with a :class:`Reserve` part make the request."""

    def resources(self) -> Resources:
        """What Ray reserves for each copy."""
        return Resources.of(self)


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

    @classmethod
    def of(cls, section: str, model: type[BaseModel]) -> RequestFields:
        """The fields of ``model``, the flow parameters' section ``section``, marked with a
        :class:`Reserve` part."""
        marked = reserving_fields(model)
        return cls(**{part.value: f"{section}.{name}" for part, name in marked.items()})


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


def memory_field(title: str, reserved_for: str) -> Any:
    return Field(
        None, gt=0, title=title, description=f"Heap memory Ray reserves for {reserved_for}."
    )
