"""The wire protocols' translations, without a server: every format of MLflow's scoring
protocol and of the Open Inference Protocol v2 becomes the same rows in the model's order, the
answers have each protocol's shape, and a malformed body gets that protocol's 4xx."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pandas as pd
import pytest
from mlflow.utils.proto_json_utils import dump_input_data
from tritonclient.http import InferInput, InferRequestedOutput
from tritonclient.http._utils import _get_inference_request

from prefect_ml.integrations.serving import (
    MlflowScoring,
    OpenInference,
    RequestError,
    ServedModel,
    model_metadata,
)

ROWS = np.array([[0.0, 1.5, 2.0, 3.0], [4.0, 5.0, 6.25, 7.0], [8.0, 9.0, 10.0, 11.0]], np.float32)
NAMES = ["b", "a", "d", "c"]  # the model's own order, not sorted


def _model(**update: Any) -> ServedModel:
    base = {"name": "m", "version": "3", "run_id": "r", "tracking_uri": "sqlite://"}
    return ServedModel(**{**base, "sample_shape": [4], "class_names": ["x", "y"], **update})


UNNAMED, NAMED = _model(), _model(feature_names=NAMES)


def _scored(body: str | bytes, served: ServedModel, content_type: str = "application/json") -> Any:
    raw = body.encode() if isinstance(body, str) else body
    return MlflowScoring().parse(raw, content_type, served).matrix


def _frame(served: ServedModel, order: list[int]) -> pd.DataFrame:
    """The rows as a pandas frame whose columns are in ``order`` (not the model's)."""
    columns = served.feature_names or [str(i) for i in range(4)]
    return pd.DataFrame(ROWS[:, order], columns=[columns[i] for i in order])


@pytest.mark.parametrize("served", [UNNAMED, NAMED], ids=["feature vectors", "named columns"])
def test_every_mlflow_format_gives_the_rows_in_the_models_column_order(served: ServedModel) -> None:
    shuffled = _frame(served, [2, 0, 3, 1])
    records = json.dumps({"dataframe_records": shuffled.to_dict(orient="records")})
    bodies = {
        # what MLflow's own client sends for a frame and for an array
        "client frame": dump_input_data(shuffled),
        "client array": dump_input_data(ROWS),
        "dataframe_split": json.dumps({"dataframe_split": shuffled.to_dict(orient="split")}),
        "dataframe_split without columns": json.dumps({"dataframe_split": {"data": ROWS.tolist()}}),
        "dataframe_records": records,
        "instances": json.dumps({"instances": ROWS.tolist()}),
        "instances of records": records.replace("dataframe_records", "instances"),
        "inputs": json.dumps({"inputs": ROWS.tolist(), "params": {"ignored": 1}}),
        "inputs as columns": json.dumps({"inputs": shuffled.to_dict(orient="list")}),
        "inputs nested": json.dumps({"inputs": ROWS.reshape(3, 2, 2).tolist()}),
    }
    for case, body in bodies.items():
        np.testing.assert_array_equal(_scored(body, served), ROWS, err_msg=case)
    csv = shuffled.to_csv(index=False)
    np.testing.assert_array_equal(_scored(csv, served, "text/csv; charset=utf-8"), ROWS)
    if served is UNNAMED:  # pandas names a matrix's columns 0, 1, ...: the model's positions
        np.testing.assert_array_equal(_scored(dump_input_data(pd.DataFrame(ROWS)), served), ROWS)


def _mlflow_error(body: str | bytes, content_type: str = "application/json") -> tuple[int, str]:
    protocol = MlflowScoring()
    raw = body.encode() if isinstance(body, str) else body
    with pytest.raises(RequestError) as refused:
        protocol.parse(raw, content_type, NAMED)
    status, content, media_type = protocol.error(refused.value)
    if status == 415:
        assert media_type == "text/plain"
        return status, content
    assert media_type == "application/json"
    answer = json.loads(content)
    assert set(answer) == {"error_code", "message"}
    return status, f"{answer['error_code']}: {answer['message']}"


@pytest.mark.parametrize(
    ("body", "content_type", "status", "words"),
    [
        ('{"inputs": [[1, 2, 3, 4]], "instances": [[1, 2, 3, 4]]}', None, 400, "exactly one"),
        ('{"params": {}}', None, 400, "exactly one of the input fields"),
        ("[[1, 2, 3, 4]]", None, 400, "should be an object"),
        ("inputs=1", None, 400, "BAD_REQUEST: the body is not valid JSON"),
        ('{"inputs": [[1, 2, 3]]}', None, 400, "expected 4 features, got 3"),
        ('{"inputs": [[1, 2, 3, NaN]]}', None, 400, "finite"),
        ('{"inputs": [[1, 2, 3, true]]}', None, 400, "valid number"),
        ('{"inputs": []}', None, 400, "no rows"),
        ('{"inputs": [[[1, 2], [3]]]}', None, 400, "different lengths"),
        ('{"dataframe_records": [{"a": 1, "b": 2, "c": 3}]}', None, 400, "missing ['d']"),
        (
            json.dumps({"dataframe_split": {"columns": [*"abcde"], "data": [[1, 2, 3, 4, 5]]}}),
            None,
            400,
            "unexpected ['e']",
        ),
        (
            '{"dataframe_split": {"columns": ["a", "b", "c", "d"], "data": [[1, 2]]}}',
            None,
            400,
            "2 values for 4 columns",
        ),
        ('{"inputs": {"a": [1], "b": [2], "c": [3], "d": [4, 5]}}', None, 400, "different numbers"),
        ("a,b,c,d\n1,2,3,x\n", "text/csv", 400, "CSV row 1: a value is not a number"),
        ("a,b,c,d\n1,2,3,1e39\n", "text/csv", 400, "not a finite float32"),
        ("", "text/csv", 400, "empty"),
        (b"a,b,c,d\n\xff", "text/csv", 400, "UTF-8"),
        ('{"inputs": [[1, 2, 3, 4]]}', "text/plain", 415, "only supports the following content"),
        (
            '{"inputs": [[1, 2, 3, 4]]}',
            "application/json; charset=latin-1",
            415,
            "only supports UTF-8",
        ),
        (
            '{"inputs": [[1, 2, 3, 4]]}',
            "application/json; format=pandas-split",
            415,
            "Unrecognized",
        ),
        ('{"inputs": [[1, 2, 3, 4]]}', "", 415, "content types"),
    ],
)
def test_a_malformed_mlflow_request_gets_mlflows_error_shape(
    body: str | bytes, content_type: str | None, status: int, words: str
) -> None:
    got_status, message = _mlflow_error(
        body, "application/json" if content_type is None else content_type
    )
    assert got_status == status and words in message, message


def test_mlflow_answers_one_class_or_value_per_row_and_a_nan_is_a_500() -> None:
    protocol = MlflowScoring()
    identity = {"name": "m", "version": "3", "run_id": "r"}
    scoring = protocol.parse(b'{"inputs": [[1, 2, 3, 4]]}', "application/json", UNNAMED)
    answer = protocol.render(np.array([[0.2, 0.8], [0.9, 0.1]]), UNNAMED, identity, scoring)
    assert json.loads(answer) == {"predictions": ["y", "x"]}
    regression = _model(task="regression", class_names=None)
    values = protocol.render(np.array([[1.5], [-2.0]]), regression, identity, scoring)
    assert json.loads(values) == {"predictions": [1.5, -2.0]}
    with pytest.raises(RequestError) as failed:
        protocol.render(np.array([[np.nan, 1.0]]), UNNAMED, identity, scoring)
    status, content, _media = protocol.error(failed.value)
    assert status == 500 and json.loads(content)["error_code"] == "INTERNAL_ERROR"


def _triton_body(
    inputs: list[InferInput], outputs: list[InferRequestedOutput] | None = None, **kwargs: Any
) -> tuple[bytes, str | None]:
    """The body and Inference-Header-Content-Length that tritonclient's HTTP client sends."""
    body, header = _get_inference_request(
        inputs=inputs,
        request_id=kwargs.get("request_id", ""),
        outputs=outputs,
        sequence_id=0,
        sequence_start=False,
        sequence_end=False,
        priority=0,
        timeout=None,
        custom_parameters=None,
    )
    return body, None if header is None else str(header)


def _triton_input(name: str, array: np.ndarray, datatype: str, binary: bool) -> InferInput:
    tensor = InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array, binary_data=binary)
    return tensor


def _infer(body: bytes, header: str | None, served: ServedModel = UNNAMED) -> np.ndarray:
    return OpenInference(header).parse(body, "application/json", served).matrix


@pytest.mark.parametrize("binary", [False, True], ids=["JSON data", "binary data"])
@pytest.mark.parametrize(
    ("datatype", "dtype"), [("FP32", np.float32), ("FP64", np.float64), ("INT64", np.int64)]
)
def test_tritonclients_requests_give_the_rows(binary: bool, datatype: str, dtype: Any) -> None:
    rows = np.round(ROWS).astype(dtype)
    body, header = _triton_body([_triton_input("input", rows, datatype, binary)])
    np.testing.assert_array_equal(_infer(body, header), rows.astype(np.float32))
    # a sample of several dimensions, e.g. 2x2 pixels: row-major
    images = _model(sample_shape=[1, 2, 2])
    body, header = _triton_body(
        [_triton_input("input", rows.reshape(3, 1, 2, 2), datatype, binary)]
    )
    np.testing.assert_array_equal(_infer(body, header, images), rows.astype(np.float32))


def test_oip_takes_nested_data_and_one_input_per_named_column() -> None:
    nested = {
        "inputs": [{"name": "input", "shape": [3, 4], "datatype": "FP32", "data": ROWS.tolist()}]
    }
    np.testing.assert_array_equal(_infer(json.dumps(nested).encode(), None), ROWS)
    columns = [  # in another order than the model's
        _triton_input(name, ROWS[:, NAMES.index(name)].reshape(3, 1), "FP32", False)
        for name in sorted(NAMES)
    ]
    body, header = _triton_body(columns)
    np.testing.assert_array_equal(_infer(body, header, NAMED), ROWS)
    metadata = model_metadata(NAMED)
    assert metadata["inputs"][0] == {"name": "input", "datatype": "FP32", "shape": [-1, 4]}
    assert [tensor["name"] for tensor in metadata["inputs"][1:]] == NAMES
    assert metadata["outputs"] == [
        {"name": "label", "datatype": "BYTES", "shape": [-1]},
        {"name": "probabilities", "datatype": "FP32", "shape": [-1, 2]},
    ]
    assert metadata["versions"] == ["3"] and metadata["name"] == "m"


def test_oip_answers_the_outputs_asked_for_with_the_request_id() -> None:
    protocol = OpenInference()
    identity = {"name": "m", "version": "3", "run_id": "r"}
    outputs = np.array([[0.25, 0.75], [0.5, 0.5], [1.0, 0.0]], np.float32)
    body, _ = _triton_body(
        [_triton_input("input", ROWS, "FP32", False)],
        [InferRequestedOutput("label", binary_data=False)],
        request_id="req-7",
    )
    scoring = protocol.parse(body, "", UNNAMED)
    answer = json.loads(protocol.render(outputs, UNNAMED, identity, scoring))
    assert answer == {
        "model_name": "m",
        "model_version": "3",
        "id": "req-7",
        "outputs": [{"name": "label", "shape": [3], "datatype": "BYTES", "data": ["y", "x", "x"]}],
    }
    every = protocol.parse(
        json.dumps({"inputs": [json.loads(body)["inputs"][0]]}).encode(), "", UNNAMED
    )
    answer = json.loads(protocol.render(outputs, UNNAMED, identity, every))
    assert [o["name"] for o in answer["outputs"]] == [
        "label",
        "probabilities",
    ] and "id" not in answer
    assert answer["outputs"][1] == {
        "name": "probabilities",
        "shape": [3, 2],
        "datatype": "FP32",
        "data": [0.25, 0.75, 0.5, 0.5, 1.0, 0.0],
    }
    regression = _model(task="regression", class_names=None)
    values = json.loads(
        protocol.render(np.array([[1.5], [2.0], [3.0]]), regression, identity, every)
    )
    assert values["outputs"] == [
        {"name": "value", "shape": [3], "datatype": "FP64", "data": [1.5, 2.0, 3.0]}
    ]


def _oip_request(**tensor: Any) -> bytes:
    base = {"name": "input", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}
    return json.dumps({"inputs": [{**base, **tensor}]}).encode()


@pytest.mark.parametrize(
    ("body", "header", "words"),
    [
        (_oip_request(datatype="BYTES"), None, "input 'input': datatype 'BYTES'"),
        (_oip_request(shape=[1, 5]), None, "input 'input': 4 values for shape [1, 5]"),
        (_oip_request(shape=[2, 2]), None, "input 'input': shape [2, 2]; this model takes [-1, 4]"),
        (_oip_request(shape=[1, -4]), None, "negative dimension"),
        (_oip_request(data=[[1, 2], [3, 4]]), None, "nested data of shape [2, 2], not [1, 4]"),
        (_oip_request(data=[[1, 2], [3]]), None, "different lengths"),
        (_oip_request(data=[1, 2, 3, "x"]), None, "input 'input': the body does not match"),
        (_oip_request(data=[1, 2, 3, 1e39]), None, "input 'input'"),
        (_oip_request(datatype="INT32", data=[1, 2, 3, 4.5]), None, "INT32 data holds a fraction"),
        (_oip_request(data=None), None, "input 'input': no data"),
        (
            _oip_request(name="pixels"),
            None,
            "inputs ['pixels']; this model takes one input 'input'",
        ),
        (json.dumps({"inputs": []}).encode(), None, "inputs"),
        (b"{", None, "not valid JSON"),
        (
            json.dumps(
                {"inputs": json.loads(_oip_request())["inputs"], "outputs": [{"name": "logits"}]}
            ).encode(),
            None,
            "unknown output(s) ['logits']",
        ),
        (_oip_request(), "9999", "Inference-Header-Content-Length '9999'"),
        (
            _oip_request(data=None, parameters={"binary_data_size": 16}),
            str(len(_oip_request(data=None, parameters={"binary_data_size": 16}))),
            "binary_data_size 16 is not in the body",
        ),
    ],
)
def test_a_malformed_inference_request_gets_a_400_naming_the_input(
    body: bytes, header: str | None, words: str
) -> None:
    protocol = OpenInference(header)
    with pytest.raises(RequestError) as refused:
        protocol.parse(body, "application/json", UNNAMED)
    status, content, media_type = protocol.error(refused.value)
    assert (status, media_type) == (400, "application/json")
    assert list(json.loads(content)) == ["error"] and words in json.loads(content)["error"]
