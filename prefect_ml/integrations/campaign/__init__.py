"""A hyperparameter campaign's engine: the Optuna study as its durable state, one coordinator per
study, the search space, and the warm Ray actors that train its trials.

The study is the campaign: every trial's parameters, intermediate values and final state live in
it, so a campaign killed at any moment resumes by opening the study again. Only the campaign's
coordinator (:mod:`tasks.campaign`) writes to it, holding the campaign's storage lease and, when
the study is in a database, its claim there (:class:`StudyClaim`). A trial runs on a warm trial
worker (:class:`TrialWorker`, a Ray actor that keeps torch and the splits loaded) addressed by
slot through :class:`RayTrialPool`, so the coordinator sees slots and outcomes, never Ray.

Behind this face: ``_studies`` (Optuna: storage, sampler, pruner, recovery of interrupted
trials, plots; the one module that imports Optuna), ``_study_claims`` (the claim on a study in
its own database; the one that imports SQLAlchemy), ``_search_spaces`` (a space as a function
of a trial: the user's define-by-run function or the sweep section's declared dict),
``_trial_worker`` (:class:`TrialWorker`, :class:`TrialSpec`) and ``_trial_pool`` (slots and
outcomes over Ray actors).
"""

from prefect_ml.integrations.campaign._search_spaces import (
    first_draw,
    resolve_space,
    tuned_values,
    with_values,
)
from prefect_ml.integrations.campaign._studies import (
    ATTEMPT_ATTR,
    ERROR_ATTR,
    INTERRUPTED_ATTR,
    MAX_ATTEMPTS,
    NOT_STARTED_ATTR,
    OBJECTIVES_ATTR,
    PARENT_RUN_ATTR,
    TUNED_ATTR,
    best_trials,
    check_search_space,
    counts_toward_budget,
    distributions,
    draw_once,
    grid_size,
    make_pruner,
    make_sampler,
    open_study,
    plots,
    recover_interrupted,
    requeue,
    root_trial,
    storage_for,
)
from prefect_ml.integrations.campaign._study_claims import (
    StudyClaim,
    claims_supported,
    claims_table,
)
from prefect_ml.integrations.campaign._trial_pool import (
    Epochs,
    Outcome,
    RayTrialPool,
    TrialError,
    TrialPool,
    WorkerLost,
)
from prefect_ml.integrations.campaign._trial_worker import EpochReport, TrialSpec, TrialWorker

__all__ = [
    "ATTEMPT_ATTR",
    "ERROR_ATTR",
    "INTERRUPTED_ATTR",
    "MAX_ATTEMPTS",
    "NOT_STARTED_ATTR",
    "OBJECTIVES_ATTR",
    "PARENT_RUN_ATTR",
    "TUNED_ATTR",
    "EpochReport",
    "Epochs",
    "Outcome",
    "RayTrialPool",
    "StudyClaim",
    "TrialError",
    "TrialPool",
    "TrialSpec",
    "TrialWorker",
    "WorkerLost",
    "best_trials",
    "check_search_space",
    "claims_supported",
    "claims_table",
    "counts_toward_budget",
    "distributions",
    "draw_once",
    "first_draw",
    "grid_size",
    "make_pruner",
    "make_sampler",
    "open_study",
    "plots",
    "recover_interrupted",
    "requeue",
    "resolve_space",
    "root_trial",
    "storage_for",
    "tuned_values",
    "with_values",
]
