"""Regression end to end, as a new user tries it: scikit-learn's diabetes data as a CSV, trained
with ``--task regression`` on 2 Ray workers, evaluated (RMSE, MAE, R², predicted-vs-actual),
registered with a signature of its feature columns, served (``/predict`` returns numbers) and
predicted by ``mlflow models predict`` from a CSV of those columns; then a campaign over a
regression space."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pandas as pd
import pytest
from mlflow.models import get_model_info
from sklearn.datasets import load_diabetes

from prefect_ml.flows.serve import serve_model
from prefect_ml.flows.sweep import hpo_campaign
from prefect_ml.flows.train import TrainingOutcome, train_model
from prefect_ml.integrations import tracking
from prefect_ml.integrations.settings import PrefectMLSettings
from prefect_ml.tasks.params import CampaignParams, ServeModelParams, TrainModelParams
from tests.helpers import serve_applications_deleted_after

pytestmark = pytest.mark.e2e

MODEL_NAME = "diabetes-regressor"
EPOCHS = 20


def write_diabetes_csv(path: Path) -> pd.DataFrame:
    frame = load_diabetes(as_frame=True).frame  # ten feature columns and "target"
    frame.to_csv(path, index=False)
    return frame


@dataclass
class Trained:
    settings: PrefectMLSettings
    frame: pd.DataFrame
    csv: Path
    outcome: TrainingOutcome
    url: str


def regression_params(csv: Path, **sections: dict) -> dict:
    return {
        "data": {
            "dataset": "tabular",
            "url": csv.as_uri(),
            "label_column": "target",
            "task": "regression",
            "split_seed": 2,  # seed 0's 67 test rows are hard: a linear fit scores R² 0.23
        },
        "model": {"hidden": 16, "depth": 1},
        "training": {"epochs": EPOCHS, "workers": 2, "batch_size": 32, "lr": 0.005},
        **sections,
    }


def test_a_campaign_over_a_regression_space_optimises_rmse(
    ray_cluster: None, home: PrefectMLSettings, tmp_path: Path
) -> None:
    """First in the module: its two trial slots need the CPUs the served model holds later."""
    csv = tmp_path / "diabetes.csv"
    write_diabetes_csv(csv)
    sweep = {
        "campaign": "diabetes",
        "n_trials": 3,
        "concurrency": 2,
        "pruner": "none",
        "search_space": {"lr": {"type": "float", "low": 1e-3, "high": 3e-2, "log": True}},
    }
    params = CampaignParams.model_validate(
        regression_params(csv, training={"epochs": 4, "batch_size": 32}, sweep=sweep)
    )
    assert params.sweep.objectives == {"val_rmse": "minimize"}  # the task's, by default
    result = hpo_campaign(params)
    assert result.complete == 3 and result.objectives == {"val_rmse": "minimize"}
    values = [trial.values["val_rmse"] for trial in result.trials]
    assert values == sorted(values) and result.best[0].values["val_rmse"] == values[0]
    assert set(result.best_params) == {"lr"}


@pytest.fixture(scope="module")
def trained(serve_port: int, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Trained]:
    """The diabetes regressor trained, registered (@champion) and served on a loopback port."""
    folder = tmp_path_factory.mktemp("regression")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PREFECT_ML_HOME", str(folder / "home"))
        for variable in ("MLFLOW_TRACKING_URI", "PREFECT_ML_MLFLOW_TRACKING_URI"):
            patch.delenv(variable, raising=False)
        csv = folder / "diabetes.csv"
        frame = write_diabetes_csv(csv)
        params = TrainModelParams.model_validate(
            regression_params(csv, registry={"model_name": MODEL_NAME})
        )
        outcome = train_model(params)
        with serve_applications_deleted_after():
            served = serve_model(
                ServeModelParams(
                    model_name=MODEL_NAME, serving={"port": serve_port, "replica_cpus": 0.25}
                )
            )
            yield Trained(PrefectMLSettings(), frame, csv, outcome, served.url)


def test_regression_trains_evaluates_and_registers_with_its_own_metrics(trained: Trained) -> None:
    outcome = trained.outcome
    assert outcome.data.task == "regression" and outcome.data.num_classes == 1
    assert outcome.data.class_names == []
    targets = trained.frame["target"]
    assert outcome.data.target_mean == pytest.approx(targets.mean(), rel=0.1)  # training split's
    metrics = outcome.evaluation.metrics
    assert set(metrics) == {"rmse", "mae", "r2", "loss"}
    assert outcome.evaluation.confusion_matrix is None
    assert metrics["r2"] > 0.3, metrics  # a mean predictor scores 0; on one process about 0.48
    assert metrics["rmse"] < targets.std()
    assert metrics["loss"] == pytest.approx(metrics["rmse"] ** 2)
    assert set(outcome.trained.epoch_metrics) >= {"val_rmse", "val_mae", "val_r2", "train_loss"}

    client = tracking.client_for(trained.settings.resolved_tracking_uri)
    run = client.get_run(outcome.trained.run_id)
    assert {"test_rmse", "test_mae", "test_r2"} <= set(run.data.metrics)
    assert "test_accuracy" not in run.data.metrics
    history = client.get_metric_history(outcome.trained.run_id, "val_rmse")
    assert [m.step for m in history] == list(range(1, EPOCHS + 1))
    artifacts = {a.path for a in client.list_artifacts(outcome.trained.run_id, "evaluation")}
    assert artifacts == {"evaluation/predicted_vs_actual.png"}

    registration = outcome.registration
    assert registration.promoted and "test_rmse" in registration.reason  # rmse by default
    version = client.get_model_version(MODEL_NAME, registration.version)
    assert version.tags[tracking.TASK_TAG] == "regression"
    # pt2 takes tensor signatures only: float64 rows of the ten columns, named in a tag.
    signature = get_model_info(registration.model_uri).signature
    assert signature is not None
    (spec,) = signature.inputs.inputs
    assert (str(spec.type), spec.shape) == ("float64", (-1, 10))
    features = [c for c in trained.frame.columns if c != "target"]
    assert json.loads(version.tags[tracking.FEATURE_NAMES_TAG]) == features


def test_served_regressor_answers_numbers_in_the_targets_units(trained: Trained) -> None:
    rows = trained.frame.drop(columns=["target"]).head(20)
    by_name = httpx.post(
        f"{trained.url}/predict", json={"inputs": rows.to_dict(orient="records")}, timeout=30
    )
    assert by_name.status_code == 200, by_name.text
    body = by_name.json()
    predictions = np.asarray(body["predictions"])
    assert predictions.dtype == np.float64 and predictions.shape == (20,)
    assert "probabilities" not in body
    actual = trained.frame["target"].head(20).to_numpy()
    assert np.abs(predictions - actual).mean() < trained.frame["target"].std()  # target units
    by_position = httpx.post(
        f"{trained.url}/predict", json={"inputs": rows.to_numpy().tolist()}, timeout=30
    ).json()
    np.testing.assert_allclose(by_position["predictions"], predictions, rtol=1e-5)
    metadata = httpx.get(f"{trained.url}/metadata", timeout=30).json()
    assert metadata["task"] == "regression" and metadata["classes"] == []


def test_mlflow_models_predict_takes_a_csv_of_the_feature_columns(
    trained: Trained, tmp_path: Path
) -> None:
    """The champion scored by MLflow's own CLI, from a CSV that names the columns."""
    rows = trained.frame.drop(columns=["target"]).head(15)
    csv = tmp_path / "rows.csv"
    rows.to_csv(csv, index=False)
    output = tmp_path / "predictions.json"
    mlflow_cli = Path(sys.executable).parent / "mlflow"
    command = [mlflow_cli, "models", "predict", "-m", f"models:/{MODEL_NAME}@champion"]
    command += ["-i", csv, "-t", "csv", "-o", output, "--env-manager", "local"]
    env = {**os.environ, "MLFLOW_TRACKING_URI": trained.settings.resolved_tracking_uri}
    run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    predicted = np.asarray(json.loads(output.read_text())["predictions"]).reshape(-1)
    served = httpx.post(
        f"{trained.url}/predict", json={"inputs": rows.to_numpy().tolist()}, timeout=30
    ).json()["predictions"]
    np.testing.assert_allclose(predicted, served, rtol=1e-4)
