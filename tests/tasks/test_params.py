from __future__ import annotations

import math
from typing import Any

import pytest
from pydantic import ValidationError

from prefect_ml.integrations.config import Role, fields_with, searchable
from prefect_ml.tasks.params import (
    CampaignParams,
    ModelParams,
    PipelineParams,
    SweepParams,
    TrainingParams,
    TrainModelParams,
    with_trial_values,
)


@pytest.mark.parametrize(
    ("given", "field", "message"),
    [
        ({"training": {"workers": 0}}, "training.workers", "needs at least 1 worker"),
        ({"training": {"workers": "4-2"}}, "training.workers", "max >= min (got (4, 2))"),
        ({"training": {"workers": "two"}}, "training.workers", "write 4 or 2-4"),
        ({"training": {"precision": "fp16"}}, "training", "fp16 needs a GPU: set --use-gpu"),
        ({"training": {"precision": "int8"}}, "training.precision", "'fp32', 'bf16' or 'fp16'"),
        ({"training": {"strategy": "zero3"}}, "training.strategy", "'tp' or 'pp'"),
        ({"training": {"accelerator_type": "H100"}}, "training", "set --use-gpu as well"),
        (
            {"training": {"strategy": "tp", "workers": 3, "tensor_parallel_size": 2}},
            "training",
            "tensor_parallel_size 2 must be at least 2 and divide the 3 workers",
        ),
        ({"training": {"strategy": "pp", "workers": "2-4"}}, "training", "fixed worker count"),
        ({"training": {"pipeline_parallel_size": 2}}, "training", "applies to --strategy pp"),
        (
            {"training": {"strategy": "pp", "batch_size": 2, "pipeline_microbatches": 4}},
            "training",
            "lower --pipeline-microbatches",
        ),
        (
            {"training": {"strategy": "pp", "checkpoint_layout": "gathered"}},
            "training",
            "no worker of a pipeline holds the whole model",
        ),
        ({"training": {"collective_timeout_s": 1}}, "training.collective_timeout_s", "10"),
        ({"training": {"epochs": -1}}, "training.epochs", "greater than or equal to 1"),
        ({"training": {"lr": 0}}, "training.lr", "greater than 0"),
        ({"training": {"lr": math.nan}}, "training.lr", "finite number"),
        ({"training": {"optimizer": "adagrad"}}, "training.optimizer", "'adam', 'adamw' or 'sgd'"),
        ({"data": {"dataset": "mnist"}}, "data", "unknown dataset 'mnist'"),
        ({"data": {"dataset": "tabular"}}, "data", "needs url; set --url"),
        ({"model": {"model": "transformer"}}, "model", "model.model: unknown model 'transformer'"),
        ({"model": {"model": "nope.nothing:build"}}, "model", "PREFECT_ML_ALLOWED_MODULES"),
        ({"model": {"model": "tests.fixtures.nope:build"}}, "model", "cannot import module"),
        ({"model": {"model_options": {"widht": 3}}}, "model", "does not accept ['widht']"),
        ({"training": {"wokers": 2}}, "training.wokers", "Extra inputs are not permitted"),
        ({"data": {"task": "ranking"}}, "data.task", "'classification' or 'regression'"),
        (
            {"data": {"task": "regression"}, "registry": {"metric": "accuracy"}},
            "",
            "registry.metric: regression produces no 'accuracy'; use one of ['rmse',",
        ),
        (
            {
                "data": {"task": "regression"},
                "training": {"best_checkpoint_metric": "val_accuracy"},
            },
            "",
            "training.best_checkpoint_metric: regression produces no 'val_accuracy'",
        ),
        (
            {"training": {"best_checkpoint_metric": "val_r2"}},
            "",
            "classification produces no 'val_r2'",
        ),
        (
            {"training": {"early_stopping_patience": 2, "early_stopping_metric": "val_rmse"}},
            "",
            "training.early_stopping_metric: classification produces no 'val_rmse'",
        ),
        (
            {"training": {"early_stopping_metric": "val loss!"}},
            "training.early_stopping_metric",
            "String should match pattern",
        ),
        (
            {"training": {"early_stopping_patience": 2, "early_stopping_metric": "val_acc"}},
            "",
            "classification produces no 'val_acc'",  # the built-in MLP logs nothing of its own
        ),
        ({"training": {"early_stopping_patience": -1}}, "training.early_stopping_patience", "0"),
        ({"training": {"early_stopping_min_delta": -1}}, "training.early_stopping_min_delta", "0"),
        ({"training": {"checkpoint_budget": 1.5}}, "training.checkpoint_budget", "less than or"),
        ({"training": {"checkpoint_budget": -0.1}}, "training.checkpoint_budget", "greater than"),
        ({"training": {"checkpoint_budget": "nan"}}, "training.checkpoint_budget", "finite"),
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


def test_run_key_ignores_fault_tolerance_and_layout_but_not_hyperparameters() -> None:
    """A run resumed on other workers or another strategy is the same run: its checkpoints
    restore under any layout. Precision changes what is computed, so it is a new run."""
    base = TrainModelParams()
    same = TrainModelParams.model_validate(
        {
            "training": {
                "max_failures": 9,
                "workers": "1-4",
                "strategy": "fsdp",
                "gradient_checkpointing": True,
                "collective_timeout_s": 60,
            }
        }
    )
    for change in ({"lr": 0.1}, {"precision": "bf16"}):
        other = TrainModelParams.model_validate({"training": change})
        assert base.run_key("fp") != other.run_key("fp"), change
    assert base.run_key("fp") == same.run_key("fp")
    assert base.run_key("fp") != base.run_key("fp2")


def test_early_stopping_is_in_the_run_identity_only_when_on_and_force_never_is() -> None:
    """Patience 0 (or unset) is the run it was before early stopping existed; on, its values
    and the metric it watches (by default the best-checkpoint metric) are the identity."""

    def key(**training: Any) -> str:
        return TrainModelParams.model_validate({"training": training}).run_key("fp")

    base = key()
    assert key(early_stopping_patience=0, early_stopping_min_delta=0.5) == base
    assert key(force=True) == base
    on = key(early_stopping_patience=2)
    assert on != base
    assert key(early_stopping_patience=2, early_stopping_metric="val_loss") == on
    assert key(early_stopping_patience=2, best_checkpoint_metric="val_accuracy") != on
    assert key(early_stopping_patience=2, early_stopping_min_delta=0.01) != on
    assert key(early_stopping_patience=2, force=True) == on
    watched = TrainModelParams.model_validate({"training": {"best_checkpoint_metric": "none"}})
    assert watched.training.early_stopping_monitor == "val_loss"


@pytest.mark.parametrize("name", ["early_stopping_patience", "force"])
def test_early_stopping_and_force_are_not_searchable(name: str) -> None:
    space = {name: {"type": "int", "low": 0, "high": 3}}
    with pytest.raises(ValidationError, match=f"'{name}' is not a tunable parameter"):
        SweepParams.model_validate({"search_space": space})


def test_the_role_marked_on_a_field_decides_the_run_identity_and_the_search_space() -> None:
    """One mark, two readers: a run's identity holds exactly the training fields a campaign may
    tune, and every field marked with a role is refused in a search space."""
    tunable = searchable(ModelParams) | searchable(TrainingParams)
    assert tunable == {
        *("hidden", "depth", "channels", "dropout"),
        *("epochs", "batch_size", "lr", "optimizer", "weight_decay", "scheduler", "seed"),
        "precision",
    }
    assert set(TrainingParams().identity()) == searchable(TrainingParams)
    assert fields_with(TrainingParams, Role.EARLY_STOPPING) == {
        "early_stopping_patience",
        "early_stopping_min_delta",
        "early_stopping_metric",
        "early_stopping_mode",
    }
    marked = fields_with(ModelParams, *Role) | fields_with(TrainingParams, *Role)
    assert {"model", "workers", "use_gpu", "strategy", "force"} <= marked
    for name in marked:
        space = {name: {"type": "categorical", "choices": [1]}}
        with pytest.raises(ValidationError, match=f"'{name}' is not a tunable parameter"):
            SweepParams.model_validate({"search_space": space})


@pytest.mark.parametrize(
    ("given", "expected"), [(3, (3, 3)), ("3", (3, 3)), ("1-4", (1, 4)), ([2, 4], (2, 4))]
)
def test_workers_is_a_count_or_an_elastic_range(given: Any, expected: tuple[int, int]) -> None:
    training = TrainModelParams.model_validate({"training": {"workers": given}}).training
    assert training.worker_range == expected


def test_a_workers_resources_carry_gpu_type_and_memory() -> None:
    training = TrainModelParams.model_validate(
        {
            "training": {
                "use_gpu": True,
                "accelerator_type": "H100",
                "memory_per_worker_gb": 8,
                "cpus_per_worker": 4,
            }
        }
    ).training
    request = training.resources()
    assert (request.cpus, request.gpus, request.accelerator_type) == (4, 1, "H100")
    assert request.memory_bytes == 8 * 10**9


@pytest.mark.parametrize(
    ("sweep", "field", "message"),
    [
        (
            {"search_space": {"lr": {"type": "float", "low": 0.1, "high": 0.01}}},
            "sweep.search_space.lr",
            "low (0.1) must be smaller than high (0.01)",
        ),
        (
            {"search_space": {"lr": {"type": "float", "low": 0.0, "high": 0.1, "log": True}}},
            "sweep.search_space.lr",
            "log scale needs low > 0",
        ),
        (
            {"search_space": {"optimizer": {"type": "categorical", "choices": []}}},
            "sweep.search_space.optimizer",
            "choices must be a non-empty list",
        ),
        (
            {"search_space": {"lr": {"type": "normal", "low": 0.1, "high": 1}}},
            "sweep.search_space.lr.type",
            "'float', 'int' or 'categorical'",
        ),
        (
            {"search_space": {"learning_rate": {"type": "float", "low": 0.1, "high": 1}}},
            "sweep",
            "'learning_rate' is not a tunable parameter",
        ),
        (
            {"search_space": {"workers": {"type": "int", "low": 1, "high": 4}}},
            "sweep",
            "'workers' is not a tunable parameter",
        ),
        (
            {"search_space": {"optimizer": {"type": "categorical", "choices": ["adam", "lion"]}}},
            "sweep",
            "search_space.optimizer: 'lion' is not a valid optimizer",
        ),
        (
            {"search_space": {"dropout": {"type": "float", "low": 0.0, "high": 1.5}}},
            "sweep",
            "search_space.dropout: 1.5 is not a valid dropout",
        ),
        ({"n_trials": 0}, "sweep.n_trials", "greater than or equal to 1"),
        ({"concurrency": 0}, "sweep.concurrency", "greater than or equal to 1"),
        ({"timeout_seconds": -5}, "sweep.timeout_seconds", "greater than 0"),
        ({"n_trials": None}, "sweep", "set a budget: n_trials and/or timeout_seconds"),
        ({"objectives": {"val acc!": "maximize"}}, "sweep", "['val acc!'] is not a metric name"),
        (
            {
                "objectives": {"val_accuracy": "maximize", "val_loss": "minimize"},
                "pruner": "median",
            },
            "sweep",
            "pruning needs a single objective",
        ),
        (
            {"sampler": "grid", "search_space": {"lr": {"type": "float", "low": 0.1, "high": 1}}},
            "sweep",
            "search_space.lr: a float dimension needs a step for grid search",
        ),
        ({"campaign": "../escape"}, "sweep.campaign", "should match pattern"),
        (
            {"sampler": "grid", "search_space": {"hidden": {"type": "int", "low": 1, "high": 1e7}}},
            "sweep",
            "search_space.hidden: the grid has 10,000,000 values, more than 10,000",
        ),
        (
            {
                "sampler": "grid",
                "search_space": {
                    "lr": {"type": "float", "low": 1e-9, "high": 1e308, "step": 1e-300}
                },
            },
            "sweep",
            "search_space.lr: the grid has",
        ),
        (
            {
                "sampler": "grid",
                "search_space": {"hidden": {"type": "int", "low": 1, "high": 9, "step": 0.5}},
            },
            "sweep",
            "search_space.hidden: an int dimension's step must be a whole number (got 0.5)",
        ),
        (
            {
                "sampler": "grid",
                "search_space": {
                    "hidden": {"type": "int", "low": 1, "high": 1000},
                    "depth": {"type": "int", "low": 1, "high": 1000},
                },
            },
            "sweep",
            "1,000,000 combinations {'hidden': 1000, 'depth': 1000}, more than 100,000",
        ),
    ],
)
def test_invalid_campaigns_name_the_field(sweep: dict[str, Any], field: str, message: str) -> None:
    with pytest.raises(ValidationError) as error:
        CampaignParams.model_validate({"sweep": sweep})
    problems = {".".join(map(str, e["loc"])): e["msg"] for e in error.value.errors()}
    assert field in problems, problems
    assert message in problems[field]


def test_trial_values_go_into_their_sections() -> None:
    params = PipelineParams(sweep={"n_trials": 2})
    tuned = with_trial_values(params, {"lr": 0.01, "hidden": 64, "optimizer": "sgd"})
    assert (tuned.training.lr, tuned.model.hidden, tuned.training.optimizer) == (0.01, 64, "sgd")
    assert tuned.sweep == params.sweep and tuned.training.epochs == params.training.epochs
    campaign = params.campaign()
    assert campaign.sweep.n_trials == 2 and campaign.training == params.training


def test_grid_values_cover_int_float_and_choices() -> None:
    grid = SweepParams(
        sampler="grid",
        search_space={
            "hidden": {"type": "int", "low": 16, "high": 64, "step": 16},
            "dropout": {"type": "float", "low": 0.0, "high": 0.2, "step": 0.1},
            "optimizer": {"type": "categorical", "choices": ["adam", "sgd"]},
        },
    ).search_space
    assert grid["hidden"].grid() == [16, 32, 48, 64]
    assert grid["dropout"].grid() == pytest.approx([0.0, 0.1, 0.2])
    assert grid["optimizer"].grid() == ["adam", "sgd"]


def test_half_precision_inference_needs_a_gpu_replica() -> None:
    from prefect_ml.tasks.params import ServingParams

    with pytest.raises(ValidationError, match="inference_precision bf16 needs a GPU replica"):
        ServingParams(inference_precision="bf16")
    assert ServingParams(inference_precision="fp16", replica_gpus=0.5).inference_precision == "fp16"


def test_a_campaign_optimises_metrics_its_task_produces() -> None:
    regression = {"data": {"task": "regression", "dataset": "tests.fixtures.user_code:blobs"}}
    assert CampaignParams.model_validate(regression).sweep.objectives == {"val_rmse": "minimize"}
    assert CampaignParams().sweep.objectives == {"val_accuracy": "maximize"}
    chosen = {**regression, "sweep": {"objectives": {"val_r2": "maximize"}}}
    assert CampaignParams.model_validate(chosen).sweep.objectives == {"val_r2": "maximize"}
    with pytest.raises(ValidationError, match="regression produces no \\['val_accuracy'\\]"):
        CampaignParams.model_validate(
            {**regression, "sweep": {"objectives": {"val_accuracy": "maximize"}}}
        )
    with pytest.raises(ValidationError, match="classification produces no \\['val_rmse'\\]"):
        PipelineParams.model_validate({"sweep": {"objectives": {"val_rmse": "minimize"}}})
