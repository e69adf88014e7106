"""The public task API: one namespace, cheap to import; keyword options checked before any
compute, naming the option; the shipped flows' sections passed through unchanged; promotion on
several metrics."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
from prefect import Task

import prefect_ml
from prefect_ml import ConfigurationError, Evaluation, PreparedData, TrainResult
from prefect_ml.integrations.problems import PROBLEMS
from prefect_ml.integrations.settings import PrefectMLSettings
from prefect_ml.tasks.params import (
    CampaignParams,
    ModelParams,
    TrainingSections,
    params_from_options,
    section_options,
)
from prefect_ml.tasks.register import decide, promotion_rules
from tests.conftest import REPO_ROOT

PUBLIC_TASKS = ("preprocess", "train", "evaluate", "register", "serve", "campaign")


def _prepared(shape: list[int] | None = None) -> PreparedData:
    return PreparedData(
        fingerprint="f" * 20,
        splits_url="file:///nowhere",
        sample_shape=shape or [64],
        num_classes=10,
        class_names=[str(i) for i in range(10)],
        rows={"train": 1257, "val": 270, "test": 270},
    )


def _trained() -> TrainResult:
    return TrainResult(
        run_id="r",
        experiment_id="1",
        checkpoint_url="file:///nowhere",
        final_epoch=1,
        resumed_from_epoch=0,
        best_epoch=1,
        epoch_metrics={},
        model=ModelParams(),
        data=_prepared(),
    )


def test_the_package_imports_without_loading_its_dependencies() -> None:
    """Prefect imports every ``prefect.collections`` package; ours loads names on first use."""
    probe = (
        "import sys, prefect_ml\n"
        "heavy = ('prefect', 'torch', 'ray', 'mlflow', 'pydantic')\n"
        "heavy = [m for m in heavy if m in sys.modules]\n"
        "assert not heavy, heavy\n"
        "print(type(prefect_ml.train).__name__, prefect_ml.__version__)\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO_ROOT, capture_output=True, text=True, check=False
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.split()[0] == "Task"


def test_every_public_name_resolves_and_the_steps_are_prefect_tasks() -> None:
    for name in prefect_ml.__all__:
        assert getattr(prefect_ml, name) is not None, name
    for name in PUBLIC_TASKS:
        assert isinstance(getattr(prefect_ml, name), Task), name
    with pytest.raises(AttributeError):
        prefect_ml.no_such_name  # noqa: B018


def test_no_module_imports_the_old_top_level_packages() -> None:
    """Only ``prefect_ml.*`` names: a top-level ``flows`` or ``tasks`` is the user's own."""
    offenders = []
    for folder in ("prefect_ml", "tests", "benchmarks", "examples"):
        for path in (REPO_ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = []
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                offenders += [
                    f"{path.relative_to(REPO_ROOT)}: {name}"
                    for name in names
                    if name.split(".")[0] in ("flows", "tasks", "integrations")
                ]
    assert not offenders


@pytest.mark.parametrize(
    ("call", "field", "words"),
    [
        (lambda: prefect_ml.train.fn(_prepared(), epoch=3), "epoch", "did you mean 'epochs'"),
        (lambda: prefect_ml.train.fn(_prepared(), epochs=0), "epochs", "greater than or equal"),
        (lambda: prefect_ml.train.fn(_prepared(), batch_size=5000), "training.batch_size", "1257"),
        (lambda: prefect_ml.train.fn(_prepared(), model="os:system"), "model", "not allowed"),
        (lambda: prefect_ml.train.fn(_prepared(), experiment="../x"), "experiment", ".."),
        (
            lambda: prefect_ml.campaign.fn(_prepared(), n_trial=3),
            "n_trial",
            "did you mean 'n_trials'",
        ),
        (lambda: prefect_ml.campaign.fn(_prepared(), search_space={}), "sweep", "search_space"),
        (lambda: prefect_ml.preprocess.fn("tabular"), "preprocess", "needs url"),
        (lambda: prefect_ml.preprocess.fn(test_fraction=0.9), "test_fraction", "less than"),
        (lambda: prefect_ml.serve.fn("m", port=0), "port", "greater than or equal"),
        (lambda: prefect_ml.serve.fn("m", version="latest"), "model_version", "pattern"),
        (
            lambda: prefect_ml.register.fn(
                _trained(),
                Evaluation(metrics={}, confusion_matrix=[]),
                model_name="m",
                promote_if={"f1": 0.1},
            ),
            "promote_if",
            "classification produces no test metric 'f1'",
        ),
        (
            lambda: prefect_ml.register.fn(
                _trained(),
                Evaluation(metrics={}, confusion_matrix=[]),
                model_name="m",
                promote_if={"loss": -1.0},
            ),
            "promote_if['loss']",
            "a number >= 0",
        ),
        (
            lambda: prefect_ml.evaluate.fn(_trained(), _prepared(shape=[1, 8, 8])),
            "data",
            "cannot score",
        ),
    ],
)
@pytest.mark.empty_home
def test_bad_options_fail_naming_the_option_before_anything_is_touched(
    home: PrefectMLSettings, call: object, field: str, words: str
) -> None:
    """Refused before Ray, MLflow or storage: the project home stays empty."""
    import ray

    ray_before = ray.is_initialized()  # the session's Ray may be up for other tests
    with pytest.raises(ConfigurationError) as refused:
        call()  # type: ignore[operator]
    assert refused.value.field == field
    assert words in str(refused.value)
    assert not home.home_dir.exists() or not any(home.home_dir.iterdir())
    assert ray.is_initialized() == ray_before


def test_the_flows_sections_pass_through_the_options_unchanged() -> None:
    """What a flow hands the public tasks rebuilds its own sections exactly, including what was
    left unset (a pruner not named with several objectives is not an error)."""
    params = CampaignParams.model_validate(
        {
            "model": {"hidden": 16},
            "training": {"workers": "1-2", "epochs": 3},
            "sweep": {"objectives": {"val_loss": "minimize", "val_accuracy": "maximize"}},
        }
    )
    options = section_options(params.model, params.training, params.sweep)
    assert "pruner" not in options
    rebuilt = params_from_options(
        CampaignParams, options, step="campaign", experiment=params.experiment, data=params.data
    )
    assert rebuilt == params
    sections = params_from_options(
        TrainingSections,
        section_options(params.model, params.training),
        step="train",
        experiment=params.experiment,
        data=params.data,
    )
    assert sections.run_key("fp") == params.run_key("fp")


def test_promotion_needs_every_metric_of_promote_if_in_its_direction() -> None:
    champion = {"test_accuracy": 0.90, "test_loss": 0.30, "test_macro_f1": 0.89}
    better_but_less_sure = Evaluation(
        metrics={"accuracy": 0.95, "loss": 0.35, "macro_f1": 0.94}, confusion_matrix=[]
    )

    def verdict(promote_if: dict[str, float], directions: dict | None = None) -> tuple[bool, str]:
        rules = promotion_rules(PROBLEMS["classification"], promote_if, directions or {})
        decision = decide(better_but_less_sure, rules, champion, "3")
        return decision.promoted, decision.reason

    assert verdict({"accuracy": 0.0})[0]
    assert verdict({"accuracy": 0.0, "macro_f1": 0.04})[0]
    assert not verdict({"accuracy": 0.1})[0]  # beats it, but not by 0.1
    promoted, reason = verdict({"accuracy": 0.0, "loss": 0.0})  # loss is minimised: worse
    assert not promoted
    assert "test_accuracy=0.9500 beats" in reason and "test_loss=0.3500 does not beat" in reason
    assert verdict({"loss": 0.0}, {"loss": "maximize"})[0]  # the direction given wins
    rules = promotion_rules(PROBLEMS["classification"], {"loss": 0}, {})
    first = decide(better_but_less_sure, rules, {}, None)
    assert first.promoted and "no current champion" in first.reason
    with pytest.raises(ConfigurationError, match="directions"):
        promotion_rules(PROBLEMS["classification"], {"accuracy": 0.0}, {"loss": "minimize"})
    with pytest.raises(ConfigurationError, match="at least one"):
        promotion_rules(PROBLEMS["classification"], {}, {})
    with pytest.raises(ConfigurationError, match="regression produces no test metric 'accuracy'"):
        promotion_rules(PROBLEMS["regression"], {"accuracy": 0.0}, {})
    (rmse,) = promotion_rules(PROBLEMS["regression"], {"rmse": 0.5}, {})
    assert (rmse.metric, rmse.direction, rmse.min_delta) == ("rmse", "minimize", 0.5)


def test_repository_imports_the_package_it_installs() -> None:
    """The package's files live in prefect_ml/, as the wheel installs them; the top-level
    flows/, tasks/ and integrations/ are links into it (prefect.yaml's entrypoints, the layout)."""
    for name in ("flows", "tasks", "integrations"):
        link, folder = REPO_ROOT / name, REPO_ROOT / "prefect_ml" / name
        assert link.is_symlink() and link.resolve() == folder.resolve()
        assert folder.is_dir() and not folder.is_symlink()
    assert Path(prefect_ml.__file__).parent == REPO_ROOT / "prefect_ml"
