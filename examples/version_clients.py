"""Select a version of the served model per request, from clients no one here wrote
(docs/how-to/several-versions.md): any HTTP client by a header or by the version's URL,
tritonclient by ``model_version`` (a number, or an alias).

    prefect-ml serve --model-name digits-classifier     # in another terminal, with a version 2
    python examples/version_clients.py
"""

from typing import Any

import httpx
import numpy as np
import tritonclient.http as triton
from sklearn.datasets import load_digits

MODEL = "digits-classifier"


def predict_by_header(
    server: str, rows: np.ndarray, version: str, model: str = MODEL
) -> dict[str, Any]:
    """``/predict`` (or ``/invocations``) with the version in Ray Serve's multiplexing header."""
    pinned = {"serve_multiplexed_model_id": f"{model}/{version}"}
    response = httpx.post(
        f"http://{server}/predict", json={"inputs": rows.tolist()}, headers=pinned
    )
    return response.raise_for_status().json()


def invoke_by_url(server: str, rows: np.ndarray, version: str, model: str = MODEL) -> list[str]:
    """The version's base URL, for a client that takes a URL and posts to ``/invocations``."""
    base = f"http://{server}/models/{model}/versions/{version}"
    response = httpx.post(f"{base}/invocations", json={"inputs": rows.tolist()})
    return response.raise_for_status().json()["predictions"]


def infer_with_triton(server: str, rows: np.ndarray, version: str, model: str = MODEL) -> list[str]:
    """Each row's class from tritonclient, which names the version in ``model_version``."""
    client = triton.InferenceServerClient(url=server)
    if not client.is_model_ready(model, version):  # this loads it on a replica
        raise RuntimeError(f"{model} version {version} cannot be served now")
    tensor = triton.InferInput("input", list(rows.shape), "FP32")
    tensor.set_data_from_numpy(rows.astype(np.float32))
    labels = client.infer(model, [tensor], model_version=version).as_numpy("label")
    return [str(label) for label in labels]  # BYTES data comes back as str


if __name__ == "__main__":
    rows = load_digits().data[:5]
    server = "127.0.0.1:8000"  # host:port, and the route prefix if the app has one
    print(predict_by_header(server, rows, "2")["predictions"])
    print(invoke_by_url(server, rows, "2"))
    print(infer_with_triton(server, rows, "challenger"))
