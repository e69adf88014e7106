"""``batch_predict`` on a real Ray, MLflow registry, Prefect API and S3 API (moto): predictions
equal the model's own row for row, the manifest commits the output, a rerun reuses it, and bad
inputs fail before any Ray work, naming what to fix."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import mlflow.pytorch
import numpy as np
import pandas as pd
import pytest
import torch
from click.testing import CliRunner
from sklearn.datasets import load_digits

from prefect_ml.flows.cli import app
from prefect_ml.flows.predict import batch_predict
from prefect_ml.integrations import storage
from prefect_ml.integrations.errors import ConfigurationError
from prefect_ml.integrations.settings import PrefectMLSettings
from prefect_ml.tasks.params import PredictParams
from tests.helpers import flow_run_artifacts, register_classifier

MODEL = "batch-digits"
DIGITS = load_digits()
FEATURES = DIGITS.data.astype(np.float32)
NAMES = [f"pixel_{i}" for i in range(FEATURES.shape[1])]


@dataclass
class Registered:
    settings: PrefectMLSettings
    version: str
    run_id: str
    rows: pd.DataFrame  # an ``id`` column and the features

    def expected(self) -> pd.Series:
        """The registered model's own predictions, loaded in this process, by id."""
        mlflow.set_tracking_uri(self.settings.resolved_tracking_uri)
        model = mlflow.pytorch.load_model(f"models:/{MODEL}/{self.version}")
        module = model.module() if isinstance(model, torch.export.ExportedProgram) else model
        with torch.inference_mode():
            logits = module(torch.from_numpy(self.rows[NAMES].to_numpy(np.float32, copy=True)))
        return pd.Series(logits.argmax(dim=1).numpy().astype(str), index=self.rows["id"])


@pytest.fixture(scope="module")
def registered(ray_cluster: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registered]:
    """A classifier that names its feature columns, registered once @champion in its own home."""
    from prefect_ml.integrations import tracking

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PREFECT_ML_HOME", str(tmp_path_factory.mktemp("predict") / "home"))
        for variable in ("MLFLOW_TRACKING_URI", "PREFECT_ML_MLFLOW_TRACKING_URI"):
            patch.delenv(variable, raising=False)
        settings = PrefectMLSettings()
        version = register_classifier(
            settings, MODEL, FEATURES, DIGITS.target, seed=0, feature_names=NAMES
        )
        client = tracking.client_for(settings.resolved_tracking_uri)
        run_id = str(client.get_model_version(MODEL, version).run_id)
        rows = pd.DataFrame(FEATURES, columns=NAMES)
        rows.insert(0, "id", [f"row-{i:04d}" for i in range(len(rows))])
        yield Registered(settings, version, run_id, rows)


def _scored(params: PredictParams) -> tuple[str, object]:
    state = batch_predict(params, return_state=True)
    assert state.is_completed(), state.message
    return str(state.state_details.flow_run_id), state.result()


def _check_predictions(registered: Registered, output_url: str) -> None:
    fs, path = storage.filesystem(output_url)
    files = [f for f in fs.find(path) if f.endswith(".parquet")]
    scored = pd.concat(pd.read_parquet(fs.open(f)) for f in files).set_index("id")
    expected = registered.expected()
    assert sorted(scored.index) == sorted(expected.index)  # every row once, ids passed through
    assert (scored["prediction"] == expected.loc[scored.index]).all()
    probabilities = np.stack(scored["probabilities"].to_numpy())
    assert probabilities.shape == (len(expected), 10)
    np.testing.assert_allclose(probabilities.sum(axis=1), 1.0, atol=1e-4)
    assert list(scored.columns) == ["prediction", "probabilities"]


def test_a_csv_directory_is_scored_row_for_row_and_a_rerun_reuses_it(
    registered: Registered, tmp_path: Path
) -> None:
    folder = tmp_path / "csv"
    folder.mkdir()
    half = len(registered.rows) // 2
    registered.rows.iloc[:half].to_csv(folder / "a.csv", index=False)
    registered.rows.iloc[half:].to_csv(folder / "b.csv", index=False)
    params = PredictParams(model_name=MODEL, url=str(folder), concurrency=1)

    flow_run_id, result = _scored(params)
    manifest = result.manifest  # type: ignore[attr-defined]
    assert not result.reused  # type: ignore[attr-defined]
    assert manifest.output_url.startswith(
        storage.join(storage.root_url(registered.settings), "predictions")
    )
    _check_predictions(registered, manifest.output_url)
    committed = json.loads(
        storage.read_bytes(storage.predictions_manifest_url(manifest.output_url))
    )
    assert committed["model_version"] == registered.version
    assert committed["run_id"] == registered.run_id
    assert committed["rows"] == len(registered.rows)
    assert len(committed["inputs"]) == 2 and committed["created"]
    assert not storage.exists(storage.predictions_pending_url(manifest.output_url))
    artifacts = flow_run_artifacts(flow_run_id)
    assert f"v{registered.version}" in artifacts["batch-predictions"]
    assert manifest.output_url in artifacts["batch-predictions"]

    _, again = _scored(params)
    assert again.reused  # type: ignore[attr-defined]
    assert again.manifest == manifest  # type: ignore[attr-defined]
    command = ["predict", "--model-name", MODEL, "--alias", "champion", "--url", str(folder)]
    printed = CliRunner().invoke(app, command)
    assert printed.exit_code == 0, printed.output
    assert "reused" in printed.output and f"{len(registered.rows):,}" in printed.output


def test_one_parquet_file_is_read_as_the_blocks_asked_so_every_actor_gets_rows(
    registered: Registered, tmp_path: Path
) -> None:
    from prefect_ml.integrations import datasets

    registered.rows.to_parquet(tmp_path / "digits.parquet", index=False)
    files = datasets.describe_files(str(tmp_path), "url")
    # Ray 2.60's default Parquet reader makes these rows one block, whatever the count asked.
    read = datasets.read_files(files, "parquet", blocks=4, read_tasks=1).materialize()
    assert read.num_blocks() >= 4
    assert read.count() == len(registered.rows)


def test_a_parquet_file_on_s3_is_scored_into_s3(registered: Registered, s3_bucket: str) -> None:
    source = f"{s3_bucket}/rows/digits.parquet"
    storage.write_bytes(source, registered.rows.to_parquet(index=False))
    output = f"{s3_bucket}/predictions/digits"
    params = PredictParams(
        model_name=MODEL,
        model_version=registered.version,
        url=source,
        output=output,
        concurrency=1,
    )

    _, result = _scored(params)

    assert result.manifest.output_url == output  # type: ignore[attr-defined]
    assert result.manifest.inputs == [source]  # type: ignore[attr-defined]
    _check_predictions(registered, output)
    assert storage.exists(storage.predictions_manifest_url(output))


def test_a_missing_feature_column_fails_before_any_ray_work_naming_it(
    registered: Registered, tmp_path: Path
) -> None:
    source = tmp_path / "rows.csv"
    registered.rows.drop(columns=["pixel_5"]).to_csv(source, index=False)
    output = tmp_path / "out"

    state = batch_predict(
        PredictParams(model_name=MODEL, url=str(source), output=str(output)), return_state=True
    )

    assert state.is_failed()
    error = state.result(raise_on_failure=False)
    assert isinstance(error, ConfigurationError)
    assert error.field == "url" and "'pixel_5'" in error.message
    assert not output.exists()  # nothing was scored or written


def test_a_bad_alias_or_parameter_fails_naming_the_field(
    registered: Registered, tmp_path: Path
) -> None:
    source = tmp_path / "rows.csv"
    registered.rows.to_csv(source, index=False)

    state = batch_predict(
        PredictParams(model_name=MODEL, alias="no-such-alias", url=str(source)), return_state=True
    )

    error = state.result(raise_on_failure=False)
    assert isinstance(error, ConfigurationError)
    assert error.field == "alias" and "@no-such-alias" in error.message
    with pytest.raises(ValueError, match="concurrency"):
        PredictParams(url=str(source), concurrency=0)
    with pytest.raises(ValueError, match="needs a GPU"):
        PredictParams(url=str(source), inference_precision="bf16")
