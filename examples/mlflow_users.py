"""Give a person read access to the pipeline's experiment and model, as MLflow's admin, on a
tracking server that runs MLflow's basic-auth app (deployments/README.md):

    MLFLOW_TRACKING_USERNAME=admin MLFLOW_TRACKING_PASSWORD=... python examples/mlflow_users.py
"""

from mlflow import MlflowClient
from mlflow.server.auth.client import AuthServiceClient


def give_read_access(tracking_uri: str, user: str, password: str) -> None:
    """Create ``user`` and let it read the ``prefect-ml`` experiment's runs and the
    ``digits-classifier`` model's versions (``"EDIT"`` would also let it log and move aliases)."""
    users = AuthServiceClient(tracking_uri)
    users.create_user(user, password)
    experiment = MlflowClient(tracking_uri).get_experiment_by_name("prefect-ml")
    if experiment is None:
        raise LookupError("no experiment 'prefect-ml' yet: run the pipeline once first")
    users.grant_user_permission(user, "experiment", experiment.experiment_id, "READ")
    users.grant_user_permission(user, "registered_model", "digits-classifier", "READ")


if __name__ == "__main__":
    give_read_access("https://127.0.0.1:5000", "alice", "a-long-password")
