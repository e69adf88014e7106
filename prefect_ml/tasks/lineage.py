"""Lineage of a registered version, read back from MLflow: data -> preprocessing -> flow runs
-> training run -> checkpoint -> version -> where it is served, each with a link."""

from __future__ import annotations

import json
import os
import re
from typing import TYPE_CHECKING

from pydantic import BaseModel

from prefect_ml.integrations import services, tracking
from prefect_ml.integrations.errors import ConfigurationError
from prefect_ml.integrations.settings import get_settings

__all__ = ["Lineage", "LineageStep", "parse_reference", "trace"]

if TYPE_CHECKING:
    from mlflow.entities import Run

REFERENCE = re.compile(r"^(?P<name>[^@/]+)(?:@(?P<alias>[^@/]+)|/(?P<version>\d+))?$")


class LineageStep(BaseModel):
    """One link of the chain: its stage, what it is, and where to open it (if anywhere)."""

    stage: str
    what: str
    link: str | None = None


class Lineage(BaseModel):
    model_name: str
    version: str
    steps: list[LineageStep]


def parse_reference(reference: str) -> tuple[str, str, str | None]:
    """``name@alias``, ``name/version`` or ``name`` (its @champion) -> (name, alias, version)."""
    match = REFERENCE.match(reference)
    if match is None:
        raise ConfigurationError("model", f"{reference!r} is not NAME@ALIAS, NAME/VERSION or NAME")
    return match["name"], match["alias"] or "champion", match["version"]


def _flow_run_link(flow_run_id: str) -> str | None:
    api_url = os.environ.get("PREFECT_API_URL")
    return f"{services.ui_url(api_url)}/runs/flow-run/{flow_run_id}" if api_url else None


def trace(reference: str) -> Lineage:
    """The chain behind the version ``reference`` names; a clear error if there is none."""
    name, alias, number = parse_reference(reference)
    tracking_uri = get_settings().resolved_tracking_uri
    client = tracking.client_for(tracking_uri)
    version = tracking.registered_version(client, name, alias=alias, version=number)
    run = client.get_run(str(version.run_id))
    steps = [*_data_steps(run), *_run_steps(run, tracking_uri)]
    aliases = ", ".join(f"@{a}" for a in version.aliases) or "no alias"
    decision = version.tags.get("promotion.reason", "")
    steps.append(
        LineageStep(
            stage="model version",
            what=f"{version.name} v{version.version} ({aliases}); {decision}".rstrip("; "),
            link=tracking.model_version_url(tracking_uri, str(version.name), str(version.version)),
        )
    )
    if canary := version.tags.get(tracking.CANARY_TAG):
        steps.append(LineageStep(stage="canary", what=canary))
    for app_name, record in sorted(tracking.serving_records(version).items()):
        period = f"since {record.get('since', '?')}"
        if "until" in record:
            period += f" until {record['until']}"
        steps.append(
            LineageStep(
                stage="serving", what=f"application {app_name!r} {period}", link=record["url"]
            )
        )
    return Lineage(model_name=str(version.name), version=str(version.version), steps=steps)


def _data_steps(run: Run) -> list[LineageStep]:
    tags, params = run.data.tags, run.data.params
    steps = []
    for dataset_input in run.inputs.dataset_inputs if run.inputs else []:
        dataset = dataset_input.dataset
        source = json.loads(dataset.source).get("url", dataset.source)
        profile = json.loads(dataset.profile) if dataset.profile else {}
        rows = ", ".join(f"{k} {v}" for k, v in profile.get("rows", {}).items())
        steps.append(
            LineageStep(
                stage="data",
                what=f"{dataset.name} (digest {dataset.digest}) from {source}",
                link=source if "://" in source else None,
            )
        )
        if rows:
            steps.append(
                LineageStep(
                    stage="preprocess",
                    what=f"splits {rows}; fingerprint {tags.get(tracking.FINGERPRINT_TAG, '?')}",
                    link=tags.get(tracking.SPLITS_TAG),
                )
            )
    if not steps:  # a run logged before datasets were inputs: its parameters say what it used
        source = params.get("data.url") or params.get("data.dataset", "?")
        fingerprint = tags.get(tracking.FINGERPRINT_TAG, "?")
        steps.append(LineageStep(stage="data", what=f"{source}; fingerprint {fingerprint}"))
    return steps


def _run_steps(run: Run, tracking_uri: str) -> list[LineageStep]:
    info, tags = run.info, run.data.tags
    steps = [
        LineageStep(
            stage="flow run",
            what=f"{flow_run_id} ({step} at {when})",
            link=_flow_run_link(flow_run_id),
        )
        for when, flow_run_id, step in tracking.flow_runs(tags)
    ]
    steps.append(
        LineageStep(
            stage="training run",
            what=f"{info.run_name} ({info.run_id}, {info.status})",
            link=tracking.run_url(tracking_uri, info.experiment_id, info.run_id),
        )
    )
    if checkpoint := tags.get("checkpoint.latest"):
        steps.append(
            LineageStep(stage="checkpoint", what="last verified checkpoint", link=checkpoint)
        )
    return steps
