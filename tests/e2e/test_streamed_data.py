"""A directory of Parquet files on S3 (moto's server), streamed end to end: Ray Data prepares the
splits as Parquet shards on S3, two Ray Train workers stream their shards, Ray Data actors score
the whole test split, the model is registered; a campaign's trials then train on the same
streamed splits. Nothing of the data goes through the driver's memory as arrays."""

from __future__ import annotations

from pathlib import Path

import pytest

from prefect_ml.flows.sweep import hpo_campaign
from prefect_ml.flows.train import train_model
from prefect_ml.integrations import storage, tracking
from prefect_ml.integrations.settings import PrefectMLSettings
from prefect_ml.tasks.params import CampaignParams, TrainModelParams
from tests.integrations.test_streaming import write_parquet_files

pytestmark = pytest.mark.e2e


def test_a_dataset_on_s3_is_streamed_through_training_evaluation_and_a_campaign(
    ray_cluster: None,
    home: PrefectMLSettings,
    s3_bucket: str,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    write_parquet_files(tmp_path / "source")
    for file in sorted((tmp_path / "source").iterdir()):
        storage.write_bytes(storage.join(s3_bucket, "data", file.name), file.read_bytes())
    monkeypatch.setenv("PREFECT_ML_STORAGE_URL", storage.join(s3_bucket, "store"))
    monkeypatch.setenv("PREFECT_ML_STREAM_MIN_MB", "0")  # 'auto' streams even these 300 KB
    data = {"dataset": "tabular", "url": storage.join(s3_bucket, "data"), "label_column": "kind"}

    outcome = train_model(
        TrainModelParams(
            data=data,
            model={"hidden": 32, "depth": 1},
            training={"epochs": 3, "workers": 2, "batch_size": 64, "lr": 0.01},
            registry={"model_name": "streamed-blobs"},
        )
    )
    prepared = outcome.data
    assert prepared.layout == "parquet" and prepared.splits_url.startswith(s3_bucket)
    names = storage.list_names(prepared.splits_url)
    assert "parquet" in names and not any(name.endswith("_features.npy") for name in names)
    client = tracking.client_for(home.resolved_tracking_uri)
    run = client.get_run(outcome.trained.run_id)
    assert run.data.tags[tracking.DATA_LAYOUT_TAG] == "parquet"
    assert run.data.tags["prefect_ml.worker_group_size"] == "2"
    assert outcome.evaluation.metrics["accuracy"] > 0.8
    assert outcome.evaluation.confusion_matrix is not None
    scored = sum(map(sum, outcome.evaluation.confusion_matrix))
    assert scored == prepared.rows["test"], "every test row scored once, on the cluster"
    assert outcome.registration.version == "1"

    result = hpo_campaign(
        CampaignParams(
            data=data,
            model={"hidden": 32, "depth": 1},
            training={"epochs": 2, "batch_size": 64},
            sweep={
                "campaign": "streamed",
                "n_trials": 2,
                "concurrency": 1,
                "pruner": "none",
                "search_space": {"lr": {"type": "float", "low": 1e-3, "high": 3e-2, "log": True}},
            },
        )
    )
    assert result.complete == 2
    assert all(trial.values["val_accuracy"] > 0.5 for trial in result.trials)
    parent = client.get_run(result.parent_run_id)
    assert parent.data.tags[tracking.DATA_LAYOUT_TAG] == "parquet"
    assert parent.data.tags[tracking.FINGERPRINT_TAG] == prepared.fingerprint, (
        "the campaign trained on the streamed splits already prepared"
    )
