"""Optuna: a campaign's durable state (the study), its sampler and pruner, recovery and plots.

The study is the campaign: every trial's parameters, intermediate values and final state live in
it, so a campaign killed at any moment is resumed by opening the study again. Only one process —
the campaign's coordinator, holding the campaign's lease (:mod:`integrations.storage`) and, in a
database, its claim on the study (:class:`~integrations.campaign.StudyClaim`) — writes to a
study.
"""

from __future__ import annotations

import contextlib
import logging
import math
import sqlite3
import time
import warnings
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prefect_ml.integrations.errors import ConfigurationError
from prefect_ml.integrations.libraries import lazy_import
from prefect_ml.integrations.redaction import masked

if TYPE_CHECKING:
    import optuna
    from matplotlib.figure import Figure
else:
    optuna = lazy_import("optuna")  # about a second: when a campaign runs, not with the flows

logger = logging.getLogger(__name__)

PARENT_RUN_ATTR = "prefect_ml.mlflow_parent_run_id"
OBJECTIVES_ATTR = "prefect_ml.objectives"
# Trial user attributes.
INTERRUPTED_ATTR = "prefect_ml.interrupted"  # failed because its coordinator died; retried
ROOT_ATTR = "prefect_ml.root_trial"  # the first attempt of a retried trial: its checkpoints
ERROR_ATTR = "prefect_ml.error"
TUNED_ATTR = (
    "prefect_ml.tuned"  # what the trial's search space set: {"lr": ..., "model_options.x": ...}
)
ATTEMPT_ATTR = "prefect_ml.attempt"  # 1 for a first attempt; retries count up
MAX_ATTEMPTS = 3
NOT_STARTED_ATTR = "prefect_ml.not_started"  # asked ahead, never run: the campaign ended first
OPEN_ATTEMPTS = 4


def is_database(url: str) -> bool:
    """Whether an Optuna storage URL names a database (an SQLAlchemy URL), not a journal file."""
    return "://" in url


def engine_options(url: str) -> dict[str, Any]:
    """SQLAlchemy ``create_engine`` options for the study database ``url`` (created if it is a
    new SQLite file, in write-ahead-log mode), shared by Optuna's storage and the study claims
    (``_study_claims``)."""
    if not url.startswith("sqlite:///"):
        return {}
    path = url.removeprefix("sqlite:///").partition("?")[0]
    if path and path != ":memory:":
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        write_ahead_log(path)
    # SQLite serialises writers; waiting for the lock beats failing with "database is locked"
    # when two campaigns share one file.
    return {"connect_args": {"timeout": 60}}


def write_ahead_log(path: str) -> None:
    """Put the SQLite file ``path`` in write-ahead-log mode (kept in the file, for every later
    connection): a commit is one append and one fsync instead of a rollback journal created,
    synced and deleted, and readers (the dashboard, ``optuna.load_study``) no longer block the
    campaign's writes. Commits stay as durable (SQLite's default ``synchronous=FULL``). A
    campaign commits a dozen times per trial, and every parameter a trial draws is one."""
    with contextlib.closing(sqlite3.connect(path, timeout=60)) as connection:
        connection.execute("PRAGMA journal_mode=WAL")


def storage_for(url: str) -> optuna.storages.BaseStorage:
    """An SQLAlchemy URL gives an RDB storage; anything else is the path of a journal file."""
    if not is_database(url):
        from optuna.storages.journal import JournalFileBackend

        journal = Path(url).expanduser()
        journal.parent.mkdir(parents=True, exist_ok=True)
        return optuna.storages.JournalStorage(JournalFileBackend(str(journal)))
    return optuna.storages.RDBStorage(url, engine_kwargs=engine_options(url))


def distributions(search_space: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Optuna distributions from the validated, declarative search space."""
    made: dict[str, Any] = {}
    for name, spec in search_space.items():
        if spec["type"] == "categorical":
            made[name] = optuna.distributions.CategoricalDistribution(spec["choices"])
        elif spec["type"] == "int":
            step = int(spec.get("step") or 1)
            made[name] = optuna.distributions.IntDistribution(
                int(spec["low"]), int(spec["high"]), log=spec["log"], step=step
            )
        else:
            made[name] = optuna.distributions.FloatDistribution(
                spec["low"], spec["high"], log=spec["log"], step=spec.get("step")
            )
    return made


def make_sampler(
    name: str,
    seed: int | None,
    grid: dict[str, list[Any]] | None = None,
    *,
    conditional: bool = False,
) -> optuna.samplers.BaseSampler:
    """The sampler ``name``; for a ``conditional`` space (trials draw different dimensions),
    TPE models the dimensions drawn together jointly (``multivariate``, ``group``) instead of
    each one alone."""
    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if name == "cmaes":
        return optuna.samplers.CmaEsSampler(seed=seed, warn_independent_sampling=False)
    if name == "grid":
        return ask_tell_grid_sampler()(grid or {}, seed=seed)
    if conditional:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            return optuna.samplers.TPESampler(seed=seed, multivariate=True, group=True)
    return optuna.samplers.TPESampler(seed=seed)


def draw_once(space: Callable[[optuna.Trial], Any]) -> tuple[Any, dict[str, Any]]:
    """What ``space`` returns for one trial of a throw-away in-memory study, and the
    distributions it drew: how a campaign checks a space before any trial trains.

    Raises:
        whatever ``space`` raises.
    """
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    trial = study.ask()
    returned = space(trial)
    return returned, dict(trial.distributions)


@cache
def ask_tell_grid_sampler() -> type[optuna.samplers.GridSampler]:
    """Optuna's grid sampler without its ``study.stop()`` once the grid is exhausted (a class
    made on first use: its base class is Optuna's).

    ``stop()`` only works inside ``study.optimize``; with ask/tell it raises. The campaign caps
    its budget at the grid's size instead.
    """

    class AskTellGridSampler(optuna.samplers.GridSampler):
        def after_trial(self, *args: Any, **kwargs: Any) -> None:
            return None

    return AskTellGridSampler


def make_pruner(name: str, max_epochs: int) -> optuna.pruners.BasePruner:

    if name == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=4, n_warmup_steps=1)
    if name == "hyperband":
        return optuna.pruners.HyperbandPruner(min_resource=1, max_resource=max_epochs)
    if name == "successive_halving":
        return optuna.pruners.SuccessiveHalvingPruner(min_resource=1)
    return optuna.pruners.NopPruner()


def open_study(
    storage_url: str,
    name: str,
    objectives: dict[str, str],
    sampler: optuna.samplers.BaseSampler,
    pruner: optuna.pruners.BasePruner,
) -> optuna.Study:
    """Create the study ``name`` or load it; its objectives must match the stored ones.

    Two campaigns starting at once on a new database race to create its tables; the loser
    retries a few times and then finds them.
    """
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    for attempt in range(1, OPEN_ATTEMPTS + 1):
        try:
            study = optuna.create_study(
                storage=storage_for(storage_url),
                study_name=name,
                directions=[optuna.study.StudyDirection[d.upper()] for d in objectives.values()],
                sampler=sampler,
                pruner=pruner,
                load_if_exists=True,
            )
            break
        except Exception as exc:  # SQLAlchemy and journal errors differ; all mean the same here
            if attempt == OPEN_ATTEMPTS:
                raise ConfigurationError(
                    "optuna_storage", f"cannot open Optuna storage {masked(storage_url)}: {exc}"
                ) from exc
            time.sleep(0.5 * attempt)
    stored = study.user_attrs.get(OBJECTIVES_ATTR)
    if stored is None:
        study.set_user_attr(OBJECTIVES_ATTR, objectives)
    elif stored != objectives:
        raise ConfigurationError(
            "sweep.objectives",
            f"campaign '{name}' was started with objectives {stored}, not {objectives}; "
            "use the same objectives to continue it, or a new campaign name",
        )
    return study


def check_search_space(study: optuna.Study, space: dict[str, Any]) -> None:
    """Refuse a search space the study's existing trials contradict (changed choices, log...)."""
    for trial in study.get_trials(deepcopy=False):
        for name, distribution in trial.distributions.items():
            if name not in space:
                continue
            try:
                optuna.distributions.check_distribution_compatibility(distribution, space[name])
            except ValueError as exc:
                raise ConfigurationError(
                    f"sweep.search_space.{name}",
                    f"campaign '{study.study_name}' already has trials with {distribution}; "
                    f"{exc}. Keep the dimension's type, choices, log and step to continue it, "
                    "or use a new campaign name",
                ) from None
        if set(space) <= set(trial.distributions):
            return  # a trial covering every dimension was checked; later ones match it


def requeue(study: optuna.Study, trial: optuna.trial.FrozenTrial | optuna.trial.Trial) -> bool:
    """Fail an interrupted attempt and queue the next one: same parameters, same root trial.

    The retry keeps the first attempt's number as its root, so it resumes from that attempt's
    checkpoints. Interrupted attempts do not count toward the budget; their retries do. After
    ``MAX_ATTEMPTS`` the trial is not queued again (returns False): the caller fails it for good.
    """
    attempt = int(trial.user_attrs.get(ATTEMPT_ATTR, 1))
    if attempt >= MAX_ATTEMPTS:
        return False
    study._storage.set_trial_user_attr(trial._trial_id, INTERRUPTED_ATTR, True)
    study.tell(trial.number, state=optuna.trial.TrialState.FAIL, skip_if_finished=True)
    study.enqueue_trial(
        trial.params, user_attrs={ROOT_ATTR: root_trial(trial), ATTEMPT_ATTR: attempt + 1}
    )
    return True


def recover_interrupted(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    """Requeue the trials a dead coordinator left RUNNING (see :func:`requeue`)."""
    interrupted = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,))
    for trial in interrupted:
        if not requeue(study, trial):
            study._storage.set_trial_user_attr(
                trial._trial_id, ERROR_ATTR, f"interrupted {MAX_ATTEMPTS} times"
            )
            study.tell(trial.number, state=optuna.trial.TrialState.FAIL, skip_if_finished=True)
    return interrupted


def counts_toward_budget(trial: optuna.trial.FrozenTrial) -> bool:
    """Completed, pruned and failed-on-its-own trials are finished; interrupted ones are not."""
    if trial.state in (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED):
        return True
    if trial.state != optuna.trial.TrialState.FAIL:
        return False
    return not (trial.user_attrs.get(INTERRUPTED_ATTR) or trial.user_attrs.get(NOT_STARTED_ATTR))


def root_trial(trial: optuna.trial.FrozenTrial | optuna.trial.Trial) -> int:
    return int(trial.user_attrs.get(ROOT_ATTR, trial.number))


def grid_size(grid: dict[str, list[Any]]) -> int:
    return math.prod(len(values) for values in grid.values())


def best_trials(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    """The best trial (one objective) or the Pareto front (several); empty if none completed."""
    if not study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)):
        return []
    return list(study.best_trials) if len(study.directions) > 1 else [study.best_trial]


def plots(study: optuna.Study, objective_names: list[str]) -> dict[str, Figure]:
    """Optuna's standard plots as matplotlib figures; a plot that cannot be drawn yet is skipped."""
    import matplotlib

    matplotlib.use("Agg")
    from optuna.visualization import matplotlib as optuna_plots

    target: dict[str, Any] = {}
    if len(objective_names) > 1:
        target = {"target": lambda t: t.values[0], "target_name": objective_names[0]}
    makers: dict[str, Any] = {
        "optimization_history": lambda: optuna_plots.plot_optimization_history(study, **target),
        "param_importances": lambda: optuna_plots.plot_param_importances(study, **target),
        "parallel_coordinate": lambda: optuna_plots.plot_parallel_coordinate(study, **target),
        "intermediate_values": lambda: optuna_plots.plot_intermediate_values(study),
    }
    if len(objective_names) > 1:
        makers["pareto_front"] = lambda: optuna_plots.plot_pareto_front(
            study, target_names=objective_names
        )
    figures: dict[str, Figure] = {}
    for name, make in makers.items():
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                warnings.simplefilter("ignore", UserWarning)  # "no artists", flat ranges
                axes = make()
        except (ValueError, RuntimeError, ZeroDivisionError) as exc:
            logger.info("plot %s skipped: %s", name, exc)
            continue
        figure = axes.figure if hasattr(axes, "figure") else axes.flat[0].figure
        figure.set_size_inches(9, 5)
        figure.tight_layout()
        figures[name] = figure
    return figures
