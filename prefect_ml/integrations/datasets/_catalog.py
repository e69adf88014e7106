"""Datasets and models by short name or by ``package.module:factory`` import path.

What user code implements, a dataset loader and a model factory, is stated in
:mod:`integrations.contracts` (:class:`DatasetLoader`, :class:`ModelFactory`).

Both are resolved and checked (allowed, importable, callable, right signature) while parameters
are parsed, before any compute starts. User code is allowed by :mod:`integrations.plugins`: a
registered entry point or a module under ``PREFECT_ML_ALLOWED_MODULES``; nothing else is imported.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from prefect_ml.integrations import plugins, storage
from prefect_ml.integrations.contracts import DatasetLoader, ModelFactory
from prefect_ml.integrations.datasets import _tabular_files
from prefect_ml.integrations.errors import ConfigurationError

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class DatasetArrays:
    """A whole dataset in memory: float32 features and the labels of its task type: int64
    class ids with their names (classification), or float32 target values (regression, no
    class names).

    ``feature_names`` names the columns of a tabular dataset; serving accepts rows by name. The
    built-in loaders return their raw labels here; :func:`load_dataset` turns them into the
    task's.
    """

    features: np.ndarray
    labels: np.ndarray
    class_names: list[str]
    feature_names: list[str] | None = None

    @property
    def sample_shape(self) -> tuple[int, ...]:
        return tuple(int(d) for d in self.features.shape[1:])


def load_digits_dataset() -> DatasetArrays:
    """scikit-learn's bundled 8x8 digits (1,797 images, 10 classes) as ``(n, 1, 8, 8)``."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    features = bunch.images.astype(np.float32)[:, None, :, :]
    return DatasetArrays(features, bunch.target.astype(np.int64), [])


def load_tabular_dataset(url: str, label_column: str) -> DatasetArrays:
    """CSV or Parquet files at any fsspec URL (a file, a directory, a glob), read whole; every
    column but ``label_column`` is a feature. Data too big for that is streamed instead (see
    ``tasks.data``)."""
    import pandas as pd

    source = _tabular_files.describe_source(url, label_column)
    frames = []
    for file in source.files:
        with storage.open_file(file.url) as handle:
            read = pd.read_parquet if source.format == "parquet" else pd.read_csv
            frames.append(read(handle))
    frame = pd.concat(frames, ignore_index=True) if len(frames) > 1 else frames[0]
    feature_frame = frame.drop(columns=[label_column])
    non_numeric = [c for c in feature_frame.columns if not pd.api.types.is_numeric_dtype(frame[c])]
    if non_numeric:
        raise ConfigurationError(
            "data.url", f"feature columns {non_numeric} are not numeric; encode or drop them"
        )
    return DatasetArrays(
        feature_frame.to_numpy(dtype=np.float32),
        frame[label_column].to_numpy(),
        [],
        [str(c) for c in feature_frame.columns],
    )


def build_mlp(
    input_shape: Sequence[int],
    num_classes: int,
    *,
    hidden: int = 128,
    depth: int = 2,
    dropout: float = 0.1,
) -> torch.nn.Module:
    """A multilayer perceptron: ``depth`` hidden layers of ``hidden`` units, ReLU, dropout."""
    from torch import nn

    layers: list[nn.Module] = [nn.Flatten()]
    width = int(np.prod(input_shape))
    for _ in range(depth):
        layers += [nn.Linear(width, hidden), nn.ReLU(), nn.Dropout(dropout)]
        width = hidden
    layers.append(nn.Linear(width, num_classes))
    return nn.Sequential(*layers)


def build_cnn(
    input_shape: Sequence[int],
    num_classes: int,
    *,
    channels: int = 32,
    dropout: float = 0.1,
) -> torch.nn.Module:
    """A small conv net for image-shaped inputs ``(C, H, W)``: two conv blocks, a linear head."""
    from torch import nn

    if len(input_shape) != 3:
        raise ConfigurationError(
            "model.model",
            f"cnn needs image-shaped samples (C, H, W) but the dataset gives {tuple(input_shape)}; "
            "use --model mlp",
        )
    in_channels = int(input_shape[0])
    return nn.Sequential(
        nn.Conv2d(in_channels, channels, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(channels, channels * 2, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(2),
        nn.Flatten(),
        nn.Dropout(dropout),
        nn.Linear(channels * 2 * 4, num_classes),
    )


BUILTIN_DATASETS: dict[str, Callable[..., Any]] = {
    "digits": load_digits_dataset,
    "tabular": load_tabular_dataset,
}
BUILTIN_MODELS: dict[str, Callable[..., Any]] = {"mlp": build_mlp, "cnn": build_cnn}


def import_callable(path: str, *, group: str, field: str) -> Callable[..., Any]:
    """Import ``package.module:attribute``, if :mod:`integrations.plugins` allows it, and check
    that it is callable."""
    module_name, attribute = plugins.check_allowed(path, group=group, field=field)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigurationError(
            field,
            f"cannot import module {module_name!r} ({exc}); install it or put it on PYTHONPATH",
        ) from exc
    target = getattr(module, attribute, None)
    if target is None:
        raise ConfigurationError(field, f"module {module_name!r} has no attribute {attribute!r}")
    if not callable(target):
        raise ConfigurationError(field, f"{path!r} is not callable; point it at a function")
    defined_in = getattr(target, "__module__", None)
    plugins.check_defined_in_allowed_module(path, defined_in, group=group, field=field)
    return target  # type: ignore[no-any-return]


def _user_callable(name: str, *, group: str, field: str) -> Callable[..., Any] | None:
    """The plug-in registered as ``name`` or the code at import path ``name``; None if ``name``
    is neither."""
    registered = plugins.registered(group)
    if name in registered:
        return import_callable(registered[name], group=group, field=field)
    if ":" in name:
        return import_callable(name, group=group, field=field)
    return None


def _check_accepts(target: Callable[..., Any], names: Sequence[str], *, field: str) -> None:
    signature = inspect.signature(target)
    params = signature.parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return
    missing = [n for n in names if n not in params]
    if missing:
        raise ConfigurationError(
            field,
            f"{getattr(target, '__qualname__', target)}{signature} does not accept {missing}; "
            f"its signature must accept {list(names)}",
        )


def _check_no_other_required(
    target: Callable[..., Any], given: Sequence[str], *, field: str
) -> None:
    required = [
        p.name
        for p in inspect.signature(target).parameters.values()
        if p.default is p.empty
        and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        and p.name not in given
    ]
    if required:
        raise ConfigurationError(
            field,
            f"{getattr(target, '__qualname__', target)} requires {required}, which are not given",
        )


def resolve_dataset(name: str, options: dict[str, Any] | None = None) -> DatasetLoader:
    """The dataset loader for a built-in name, a plug-in or an allowed import path, checked
    against ``options``."""
    options = options or {}
    loader = BUILTIN_DATASETS.get(name) or _user_callable(
        name, group=plugins.DATASET_GROUP, field="data.dataset"
    )
    if loader is None:
        raise ConfigurationError(
            "data.dataset",
            f"unknown dataset {name!r}; use one of {sorted(BUILTIN_DATASETS)}, a plug-in of "
            f"{sorted(plugins.registered(plugins.DATASET_GROUP))} "
            "or an import path 'package.module:loader'",
        )
    _check_accepts(loader, list(options), field="data.dataset")
    _check_no_other_required(loader, list(options), field="data.dataset")
    return loader


def resolve_model(name: str, user_options: Sequence[str] = ()) -> ModelFactory:
    """The model factory for a built-in name, a plug-in or an allowed import path, with its
    signature checked.

    ``user_options`` are option names the user passed explicitly: each must be accepted by the
    factory, so a typo fails here instead of being silently dropped.
    """
    if name in BUILTIN_MODELS:
        _check_accepts(BUILTIN_MODELS[name], list(user_options), field="model.model_options")
        return BUILTIN_MODELS[name]
    factory = _user_callable(name, group=plugins.MODEL_GROUP, field="model.model")
    if factory is None:
        raise ConfigurationError(
            "model.model",
            f"unknown model {name!r}; use one of {sorted(BUILTIN_MODELS)}, a plug-in of "
            f"{sorted(plugins.registered(plugins.MODEL_GROUP))} "
            "or an import path 'package.module:factory'",
        )
    _check_accepts(factory, ["input_shape", "num_classes"], field="model.model")
    _check_accepts(factory, list(user_options), field="model.model_options")
    return factory


def explicit_parameters(target: Callable[..., Any]) -> set[str]:
    """The keyword parameters ``target``'s signature names (not those a ``**kwargs`` takes)."""
    return {
        p.name
        for p in inspect.signature(target).parameters.values()
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    }


def accepted_options(target: Callable[..., Any], options: dict[str, Any]) -> dict[str, Any]:
    """The subset of ``options`` that ``target`` accepts by keyword."""
    params = inspect.signature(target).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return dict(options)
    return {k: v for k, v in options.items() if k in params}


def load_dataset(name: str, options: dict[str, Any], task: str = "classification") -> DatasetArrays:
    """Load a dataset through its loader, with the labels of ``task``: class ids (the sorted
    unique values become classes 0..k-1) or numeric targets."""
    result = resolve_dataset(name, options)(**options)
    if isinstance(result, DatasetArrays):
        features, raw, feature_names = result.features, result.labels, result.feature_names
    else:
        try:
            features, raw = result
        except (TypeError, ValueError) as exc:
            raise ConfigurationError(
                "data.dataset", f"{name} must return (features, labels) arrays, got {type(result)}"
            ) from exc
        feature_names = None
    where = (
        ("data.label_column", f"column {options.get('label_column')!r}")
        if name == "tabular"
        else ("data.dataset", f"the labels of {name}")
    )
    labels, class_names = task_labels(np.asarray(raw), task, field=where[0], what=where[1])
    return DatasetArrays(np.asarray(features, dtype=np.float32), labels, class_names, feature_names)


def task_labels(
    raw: np.ndarray, task: str, *, field: str, what: str
) -> tuple[np.ndarray, list[str]]:
    """``(labels, class_names)`` of ``raw`` labels for ``task``.

    Raises:
        ConfigurationError: a regression target with missing or non-numeric values, naming
            ``what`` (the column) and how many rows.
    """
    if task == "classification":
        classes, ids = np.unique(raw, return_inverse=True)
        return ids.astype(np.int64), [str(c) for c in classes]
    import pandas as pd

    values = pd.to_numeric(pd.Series(raw.reshape(-1)), errors="coerce").to_numpy(np.float64)
    bad = np.flatnonzero(~np.isfinite(values))
    if bad.size:
        raise ConfigurationError(
            field,
            f"the regression target ({what}) is not a number in {bad.size} of {values.size} "
            f"rows (missing, NaN, infinite or text), e.g. rows {bad[:5].tolist()}; drop or "
            "fill those rows, or use --task classification for class labels",
        )
    return values.astype(np.float32), []


def build_model(
    name: str, input_shape: Sequence[int], num_classes: int, options: dict[str, Any]
) -> torch.nn.Module:
    """Build a model from the catalog, passing only the options its factory accepts."""
    factory = resolve_model(name)
    return factory(tuple(input_shape), num_classes, **accepted_options(factory, options))  # type: ignore[no-any-return]


CHECKPOINTING_HOOK = "gradient_checkpointing_enable"


def check_gradient_checkpointing(model: torch.nn.Module) -> None:
    """Refuse a model that has no way to checkpoint its activations."""
    from torch import nn

    if not (isinstance(model, nn.Sequential) or callable(getattr(model, CHECKPOINTING_HOOK, None))):
        raise ConfigurationError(
            "training.gradient_checkpointing",
            f"{type(model).__name__} is not an nn.Sequential and has no {CHECKPOINTING_HOOK}(); "
            "define that method on the model (see the catalog docs) or drop "
            "--gradient-checkpointing",
        )


def enable_gradient_checkpointing(model: torch.nn.Module) -> torch.nn.Module:
    """Make ``model`` keep only segment boundaries in forward and recompute the rest in backward.

    A model's own ``gradient_checkpointing_enable()`` wins. An ``nn.Sequential`` (every built-in
    model) runs as ``checkpoint_sequential`` in about sqrt(len) segments, which minimises the
    activations held (boundaries plus one segment being recomputed). Only ``forward`` changes:
    parameter names, the state dict and the logged model stay those of the plain model.
    """
    import functools
    import math

    check_gradient_checkpointing(model)
    hook = getattr(model, CHECKPOINTING_HOOK, None)
    if callable(hook):
        hook()
        return model
    segments = max(1, math.isqrt(len(model)))  # type: ignore[arg-type]
    model.forward = functools.partial(_checkpointed_forward, model, segments)  # type: ignore[method-assign,arg-type]
    return model


def _checkpointed_forward(model: torch.nn.Sequential, segments: int, x: torch.Tensor) -> Any:
    import torch
    from torch.utils.checkpoint import checkpoint_sequential

    if not (model.training and torch.is_grad_enabled()):  # nothing to save: run it plainly
        for module in model:
            x = module(x)
        return x
    return checkpoint_sequential(model, segments, x, use_reentrant=False)


def with_standardizer(
    model: torch.nn.Module, mean: np.ndarray, std: np.ndarray, sample_shape: Sequence[int]
) -> torch.nn.Module:
    """``model`` preceded by the training split's standardisation, built from torch's own modules.

    An eval-mode ``BatchNorm1d`` whose running statistics are the training mean and variance
    computes ``(x - mean) / std`` exactly; using it (not a custom class) keeps the logged model
    loadable by ``mlflow models serve`` without any of this project's code.
    """
    import torch
    from torch import nn

    width = int(np.prod(sample_shape))
    norm = nn.BatchNorm1d(width, eps=1e-12, affine=False)
    assert norm.running_mean is not None and norm.running_var is not None
    with torch.no_grad():
        norm.running_mean.copy_(torch.from_numpy(mean.reshape(-1).astype(np.float32)))
        norm.running_var.copy_(torch.from_numpy((std.reshape(-1).astype(np.float32)) ** 2 - 1e-12))
    layers: list[nn.Module] = [nn.Flatten(), norm]
    if len(sample_shape) > 1:
        layers.append(nn.Unflatten(1, tuple(int(d) for d in sample_shape)))
    return nn.Sequential(*layers, model).eval()


def with_target_scale(model: torch.nn.Module, mean: float, std: float) -> torch.nn.Module:
    """``model`` (one standardised output) followed by ``y * std + mean``: predictions in the
    target's units, as a plain ``nn.Linear`` that ``mlflow models serve`` loads without this
    project's code."""
    import torch
    from torch import nn

    scale = nn.Linear(1, 1)
    with torch.no_grad():
        scale.weight.fill_(std)
        scale.bias.fill_(mean)
    return nn.Sequential(model, scale).eval()


def taking_float64(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` behind a cast of its float64 input to float32.

    A tabular model is logged this way: MLflow reads a CSV (``mlflow models predict -t csv``)
    as float64 and checks it against the tensor signature without casting, and pt2, the only
    format loaded here, takes only tensor signatures. torch.export traces the cast into the
    graph, so the logged model needs none of this project's code.
    """
    from torch import nn

    class AsFloat32(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.float()

    return nn.Sequential(AsFloat32(), model).eval()
