"""A pruned trial is told PRUNED without values, whenever the study thread gets to it."""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any

import optuna
from optuna.distributions import FloatDistribution
from optuna.trial import TrialState

from tasks.sweep import Coordinator, RunningTrial, Tally


class HeldExecutor(Executor):
    """Runs nothing until :meth:`release`: the study thread as late as it can be."""

    def __init__(self) -> None:
        self.held: list[tuple[Future[Any], Callable[[], Any]]] = []

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        future: Future[Any] = Future()
        self.held.append((future, lambda: fn(*args, **kwargs)))
        return future

    def release(self) -> None:
        for future, job in self.held:
            try:
                future.set_result(job())
            except Exception as exc:
                future.set_exception(exc)


class Ended:
    def trial_ended(self, *args: Any) -> None:
        pass


def test_a_pruned_trial_is_told_without_values_when_the_study_thread_runs_late() -> None:
    coordinator = Coordinator.__new__(Coordinator)
    coordinator.study = optuna.create_study(direction="maximize")
    coordinator.objectives, coordinator.names = {"val_accuracy": "maximize"}, ["val_accuracy"]
    coordinator.study_thread = held = HeldExecutor()  # type: ignore[assignment]
    coordinator.study_writes, coordinator.tally = [], Tally()
    coordinator.logger = logging.getLogger("test")  # type: ignore[assignment]
    trial = coordinator.study.ask({"lr": FloatDistribution(1e-3, 1e-1)})
    running = RunningTrial(trial, None, "", last_metrics={"val_accuracy": 0.4})

    coordinator._finish(running, "PRUNED", {}, Ended())  # type: ignore[arg-type]
    held.release()

    [write] = coordinator.study_writes
    write.result()
    assert coordinator.study.trials[0].state == TrialState.PRUNED
