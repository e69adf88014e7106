"""The registry step: log the model, register a version, move the alias only if it is better,
and publish the training summary a person reads (markdown, metrics table, links)."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prefect import get_run_logger, task
from prefect.artifacts import create_link_artifact, create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel

from prefect_ml.integrations import problems, services, storage, tracking, training
from prefect_ml.integrations.datasets import taking_float64, with_standardizer, with_target_scale
from prefect_ml.integrations.errors import ConfigurationError
from prefect_ml.integrations.problems import Direction
from prefect_ml.integrations.settings import get_settings
from prefect_ml.tasks.evaluate import Evaluation
from prefect_ml.tasks.train import TrainResult, trained_model
from prefect_ml.tasks.training import current_flow_run_id

if TYPE_CHECKING:
    import numpy as np

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


@dataclass(frozen=True)
class PromotionRule:
    """The new version must beat the champion's ``test_<metric>`` by ``min_delta``."""

    metric: str
    direction: Direction
    min_delta: float


def promotion_rules(
    problem: problems.Problem,
    promote_if: Mapping[str, float],
    directions: Mapping[str, str],
) -> list[PromotionRule]:
    """One checked rule per metric of ``promote_if`` (test metric -> minimum improvement), each
    in its direction: ``directions``' or the metric's own.

    Raises:
        ConfigurationError: a metric the task type does not produce, an improvement below 0,
            a direction other than maximize/minimize.
    """
    if not promote_if:
        raise ConfigurationError(
            "promote_if", "name at least one test metric, e.g. {'accuracy': 0}"
        )
    if stray := sorted(set(directions) - set(promote_if)):
        raise ConfigurationError("directions", f"{stray} are not metrics of promote_if")
    rules = []
    for metric, min_delta in promote_if.items():
        if metric not in problem.test_metrics:
            raise ConfigurationError(
                "promote_if",
                f"{problem.name} produces no test metric {metric!r}; use one of "
                f"{list(problem.test_metrics)}",
            )
        if not (isinstance(min_delta, int | float) and math.isfinite(min_delta) and min_delta >= 0):
            raise ConfigurationError(
                f"promote_if[{metric!r}]",
                f"the improvement must be a number >= 0, not {min_delta!r}",
            )
        direction = directions.get(metric, problem.test_metrics[metric])
        if direction not in ("maximize", "minimize"):
            raise ConfigurationError(
                f"directions[{metric!r}]", f"{direction!r} is neither 'maximize' nor 'minimize'"
            )
        rules.append(PromotionRule(metric, direction, float(min_delta)))  # type: ignore[arg-type]
    return rules


def decide(
    evaluation: Evaluation,
    rules: list[PromotionRule],
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
    trained: TrainResult,
    evaluation: Evaluation,
    *,
    model_name: str,
    alias: str,
    rules: list[PromotionRule],
) -> Registration:
    """Register the trained model (raw features in; logits out, or for regression predictions
    in the target's units) and move the alias to it only if it beats the alias's current
    version on every rule's metric.

    The logged model includes the training split's standardisation, so it takes the same raw
    features as the source data: ``mlflow models serve -m models:/<name>@champion`` serves it as is.
    """
    logger = get_run_logger()
    settings = get_settings()
    client = tracking.client_for(settings.resolved_tracking_uri)
    served, raw_example, input_dtype = _served_model(trained)

    current = tracking.champion(client, model_name, alias)
    champion_metrics = tracking.run_metrics(client, current[1]) if current is not None else {}
    decision = decide(evaluation, rules, champion_metrics, current[0] if current else None)
    version = tracking.log_and_register_model(
        client,
        settings.resolved_tracking_uri,
        trained.run_id,
        served,
        raw_example,
        model_name=model_name,
        tags=_version_tags(trained, evaluation, rules, input_dtype),
    )
    verdict = _record_decision(client, trained.run_id, model_name, alias, version, decision)
    registered_name = tracking.in_namespace(model_name)  # what the registry calls it
    logger.info("%s v%s %s to @%s: %s", registered_name, version, verdict, alias, decision.reason)
    if decision.promoted:  # the champion changed: the alert automation listens for this
        services.announce_promotion(
            model=registered_name,
            version=version,
            previous_version=decision.previous_version,
            alias=alias,
            reason=decision.reason,
            run_id=trained.run_id,
        )
    return Registration(
        model_name=registered_name,
        version=version,
        model_uri=f"models:/{registered_name}/{version}",
        alias=alias,
        promoted=decision.promoted,
        reason=decision.reason,
        previous_champion=decision.previous_version,
    )


def _served_model(trained: TrainResult) -> tuple[Any, np.ndarray, str]:
    """The model as it is logged, taking the source data's raw features (the training split's
    standardisation inside, a regression's predictions in the target's units), an input example
    of those features, and their dtype."""
    data = trained.data
    model = trained_model(trained)
    mean = storage.read_array(storage.statistic_url(data.splits_url, "mean"))
    std = storage.read_array(storage.statistic_url(data.splits_url, "std"))
    test_rows, _ = data.shard("test").head(INPUT_EXAMPLE_ROWS)
    raw_example = (test_rows * std + mean).astype("float32")
    # A model's own predict_step (Lightning's) is what serving and batch scoring run.
    served = with_standardizer(training.served_module(model), mean, std, data.sample_shape)
    if data.task == "regression":
        served = with_target_scale(served, data.target_mean, data.target_std)
    if data.feature_names:  # tabular: rows read from a CSV are float64
        return taking_float64(served), raw_example.astype("float64"), "float64"
    return served, raw_example, "float32"


def _version_tags(
    trained: TrainResult, evaluation: Evaluation, rules: list[PromotionRule], input_dtype: str
) -> dict[str, str]:
    """What a version carries so serving and lineage need no other record: its data (fingerprint,
    task, input dtype and shape, class and feature names), its runs, its tested metrics."""
    data = trained.data
    return {
        tracking.FINGERPRINT_TAG: data.fingerprint,
        tracking.TASK_TAG: data.task,
        tracking.INPUT_DTYPE_TAG: input_dtype,
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
    }


def _record_decision(
    client: Any,
    run_id: str,
    model_name: str,
    alias: str,
    version: str,
    decision: tracking.PromotionDecision,
) -> str:
    """Move the alias if promoted, tag the version and the training run with the decision, and
    finish the run; the verdict ("promoted" or "not promoted")."""
    if decision.promoted:
        tracking.set_alias(client, model_name, alias, version)
    verdict = "promoted" if decision.promoted else "not promoted"
    decision_tags = {"promotion.decision": verdict, "promotion.reason": decision.reason}
    tracking.tag_version(client, model_name, version, decision_tags)
    registered_tag = {tracking.REGISTERED_VERSION_TAG: version}
    tracking.set_tags(client, run_id, {**decision_tags, **registered_tag})
    tracking.record_flow_run(client, run_id, current_flow_run_id(), "register")
    tracking.finish_run(client, run_id)
    return verdict


def summary_markdown(
    trained: TrainResult,
    evaluation: Evaluation,
    registration: Registration,
    run_link: str,
    version_link: str,
) -> str:
    metric_rows = (
        "\n".join(f"| test {name} | {value:.4f} |" for name, value in evaluation.metrics.items())
        + "\n"
        + "\n".join(
            f"| last epoch {name} | {value:.4f} |" for name, value in trained.epoch_metrics.items()
        )
    )
    resumed = (
        f"resumed from epoch {trained.resumed_from_epoch}"
        if trained.resumed_from_epoch
        else "from scratch"
    )
    if trained.early_stopped:
        resumed += f"; early stopping ended it at {trained.early_stopped}"
    outcome_notes = "".join(
        f"\n- **{label}**: {text}" for label, text in training_notes(trained, registration)
    )
    verdict = "**promoted**" if registration.promoted else "**not promoted**"
    if trained.reused:
        verdict = "**reused**"
    data = trained.data
    layout_note = (
        "Parquet shards streamed by the workers"
        if data.layout == "parquet"
        else "arrays each worker reads whole"
    )
    return f"""# Training summary

| metric | value |
|---|---|
{metric_rows}

- **Data**: fingerprint `{data.fingerprint}`, rows {data.rows}, splits at `{data.splits_url}`
  ({data.layout}: {layout_note})
- **Training**: {trained.final_epoch} epochs ({resumed}), checkpoints at `{trained.checkpoint_url}`
- **MLflow run**: [{trained.run_id}]({run_link})
- **Model**: [`{registration.model_uri}`]({version_link})
- **Alias `{registration.alias}`**: {verdict} — {registration.reason}{outcome_notes}
"""


def training_notes(trained: TrainResult, registration: Registration) -> list[tuple[str, str]]:
    """What a summary adds about early stopping and reuse, as (label, text) lines."""
    notes = [("Evaluated epoch", f"{trained.best_epoch} (its checkpoint is the registered model)")]
    if trained.reused:
        notes.append(
            (
                "Reused",
                f"MLflow run {trained.run_id} and {registration.model_name} "
                f"v{registration.version} were already trained and registered for this identity; "
                "nothing was trained again (--force trains a new run)",
            )
        )
    return notes


def publish_summary_artifacts(
    trained: TrainResult, evaluation: Evaluation, registration: Registration
) -> None:
    """Markdown summary, a metrics table and a link to the MLflow run on the current flow run."""
    settings = get_settings()
    uri = settings.resolved_tracking_uri
    run_link = tracking.run_url(uri, trained.experiment_id, trained.run_id)
    version_link = tracking.model_version_url(uri, registration.model_name, registration.version)
    create_markdown_artifact(
        summary_markdown(trained, evaluation, registration, run_link, version_link),
        key="training-summary",
        description=f"{registration.model_name} v{registration.version}",
    )
    create_table_artifact(
        [
            {"metric": f"test_{name}", "value": round(value, 6)}
            for name, value in evaluation.metrics.items()
        ]
        + [
            {"metric": "model_version", "value": registration.version},
            {"metric": "promoted", "value": str(registration.promoted)},
        ],
        key="test-metrics",
        description="Held-out test metrics and the registry decision",
    )
    create_link_artifact(run_link, link_text=f"MLflow run {trained.run_id}", key="mlflow-run")
    create_link_artifact(
        version_link,
        link_text=f"{registration.model_name} v{registration.version} in the MLflow registry",
        key="registered-model",
    )


@task(name="register", cache_policy=NO_CACHE)
def register(
    trained: TrainResult,
    evaluation: Evaluation,
    *,
    model_name: str,
    alias: str = "champion",
    promote_if: Mapping[str, float] | None = None,
    directions: Mapping[str, Direction] | None = None,
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
            default the task's metric with any improvement (``{"accuracy": 0.0}``, for
            regression ``{"rmse": 0.0}``).
        directions: ``"maximize"`` or ``"minimize"`` per metric, where not the metric's own
            (loss, rmse and mae are minimised, the others maximised).

    Raises:
        ConfigurationError: a metric the task does not produce, a negative improvement or an
            empty name, before anything is registered.
    """
    for field, name in (("model_name", model_name), ("alias", alias)):
        if not name:
            raise ConfigurationError(field, "must not be empty")
    problem = trained.data.problem
    rules = promotion_rules(problem, promote_if or {problem.promotion: 0.0}, directions or {})
    registration = register_model(
        trained, evaluation, model_name=model_name, alias=alias, rules=rules
    )
    publish_summary_artifacts(trained, evaluation, registration)
    return registration
