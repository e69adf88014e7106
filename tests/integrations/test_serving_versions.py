"""Several versions on one endpoint, without a server: how a request names a version, the
registry as a replica reads it (schemas kept, aliases looked up again, failures remembered for
a while), the settings that bound it, and the routes and header in the OpenAPI schema."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError
from sklearn.datasets import load_digits

from prefect_ml.integrations import tracking
from prefect_ml.integrations.config import ServingParams
from prefect_ml.integrations.errors import ConfigurationError
from prefect_ml.integrations.serving import (
    RequestError,
    Selection,
    ServedModel,
    VersionCatalog,
    _versions,
    check_registered,
    chosen,
    parse_model_id,
    registered_model,
)
from prefect_ml.integrations.settings import PrefectMLSettings
from tests.helpers import register_classifier

MODEL = "digits-classifier"


@pytest.mark.parametrize(
    ("model_id", "selection"),
    [
        ("digits-classifier/2", Selection(MODEL, "2")),
        ("digits-classifier@challenger", Selection(MODEL, "challenger")),
        ("acme.digits/10", Selection("acme.digits", "10")),
        ("a@b@champion", Selection("a@b", "champion")),
    ],
)
def test_a_header_names_a_version_or_an_alias(model_id: str, selection: Selection) -> None:
    assert parse_model_id(model_id) == selection
    assert str(selection) == model_id


@pytest.mark.parametrize(
    "model_id", [MODEL, f"{MODEL}/", f"{MODEL}/two", f"{MODEL}/²", "/2", "@x", "a@b/c"]
)
def test_a_header_that_names_no_version_is_a_400_that_shows_how(model_id: str) -> None:
    with pytest.raises(RequestError) as refused:
        parse_model_id(model_id)
    assert refused.value.status == 400
    assert "<name>/<version>" in refused.value.message and "<name>@<alias>" in refused.value.message


def test_the_path_and_the_header_select_one_version_together_or_a_400() -> None:
    assert chosen("", None) is None
    assert chosen(f"{MODEL}/2", None) == Selection(MODEL, "2")
    assert chosen("", Selection(MODEL, "3")) == Selection(MODEL, "3")
    assert chosen(f"{MODEL}/3", Selection(MODEL, "3")) == Selection(MODEL, "3")
    with pytest.raises(RequestError, match="the path selects digits-classifier/3 and the"):
        chosen(f"{MODEL}/2", Selection(MODEL, "3"))


@pytest.mark.parametrize(
    ("serving", "words"),
    [
        ({"other_models": "a/b"}, "holds '/' or '@'"),
        ({"other_models": ["a@b"]}, "give the registered model's name"),
        ({"other_models": "a, b, a"}, "named twice"),
        ({"other_models": "a", "max_models_per_replica": 0}, "raise --max-models-per-replica"),
        ({"max_models_per_replica": -1}, "max_models_per_replica"),
        ({"max_models_per_replica": 65}, "max_models_per_replica"),
    ],
)
def test_the_version_settings_name_the_field_to_fix(serving: dict[str, object], words: str) -> None:
    with pytest.raises(ValidationError, match=words):
        ServingParams.model_validate(serving)


def test_other_models_take_a_comma_separated_flag_or_a_list() -> None:
    assert ServingParams(other_models=" a, b ,").other_models == ["a", "b"]  # type: ignore[arg-type]
    assert ServingParams(other_models=["a", "b"]).other_models == ["a", "b"]
    assert ServingParams().max_models_per_replica == 3 and ServingParams().other_models == []


@pytest.fixture(scope="module")
def registry(
    mlflow_database_template: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[PrefectMLSettings, ServedModel]]:
    """digits-classifier v1 (@champion) and v2 registered in a home of the module's (as the
    ``home`` fixture makes one); v1 is the served one. The tests move only the challenger."""
    folder = tmp_path_factory.mktemp("versions") / "home"
    folder.mkdir()
    shutil.copyfile(mlflow_database_template, folder / "mlflow.db")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PREFECT_ML_HOME", str(folder))
        for variable in ("MLFLOW_TRACKING_URI", "PREFECT_ML_MLFLOW_TRACKING_URI"):
            patch.delenv(variable, raising=False)
        settings = PrefectMLSettings()
        digits = load_digits()
        features, labels = digits.data[:300].astype(np.float32), digits.target[:300]
        register_classifier(settings, MODEL, features, labels, seed=0)
        uri = settings.resolved_tracking_uri
        client = tracking.client_for(uri)
        version = client.get_model_version(MODEL, "1")
        # v2: the same artifacts and tags registered again (the catalog reads only the registry)
        client.create_model_version(MODEL, str(version.source), version.run_id, tags=version.tags)
        yield settings, registered_model(version, uri)


def test_the_catalog_reads_versions_and_aliases_from_the_registry_and_refuses_the_rest(
    registry: tuple[PrefectMLSettings, ServedModel], monkeypatch: pytest.MonkeyPatch
) -> None:
    settings, served = registry
    catalog = VersionCatalog(served, other_models=["other-model"])
    assert catalog.names == {MODEL, "other-model"}
    assert catalog.cached(Selection(MODEL, "1")) is served
    assert catalog.cached(Selection(MODEL, "2")) is None  # not asked for yet
    second = catalog.resolve(Selection(MODEL, "2"))
    assert (second.name, second.version) == (MODEL, "2")
    assert second.class_names == [str(c) for c in range(10)] and second.sample_shape == [64]
    assert catalog.cached(Selection(MODEL, "2")) is second  # kept

    client = tracking.client_for(settings.resolved_tracking_uri)
    tracking.set_alias(client, MODEL, "challenger", "2")
    assert catalog.resolve(Selection(MODEL, "challenger")) is second
    tracking.set_alias(client, MODEL, "challenger", "1")
    # within ALIAS_TTL_S the replica answers from what it read; after it, it reads again
    assert catalog.cached(Selection(MODEL, "challenger")) is second
    monkeypatch.setattr(_versions, "ALIAS_TTL_S", 0.0)
    assert catalog.cached(Selection(MODEL, "challenger")) is None
    assert catalog.resolve(Selection(MODEL, "challenger")).version == "1"

    for selection, words in [
        (Selection(MODEL, "9"), "digits-classifier has no version 9"),
        (Selection(MODEL, "nobody"), "digits-classifier has no alias nobody"),
        (Selection(MODEL, "x y"), "digits-classifier has no alias x y"),  # not an alias's name
        # beyond the registry's version column: MLflow's internal error, a 404 here
        (Selection(MODEL, "9" * 20), f"digits-classifier has no version {'9' * 20}"),
        (Selection("someone-elses", "1"), "someone-elses is not served here; versions of"),
    ]:
        with pytest.raises(RequestError) as refused:
            catalog.resolve(selection)
        assert refused.value.status == 404 and words in refused.value.message


def test_a_version_that_failed_to_load_is_refused_503_until_its_retry(
    registry: tuple[PrefectMLSettings, ServedModel], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, served = registry
    catalog = VersionCatalog(served, other_models=[])
    second = catalog.resolve(Selection(MODEL, "2"))
    catalog.failure(second)  # nothing recorded: no refusal
    problem = catalog.record_failure(second, ValueError("the artifact is gone\nand more"))
    assert problem.status == 503 and problem.headers == {"Retry-After": "30"}
    assert problem.message == (
        "digits-classifier/2 cannot be served now (ValueError: the artifact is gone); "
        "the other versions answer"
    )
    with pytest.raises(RequestError, match="cannot be served now"):
        catalog.failure(second)
    catalog.failure(served)  # the others are not refused
    monkeypatch.setattr(_versions, "FAILURE_TTL_S", 0.0)
    catalog.failure(second)  # tried again after FAILURE_TTL_S


def test_other_models_must_be_registered_before_serving(
    registry: tuple[PrefectMLSettings, ServedModel],
) -> None:
    settings, _ = registry
    check_registered(settings.resolved_tracking_uri, [MODEL], "serving.other_models")
    with pytest.raises(ConfigurationError, match="no registered model 'missing'") as refused:
        check_registered(settings.resolved_tracking_uri, [MODEL, "missing"], "serving.other_models")
    assert refused.value.field == "serving.other_models"


def test_the_openapi_schema_describes_the_version_routes_and_the_selection_header() -> None:
    from prefect_ml.integrations import serving

    paths = serving.api.openapi()["paths"]
    for route in ("/predict", "/invocations"):
        by_path = paths[f"/models/{{name}}/versions/{{version}}{route}"]["post"]
        assert [p["name"] for p in by_path["parameters"]] == ["name", "version"]
        assert "application/json" in by_path["requestBody"]["content"]
        assert "503" in by_path["responses"]
        header = paths[route]["post"]["parameters"]
        assert [(p["name"], p["in"]) for p in header] == [("serve_multiplexed_model_id", "header")]
    infer = paths["/v2/models/{name}/infer"]["post"]["parameters"]
    assert [p["name"] for p in infer] == ["name", "serve_multiplexed_model_id"]
    assert "503" in paths["/v2/models/{name}/versions/{version}/ready"]["get"]["responses"]
