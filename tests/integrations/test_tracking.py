from __future__ import annotations

from pathlib import Path

import pytest

from integrations import tracking
from integrations.settings import PrefectMLSettings


@pytest.mark.parametrize(
    ("new", "champion", "direction", "delta", "promoted"),
    [
        (0.95, None, "maximize", 0.0, True),
        (0.96, 0.95, "maximize", 0.0, True),
        (0.955, 0.95, "maximize", 0.01, False),
        (0.95, 0.95, "maximize", 0.0, False),
        (0.20, 0.30, "minimize", 0.05, True),
        (0.29, 0.30, "minimize", 0.05, False),
    ],
)
def test_promotion_decision(
    new: float, champion: float | None, direction: str, delta: float, promoted: bool
) -> None:
    decision = tracking.decide_promotion(
        new,
        champion,
        metric="test_accuracy",
        direction=direction,
        min_delta=delta,
        champion_version="3" if champion is not None else None,
    )
    assert decision.promoted is promoted
    assert "test_accuracy" in decision.reason
    if champion is not None:
        assert "v3" in decision.reason and decision.previous_value == champion


def test_unfinished_runs_are_resumed_finished_ones_are_not(home: PrefectMLSettings) -> None:
    client = tracking.client_for(home.resolved_tracking_uri)
    experiment = tracking.ensure_experiment(client, "exp", home.mlflow_artifact_root)
    first, _ = tracking.start_or_resume_run(
        client, experiment, "k", run_name="r", params={}, tags={}
    )
    again, resumed = tracking.start_or_resume_run(
        client, experiment, "k", run_name="r", params={}, tags={"t": "v"}
    )
    assert (again, resumed) == (first, True)
    tracking.finish_run(client, first)
    fresh, resumed = tracking.start_or_resume_run(
        client, experiment, "k", run_name="r", params={}, tags={}
    )
    assert fresh != first and not resumed
    other, resumed = tracking.start_or_resume_run(
        client, experiment, "other-key", run_name="r", params={}, tags={}
    )
    assert other not in (first, fresh) and not resumed


_KILLED_MID_MIGRATION = """
import os, signal, sys
import mlflow.store.db.utils as db_utils
from integrations import tracking

def die(*args, **kwargs):  # the moment the chaos run hit: tables created, migrations not done
    os.kill(os.getpid(), signal.SIGKILL)

db_utils._upgrade_db = die
tracking.client_for(sys.argv[1])
"""


def test_a_process_killed_while_creating_the_database_leaves_none_behind(
    tmp_path: Path,
) -> None:
    """Killed in the middle of MLflow's migrations of a new SQLite database, a process left a
    half-migrated file on which every later run failed; now the file appears only when whole."""
    import subprocess
    import sys

    from tests.conftest import REPO_ROOT

    database = tmp_path / "mlflow.db"
    uri = f"sqlite:///{database}"
    killed = subprocess.run(
        [sys.executable, "-c", _KILLED_MID_MIGRATION, uri], cwd=REPO_ROOT, check=False
    )
    assert killed.returncode == -9
    assert not database.exists()

    client = tracking.client_for(uri)
    experiment = tracking.ensure_experiment(client, "after-a-kill", None)
    run_id, _ = tracking.start_or_resume_run(
        client, experiment, "key", run_name="r", params={"a": 1}, tags={}
    )
    tracking.log_epoch(client, run_id, 1, {"val_loss": 0.5}, "file:///checkpoint")
    assert tracking.logged_epochs(client, run_id) == [1]
    assert [p.name for p in tmp_path.iterdir() if ".creating-" in p.name] == []
