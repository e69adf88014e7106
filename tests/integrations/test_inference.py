"""Serving's forward pass and its device: runs where only torch, numpy and pydantic exist."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from prefect_ml.integrations.datasets import build_model
from prefect_ml.integrations.errors import ConfigurationError
from prefect_ml.integrations.serving import Predictor, serving_device

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _model_and_rows() -> tuple[torch.nn.Module, np.ndarray]:
    torch.manual_seed(0)
    model = build_model("cnn", [1, 8, 8], 10, {}).eval()
    rows = np.random.default_rng(0).normal(size=(33, 64)).astype(np.float32)
    return model, rows


@pytest.mark.parametrize(
    ("reserved", "cuda", "expected"),
    [(0.0, False, "cpu"), (0.0, True, "cpu"), (0.25, True, "cuda:0"), (2.0, True, "cuda:0")],
)
def test_a_replica_computes_on_the_gpu_it_reserved(
    reserved: float, cuda: bool, expected: str
) -> None:
    assert serving_device(reserved, cuda) == torch.device(expected)


def test_a_gpu_replica_where_torch_sees_no_gpu_is_refused_not_run_on_the_cpu() -> None:
    with pytest.raises(ConfigurationError, match="serving.replica_gpus.*sees no CUDA device"):
        serving_device(1.0, cuda_available=False)


def test_cpu_predictor_returns_the_models_softmax_in_its_sample_shape() -> None:
    model, rows = _model_and_rows()
    predictor = Predictor(model, [1, 8, 8], torch.device("cpu"))
    with torch.no_grad():
        expected = torch.softmax(model(torch.from_numpy(rows).reshape(-1, 1, 8, 8)), dim=1)
    found = predictor.probabilities(rows)
    assert found.dtype == np.float32 and found.shape == (33, 10)
    np.testing.assert_allclose(found, expected.numpy(), atol=1e-6)
    assert predictor.describe().type == "cpu" and predictor.describe().precision == "fp32"


def test_a_regression_predictor_returns_values_and_feeds_a_float64_model_float64() -> None:
    """A tabular model is logged behind a float64-to-float32 cast (``taking_float64``)."""
    from prefect_ml.integrations.datasets import taking_float64, with_target_scale

    torch.manual_seed(0)
    network = build_model("mlp", [5], 1, {"hidden": 8}).eval()
    model = taking_float64(with_target_scale(network, mean=150.0, std=70.0))
    batch = ({0: torch.export.Dim("batch")},)
    example = (torch.zeros(2, 5, dtype=torch.float64),)
    exported = torch.export.export(model, example, dynamic_shapes=batch).module()
    rows = np.random.default_rng(1).normal(size=(7, 5)).astype(np.float32)
    predictor = Predictor(
        exported, [5], torch.device("cpu"), task="regression", input_dtype="float64"
    )
    found = predictor.outputs(rows)
    with torch.no_grad():
        expected = network(torch.from_numpy(rows)).numpy() * 70.0 + 150.0
    assert found.shape == (7, 1)
    np.testing.assert_allclose(found, expected, rtol=1e-5)
    with pytest.raises(RuntimeError):  # the exported graph takes float64 only
        Predictor(exported, [5], torch.device("cpu"), task="regression").outputs(rows)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_gpu_predictor_holds_the_model_on_the_gpu_and_agrees_with_the_cpu(precision: str) -> None:
    model, rows = _model_and_rows()
    expected = Predictor(model, [1, 8, 8], torch.device("cpu")).probabilities(rows)
    predictor = Predictor(model, [1, 8, 8], torch.device("cuda", 0), precision)  # type: ignore[arg-type]
    assert all(p.device.type == "cuda" for p in predictor.model.parameters())
    found = predictor.probabilities(rows)
    assert found.dtype == np.float32
    np.testing.assert_allclose(found, expected, atol=1e-4 if precision == "fp32" else 3e-2)
    description = predictor.describe()
    assert description.type == "cuda:0" and description.name == torch.cuda.get_device_name(0)
