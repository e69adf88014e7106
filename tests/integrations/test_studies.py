"""Optuna studies: storage kinds, recovery of interrupted trials."""

from __future__ import annotations

import contextlib
import sqlite3
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from prefect_ml.integrations.campaign import (
    INTERRUPTED_ATTR,
    _studies,
    counts_toward_budget,
    distributions,
    grid_size,
    make_pruner,
    make_sampler,
    open_study,
    recover_interrupted,
    root_trial,
)
from prefect_ml.integrations.errors import ConfigurationError

SPACE = {
    "lr": {"type": "float", "low": 1e-4, "high": 1e-1, "log": True, "step": None},
    "hidden": {"type": "int", "low": 8, "high": 64, "log": False, "step": 8},
    "optimizer": {"type": "categorical", "choices": ["adam", "sgd"]},
}
OBJECTIVES = {"val_accuracy": "maximize"}


def _open(url: str, name: str = "c", objectives: dict[str, str] = OBJECTIVES) -> optuna.Study:
    return open_study(url, name, objectives, make_sampler("random", 0), make_pruner("none", 3))


def test_distributions_follow_the_declared_space() -> None:
    made = distributions(SPACE)
    assert made["lr"].log and made["lr"].low == 1e-4
    assert made["hidden"].step == 8 and made["hidden"].high == 64
    assert made["optimizer"].choices == ("adam", "sgd")


@pytest.mark.parametrize("kind", ["sqlite", "journal"])
def test_a_study_persists_in_sqlite_or_a_journal_file(tmp_path: Path, kind: str) -> None:
    url = f"sqlite:///{tmp_path}/o.db" if kind == "sqlite" else str(tmp_path / "o.journal")
    study = _open(url)
    trial = study.ask(distributions(SPACE))
    study.tell(trial, 0.5)
    again = _open(url)
    assert [t.value for t in again.trials] == [0.5]


def test_a_sqlite_study_writes_ahead_and_optuna_reads_it(tmp_path: Path) -> None:
    """Its file is in write-ahead-log mode (one fsync per commit, readers never block the
    campaign), which any SQLite client and ``optuna.load_study`` read."""
    url = f"sqlite:///{tmp_path}/studies/o.db"
    study = _open(url)
    trial = study.ask(distributions(SPACE))
    study.tell(trial, 0.5)
    with contextlib.closing(sqlite3.connect(tmp_path / "studies" / "o.db")) as connection:
        assert connection.execute("PRAGMA journal_mode").fetchone() == ("wal",)
    assert [t.value for t in optuna.load_study(study_name="c", storage=url).trials] == [0.5]


def test_changed_objectives_are_refused_naming_the_field(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/o.db"
    _open(url)
    with pytest.raises(ConfigurationError, match="sweep.objectives"):
        _open(url, objectives={"val_loss": "minimize"})


def test_interrupted_trials_fail_and_are_queued_again_with_their_parameters(
    tmp_path: Path,
) -> None:
    study = _open(f"sqlite:///{tmp_path}/o.db")
    space = distributions(SPACE)
    done, left_running = study.ask(space), study.ask(space)
    study.tell(done, 0.9)

    recovered = recover_interrupted(study)

    assert [t.number for t in recovered] == [left_running.number]
    failed = study.trials[left_running.number]
    assert failed.state == TrialState.FAIL and failed.user_attrs[INTERRUPTED_ATTR]
    assert not counts_toward_budget(failed)
    assert counts_toward_budget(study.trials[done.number])
    retry = study.ask(space)  # the queued retry comes first, with the same parameters
    assert retry.params == left_running.params
    assert root_trial(retry) == left_running.number
    study.tell(retry, 0.8)
    assert recover_interrupted(study) == []  # nothing is retried twice


def test_an_unreachable_database_is_named_without_its_password(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from tests.helpers import free_port

    monkeypatch.setattr(_studies, "OPEN_ATTEMPTS", 1)
    url = f"postgresql://ml:s3cret-pw@127.0.0.1:{free_port()}/optuna"
    sampler = optuna.samplers.RandomSampler()
    with pytest.raises(ConfigurationError) as refused:
        open_study(url, "c", {"val_accuracy": "maximize"}, sampler, make_pruner("none", 1))
    assert "s3cret-pw" not in str(refused.value)
    assert "ml:***@127.0.0.1" in refused.value.message


def test_a_grid_campaign_tells_every_point_of_the_grid_with_ask_and_tell(tmp_path: Path) -> None:
    """Optuna's grid sampler stops the study once the grid is exhausted, which raises outside
    ``study.optimize`` (its last ``tell``); the campaign's grid sampler does not stop it."""
    grid = {"optimizer": ["adam", "sgd"]}
    sampler = make_sampler("grid", 0, grid)
    assert type(make_sampler("grid", 1, grid)) is type(sampler)  # one class, made once
    study = open_study(
        str(tmp_path / "o.journal"), "g", OBJECTIVES, sampler, make_pruner("none", 3)
    )
    space = distributions({"optimizer": {"type": "categorical", "choices": ["adam", "sgd"]}})
    for _ in range(grid_size(grid)):
        trial = study.ask(space)
        study.tell(trial, 0.5)
    assert sorted(t.params["optimizer"] for t in study.trials) == ["adam", "sgd"]
