"""The Ray quota: training and campaign tasks share one tag concurrency limit on the server."""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime
from uuid import UUID

import pytest
from prefect import flow
from prefect.client.orchestration import get_client
from prefect.concurrency.sync import concurrency

from prefect_ml.integrations.services import RAY_TAG, ray_quota, set_ray_quota
from prefect_ml.integrations.settings import PrefectMLSettings
from prefect_ml.tasks.data import PreparedData
from prefect_ml.tasks.sweep import campaign
from prefect_ml.tasks.train import train


def test_ray_heavy_tasks_carry_the_quota_tag() -> None:
    assert RAY_TAG in train.tags
    assert RAY_TAG in campaign.tags


def _remove_ray_quota() -> None:
    with get_client(sync_client=True) as client:
        client.delete_concurrency_limit_by_tag(RAY_TAG)


def test_training_waits_until_the_other_run_frees_the_ray_slot(
    home: PrefectMLSettings, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    """Another flow run holds the only slot; this run's training starts only once it is free."""
    set_ray_quota(1)
    assert ray_quota() == 1
    # The limit is the session server's: later tests train and run campaigns side by side.
    request.addfinalizer(_remove_ray_quota)
    # An MLflow URI with no store behind it makes the training body fail at its first line, so
    # the test measures when the body started without training anything.
    monkeypatch.setenv("PREFECT_ML_MLFLOW_TRACKING_URI", "nostore://nowhere")
    holding, released_at = threading.Event(), []

    def other_run() -> None:
        with concurrency(f"tag:{RAY_TAG}", occupy=1):
            holding.set()
            time.sleep(4)
            released_at.append(datetime.now(UTC))

    holder = threading.Thread(target=other_run)
    holder.start()
    assert holding.wait(30)
    data = PreparedData(
        fingerprint="f" * 16,
        splits_url=(home.home_dir / "nowhere").as_uri(),
        rows={"train": 100},
        sample_shape=[4],
        num_classes=2,
        class_names=["a", "b"],
        feature_names=None,
    )

    @flow
    def second_run() -> tuple[UUID | None, bool, str]:
        state = train(data, return_state=True)
        error = str(state.result(raise_on_failure=False))
        return state.state_details.task_run_id, state.is_failed(), error

    task_run_id, failed, error = second_run()
    holder.join()
    assert failed and "nostore" in error
    assert task_run_id is not None
    with get_client(sync_client=True) as client:
        task_run = client.read_task_run(task_run_id)
    assert task_run.start_time is not None
    assert task_run.start_time >= released_at[0]
