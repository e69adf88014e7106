from __future__ import annotations

import math
from typing import Any

import pytest
from pydantic import ValidationError

from tasks.params import PipelineParams, TrainModelParams


@pytest.mark.parametrize(
    ("given", "field", "message"),
    [
        ({"training": {"workers": 0}}, "training.workers", "greater than or equal to 1"),
        ({"training": {"epochs": -1}}, "training.epochs", "greater than or equal to 1"),
        ({"training": {"lr": 0}}, "training.lr", "greater than 0"),
        ({"training": {"lr": math.nan}}, "training.lr", "finite number"),
        ({"training": {"optimizer": "adagrad"}}, "training.optimizer", "'adam', 'adamw' or 'sgd'"),
        ({"data": {"dataset": "mnist"}}, "data", "unknown dataset 'mnist'"),
        ({"data": {"dataset": "tabular"}}, "data", "needs url; set --url"),
        ({"model": {"model": "transformer"}}, "model", "model.model: unknown model 'transformer'"),
        ({"model": {"model": "nope.nothing:build"}}, "model", "cannot import module"),
        ({"model": {"model_options": {"widht": 3}}}, "model", "does not accept ['widht']"),
        ({"training": {"wokers": 2}}, "training.wokers", "Extra inputs are not permitted"),
    ],
)
def test_invalid_parameters_name_the_field(given: dict[str, Any], field: str, message: str) -> None:
    with pytest.raises(ValidationError) as error:
        TrainModelParams.model_validate(given)
    problems = {".".join(map(str, e["loc"])): e["msg"] for e in error.value.errors()}
    assert field in problems, problems
    assert message in problems[field]


def test_defaults_are_valid_and_json_schema_has_titles() -> None:
    schema = PipelineParams.model_json_schema()
    training = schema["$defs"]["TrainingParams"]["properties"]
    assert training["workers"]["title"] == "Workers" and training["workers"]["default"] == 2
    assert training["optimizer"]["enum"] == ["adam", "adamw", "sgd"]
    assert all("description" in field for field in training.values())


def test_run_key_ignores_fault_tolerance_but_not_hyperparameters() -> None:
    base = TrainModelParams()
    same = TrainModelParams.model_validate({"training": {"max_failures": 9}})
    other = TrainModelParams.model_validate({"training": {"lr": 0.1}})
    assert base.run_key("fp") == same.run_key("fp")
    assert base.run_key("fp") != other.run_key("fp")
    assert base.run_key("fp") != base.run_key("fp2")
