"""Clients no one here wrote, against `prefect-ml serve`: MLflow's scoring client and Triton's
HTTP client (Open Inference Protocol v2), on a served digits classifier.

    prefect-ml serve --model-name digits-classifier      # in another terminal
    python examples/serving_clients.py

The page "Serving protocols" (docs/how-to/serving-protocols.md) shows this file;
tests/e2e/test_serving_protocols.py calls these functions against a served model.
"""

import numpy as np
import tritonclient.http as triton
from mlflow.pyfunc.scoring_server.client import ScoringServerClient
from sklearn.datasets import load_digits


def classes_from_mlflow_client(host: str, port: int, rows: np.ndarray) -> list[str]:
    """MLflow's own client (it sends no token: for an endpoint without one). ``rows`` may be a
    pandas DataFrame too, its columns matched by name."""
    client = ScoringServerClient(host, port)
    client.wait_server_ready(timeout=30)
    return list(client.invoke(rows)["predictions"])


def classes_from_triton_client(
    host: str,
    port: int,
    rows: np.ndarray,
    model_name: str = "digits-classifier",
    version: str = "",  # "" the endpoint's default; "3" pins version 3
    headers: dict[str, str] | None = None,  # e.g. {"Authorization": "Bearer <token>"}
) -> tuple[list[str], np.ndarray]:
    """Triton's HTTP client: each row's class and its class probabilities."""
    client = triton.InferenceServerClient(url=f"{host}:{port}")
    tensor = triton.InferInput("input", list(rows.shape), "FP32")
    tensor.set_data_from_numpy(rows.astype(np.float32))
    result = client.infer(model_name, [tensor], model_version=version, headers=headers)
    labels = [str(label) for label in result.as_numpy("label")]  # BYTES data comes back as str
    return labels, result.as_numpy("probabilities")


if __name__ == "__main__":
    digits = load_digits().data[:5].astype(np.float32)
    print(classes_from_mlflow_client("127.0.0.1", 8000, digits))  # ['0', '1', '2', '3', '4']
    print(classes_from_triton_client("127.0.0.1", 8000, digits)[0])  # the same classes
