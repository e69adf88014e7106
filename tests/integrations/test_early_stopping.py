"""Early stopping's decision from a run's epoch history, and the retention that keeps the best
epoch's weights, on a real checkpoint store (no Ray: the decision is plain data)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prefect_ml.integrations.config.loop import TrainLoop
from prefect_ml.integrations.early_stopping import BestEpoch, EarlyStopping, StopDecision
from prefect_ml.integrations.storage import CheckpointStore
from prefect_ml.integrations.training import (
    METRICS_FILE,
    EpochCommitter,
    committed_history,
    retention,
)


def _history(metric: str, *values: float) -> dict[int, dict[str, float]]:
    return {epoch: {metric: value} for epoch, value in enumerate(values, start=1)}


def test_stops_after_patience_epochs_without_an_improvement_beyond_min_delta() -> None:
    stopping = EarlyStopping.for_metric("val_loss", patience=2, min_delta=0.05)
    history = _history("val_loss", 1.0, 0.8, 0.78, 0.9, 0.5)
    # 0.78 beats 0.8 by less than min delta: epoch 2 stays the best, epoch 4 is 2 past it.
    assert stopping.decide(history) == StopDecision(4, BestEpoch(2, 0.8), "val_loss")
    assert stopping.decide({e: history[e] for e in (1, 2, 3)}) is None, "one epoch short"
    assert stopping.best(history) == BestEpoch(2, 0.8), "epochs past the stop do not count"
    patient = EarlyStopping.for_metric("val_loss", patience=3, min_delta=0.05)
    assert patient.decide(history) is None and patient.best(history) == BestEpoch(5, 0.5)
    described = stopping.decide(history).describe(12)  # type: ignore[union-attr]
    assert described == "epoch 4 of 12; best epoch 2 (val_loss 0.8)"


def test_a_maximised_metric_improves_upwards_and_nan_or_missing_epochs_count_as_no_gain() -> None:
    stopping = EarlyStopping.for_metric("val_accuracy", patience=2)
    assert stopping.mode == "max"
    assert stopping.decide(_history("val_accuracy", 0.5, 0.7, 0.9, 0.95)) is None
    # Epoch 2 is NaN and epoch 3's checkpoint did not verify (absent): both count as epochs.
    history = {
        1: {"val_accuracy": 0.6},
        2: {"val_accuracy": float("nan")},
        4: {"val_accuracy": 0.5},
    }
    decision = stopping.decide(history)
    assert decision is not None and (decision.epoch, decision.best.epoch) == (4, 1)
    assert EarlyStopping.for_metric("val_rmse", patience=1).mode == "min"


def test_patience_below_one_and_a_negative_delta_are_refused() -> None:
    with pytest.raises(ValueError, match="patience"):
        EarlyStopping("val_loss", patience=0)
    with pytest.raises(ValueError, match="min_delta"):
        EarlyStopping("val_loss", patience=1, min_delta=-0.1)


def test_retention_keeps_the_weights_of_early_stoppings_best_epoch(tmp_path: Path) -> None:
    """Keep 1 checkpoint and no best-checkpoint metric: only the newest would keep its weights,
    but early stopping's best epoch (by val_loss) keeps them too, also across a restart."""
    config = TrainLoop.from_options(
        splits_url="",
        sample_shape=[1],
        num_classes=2,
        model="mlp",
        model_options={},
        epochs=6,
        batch_size=1,
        lr=0.1,
        optimizer="adam",
        weight_decay=0.0,
        scheduler="none",
        seed=0,
        checkpoint_url=tmp_path.as_uri(),
        keep_checkpoints=1,
        best_checkpoint_metric="none",
        early_stopping_patience=3,
    )
    store = CheckpointStore(config.checkpoint_url)
    losses = {1: 0.9, 2: 0.4, 3: 0.6, 4: 0.7}

    def commit(committer: EpochCommitter, epochs: list[int]) -> None:
        for epoch in epochs:
            metrics = {"val_loss": losses[epoch]}
            committer.submit(
                epoch, {"w": bytes([epoch])}, metrics, epoch_started=0, blocked_since=0
            )
        committer.close()

    stopping = config.training.early_stopping()
    commit(EpochCommitter(store, retention(config.training), early_stopping=stopping), [1, 2, 3])
    # A restarted committer learns the history from the committed metrics files.
    history = committed_history(store, 3)
    assert history == {e: {**json.loads(store.read_verified(e, METRICS_FILE))} for e in (1, 2, 3)}
    commit(
        EpochCommitter(store, retention(config.training), early_stopping=stopping, history=history),
        [4],
    )

    assert store.load(2).files["w"] == bytes([2]), "the best epoch kept its weights"
    assert store.load(4).files["w"] == bytes([4]), "the newest is the resume point"
    for pruned in (1, 3):
        with pytest.raises(Exception, match="pruned"):
            store.load(pruned)
    assert set(committed_history(store, 4)) == {1, 2, 3, 4}, "every epoch kept its metrics"
    assert stopping is not None and stopping.decide(committed_history(store, 4)) is None
