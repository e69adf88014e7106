"""``python -m prefect_ml.flows.cli``: the ``prefect-ml`` command."""

from prefect_ml.flows.cli import app

if __name__ == "__main__":
    app()
