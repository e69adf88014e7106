from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from prefect_ml.integrations.datasets import (
    build_model,
    load_dataset,
    resolve_dataset,
    resolve_model,
    with_standardizer,
)
from prefect_ml.integrations.errors import ConfigurationError


def test_digits_is_image_shaped() -> None:
    digits = load_dataset("digits", {})
    assert digits.features.shape == (1797, 1, 8, 8)
    assert digits.features.dtype == np.float32
    assert sorted(set(digits.labels.tolist())) == list(range(10))


@pytest.mark.parametrize("suffix", ["csv", "parquet"])
def test_tabular_reads_csv_and_parquet(tmp_path: Path, suffix: str) -> None:
    frame = pd.DataFrame({"a": [1.0, 2.0, 3.0, 4.0], "b": [0, 1, 0, 1], "species": list("xyxz")})
    path = tmp_path / f"data.{suffix}"
    frame.to_csv(path, index=False) if suffix == "csv" else frame.to_parquet(path)
    data = load_dataset("tabular", {"url": path.as_uri(), "label_column": "species"})
    assert data.features.shape == (4, 2)
    assert data.class_names == ["x", "y", "z"]
    assert data.labels.tolist() == [0, 1, 0, 2]


def test_tabular_missing_label_column_names_the_field(tmp_path: Path) -> None:
    path = tmp_path / "data.csv"
    pd.DataFrame({"a": [1.0], "b": [2.0]}).to_csv(path, index=False)
    with pytest.raises(ConfigurationError) as error:
        load_dataset("tabular", {"url": path.as_uri(), "label_column": "label"})
    assert error.value.field == "data.label_column"
    # The file's column count, never its header (a glob may reach a file of secrets).
    assert "which has 2 columns" in str(error.value) and "--label-column" in str(error.value)
    assert "'a'" not in str(error.value) and "'b'" not in str(error.value)


def test_tabular_rejects_text_features(tmp_path: Path) -> None:
    path = tmp_path / "data.csv"
    pd.DataFrame({"name": ["p", "q"], "y": [0, 1]}).to_csv(path, index=False)
    with pytest.raises(ConfigurationError, match="not numeric"):
        load_dataset("tabular", {"url": path.as_uri(), "label_column": "y"})


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("resnet", "unknown model 'resnet'"),
        ("no_such_package.models:build", "is not allowed"),
        ("tests.fixtures.no_such_module:build", "cannot import module 'tests.fixtures.no_such"),
        ("tests.fixtures.user_code:missing", "has no attribute 'missing'"),
        ("tests.fixtures.user_code:NOT_CALLABLE", "is not callable"),
        ("tests.fixtures.user_code:wrong_signature", "must accept ['input_shape', 'num_classes']"),
        ("tests.fixtures.user_code", "unknown model"),
    ],
)
def test_bad_model_names_fail_with_a_clear_message(name: str, message: str) -> None:
    with pytest.raises(ConfigurationError) as error:
        resolve_model(name)
    assert error.value.field == "model.model"
    assert message in str(error.value)


def test_user_dataset_with_unknown_option_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="does not accept"):
        resolve_dataset("tests.fixtures.user_code:blobs", {"colour": "red"})


def test_user_code_by_import_path() -> None:
    data = load_dataset("tests.fixtures.user_code:blobs", {"rows": 30})
    assert data.features.shape == (30, 6) and data.class_names == ["0", "1", "2"]
    model = build_model(
        "tests.fixtures.user_code:linear_model", (6,), 3, {"bias": False, "hidden": 9}
    )
    assert model(torch.zeros(2, 6)).shape == (2, 3)


@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_builtin_models_give_logits(name: str) -> None:
    model = build_model(
        name, (1, 8, 8), 10, {"hidden": 16, "depth": 3, "channels": 4, "dropout": 0.0}
    )
    assert model(torch.zeros(5, 1, 8, 8)).shape == (5, 10)


def test_cnn_refuses_flat_inputs() -> None:
    with pytest.raises(ConfigurationError, match="image-shaped"):
        build_model("cnn", (64,), 10, {})


def test_standardizer_computes_z_scores_with_builtin_modules() -> None:
    mean = np.arange(6, dtype=np.float32).reshape(1, 2, 3)
    std = np.full((1, 2, 3), 2.0, dtype=np.float32)
    model = with_standardizer(torch.nn.Identity(), mean, std, (1, 2, 3))
    raw = torch.randn(4, 1, 2, 3)
    expected = (raw - torch.from_numpy(mean)) / 2.0
    assert torch.allclose(model(raw), expected, atol=1e-5)
    assert all(type(m).__module__.startswith("torch.") for m in model.modules())
