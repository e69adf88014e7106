"""The canary step of serving: the new version answers a share of the requests next to the
serving one for a window, then takes them all or is rolled back, moving the alias back."""

from __future__ import annotations

import datetime
from typing import Any

from prefect import get_run_logger
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from pydantic import BaseModel
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from prefect_ml.integrations import services, serving, tracking
from prefect_ml.integrations.config.serving import CanaryPolicy
from prefect_ml.integrations.errors import ConfigurationError, DeploymentError

__all__ = ["CanaryReport", "publish_canary", "record_verdict", "run_canary"]

LOAD_TIMEOUT_S = 300.0  # every replica downloads and loads the canary next to its own model


class CanaryReport(BaseModel):
    """What a canary rollout measured and decided."""

    model_name: str
    stable_version: str
    stable_run_id: str
    canary_version: str
    share: float
    promoted: bool
    reason: str
    comparison: list[dict[str, Any]]  # one row per version: requests, errors, latency, metric


def _row(role: str, version: str, stats: serving.VersionStats, task: str) -> dict[str, Any]:
    metric = stats.metric(task)
    return {
        "version": f"v{version} ({role})",
        "requests": stats.requests,
        "errors": stats.errors,
        "error rate": f"{stats.error_rate:.2%}",
        **{f"p{q} ms": f"{stats.latency_ms(q / 100):.1f}" for q in (50, 95, 99)},
        f"{serving.metric_name(task)} (labelled)": "" if metric is None else f"{metric:.4f}",
        "labelled rows": stats.labelled,
    }


def _check_comparable(stable: serving.ServedModel, candidate: serving.ServedModel) -> None:
    if stable.io_schema() != candidate.io_schema():
        raise ConfigurationError(
            "serving.canary_share",
            f"{candidate.uri} takes other inputs or answers otherwise than {stable.uri}, which "
            "the application serves; a canary shares its endpoint, so roll without one "
            "(--canary-share 0) or serve it as another application (--app-name)",
        )


def run_canary(
    stable: serving.ServedModel,
    candidate: serving.ServedModel,
    policy: CanaryPolicy,
    app_name: str,
) -> CanaryReport:
    """Give ``candidate`` the policy's share of ``app_name``'s requests for its window and judge
    it against ``stable``; only measures and decides (the caller rolls or not)."""
    logger = get_run_logger()
    _check_comparable(stable, candidate)
    rollout = serving.Rollout(app_name, candidate.model_dump(), policy.share)
    try:
        rollout.wait_loaded(lambda: serving.running_replicas(app_name), LOAD_TIMEOUT_S)
        logger.info(
            "Canary v%s answers %.0f%% of %s's requests next to v%s for %g s",
            candidate.version,
            policy.share * 100,
            app_name,
            stable.version,
            policy.window_s,
        )
        verdict, stable_stats, canary_stats = _measure(rollout, policy, candidate.task)
    except DeploymentError as exc:
        verdict = serving.Verdict(False, str(exc))
        stable_stats = canary_stats = serving.VersionStats()
    finally:
        rollout.close()
    task = candidate.task
    return CanaryReport(
        model_name=candidate.name,
        stable_version=stable.version,
        stable_run_id=stable.run_id,
        canary_version=candidate.version,
        share=policy.share,
        promoted=verdict.promote,
        reason=verdict.reason,
        comparison=[
            _row("serving", stable.version, stable_stats, task),
            _row("canary", candidate.version, canary_stats, task),
        ],
    )


def _measure(
    rollout: serving.Rollout, policy: CanaryPolicy, task: str
) -> tuple[serving.Verdict, serving.VersionStats, serving.VersionStats]:
    progress = Progress(
        TextColumn("[bold]canary"),
        BarColumn(),
        TextColumn("{task.fields[counts]}"),
        TimeElapsedColumn(),
    )
    bar = progress.add_task("window", total=policy.window_s, counts="")

    def show(elapsed: float, stable: serving.VersionStats, candidate: serving.VersionStats) -> None:
        counts = (
            f"canary {candidate.requests} req / {candidate.errors} err, "
            f"serving {stable.requests} req / {stable.errors} err"
        )
        progress.update(bar, completed=elapsed, counts=counts)

    with progress:
        return rollout.measure(policy, task, show)


def canary_markdown(report: CanaryReport) -> str:
    verdict = "promoted to 100%" if report.promoted else "rolled back"
    header = list(report.comparison[0])
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(str(row[c]) for c in header) + " |" for row in report.comparison]
    table = "\n".join(lines)
    return f"""# Canary `{report.model_name}` v{report.canary_version}: {verdict}

v{report.canary_version} answered {report.share:.0%} of the requests next to
v{report.stable_version}. **{report.reason}**.

{table}

A request the canary failed was answered by v{report.stable_version} and counted as the
canary's error.
"""


def publish_canary(report: CanaryReport) -> None:
    create_markdown_artifact(canary_markdown(report), key="canary", description="Canary rollout")
    create_table_artifact(report.comparison, key="canary-comparison", description="Canary")


def record_verdict(report: CanaryReport, alias: str | None, tracking_uri: str) -> None:
    """Tag the canary's version with the verdict; on a rollback, move ``alias`` back to the
    serving version if it still points at the canary (a person may have moved it since)."""
    client = tracking.client_for(tracking_uri)
    name, version = report.model_name, report.canary_version
    verdict = "promoted" if report.promoted else "rolled back"
    now = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    tracking.tag_version(
        client, name, version, {tracking.CANARY_TAG: f"{verdict} at {now}: {report.reason}"}
    )
    if report.promoted or alias is None:
        return
    holder = tracking.champion(client, name, alias)
    if holder is not None and holder[0] == version:
        tracking.set_alias(client, name, alias, report.stable_version)
        services.announce_promotion(  # the champion changed back: the alert automation tells
            model=name,
            version=report.stable_version,
            previous_version=version,
            alias=alias,
            reason=f"canary v{version} rolled back: {report.reason}",
            run_id=report.stable_run_id,
        )
        get_run_logger().warning(
            "Canary v%s rolled back (%s); @%s is back on v%s",
            version,
            report.reason,
            alias,
            report.stable_version,
        )
