"""A campaign's search space, checked before any trial: define-by-run functions (by import path,
plug-in or the function itself), the declared dict with the user model's and dataset loader's
options and conditions, the sampler each gets, and every bad space's message; and the data of
trials that draw dataset options. No Ray: the space is asked for one trial of an in-memory
Optuna study, as the campaign does before it starts, and trials are planned, not trained."""

from __future__ import annotations

import json
import logging
import re
from collections import Counter
from pathlib import Path
from typing import Any

import optuna
import pytest
from click.testing import CliRunner
from pydantic import ValidationError

from prefect_ml.flows.cli import app, nested_parameters
from prefect_ml.integrations import storage
from prefect_ml.integrations.campaign import TUNED_ATTR, make_sampler, resolve_space, tuned_values
from prefect_ml.integrations.config.sweep import default_search_space
from prefect_ml.integrations.errors import ConfigurationError
from prefect_ml.integrations.settings import PrefectMLSettings
from prefect_ml.tasks.campaign.coordinator import TrialRefused
from prefect_ml.tasks.campaign.identity import CampaignIdentity
from prefect_ml.tasks.campaign.results import trial_summary
from prefect_ml.tasks.campaign.run import TrialPlanner
from prefect_ml.tasks.data import prepare_data
from prefect_ml.tasks.params import CampaignParams, params_from_options, with_trial_values
from tests.conftest import REPO_ROOT
from tests.fixtures import search_spaces as user_spaces

MODEL = "tests.fixtures.search_spaces:blocks_model"
SPACES = "tests.fixtures.search_spaces"
LOADER = f"{SPACES}:feature_subset"


def campaign_params(search_space: Any, **sweep: Any) -> CampaignParams:
    return CampaignParams.model_validate(
        {"model": {"model": MODEL}, "sweep": {"search_space": search_space, **sweep}}
    )


def refusal(search_space: Any, **sweep: Any) -> str:
    with pytest.raises(ValidationError) as error:
        campaign_params(search_space, **sweep)
    return " ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in error.value.errors())


@pytest.mark.parametrize(
    ("space", "message"),
    [
        (f"{SPACES}:nowhere", f"module '{SPACES}' has no attribute 'nowhere'"),
        ("tests.fixtures.missing_module:space", "cannot import module 'tests.fixtures.missing_"),
        ("os.path:join", "'os.path:join' is not allowed: module 'os.path' is neither under"),
        (f"{SPACES}:NOT_A_SPACE", f"'{SPACES}:NOT_A_SPACE' is not callable"),
        ("no_such_plugin", "neither an import path 'package.module:function' nor a plug-in"),
        (
            f"{SPACES}:raising",
            f"{SPACES}:raising raised RuntimeError: no GPU quota for this space, when asked",
        ),
        (f"{SPACES}:not_a_mapping", f"{SPACES}:not_a_mapping returned list, not a mapping"),
        (
            f"{SPACES}:unknown_name",
            f"{SPACES}:unknown_name: 'weight_decy' is not a tunable parameter; did you mean",
        ),
        (
            f"{SPACES}:refused_value",
            f"{SPACES}:refused_value sets dropout = 1.",
        ),
        (f"{SPACES}:unknown_option", "does not accept ['depthh']"),
    ],
)
def test_a_bad_define_by_run_space_fails_before_any_trial_naming_itself_and_the_key(
    space: str, message: str
) -> None:
    problem = refusal(space)

    assert "search_space" in problem
    assert message in problem


def test_an_unknown_name_is_shown_with_its_close_matches_and_every_tunable_name() -> None:
    problem = refusal(f"{SPACES}:unknown_name")

    assert "did you mean 'weight_decay'" in problem
    assert "'model_options.<key>'" in problem and "'weight_decay'" in problem
    assert "'dataset_options.<key>'" in problem


def test_a_refused_value_names_the_field_s_own_rule() -> None:
    assert "refused: Input should be less than 1" in refusal(f"{SPACES}:refused_value")


def test_grid_search_is_refused_for_a_define_by_run_space_with_the_reason() -> None:
    problem = refusal(f"{SPACES}:branch_and_loop", sampler="grid")

    assert "grid search enumerates every dimension's values before the first trial" in problem
    assert "a define-by-run space only shows its dimensions as it runs" in problem


def test_the_python_api_takes_the_function_itself_and_records_its_import_path() -> None:
    def space(trial: Any) -> dict[str, Any]:
        return {"model_options.widths": [trial.suggest_int("width", 8, 16)]}

    params = params_from_options(
        CampaignParams, {"model": MODEL, "search_space": space}, step="campaign"
    )

    assert params.sweep.search_space is space
    assert params.sweep.conditional
    shown = params.sweep.model_dump(mode="json")["search_space"]
    assert shown.endswith(
        ":test_the_python_api_takes_the_function_itself_and_records_its_import_path.<locals>.space"
    )
    with pytest.raises(ConfigurationError, match="sweep.search_space: .*raised ZeroDivisionError"):
        params_from_options(
            CampaignParams, {"model": MODEL, "search_space": lambda trial: 1 / 0}, step="campaign"
        )


def test_dotted_and_nested_names_are_the_same_values() -> None:
    nested = {"training": {"lr": 0.01}, "model": {"model_options": {"widths": [8]}}}
    dotted = {"training.lr": 0.01, "model.model_options.widths": [8]}
    short = {"lr": 0.01, "model_options.widths": [8]}

    found = [tuned_values(v, source="s") for v in (nested, dotted, short)]

    assert found == [short, short, short]
    params = with_trial_values(campaign_params(f"{SPACES}:branch_and_loop"), short)
    assert params.training.lr == 0.01 and params.model.model_options == {"widths": [8]}


def data_params(dataset: str, **options: Any) -> dict[str, Any]:
    return {"dataset": dataset, **options}


def test_a_space_tunes_the_options_the_user_loader_accepts_and_refuses_others() -> None:
    loader = {"data": data_params(LOADER)}
    declared = {"dataset_options.features": {"type": "categorical", "choices": [2, 4]}}
    for space in (declared, f"{SPACES}:features_and_widths"):
        params = CampaignParams.model_validate(
            {**loader, "model": {"model": MODEL}, "sweep": {"search_space": space}}
        )
        tuned = with_trial_values(params, {"dataset_options.features": 2})
        assert tuned.data.dataset_options == {"features": 2}

    misspelt = {"dataset_options.featurs": {"type": "int", "low": 2, "high": 8}}
    for space in (misspelt, f"{SPACES}:unknown_dataset_option"):
        with pytest.raises(ValidationError) as error:
            CampaignParams.model_validate({**loader, "sweep": {"search_space": space}})
        problem = str(error.value)
        assert "sweep.search_space" in problem and "does not accept ['featurs']" in problem
        assert "feature_subset" in problem, "the message names the loader"

    tabular = data_params("tabular", url="data.csv", label_column="y")
    with pytest.raises(ValidationError, match="the 'tabular' dataset takes none"):
        CampaignParams.model_validate({"data": tabular, "sweep": {"search_space": declared}})


def declared_conditional() -> dict[str, Any]:
    return {
        "optimizer": {"type": "categorical", "choices": ["adam", "sgd"]},
        "weight_decay": {
            "type": "float",
            "low": 1e-5,
            "high": 1e-2,
            "log": True,
            "when": {"optimizer": "sgd"},
        },
        "model_options.skip_scale": {
            "type": "float",
            "low": 0.1,
            "high": 1.0,
            "when": {"optimizer": ["sgd"]},
        },
        "model_options.widths": {"type": "categorical", "choices": [8, 16]},
    }


def test_a_declared_space_tunes_model_options_and_draws_a_condition_only_when_it_holds() -> None:
    sweep = campaign_params(declared_conditional(), sampler_seed=3).sweep
    assert sweep.conditional
    space = resolve_space(sweep.search_space)
    study = optuna.create_study(sampler=make_sampler("tpe", 3, conditional=True))

    drawn = []
    for _ in range(12):
        trial = study.ask()
        values = space(trial)
        study.tell(trial, 0.5)
        drawn.append((trial.params, values))

    assert {params["optimizer"] for params, _ in drawn} == {"adam", "sgd"}
    conditional = {"weight_decay", "model_options.skip_scale"}
    for params, values in drawn:
        sgd = params["optimizer"] == "sgd"
        assert set(params) & conditional == (conditional if sgd else set())
        assert values == params, "a declared dimension's name is the value's name"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"when": {"optimiser": "sgd"}}, "'optimiser' is not a dimension of the space"),
        ({"when": {"model_options.widths": 32}}, "has no choice [32]; its choices are [8, 16]"),
        ({"when": {"model_options.skip_scale": 0.5}}, "is a range; a condition names a categ"),
    ],
)
def test_a_bad_condition_is_refused_naming_the_dimension(
    change: dict[str, Any], message: str
) -> None:
    space = declared_conditional()
    space["weight_decay"].update(change)

    problem = refusal(space)

    assert "search_space.weight_decay.when" in problem and message in problem


def test_conditions_that_name_each_other_are_refused_as_a_cycle() -> None:
    space = {
        "optimizer": {
            "type": "categorical",
            "choices": ["adam", "sgd"],
            "when": {"scheduler": "none"},
        },
        "scheduler": {
            "type": "categorical",
            "choices": ["cosine", "none"],
            "when": {"optimizer": "sgd"},
        },
    }
    assert "name each other in a cycle" in refusal(space)


def test_a_declared_option_the_user_factory_does_not_take_is_refused() -> None:
    problem = refusal({"model_options.depthh": {"type": "int", "low": 1, "high": 3}})

    assert "sweep.search_space" in problem and "does not accept ['depthh']" in problem


def test_grid_search_refuses_conditions() -> None:
    space = declared_conditional()
    del space["weight_decay"]
    space["model_options.skip_scale"] = {
        "type": "categorical",
        "choices": [0.1, 0.5],
        "when": {"optimizer": "sgd"},
    }

    assert "grid search needs the same dimensions in every trial" in refusal(space, sampler="grid")


def test_the_sampler_models_a_conditional_space_jointly() -> None:
    conditional = make_sampler("tpe", 0, conditional=True)
    plain = make_sampler("tpe", 0)

    assert conditional._multivariate and conditional._group  # type: ignore[attr-defined]
    assert not plain._multivariate  # type: ignore[attr-defined]
    assert not campaign_params(default_search_space()).sweep.conditional


def test_a_trial_s_summary_carries_what_its_space_set_and_what_it_drew() -> None:
    space = resolve_space(user_spaces.branch_and_loop)
    study = optuna.create_study(direction="maximize")
    trial = study.ask()
    values = tuned_values(space(trial), source="s")
    trial.set_user_attr(TUNED_ATTR, values)
    study.tell(trial, 0.9)

    summary = trial_summary(study.trials[0], ["val_accuracy"], {})

    assert summary.tuned == values and "model_options.widths" in summary.tuned
    assert summary.params == study.trials[0].params and "blocks" in summary.params


def _shown_default(help_text: str) -> str:
    flat = " ".join(help_text.split())
    start = flat.index("--search-space")
    shown = flat[start:].split("[default: ", 1)[1]
    return shown[: shown.index("] (inline JSON/YAML")]


def test_sweep_help_shows_the_default_search_space_as_json_a_user_can_type() -> None:
    result = CliRunner().invoke(app, ["sweep", "--help"], terminal_width=100)

    assert result.exit_code == 0, result.output
    assert "SearchDimension(" not in result.output
    typed = json.loads(_shown_default(result.output))
    assert campaign_params(typed).sweep.search_space == default_search_space()


def test_the_search_space_flag_takes_an_import_path_or_a_mapping() -> None:
    by_path = nested_parameters(CampaignParams, {"search_space": f"{SPACES}:branch_and_loop"})
    inline = nested_parameters(
        CampaignParams, {"search_space": '{"lr": {"type": "float", "low": 0.001, "high": 0.1}}'}
    )

    assert by_path["sweep"]["search_space"] == f"{SPACES}:branch_and_loop"
    assert inline["sweep"]["search_space"]["lr"]["high"] == 0.1


def test_prefect_ml_sweep_refuses_a_bad_space_before_it_starts_anything() -> None:
    result = CliRunner().invoke(
        app, ["sweep", "--model", MODEL, "--search-space", f"{SPACES}:raising"]
    )

    assert result.exit_code == 2
    shown = " ".join(re.sub("[│┃]", " ", result.output).split())
    assert f"{SPACES}:raising raised RuntimeError: no GPU quota for this space" in shown


def test_the_docs_example_and_its_declared_equivalent_tune_the_example_model(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch
    import yaml

    from prefect_ml.integrations import datasets

    monkeypatch.setenv("PREFECT_ML_ALLOWED_MODULES", "examples")
    declared = yaml.safe_load((REPO_ROOT / "examples/search_space.yaml").read_text())
    for space in ("examples.search_space:space", declared):
        params = CampaignParams.model_validate(
            {"model": {"model": "examples.search_space:build"}, "sweep": {"search_space": space}}
        )
        assert params.sweep.conditional
        function = resolve_space(params.sweep.search_space)
        study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=1))
        for _ in range(6):
            trial = study.ask()
            values = tuned_values(function(trial), source="example")
            tuned = with_trial_values(params, values)
            assert ("weight_decay" in values) == (tuned.training.optimizer == "sgd")
            options = tuned.model.factory_options()
            model = datasets.build_model(tuned.model.model, (1, 8, 8), 10, options)
            assert model(torch.zeros(2, 1, 8, 8)).shape == (2, 10)
            study.tell(trial, 0.5)


def loads(received: Path) -> list[int | None]:
    """The ``features`` the fixture loader was called with, one per call."""
    return [json.loads(p.read_text())["features"] for p in received.iterdir()]


def test_trials_that_draw_dataset_options_train_on_data_prepared_once_per_distinct_options(
    home: PrefectMLSettings, tmp_path: Path
) -> None:
    received = tmp_path / "received"
    params = CampaignParams.model_validate(
        {
            "data": {"dataset": LOADER, "dataset_options": {"record": str(received)}},
            "model": {"model": MODEL},
            "training": {"batch_size": 32},
            "sweep": {"search_space": f"{SPACES}:features_and_widths"},
        }
    )
    logger = logging.getLogger("campaign")
    campaign_data = prepare_data(params.data, storage.root_url(home), logger)
    assert loads(received) == [None], "the campaign's own data: every feature"
    identity = CampaignIdentity(name="c", key="c@0", checkpoint_root="file:///campaign")
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=4))

    def plan_trials(planner: TrialPlanner, count: int) -> list[tuple[int, Any, dict[str, Any]]]:
        planned = []
        for _ in range(count):
            trial = study.ask()
            spec, mlflow_params = planner(trial)
            study.tell(trial, 0.5)
            planned.append((trial.params["features"], spec.loop.data, mlflow_params))
        return planned

    planned = plan_trials(TrialPlanner.of(params, campaign_data, identity, home, logger), 8)

    drawn = [features for features, _, _ in planned]
    assert set(drawn) == {2, 4, 8} and len(drawn) > 3, "some trials drew the same options"
    assert Counter(loads(received)) == Counter([None, 2, 4, 8]), "once per distinct options"
    for features, data, mlflow_params in planned:
        assert data.sample_shape == [features], "the trial trains on its own feature subset"
        assert mlflow_params["data.dataset_options"]["features"] == features
        assert mlflow_params["drawn.features"] == features
        assert data.splits_url.endswith(f"/{mlflow_params['data.fingerprint']}")
    by_features = {features: data.splits_url for features, data, _ in planned}
    assert len(set(by_features.values())) == 3
    assert all(data.splits_url == by_features[f] for f, data, _ in planned), "shared copies"
    assert by_features[8] == campaign_data.splits_url, "the same content: the same splits"

    # A resumed campaign (a new process) reuses what the study remembers: no loading again.
    resumed = plan_trials(TrialPlanner.of(params, campaign_data, identity, home, logger), 4)
    assert len(loads(received)) == 4
    assert all(data.splits_url == by_features[f] for f, data, _ in resumed)

    # A space that sets no dataset option trains every trial on the campaign's data.
    sweep = params.sweep.model_copy(update={"search_space": f"{SPACES}:branch_and_loop"})
    plain = params.model_copy(update={"sweep": sweep})
    trial = study.ask()
    spec, mlflow_params = TrialPlanner.of(plain, campaign_data, identity, home, logger)(trial)
    assert spec.loop.data.splits_url == campaign_data.splits_url
    assert "data.fingerprint" not in mlflow_params and len(loads(received)) == 4


def test_a_trial_whose_dataset_options_leave_too_few_rows_fails_alone_with_the_reason(
    home: PrefectMLSettings,
) -> None:
    params = CampaignParams.model_validate(
        {
            "data": {"dataset": LOADER},
            "model": {"model": MODEL},
            "training": {"batch_size": 64},
            "sweep": {"search_space": f"{SPACES}:few_rows"},
        }
    )
    logger = logging.getLogger("campaign")
    campaign_data = prepare_data(params.data, storage.root_url(home), logger)
    identity = CampaignIdentity(name="c", key="c@0", checkpoint_root="file:///campaign")
    planner = TrialPlanner.of(params, campaign_data, identity, home, logger)
    study = optuna.create_study()
    study.enqueue_trial({"rows": 30})
    trial = study.ask()

    with pytest.raises(TrialRefused) as refused:
        planner(trial)

    assert "training.batch_size: 64 is larger than the training split" in refused.value.reason
    assert refused.value.mlflow_params == {"drawn.rows": 30}
