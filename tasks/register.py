"""The registry step: log the model, register a version, move the alias only if it is better."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Literal

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel, ValidationError

from prefect_ml.integrations import storage, tracking
from prefect_ml.integrations.catalog import with_standardizer
from prefect_ml.integrations.errors import ConfigurationError
from prefect_ml.integrations.settings import get_settings
from prefect_ml.tasks.evaluate import METRIC_DIRECTIONS, Evaluation
from prefect_ml.tasks.params import RegistryParams
from prefect_ml.tasks.report import publish_summary_artifacts
from prefect_ml.tasks.train import TrainResult, current_flow_run_id, trained_model

__all__ = ["Registration", "register"]

INPUT_EXAMPLE_ROWS = 5


class Registration(BaseModel):
    """What :func:`register` returns: the registered version and the alias decision.

    Attributes:
        model_name: the registered model's name in the registry (with the tenant's prefix).
        version, model_uri: the new version, ``models:/<name>/<version>``.
        alias: the alias it was compared for; ``promoted``: whether it took it, and why
            (``reason``); ``previous_champion``: the version that held it before, if any.
    """

    model_name: str
    version: str
    model_uri: str
    alias: str
    promoted: bool
    reason: str
    previous_champion: str | None


def promotion_rules(
    model_name: str,
    alias: str,
    promote_if: Mapping[str, float],
    directions: Mapping[str, Literal["maximize", "minimize"]],
) -> list[RegistryParams]:
    """One checked rule per metric of ``promote_if`` (test metric -> minimum improvement), each
    in its direction: ``directions``' or the metric's own (:data:`METRIC_DIRECTIONS`)."""
    if not promote_if:
        raise ConfigurationError(
            "promote_if", "name at least one test metric, e.g. {'accuracy': 0}"
        )
    if stray := sorted(set(directions) - set(promote_if)):
        raise ConfigurationError("directions", f"{stray} are not metrics of promote_if")
    rules = []
    for metric, min_delta in promote_if.items():
        try:
            rules.append(
                RegistryParams(
                    model_name=model_name,
                    alias=alias,
                    metric=metric,  # type: ignore[arg-type]
                    direction=directions.get(metric) or METRIC_DIRECTIONS.get(metric, "maximize"),  # type: ignore[arg-type]
                    min_delta=min_delta,
                )
            )
        except ValidationError as exc:
            error = exc.errors()[0]
            name = str(error["loc"][0]) if error["loc"] else ""
            field = {
                "metric": "promote_if",
                "min_delta": f"promote_if[{metric!r}]",
                "direction": f"directions[{metric!r}]",
            }.get(name, name)
            raise ConfigurationError(field, error["msg"]) from None
    return rules


def decide(
    evaluation: Evaluation,
    rules: list[RegistryParams],
    champion_metrics: Mapping[str, float],
    champion_version: str | None,
) -> tracking.PromotionDecision:
    """Promote when every rule holds against the champion's ``test_*`` metrics (or there is
    no champion); the reason lists each rule's verdict."""
    decisions = [
        tracking.decide_promotion(
            evaluation.metrics[rule.metric],
            champion_metrics.get(f"test_{rule.metric}"),
            metric=f"test_{rule.metric}",
            direction=rule.direction,
            min_delta=rule.min_delta,
            champion_version=champion_version,
        )
        for rule in rules
    ]
    return tracking.PromotionDecision(
        promoted=all(d.promoted for d in decisions),
        reason="; ".join(d.reason for d in decisions),
        previous_version=champion_version,
        previous_value=decisions[0].previous_value,
    )


def register_model(
    trained: TrainResult, evaluation: Evaluation, rules: list[RegistryParams]
) -> Registration:
    """Register the trained model (raw features in, logits out) and move the alias to it only
    if it beats the alias's current version on every rule's metric.

    The logged model includes the training split's standardisation, so it takes the same raw
    features as the source data: ``mlflow models serve -m models:/<name>@champion`` serves it as is.
    """
    logger = get_run_logger()
    settings = get_settings()
    data = trained.data
    registry = rules[0]  # every rule names the same model and alias
    client = tracking.client_for(settings.resolved_tracking_uri)
    model = trained_model(trained)
    mean = storage.read_array(storage.join(data.splits_url, "mean.npy"))
    std = storage.read_array(storage.join(data.splits_url, "std.npy"))
    test_rows = storage.read_array_rows(
        storage.join(data.splits_url, "test_features.npy"), 0, INPUT_EXAMPLE_ROWS
    )
    raw_example = (test_rows * std + mean).astype("float32")

    current = tracking.champion(client, registry.model_name, registry.alias)
    champion_metrics = tracking.run_metrics(client, current[1]) if current is not None else {}
    decision = decide(evaluation, rules, champion_metrics, current[0] if current else None)
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
            **{f"test_{r.metric}": f"{evaluation.metrics[r.metric]:.6f}" for r in rules},
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
        "%s v%s %s to @%s: %s", model_name, version, verdict, registry.alias, decision.reason
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
    trained: TrainResult,
    evaluation: Evaluation,
    *,
    model_name: str,
    alias: str = "champion",
    promote_if: Mapping[str, float] | None = None,
    directions: Mapping[str, Literal["maximize", "minimize"]] | None = None,
) -> Registration:
    """Register a trained run's model in MLflow and give it the alias only if it is better.

    The new version takes ``alias`` when no version holds it yet, or when it beats that version
    on every metric of ``promote_if`` by at least the given amount. The decision and its reason
    are tagged on the version and the run, and a summary (markdown, metrics table, links) is
    published as artifacts of the flow run.

    Args:
        trained: what :func:`~prefect_ml.train` returned.
        evaluation: what :func:`~prefect_ml.evaluate` returned for it.
        model_name: the registered model's name.
        alias: the alias it competes for.
        promote_if: test metric -> minimum improvement, e.g. ``{"macro_f1": 0.01}``; by
            default ``{"accuracy": 0.0}`` (any improvement).
        directions: ``"maximize"`` or ``"minimize"`` per metric, where not the metric's own
            (accuracy and macro_f1 are maximised, loss minimised).

    Raises:
        ConfigurationError: an unknown metric, a negative improvement or an empty name, before
            anything is registered.
    """
    rules = promotion_rules(model_name, alias, promote_if or {"accuracy": 0.0}, directions or {})
    registration = register_model(trained, evaluation, rules)
    publish_summary_artifacts(trained, evaluation, registration)
    return registration
