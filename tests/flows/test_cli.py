"""The ``prefect-ml`` command line: flags mirror parameters, errors name them, doctor checks."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from flows.cli import app
from integrations.settings import PrefectMLSettings


@pytest.mark.parametrize("command", ["run", "train"])
def test_flags_mirror_parameter_names(command: str) -> None:
    result = CliRunner().invoke(app, [command, "--help"])
    assert result.exit_code == 0
    for flag in (
        "--epochs",
        "--workers",
        "--batch-size",
        "--lr",
        "--model",
        "--dataset",
        "--label-column",
        "--model-name",
        "--min-delta",
        "--no-normalize",
    ):
        assert flag in result.output


def test_invalid_flags_exit_2_naming_each_field(home: PrefectMLSettings) -> None:
    result = CliRunner().invoke(app, ["train", "--workers", "0", "--lr", "nan", "--model", "gpt"])
    assert result.exit_code == 2
    for text in ("training.workers", "training.lr", "unknown model 'gpt'", "finite number"):
        assert text in result.output
    assert not home.home_dir.joinpath("mlflow.db").exists()


def test_bad_json_option_is_a_usage_error() -> None:
    result = CliRunner().invoke(app, ["train", "--model-options", "{width: 3"])
    assert result.exit_code == 2 and "not valid JSON" in result.output


@pytest.mark.usefixtures("ray_cluster")
def test_doctor_reports_every_system(home: PrefectMLSettings) -> None:
    result = CliRunner().invoke(app, ["doctor"])
    assert result.exit_code == 0, result.output
    for check in ("versions", "devices", "ray", "mlflow", "storage"):
        assert check in result.output
    assert "FAIL" not in result.output


def test_doctor_fails_on_unwritable_storage(
    home: PrefectMLSettings, monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    blocker = tmp_path / "file-not-dir"
    blocker.write_text("x")
    monkeypatch.setenv("PREFECT_ML_STORAGE_URL", (blocker / "storage").as_uri())
    result = CliRunner().invoke(app, ["doctor"])
    assert result.exit_code == 1
    storage_row = next(line for line in result.output.splitlines() if "│ storage" in line)
    assert "FAIL" in storage_row and "Not a directory" in storage_row
