"""What a replica is constructed with and what it holds: the serving section and the token's
digest, and each model version it has loaded, with the batcher its requests share."""

from __future__ import annotations

import hashlib
from typing import Any, NamedTuple

import numpy as np
from pydantic import BaseModel

from prefect_ml.integrations.config import ServingParams
from prefect_ml.integrations.serving._batching import AdaptiveBatcher
from prefect_ml.integrations.serving._inference import Predictor
from prefect_ml.integrations.serving._models import ServedModel, load_predictor


class ReplicaOptions(BaseModel):
    """What every replica is constructed with: the serving section as the flow parameters hold
    it (request limits, batching, its resources and device), and the bearer token's digest."""

    serving: ServingParams
    token_sha256: str | None

    @property
    def torch_threads(self) -> int:
        """The whole CPUs the replica reserved, at least one."""
        return max(1, int(self.serving.replica_cpus))


def token_digest(token: str) -> str:
    """Replicas hold the token's digest, never the token: Ray's state shows constructor args."""
    return hashlib.sha256(token.encode()).hexdigest()


class LoadedVersion(NamedTuple):
    """A model version in a replica's memory, ready to answer."""

    predictor: Predictor
    served: ServedModel
    identity: dict[str, Any]
    input_example: list[list[float]]


def load_version(served: ServedModel, limits: ServingParams) -> LoadedVersion:
    """Download ``served`` and load it (pt2 only) on the device the replica reserved; a
    pickle-format version fails the replica here, and the old one serves on."""
    from mlflow.models import Model

    predictor, local = load_predictor(served, limits.replica_gpus, limits.inference_precision)
    example = Model.load(local).load_input_example(local)
    rows = np.asarray(example).reshape(-1, served.width)[:2].tolist()
    return LoadedVersion(predictor, served, served.identity(), rows)


class Pinned(NamedTuple):
    """A version a request selected, loaded in a replica next to the serving one, and the
    batcher its requests share."""

    version: LoadedVersion
    batcher: AdaptiveBatcher[np.ndarray, np.ndarray]


def batched_outputs(version: LoadedVersion | None, matrices: list[np.ndarray]) -> list[np.ndarray]:
    if version is None:
        raise RuntimeError("the canary was dropped while its batch waited")
    outputs = version.predictor.outputs(np.concatenate(matrices))
    return np.split(outputs, np.cumsum([len(m) for m in matrices])[:-1])
