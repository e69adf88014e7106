"""A model with its own steps (integrations.training): trained through its training_step and
configure_optimizers, validated through its validation_step next to the task's metrics,
checkpointed as the plain network; a model that breaks the contract is refused, naming the
hook, before any worker starts."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from prefect_ml.integrations import training
from prefect_ml.integrations.contracts import TrainingModule
from prefect_ml.integrations.errors import ConfigurationError
from prefect_ml.integrations.settings import PrefectMLSettings
from prefect_ml.integrations.storage import CheckpointStore
from prefect_ml.integrations.training import METRICS_FILE
from prefect_ml.tasks.data import inspect_dataset, preprocess_dataset
from prefect_ml.tasks.params import TrainModelParams
from prefect_ml.tasks.training import check_model
from tests.fixtures.user_code import StepsModule
from tests.helpers import blob_trainer

STEPS = "tests.fixtures.user_code:steps_model"
SMOOTHED = "tests.fixtures.user_code:smoothed_model"


def test_the_fixture_fits_the_protocol_by_duck_typing() -> None:
    assert isinstance(StepsModule(4, 3), TrainingModule)
    assert training.is_hooked(StepsModule(4, 3))
    assert not training.is_hooked(torch.nn.Linear(4, 3))


def test_a_hooked_model_trains_through_its_own_steps_and_resumes(tmp_path: Path) -> None:
    url = (tmp_path / "run").as_uri()
    trainer = blob_trainer(url, model=STEPS, epochs=3)
    assert isinstance(trainer.optimizer, torch.optim.SGD)  # its configure_optimizers()
    history = []
    for epoch in (1, 2):
        metrics = trainer.train_epoch(epoch)
        history.append(metrics)
        files = {**trainer.snapshot(epoch), METRICS_FILE: json.dumps(metrics).encode()}
        CheckpointStore(url).save(epoch, files)
    first, second = history
    # validation_step's metrics next to the task's own (forward-based) ones
    assert {"val_top2_accuracy", "val_accuracy", "val_loss", "train_loss"} <= set(second)
    assert second["train_loss"] < first["train_loss"]
    assert second["val_accuracy"] > 0.9 and second["val_top2_accuracy"] >= second["val_accuracy"]

    resumed = blob_trainer(url, model=STEPS, epochs=3)
    assert resumed.first_epoch == 3
    for name, value in trainer.network.state_dict().items():
        torch.testing.assert_close(resumed.network.state_dict()[name], value)
    # Checkpoints hold the network's own names: evaluation rebuilds it from the factory.
    model, epoch = training.load_trained_model(url, STEPS, [4], 3, {})
    assert epoch == 2 and set(model.state_dict()) == set(trainer.network.state_dict())


@pytest.mark.parametrize(
    ("model", "options", "training", "field", "words"),
    [
        (STEPS, {"broken": "optimizers"}, {}, "model.configure_optimizers", "manual optim"),
        (STEPS, {"broken": "loss"}, {}, "model.training_step", "scalar tensor"),
        (STEPS, {"broken": "validation"}, {}, "model.validation_step", "dict of scalar tensors"),
        (STEPS, {}, {"strategy": "fsdp"}, "training.strategy", "use --strategy ddp"),
        (SMOOTHED, {"broken": True}, {}, "model.compute_loss", "scalar tensor"),
    ],
)
def test_a_model_that_breaks_the_contract_is_refused_before_training_naming_the_hook(
    home: PrefectMLSettings,
    model: str,
    options: dict[str, object],
    training: dict[str, str],
    field: str,
    words: str,
) -> None:
    params = TrainModelParams.model_validate(
        {
            "data": {"dataset": "tests.fixtures.user_code:blobs"},
            "model": {"model": model, "model_options": options},
            "training": training,
        }
    )
    summary = inspect_dataset(params)
    data = preprocess_dataset(params.data, summary.fingerprint, home.resolved_storage_url)
    with pytest.raises(ConfigurationError) as refused:
        check_model(params, data)
    assert refused.value.field == field
    assert words in str(refused.value)


def test_hooked_validation_metrics_are_batch_weighted_means() -> None:
    """Uneven batches: the epoch's value is the mean over rows, not over batches."""
    trainer = blob_trainer("memory://unused", model=STEPS)
    sums = trainer._model_validation(batch_size=40)  # 90 rows: batches of 40, 40, 10
    with torch.no_grad():
        features, labels = (torch.from_numpy(a) for a in trainer.val.head(trainer.val.rows))
        top2 = trainer.network(features).topk(2, dim=1).indices
        expected = (top2 == labels[:, None]).any(dim=1).double().sum()
    assert float(sums["val_top2_accuracy"]) == pytest.approx(float(expected))
    assert np.isfinite(float(sums["val_loss"]))


def test_a_plain_model_s_own_loss_and_metrics_replace_and_extend_the_tasks(tmp_path: Path) -> None:
    trainer = blob_trainer((tmp_path / "run").as_uri(), model=SMOOTHED, epochs=2)
    metrics = trainer.train_epoch(1)
    steps = -(-90 // 16)  # batches of 16 over 90 rows
    assert trainer.network.loss_calls == steps  # its compute_loss, not the task's
    assert {"val_confidence", "val_accuracy", "val_loss"} <= set(metrics)
    assert 1 / 3 < metrics["val_confidence"] <= 1.0


def test_the_task_s_validation_pass_is_skipped_when_the_steps_return_its_metrics(
    tmp_path: Path,
) -> None:
    """validation_step returning val_loss and val_accuracy makes the forward pass redundant."""
    partial = blob_trainer((tmp_path / "a").as_uri(), model=STEPS)
    assert partial.task_validation  # loss and top2_accuracy: no val_accuracy of its own
    covering = blob_trainer(
        (tmp_path / "b").as_uri(), model="tests.fixtures.user_code:covering_model"
    )
    assert not covering.task_validation
    metrics = covering.train_epoch(1)
    assert {"val_loss", "val_accuracy", "train_loss"} <= set(metrics)
    assert 0.0 <= metrics["val_accuracy"] <= 1.0


def test_a_real_lightning_module_trains_through_its_hooks(tmp_path: Path) -> None:
    """lightning.LightningModule fits the contract as it is: no Trainer, no adapter."""
    import lightning

    trainer = blob_trainer(
        (tmp_path / "lit").as_uri(), model="tests.fixtures.lightning_code:build", epochs=3
    )
    assert isinstance(trainer.network, lightning.LightningModule)
    assert isinstance(trainer.optimizer, torch.optim.Adam)  # {"optimizer": ...}
    first, second = trainer.train_epoch(1), trainer.train_epoch(2)
    assert second["val_lit_loss"] < first["val_lit_loss"]
    assert second["val_accuracy"] > 0.9  # the task's own metric, from its forward
    rows = torch.from_numpy(trainer.val.head(4)[0])
    exported = torch.export.export(trainer.network.eval(), (rows,))
    assert exported.module()(rows).shape == (4, 3)  # pt2, as registered


def test_a_hooked_model_trains_under_autocast_in_bf16(tmp_path: Path) -> None:
    """Precision works for hooked models: their steps run inside the autocast context."""
    trainer = blob_trainer((tmp_path / "bf16").as_uri(), model=STEPS, precision="bf16")
    metrics = trainer.train_epoch(1)
    assert np.isfinite(metrics["train_loss"]) and np.isfinite(metrics["val_top2_accuracy"])
    assert trainer.train_epoch(2)["train_loss"] < metrics["train_loss"]
