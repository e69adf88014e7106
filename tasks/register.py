"""The registry step: log the model, register a version, move the alias only if it is better."""

from __future__ import annotations

import json

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel

from integrations import storage, tracking
from integrations.catalog import with_standardizer
from integrations.settings import get_settings
from tasks.data import PreparedData
from tasks.evaluate import Evaluation
from tasks.params import TrainModelParams
from tasks.train import TrainResult, current_flow_run_id, trained_model

INPUT_EXAMPLE_ROWS = 5


class Registration(BaseModel):
    """The registered version and the alias decision, with its reason."""

    model_name: str
    version: str
    model_uri: str
    alias: str
    promoted: bool
    reason: str
    previous_champion: str | None


def register_model(
    params: TrainModelParams, data: PreparedData, trained: TrainResult, evaluation: Evaluation
) -> Registration:
    """Register the trained model (raw features in, logits out) and decide on the alias.

    The logged model includes the training split's standardisation, so it takes the same raw
    features as the source data: ``mlflow models serve -m models:/<name>@champion`` serves it as is.
    """
    logger = get_run_logger()
    settings = get_settings()
    registry = params.registry
    client = tracking.client_for(settings.resolved_tracking_uri)
    model = trained_model(params, data, trained)
    mean = storage.read_array(storage.join(data.splits_url, "mean.npy"))
    std = storage.read_array(storage.join(data.splits_url, "std.npy"))
    test_rows = storage.read_array_rows(
        storage.join(data.splits_url, "test_features.npy"), 0, INPUT_EXAMPLE_ROWS
    )
    raw_example = (test_rows * std + mean).astype("float32")

    current = tracking.champion(client, registry.model_name, registry.alias)
    champion_value = None
    if current is not None:
        champion_value = tracking.run_metrics(client, current[1]).get(f"test_{registry.metric}")
    new_value = evaluation.metrics[registry.metric]
    decision = tracking.decide_promotion(
        new_value,
        champion_value,
        metric=f"test_{registry.metric}",
        direction=registry.direction,
        min_delta=registry.min_delta,
        champion_version=current[0] if current else None,
    )
    version = tracking.log_and_register_model(
        client,
        settings.resolved_tracking_uri,
        trained.run_id,
        with_standardizer(model, mean, std, data.sample_shape),
        raw_example,
        model_name=registry.model_name,
        tags={
            tracking.FINGERPRINT_TAG: data.fingerprint,
            tracking.SAMPLE_SHAPE_TAG: json.dumps(data.sample_shape),
            tracking.CLASS_NAMES_TAG: json.dumps(data.class_names),
            **(
                {tracking.FEATURE_NAMES_TAG: json.dumps(data.feature_names)}
                if data.feature_names
                else {}
            ),
            tracking.SOURCE_RUN_TAG: trained.run_id,
            tracking.FLOW_RUN_TAG: current_flow_run_id(),
            f"test_{registry.metric}": f"{new_value:.6f}",
        },
    )
    if decision.promoted:
        tracking.set_alias(client, registry.model_name, registry.alias, version)
    verdict = "promoted" if decision.promoted else "not promoted"
    decision_tags = {"promotion.decision": verdict, "promotion.reason": decision.reason}
    tracking.tag_version(client, registry.model_name, version, decision_tags)
    tracking.set_tags(client, trained.run_id, {**decision_tags, "registered_version": version})
    tracking.finish_run(client, trained.run_id)
    model_name = tracking.in_namespace(registry.model_name)  # what the registry calls it
    logger.info(
        "%s v%s %s to @%s: %s",
        model_name,
        version,
        verdict,
        registry.alias,
        decision.reason,
    )
    return Registration(
        model_name=model_name,
        version=version,
        model_uri=f"models:/{model_name}/{version}",
        alias=registry.alias,
        promoted=decision.promoted,
        reason=decision.reason,
        previous_champion=decision.previous_version,
    )


@task(name="register", cache_policy=NO_CACHE)
def register(
    params: TrainModelParams, data: PreparedData, trained: TrainResult, evaluation: Evaluation
) -> Registration:
    return register_model(params, data, trained, evaluation)
