"""deployments/prefect.yaml and the parameter forms its flows render in the Prefect UI."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from prefect.flows import load_flow_from_entrypoint
from prefect.utilities.callables import parameter_schema

from prefect_ml.integrations.errors import ConfigurationError
from prefect_ml.integrations.services import read_deployment_specs, runner_deployments
from tests.conftest import REPO_ROOT

PREFECT_FILE = REPO_ROOT / "deployments" / "prefect.yaml"
EXPECTED = {
    "nightly": ("flows/pipeline.py:ml_pipeline", "ml-pipeline"),
    "campaign": ("flows/sweep.py:hpo_campaign", "hpo-campaign"),
    "train": ("flows/train.py:train_model", "train-model"),
    "serve": ("flows/serve.py:serve_model", "serve-model"),
    "batch-predict": ("flows/predict.py:batch_predict", "batch-predict"),
}


def test_prefect_yaml_names_every_flow_by_path_on_the_process_pool() -> None:
    document = yaml.safe_load(PREFECT_FILE.read_text())
    entries = {entry["name"]: entry for entry in document["deployments"]}
    assert {name: entry["entrypoint"] for name, entry in entries.items()} == {
        name: entrypoint for name, (entrypoint, _flow) in EXPECTED.items()
    }
    for name, (entrypoint, _flow) in EXPECTED.items():
        path = entrypoint.split(":")[0]
        assert (REPO_ROOT / path).is_file(), path
        assert entries[name]["work_pool"]["name"] == "ml-process"
        assert entries[name]["enforce_parameter_schema"] is True
    assert entries["nightly"]["schedules"] == [
        {"cron": "0 2 * * *", "timezone": "UTC", "active": True}
    ]
    assert all("schedules" not in entries[name] for name in EXPECTED if name != "nightly")


def test_prefect_ml_deploy_builds_the_same_deployments(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO_ROOT)  # entrypoints are relative to the project root
    deployments = runner_deployments(read_deployment_specs(PREFECT_FILE))
    built = {d.name: (d.entrypoint, d.flow_name) for d in deployments}
    assert built == EXPECTED
    nightly = next(d for d in deployments if d.name == "nightly")
    assert [s.schedule.cron for s in nightly.schedules] == ["0 2 * * *"]  # type: ignore[union-attr]
    assert nightly.concurrency_limit == 1
    assert all(d.enforce_parameter_schema for d in deployments)


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"name": "x", "entrypoint": "flows/train.py:train_model", "shedules": []}, "shedules"),
        ({"name": "x"}, "entrypoint"),
        (
            {"name": "x", "entrypoint": "flows/train.py:train_model", "schedules": [{"at": 1}]},
            "neither 'cron' nor 'interval'",
        ),
    ],
)
def test_a_wrong_deployment_entry_is_named(
    tmp_path: Path, entry: dict[str, Any], message: str
) -> None:
    prefect_file = tmp_path / "prefect.yaml"
    prefect_file.write_text(yaml.safe_dump({"deployments": [entry]}))
    with pytest.raises(ConfigurationError, match=message):
        read_deployment_specs(prefect_file)


def _leaf_fields(schema: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(section.field, property) for every field of every parameter model in the schema."""
    return [
        (f"{model}.{name}", prop)
        for model, definition in schema["definitions"].items()
        for name, prop in definition["properties"].items()
    ]


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_every_form_field_has_a_title_a_description_and_a_default(name: str) -> None:
    entrypoint, _flow = EXPECTED[name]
    flow = load_flow_from_entrypoint(str(REPO_ROOT / entrypoint), use_placeholder_flow=False)
    schema = parameter_schema(flow).model_dump_for_openapi()
    assert schema["properties"]["params"]["description"]  # from the flow's docstring
    assert "default" in schema["properties"]["params"]
    for field, prop in _leaf_fields(schema):
        assert prop.get("title"), f"{field} has no title"
        assert prop.get("description"), f"{field} has no description"
        if field != "SearchDimension.type":  # a search dimension must say its type
            assert "default" in prop, f"{field} has no default"


def test_choices_render_as_enums() -> None:
    flow = load_flow_from_entrypoint(
        str(REPO_ROOT / "flows/pipeline.py:ml_pipeline"), use_placeholder_flow=False
    )
    definitions = parameter_schema(flow).model_dump_for_openapi()["definitions"]
    assert definitions["TrainingParams"]["properties"]["optimizer"]["enum"] == [
        "adam",
        "adamw",
        "sgd",
    ]
    assert definitions["SweepParams"]["properties"]["sampler"]["enum"] == [
        "tpe",
        "random",
        "cmaes",
        "grid",
    ]
    assert definitions["DataParams"]["properties"]["task"]["enum"] == [
        "classification",
        "regression",
    ]
    # Optional choices (none: the task's own) are an enum or null.
    metric = definitions["RegistryParams"]["properties"]["metric"]
    assert metric["default"] is None
    assert [option.get("enum") for option in metric["anyOf"]] == [
        ["accuracy", "macro_f1", "loss", "rmse", "mae", "r2"],
        None,
    ]
