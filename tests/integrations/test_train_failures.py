"""Which Ray Train failures end a run at once, and what the run's end says (no Ray started:
the decisions on the exceptions Ray Train hands its controller)."""

from __future__ import annotations

import re
import traceback
from pathlib import Path

import pytest
from ray.exceptions import ActorDiedError
from ray.train.v2._internal.exceptions import (
    WorkerGroupStartupFailedError,
    WorkerGroupStartupTimeoutError,
)
from ray.train.v2._internal.execution.controller.state import (
    ReschedulingState,
    RestartingState,
    RunningState,
    SchedulingState,
)
from ray.train.v2.api.exceptions import ControllerError, WorkerGroupError

from prefect_ml.integrations.compute import describe_placement
from prefect_ml.integrations.errors import ModelStepError, TrainingCodeError
from prefect_ml.integrations.training import (
    FailFast,
    WorkerFailure,
    code_failure_message,
    deterministic,
    innermost_frame,
)
from tests.helpers import blob_trainer


def test_a_python_error_of_the_workers_code_is_deterministic_a_death_or_io_error_is_not() -> None:
    assert deterministic({0: ModuleNotFoundError("No module named 'x'"), 1: ValueError()}) == [0, 1]
    assert deterministic({1: TypeError("bad"), 0: RuntimeError("gloo: peer closed")}) == [1]
    # A storage, network or collective error may heal on a restart.
    assert deterministic({0: OSError("S3 503"), 1: RuntimeError("NCCL timeout")}) == []
    # A dead worker makes its peers fail with errors of any kind: the restart heals them all.
    died = ActorDiedError()
    assert deterministic({0: died, 1: ValueError("collateral")}) == []


def _raise_in_user_code() -> None:
    import importlib

    importlib.import_module("a_package_nobody_has")


def test_the_frame_named_is_the_users_not_pythons_import_machinery() -> None:
    with pytest.raises(ModuleNotFoundError) as raised:
        _raise_in_user_code()
    text = "".join(traceback.format_exception(raised.value))
    where = innermost_frame(text)
    assert where.startswith("_raise_in_user_code ("), where
    assert __file__ in where
    assert innermost_frame("no traceback here") == ""


def test_the_message_names_node_worker_error_code_and_fix_each_error_once() -> None:
    missing = ModuleNotFoundError("No module named 'torchvision'", name="torchvision")
    failures = [
        WorkerFailure(0, "10.0.0.1", missing, "build (/src/models.py:3)"),
        WorkerFailure(1, "10.0.0.2", ModuleNotFoundError("No module named 'torchvision'")),
        WorkerFailure(2, "10.0.0.2", ValueError("width -1")),
    ]
    message = code_failure_message(failures, "the model acme.models:build", "not retried")
    assert (
        "worker rank 0 on node 10.0.0.1: ModuleNotFoundError: No module named 'torchvision' "
        "in build (/src/models.py:3) (and 1 other worker(s) the same way)"
    ) in message
    assert "worker rank 2 on node 10.0.0.2: ValueError: width -1" in message
    assert "torchvision cannot be imported on that node" in message
    for fix in ("pip install", "PREFECT_ML_SHIP_CODE=always", "PREFECT_ML_ALLOWED_MODULES"):
        assert fix in message
    other = code_failure_message(failures[2:], "the model acme.models:build", "not retried")
    assert "fix the model acme.models:build so that it runs on the workers" in other


def _fail_fast(limit: int = 1) -> FailFast:
    return FailFast(code="the model m", request="1 CPU", start_failure_limit=limit, max_failures=3)


def test_a_deterministic_worker_error_ends_the_run_instead_of_a_restart() -> None:
    callback = _fail_fast()
    error = WorkerGroupError("rank 0 failed", {0: ValueError("width -1")})
    with pytest.raises(TrainingCodeError, match="worker rank 0 on node an unknown node"):
        callback.after_controller_state_update(RunningState(), RestartingState(error))
    healable = WorkerGroupError("rank 0 died", {0: ActorDiedError()})
    callback.after_controller_state_update(RunningState(), RestartingState(healable))


@pytest.mark.usefixtures("ray_cluster")
def test_failed_starts_in_a_row_past_the_limit_end_the_run_and_a_started_group_resets_them() -> (
    None
):
    import ray

    callback = _fail_fast(limit=1)
    callback.on_controller_start_worker_group(scaling_config=None, num_workers=3)
    timeout = ControllerError(WorkerGroupStartupTimeoutError(3))
    scheduling = SchedulingState(None)  # type: ignore[arg-type]
    callback.after_controller_state_update(scheduling, ReschedulingState(timeout))  # one retry
    callback.after_controller_state_update(scheduling, RunningState())  # it started: reset
    callback.after_controller_state_update(scheduling, ReschedulingState(timeout))
    with pytest.raises(TrainingCodeError) as ended:
        callback.after_controller_state_update(scheduling, ReschedulingState(timeout))
    message = str(ended.value)
    assert "failed to start 2 time(s) in a row: Ray could not place it" in message
    (node,) = (node["NodeManagerAddress"] for node in ray.nodes() if node["Alive"])
    # The session's Ray: one node of 2 CPUs, some of them maybe taken by a test before.
    assert re.search(
        rf"3 worker\(s\) x \(1 CPU\) asked; free now: node {node}: [\d.]+ of 2 CPU", message
    )
    assert "PREFECT_ML_CONTROLLER_FAILURE_LIMIT" in message

    died = ControllerError(WorkerGroupStartupFailedError("a worker died while initializing"))
    callback = _fail_fast(limit=0)
    with pytest.raises(TrainingCodeError, match="a worker died while starting"):
        callback.after_controller_state_update(scheduling, ReschedulingState(died))


def test_placement_is_described_per_node() -> None:
    assert (
        describe_placement("2 CPU", 3, {}) == "3 worker(s) x (2 CPU) asked; free now: no node alive"
    )


def test_a_model_whose_first_step_fails_on_its_shapes_is_a_deterministic_error(
    tmp_path: Path,
) -> None:
    """torch raises a shape mismatch as a RuntimeError, which may also be a collective's (a
    peer lost): in the forward of a worker's first step it is the model's, and ends the run."""
    trainer = blob_trainer(
        tmp_path.as_uri(), model="tests.fixtures.worker_faults:model_of_the_wrong_width"
    )
    with pytest.raises(ModelStepError) as failed:
        trainer.run_epoch(1)
    message = str(failed.value)
    model = "the model tests.fixtures.worker_faults:model_of_the_wrong_width"
    assert f"{model} failed its first training step on this worker" in message
    assert "the data's sample shape [4]" in message and "mat1 and mat2" in message
    assert deterministic({0: failed.value}) == [0]
    assert deterministic({0: RuntimeError("mat1 and mat2 shapes cannot be multiplied")}) == []
