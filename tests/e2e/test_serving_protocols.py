"""The serving app's other protocols on the real Ray Serve, spoken by clients no one here wrote:
MLflow's ``ScoringServerClient`` and raw ``/invocations`` (every JSON format and CSV), Triton's
``tritonclient`` over the Open Inference Protocol v2, and schemathesis fuzzing the OpenAPI
schema; each answer equal to ``/predict``'s and to MLflow's own for the same version.

The module reuses test_serving's ``served`` fixture (digits-classifier v1 on a free port)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import mlflow
import numpy as np
import pandas as pd
import pytest
import tritonclient.http as triton
from mlflow.pyfunc.scoring_server.client import ScoringServerClient
from ray import serve
from tritonclient.utils import InferenceServerException

from examples import serve_several_versions, serving_clients, version_clients
from prefect_ml.flows.serve import serve_model
from prefect_ml.integrations import tracking
from tests.e2e import test_serving
from tests.e2e.test_pipeline import _predict_with_mlflow_models_serve
from tests.e2e.test_serving import (
    DIGITS,
    FEATURES,
    MAX_BODY,
    MAX_ROWS,
    TOKEN,
    Served,
    _broken_version,
    _local_probabilities,
    _pickle_format,
    _replica_log,
)
from tests.helpers import register_classifier

# test_serving's fixture, the same deployment for this module: digits-classifier v1, no token.
served = test_serving.served

ROWS = FEATURES[100:140]
MODEL = "digits-classifier"


def _predicted(url: str, rows: np.ndarray, headers: dict[str, str] | None = None) -> Any:
    response = httpx.post(f"{url}/predict", json={"inputs": rows.tolist()}, headers=headers)
    assert response.status_code == 200, response.text
    return response.json()


def _labels(result: triton.InferResult) -> list[str]:
    """The ``label`` output as strings (tritonclient gives JSON's BYTES data as str)."""
    return [str(label) for label in result.as_numpy("label")]


def _mlflow_models_predict(served: Served, version: str, rows: np.ndarray, tmp: Path) -> Any:
    """``mlflow models predict`` on the registered version: its raw outputs per row."""
    request, output = tmp / "input.json", tmp / "output.json"
    request.write_text(json.dumps({"inputs": rows.tolist()}))
    command = [sys.executable, "-m", "mlflow", "models", "predict", "--env-manager", "local"]
    uri = f"models:/{MODEL}/{version}"
    env = {**os.environ, "MLFLOW_TRACKING_URI": served.settings.resolved_tracking_uri}
    subprocess.run(
        [*command, "-m", uri, "-i", str(request), "-o", str(output), "-t", "json"],
        env=env,
        check=True,
        capture_output=True,
        timeout=300,
    )
    return np.asarray(json.loads(output.read_text())["predictions"])


def test_mlflows_client_and_every_scoring_format_answer_as_predict_and_as_mlflow_itself(
    served: Served, tmp_path: Path
) -> None:
    expected = _predicted(served.url, ROWS)
    assert expected["model"]["version"] == "1"
    classes = expected["predictions"]

    client = ScoringServerClient("127.0.0.1", served.port)
    client.wait_server_ready(timeout=30)
    assert client.get_version() == mlflow.__version__
    shuffled = pd.DataFrame(ROWS).iloc[:, ::-1]  # columns 63..0: matched by name, not order
    assert client.invoke(shuffled)["predictions"] == classes
    assert client.invoke(ROWS)["predictions"] == classes
    # the docs' client script (docs/how-to/serving-protocols.md includes it) as a user runs it
    assert serving_clients.classes_from_mlflow_client("127.0.0.1", served.port, ROWS) == classes
    assert httpx.get(f"{served.url}/health").status_code == 200

    records = shuffled.to_dict(orient="records")
    bodies: dict[str, Any] = {
        "dataframe_split": {"dataframe_split": shuffled.to_dict(orient="split")},
        "dataframe_records": {"dataframe_records": records},
        "instances": {"instances": records},
        "inputs": {"inputs": ROWS.reshape(-1, 8, 8).tolist(), "params": {"unused": True}},
    }
    for case, body in bodies.items():
        answer = httpx.post(f"{served.url}/invocations", json=body)
        assert answer.status_code == 200, (case, answer.text)
        assert answer.json() == {"predictions": classes}, case
    csv = httpx.post(
        f"{served.url}/invocations",
        content=shuffled.to_csv(index=False),
        headers={"content-type": "text/csv; charset=utf-8"},
    )
    assert csv.status_code == 200 and csv.json() == {"predictions": classes}, csv.text

    # MLflow's own server and CLI on the same registered version answer the network's raw
    # outputs (logits): their argmax is our class, row for row.
    served_by_mlflow = _predict_with_mlflow_models_serve(served.settings, ROWS)
    predicted_by_mlflow = _mlflow_models_predict(served, "1", ROWS, tmp_path)
    for logits in (served_by_mlflow, predicted_by_mlflow):
        assert [str(c) for c in logits.argmax(axis=1)] == classes
    assert np.mean(np.array(classes, dtype=int) == DIGITS.target[100:140]) > 0.9


def test_tritonclient_speaks_the_open_inference_protocol_to_the_served_model(
    served: Served,
) -> None:
    expected = _predicted(served.url, ROWS)
    client = triton.InferenceServerClient(url=f"127.0.0.1:{served.port}")
    assert client.is_server_live() and client.is_server_ready()
    assert client.get_server_metadata()["name"] == "prefect-ml"
    assert client.is_model_ready(MODEL) and client.is_model_ready(MODEL, "1")
    assert not client.is_model_ready(MODEL, "99") and not client.is_model_ready("other")
    metadata = client.get_model_metadata(MODEL)
    assert metadata["versions"] == ["1"]
    assert metadata["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [-1, 64]}]
    assert [o["name"] for o in metadata["outputs"]] == ["label", "probabilities"]
    assert client.get_model_metadata(MODEL, "1") == metadata

    for binary in (False, True):  # JSON data, and Triton's binary extension (its default)
        tensor = triton.InferInput("input", list(ROWS.shape), "FP32")
        tensor.set_data_from_numpy(ROWS, binary_data=binary)
        result = client.infer(MODEL, [tensor], request_id=f"request-{binary}")
        assert result.get_response()["id"] == f"request-{binary}"
        assert result.get_response()["model_version"] == "1"
        assert _labels(result) == expected["predictions"]
        np.testing.assert_allclose(
            result.as_numpy("probabilities"), expected["probabilities"], atol=1e-6
        )
    images = triton.InferInput("input", [len(ROWS), 1, 8, 8], "FP64")
    images.set_data_from_numpy(ROWS.reshape(-1, 1, 8, 8).astype(np.float64), binary_data=False)
    only_labels = [triton.InferRequestedOutput("label", binary_data=False)]
    result = client.infer(MODEL, [images], model_version="1", outputs=only_labels)
    assert [o["name"] for o in result.get_response()["outputs"]] == ["label"]
    assert _labels(result) == expected["predictions"]

    for model, version, words in [("other", "", "is not served here"), (MODEL, "99", "no version")]:
        with pytest.raises(InferenceServerException) as refused:
            client.infer(model, [images], model_version=version)
        assert refused.value.status() == "404" and words in refused.value.message()
    wrong = triton.InferInput("input", [len(ROWS), 63], "FP32")
    wrong.set_data_from_numpy(ROWS[:, :63], binary_data=False)
    with pytest.raises(InferenceServerException) as refused:
        client.infer(MODEL, [wrong])
    assert refused.value.status() == "400" and "input 'input'" in refused.value.message()
    client.close()

    # the docs' client script (docs/how-to/serving-protocols.md includes it) as a user runs it
    labels, probabilities = serving_clients.classes_from_triton_client(
        "127.0.0.1", served.port, ROWS
    )
    assert labels == expected["predictions"]
    np.testing.assert_allclose(probabilities, expected["probabilities"], atol=1e-6)


def _bad_requests() -> list[tuple[str, str, dict[str, str], str | bytes, int, str]]:
    """(route, case, headers, body, status, words) for the MLflow and OIP routes."""
    row = FEATURES[0].tolist()
    as_json = {"content-type": "application/json"}
    infer = f"/v2/models/{MODEL}/infer"
    tensor = {"name": "input", "shape": [1, 64], "datatype": "FP32", "data": row}
    too_many = [row] * (MAX_ROWS + 1)
    return [
        ("/invocations", "no format", as_json, '{"rows": []}', 400, "exactly one"),
        ("/invocations", "not JSON", as_json, "{", 400, "not valid JSON"),
        ("/invocations", "short row", as_json, '{"inputs": [[1.0]]}', 400, "expected 64"),
        ("/invocations", "text", {"content-type": "text/plain"}, "x", 415, "content types"),
        (
            "/invocations",
            "latin-1",
            {"content-type": "text/csv; charset=latin-1"},
            "x",
            415,
            "UTF-8",
        ),
        (
            "/invocations",
            "too many rows",
            as_json,
            json.dumps({"inputs": too_many}),
            413,
            "limit is",
        ),
        ("/invocations", "too large", as_json, b" " * (MAX_BODY + 1), 413, "byte limit"),
        (infer, "not JSON", as_json, "{", 400, "not valid JSON"),
        (infer, "no inputs", as_json, '{"inputs": []}', 400, "inputs"),
        (
            infer,
            "bad datatype",
            as_json,
            json.dumps({"inputs": [{**tensor, "datatype": "BF16"}]}),
            400,
            "input 'input': datatype 'BF16'",
        ),
        (
            infer,
            "bad shape",
            as_json,
            json.dumps({"inputs": [{**tensor, "shape": [2, 64]}]}),
            400,
            "input 'input': 64 values for shape [2, 64]",
        ),
        (
            infer,
            "too many rows",
            as_json,
            json.dumps({"inputs": [{**tensor, "shape": [MAX_ROWS + 1, 64], "data": too_many}]}),
            413,
            "limit is",
        ),
        (
            f"/v2/models/{MODEL}/versions/99/infer",
            "unknown version",
            as_json,
            json.dumps({"inputs": [tensor]}),
            404,
            "digits-classifier has no version 99",
        ),
    ]


def test_a_malformed_request_of_each_protocol_gets_its_4xx_shape_and_requests_share_the_batcher(
    served: Served,
) -> None:
    with httpx.Client(base_url=served.url, timeout=30) as client:
        before = client.get("/metadata").json()["batching"]["requests"]
        for route, case, headers, body, status, words in _bad_requests():
            response = client.post(route, content=body, headers=headers)
            assert response.status_code == status, (case, response.status_code, response.text)
            if status == 415:  # MLflow's own 415 is plain text
                assert response.headers["content-type"].startswith("text/plain"), case
                assert words in response.text, (case, response.text)
                continue
            answer = response.json()
            message = answer["message"] if route == "/invocations" else answer["error"]
            assert set(answer) == (
                {"error_code", "message"} if route == "/invocations" else {"error"}
            )
            assert words in message, (case, message)
        row = FEATURES[0].tolist()
        good = [
            client.post("/invocations", json={"inputs": [row]}),
            client.post(
                f"/v2/models/{MODEL}/infer",
                json={
                    "inputs": [{"name": "input", "shape": [1, 64], "datatype": "FP32", "data": row}]
                },
            ),
            client.post("/predict", json={"inputs": [row]}),
        ]
        assert [answer.status_code for answer in good] == [200, 200, 200]
        after = client.get("/metadata").json()["batching"]["requests"]
    # the three good requests went through the replica's one batcher; no refused one did
    assert after - before == 3


def test_every_protocol_needs_the_token_and_is_in_the_access_log(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PREFECT_ML_SERVE_TOKEN", TOKEN)
    params = served.params(app_name="protocols", route_prefix="/protocols")
    assert serve_model(params).authenticated
    url = f"{served.url}/protocols"
    auth = {"Authorization": f"Bearer {TOKEN}"}
    row = FEATURES[0].tolist()
    infer_body = {"inputs": [{"name": "input", "shape": [1, 64], "datatype": "FP32", "data": row}]}
    refused = httpx.post(f"{url}/invocations", json={"inputs": [row]})
    assert refused.status_code == 401 and refused.json()["error_code"] == "UNAUTHENTICATED"
    assert refused.headers["www-authenticate"] == "Bearer"
    refused = httpx.post(f"{url}/v2/models/{MODEL}/infer", json=infer_body)
    assert refused.status_code == 401 and "bearer token" in refused.json()["error"]
    assert httpx.get(f"{url}/v2/models/{MODEL}").status_code == 401
    assert httpx.get(f"{url}/v2/models/{MODEL}/ready").status_code == 401
    # Liveness needs no token, as /healthz.
    assert httpx.get(f"{url}/ping").status_code == 200
    assert httpx.get(f"{url}/v2/health/live").json() == {"live": True}

    classes = _predicted(url, FEATURES[:3], auth)["predictions"]
    scored = httpx.post(f"{url}/invocations", json={"inputs": FEATURES[:3].tolist()}, headers=auth)
    assert scored.json() == {"predictions": classes}
    infer_body["inputs"][0].update(shape=[3, 64], data=FEATURES[:3].tolist())
    inferred = httpx.post(
        f"{url}/v2/models/{MODEL}/versions/1/infer", json=infer_body, headers=auth
    )
    assert inferred.json()["outputs"][0]["data"] == classes
    log = _replica_log("protocols")  # Serve logs the route's template
    for line in (
        "POST /protocols/invocations 200",
        "POST /protocols/invocations 401",
        "POST /protocols/v2/models/{name}/versions/{version}/infer 200",
        "POST /protocols/v2/models/{name}/infer 401",
    ):
        assert line in log, line
    serve.delete("protocols")


def test_the_openapi_schema_describes_every_route_and_a_fuzz_run_finds_no_5xx(
    served: Served, tmp_path: Path
) -> None:
    openapi = httpx.get(f"{served.url}/openapi.json").json()
    paths = openapi["paths"]
    routes = {
        "/predict",
        "/invocations",
        "/ping",
        "/health",
        "/version",
        "/v2",
        "/v2/health/live",
        "/v2/health/ready",
        "/v2/models/{name}",
        "/v2/models/{name}/versions/{version}",
        "/v2/models/{name}/ready",
        "/v2/models/{name}/versions/{version}/ready",
        "/v2/models/{name}/infer",
        "/v2/models/{name}/versions/{version}/infer",
        "/models/{name}/versions/{version}/predict",
        "/models/{name}/versions/{version}/invocations",
    }
    assert routes <= set(paths)
    for route in ("/predict", "/invocations", "/v2/models/{name}/infer"):
        parameters = paths[route]["post"]["parameters"]
        assert {"name": "serve_multiplexed_model_id", "in": "header"}.items() <= parameters[
            -1
        ].items()
    scoring = paths["/invocations"]["post"]
    assert set(scoring["requestBody"]["content"]) == {"application/json", "text/csv"}
    assert {"dataframe_split", "dataframe_records", "instances", "inputs"} <= set(
        scoring["requestBody"]["content"]["application/json"]["schema"]["properties"]
    )
    assert "400" in scoring["responses"] and "200" in scoring["responses"]
    infer = paths["/v2/models/{name}/infer"]["post"]
    assert "inputs" in infer["requestBody"]["content"]["application/json"]["schema"]["properties"]
    assert "InferResponse" in json.dumps(infer["responses"]["200"])

    # The served model in the /v2/models/{name}[/versions/{version}] paths, so that generated
    # bodies reach the model rather than a 404; one worker (hypothesis's lambda descriptions
    # race in threads on Python 3.11: "AST constructor recursion depth mismatch").
    config = tmp_path / "schemathesis.toml"
    config.write_text(f'[parameters]\n"path.name" = "{MODEL}"\n"path.version" = "1"\n')
    command = [sys.executable, "-m", "schemathesis.cli", "--config-file", str(config), "run"]
    command.append(f"{served.url}/openapi.json")
    options = ["--checks", "not_a_server_error", "--max-examples", "25", "--workers", "1"]
    options += ["--phases", "examples,coverage,fuzzing", "--request-timeout", "30"]
    options += ["--seed", "41", "--generation-database", "none", "--no-color"]
    run = subprocess.run(  # in tmp_path: schemathesis keeps a cache in its working directory
        [*command, *options], capture_output=True, text=True, timeout=900, cwd=tmp_path
    )
    assert run.returncode == 0, run.stdout[-6000:]
    counts = re.search(r"(\d+) generated, (\d+) passed", run.stdout)
    assert counts and counts[1] == counts[2] and int(counts[1]) > 200, run.stdout[-3000:]
    # healthy afterwards: the same answers as before the run
    assert httpx.get(f"{served.url}/healthz").json()["status"] == "ok"
    assert _predicted(served.url, ROWS)["model"]["version"] == "1"


def _select(version: str) -> dict[str, str]:
    """The header that selects ``version`` of the model (Ray Serve's multiplexing header)."""
    return {"serve_multiplexed_model_id": f"{MODEL}/{version}"}


def test_several_versions_answer_side_by_side_loaded_on_demand_with_lru_and_a_broken_one_alone_503(
    served: Served, tmp_path: Path
) -> None:
    """Issue 41, part 3: the champion, a challenger (by alias) and pinned versions answer on one
    endpoint by header and by path on every protocol, each with its own model; a replica keeps
    at most max_models_per_replica of them and unloads the least recently used; a version that
    cannot load answers 503 while the others answer on."""
    settings = served.settings
    client = tracking.client_for(settings.resolved_tracking_uri)
    three, four = (
        register_classifier(settings, MODEL, FEATURES, DIGITS.target, seed=seed, alias=None)
        for seed in (2, 5)
    )
    broken = _broken_version(served, _pickle_format, seed=6)
    tracking.set_alias(client, MODEL, "challenger", "2")
    # served as docs/how-to/several-versions.md serves it: at most 2 more versions a replica,
    # of digits-classifier or of another registered model, "wine"
    register_classifier(settings, "wine", FEATURES, DIGITS.target, seed=7, alias=None)
    deployed = serve_several_versions.serve_several_versions(
        port=served.port, replica_cpus=0.25, app_name="versions", route_prefix="/versions"
    )
    assert deployed.version == "1"
    url = f"{served.url}/versions"
    rows = ROWS[:8]

    def loaded() -> dict[str, Any]:
        return httpx.get(f"{url}/metadata").json()["versions"]["loaded"]

    # Each selection answers with its own model: the probabilities of that registered version.
    answers = {
        "1": httpx.post(f"{url}/predict", json={"inputs": rows.tolist()}),
        "2": httpx.post(f"{url}/predict", json={"inputs": rows.tolist()}, headers=_select("2")),
        three: httpx.post(
            f"{url}/models/{MODEL}/versions/{three}/predict", json={"inputs": rows.tolist()}
        ),
    }
    # the versions are different models: their probabilities differ
    assert not np.allclose(
        _local_probabilities(settings, "1", rows),
        _local_probabilities(settings, "2", rows),
        atol=1e-3,
    )
    for version, answer in answers.items():
        assert answer.status_code == 200, (version, answer.text)
        assert answer.json()["model"]["version"] == version
        expected = _local_probabilities(settings, version, rows)
        np.testing.assert_allclose(answer.json()["probabilities"], expected, atol=1e-5)
    assert list(loaded()) == [f"{MODEL}/2", f"{MODEL}/{three}"]
    metadata = httpx.get(f"{url}/metadata").json()
    assert metadata["model"]["version"] == "1"  # the served version is not one of the two
    assert metadata["versions"]["max_models_per_replica"] == 2

    # The challenger by alias, on the OIP path: v2 again, now the most recently used.
    tensor = {"name": "input", "shape": list(rows.shape), "datatype": "FP32"}
    infer = {"inputs": [{**tensor, "data": rows.tolist()}]}
    challenger = httpx.post(f"{url}/v2/models/{MODEL}/versions/challenger/infer", json=infer)
    assert challenger.status_code == 200 and challenger.json()["model_version"] == "2"
    # A third selected version unloads the least recently used one (v3), not the oldest (v2).
    scored = httpx.post(
        f"{url}/models/{MODEL}/versions/{four}/invocations", json={"inputs": rows.tolist()}
    )
    assert scored.status_code == 200, scored.text
    assert set(loaded()) == {f"{MODEL}/2", f"{MODEL}/{four}"}
    after = loaded()
    assert after[f"{MODEL}/2"]["requests"] == 2 and after[f"{MODEL}/{four}"]["requests"] == 1
    again = httpx.post(f"{url}/predict", json={"inputs": rows.tolist()}, headers=_select(three))
    assert again.json()["model"]["version"] == three  # loaded again on demand
    assert set(loaded()) == {f"{MODEL}/{four}", f"{MODEL}/{three}"}

    # A version that cannot load: 503 in each protocol's shape, for that version only.
    for attempt in range(2):  # the second within FAILURE_TTL_S: refused without a new load
        oip = httpx.post(f"{url}/v2/models/{MODEL}/versions/{broken}/infer", json=infer)
        assert oip.status_code == 503 and "cannot be served now" in oip.json()["error"], attempt
        assert "pickle" in oip.json()["error"] and oip.headers["retry-after"] == "30"
        mlflow_answer = httpx.post(
            f"{url}/invocations", json={"inputs": rows.tolist()}, headers=_select(broken)
        )
        assert mlflow_answer.status_code == 503
        assert mlflow_answer.json()["error_code"] == "TEMPORARILY_UNAVAILABLE"
        ready = httpx.get(f"{url}/v2/models/{MODEL}/versions/{broken}/ready")
        assert ready.status_code == 503
        for version, headers in [("1", {}), (three, _select(three)), ("2", _select("2"))]:
            answer = httpx.post(f"{url}/predict", json={"inputs": rows.tolist()}, headers=headers)
            assert answer.status_code == 200 and answer.json()["model"]["version"] == version

    # Unknown versions, aliases and models are 404s; a malformed or contradicting selection 400.
    refusals = [
        ("/predict", _select("99"), 404, "has no version 99"),
        ("/predict", {"serve_multiplexed_model_id": f"{MODEL}@nobody"}, 404, "no alias nobody"),
        ("/predict", {"serve_multiplexed_model_id": "other/1"}, 404, "other is not served here"),
        ("/predict", {"serve_multiplexed_model_id": MODEL}, 400, "names no version"),
        (f"/models/{MODEL}/versions/2/predict", _select(three), 400, "send one"),
    ]
    for route, headers, status, words in refusals:
        answer = httpx.post(f"{url}{route}", json={"inputs": rows.tolist()}, headers=headers)
        assert answer.status_code == status, (route, headers, answer.text)
        assert words in answer.json()["detail"]["message"], answer.text

    # tritonclient selects by the version in the path; metadata and readiness per version.
    triton_client = triton.InferenceServerClient(url=f"127.0.0.1:{served.port}/versions")
    assert triton_client.is_model_ready(MODEL, "2")
    assert not triton_client.is_model_ready(MODEL, broken)
    assert triton_client.get_model_metadata(MODEL, four)["versions"] == [four]
    triton_client.close()

    # The selected version answers through /invocations and OIP with the classes that
    # `mlflow models predict` gives on the same registered version.
    by_mlflow = [str(c) for c in _mlflow_models_predict(served, "2", rows, tmp_path).argmax(axis=1)]
    invocations = httpx.post(
        f"{url}/invocations", json={"inputs": rows.tolist()}, headers=_select("2")
    )
    assert invocations.json() == {"predictions": by_mlflow}
    oip = httpx.post(f"{url}/v2/models/{MODEL}/versions/2/infer", json=infer).json()
    assert oip["outputs"][0]["name"] == "label" and oip["outputs"][0]["data"] == by_mlflow

    # The page's clients (examples/version_clients.py) as a user runs them, and a version of
    # the other model selected the same way.
    server = f"127.0.0.1:{served.port}/versions"
    pinned = version_clients.predict_by_header(server, rows, "2")
    assert pinned["model"]["version"] == "2"
    expected = _local_probabilities(settings, "2", rows)
    np.testing.assert_allclose(pinned["probabilities"], expected, atol=1e-5)
    assert version_clients.invoke_by_url(server, rows, "2") == by_mlflow
    assert version_clients.infer_with_triton(server, rows, "challenger") == by_mlflow
    with pytest.raises(RuntimeError, match=f"version {broken} cannot be served now"):
        version_clients.infer_with_triton(server, rows, broken)
    wine = version_clients.predict_by_header(server, rows, "1", model="wine")
    assert (wine["model"]["name"], wine["model"]["version"]) == ("wine", "1")
    assert wine["probabilities"] != pinned["probabilities"]  # another model answered

    log = _replica_log("versions")
    for line in (
        "POST /versions/predict 200",
        "POST /versions/models/{name}/versions/{version}/invocations 200",
        "POST /versions/v2/models/{name}/versions/{version}/infer 503",
        "POST /versions/invocations 503",
    ):
        assert line in log, line
    serve.delete("versions")
