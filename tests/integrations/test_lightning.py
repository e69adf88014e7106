"""A ``lightning.LightningModule`` as Lightning's documentation writes it, trained through its
hooks without a Lightning ``Trainer``: ``self.log``/``self.log_dict`` recorded with Lightning's
semantics (checked against a real ``Trainer`` on the same module), every ``configure_optimizers``
form Lightning accepts with its schedulers stepped as Lightning steps them, the epoch hooks and
``current_epoch``/``global_step``, and the pre-flight check that never refuses a valid model.
The 2-worker DDP run through the CLI and a user's flow is tests/e2e/test_lightning.py."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from prefect_ml.integrations import training
from prefect_ml.integrations.errors import ConfigurationError, TrainingCodeError
from prefect_ml.integrations.settings import PrefectMLSettings
from prefect_ml.integrations.storage import CheckpointStore
from prefect_ml.tasks.data import inspect_dataset, preprocess_dataset
from prefect_ml.tasks.params import TrainModelParams
from prefect_ml.tasks.retries import is_permanent
from prefect_ml.tasks.training import check_model
from tests.helpers import blob_trainer, blobs

EXAMPLE = "examples.lightning_classifier:build"
FIXTURES = "tests.fixtures.lightning_code"


@pytest.fixture
def examples_allowed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PREFECT_ML_ALLOWED_MODULES", "examples,tests.fixtures")


def _trained(model: str, epochs: int, tmp_path: Path, **config: Any) -> list[dict[str, float]]:
    trainer = blob_trainer((tmp_path / "run").as_uri(), model=model, epochs=epochs, **config)
    return [trainer.train_epoch(epoch) for epoch in range(1, epochs + 1)]


def test_self_log_records_what_a_lightning_trainer_records(tmp_path: Path) -> None:
    """The same module under lightning.Trainer and under prefect-ml: every value it logs (from
    training_step, validation_step, log_dict and the three epoch hooks; sum, mean, max and min
    reductions; on_step and on_epoch) reaches the epoch's metrics with Lightning's value,
    under its split's prefix."""
    import lightning
    from torch.utils.data import DataLoader, TensorDataset

    from tests.fixtures.lightning_code import LoggingProbe

    features, labels = blobs(rows=90, features=4)
    data = TensorDataset(torch.from_numpy(features).float(), torch.from_numpy(labels).long())
    reference = lightning.Trainer(
        max_epochs=2,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    reference.fit(
        LoggingProbe(4, 3), DataLoader(data, batch_size=16), DataLoader(data, batch_size=256)
    )
    expected = {name: float(value) for name, value in reference.callback_metrics.items()}

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # Lightning's "self.trainer reference is not registered"
        ours = _trained(f"{FIXTURES}:logging_probe", 2, tmp_path)[-1]
    validation = {"mean", "label_mean", "seen", "steps_at_validation_end"}
    assert len(expected) == 12, expected  # rows, rows_step, rows_epoch and 9 more
    for name, value in expected.items():
        hook = "validation_step" if name in validation else "training_step"
        recorded = training.metric_name(hook, name)
        assert ours[recorded] == pytest.approx(value, rel=1e-6), (recorded, ours, expected)
    assert ours["train_rows_step"] == 10.0  # the last batch of 90 rows in 16s
    assert ours["train_epoch_at_start"] == ours["train_epoch_at_end"] == 1.0  # 0-based epochs


def test_the_documented_lightning_module_trains_as_it_is(
    tmp_path: Path, examples_allowed: None
) -> None:
    """examples/lightning_classifier.py: validation_step returns nothing and logs, training_step
    logs on step and epoch, StepLR halves the rate every epoch; no warning from Lightning."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        history = _trained(EXAMPLE, 3, tmp_path)
    assert [epoch["lr"] for epoch in history] == [0.1, 0.05, 0.025]  # the rate each epoch used
    last = history[-1]
    assert {"val_loss", "val_acc", "train_loss_step", "train_loss_epoch"} <= set(last)
    assert last["train_loss"] == last["train_loss_epoch"]  # Lightning's callback value
    assert last["val_acc"] > 0.9 and last["val_acc"] == pytest.approx(last["val_accuracy"])


def test_the_loop_state_a_lightning_module_reads(tmp_path: Path, examples_allowed: None) -> None:
    trainer = blob_trainer((tmp_path / "run").as_uri(), model=EXAMPLE, epochs=4)
    trainer.train_epoch(1)
    trainer.train_epoch(2)
    module = trainer.network
    steps = -(-90 // 16)
    assert (module.current_epoch, module.global_step) == (1, 2 * steps)
    assert module.trainer.estimated_stepping_batches == 4 * steps
    assert module.trainer.is_global_zero and module.device == torch.device("cpu")
    assert float(module.trainer.callback_metrics["val_acc"]) > 0.9


@pytest.mark.parametrize(
    ("form", "rates"),
    [
        ("optimizer", [1.0, 1.0, 1.0, 1.0]),
        ("list", [1.0, 1.0, 1.0, 1.0]),
        ("tuple", [1.0, 0.5, 0.25, 0.125]),
        ("dict", [1.0, 0.5, 0.25, 0.125]),
        ("dicts", [1.0, 0.5, 0.25, 0.125]),
        ("every-2-epochs", [1.0, 1.0, 0.5, 0.5]),
        # 6 batches an epoch: a step every 2 batches halves the rate 3 times an epoch
        ("every-2-steps", [1.0, 0.125, 0.125**2, 0.125**3]),
    ],
)
def test_every_configure_optimizers_form_steps_its_schedulers_as_lightning(
    tmp_path: Path, form: str, rates: list[float]
) -> None:
    history = _trained(f"{FIXTURES}:scheduled", 4, tmp_path, model_options={"form": form})
    assert [epoch["lr"] for epoch in history] == pytest.approx(rates)


def test_a_plateau_scheduler_steps_on_its_monitored_metric(tmp_path: Path) -> None:
    """ReduceLROnPlateau(patience=0) halves the rate after any epoch whose monitored metric
    did not improve, so the rates follow the metric's history."""
    for form, monitor in (("plateau", "val_loss"), ("plateau-config", "train_loss")):
        history = _trained(
            f"{FIXTURES}:scheduled", 5, tmp_path / form, model_options={"form": form}, lr=1.0
        )
        rate, best = 1.0, float("inf")
        for epoch in history:
            assert epoch["lr"] == pytest.approx(rate), (form, history)
            if epoch[monitor] < best:
                best = epoch[monitor]
            else:
                rate /= 2


@pytest.mark.parametrize(
    ("form", "words"),
    [
        ("two", "manual optimisation"),
        ("plateau-unmonitored", "without a monitor"),
        ("interval", "'epoch' or 'step'"),
        ("keys", "takes 'optimizer'"),
        ("none", "returned NoneType"),
    ],
)
def test_a_form_that_cannot_train_here_is_refused_naming_it(
    tmp_path: Path, form: str, words: str
) -> None:
    with pytest.raises(ConfigurationError) as refused:
        blob_trainer(
            (tmp_path / "r").as_uri(), model=f"{FIXTURES}:scheduled", model_options={"form": form}
        )
    assert refused.value.field == "model.configure_optimizers"
    assert words in str(refused.value)


def test_manual_optimisation_and_an_unknown_plateau_monitor_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="automatic_optimization = False"):
        blob_trainer((tmp_path / "m").as_uri(), model=f"{FIXTURES}:manual")
    trainer = blob_trainer(
        (tmp_path / "p").as_uri(),
        model=f"{FIXTURES}:scheduled",
        model_options={"form": "plateau-unknown"},
    )
    with pytest.raises(ConfigurationError, match="monitors 'nope'"):
        trainer.train_epoch(1)


def test_self_log_refuses_what_lightning_refuses_naming_the_hook() -> None:
    log = training.StepLog()
    with log.hook("on_train_epoch_end"), pytest.raises(ConfigurationError, match="on_step"):
        log.log("x", 1.0, on_step=True)
    with log.hook("validation_step"):
        with pytest.raises(ConfigurationError, match="logs nothing"):
            log.log("x", 1.0, on_step=False, on_epoch=False)
        with pytest.raises(ConfigurationError, match="reduce_fx"):
            log.log("x", 1.0, reduce_fx="median")
        with pytest.raises(ConfigurationError, match="shape \\[3\\]"):
            log.log("x", torch.ones(3))
        log.log("y", 1.0)
        with pytest.raises(ConfigurationError, match="different arguments"):
            log.log("y", 1.0, reduce_fx="sum")
    log.log("outside", 1.0)  # outside the hooks (a forward at serving time): ignored
    assert log.names() == ["val_y"]


def test_epoch_values_across_workers_follow_sync_dist() -> None:
    """sync_dist=True: the weighted mean of every worker's rows (and max, sum over workers);
    without it rank 0's own value, as Lightning logs it."""
    workers = []
    for rows, value in ((30, 1.0), (10, 3.0)):
        log = training.StepLog()
        with log.hook("validation_step", rows):
            log.log("synced", value, sync_dist=True)
            log.log("local", value)
            log.log("top", value, sync_dist=True, reduce_fx="max")
            log.log("count", float(rows), sync_dist=True, reduce_fx="sum")
        workers.append(log.take())
    metrics = training.combine(workers)
    assert metrics["val_synced"] == pytest.approx((30 * 1.0 + 10 * 3.0) / 40)
    assert metrics["val_local"] == 1.0
    assert metrics["val_top"] == 3.0 and metrics["val_count"] == 40.0


def test_early_stopping_and_the_best_checkpoint_watch_a_logged_metric(
    tmp_path: Path, examples_allowed: None
) -> None:
    """val_acc is the model's own (self.log): early stopping watches it upwards (mode max),
    and a metric no epoch produces is refused after the first epoch, as Lightning's
    EarlyStopping refuses it."""
    watching = {
        "early_stopping_patience": 1,
        "early_stopping_metric": "val_acc",
        "early_stopping_mode": "max",
        "early_stopping_min_delta": 0.5,  # no epoch after the first beats it by that much
    }
    url = (tmp_path / "run").as_uri()
    training.train_epochs(blob_trainer(url, model=EXAMPLE, epochs=6, **watching))
    history = training.committed_history(CheckpointStore(url), 6)
    assert sorted(history) == [1, 2]  # stopped after epoch 2: patience 1 past the best
    typo = {**watching, "early_stopping_metric": "val_acuracy"}
    with pytest.raises(ConfigurationError, match="'val_acuracy' is not among"):
        training.train_epochs(blob_trainer((tmp_path / "t").as_uri(), model=EXAMPLE, **typo))


def _prepared(home: PrefectMLSettings, model: str, **model_section: Any) -> tuple[Any, Any]:
    params = TrainModelParams.model_validate(
        {
            "data": {"dataset": "tests.fixtures.user_code:blobs"},
            "model": {"model": model, **model_section},
        }
    )
    summary = inspect_dataset(params)
    return params, preprocess_dataset(params.data, summary.fingerprint, home.resolved_storage_url)


def test_the_pre_flight_check_builds_a_model_that_computes_in_init_on_the_cpu(
    home: PrefectMLSettings, examples_allowed: None
) -> None:
    """int(torch.tensor(shape).prod()) fails on the meta device; the check builds it on the
    CPU instead, and learns what the steps log with prog_bar for the progress line."""
    from examples.lightning_classifier import build

    with pytest.raises(RuntimeError, match="meta"), torch.device("meta"):
        build((4,), 3)
    params, data = _prepared(home, EXAMPLE)
    probe = check_model(params, data)
    assert probe is not None
    assert {"val_loss", "val_acc", "train_loss"} <= probe.names
    assert probe.prog_bar == {"train_loss_step", "train_loss_epoch", "val_acc"}  # Lightning's


def test_a_factory_receives_only_what_its_user_set(home: PrefectMLSettings) -> None:
    """build(input_shape, num_classes, **kwargs) gets model_options alone, not the built-in
    MLP's hidden/depth/channels/dropout; a factory that names hidden gets it."""
    params, data = _prepared(home, f"{FIXTURES}:kwargs_only")
    assert params.model.factory_options() == {}
    assert check_model(params, data) is None
    named, _ = _prepared(home, "tests.fixtures.user_code:picky_model", hidden=8)
    assert named.model.factory_options() == {"hidden": 8, "dropout": 0.1}


def test_an_error_of_the_user_s_code_before_training_is_not_retried(
    home: PrefectMLSettings,
) -> None:
    """A factory that raises TypeError fails the pre-flight check as a TrainingCodeError, which
    the train task's retry condition treats as permanent."""
    params, data = _prepared(home, f"{FIXTURES}:kwargs_only", model_options={"depth": 2})
    with pytest.raises(TrainingCodeError, match="TypeError: kwargs_only got unexpected") as error:
        check_model(params, data)
    assert is_permanent(error.value)


def test_a_hooked_model_without_validation_step_trains(tmp_path: Path) -> None:
    """validation_step is optional, as in Lightning: the task's own validation reports."""
    trainer = blob_trainer(
        (tmp_path / "r").as_uri(),
        model="tests.fixtures.user_code:steps_model",
        model_options={"broken": "missing"},
    )
    assert not training.defines(trainer.network, "validation_step")
    metrics = trainer.train_epoch(1)
    assert {"train_loss", "val_loss", "val_accuracy"} <= set(metrics)


def test_a_campaign_may_optimise_what_a_model_of_one_s_own_logs(examples_allowed: None) -> None:
    """A logged metric is a valid objective for a user model; the built-in MLP logs nothing,
    so the same objective is refused for it, naming the task's metrics."""
    from pydantic import ValidationError

    from prefect_ml.tasks.params import CampaignParams

    sweep = {"n_trials": 2, "objectives": {"val_acc": "maximize"}}
    own = CampaignParams.model_validate({"model": {"model": EXAMPLE}, "sweep": sweep})
    assert own.sweep.objectives == {"val_acc": "maximize"}
    with pytest.raises(ValidationError, match="produces no \\['val_acc'\\]"):
        CampaignParams.model_validate({"sweep": sweep})


def test_test_step_scores_the_test_split_and_predict_step_is_what_serves(
    tmp_path: Path, examples_allowed: None
) -> None:
    """Evaluation adds what test_step logs (test_acc); registration exports predict_step's
    output (here logits over a temperature) instead of forward's."""
    trainer = blob_trainer((tmp_path / "run").as_uri(), model=EXAMPLE, epochs=2)
    trainer.train_epoch(1)
    features, labels = (torch.from_numpy(a) for a in trainer.val.head(trainer.val.rows))
    batches = zip(features.split(32), labels.split(32), strict=True)
    metrics = training.test_step_metrics(trainer.network, batches)
    accuracy = (trainer.network(features).argmax(dim=1) == labels).double().mean()
    assert metrics == {"test_acc": pytest.approx(float(accuracy))}
    served = training.served_module(trainer.network)
    exported = torch.export.export(served, (features[:4],)).module()
    torch.testing.assert_close(exported(features[:4]), trainer.network(features[:4]) / 2.0)
    assert training.served_module(torch.nn.Linear(4, 3)).__class__ is torch.nn.Linear
