from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch

from prefect_ml.integrations import tracking
from prefect_ml.integrations.errors import ConfigurationError
from prefect_ml.integrations.settings import PrefectMLSettings

if TYPE_CHECKING:
    from mlflow import MlflowClient


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
from prefect_ml.integrations import tracking

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


@pytest.mark.parametrize("name", ["../../../../elsewhere/x", "/abs", "a/%2e%2e/%2e%2e/b", "."])
def test_an_experiment_name_cannot_move_its_artifacts_out_of_the_root(
    home: PrefectMLSettings, name: str
) -> None:
    client = tracking.client_for(home.resolved_tracking_uri)
    with pytest.raises(ConfigurationError) as error:
        tracking.ensure_experiment(client, name, home.mlflow_artifact_root)
    assert error.value.field == "experiment"
    assert client.get_experiment_by_name(name) is None


class _Trap(torch.nn.Module):
    """A model whose pickle creates a file when it is loaded."""

    def __init__(self, canary: str) -> None:
        super().__init__()
        self.canary = canary

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (exec, (f"open({self.canary!r}, 'w').close()",))


def _register(client: MlflowClient, home: PrefectMLSettings, log: Any) -> str:
    """Log a model with ``log`` in a new run, register it; the local copy of the version."""
    import mlflow

    experiment = tracking.ensure_experiment(client, "models", home.mlflow_artifact_root)
    run = client.create_run(experiment)
    mlflow.set_tracking_uri(home.resolved_tracking_uri)
    mlflow.set_registry_uri(home.resolved_tracking_uri)
    with mlflow.start_run(run_id=run.info.run_id):
        info = log()
    client.create_registered_model("m")
    version = client.create_model_version(
        "m", info.model_uri, run_id=run.info.run_id, model_id=info.model_id
    )
    return str(mlflow.artifacts.download_artifacts(f"models:/m/{version.version}"))


def test_a_pickle_format_version_is_refused_without_being_loaded(
    home: PrefectMLSettings, tmp_path: Path
) -> None:
    import mlflow.pytorch

    canary = tmp_path / "canary"
    client = tracking.client_for(home.resolved_tracking_uri)
    local = _register(
        client,
        home,
        lambda: mlflow.pytorch.log_model(
            _Trap(str(canary)), name="model", serialization_format="pickle"
        ),
    )
    with pytest.raises(ConfigurationError, match="with pickle, which runs code") as error:
        tracking.load_pt2_model(local, what="m v1")
    assert "m v1" in error.value.message and "serialization_format='pt2'" in error.value.message
    assert not canary.exists()


def test_a_version_no_replica_would_load_is_refused_from_its_mlmodel_and_file_names(
    home: PrefectMLSettings, tmp_path: Path
) -> None:
    """What serving checks before it deploys (tasks/serve.py resolve_served_model): the same
    refusals as the loader, read from the registry's copy without loading or downloading the
    weights; a version with no MLmodel file is refused too."""
    import mlflow.pytorch
    import numpy as np

    canary = tmp_path / "canary"
    client = tracking.client_for(home.resolved_tracking_uri)
    _register(
        client,
        home,
        lambda: mlflow.pytorch.log_model(
            _Trap(str(canary)), name="model", serialization_format="pickle"
        ),
    )
    pickled = client.get_model_version("m", "1")
    with pytest.raises(ConfigurationError, match="with pickle, which runs code") as error:
        tracking.check_loadable(client, pickled)
    assert error.value.field == "model_version" and "models:/m/1" in error.value.message
    assert not canary.exists()

    pt2 = torch.nn.Sequential(torch.nn.Linear(4, 3)).eval()
    example = np.ones((5, 4), dtype=np.float32)
    experiment = tracking.ensure_experiment(client, "e", home.mlflow_artifact_root)
    run_id = client.create_run(experiment).info.run_id
    tracking.log_and_register_model(
        client, home.resolved_tracking_uri, run_id, pt2, example, model_name="pt2", tags={}
    )
    version = client.get_model_version("pt2", "1")
    tracking.check_loadable(client, version)  # a pt2 version passes
    location = client.get_model_version_download_uri("pt2", "1").removeprefix("file://")
    (Path(location) / "MLmodel").unlink()
    with pytest.raises(ConfigurationError, match="models:/pt2/1 has no MLmodel file at"):
        tracking.check_loadable(client, version)


def test_registered_versions_are_pt2_and_load_without_pickle(home: PrefectMLSettings) -> None:
    import numpy as np

    client = tracking.client_for(home.resolved_tracking_uri)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3)).eval()
    example = np.ones((5, 4), dtype=np.float32)
    tracking.log_and_register_model(
        client,
        home.resolved_tracking_uri,
        client.create_run(
            tracking.ensure_experiment(client, "e", home.mlflow_artifact_root)
        ).info.run_id,
        model,
        example,
        model_name="pt2-model",
        tags={},
    )
    import mlflow

    local = mlflow.artifacts.download_artifacts("models:/pt2-model/1")
    assert (Path(local) / "data" / "model.pt2").is_file()
    loaded = tracking.load_pt2_model(local, what="pt2-model v1")
    with torch.no_grad():
        assert torch.allclose(loaded(torch.from_numpy(example)), model(torch.from_numpy(example)))


def test_a_worker_takes_the_masked_password_from_its_own_node_s_setting(
    home: PrefectMLSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 36, finding 9: what travels to Ray is masked (:func:`tracking.shipped_uri`); a
    worker uses its node's URI when it is the same one, and says what to set when it is not."""
    uri = "postgresql://mlflow:PASSWORD@db.internal/mlflow"
    shipped = tracking.shipped_uri(uri)
    assert shipped == "postgresql://mlflow:***@db.internal/mlflow"
    sqlite = home.resolved_tracking_uri
    assert tracking.shipped_uri(sqlite) == sqlite == tracking.worker_uri(sqlite)
    with pytest.raises(ConfigurationError, match="set the same PREFECT_ML_MLFLOW_TRACKING_URI"):
        tracking.worker_uri(shipped)  # this node's setting is the home's SQLite database
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "postgresql://mlflow:OTHER@elsewhere/mlflow")
    with pytest.raises(ConfigurationError) as refused:
        tracking.worker_uri(shipped)  # another database
    assert "OTHER" not in str(refused.value) and "mlflow:***@elsewhere" in str(refused.value)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    assert tracking.worker_uri(shipped) == uri
