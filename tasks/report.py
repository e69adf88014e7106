"""What a person sees of a flow run: a markdown summary, a metrics table and links as artifacts."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prefect.artifacts import create_link_artifact, create_markdown_artifact, create_table_artifact

from prefect_ml.integrations import timeline, tracking
from prefect_ml.integrations.settings import get_settings

if TYPE_CHECKING:  # the registry step publishes these; they name its types
    from prefect_ml.tasks.evaluate import Evaluation
    from prefect_ml.tasks.register import Registration
    from prefect_ml.tasks.train import TrainResult


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


def timeline_markdown(recorded: timeline.Timeline, flow_name: str) -> str:
    """The timeline as a table with a bar per step: where the run's wall time went."""
    rows = recorded.rows()
    longest = max((took for _name, _at, took in rows), default=0.0) or 1.0
    lines = [
        f"# Timeline of {flow_name}",
        "",
        "Seconds since the process started (interpreter start-up and imports included).",
        "",
        "| moment | at (s) | since the previous (s) | |",
        "|---|---:|---:|---|",
    ]
    for name, at, took in rows:
        bar = "█" * max(1, round(24 * took / longest)) if took >= 0.05 else ""
        lines.append(f"| {name} | {at:.1f} | {took:.1f} | {bar} |")
    return "\n".join(lines) + "\n"


@contextlib.contextmanager
def published_timeline(flow_name: str) -> Iterator[None]:
    """Record the moments of a flow run's body and publish them as its ``timeline`` artifact,
    also when the run fails."""
    with timeline.recording("flow run started (Prefect API ready)") as recorded:
        try:
            yield
        finally:
            timeline.mark("flow run ends")
            create_markdown_artifact(
                timeline_markdown(recorded, flow_name),
                key="timeline",
                description=f"Where {flow_name}'s time went",
            )
