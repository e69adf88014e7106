"""A campaign's study read with Optuna itself (docs/how-to/search-spaces.md): the best trial's
drawn parameters, and what the search space returned for it.

    python examples/best_trial.py blocks
"""

import sys

import optuna


def best_trial(
    campaign: str, storage: str = "sqlite:///.prefect-ml/optuna.db"
) -> optuna.trial.FrozenTrial:
    study = optuna.load_study(study_name=campaign, storage=storage)
    print(study.best_trial.params, study.best_trial.user_attrs["prefect_ml.tuned"])
    return study.best_trial


if __name__ == "__main__":
    best_trial(sys.argv[1])
