"""When Prefect tries a failed step again: after a transient error, with exponential backoff.

Only the steps whose retry resumes where the failed attempt stopped carry this policy: data
inspection and preprocessing (cached by fingerprint), training (the same run identity reopens
its MLflow run and continues from the last verified checkpoint) and campaigns (resumed by name).
Errors that no retry fixes (bad parameters, refused credentials, a campaign in which no trial
completed) fail at once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from prefect.tasks import exponential_backoff
from pydantic import ValidationError

from prefect_ml.integrations.errors import (
    CampaignFailedError,
    ConfigurationError,
    EnvironmentCheckError,
    TrainingCodeError,
)
from prefect_ml.integrations.settings import get_settings
from prefect_ml.integrations.storage import LeaseLostError

if TYPE_CHECKING:
    from prefect import Task
    from prefect.client.schemas.objects import TaskRun
    from prefect.states import State

# Errors that a second attempt meets again. EnvironmentCheckError covers refused or missing
# credentials and a missing bucket; a lease held by another driver is a ConfigurationError.
PERMANENT_ERRORS: tuple[type[BaseException], ...] = (
    ConfigurationError,
    EnvironmentCheckError,
    CampaignFailedError,
    TrainingCodeError,  # a worker's code raises the same error on every attempt
    LeaseLostError,  # another driver carries the run on; this one must not write again
    ValidationError,
)
# Spreads the retries of many runs that failed together (an S3 or MLflow outage) over time.
RETRY_JITTER_FACTOR = 0.5


def is_permanent(error: BaseException) -> bool:
    """Whether ``error``, or any error it was raised from, is one no retry fixes."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        if isinstance(current, PERMANENT_ERRORS):
            return True
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return False


def is_transient(_task: Task[Any, Any], _task_run: TaskRun, state: State[Any]) -> bool:
    """Prefect's ``retry_condition_fn``: retry unless the failure is permanent."""
    error = state.result(raise_on_failure=False)
    return not (isinstance(error, BaseException) and is_permanent(error))


def transient_retries() -> dict[str, Any]:
    """``@task`` options retrying transient failures ``PREFECT_ML_TASK_RETRIES`` times, the
    first after ``PREFECT_ML_TASK_RETRY_DELAY_S`` seconds, each next one twice as late."""
    settings = get_settings()
    return {
        "retries": settings.task_retries,
        "retry_delay_seconds": exponential_backoff(settings.task_retry_delay_s),
        "retry_jitter_factor": RETRY_JITTER_FACTOR,
        "retry_condition_fn": is_transient,
    }
