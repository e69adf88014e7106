"""The ``prefect-ml`` command line: flags mirror parameters, errors name them, doctor checks,
what the driver imports."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import prefect_ml
from prefect_ml.flows.cli import app
from prefect_ml.flows.cli._output import console
from prefect_ml.integrations import compute
from prefect_ml.integrations.settings import PrefectMLSettings
from tests.conftest import REPO_ROOT
from tests.helpers import free_port


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
        "--early-stopping-patience",
        "--early-stopping-min-delta",
        "--early-stopping-metric",
        "--force",
    ):
        assert flag in result.output


def test_gpu_layer_flags_parse_into_the_training_section() -> None:
    from prefect_ml.flows.cli import parse_parameters
    from prefect_ml.tasks.params import TrainModelParams

    usage = CliRunner().invoke(app, ["train", "--help"]).output
    for flag in ("--precision", "--strategy", "--gradient-checkpointing", "--accelerator-type"):
        assert flag in usage
    params = parse_parameters(
        TrainModelParams,
        {"workers": "1-3", "precision": "bf16", "strategy": "fsdp", "gradient_checkpointing": True},
    )
    training = params.training
    assert training.worker_range == (1, 3) and training.strategy == "fsdp"
    assert training.precision == "bf16" and training.gradient_checkpointing


@pytest.mark.empty_home
def test_invalid_flags_exit_2_naming_each_field(home: PrefectMLSettings) -> None:
    result = CliRunner().invoke(app, ["train", "--workers", "0", "--lr", "nan", "--model", "gpt"])
    assert result.exit_code == 2
    for text in ("training.workers", "training.lr", "unknown model 'gpt'", "finite number"):
        assert text in result.output
    assert not home.home_dir.joinpath("mlflow.db").exists()


@pytest.mark.empty_home
def test_serve_flags_mirror_the_serving_parameters_and_bad_ones_exit_2(
    home: PrefectMLSettings,
) -> None:
    usage = CliRunner().invoke(app, ["serve", "--help"])
    for flag in (
        "--model-version",
        "--alias",
        "--host",
        "--max-batch-size",
        "--watch",
        "--replica-gpus",
        "--no-batching",
    ):
        assert flag in usage.output
    assert "--serve" in CliRunner().invoke(app, ["run", "--help"]).output
    for flags, texts in (
        (["--min-replicas", "3", "--max-replicas", "2"], ["raise --max-replicas"]),
        (["--port", "0", "--replica-gpus", "-1"], ["serving.port", "serving.replica_gpus"]),
    ):
        result = CliRunner().invoke(app, ["serve", *flags])
        assert result.exit_code == 2
        for text in texts:
            assert text in result.output
    assert not home.home_dir.joinpath("mlflow.db").exists()


def test_bad_json_option_is_a_usage_error() -> None:
    result = CliRunner().invoke(app, ["train", "--model-options", "{width: 3"])
    assert result.exit_code == 2 and "not valid JSON" in result.output


@pytest.fixture
def wide_console(monkeypatch: pytest.MonkeyPatch) -> None:
    """The commands' console 400 columns wide, so a doctor row is one line, whatever the
    terminal. Set on the console, not as COLUMNS: rich fixes a console's width when it is built
    (at import) if COLUMNS is set then, and a pytest-xdist worker starts with COLUMNS=80 (pytest
    imports readline, which exports the screen size it finds, 80x24 without a terminal, to the
    processes started after it)."""
    monkeypatch.setattr(console, "_width", 400)


@pytest.mark.usefixtures("ray_cluster", "wide_console")
def test_doctor_reports_every_system(home: PrefectMLSettings) -> None:
    result = CliRunner().invoke(app, ["doctor"])
    assert result.exit_code == 0, result.output
    for check in ("versions", "devices", "ray", "mlflow", "storage", "HAProxy ingress"):
        assert check in result.output
    runtime = compute.detect_runtime()
    devices_row = next(line for line in result.output.splitlines() if "│ devices" in line)
    assert f"{runtime.kind}: " in devices_row
    assert f"torch {torch.__version__}" in result.output
    assert result.output.count("WARNING: ") == len(runtime.warnings)
    assert "server http://127.0.0.1:" in result.output  # the test harness's Prefect server
    node_rows = [line for line in result.output.splitlines() if "│ node " in line]
    assert len(node_rows) == 1, "the local Ray's one node"
    assert f"prefect-ml {prefect_ml.__version__} (local Ray: this process's code)" in node_rows[0]
    assert "storage: written, read back and deleted; sees the driver's probe object" in (
        result.output
    )
    assert "FAIL" not in result.output


@pytest.mark.usefixtures("wide_console")
@pytest.mark.parametrize(
    ("where", "expected"),
    [("file", "not a writable directory"), ("s3", "'no-such-bucket' of s3://no-such-bucket")],
)
def test_doctor_fails_on_unusable_storage(
    home: PrefectMLSettings,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    moto_s3: object,
    where: str,
    expected: str,
) -> None:
    blocker = tmp_path / "file-not-dir"
    blocker.write_text("x")
    url = (blocker / "storage").as_uri() if where == "file" else "s3://no-such-bucket/prefect-ml"
    monkeypatch.setenv("PREFECT_ML_STORAGE_URL", url)
    result = CliRunner().invoke(app, ["doctor"])
    assert result.exit_code == 1
    storage_row = next(line for line in result.output.splitlines() if "│ storage" in line)
    assert "FAIL" in storage_row and expected in storage_row


def test_sweep_flags_mirror_campaign_parameters() -> None:
    result = CliRunner().invoke(app, ["sweep", "--help"])
    assert result.exit_code == 0
    for flag in (
        "--campaign",
        "--search-space",
        "--objectives",
        "--sampler",
        "--pruner",
        "--n-trials",
        "--timeout-seconds",
        "--concurrency",
        "--trial-cpus",
        "--trial-gpus",
        "--trial-workers",
        "--epochs",
    ):
        assert flag in result.output
    run_help = CliRunner().invoke(app, ["run", "--help"]).output
    assert "--campaign" in run_help and "--n-trials" in run_help


def _squash(text: str) -> str:
    return "".join(c for c in text if c.isalnum())


@pytest.mark.empty_home
@pytest.mark.parametrize("source", ["inline", "yaml-file"])
def test_invalid_search_space_exits_2_before_any_trial(
    home: PrefectMLSettings, tmp_path, source: str
) -> None:
    space = (
        "lr: {type: float, low: 0.0, high: 0.1, log: true}\nhidden: {type: int, low: 9, high: 3}"
    )
    if source == "yaml-file":
        path = tmp_path / "space.yaml"
        path.write_text(space)
        space = str(path)
    result = CliRunner().invoke(
        app, ["sweep", "--search-space", space, "--n-trials", "0", "--concurrency", "0"]
    )
    assert result.exit_code == 2, result.output
    for text in (
        "sweep.search_space.lr",
        "log scale needs low > 0",
        "sweep.search_space.hidden",
        "low (9) must be smaller than high (3)",
        "sweep.n_trials",
        "sweep.concurrency",
    ):
        assert _squash(text) in _squash(result.output)  # the table wraps long messages
    assert not home.home_dir.joinpath("optuna.db").exists()
    assert not home.home_dir.joinpath("mlflow.db").exists()


def test_deploy_without_a_server_says_how_to_start_one(
    home: PrefectMLSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PREFECT_API_URL", f"http://127.0.0.1:{free_port()}/api")
    result = CliRunner().invoke(app, ["deploy"])
    assert result.exit_code == 1
    assert "no Prefect server answers" in result.output and "prefect-ml ui" in result.output


def test_deploy_names_an_unknown_deployment_and_a_missing_file(
    home: PrefectMLSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    from prefect.settings import PREFECT_API_URL

    monkeypatch.chdir(REPO_ROOT)
    monkeypatch.setenv("PREFECT_API_URL", str(PREFECT_API_URL.value()))  # the test harness
    unknown = CliRunner().invoke(app, ["deploy", "--only", "nightly", "--only", "weekly"])
    assert unknown.exit_code == 1
    assert "--only" in unknown.output and "weekly" in unknown.output
    missing = CliRunner().invoke(app, ["deploy", "--prefect-file", "nowhere/prefect.yaml"])
    assert missing.exit_code == 1
    assert "--prefect-file" in missing.output and "does not exist" in missing.output


def test_ui_on_a_taken_port_names_the_flag(home: PrefectMLSettings) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = CliRunner().invoke(app, ["ui", "--port", str(port)])
    assert result.exit_code == 1
    assert "--port" in result.output and "not available" in result.output


@pytest.mark.empty_home
def test_task_flags_parse_and_a_metric_the_task_lacks_exits_2(
    home: PrefectMLSettings, tmp_path: Path
) -> None:
    from prefect_ml.flows.cli import parse_parameters
    from prefect_ml.tasks.params import TrainModelParams

    csv = tmp_path / "values.csv"
    csv.write_text("x,y\n" + "\n".join(f"{i},{i * 0.5}" for i in range(40)) + "\n")
    flags = {"task": "regression", "dataset": "tabular", "url": csv.as_uri(), "label_column": "y"}
    params = parse_parameters(TrainModelParams, {**flags, "metric": "r2"})
    assert params.data.task == "regression" and params.registry.metric == "r2"
    command = ["train", "--task", "regression", "--dataset", "tabular", "--url", csv.as_uri()]
    command += ["--label-column", "y", "--metric", "accuracy"]
    result = CliRunner().invoke(app, command)
    assert result.exit_code == 2
    output = " ".join(result.output.split())  # the table wraps long messages
    assert "regression produces no" in output and "'accuracy'" in output
    assert not home.home_dir.joinpath("mlflow.db").exists()


@pytest.mark.empty_home
def test_predict_flags_mirror_the_predict_parameters_and_bad_ones_exit_2(
    home: PrefectMLSettings,
) -> None:
    usage = CliRunner().invoke(app, ["predict", "--help"])
    for flag in ("--model-name", "--alias", "--model-version", "--url", "--output", "--force"):
        assert flag in usage.output
    for flag in ("--use-gpu", "--concurrency", "--batch-size", "--inference-precision"):
        assert flag in usage.output
    for flags, text in (
        (["--url", "rows.csv", "--concurrency", "0"], "concurrency"),
        (["--url", "rows.csv", "--inference-precision", "bf16"], "needs a GPU"),
        (["--url", "ftp://host/rows.csv"], "not allowed"),
    ):
        result = CliRunner().invoke(app, ["predict", *flags])
        assert result.exit_code == 2, result.output
        assert text in result.output
    assert not home.home_dir.joinpath("mlflow.db").exists()


def test_the_command_and_its_flows_import_no_ray_optuna_torch_or_mlflow() -> None:
    """``prefect-ml --help`` and the flows' import (Prefect's, when it loads an entrypoint) load
    none of Ray, Ray Serve, Optuna, torch, MLflow, FastAPI or SQLAlchemy: a step loads each when
    it needs it (their owners declare them with :func:`integrations.libraries.lazy_import`)."""
    late = {"ray", "ray.serve", "optuna", "torch", "mlflow", "fastapi", "sqlalchemy"}
    flows = ("cli", "pipeline", "train", "sweep", "serve", "predict")
    probe = (
        "import contextlib, sys\n"
        "from prefect_ml.flows.cli import app\n"
        "with contextlib.suppress(SystemExit):\n"
        "    app(['--help'])\n"
        f"print(sorted({late!r} & set(sys.modules)))\n"
        f"import {', '.join(f'prefect_ml.flows.{name}' for name in flows)}\n"
        f"print(sorted({late!r} & set(sys.modules)))\n"
    )
    found = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    )
    after_help, after_flows = found.stdout.splitlines()[-2:]
    assert (after_help, after_flows) == ("[]", "[]")


def test_the_campaign_summary_masks_the_study_database_password(
    home: PrefectMLSettings, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 36, finding 9, the same shape: the CLI's "watch it" line printed the Optuna
    storage whole, its password in terminals and CI logs."""
    from prefect_ml.flows.cli import print_campaign
    from prefect_ml.tasks.campaign.results import CampaignResult

    monkeypatch.setenv("PREFECT_ML_OPTUNA_STORAGE", "postgresql://optuna:PASSWORD@db/optuna")
    result = CampaignResult(
        campaign="c",
        experiment_id="1",
        parent_run_id="r",
        finished=0,
        complete=0,
        pruned=0,
        failed=0,
        best=[],
        trials=[],
        objectives={"val_loss": "minimize"},
        timings={},
    )
    print_campaign(result)
    printed = capsys.readouterr().err
    assert "optuna-dashboard postgresql://optuna:***@db/optuna" in printed
    assert "PASSWORD" not in printed
