"""Retries of failed steps on a real Prefect API: a transient failure is tried again and the
retry carries on; a permanent one (bad parameters, refused credentials, a campaign in which no
trial completed) fails at its first attempt."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from uuid import UUID

import pytest
from prefect import flow, task
from prefect.client.orchestration import get_client

from prefect_ml.integrations.errors import (
    CampaignFailedError,
    ConfigurationError,
    EnvironmentCheckError,
    PrefectMLError,
)
from prefect_ml.integrations.settings import get_settings
from prefect_ml.integrations.storage import LeaseLostError
from prefect_ml.tasks.data import inspect_data, preprocess
from prefect_ml.tasks.retries import is_transient, transient_retries
from prefect_ml.tasks.sweep import campaign
from prefect_ml.tasks.train import train


def test_the_resumable_steps_carry_the_retry_policy_of_the_settings() -> None:
    settings = get_settings()
    for step in (inspect_data, preprocess, train, campaign):
        assert step.retries == settings.task_retries, step.name
        assert step.retry_condition_fn is is_transient, step.name
        assert step.retry_jitter_factor


def _run_failing(errors: list[BaseException]) -> tuple[int, UUID | None, Any]:
    """Run a step with the policy of the settings that raises ``errors`` one per attempt, then
    succeeds; returns how many attempts ran, the task run and its result (or error)."""
    attempts: list[int] = []

    @task(**transient_retries())
    def step() -> str:
        attempts.append(1)
        if len(attempts) <= len(errors):
            raise errors[len(attempts) - 1]
        return "resumed"

    @flow
    def run() -> tuple[UUID | None, Any]:
        state = step(return_state=True)
        return state.state_details.task_run_id, state.result(raise_on_failure=False)

    task_run_id, result = run(return_state=True).result(raise_on_failure=False)
    return len(attempts), task_run_id, result


@pytest.fixture
def quick_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PREFECT_ML_TASK_RETRIES", "2")
    monkeypatch.setenv("PREFECT_ML_TASK_RETRY_DELAY_S", "0.1")


@pytest.mark.usefixtures("quick_retries")
def test_a_transient_failure_is_retried_and_the_retry_finishes_the_step() -> None:
    attempts, task_run_id, result = _run_failing([OSError("connection reset by peer")])

    assert (attempts, result) == (2, "resumed")
    assert task_run_id is not None
    with get_client(sync_client=True) as client:
        task_run = client.read_task_run(task_run_id)
        states = [s.name for s in client.read_task_run_states(task_run_id)]
    assert task_run.run_count == 2 and task_run.state_name == "Completed"
    assert "AwaitingRetry" in states, states


@pytest.mark.usefixtures("quick_retries")
def test_retries_stop_at_the_configured_number() -> None:
    attempts, _task_run_id, result = _run_failing([OSError("503")] * 5)

    assert attempts == 3  # the first attempt and PREFECT_ML_TASK_RETRIES=2 retries
    assert isinstance(result, OSError)


@pytest.mark.usefixtures("quick_retries")
@pytest.mark.parametrize(
    "error",
    [
        pytest.param(ConfigurationError("training.epochs", "must be positive"), id="parameter"),
        pytest.param(EnvironmentCheckError("S3 refused the credentials"), id="credentials"),
        pytest.param(CampaignFailedError("campaign x: no trial completed"), id="no-trial"),
        pytest.param(LeaseLostError("training run r: another process took over"), id="lease-lost"),
    ],
)
def test_a_permanent_error_is_not_retried(error: PrefectMLError) -> None:
    attempts, task_run_id, result = _run_failing([error])

    assert attempts == 1
    assert type(result) is type(error)
    assert task_run_id is not None
    with get_client(sync_client=True) as client:
        assert client.read_task_run(task_run_id).state_name == "Failed"


def _wrapped(make: Callable[[], BaseException]) -> BaseException:
    """An error the way a step reports it: a PrefectMLError raised from the original."""
    try:
        try:
            raise make()
        except Exception as exc:
            raise PrefectMLError("training run r failed; run the same command again") from exc
    except PrefectMLError as outer:
        return outer


@pytest.mark.usefixtures("quick_retries")
def test_a_permanent_error_wrapped_by_the_step_is_still_not_retried() -> None:
    error = _wrapped(lambda: ConfigurationError("model.model_options", "unknown option"))
    attempts, _task_run_id, _result = _run_failing([error])
    assert attempts == 1

    transient = _wrapped(lambda: ConnectionResetError("reset"))
    attempts, _task_run_id, result = _run_failing([transient])
    assert (attempts, result) == (2, "resumed")


def test_retries_can_be_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PREFECT_ML_TASK_RETRIES", "0")
    attempts, _task_run_id, result = _run_failing([OSError("reset")])
    assert attempts == 1 and isinstance(result, OSError)
