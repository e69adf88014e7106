"""``ml_pipeline`` end to end on real Prefect, Ray and MLflow: train, register, promote or not."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import mlflow.pyfunc
import numpy as np
import pytest
from click.testing import CliRunner
from sklearn.datasets import load_digits

from examples import pipeline_from_python
from prefect_ml.flows.cli import app
from prefect_ml.flows.pipeline import ml_pipeline
from prefect_ml.integrations import storage, tracking
from prefect_ml.integrations.settings import PrefectMLSettings
from prefect_ml.tasks.params import PipelineParams
from tests.helpers import flow_run_artifacts, free_port, serve_applications_deleted_after, wait_for
from tests.s3 import TEST_BUCKET, MotoS3


def _timeline(markdown: str) -> list[tuple[str, float]]:
    """The (moment, seconds since the process started) rows of a timeline artifact."""
    rows = [line.strip("|").split("|") for line in markdown.splitlines() if line.startswith("| ")]
    return [(cells[0].strip(), float(cells[1])) for cells in rows[1:]]  # after the header


def _predict_with_mlflow_models_serve(home: PrefectMLSettings, images: np.ndarray) -> np.ndarray:
    """``mlflow models serve -m models:/digits-classifier@champion``, as Get started says."""
    port = free_port()
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlflow",
            "models",
            "serve",
            "-m",
            "models:/digits-classifier@champion",
            "--env-manager",
            "local",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ],
        env={
            **os.environ,
            "MLFLOW_TRACKING_URI": home.resolved_tracking_uri,
            # mlflow starts `uvicorn` by name: the virtualenv's bin must be on PATH, as when active.
            "PATH": os.pathsep.join([os.path.dirname(sys.executable), os.environ["PATH"]]),
        },
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: _responds(f"{base}/ping"), 120, "mlflow models serve to come up")
        response = httpx.post(
            f"{base}/invocations", json={"inputs": images.astype(np.float32).tolist()}, timeout=30
        )
        response.raise_for_status()
        return np.asarray(response.json()["predictions"])
    finally:
        server.terminate()
        server.wait(timeout=30)


def _responds(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.mark.usefixtures("ray_cluster")
def test_pipeline_registers_promotes_and_then_keeps_the_better_champion(
    home: PrefectMLSettings,
) -> None:
    good = PipelineParams.model_validate({"training": {"epochs": 8}})
    state = ml_pipeline(params=good, return_state=True)
    assert state.is_completed(), state
    outcome = state.result()
    flow_run_id = str(state.state_details.flow_run_id)

    assert outcome.evaluation.metrics["accuracy"] >= 0.93
    registration = outcome.registration
    assert (registration.version, registration.promoted) == ("1", True)
    client = tracking.client_for(home.resolved_tracking_uri)
    assert tracking.champion(client, "digits-classifier", "champion") == (
        "1",
        outcome.trained.run_id,
    )

    run = client.get_run(outcome.trained.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.tags[tracking.FLOW_RUN_TAG] == flow_run_id
    assert run.data.params["training.epochs"] == "8"
    assert tracking.logged_epochs(client, run.info.run_id) == list(range(1, 9))
    assert {"test_accuracy", "test_macro_f1", "test_loss"} <= set(run.data.metrics)
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id, "evaluation")}
    assert "evaluation/confusion_matrix.png" in artifacts
    version = client.get_model_version("digits-classifier", "1")
    assert version.tags[tracking.FINGERPRINT_TAG] == outcome.data.fingerprint
    assert version.tags[tracking.FLOW_RUN_TAG] == flow_run_id
    assert version.tags["promotion.decision"] == "promoted"

    published = flow_run_artifacts(flow_run_id)
    assert "Training summary" in published["training-summary"]
    assert outcome.trained.run_id in published["training-summary"]
    assert {"test-metrics", "mlflow-run"} <= set(published)
    version_link = "/#/models/digits-classifier/versions/1"
    assert version_link in published["registered-model"]
    assert version_link in published["training-summary"]
    moments = _timeline(published["timeline"])
    names = [name for name, _at in moments]
    assert names[0] == "flow run started (Prefect API ready)" and names[-1] == "flow run ends"
    steps = [
        "data ready",
        "training run opened (MLflow run, lease); worker group starts",
        "training worker group ready (model built, data opened)",
        "epoch 1 committed (seen by the driver's 1 s poll)",
        "training workers done",
        "trained",
        "evaluated",
        "registered",
    ]
    assert [name for name in names if name in steps] == steps, names
    times = [at for _name, at in moments]
    assert times == sorted(times) and times[0] > 0, "seconds since the process started"

    # The registered model takes raw features (standardisation included) and serves as is.
    mlflow.set_tracking_uri(home.resolved_tracking_uri)
    served = mlflow.pyfunc.load_model("models:/digits-classifier@champion")
    digits = load_digits()
    logits = served.predict(digits.images[:400, None].astype(np.float32))
    assert (np.asarray(logits).argmax(axis=1) == digits.target[:400]).mean() > 0.9
    served_by_cli = _predict_with_mlflow_models_serve(home, digits.images[:50, None])
    assert (served_by_cli.argmax(axis=1) == digits.target[:50]).mean() > 0.9

    # A worse model (one epoch) is registered but does not take the alias. The splits were
    # wiped meanwhile: the cached preprocess result must not point at missing files. This one
    # is called as docs/how-to/own-flows.md calls the flow from Python.
    shutil.rmtree(home.home_dir / "storage" / "datasets")
    second = pipeline_from_python.train_and_register(workers=2, epochs=1)
    assert second.data.fingerprint == outcome.data.fingerprint
    assert (second.registration.version, second.registration.promoted) == ("2", False)
    assert "does not beat champion v1" in second.registration.reason
    assert tracking.champion(client, "digits-classifier", "champion")[0] == "1"
    assert client.get_model_version("digits-classifier", "2").tags["promotion.decision"] == (
        "not promoted"
    )


def _digits_parquet() -> bytes:
    """scikit-learn's digits as a table: 64 named pixel columns and the label."""
    import io

    import pandas as pd

    digits = load_digits()
    frame = pd.DataFrame(digits.data, columns=[f"pixel_{i}" for i in range(64)])
    frame["digit"] = digits.target
    buffer = io.BytesIO()
    frame.to_parquet(buffer)
    return buffer.getvalue()


@pytest.mark.entry_point("S3 storage")
@pytest.mark.usefixtures("ray_cluster")
def test_the_pipeline_with_a_sweep_runs_on_s3_with_mlflow_artifacts_in_s3(
    home: PrefectMLSettings,
    s3_bucket: str,
    moto_s3: MotoS3,
    mlflow_s3_server: str,
    monkeypatch: pytest.MonkeyPatch,
    serve_port: int,
) -> None:
    """Dataset, splits, checkpoints, Ray Train state, Prefect results and MLflow artifacts all on
    S3; the campaign's best values train the final model, which is served from there."""
    dataset_url = storage.join(s3_bucket, "raw", "digits.parquet")
    storage.write_bytes(dataset_url, _digits_parquet())
    storage_url = storage.join(s3_bucket, "prefect-ml")
    monkeypatch.setenv("PREFECT_ML_STORAGE_URL", storage_url)
    params = PipelineParams.model_validate(
        {
            "data": {"dataset": "tabular", "url": dataset_url, "label_column": "digit"},
            "training": {"epochs": 3, "batch_size": 64, "keep_checkpoints": 1},
            "sweep": {
                "campaign": "pipeline-search",
                "n_trials": 3,
                "concurrency": 2,
                "sampler": "random",
                "search_space": {
                    "lr": {"type": "float", "low": 1e-3, "high": 3e-2, "log": True},
                    "hidden": {"type": "int", "low": 32, "high": 128},
                },
            },
            "serving": {"port": serve_port, "replica_cpus": 0.25},
        }
    )

    uri = mlflow_s3_server
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    with serve_applications_deleted_after():
        state = ml_pipeline(params=params, return_state=True)

    assert state.is_completed(), state.message
    outcome = state.result()
    client = tracking.client_for(uri)
    experiment = outcome.trained.experiment_id  # the session's MLflow server has others too
    parent = client.search_runs([experiment], f"tags.`{tracking.CAMPAIGN_PARENT_TAG}` != ''")[0]
    best_trial = parent.data.tags["prefect_ml.best_trials"].split(",")[0]
    best = tracking.trial_runs(client, experiment, parent.info.run_id)[int(best_trial)]
    final = client.get_run(outcome.trained.run_id)
    for name in ("training.lr", "model.hidden"):
        assert final.data.params[name] == best.data.params[name]
    assert final.data.params["training.workers"] == "2", "the final model trains distributed"
    assert outcome.registration.version == "1"
    assert final.info.artifact_uri.startswith("mlflow-artifacts:")
    published = flow_run_artifacts(str(state.state_details.flow_run_id))
    assert "training-summary" in published

    # The pipeline ended by serving @champion (the final model, v1) and smoke-testing it;
    # the replica loaded the model through the MLflow server, from S3.
    assert outcome.serving.version == "1" and outcome.serving.alias == "champion"
    smoke = outcome.serving.smoke
    assert smoke.response["model"]["run_id"] == outcome.trained.run_id
    mlflow.set_tracking_uri(uri)
    local = mlflow.pyfunc.load_model("models:/digits-classifier/1")
    # A tabular model takes float64 rows, as a CSV or a DataFrame holds them.
    rows = np.asarray(smoke.request["inputs"], dtype=np.float64).reshape(-1, 64)
    expected = np.asarray(local.predict(rows)).argmax(axis=1)
    assert smoke.response["predictions"] == [str(d) for d in expected]
    assert "Smoke request" in published["serving"]
    assert tracking.logged_epochs(client, final.info.run_id) == [1, 2, 3]
    _check_lineage(outcome, dataset_url, str(state.state_details.flow_run_id))

    # Every byte lives in the bucket; nothing was written to the local home's storage.
    keys = list(_bucket_keys(moto_s3))
    fingerprint = outcome.data.fingerprint
    run_prefix = f"prefect-ml/checkpoints/{outcome.trained.experiment_id}/{final.info.run_id}/"
    assert any(k.startswith(f"prefect-ml/datasets/{fingerprint}/train_") for k in keys)
    assert any(  # campaigns/<Optuna storage hash>/<campaign>/
        k.startswith("prefect-ml/campaigns/") and "/pipeline-search/trial-" in k for k in keys
    )
    assert any(k == f"prefect-ml/datasets/{fingerprint}/meta.json" for k in keys)
    assert not any(k.startswith("prefect-ml/prefect-results/") for k in keys), "no pickles"
    assert any(k.startswith("prefect-ml/ray_results/") for k in keys), "Ray Train's run state"
    assert any(k.startswith("mlartifacts/") and k.endswith("/MLmodel") for k in keys)
    assert any(k.startswith("mlartifacts/") and "confusion_matrix.png" in k for k in keys)
    assert not (home.home_dir / "storage").exists()
    # Retention kept one checkpoint's weights (the last); every epoch kept its metrics.
    data_file = "/__0_0.distcp"  # the DCP data file of a checkpoint
    state_files = sorted(k for k in keys if k.startswith(run_prefix) and k.endswith(data_file))
    assert state_files == [f"{run_prefix}epoch-000003/__0_0.distcp"]


def _check_lineage(outcome: Any, dataset_url: str, flow_run_id: str) -> None:
    """`prefect-ml lineage` walks from the champion back to the dataset on S3 and forward to
    where it is served, each link from what the pipeline recorded."""
    result = CliRunner().invoke(app, ["lineage", "digits-classifier@champion", "--json"])
    assert result.exit_code == 0, result.output
    chain = json.loads(result.output[result.output.index("{") :])
    assert chain["version"] == "1"
    steps = {(step["stage"], step["what"].split(" ")[0]): step for step in chain["steps"]}
    stages = [step["stage"] for step in chain["steps"]]
    order = ["data", "preprocess", "flow run", "training run", "checkpoint", "model version"]
    assert [s for s in stages if s in order] == order[:2] + ["flow run"] * 2 + order[3:]
    assert stages[-1] == "serving"
    data = steps[("data", "digits.parquet")]
    assert data["link"] == dataset_url and outcome.data.fingerprint[:36] in data["what"]
    assert steps[("preprocess", "splits")]["link"] == outcome.data.splits_url
    assert {s["what"].split(" ")[0] for s in chain["steps"] if s["stage"] == "flow run"} == {
        flow_run_id
    }  # the pipeline's one flow run trained the run and registered it
    run_step = next(s for s in chain["steps"] if s["stage"] == "training run")
    assert outcome.trained.run_id in run_step["what"] and run_step["link"]
    checkpoint = next(s for s in chain["steps"] if s["stage"] == "checkpoint")
    assert checkpoint["link"].startswith(outcome.trained.checkpoint_url)
    version = next(s for s in chain["steps"] if s["stage"] == "model version")
    assert "@champion" in version["what"] and version["link"].endswith("/versions/1")
    serving = chain["steps"][-1]
    assert serving["link"] == outcome.serving.url and "since" in serving["what"]


def _bucket_keys(moto_s3: MotoS3) -> Iterator[str]:
    pages = moto_s3.client().get_paginator("list_objects_v2")  # type: ignore[attr-defined]
    for page in pages.paginate(Bucket=TEST_BUCKET):
        yield from (item["Key"] for item in page.get("Contents", []))
