"""The shipped pipeline called from Python (docs/how-to/own-flows.md). Prefect reads its
settings when it is imported, so the process is prepared first: Prefect's state then lives
under the project home.

    python -m examples.pipeline_from_python
"""

from prefect_ml.integrations.services import prepare_process_environment

prepare_process_environment()

from prefect_ml import ml_pipeline  # noqa: E402
from prefect_ml.flows.pipeline import PipelineOutcome  # noqa: E402
from prefect_ml.tasks.params import PipelineParams, TrainingParams  # noqa: E402


def train_and_register(workers: int, epochs: int) -> PipelineOutcome:
    """Digits trained on ``workers`` Ray workers, evaluated, registered, promoted if better."""
    params = PipelineParams(training=TrainingParams(workers=workers, epochs=epochs))
    return ml_pipeline(params=params)


if __name__ == "__main__":
    outcome = train_and_register(workers=4, epochs=20)
    print(outcome.registration.reason)
