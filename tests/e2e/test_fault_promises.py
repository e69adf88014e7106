"""The fault-tolerance promises (docs/how-to/resuming.md) on the real systems: a training past
``--max-failures`` is marked FAILED with an error that says to run it again, and a retry of the
step resumes it; the next run aborts a killed writer's incomplete uploads; a hung peer fails
the group after ``--collective-timeout-s`` and the group restarts from its checkpoint. (A killed
run's Ray slot freeing itself is tested on `prefect-ml ui`'s server, in test_prefect_ui.py.)"""

from __future__ import annotations

import math
import signal
import threading
from pathlib import Path

import psutil
import pytest
from prefect import flow

from prefect_ml.integrations import storage, tracking, training
from prefect_ml.integrations.errors import PrefectMLError
from prefect_ml.integrations.settings import PrefectMLSettings, get_settings
from prefect_ml.tasks.data import PreparedData, inspect_dataset, preprocess_dataset
from prefect_ml.tasks.params import TrainModelParams, section_options
from prefect_ml.tasks.train import TrainResult, train, train_distributed
from tests.fixtures.faulty_code import BUDGET_FILE
from tests.helpers import committed_epochs, ray_train_workers, wait_for
from tests.s3 import TEST_BUCKET, MotoS3

pytestmark = pytest.mark.e2e


@flow
def prepare(params: TrainModelParams) -> PreparedData:
    summary = inspect_dataset(params)
    return preprocess_dataset(params.data, summary.fingerprint, get_settings().resolved_storage_url)


@flow
def train_once(params: TrainModelParams, data: PreparedData) -> TrainResult:
    """The training step's body, without Prefect's retries."""
    return train_distributed(params, data)


@flow
def train_with_a_retry(params: TrainModelParams, data: PreparedData) -> tuple[TrainResult, int]:
    """The training task with one immediate retry; its result and how many attempts ran."""
    from prefect.client.orchestration import get_client

    retried = train.with_options(retries=1, retry_delay_seconds=0)
    options = section_options(params.model, params.training)
    state = retried(data, experiment=params.experiment, **options, return_state=True)
    task_run_id = state.state_details.task_run_id
    assert task_run_id is not None
    with get_client(sync_client=True) as client:
        attempts = client.read_task_run(task_run_id).run_count
    return state.result(), attempts


def _incomplete_uploads(moto_s3: MotoS3) -> dict[str, str]:
    listed = moto_s3.client().list_multipart_uploads(Bucket=TEST_BUCKET)  # type: ignore[attr-defined]
    return {u["UploadId"]: u["Key"] for u in listed.get("Uploads", [])}


def _leave_incomplete_upload(moto_s3: MotoS3, folder_url: str) -> str:
    """What a writer killed mid-upload leaves: a started multipart upload with a part, never
    completed. Returns its upload id."""
    s3 = moto_s3.client()
    key = folder_url.removeprefix(f"s3://{TEST_BUCKET}/") + "/epoch-000099/__0_0.distcp"
    upload = s3.create_multipart_upload(Bucket=TEST_BUCKET, Key=key)  # type: ignore[attr-defined]
    s3.upload_part(  # type: ignore[attr-defined]
        Bucket=TEST_BUCKET, Key=key, UploadId=upload["UploadId"], PartNumber=1, Body=b"x" * 1024
    )
    return str(upload["UploadId"])


@pytest.mark.usefixtures("ray_cluster")
def test_past_max_failures_the_run_is_failed_and_a_retry_resumes_it_aborting_dead_uploads(
    home: PrefectMLSettings,
    s3_bucket: str,
    moto_s3: MotoS3,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    """A user model kills its worker process mid-epoch. With ``--max-failures 1`` the second
    crash ends the run: the MLflow run is FAILED and the error says to run the same command
    again. A killed writer's multipart upload is left in the run's checkpoint folder. The
    training task then fails once more (``--max-failures 0``, which does not change the run's
    identity) and Prefect's retry resumes the same run from its checkpoint to the end; that run
    aborted the incomplete upload first."""
    monkeypatch.setenv("PREFECT_ML_STORAGE_URL", f"{s3_bucket}/faults")
    crash_dir = tmp_path / "crashes"
    crash_dir.mkdir()
    epochs, batch_size = 8, 64
    training = {"epochs": epochs, "batch_size": batch_size, "workers": 1, "max_failures": 1}
    data = prepare(TrainModelParams.model_validate({"training": training}))
    # Each worker process dies in the middle of its third epoch: by then the first epoch's
    # checkpoint is committed (an epoch's commit is awaited before the next one starts), so
    # every attempt moves the run on by at least one epoch.
    batches = math.ceil(data.rows["train"] / batch_size)
    options = {"crash_dir": str(crash_dir), "after_batches": 2 * batches + batches // 2}
    model = {"model": "tests.fixtures.faulty_code:crashing_model", "model_options": options}
    params = TrainModelParams.model_validate({"model": model, "training": training})

    (crash_dir / BUDGET_FILE).write_text("2")  # the first attempt and its one restart crash
    state = train_once(params, data, return_state=True)
    error = state.result(raise_on_failure=False)
    assert isinstance(error, PrefectMLError), error
    assert "Run the same command again to resume from its last verified checkpoint" in str(error)
    assert len(list(crash_dir.glob("crash-*"))) == 2
    client = tracking.client_for(home.resolved_tracking_uri)
    experiment = client.get_experiment_by_name(params.experiment)
    assert experiment is not None
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FAILED"
    checkpoints = storage.join(
        f"{s3_bucket}/faults", "checkpoints", experiment.experiment_id, run.info.run_id
    )
    dead_upload = _leave_incomplete_upload(moto_s3, checkpoints)
    assert dead_upload in _incomplete_uploads(moto_s3)

    (crash_dir / BUDGET_FILE).write_text("3")  # one more crash: the task's first attempt
    rerun = params.model_copy(
        update={"training": params.training.model_copy(update={"max_failures": 0})}
    )
    result, attempts = train_with_a_retry(rerun, data)

    assert attempts == 2, "the task failed once and its retry finished the training"
    assert len(list(crash_dir.glob("crash-*"))) == 3
    assert result.run_id == run.info.run_id, "the retry continued the same MLflow run"
    assert result.final_epoch == epochs
    assert 2 <= result.resumed_from_epoch < epochs, "it resumed from a checkpoint"
    assert tracking.logged_epochs(client, result.run_id) == list(range(1, epochs + 1))
    assert dead_upload not in _incomplete_uploads(moto_s3), "the killed writer's upload aborted"


@pytest.mark.usefixtures("ray_cluster")
def test_a_hung_peer_fails_the_group_after_the_collective_timeout_and_it_restarts(
    home: PrefectMLSettings,
) -> None:
    """One of two workers is stopped (SIGSTOP) after epoch 1: the other waits in a collective
    for ``--collective-timeout-s`` (10 s), the group fails, and the new group resumes from the
    last checkpoint and finishes; every epoch is logged once."""
    epochs = 5
    params = TrainModelParams.model_validate(
        {
            "model": {
                "model": "tests.fixtures.user_code:slow_model",
                "model_options": {"delay": 0.05},
            },
            "training": {
                "epochs": epochs,
                "workers": 2,
                "max_failures": 1,
                "collective_timeout_s": 10,
            },
        }
    )
    data = prepare(params)
    outcome: dict[str, TrainResult | BaseException] = {}

    def run() -> None:
        try:
            outcome["result"] = train_once(params, data)
        except BaseException as exc:  # surfaced by the assertion below
            outcome["result"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    storage_dir = home.home_dir / "storage"
    stopped: psutil.Process | None = None
    try:
        wait_for(lambda: 1 in committed_epochs(storage_dir), 300, "the epoch-1 checkpoint")
        workers = ray_train_workers()
        assert len(workers) == 2
        stopped = workers[-1]
        stopped.send_signal(signal.SIGSTOP)
        thread.join(timeout=600)
    finally:
        if stopped is not None and stopped.is_running():
            stopped.send_signal(signal.SIGCONT)
            stopped.kill()
    assert not thread.is_alive(), "the training hung"

    result = outcome["result"]
    assert isinstance(result, TrainResult), result
    assert result.final_epoch == epochs
    client = tracking.client_for(home.resolved_tracking_uri)
    assert tracking.logged_epochs(client, result.run_id) == list(range(1, epochs + 1))
    tags = client.get_run(result.run_id).data.tags
    assert 2 <= int(tags[training.STARTED_AT_TAG]) <= epochs, "restarted from a checkpoint"
    assert committed_epochs(storage_dir) == list(range(1, epochs + 1))
