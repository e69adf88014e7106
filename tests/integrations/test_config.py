"""The configuration is declared once: what a Ray training worker, a campaign trial or a Serve
replica receives is the sections themselves, so no receiving object or the function that
starts it declares a default of a section field again (a second default drifts: the loop
config's ``keep_checkpoints`` was 0 where the section's is 3, the replica's
``batch_inline_below_s`` 0.0 where the section's is 0.002, its ``max_queued_requests`` -1
where the section's is 512)."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

import pytest
from pydantic import BaseModel

from prefect_ml.integrations import serving, training
from prefect_ml.integrations.campaign import TrialSpec
from prefect_ml.integrations.config import (
    DataParams,
    ModelParams,
    PredictParams,
    ServingParams,
    SweepParams,
    TrainingParams,
)
from prefect_ml.integrations.config.loop import Splits, TrainLoop
from prefect_ml.integrations.config.resources import Reserve, Resources, reserving_fields
from prefect_ml.tasks import serve
from prefect_ml.tasks.data import PreparedData
from prefect_ml.tasks.training import train_loop

SECTION_FIELDS = {
    name
    for section in (
        DataParams,
        ModelParams,
        TrainingParams,
        SweepParams,
        ServingParams,
        PredictParams,
    )
    for name in section.model_fields
}
RECEIVERS: list[Any] = [
    TrainLoop,
    TrialSpec,
    training.fit,
    training.train_loop_per_worker,
    train_loop,
    serving.ReplicaOptions,
    serving.replica_arguments,
    serving.deployment_options,
    serving.deploy,
    serve.replica_options,
    serve.deploy_or_roll_back,
    serving.scorer_arguments,
    serving.score,
]


def declared_defaults(receiver: type | Callable[..., Any]) -> dict[str, Any]:
    """The defaults ``receiver`` itself declares: a pydantic model's or dataclass's fields
    (not inherited ones), a function's parameters."""
    if isinstance(receiver, type) and issubclass(receiver, BaseModel):
        own = vars(receiver).get("__annotations__", {})
        return {
            name: field.get_default(call_default_factory=True)
            for name, field in receiver.model_fields.items()
            if name in own and not field.is_required()
        }
    if dataclasses.is_dataclass(receiver):
        return {
            field.name: field.default
            for field in dataclasses.fields(receiver)
            if field.default is not dataclasses.MISSING
        }
    return {
        name: parameter.default
        for name, parameter in inspect.signature(receiver).parameters.items()
        if parameter.default is not inspect.Parameter.empty
    }


@pytest.mark.parametrize("receiver", RECEIVERS, ids=lambda r: r.__qualname__)
def test_what_a_worker_receives_declares_no_default_of_a_section_field(receiver: Any) -> None:
    twice = {
        name: value for name, value in declared_defaults(receiver).items() if name in SECTION_FIELDS
    }
    assert not twice, f"{receiver.__qualname__} declares section defaults again: {twice}"


def test_the_request_declares_no_default_of_what_a_section_asks() -> None:
    """Resources is built from every marked field of a section: beyond "nothing asked" (no
    GPU, type, memory or custom resource) it declares no default, so a section's is the one."""
    for section in (TrainingParams, SweepParams, ServingParams):
        for part in set(reserving_fields(section)) - {Reserve.COUNT}:
            field = Resources.model_fields[part.value]
            assert field.is_required() or not field.get_default(call_default_factory=True), part


def test_the_replica_is_constructed_with_the_serving_section_itself() -> None:
    assert serving.ReplicaOptions.model_fields["serving"].annotation is ServingParams
    assert all(field.is_required() for field in serving.ReplicaOptions.model_fields.values())


def test_the_loop_holds_the_sections_and_the_prepared_data_its_splits_once() -> None:
    assert TrainLoop.model_fields["model"].annotation is ModelParams
    assert TrainLoop.model_fields["training"].annotation is TrainingParams
    assert all(TrainLoop.model_fields[name].is_required() for name in ("model", "training"))
    own = set(vars(PreparedData).get("__annotations__", {}))
    assert issubclass(PreparedData, Splits) and not own & set(Splits.model_fields)
